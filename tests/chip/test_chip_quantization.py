"""Weight-only int8 and int4 (torchao through transformers' ``TorchAoConfig``) on the chip, against the CPU running the
same quantized weights (loaded on ``tpu``, then moved to the CPU, as tests/quantization do): bfloat16 logits within a
few bf16 steps, greedy tokens equal up to a bfloat16 tie."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.chip

# tests/quantization's geometry: int4's group size 128 divides every in_features; weights drawn wide (0.3) so that the
# next-token logits differ by more than bf16's rounding.
GEOMETRY = {"hidden_size": 128, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 32, "num_hidden_layers": 2, "initializer_range": 0.3}  # fmt: skip
_LOADED: dict[str, tuple] = {}


def _config(kind: str):
    from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig
    from transformers import TorchAoConfig

    return TorchAoConfig(Int8WeightOnlyConfig() if kind == "int8" else Int4WeightOnlyConfig(group_size=128))


def _pair(kind: str, tmp_path_factory) -> tuple:
    if kind not in _LOADED:
        import torch
        from transformers import AutoModelForCausalLM

        from hf_tpu.testing import tiny_model

        path = tmp_path_factory.getbasetemp() / "chip-quant-llama"
        if not (path / "config.json").is_file():
            tiny_model("llama", path, **GEOMETRY)

        def load():
            return AutoModelForCausalLM.from_pretrained(path, device_map="tpu", dtype=torch.bfloat16,
                                                        quantization_config=_config(kind)).eval()  # fmt: skip

        cpu = load().to("cpu")
        _LOADED[kind] = (cpu, load())
    return _LOADED[kind]


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_logits_within_bf16_steps_of_cpu(tpu, chip, needs, tmp_path_factory, kind):
    needs("torchao")
    import torch
    from _chip_models import prompts

    cpu, model = _pair(kind, tmp_path_factory)
    weight = model.model.layers[0].mlp.down_proj.weight
    assert hasattr(type(weight), "__tensor_flatten__"), type(weight)  # a torchao tensor: the quantized weights ran
    ids, _ = prompts(1, [12], vocab=128, seed=60)
    with torch.no_grad():
        got = model(input_ids=ids.to("tpu")).logits.cpu()
        want = cpu(input_ids=ids).logits
    chip.bf16_close(got, want, tolerance=2e-2, what=f"{kind} logits")


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_greedy_tokens_equal_cpu_up_to_a_bf16_tie(tpu, chip, needs, tmp_path_factory, kind):
    needs("torchao")
    import torch
    from _chip_models import prompts

    cpu, model = _pair(kind, tmp_path_factory)
    ids, _ = prompts(1, [12], vocab=128, seed=61)
    got = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    ref = cpu.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, output_scores=True,
                       return_dict_in_generate=True)  # fmt: skip
    want = ref.sequences
    at = int((got[0] != want[0]).nonzero()[0]) if not torch.equal(got, want) else got.shape[1]
    if at < got.shape[1]:  # where they part, the CPU's two candidates are at most one bf16 step apart
        scores = ref.scores[at - ids.shape[1]][0].float()
        assert scores[want[0, at]] - scores[got[0, at]] <= scores[want[0, at]].abs() * 2**-7, (at, got, want)
    chip.tokens(got[:, :at], want[:, :at], what=f"{kind} greedy tokens before a bf16 tie", precision="bfloat16")
