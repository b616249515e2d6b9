"""A vision-language model's image layout is one value (``hf_tpu.transformers._images.image_layout``), and the
families introspection cannot tell apart are one table (``_images.LAYOUTS``), which no other module of hf_tpu names:
a new family of an existing layout is one entry there. The tiny families of ``test_vision_generate`` get the layouts
their tests serve; a family renamed (a ``model_type`` nothing knows) runs upstream's loop until its one entry is
added, then hf_tpu's cached loop. The layouts' calls end to end, equal to the CPU: ``test_vision_generate`` (core:
``test_greedy_with_images_equals_cpu_from_host_pixels[qwen2_vl]``, whose layout comes from its entry alone)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import hf_tpu.transformers._images as _images
from hf_tpu.transformers import explain, generation
from hf_tpu.transformers._images import LAYOUTS, ImageLayout

import test_vision_generate as vlm  # (this folder's tiny vision-language families)

PACKAGE = Path(_images.__file__).resolve().parents[1]
# test data, not the engine: the tiny configs' names (hf_tpu.testing's "qwen3_5" is a text-only tiny family) and the
# benchmarks' picks of architectures to sweep
TEST_DATA = (PACKAGE / "testing.py", PACKAGE / "benchmarks")


def _constants(path: Path) -> list[tuple[str, int]]:
    """The string constants of a module equal to a family of the table, with their lines."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [(n.value, n.lineno) for n in ast.walk(tree) if isinstance(n, ast.Constant) and n.value in LAYOUTS]


def test_the_table_is_the_one_place_that_names_a_family():
    assert LAYOUTS and all(isinstance(layout, ImageLayout) for layout in LAYOUTS.values())
    named = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == Path(_images.__file__).resolve() or any(path.is_relative_to(p) for p in TEST_DATA):
            continue
        named.update({f"{path.relative_to(PACKAGE.parent)}:{line}": value for value, line in _constants(path)})
    assert named == {}, named
    # in _images, each family once: its entry (no second list, such as the grid tuples the table replaced)
    found = [value for value, _ in _constants(Path(_images.__file__))]
    assert sorted(found) == sorted(LAYOUTS), found
    source = Path(_images.__file__).read_text()
    assert "_GRID_MODELS" not in source and "_GRID_TOWERS" not in source


_EXPECTED = {
    "llava": ImageLayout.PLAIN, "gemma3": ImageLayout.PLAIN, "mistral3": ImageLayout.PLAIN,
    "qwen2_vl": ImageLayout.GRID, "qwen2_5_vl": ImageLayout.GRID, "exaone4_5": ImageLayout.GRID_TOWER,
    "lfm3_vl": ImageLayout.GRID_CONSTANTS, "hyperclovax_vision_v2": ImageLayout.GRID_CONSTANTS,
    "idefics3": ImageLayout.PADDED, "idefics2": ImageLayout.PADDED, "smolvlm": ImageLayout.PADDED,
    "gemma4": ImageLayout.POSITIONED, "gemma4_unified": ImageLayout.POSITIONED,
}  # fmt: skip


def _tiny(family: str):
    if family in vlm._BUILDERS:
        return vlm._pair(family)[2]
    if family in vlm._POSITIONED:
        return vlm._gemma4_pair(family)[2]
    return vlm._padded_pair(family)[2]


@pytest.mark.parametrize("family", sorted(_EXPECTED))
def test_each_tiny_family_has_its_layout_and_the_questions_of_its_images_read_it(family):
    model = _tiny(family)
    layout = _images.image_layout(model)
    assert layout is _EXPECTED[family]
    assert _images.grid_model(model) == (layout is ImageLayout.GRID)
    assert _images.grid_tower(model) == (layout in (ImageLayout.GRID, ImageLayout.GRID_TOWER))
    assert _images.takes_grid(model) == (layout is ImageLayout.GRID_CONSTANTS)
    assert _images.positioned(model) == (layout is ImageLayout.POSITIONED)
    assert _images.padded(model) == (layout is ImageLayout.PADDED)
    assert _images.mrope_rows(model) == (3 if layout is ImageLayout.GRID else 1)
    assert (getattr(model.config, "model_type", None) in LAYOUTS) == (layout in (ImageLayout.GRID,
                                                                                ImageLayout.GRID_TOWER))  # fmt: skip


def test_a_text_model_has_no_layout():
    import transformers as T

    from hf_tpu.testing import tiny_config

    with torch.device("meta"):
        model = T.LlamaForCausalLM(tiny_config("llama"))
    assert _images.image_layout(model) is None and _images.mrope_rows(model) == 1
    assert not (_images.grid_tower(model) or _images.takes_grid(model) or _images.positioned(model))


def _renamed(monkeypatch, listed: bool):
    """A tiny Qwen2-VL whose config names a family nothing knows (a new family with Qwen2-VL's layout), listed in
    the table by one entry or not, and its CPU twin."""
    cls, config, _ = vlm._BUILDERS["qwen2_vl"]()
    config.model_type = "qwen2_vl_renamed"
    if listed:
        monkeypatch.setitem(LAYOUTS, "qwen2_vl_renamed", ImageLayout.GRID)
    return vlm._cpu_and_tpu(cls, config)


def test_a_new_family_of_an_existing_layout_is_one_entry_of_the_table(monkeypatch):
    """Unlisted, a renamed Qwen2-VL is read from its encoder (it takes the grid) and, as it numbers its positions from
    its images, its image calls run upstream's loop, the reason naming the families that layout serves; with its
    one entry, its layout is Qwen2-VL's and they run hf_tpu's cached loop. The layout is decided once per model."""
    kwargs = vlm._prompt("qwen2_vl", 4, images=1, text=5, seed=0)
    _, unlisted = _renamed(monkeypatch, listed=False)
    assert _images.image_layout(unlisted) is ImageLayout.GRID_CONSTANTS
    route = explain(unlisted, **kwargs, max_new_tokens=4)
    assert route.loop == "upstream" and "numbers its positions from the images" in route.reason, route
    assert "qwen2_vl," in route.reason and "qwen2_vl_renamed" not in route.reason, route
    _, listed = _renamed(monkeypatch, listed=True)
    assert _images.image_layout(listed) is ImageLayout.GRID and _images.mrope_rows(listed) == 3
    assert explain(listed, **kwargs, max_new_tokens=4).loop == "cached"
    assert _images.image_layout(unlisted) is ImageLayout.GRID_CONSTANTS  # (decided at its first ask)


@pytest.mark.slow  # (the grid path end to end stays in the core tier: test_vision_generate's qwen2_vl)
def test_a_family_added_by_one_entry_generates_equal_to_the_cpu_on_the_cached_loop(monkeypatch):
    cpu, tpu = _renamed(monkeypatch, listed=True)
    kwargs = vlm._prompt("qwen2_vl", 4, images=2, text=5, seed=1)
    assert explain(tpu, **kwargs, max_new_tokens=4).loop == "cached"
    got = vlm._generate(tpu, kwargs, 4)
    assert torch.equal(got.cpu(), vlm._generate(cpu, kwargs, 4))
    kinds = {key[0] for key in generation.compiled_graphs(tpu)}
    assert "grid_vision" in kinds and any(kind.startswith("mm_prefill") and "mrope" in kind for kind in kinds), kinds
