"""Vision-language ``generate`` on hf_tpu's cached loop: the vision tower as its own compiled graph per image count
and pixel shape, its features merged into the left-padded prompt by the model's own forward in the prefill graph,
then the text loop's decode steps; pixel inputs left on the host. Qwen2-VL and Qwen2.5-VL: the tower on patch rows
keyed by the grids, the prompt's three rows of multimodal rotary positions (upstream's, computed on the host) packed
with the ids; EXAONE 4.5: Qwen2.5-VL's tower keyed by the grids before a text of one row of positions. LFM3-VL and
HyperCLOVA X Vision V2: patch rows and a grid per image too, the grid's values constants of the vision graph,
positions in one row. Mistral 3: each image's size (``image_sizes``) with it, host integers in the vision graph.
Idefics3 (and Idefics2, SmolVLM: their own test): a text row's images ``(rows, images, ...)`` with
``pixel_attention_mask``, the padding images dropped on the host. Gemma 4 and Gemma 4 Unified:
patch rows padded to their processor's length with each row's position (``image_position_ids``), each image's
features kept by its real rows counted on the host, ``mm_token_type_ids`` into the prefill. Tiny LLaVA-, Gemma 3-, Qwen2-VL-,
Qwen2.5-VL-, EXAONE 4.5-, LFM3-VL-, HyperCLOVA X Vision V2-, Mistral 3- and Idefics3-shaped models built from their
configs, compared with the same model's greedy generate on the CPU."""

from __future__ import annotations

import pytest
import torch

import hf_tpu
from hf_tpu.transformers import explain, generation

IMAGE = 90  # the image token of the tiny vocabulary
_TEXT = dict(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)  # fmt: skip


def _llava():
    import transformers as T

    vision = T.CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=16, patch_size=4,
        projection_dim=32,
    )  # fmt: skip
    config = T.LlavaConfig(
        vision_config=vision, text_config=T.LlamaConfig(**_TEXT), image_token_id=IMAGE, image_seq_length=17,
        vision_feature_select_strategy="full", vision_feature_layer=-1,
    )  # fmt: skip
    return T.LlavaForConditionalGeneration, config, 17  # 16 patches and the class token per image


def _gemma3():
    import transformers as T

    vision = T.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=16, patch_size=4
    )
    text = T.Gemma3TextConfig(
        **_TEXT, head_dim=8, sliding_window=6, layer_types=["sliding_attention", "full_attention"]
    )  # (a window shorter than the prompts)
    config = T.Gemma3Config(
        vision_config=vision, text_config=text, image_token_id=IMAGE, mm_tokens_per_image=4, boi_token_index=91,
        eoi_token_index=92,
    )  # fmt: skip
    return T.Gemma3ForConditionalGeneration, config, 4


_QWEN_TEXT = dict(_TEXT, rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 10000.0})
_QWEN_VISION = dict(
    depth=2, hidden_size=32, num_heads=4, patch_size=4, spatial_merge_size=2, temporal_patch_size=2, in_channels=3
)  # (16 x 16 pixels: a 4 x 4 patch grid, merged 2 x 2 into 4 image tokens)
_QWEN_TOKENS = dict(image_token_id=IMAGE, video_token_id=91, vision_start_token_id=92, vision_end_token_id=93)


def _qwen2_vl():
    import transformers as T

    config = T.Qwen2VLConfig(
        text_config=_QWEN_TEXT, vision_config=dict(_QWEN_VISION, embed_dim=32, mlp_ratio=2), **_QWEN_TOKENS
    )
    return T.Qwen2VLForConditionalGeneration, config, 4


def _qwen3_vl():  # (not in _BUILDERS: its own test; tests/contract lowers its graphs)
    import transformers as T

    vision = dict(_QWEN_VISION, intermediate_size=64, out_hidden_size=32, num_position_embeddings=16)
    vision["deepstack_visual_indexes"] = [0]  # (the first block's features added into the first decoder layer)
    config = T.Qwen3VLConfig(text_config=dict(_QWEN_TEXT, head_dim=8), vision_config=vision, **_QWEN_TOKENS)
    return T.Qwen3VLForConditionalGeneration, config, 4


def _qwen2_5_vl():
    import transformers as T

    vision = dict(  # window attention in the first block (windows of 2 x 2 image tokens), full in the second
        _QWEN_VISION, intermediate_size=64, out_hidden_size=32, window_size=16, fullatt_block_indexes=[1]
    )
    config = T.Qwen2_5_VLConfig(text_config=_QWEN_TEXT, vision_config=vision, **_QWEN_TOKENS)
    return T.Qwen2_5_VLForConditionalGeneration, config, 4


def _exaone4_5():
    import transformers as T

    vision = dict(  # Qwen2.5-VL's tower (window attention, then full) with axial rotary positions
        _QWEN_VISION, intermediate_size=64, out_hidden_size=32, window_size=16, fullatt_block_indexes=[1],
        num_key_value_heads=2,
    )  # fmt: skip
    text = dict(_TEXT, model_type="exaone4", sliding_window=6, layer_types=["sliding_attention", "full_attention"])
    config = T.Exaone4_5_Config(text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=91)
    return T.Exaone4_5_ForConditionalGeneration, config, 4


def _lfm3_vl():
    import transformers as T

    text = dict(_TEXT, head_dim=8, layer_types=["conv", "full_attention"], conv_L_cache=3)
    vision = dict(  # a convolution block, then an attention block over each image's patches (4 x 4 per 16 pixels)
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        layer_types=["conv", "full_attention"], patch_size=4, spatial_merge_size=2, temporal_patch_size=2,
    )  # fmt: skip
    config = T.Lfm3VlConfig(
        text_config=text, vision_config=vision, projector_hidden_size=32, image_token_id=IMAGE, video_token_id=91,
        vision_start_token_id=92, vision_end_token_id=93,
    )  # fmt: skip
    return T.Lfm3VlForConditionalGeneration, config, 4


def _hyperclovax_vision_v2():
    import transformers as T

    vision = dict(  # Qwen2.5-VL's tower (window attention in the first block), positions in one row
        _QWEN_VISION, model_type="qwen2_5_vl_vision", intermediate_size=64, out_hidden_size=32, window_size=16,
        fullatt_block_indexes=[1],
    )  # fmt: skip
    config = T.HyperCLOVAXVisionV2Config(
        text_config=dict(_TEXT, model_type="hyperclovax", head_dim=8), vision_config=vision, image_token_id=IMAGE,
        video_token_id=91,
    )  # fmt: skip
    return T.HyperCLOVAXVisionV2ForConditionalGeneration, config, 4


