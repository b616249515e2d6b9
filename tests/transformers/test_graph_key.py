"""Typed graph kinds (hf_tpu.transformers._graph_key): built from a base and a variant, shown and stored as the text
hf_tpu wrote when kinds were strings, read back from that text only where it comes from outside (a manifest)."""

from __future__ import annotations

import json

import pytest
import torch

import hf_tpu
import hf_tpu.sim
from hf_tpu.transformers import _graphs, generation
from hf_tpu.transformers._graph_key import NO_VARIANT, GraphKind, Variant, public_key
from hf_tpu.transformers._loops.beam import beam_features
from hf_tpu.transformers._settings import compile_cache_of, model_state
from hf_tpu.transformers.warmup import _manifest_plans

QWEN3 = ("temperature", "top_k", "top_p", "sample")


def _old(base: str, *suffixes: str) -> str:
    """A kind's text as the loops concatenated it before kinds were typed (each suffix a "+..." string)."""
    text = base
    for suffix in suffixes:
        text += suffix
    return text


# Each loop's kinds, built now and as the loops joined them before (their order of concatenation)
_EVERY_FEATURE = {"mm_token_type_ids", "mrope", "token_type_ids", "hidden_states", "attentions"}
_BEAM_FEATURES = {*beam_features(3, 6, 1, "never", True), "attentions", "token_type_ids"}
CASES = [
    (GraphKind("decode"), _old("decode")),
    (GraphKind("encoder"), _old("encoder")),
    (GraphKind("prefill", Variant(QWEN3)), _old("prefill", "+temperature+top_k+top_p+sample")),
    (GraphKind("prefill", Variant(("repetition_penalty",))), _old("prefill", "+repetition_penalty")),
    (GraphKind("decode", Variant(("no_repeat_ngram(3)", "sample"))), _old("decode", "+no_repeat_ngram(3)+sample")),
    # cached loop: sampling, outputs, token types, rows of positions, image-token types
    (
        GraphKind("decode", Variant(QWEN3, _EVERY_FEATURE)),
        _old(
            "decode", "+temperature+top_k+top_p+sample", "+attentions+hidden_states", "+token_type_ids", "+mrope",
            "+mm_token_type_ids",
        ),
    ),
    (GraphKind("mm_prefill", Variant(features={"mrope"})), _old("mm_prefill", "+mrope")),
    # the loop without a cache: outputs, then token types
    (
        GraphKind("cacheless_prefill", Variant(features={"token_type_ids", "hidden_states"})),
        _old("cacheless_prefill", "+hidden_states", "+token_type_ids"),
    ),
    # beam search: sampling, beams, early stopping, beam sampling, outputs, token types
    (
        GraphKind("beam_decode", Variant(("repetition_penalty",), _BEAM_FEATURES)),
        _old("beam_decode", "+repetition_penalty", "+beams3x6e1+never+beam_sample", "+attentions", "+token_type_ids"),
    ),
    (
        GraphKind("beam_prefill", Variant(features=beam_features(4, 8, 0, True, False))),
        _old("beam_prefill", "+beams4x8e0+early"),
    ),
]


@pytest.mark.parametrize(("kind", "text"), CASES, ids=[text for _, text in CASES])
def test_a_kind_shows_the_text_the_loops_wrote_and_parses_back_to_itself(kind, text):
    assert str(kind) == kind.name == text
    assert GraphKind.parse(text) == kind
    assert str(GraphKind.parse(text)) == text
    assert repr(kind) == f"GraphKind.parse({text!r})"
    assert f"{kind} graph" == f"{text} graph"  # (how error messages and logs name it)


