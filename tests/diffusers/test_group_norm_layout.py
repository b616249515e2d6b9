"""GroupNorm after diffusers' attention residual, in a graph compiled for the simulated tpu device, as torch_tpu 0.2.0.

The residual of a 4-D ``Attention`` (the VAE's and ``UNet2DModel``'s mid-block) is a channels-last view, and the next
ResNet's GroupNorm gets it. torch_tpu 0.2.0 runs torch's ``math_group_norm`` there, whose ``view`` refuses it while the
compiled graph is lowered (tests/contract/test_group_norm_layout.py: the same tiny VAE through the wheel); the
simulator refuses it inside a compiled graph with the wheel's words. hf_tpu's decomposition (:mod:`hf_tpu._group_norm`,
added by the diffusers integration and by ``compile_pipeline``) traces GroupNorm with a contiguous input instead.
"""

from __future__ import annotations

import pytest
import torch

import hf_tpu
from hf_tpu import _group_norm

#: A tiny SD3-shaped VAE (16 latent channels, no quant convs), as tests/contract/_tpu_compile_entries.py builds it.
TINY_SD3_VAE = dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=[32, 64], layers_per_block=1,
                    down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
                    norm_num_groups=32, use_quant_conv=False, use_post_quant_conv=False, sample_size=32)  # fmt: skip


@pytest.fixture
def vae_and_reference(sim):
    from diffusers import AutoencoderKL

    torch._dynamo.reset()
    # compile_pipeline adds the decomposition for as long as the process lives (its graphs compile at their first
    # call), under the diffusers integration: start from upstream's state whatever ran before in this process
    hf_tpu.disable("diffusers")
    torch.manual_seed(0)
    vae = AutoencoderKL(**TINY_SD3_VAE).eval()
    z = torch.randn(1, 16, 8, 8)
    with torch.no_grad():
        reference = vae.decode(z).sample
    yield vae.to("tpu"), z.to("tpu"), reference
    torch._dynamo.reset()


def _decode_compiled(vae, z):
    vae.decoder.compile(backend="tpu", fullgraph=True, dynamic=False)
    try:
        with torch.no_grad():
            return vae.decode(z).sample.cpu()
    finally:
        vae.decoder._compiled_call_impl = None


def test_a_compiled_vae_decoder_is_refused_as_torch_tpu_refuses_it(vae_and_reference):
    vae, z, _ = vae_and_reference
    with pytest.raises(RuntimeError, match=r"view\(\): cannot create a view of shape \[1, 32, 128\] from the input "
                       r"tensor of shape \[1, 64, 8, 8\] and strides \[64, 1, 512, 64\]"):  # fmt: skip
        _decode_compiled(vae, z)
    with torch.no_grad():  # eager: decoded (an SD3 VAE decoded eagerly on a v5e)
        vae.decode(z)


def test_with_the_diffusers_integration_the_compiled_decoder_equals_the_cpu(vae_and_reference):
    from hf_tpu.sim import _backend

    vae, z, reference = vae_and_reference
    with hf_tpu.enabled("diffusers"):
        assert _backend.DECOMPOSITIONS == {torch.ops.aten.native_group_norm.default: _group_norm.contiguous_group_norm}
        out = _decode_compiled(vae, z)
    torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-4)
    assert _backend.DECOMPOSITIONS == {}  # reverted with the integration


def _traced(x):
    from torch.fx.experimental.proxy_tensor import make_fx

    def norm(x):
        return torch.nn.functional.group_norm(x, 4)

    graph = make_fx(norm, decomposition_table=_group_norm.decompositions(), tracing_mode="fake")(x).graph
    return [str(n.target) for n in graph.nodes if n.op == "call_function" and "getitem" not in str(n.target)]


def test_the_decomposition_copies_only_an_input_that_is_not_contiguous():
    x = torch.randn(1, 8, 4, 4)
    assert _traced(x) == ["aten.native_group_norm.default"]
    assert _traced(x.to(memory_format=torch.channels_last)) == ["aten.clone.default", "aten.native_group_norm.default"]