def _mistral3():
    import transformers as T

    vision = T.PixtralVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, head_dim=8, image_size=16,
        patch_size=4,
    )  # fmt: skip
    config = T.Mistral3Config(
        vision_config=vision, text_config=T.MistralConfig(**_TEXT), image_token_index=IMAGE, spatial_merge_size=2,
        vision_feature_layer=-1,
    )  # fmt: skip
    return T.Mistral3ForConditionalGeneration, config, 4  # (a 4 x 4 patch grid, merged 2 x 2)


def _idefics3():
    import transformers as T

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=16,
                  patch_size=4)  # fmt: skip
    config = T.Idefics3Config(
        vision_config=vision, text_config=T.LlamaConfig(**_TEXT), image_token_id=IMAGE, scale_factor=2
    )
    return T.Idefics3ForConditionalGeneration, config, 4  # (a 4 x 4 patch grid, folded 2 x 2)


_BUILDERS = {
    "llava": _llava, "gemma3": _gemma3, "qwen2_vl": _qwen2_vl, "qwen2_5_vl": _qwen2_5_vl, "exaone4_5": _exaone4_5,
    "lfm3_vl": _lfm3_vl, "hyperclovax_vision_v2": _hyperclovax_vision_v2, "mistral3": _mistral3,
    "idefics3": _idefics3,
}  # fmt: skip
_GRID = ("qwen2_vl", "qwen2_5_vl")  # images as patch rows with a grid each, positions numbered from the grids
_GRID_IMAGES = (*_GRID, "exaone4_5")  # images as patch rows with a grid each (EXAONE 4.5: one row of positions)
# images as patch rows with a grid each, positions in one row: the vision graph takes the grid as constants
_TAKES_GRID = ("lfm3_vl", "hyperclovax_vision_v2")
_PAIRS: dict[str, tuple] = {}


def _families(names) -> list:
    """``names`` as parameters, each family's tests in one xdist group (``.ci/run``'s slow tier: ``--dist loadgroup``):
    a family's model pair and the graphs compiled for it (:data:`_PAIRS`, one per process) then serve all its tests
    on one worker, in the file's order, instead of each worker building the pair and compiling the graphs again."""
    return [pytest.param(name, marks=pytest.mark.xdist_group(f"vlm-{name}")) for name in names]


@pytest.fixture(params=_families(sorted(_BUILDERS)))
def vlm(request):
    return _pair(request.param)


def _pair(family: str) -> tuple:
    if family not in _PAIRS:
        cls, config, per_image = _BUILDERS[family]()
        _PAIRS[family] = (family, *_cpu_and_tpu(cls, config), per_image)
    return _PAIRS[family]


def _cpu_and_tpu(cls, config) -> tuple:
    """A model of ``cls`` on the CPU (seeded) and the same weights on ``tpu``, both in eval mode. (conftest's
    ``_from_config`` does the same, but tests/contract imports this module in torch_tpu's process, where importing
    this folder's conftest would enable the simulator.)"""
    torch.manual_seed(0)
    cpu = cls(config).eval()
    tpu = cls(config).eval()
    tpu.load_state_dict(cpu.state_dict())
    return cpu, tpu.to("tpu")