def test_construction_reads_its_parts():
    kind = GraphKind("decode", Variant(("top_k", "sample"), {"attentions"}))
    assert kind.base == "decode"
    assert kind.sampling == ("top_k", "sample")
    assert kind.features == frozenset({"attentions"})
    assert kind.variant == Variant(("top_k", "sample"), frozenset({"attentions"}))
    assert str(kind.variant) == "+top_k+sample+attentions"
    assert GraphKind("decode").variant == NO_VARIANT and not NO_VARIANT and str(NO_VARIANT) == ""
    assert kind.with_features("token_type_ids") == GraphKind("decode", kind.variant.with_features("token_type_ids"))
    assert kind.with_features("attentions") == kind  # (a set: adding it again changes nothing)


def test_features_in_any_order_make_one_kind_with_one_hash():
    a = GraphKind("decode", Variant(QWEN3, ["mrope", "attentions", "token_type_ids"]))
    b = GraphKind("decode", Variant(QWEN3, ["token_type_ids", "attentions", "mrope"]))
    c = GraphKind("decode", Variant(QWEN3).with_features("attentions").with_features("token_type_ids", "mrope"))
    assert a == b == c and hash(a) == hash(b) == hash(c) and len({a, b, c}) == 1
    assert str(a) == str(b) == "decode+temperature+top_k+top_p+sample+attentions+token_type_ids+mrope"
    seen = {(a, 1, 64): "graph"}
    assert seen[(b, 1, 64)] == "graph"  # (a graph key: the kind in a tuple, as run_graph's state keeps them)


def test_the_sampling_program_keeps_its_order_and_its_repeats():
    # processors run in order: another order is another graph (and another name in the compile cache)
    top_k_first, temperature_first = Variant(("top_k", "temperature")), Variant(("temperature", "top_k"))
    assert GraphKind("decode", top_k_first) != GraphKind("decode", temperature_first)
    twice = Variant(("no_repeat_ngram(2)", "no_repeat_ngram(2)"))
    assert str(twice) == "+no_repeat_ngram(2)+no_repeat_ngram(2)" and Variant.parse(str(twice)) == twice
    assert GraphKind("decode") != GraphKind("prefill") and GraphKind("decode") != "decode"  # (text is not a kind)


@pytest.mark.parametrize(
    "build",
    [
        lambda: GraphKind("decode+top_k"),  # a base holding the separator
        lambda: GraphKind(""),
        lambda: Variant(features={"attention"}),  # not a feature hf_tpu knows
        lambda: Variant(features={"beams4"}),
        lambda: Variant(("top_k+sample",)),
        lambda: Variant(("",)),
        lambda: GraphKind.parse("decode++sample"),
        lambda: GraphKind.parse("decode+attentions+top_k"),  # a sampling label after a feature: not hf_tpu's text
        lambda: GraphKind.parse("+top_k"),
        lambda: Variant.parse("top_k"),
    ],
)
def test_malformed_parts_and_texts_are_refused(build):
    with pytest.raises(ValueError):
        build()


def test_the_compile_cache_names_a_graph_by_its_text():
    """The graph ids (hashed into the cache's file names) and manifest entries are the text of the string keys."""
    text = "decode+temperature+top_k+top_p+sample+attentions"
    key = (GraphKind.parse(text), 1, 64)
    assert _graphs._graph_id(key, ()) == repr(((text, 1, 64), []))
    assert _graphs._graph_id(key, ((None, 0.5),)) == repr(((text, 1, 64), [0.5]))
    assert public_key(key) == (text, 1, 64)
    assert json.loads(json.dumps(list(public_key(key)))) == [text, 1, 64]


def _tiny(from_config):
    import transformers as T

    from hf_tpu.testing import tiny_config

    _, tpu = from_config(T.LlamaForCausalLM, tiny_config("llama", vocab_size=96))
    return tpu


