"""Graphs the simulator once failed where a chip would not: a compiled AutoencoderDC decoder (Sana's VAE, batch 2: a
convolution of a channels-last-strided input, then a view the fake tensors planned for a contiguous output) and
``torch.stft`` inside a ``backend="tpu"`` graph (its fake-tensor kernel restrides in place). Both equal the CPU."""

from __future__ import annotations

import torch


def _compiled(fn):
    torch._dynamo.reset()
    return torch.compile(fn, backend="tpu", fullgraph=True, dynamic=False)


def test_compiled_autoencoder_dc_matches_cpu(sim):
    from diffusers import AutoencoderDC

    torch.manual_seed(0)
    vae = AutoencoderDC(
        in_channels=3,
        latent_channels=4,
        attention_head_dim=2,
        encoder_block_types=("ResBlock", "EfficientViTBlock"),
        decoder_block_types=("ResBlock", "EfficientViTBlock"),
        encoder_block_out_channels=(8, 8),
        decoder_block_out_channels=(8, 8),
        encoder_qkv_multiscales=((), (5,)),
        decoder_qkv_multiscales=((), (5,)),
        encoder_layers_per_block=(1, 1),
        decoder_layers_per_block=(1, 1),
        downsample_block_type="conv",
        upsample_block_type="interpolate",
        decoder_norm_types="rms_norm",
        decoder_act_fns="silu",
    ).eval()
    latents = torch.randn(2, 4, 4, 6, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = vae.decode(latents).sample
        vae.to("tpu")
        with sim.stats() as s:
            out = _compiled(vae.decode)(latents.to("tpu")).sample
    assert s.compiles == 1
    torch.testing.assert_close(out.cpu(), reference, atol=1e-5, rtol=1e-5)


def test_stft_in_a_tpu_graph_matches_cpu(sim):
    def spectrum(x):
        window = torch.hann_window(16, device=x.device)
        return torch.stft(x, n_fft=16, hop_length=4, window=window, return_complex=True).abs()

    signal = torch.randn(2, 64, generator=torch.Generator().manual_seed(0))
    with sim.stats() as s:
        out = _compiled(spectrum)(signal.to("tpu"))
    assert s.compiles == 1
    torch.testing.assert_close(out.cpu(), spectrum(signal), atol=1e-5, rtol=1e-5)