def _prompt(family: str, per_image: int, images: int, text: int, seed: int, size=(16, 16)) -> dict:
    """A processor's output, on the host: text, the image tokens of each image, more text; the pixel values (Qwen-VL's:
    each image's 4 x 4-pixel patches of 2 frames as rows, its grid, and the tokens' modality types)."""
    g = torch.Generator().manual_seed(seed)
    if family in _GRID_IMAGES + _TAKES_GRID:
        grid = [1, size[0] // 4, size[1] // 4]
        per_image = grid[1] * grid[2] // 4
    image = torch.full((1, per_image), IMAGE)
    if family in _GRID:  # (each image between its start and end tokens: upstream numbers each run of image tokens)
        image = torch.cat([torch.tensor([[92]]), image, torch.tensor([[93]])], dim=1)
    parts = [torch.randint(3, 60, (1, text), generator=g), *[image] * images]
    ids = torch.cat([*parts, torch.randint(3, 60, (1, 3), generator=g)], dim=1)
    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if family in _GRID_IMAGES + _TAKES_GRID:
        kwargs["pixel_values"] = torch.randn(images * grid[1] * grid[2], 3 * 2 * 4 * 4, generator=g)
        kwargs["image_grid_thw"] = torch.tensor([grid] * images)
        if family in _GRID:
            kwargs["mm_token_type_ids"] = (ids == IMAGE).int()
        return kwargs
    if family == "idefics3":  # (its processor: a text row's images, with the mask of their real pixels)
        kwargs["pixel_values"] = torch.randn(1, images, 3, 16, 16, generator=g)
        kwargs["pixel_attention_mask"] = torch.ones(1, images, 16, 16, dtype=torch.long)
        return kwargs
    kwargs["pixel_values"] = torch.randn(images, 3, 16, 16, generator=g)
    if family == "mistral3":  # (its processor: each image's size)
        kwargs["image_sizes"] = torch.tensor([[16, 16]] * images)
    if (
        family == "gemma3"
    ):  # Gemma 3's processor marks the image tokens (its prefill attends within an image both ways)
        kwargs["token_type_ids"] = (ids == IMAGE).long()
    return kwargs


def _kinds(keys) -> set[str]:
    """The graph kinds of ``keys``, variants left out (Qwen-VL's vision graph, "grid_vision", and Idefics3's,
    "padded_vision", read as "vision")."""
    return {key[0].split("+", 1)[0].removeprefix("grid_").removeprefix("padded_") for key in keys}


def _generate(model, kwargs: dict, new_tokens: int):
    return model.generate(**kwargs, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)


def test_greedy_with_images_equals_cpu_from_host_pixels(vlm):
    family, cpu, tpu, per_image = vlm
    kwargs = _prompt(family, per_image, images=1, text=5, seed=0)
    assert explain(tpu, **kwargs, max_new_tokens=8).loop == "cached"
    got = _generate(tpu, kwargs, 8)
    assert got.device.type == "cpu"
    assert torch.equal(got, _generate(cpu, kwargs, 8))
    assert {"vision", "mm_prefill", "decode"} <= _kinds(generation.compiled_graphs(tpu))
    # no compiled graph of the model's reads a device value on the host (torch_tpu would refuse to lower it)
    files = (f"modeling_{family}.py", "vision_utils.py")
    reads = [site for site in hf_tpu.sim.host_reads() if any(f in site for f in files)]
    assert not reads, reads


def test_another_image_compiles_nothing_and_another_count_compiles_only_its_own_graphs(vlm):
    family, cpu, tpu, per_image = vlm
    _generate(tpu, _prompt(family, per_image, images=1, text=5, seed=0), 8)
    # another image, another prompt length in the same bucket
    kwargs = _prompt(family, per_image, images=1, text=7, seed=1)
    with hf_tpu.sim.stats() as s:
        got = _generate(tpu, kwargs, 8)
    assert torch.equal(got, _generate(cpu, kwargs, 8))
    assert s.compiles == 0 and s.shape_signatures <= 4
    # two images: the vision graph and the prefill for that feature shape (and the buckets the prompt reaches)
    before = len(generation.compiled_graphs(tpu))
    kwargs = _prompt(family, per_image, images=2, text=3, seed=2)
    got = _generate(tpu, kwargs, 8)
    assert torch.equal(got, _generate(cpu, kwargs, 8))
    added = _kinds(generation.compiled_graphs(tpu)[before:])
    assert {"vision", "mm_prefill"} <= added <= {"vision", "mm_prefill", "decode"}
    kwargs = _prompt(family, per_image, images=2, text=4, seed=3)
    with hf_tpu.sim.stats() as s:
        got = _generate(tpu, kwargs, 8)
    assert torch.equal(got, _generate(cpu, kwargs, 8))
    assert s.compiles == 0 and s.shape_signatures <= 4


def test_one_small_copy_each_way_per_decode_step_with_images(vlm):
    family, _, tpu, per_image = vlm
    kwargs = _prompt(family, per_image, images=1, text=5, seed=4)
    _generate(tpu, kwargs, 10)
    with hf_tpu.sim.stats() as short:
        _generate(tpu, kwargs, 2)
    with hf_tpu.sim.stats() as long:
        _generate(tpu, kwargs, 10)
    steps = 8
    assert long.compiles == 0
    assert (long.h2d_copies - short.h2d_copies) / steps <= 1
    assert (long.d2h_copies - short.d2h_copies) / steps <= 1
    assert (long.d2h_bytes - short.d2h_bytes) / steps <= 8
    assert (long.host_syncs - short.host_syncs) / steps <= 1


@pytest.mark.parametrize("family", _families(_GRID))
def test_grid_model_text_and_untyped_calls_equal_cpu_on_the_cached_loop(family):
    """Qwen-VL numbers every prompt in three rows (upstream's generate computes them on the host, with or without
    images): a text-only call and an image call without ``mm_token_type_ids`` (upstream then numbers the image tokens
    as text) run hf_tpu's loop ("+mrope" graphs) and equal the CPU's."""
    _, cpu, tpu, per_image = _pair(family)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    text = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    assert explain(tpu, **text, max_new_tokens=6).loop == "cached"
    before = len(generation.compiled_graphs(tpu))
    assert torch.equal(_generate(tpu, text, 6), _generate(cpu, text, 6))
    assert {key[0].split("+")[-1] for key in generation.compiled_graphs(tpu)[before:]} == {"mrope"}
    for asked in ({"num_beams": 2}, {"use_cache": False}):  # (loops that do not carry three rows: named)
        route = explain(tpu, **text, max_new_tokens=6, **asked)
        assert route.loop == "upstream" and "three rows" in route.reason, (asked, route)
    untyped = _prompt(family, per_image, images=1, text=4, seed=5)
    del untyped["mm_token_type_ids"]
    assert torch.equal(_generate(tpu, untyped, 6), _generate(cpu, untyped, 6))


def test_qwen2_vl_video_runs_upstream_naming_the_inputs():
    """Videos are not on the loop yet: the call runs upstream's loop, and explain says which inputs."""
    _, cpu, tpu, _ = _pair("qwen2_vl")
    ids = torch.cat([torch.tensor([[5, 6]]), torch.full((1, 4), 91), torch.tensor([[7, 8]])], dim=1)
    kwargs = {
        "input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values_videos": torch.randn(16, 96),
        "video_grid_thw": torch.tensor([[1, 4, 4]]), "mm_token_type_ids": (ids == 91).int() * 2,
    }  # fmt: skip
    route = explain(tpu, **kwargs, max_new_tokens=4)
    assert route.loop == "upstream" and "pixel_values_videos" in route.reason
    generation.WARNED.clear()
    with pytest.warns(UserWarning, match="pixel_values_videos"):
        got = _generate(tpu, kwargs, 4)
    assert torch.equal(got.cpu(), _generate(cpu, kwargs, 4))


def test_qwen3_vl_images_on_the_cached_loop_equal_cpu_and_warmed_sizes_compile_nothing():
    """Qwen3-VL's family (Qwen3-VL, Qwen3.5, ...) on hf_tpu's loop: its tower interpolates learned position
    embeddings to each grid (indices and weights computed on the host, keyed by the grids) and hands the features of
    an early block to the first decoder layer at the image tokens (deepstack: the "grid_vision" graph returns them,
    the image prefill adds them); positions in three rows from upstream's get_rope_index on the host. Inputs left
    on the host equal the CPU's; after warm-up of two image sizes and counts (strict: a graph warm-up missed would
    raise), calls with either size compile nothing."""
    cpu, tpu = _cpu_and_tpu(*_qwen3_vl()[:2])
    kwargs = _prompt("qwen2_vl", 4, images=2, text=5, seed=3)  # (Qwen3-VL's processor makes the same layout)
    assert explain(tpu, **kwargs, max_new_tokens=6).loop == "cached"
    got = _generate(tpu, kwargs, 6)
    assert got.device.type == "cpu" and torch.equal(got, _generate(cpu, kwargs, 6))
    kinds = {key[0] for key in generation.compiled_graphs(tpu)}
    assert "grid_vision" in kinds and {"mm_prefill", "decode"} <= {k.split("+")[0] for k in kinds if "+mrope" in k}
    report = hf_tpu.warmup(
        tpu, max_prompt_len=32, batch_sizes=[1], max_new_tokens=8, image_sizes=[(16, 16), (16, 32)],
        num_images=[1, 2], strict=True, progress=False,
    )  # fmt: skip
    assert len({key for key in report.graphs if key[0] == "grid_vision"}) == 4
    _warmed_calls_compile_nothing("qwen2_vl", cpu, tpu, 4, [(1, 6, 14, (16, 32)), (2, 7, 15, (16, 32)),
                                                          (1, 9, 16, (16, 16))])  # fmt: skip


# The warm-up test's families: one per image path (plain pixels, token types, grid with three rows of positions,
# windowed grid, grid as constants, image sizes, a text row's images). EXAONE 4.5 (Qwen2.5-VL's tower) and HyperCLOVA X
# Vision V2 (LFM3-VL's path, Qwen2.5-VL's tower) are warmed in the image-text-to-text sweep with every other
# architecture (benchmarks/vlm_sweep.py: warm-up, then calls compiling nothing).
_WARMED = sorted(set(_BUILDERS) - {"exaone4_5", "hyperclovax_vision_v2"})


@pytest.mark.parametrize("family", _families(_WARMED))
def test_warmup_of_image_counts_leaves_nothing_to_compile(family):
    """``hf_tpu.warmup(image_sizes=..., num_images=...)``: the vision graph per image count and pixel shape, and the
    image prefill and decode graphs of every warmed bucket holding the images' tokens; afterwards (strict mode: a
    graph warm-up missed would raise) one and two images in prompts of other lengths compile nothing."""
    family, cpu, tpu, per_image = _pair(family)
    # (Qwen-VL: a second image size, 16 x 32 pixels, 8 image tokens; the others' processors resize every image)
    sizes = [(16, 16), (16, 32)] if family in _GRID_IMAGES + _TAKES_GRID else [(16, 16)]
    report = hf_tpu.warmup(
        tpu, max_prompt_len=64, batch_sizes=[1], max_new_tokens=8, image_sizes=sizes, num_images=[1, 2],
        strict=True, progress=False,
    )  # fmt: skip
    kinds = ("vision", "grid_vision", "padded_vision")
    vision = {key[1] for key in report.graphs if key[0] in kinds}
    assert vision == {1, 2}  # (the images: Idefics3's real ones, its padding dropped on the host)
    assert len({key for key in report.graphs if key[0] in kinds}) == 2 * len(sizes)
    prefills = [key for key in report.graphs if key[0].startswith("mm_prefill")]
    assert {key[2] for key in prefills} == ({32, 64} if family == "llava" else {16, 32, 64})  # (LLaVA: 17 per image)
    calls = [(1, 5, 10, (16, 16)), (2, 4, 11, (16, 16)), (1, 20, 12, (16, 16)), (2, 9, 13, (16, 16))]
    calls += [(1, 6, 14, (16, 32)), (2, 7, 15, (16, 32))] if family in _GRID_IMAGES + _TAKES_GRID else []
    _warmed_calls_compile_nothing(family, cpu, tpu, per_image, calls)


def _warmed_calls_compile_nothing(family, cpu, tpu, per_image, calls):
    """Each ``(images, text tokens, seed, size)`` call's greedy tokens equal the CPU's and compile nothing (at most 4
    new signatures) after a strict warm-up, and after the process built a model of a class it had not built (a second
    model loaded: transformers registers each class it builds in a registry the forwards read, which the graphs must
    not guard on); strict mode is switched off afterwards."""
    import transformers as T

    unseen = type(f"Unseen{family.title().replace('_', '')}", (T.LlamaForCausalLM,), {})
    unseen(T.LlamaConfig(**_TEXT))
    try:
        for images, text, seed, size in calls:
            kwargs = _prompt(family, per_image, images=images, text=text, seed=seed, size=size)
            with hf_tpu.sim.stats() as s:
                got = tpu.generate(**kwargs, max_new_tokens=8, do_sample=False)
            assert torch.equal(got, cpu.generate(**kwargs, max_new_tokens=8, do_sample=False)), (images, text, size)
            assert s.compiles == 0 and s.shape_signatures <= 4, (images, text, s.compiles, s.shape_signatures)
    finally:
        generation.configure(tpu, strict=False)


def test_warmup_of_images_says_what_it_cannot_warm(vlm):
    """Image requests warm-up cannot serve raise before it compiles any text graph (the images' checks and their
    vision graph run first): images filling more tokens than the largest prompt bucket (their vision graph compiled,
    which counted them), malformed sizes, and a grid model's sizes its processor never returns (nothing compiled)."""
    family, _, tpu, _ = vlm
    compiled = len(generation.compiled_graphs(tpu))
    with pytest.raises(ValueError, match="raise max_prompt_len"):
        hf_tpu.warmup(tpu, max_prompt_len=8, max_new_tokens=4, image_sizes=[(16, 16)], num_images=[8], progress=False)
    assert _kinds(generation.compiled_graphs(tpu)[compiled:]) <= {"vision"}
    compiled = len(generation.compiled_graphs(tpu))
    with pytest.raises(ValueError, match=r"\(height, width\) pairs"):
        hf_tpu.warmup(tpu, max_prompt_len=8, max_new_tokens=4, image_sizes=[16], progress=False)
    if family in _GRID_IMAGES + _TAKES_GRID:  # its processor resizes images to whole merged patches (8 pixels here)
        with pytest.raises(ValueError, match="multiples of patch_size x spatial_merge_size"):
            hf_tpu.warmup(tpu, max_prompt_len=32, max_new_tokens=4, image_sizes=[(12, 16)], progress=False)
    assert len(generation.compiled_graphs(tpu)) == compiled


def test_an_image_encoder_that_is_not_one_graph_sends_image_calls_upstream_and_warmup_says_so():
    """A tiny LLaVA whose image encoder branches on its pixels' values (a data-dependent branch: no static graph):
    warm-up warms the text graphs, warns the reason once and returns; calls with images run upstream's loop, equal
    to the CPU's, with explain naming the reason; calls without keep hf_tpu's cached loop."""
    import warnings

    cls, config, per_image = _llava()
    torch.manual_seed(0)
    cpu, tpu = cls(config).eval(), cls(config).eval()
    tpu.load_state_dict(cpu.state_dict())
    tpu.to("tpu")
    encoder = tpu.model.get_image_features

    def branching(pixel_values, **kwargs):
        if pixel_values.abs().sum() > 1e9:  # (never true here: the result is the encoder's)
            pixel_values = pixel_values * 0
        return encoder(pixel_values, **kwargs)

    tpu.model.get_image_features = branching
    generation.WARNED.clear()
    with pytest.warns(UserWarning, match=r"image encoder \(get_image_features\) cannot be compiled") as w:
        report = hf_tpu.warmup(
            tpu, max_prompt_len=32, batch_sizes=[1], max_new_tokens=6, image_sizes=[(16, 16)], progress=False
        )
    assert len([x for x in w if "hf_tpu:" in str(x.message)]) == 1
    assert len(report.not_warmed) == 1 and "calls with images" in report.not_warmed[0]
    assert _kinds(report.graphs) == {"prefill", "decode"}
    kwargs = _prompt("llava", per_image, images=1, text=5, seed=0)
    route = explain(tpu, **kwargs, max_new_tokens=6)
    assert route.loop == "upstream" and "Data-dependent branching" in route.reason
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (said once, by warm-up)
        got = _generate(tpu, kwargs, 6)
    assert torch.equal(got.cpu(), _generate(cpu, kwargs, 6))
    text = {"input_ids": kwargs["input_ids"][:, :5], "attention_mask": kwargs["attention_mask"][:, :5]}
    assert explain(tpu, **text, max_new_tokens=6).loop == "cached"
    with hf_tpu.sim.stats() as s:  # (the warmed variant: the model's own generation_config, no min_new_tokens)
        got = tpu.generate(**text, max_new_tokens=6, do_sample=False)
    assert torch.equal(got, cpu.generate(**text, max_new_tokens=6, do_sample=False)) and s.compiles == 0


def _llava_next():
    """A tiny LLaVA-NeXT: 16-pixel tiles of 4 x 4 patches, an image resized to its best grid of tiles (pinpoints of
    1 x 1, 1 x 2 and 2 x 1 tiles) after one tile of the whole image; its tokens: the whole image's 16, then the grid's
    rows unpadded to the image's aspect, each row ending in the newline embedding."""
    import transformers as T

    vision = T.CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=16, patch_size=4,
        projection_dim=32,
    )  # fmt: skip
    config = T.LlavaNextConfig(
        vision_config=vision, text_config=T.LlamaConfig(**_TEXT), image_token_id=IMAGE,
        image_grid_pinpoints=[[16, 16], [16, 32], [32, 16]], vision_feature_select_strategy="default",
        vision_feature_layer=-1,
    )  # fmt: skip
    torch.manual_seed(0)
    cpu, tpu = T.LlavaNextForConditionalGeneration(config).eval(), T.LlavaNextForConditionalGeneration(config).eval()
    tpu.load_state_dict(cpu.state_dict())
    return cpu, tpu.to("tpu")