def test_a_manifest_in_the_old_form_gives_warm_up_its_plans(from_config, tmp_path):
    """A manifest an earlier hf_tpu wrote (kinds as text, joined with "+") is read: the entries of the model's own
    variant become shape plans, the others and the malformed ones are passed over."""
    tpu = _tiny(from_config)
    tpu.generation_config.update(do_sample=True, temperature=0.6, top_k=20, top_p=0.95)
    generation.configure(tpu, compile_cache=tmp_path / "cache")
    state = model_state(tpu)
    space = _graphs.cache_namespace(compile_cache_of(state), tpu, state)
    entries = [
        ["prefill+temperature+top_k+top_p+sample", 2, 32, 64],
        ["decode+temperature+top_k+top_p+sample", 2, 64],  # (a decode entry: its prefill's plan covers it)
        ["cacheless_prefill+temperature+top_k+top_p+sample", 1, 48],
        ["prefill", 1, 16, 32],  # greedy search: another variant
        ["prefill+top_k+temperature+top_p+sample", 1, 16, 32],  # another order: another program
        ["prefill+temperature+top_k+top_p+sample+attentions", 1, 16, 32],  # with outputs: not the model's own
        ["prefill+temperature+top_k+top_p+sample+", 1, 16, 32],  # malformed
        ["prefill+attentions+temperature", 1, 16, 32],  # malformed: a label after a feature
        ["prefill+temperature+top_k+top_p+sample", 1, "16", 32],  # dims not ints
        "prefill",
        [],
    ]
    space.manifest_path.parent.mkdir(parents=True, exist_ok=True)
    space.manifest_path.write_text(json.dumps({"format": 1, "entries": entries}, indent=1))
    plans = _manifest_plans(tpu, state)
    assert plans == [generation.ShapePlan(2, 32, 32, 64), generation.ShapePlan(1, 1, 1, 48)]


def test_warm_up_compiles_an_old_manifests_graphs_and_records_them_as_text(from_config, tmp_path):
    tpu = _tiny(from_config)
    tpu.generation_config.update(repetition_penalty=1.3)  # (greedy search with a penalty: "+repetition_penalty")
    cache = tmp_path / "cache"
    generation.configure(tpu, compile_cache=cache)
    state = model_state(tpu)
    space = _graphs.cache_namespace(compile_cache_of(state), tpu, state)
    space.manifest_path.parent.mkdir(parents=True, exist_ok=True)
    old = {"format": 1, "entries": [["prefill+repetition_penalty", 2, 16, 32], ["decode+repetition_penalty", 2, 32]]}
    space.manifest_path.write_text(json.dumps(old, indent=1))
    report = hf_tpu.warmup(tpu, max_prompt_len=16, batch_sizes=[1], max_new_tokens=4, progress=False)
    assert ("prefill+repetition_penalty", 2, 16, 32) in report.graphs
    assert ("decode+repetition_penalty", 2, 32) in report.graphs
    assert all(isinstance(key[0], str) for key in report.graphs)
    shown = generation.compiled_graphs(tpu)
    assert set(report.graphs) <= set(shown) and all(isinstance(key[0], str) for key in shown)
    # the manifest keeps the old entries first and adds the new ones in the same form (kinds as text)
    entries = space.manifest()
    assert entries[:2] == old["entries"]
    assert all(list(key) in entries for key in shown) and all(isinstance(e[0], str) for e in entries)
    # each graph stored under the name its text gives (what an earlier hf_tpu stored it under)
    assert space.graph_path(repr((("decode+repetition_penalty", 2, 32), []))).exists()
    # a second model of the same weights loads every graph from the cache, through the same manifest
    again = _tiny(from_config)
    again.generation_config.update(repetition_penalty=1.3)
    generation.configure(again, compile_cache=cache)
    with hf_tpu.sim.stats() as s:
        second = hf_tpu.warmup(again, max_prompt_len=16, batch_sizes=[1], max_new_tokens=4, progress=False)
    assert second.from_cache == len(second.graphs) == len(report.graphs) and s.compiles == 0
    ids = torch.randint(3, 96, (2, 9), generator=torch.Generator().manual_seed(0))
    with hf_tpu.sim.stats() as s:
        again.generate(ids, max_new_tokens=4)
    assert s.compiles == 0