def _llava_next_prompt(cpu, size: tuple, text: int, seed: int) -> dict:
    """Its processor's output for one image of ``size`` (height, width): the tiles, the size, and as many image
    tokens as the CPU model's own encoder gives the image features."""
    import sys

    g = torch.Generator().manual_seed(seed)
    module = sys.modules[type(cpu).__module__]
    tiles = module.image_size_to_num_patches(image_size=size, grid_pinpoints=cpu.config.image_grid_pinpoints,
                                             patch_size=16)  # fmt: skip
    pixels, sizes = torch.randn(1, tiles, 3, 16, 16, generator=g), torch.tensor([list(size)])
    with torch.no_grad():
        features = cpu.model.get_image_features(pixel_values=pixels, image_sizes=sizes).pooler_output
    image = torch.full((1, sum(f.shape[0] for f in features)), IMAGE)
    ids = torch.cat([torch.randint(3, 60, (1, text), generator=g), image, torch.tensor([[5, 6, 7]])], dim=1)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixels, "image_sizes": sizes}


def test_llava_next_tiles_equal_cpu_and_a_second_warmed_image_size_compiles_nothing():
    """LLaVA-NeXT's encoder packs each image's tiles by its size (``image_sizes``, host integers: constants of the
    vision graph; its ``np.prod`` of the static feature shape an integer there, hf_tpu/transformers/_numpy_fold.py):
    after warm-up of two image sizes (1 x 1 and 1 x 2 tiles), greedy generate with either equals the CPU's on hf_tpu's
    cached loop, compiling nothing (strict mode) and at most 4 new op shapes."""
    cpu, tpu = _llava_next()
    report = hf_tpu.warmup(
        tpu, max_prompt_len=64, batch_sizes=[1], max_new_tokens=6, image_sizes=[(16, 16), (16, 32)], strict=True,
        progress=False,
    )  # fmt: skip
    assert len([key for key in report.graphs if key[0] == "vision"]) == 2 and not report.not_warmed
    try:
        for size, text, seed in (((16, 16), 5, 0), ((16, 32), 4, 1)):
            kwargs = _llava_next_prompt(cpu, size, text, seed)
            assert explain(tpu, **kwargs, max_new_tokens=6).loop == "cached"
            with hf_tpu.sim.stats() as s:  # (the warmed variant: the model's own generation_config)
                got = tpu.generate(**kwargs, max_new_tokens=6, do_sample=False)
            assert torch.equal(got, cpu.generate(**kwargs, max_new_tokens=6, do_sample=False)), size
            assert s.compiles == 0 and s.shape_signatures <= 4, (size, s.compiles, s.shape_signatures)
    finally:
        generation.configure(tpu, strict=False)


def test_numpy_prod_of_a_static_shape_is_an_integer_in_a_compiled_graph():
    """``np.prod`` of a static shape (LLaVA-NeXT's check of its tiles' features) is folded to eager's integer while
    the generation integration is on (a branch on it is a shape check, not data-dependent), and traced again as a
    tensor, a data-dependent branch, once it is off."""
    import numpy as np
    from torch._dynamo.variables.misc import NumpyVariable

    from hf_tpu import _patch

    def checked(x):
        if np.prod(x.shape) % 6 != 0 and x.dim() == 2:
            return x + 1
        return x * 2

    def unfolded(x):  # (the same code, another function: dynamo traces it afresh with the patch off)
        if np.prod(x.shape) % 6 != 0 and x.dim() == 2:
            return x + 1
        return x * 2

    assert any(r.target.endswith("NumpyVariable.call_function") for r in _patch.applied("generation"))
    compiled = torch.compile(checked, fullgraph=True, dynamic=False, backend="eager")
    for shape in ((2, 3), (2, 4)):
        x = torch.ones(shape)
        torch.testing.assert_close(compiled(x), checked(x))
    hf_tpu.disable("generation")
    try:
        assert not hasattr(NumpyVariable.call_function, "__wrapped__")
        with pytest.raises(torch._dynamo.exc.Unsupported, match="Data-dependent branching"):
            torch.compile(unfolded, fullgraph=True, dynamic=False, backend="eager")(torch.ones(2, 3))
    finally:
        hf_tpu.enable("generation")


def test_tolist_of_a_tensor_of_constants_is_numbers_in_a_compiled_graph():
    """``tolist()``/``item()`` of a tensor built from constants only (Mistral 3's split sizes from ``image_sizes``,
    transformers' ``get_vision_position_ids`` on a merge size) are eager's numbers in a compiled graph while the
    generation integration is on: no ``.item()`` in the graph (a read of a device value on the host, which torch_tpu
    refuses to lower). A tensor computed from a graph input, and one the graph writes into, are still read in the
    graph; with the integration off every one is."""
    from torch._dynamo.variables.tensor import TensorVariable

    from hf_tpu import _patch

    def split(x, sizes):
        counts = (torch.as_tensor(sizes, device=x.device) // 2).prod(dim=-1).tolist()
        merge = torch.tensor([2], device=x.device).expand(len(sizes)).tolist()
        written = torch.zeros(2, dtype=torch.long, device=x.device)
        written[0] = len(sizes)
        return torch.split(x, counts), merge, written.tolist(), (x > 0).sum().item()

    def unfolded(x, sizes):  # (the same code, another function: dynamo traces it afresh with the patch off)
        counts = (torch.as_tensor(sizes, device=x.device) // 2).prod(dim=-1).tolist()
        return torch.split(x, counts)

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    def reads(gm) -> int:
        return sum(node.op == "call_method" and node.target == "item" for node in gm.graph.nodes)

    assert any(r.target.endswith("TensorVariable.call_method") for r in _patch.applied("generation"))
    sizes = [[4, 2], [6, 2]]  # (2 and 3 rows)
    x = torch.randn(5, 3)
    got = torch.compile(split, fullgraph=True, dynamic=False, backend=backend)(x, sizes)
    want = split(x, sizes)
    assert [t.shape for t in got[0]] == [t.shape for t in want[0]] and all(map(torch.equal, got[0], want[0]))
    assert got[1:] == want[1:]
    assert reads(graphs[-1]) == 3  # the written tensor's two values and the input's count; none of the sizes
    hf_tpu.disable("generation")
    try:
        assert not hasattr(TensorVariable.call_method, "__wrapped__")
        got = torch.compile(unfolded, fullgraph=True, dynamic=False, backend=backend)(x, sizes)
        assert all(map(torch.equal, got, unfolded(x, sizes))) and reads(graphs[-1]) == 2
    finally:
        hf_tpu.enable("generation")


def _llava_processor():
    """A processor of the tiny LLaVA, built here: a word-level tokenizer of the tiny vocabulary (``<image>`` at the
    image token), CLIP's image processor at the tower's 16 x 16, 17 image tokens per image."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import CLIPImageProcessor, LlavaProcessor, PreTrainedTokenizerFast

    words = ["<pad>", "<s>", "</s>"] + [f"w{i}" for i in range(3, IMAGE)] + ["<image>"]
    words += [f"x{i}" for i in range(IMAGE + 1, 96)]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w3"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece()  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="w3"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})  # (split out before the words)
    images = CLIPImageProcessor(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
    return LlavaProcessor(
        image_processor=images, tokenizer=tokenizer, patch_size=4, vision_feature_select_strategy="full",
        num_additional_image_tokens=1,
    )  # fmt: skip


def test_image_text_to_text_pipeline_on_tpu_runs_hf_tpu_loop_and_equals_cpu():
    """``pipeline("image-text-to-text", device="tpu")``: the processor's pixels (host) and prompt reach hf_tpu's
    loop through the model's generate (the vision graph, the image prefill), and the text equals the CPU pipeline's."""
    import numpy as np
    from PIL import Image
    from transformers import pipeline

    _, cpu, tpu, per_image = _pair("llava")
    processor = _llava_processor()
    picture = Image.fromarray((np.random.default_rng(0).random((20, 24, 3)) * 255).astype("uint8"))
    text, kwargs = "w5 w6 <image> w7 w8", {"max_new_tokens": 6, "do_sample": False}
    want = pipeline("image-text-to-text", model=cpu, processor=processor)(
        images=picture, text=text, generate_kwargs=kwargs
    )
    on_tpu = pipeline("image-text-to-text", model=tpu, processor=processor, device="tpu")
    assert on_tpu.device.type == "tpu"
    before = len(generation.compiled_graphs(tpu))
    got = on_tpu(images=picture, text=text, generate_kwargs=kwargs)
    assert got == want and len(want[0]["generated_text"]) > len(text)
    ran = generation.compiled_graphs(tpu)
    assert any(key[0] == "mm_prefill" and key[1] == 1 for key in ran), ran  # (compiled by this call or an earlier one)
    with hf_tpu.sim.stats() as s:  # a second picture of another size: the processor resizes it to the tower's
        other = Image.fromarray((np.random.default_rng(1).random((40, 30, 3)) * 255).astype("uint8"))
        got = on_tpu(images=other, text=text, generate_kwargs=kwargs)
    assert got == pipeline("image-text-to-text", model=cpu, processor=processor)(
        images=other, text=text, generate_kwargs=kwargs
    )
    assert s.compiles == 0 and len(generation.compiled_graphs(tpu)) >= before


# Gemma 4 (a vision tower pooling 2 x 2 patches of 4 pixels) and Gemma 4 Unified (an encoder-free embedder of merged
# 8-pixel patches): their processors' patch rows with positions, padded to 70 tokens' rows
_POSITIONED = ("gemma4", "gemma4_unified")


def _gemma4_pair(family: str) -> tuple:
    import transformers as T

    if family in _PAIRS:
        return _PAIRS[family]
    text = dict(
        _TEXT, head_dim=8, global_head_dim=16, sliding_window=6, layer_types=["sliding_attention", "full_attention"],
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=96, use_bidirectional_attention="vision",
    )  # fmt: skip  (each image's tokens attend to each other both ways in the prefill: mm_token_type_ids mark them)
    tokens = dict(image_token_id=IMAGE, boi_token_id=91, eoi_token_id=92, video_token_id=93, audio_token_id=94,
                  boa_token_id=95, eoa_token_index=89)  # fmt: skip
    if family == "gemma4":
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=4, head_dim=8, patch_size=4, pooling_kernel_size=2,
                      position_embedding_size=64)  # fmt: skip
        cls, config = T.Gemma4ForConditionalGeneration, T.Gemma4Config(text_config=text, vision_config=vision, **tokens)
    else:
        vision = dict(patch_size=4, pooling_kernel_size=2, mm_embed_dim=32, mm_posemb_size=64, output_proj_dims=32)
        text = {k: v for k, v in text.items() if k not in ("global_head_dim", "hidden_size_per_layer_input",
                                                           "vocab_size_per_layer_input")}  # fmt: skip
        cls = T.Gemma4UnifiedForConditionalGeneration
        config = T.Gemma4UnifiedConfig(text_config=text, vision_config=vision, **tokens)
    _PAIRS[family] = (family, *_cpu_and_tpu(cls, config), None)
    return _PAIRS[family]


def _positioned_prompt(images: int, text: int, seed: int, size: tuple[int, int]) -> dict:
    """Gemma 4's processor output (``max_soft_tokens=70``) for ``images`` images of ``size`` pixels: text, each
    image's tokens (a token per 2 x 2 patches of 4 pixels, Gemma 4 Unified's merged 8-pixel patches alike), more
    text, with the image tokens marked (``mm_token_type_ids``); each image's 4-pixel patch rows (Unified's: 8-pixel
    rows, :func:`_unified`), padded to 70 tokens' rows, and their (x, y) positions, (-1, -1) for the padding."""
    g = torch.Generator().manual_seed(seed)
    per_image = size[0] * size[1] // 64
    parts = [torch.randint(3, 60, (1, text), generator=g), *[torch.full((1, per_image), IMAGE)] * images]
    ids = torch.cat([*parts, torch.randint(3, 60, (1, 3), generator=g)], dim=1)
    rows, cols = size[0] // 4, size[1] // 4
    pixels = torch.zeros(images, 280, 48)
    pixels[:, : rows * cols] = torch.rand(images, rows * cols, 48, generator=g)
    ys, xs = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    positions = torch.full((images, 280, 2), -1, dtype=torch.long)
    positions[:, : rows * cols] = torch.stack([xs.flatten(), ys.flatten()], dim=-1)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixels,
            "image_position_ids": positions, "mm_token_type_ids": (ids == IMAGE).long()}  # fmt: skip


def _unified(kwargs: dict) -> dict:
    """Gemma 4 Unified's layout of the same images: each 2 x 2 kernel of 4-pixel patches one 8-pixel row (its
    processor merges them), 70 rows."""
    pixels, positions = kwargs["pixel_values"], kwargs["image_position_ids"]
    real = int((positions[0] != -1).all(-1).sum())
    cols = int(positions[0, :real, 0].max()) + 1
    rows = real // cols
    patches = pixels[:, :real].reshape(-1, rows, cols, 4, 4, 3)  # (the processor's rows: a patch's pixels, then colour)
    merged = patches.reshape(-1, rows // 2, 2, cols // 2, 2, 4, 4, 3).permute(0, 1, 3, 2, 5, 4, 6, 7)
    merged = merged.reshape(-1, rows // 2 * cols // 2, 192)
    out = torch.zeros(pixels.shape[0], 70, 192)
    out[:, : merged.shape[1]] = merged
    ys, xs = torch.meshgrid(torch.arange(rows // 2), torch.arange(cols // 2), indexing="ij")
    where = torch.full((pixels.shape[0], 70, 2), -1, dtype=torch.long)
    where[:, : merged.shape[1]] = torch.stack([xs.flatten(), ys.flatten()], dim=-1)
    return {**kwargs, "pixel_values": out, "image_position_ids": where}


@pytest.mark.parametrize("family", _POSITIONED)
def test_gemma4_images_run_the_cached_loop_equal_cpu_and_another_count_and_size_compile_nothing(family):
    """Gemma 4's images (patch rows padded to its processor's length, with their positions): the vision graph keeps
    each image's features by its real rows (counted on the host, where upstream masks them by the positions'
    values), so calls run hf_tpu's loop and equal the CPU's. After ``hf_tpu.warmup`` of one and two 16 x 32 images
    (strict: a graph warm-up missed would raise), calls with one or two images, and with a 32 x 16 image (another
    size, as many rows and tokens: the same graphs), compile nothing; their logits equal the CPU's too."""
    _, cpu, tpu, _ = _gemma4_pair(family)

    def prompt(images, text, seed, size):
        kwargs = _positioned_prompt(images, text, seed, size)
        return _unified(kwargs) if family == "gemma4_unified" else kwargs

    report = hf_tpu.warmup(
        tpu, max_prompt_len=32, buckets=[32, 64], batch_sizes=[1], max_new_tokens=4, image_sizes=[(16, 32)],
        num_images=[1, 2], strict=True, progress=False,
    )  # fmt: skip
    assert len([key for key in report.graphs if key[0] == "positioned_vision"]) == 2  # (one per image count)
    try:
        for images, text, seed, size in [(1, 5, 0, (16, 32)), (2, 3, 1, (16, 32)), (1, 9, 2, (32, 16))]:
            kwargs = prompt(images, text, seed, size)
            assert explain(tpu, **kwargs, max_new_tokens=4).loop == "cached"
            with hf_tpu.sim.stats() as s:
                got = tpu.generate(**kwargs, max_new_tokens=4, do_sample=False)
            assert torch.equal(got, cpu.generate(**kwargs, max_new_tokens=4, do_sample=False)), (images, size)
            assert s.compiles == 0 and s.shape_signatures <= 4, (images, size, s.compiles, s.shape_signatures)
    finally:
        generation.configure(tpu, strict=False)
    # the logits too (greedy tokens can hide a small change of the images' features): the same on the cached loop
    kwargs = prompt(2, 3, 1, (16, 32))
    asked = dict(max_new_tokens=2, do_sample=False, output_logits=True, return_dict_in_generate=True)
    assert explain(tpu, **kwargs, **asked).loop == "cached"
    got, want = tpu.generate(**kwargs, **asked), cpu.generate(**kwargs, **asked)
    torch.testing.assert_close(torch.stack(got.logits).cpu(), torch.stack(want.logits), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", _families(["llava", "gemma3", "qwen2_vl"]))
def test_image_prefill_reads_nothing_on_the_host_and_the_image_tokens_are_checked_there(family):
    """Upstream's forward checks that the prompt holds one image token per feature row (``torch_compilable_check`` on
    a tensor): in a compiled graph that is a read of a device value on the host, which torch_tpu refuses to lower
    (tests/contract/test_tpu_compile.py). hf_tpu traces its image prefill without it and checks the host ids: a
    one-token generate with an image reads one value (its token), and a prompt one image token short raises
    ImageTokensError (a ValueError, as upstream's check raises on the CPU)."""
    from hf_tpu.transformers._images import ImageTokensError

    family, cpu, tpu, per_image = _pair(family)
    kwargs = _prompt(family, per_image, images=1, text=5, seed=5)
    _generate(tpu, kwargs, 1)
    with hf_tpu.sim.stats() as s:
        got = _generate(tpu, kwargs, 1)
    assert torch.equal(got, _generate(cpu, kwargs, 1))
    assert s.d2h_copies == 1 and s.host_syncs == 1, (s.d2h_copies, s.host_syncs)
    ids = kwargs["input_ids"].clone()
    ids[0, int((ids[0] == IMAGE).nonzero()[0])] = 5  # one image token fewer
    short = {**kwargs, "input_ids": ids}
    if "token_type_ids" in short:
        short["token_type_ids"] = (ids == IMAGE).long()
    with pytest.raises(ValueError):
        _generate(cpu, short, 1)
    expected = (per_image if family != "qwen2_vl" else 4) - 1
    match = rf"holds {expected} image token\(s\) \(id {IMAGE}\) and its images fill"
    with pytest.raises(ImageTokensError, match=match):
        _generate(tpu, short, 1)


# Idefics2 (a patch real when all its pixels are, a perceiver connector taking the patches' mask) and SmolVLM (any
# pixel real; with no real image it keeps one): each text row's images padded with all-zero images to the most of a
# row, with the mask of their real pixels
_PADDED = ("idefics2", "smolvlm")


def _padded_pair(family: str) -> tuple:
    import transformers as T

    if family in _PAIRS:
        return _PAIRS[family]
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=16,
                  patch_size=4)  # fmt: skip
    if family == "idefics2":
        cls = T.Idefics2ForConditionalGeneration
        perceiver = dict(resampler_n_latents=4, resampler_depth=1, resampler_n_heads=2, resampler_head_dim=8,
                         num_key_value_heads=1)  # fmt: skip  (4 latents: 4 tokens per image)
        config = T.Idefics2Config(vision_config=vision, text_config=T.MistralConfig(**_TEXT), image_token_id=IMAGE,
                                  perceiver_config=perceiver)  # fmt: skip
    else:
        cls = T.SmolVLMForConditionalGeneration
        config = T.SmolVLMConfig(vision_config=vision, text_config=T.LlamaConfig(**_TEXT), image_token_id=IMAGE,
                                 scale_factor=2)  # fmt: skip  (a 4 x 4 patch grid folded 2 x 2: 4 tokens per image)
    _PAIRS[family] = (family, *_cpu_and_tpu(cls, config), 4)
    return _PAIRS[family]


def _padded_prompt(counts: list[int], text: int, seed: int) -> dict:
    """The processor's output for text rows holding ``counts`` images of 16 x 16 pixels (4 tokens each), rows
    left-padded to the longest: the images ``(rows, most images, 3, 16, 16)``, a row's missing ones all zero, and the
    mask of real pixels; each row's last image has only its top 14 pixel rows real (its padding pixels zero), so its
    last patch row is partly real (not a real patch by Idefics2's rule, one by SmolVLM's)."""
    g = torch.Generator().manual_seed(seed)
    rows = [
        torch.cat([torch.randint(3, 60, (text + i,), generator=g), torch.full((4 * n,), IMAGE),
                   torch.randint(3, 60, (3,), generator=g)])  # fmt: skip
        for i, n in enumerate(counts)
    ]
    length = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    pixels = torch.zeros(len(rows), max(counts), 3, 16, 16)
    real = torch.zeros(len(rows), max(counts), 16, 16, dtype=torch.long)
    for i, (row, n) in enumerate(zip(rows, counts)):
        ids[i, length - len(row) :], mask[i, length - len(row) :] = row, 1
        pixels[i, :n] = torch.rand(n, 3, 16, 16, generator=g)
        real[i, :n] = 1
        pixels[i, n - 1, :, 14:], real[i, n - 1, 14:] = 0, 0
    return {"input_ids": ids, "attention_mask": mask, "pixel_values": pixels, "pixel_attention_mask": real}


@pytest.mark.parametrize("family", _PADDED)
def test_padded_images_drop_on_the_host_equal_cpu_read_nothing_and_warmed_calls_compile_nothing(family):
    """Idefics2's and SmolVLM's encoders drop a row's padding images by their pixel values (a boolean-mask index, then
    ``tolist()`` of per-row counts: host reads torch_tpu refuses to lower). hf_tpu drops them on the host by the same
    rule and the ``"padded_vision"`` graph runs the model's vision model and connector on the real images only: calls
    with one or two images, and a batch whose rows hold two and one (a padding image), run hf_tpu's loop, equal the
    CPU's, and no graph reads the host; after warm-up (strict) of one and two images a row, such calls compile
    nothing, and a second batch of the first's shapes compiles nothing either. Images all padding: SmolVLM keeps the
    first (upstream's rule, equal to the CPU), Idefics2 has none to encode (NoImagesError; upstream fails too)."""
    from hf_tpu.transformers import _images

    _, cpu, tpu, _ = _padded_pair(family)
    assert _images.padded_rule(tpu) == {
        "full": family == "idefics2", "keep_one": family == "smolvlm", "connector_mask": family == "idefics2"
    }  # fmt: skip
    reads = len(hf_tpu.sim.host_reads())
    report = hf_tpu.warmup(
        tpu, max_prompt_len=16, buckets=[16, 32], batch_sizes=[1], max_new_tokens=4, image_sizes=[(16, 16)],
        num_images=[1, 2], strict=True, progress=False,
    )  # fmt: skip
    assert {key[1] for key in report.graphs if key[0] == "padded_vision"} == {1, 2}
    calls = [([1], 5, 0), ([2], 3, 1), ([1], 9, 2)]
    try:
        for counts, text, seed in calls:
            kwargs = _padded_prompt(counts, text, seed)
            assert explain(tpu, **kwargs, max_new_tokens=4).loop == "cached"
            with hf_tpu.sim.stats() as s:
                got = tpu.generate(**kwargs, max_new_tokens=4, do_sample=False)
            assert torch.equal(got, cpu.generate(**kwargs, max_new_tokens=4, do_sample=False)), counts
            assert s.compiles == 0 and s.shape_signatures <= 4, (counts, s.compiles, s.shape_signatures)
    finally:
        generation.configure(tpu, strict=False)
    for index, (text, seed) in enumerate([(4, 3), (2, 4)]):  # rows of two images and one: a padding image
        kwargs = _padded_prompt([2, 1], text, seed)
        with hf_tpu.sim.stats() as s:
            got = tpu.generate(**kwargs, max_new_tokens=4, do_sample=False)
        assert torch.equal(got, cpu.generate(**kwargs, max_new_tokens=4, do_sample=False)), (text, seed)
        assert index == 0 or s.compiles == 0, s.compiles
    assert ("padded_vision", 3, (3, 3, 16, 16), "int64") in generation.compiled_graphs(tpu)  # (the real images only)
    # no real image: SmolVLM's encoder keeps the first one (empty); Idefics2's has none to encode (and fails on the CPU)
    kwargs = _padded_prompt([1], 5, 5)
    kwargs["pixel_values"].zero_()
    kwargs["pixel_attention_mask"].zero_()
    if family == "smolvlm":
        got = tpu.generate(**kwargs, max_new_tokens=4, do_sample=False)
        assert torch.equal(got, cpu.generate(**kwargs, max_new_tokens=4, do_sample=False))
    else:
        with pytest.raises(RuntimeError):
            cpu.generate(**kwargs, max_new_tokens=4, do_sample=False)
        with pytest.raises(_images.NoImagesError, match="every image given to Idefics2ForConditionalGeneration"):
            tpu.generate(**kwargs, max_new_tokens=4, do_sample=False)
    assert hf_tpu.sim.host_reads()[reads:] == []


def test_a_padded_family_encoder_with_another_patch_rule_runs_upstream_naming_why(monkeypatch):
    """A model of Idefics3's family whose encoder marks its patches by a rule ``padded_rule`` does not know (here
    SmolVLM's source with its "any pixel real" line changed) is not given the ``"padded_vision"`` graph: its image
    calls run upstream's loop, and explain names the reason."""
    from hf_tpu.transformers import _images

    _, _, tpu, _ = _padded_pair("smolvlm")
    source = _images._encoder_source(tpu)
    assert _images._PADDED_ANY in source
    changed = source.replace(_images._PADDED_ANY, _images._PADDED_ANY.replace(">0", ">1"))
    monkeypatch.setitem(_images._SOURCES, type(tpu.base_model), changed)
    assert _images.padded(tpu) and _images.padded_rule(tpu) is None
    route = explain(tpu, **_padded_prompt([1], 5, 0), max_new_tokens=4)
    assert route.loop == "upstream" and "rules hf_tpu does not know" in route.reason, route
