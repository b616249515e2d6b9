"""The bucketed encoder forward (hf_tpu/encoders) against the same model on the CPU, computed in each test.

Tolerance: the simulated device computes on the CPU in float32; a padded batch sums attention over more (masked,
exactly zero-weighted) keys and batches rows differently, so results match to float32 rounding: ``atol=1e-5``,
``rtol=1e-4`` (observed differences are below 1e-6).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import texts

import hf_tpu
import hf_tpu.sim
from hf_tpu.encoders import EncoderRecompileError, compiled_graphs, configure, explain, warmup
from hf_tpu.transformers.generation import WARNED

ATOL, RTOL = 1e-5, 1e-4


def _close(got, want) -> None:
    torch.testing.assert_close(torch.as_tensor(got), torch.as_tensor(want), atol=ATOL, rtol=RTOL)


def _pipelines(task: str, path, **kwargs):
    from transformers import pipeline

    return pipeline(task, model=str(path), device="cpu", **kwargs), pipeline(
        task, model=str(path), device="tpu", **kwargs
    )


def test_feature_extraction_pipeline_equals_cpu_with_one_compile_per_bucket(encoder_dir):
    cpu, tpu = _pipelines("feature-extraction", encoder_dir("bert"))
    corpus = texts(64)
    with hf_tpu.sim.stats() as s:
        one, eight = (
            tpu(corpus),
            tpu(corpus, batch_size=8),
        )  # one text a call, and batches of 8 padded to their longest
    for got, want in ((one, cpu(corpus)), (eight, cpu(corpus, batch_size=8))):
        assert len(got) == len(want) == 64
        for g, w in zip(got, want, strict=True):
            assert len(g[0]) == len(w[0])  # the pipeline's own (unbucketed) lengths come back
            _close(g, w)
    keys = compiled_graphs(tpu.model)
    assert len(keys) == len(set(keys))  # each bucket compiled once
    assert {k[:2] for k in keys} >= {(1, 16), (1, 32), (1, 64), (8, 64)}, keys
    assert 0 < s.compiles <= len(keys)


def test_warmed_pipelines_compile_nothing_over_a_mixed_corpus(encoder_dir):
    for task, head in (
        ("feature-extraction", "AutoModel"),
        ("text-classification", "AutoModelForSequenceClassification"),
    ):
        cpu, tpu = _pipelines(task, encoder_dir("bert", head))
        report = warmup(tpu.model, max_length=64, batch_sizes=[1, 8], progress=False)
        assert report.graphs == [(b, n) for b in (1, 8) for n in (16, 32, 64)]
        corpus = texts(64, seed=1)
        # text classification: every label's score (top_k=None), compared below; the same forward as the default
        # top-1 call (top_k is the pipeline's postprocessing), so the calls counted are the ones compared
        post = {} if task == "feature-extraction" else {"top_k": None}
        with hf_tpu.sim.stats() as s:
            one = tpu(corpus, **post)  # batch 1: one call per text, each at its own length
            eight = tpu(corpus, batch_size=8, **post)  # batches of 8 padded to their longest, the last one full
            tpu(corpus[:61], batch_size=8)  # a short last batch (5 rows): padded to the warmed 8, not compiled for
        assert s.compiles == 0, (task, compiled_graphs(tpu.model))
        if task == "feature-extraction":
            for got, want in ((one, cpu(corpus)), (eight, cpu(corpus, batch_size=8))):
                for g, w in zip(got, want, strict=True):
                    _close(g, w)
        else:
            want = cpu(corpus, top_k=None)
            for got in (one, eight):
                for g, w in zip(got, want, strict=True):
                    assert [x["label"] for x in g] == [x["label"] for x in w]
                    _close([x["score"] for x in g], [x["score"] for x in w])


@pytest.mark.parametrize(
    "family", ["bert", "xlm-roberta", "modernbert", "distilbert", "electra", "deberta-v2", "mpnet"]
)
@pytest.mark.parametrize(
    "head", ["AutoModel", "AutoModelForSequenceClassification", "AutoModelForTokenClassification"]
)
def test_model_call_equals_cpu_for_each_family_and_head(encoder_dir, family, head):
    import transformers
    from transformers import AutoTokenizer

    path = encoder_dir(family, head)
    cls = getattr(transformers, head)
    cpu = cls.from_pretrained(path).eval()
    tpu = cls.from_pretrained(path, device_map="tpu").eval()
    tok = AutoTokenizer.from_pretrained(path)
    batch = tok(texts(5, seed=2, longest=20), padding=True, return_tensors="pt")
    if family == "modernbert":
        batch.pop("token_type_ids", None)
    assert explain(tpu, **batch).bucketed
    with torch.no_grad():
        want = cpu(**batch, output_hidden_states=True)
        got = tpu(**{k: v.to("tpu") for k, v in batch.items()}, output_hidden_states=True)  # inputs on the device
        # inputs left on the CPU: the same graph as the call's with its inputs on the device (no second compile);
        # the plain call's graph (no hidden states) is compared in the pipeline, sentence-transformers, cross-encoder
        # and discriminator tests below
        on_host = tpu(**batch, output_hidden_states=True)
    # DeBERTa-v2 fills the positions the call's own mask hides with an average over all of its keys, so there (and
    # only there) a padded bucket gives other values: compare the positions the mask shows (docs/encoders.md).
    shown = batch["attention_mask"].bool() if family == "deberta-v2" else torch.ones_like(batch["input_ids"]).bool()
    assert family != "deberta-v2" or not shown.all()  # the batch has padding of its own

    def per_token(tensor):
        return tensor[shown] if tensor.dim() >= 3 else tensor

    for out in (got, on_host):
        assert set(out.keys()) == set(want.keys())
        for name, value in want.items():
            if isinstance(value, tuple):
                for g, w in zip(out[name], value, strict=True):
                    assert g.device.type == "tpu"
                    _close(per_token(g.cpu()), per_token(w))
            else:
                assert out[name].shape == value.shape
                _close(per_token(out[name].cpu()), per_token(value))
    assert len(compiled_graphs(tpu)) == 1, compiled_graphs(tpu)  # both calls ran the one bucketed graph


def test_electra_discriminator_token_logits_are_sliced_to_the_call(encoder_dir):
    """ElectraForPreTraining's logits are per token with no class axis, (batch, length): sliced in tokens too."""
    from transformers import AutoTokenizer, ElectraForPreTraining

    path = encoder_dir("electra", "AutoModelForPreTraining")
    cpu = ElectraForPreTraining.from_pretrained(path).eval()
    tpu = ElectraForPreTraining.from_pretrained(path, device_map="tpu").eval()
    batch = AutoTokenizer.from_pretrained(path)(texts(3, seed=4, longest=20), padding=True, return_tensors="pt")
    with torch.no_grad():
        want, got = cpu(**batch).logits, tpu(**batch).logits
    assert compiled_graphs(tpu) and got.shape == want.shape == batch["input_ids"].shape
    _close(got.cpu(), want)


def test_return_dict_false_and_positional_inputs(encoder_dir):
    from transformers import AutoModel

    path = encoder_dir("bert")
    cpu = AutoModel.from_pretrained(path).eval()
    tpu = AutoModel.from_pretrained(path, device_map="tpu").eval()
    ids = torch.randint(5, 96, (3, 7))
    with torch.no_grad():
        want = cpu(ids, return_dict=False)
        got = tpu(ids, return_dict=False)
    assert isinstance(got, tuple) and len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        _close(g.cpu(), w)


@pytest.mark.parametrize("family", ["bert", "mpnet", "deberta-v2"])
def test_sentence_transformers_encode_equals_cpu_and_compiles_nothing_after_warmup(encoder_dir, family):
    """Mean pooling reads the positions the mask shows only: DeBERTa-v2's embeddings equal the CPU's too."""
    st = pytest.importorskip("sentence_transformers")
    path = str(encoder_dir(family))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "No sentence-transformers model found ... creating mean pooling"
        cpu = st.SentenceTransformer(path, device="cpu")
        tpu = st.SentenceTransformer(path, device="tpu")
    corpus = texts(64, seed=3)
    want = cpu.encode(corpus, batch_size=16, convert_to_tensor=True)
    report = warmup(tpu[0].auto_model, max_length=64, batch_sizes=[16], progress=False)
    assert report.new_compiles == 3
    with hf_tpu.sim.stats() as s:
        got = tpu.encode(corpus, batch_size=16, convert_to_tensor=True)
    assert s.compiles == 0
    assert got.device.type == "tpu"
    _close(got.cpu(), want)


@pytest.mark.parametrize("family", ["bert", "deberta-v2"])
def test_cross_encoder_reranking_equals_cpu_and_compiles_nothing_after_warmup(tmp_path, family):
    """Reranking: sentence-transformers' CrossEncoder scores (query, document) pairs (token type ids 0 and 1) with a
    one-label sequence classifier."""
    st = pytest.importorskip("sentence_transformers")
    from hf_tpu.testing import tiny_encoder

    tiny_encoder(family, tmp_path, head="AutoModelForSequenceClassification", num_labels=1)
    cpu = st.CrossEncoder(str(tmp_path), device="cpu")
    tpu = st.CrossEncoder(str(tmp_path), device="tpu")
    pairs = list(zip(texts(32, seed=5, longest=20), texts(32, seed=6, longest=40), strict=True))
    want = cpu.predict(pairs, batch_size=8, convert_to_tensor=True)
    warmup(tpu.model, max_length=64, batch_sizes=[8], progress=False)
    with hf_tpu.sim.stats() as s:
        got = tpu.predict(pairs, batch_size=8, convert_to_tensor=True)
    assert s.compiles == 0 and s.h2d_copies > 0  # the warmed graphs ran on the device
    assert {key[:2] for key in compiled_graphs(tpu.model)} == {(8, 16), (8, 32), (8, 64)}
    _close(got.cpu(), want)


def test_strict_mode_refuses_a_graph_warm_up_did_not_compile(encoder_dir):
    from transformers import AutoModel

    tpu = AutoModel.from_pretrained(encoder_dir("bert"), device_map="tpu").eval()
    warmup(tpu, max_length=16, batch_sizes=[2], strict=True, progress=False)
    with torch.no_grad():
        tpu(torch.randint(5, 96, (2, 9)))  # within the warmed buckets
        with pytest.raises(EncoderRecompileError, match=r"batch 2 x length 32.*hf_tpu.encoders.warmup"):
            tpu(torch.randint(5, 96, (2, 20)))
    configure(tpu, strict=False)
    with torch.no_grad():
        tpu(torch.randint(5, 96, (2, 20)))


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        ({"labels": torch.tensor([0, 1])}, "labels given"),
        ({"output_attentions": True}, "output_attentions=True"),
        ({"position_ids": torch.arange(6).expand(2, 6)}, "position_ids given"),
    ],
)
def test_calls_the_bucketed_path_cannot_serve_run_eager_and_say_why_once(encoder_dir, kwargs, reason):
    from transformers import AutoModelForSequenceClassification

    path = encoder_dir("bert", "AutoModelForSequenceClassification")
    cpu = AutoModelForSequenceClassification.from_pretrained(path).eval()
    tpu = AutoModelForSequenceClassification.from_pretrained(path, device_map="tpu").eval()
    ids = torch.randint(5, 96, (2, 6))
    WARNED.clear()
    route = explain(tpu, input_ids=ids, **kwargs)
    assert not route.bucketed and reason in route.reason
    with torch.no_grad():
        want = cpu(input_ids=ids, **kwargs)
        with pytest.warns(UserWarning, match=reason):
            got = tpu(input_ids=ids, **{k: v.to("tpu") if torch.is_tensor(v) else v for k, v in kwargs.items()})
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # said once
            tpu(input_ids=ids, **{k: v.to("tpu") if torch.is_tensor(v) else v for k, v in kwargs.items()})
    assert compiled_graphs(tpu) == []
    _close(got.logits.cpu(), want.logits)
    if "labels" in kwargs:
        _close(got.loss.cpu(), want.loss)


def test_training_mode_and_overlong_inputs_take_the_eager_path(encoder_dir):
    from transformers import AutoModel

    tpu = AutoModel.from_pretrained(encoder_dir("bert"), device_map="tpu")
    tpu.train()
    assert "training mode" in explain(tpu, input_ids=torch.ones(1, 4, dtype=torch.long)).reason
    tpu.eval()
    configure(tpu, batch_sizes=[1, 2])
    assert "past the largest batch bucket (2)" in explain(tpu, input_ids=torch.ones(3, 4, dtype=torch.long)).reason
    assert "past the largest bucket (128" in explain(tpu, input_ids=torch.ones(1, 129, dtype=torch.long)).reason
    configure(tpu, bucketed=False)  # turned off for this model alone: upstream's forward, no warning
    assert "turned off for this model" in explain(tpu, input_ids=torch.ones(1, 4, dtype=torch.long)).reason
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error", UserWarning)
        tpu(torch.ones(1, 4, dtype=torch.long))
    assert compiled_graphs(tpu) == []


def test_disable_puts_upstream_forward_back():
    from transformers import BertModel

    assert hasattr(BertModel.forward, "__hf_tpu_upstream__")
    upstream = BertModel.forward.__hf_tpu_upstream__
    hf_tpu.disable("encoders")
    try:
        assert BertModel.forward is upstream
    finally:
        hf_tpu.enable("encoders")
    assert BertModel.forward.__hf_tpu_upstream__ is upstream


def test_warmup_refuses_a_model_off_the_tpu(encoder_dir):
    from transformers import AutoModel

    with pytest.raises(ValueError, match="model.to\\('tpu'\\)"):
        warmup(AutoModel.from_pretrained(encoder_dir("bert")), progress=False)


def test_an_output_the_path_cannot_slice_back_sends_the_model_to_eager_once(encoder_dir):
    from transformers import AutoModelForPreTraining

    path = encoder_dir("bert", "AutoModelForPreTraining")
    cpu = AutoModelForPreTraining.from_pretrained(path).eval()
    tpu = AutoModelForPreTraining.from_pretrained(path, device_map="tpu").eval()
    ids = torch.randint(5, 96, (2, 6))
    WARNED.clear()
    assert explain(tpu, input_ids=ids).bucketed  # known only once its graph has run
    with torch.no_grad(), pytest.warns(UserWarning, match="its output 'prediction_logits' has padded axes"):
        got = tpu(input_ids=ids)
    assert "prediction_logits" in explain(tpu, input_ids=ids).reason  # and the model stays on the eager path
    with torch.no_grad():
        want = cpu(input_ids=ids)
        _close(got.prediction_logits.cpu(), want.prediction_logits)
        _close(tpu(input_ids=ids).seq_relationship_logits.cpu(), want.seq_relationship_logits)


def test_a_causal_lm_on_an_encoder_trunk_generates_as_before_without_a_note():
    """RobertaForCausalLM (a GenerationMixin head: not wrapped) calls the wrapped RobertaModel with a cache: upstream's
    forward, logged, not warned; generate stays token-identical to the CPU."""
    from transformers import RobertaConfig, RobertaForCausalLM

    config = RobertaConfig(
        vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2, is_decoder=True,
    )  # fmt: skip
    torch.manual_seed(0)
    cpu = RobertaForCausalLM(config).eval()
    tpu = RobertaForCausalLM(config).eval()
    tpu.load_state_dict(cpu.state_dict())
    tpu.to("tpu")
    ids = torch.randint(3, 96, (1, 7))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        got = tpu.generate(ids, max_new_tokens=6, do_sample=False)  # upstream's generate: "generation" is off here
    assert torch.equal(got.cpu(), cpu.generate(ids, max_new_tokens=6, do_sample=False))


def test_hf_tpu_warmup_of_an_encoder_is_the_encoder_warmup(encoder_dir):
    from transformers import AutoModel

    from hf_tpu.encoders import EncoderWarmupReport
    from hf_tpu.errors import UserError

    tpu = AutoModel.from_pretrained(encoder_dir("bert"), device_map="tpu").eval()
    report = hf_tpu.warmup(tpu, max_prompt_len=20, batch_sizes=[3], max_new_tokens=8, progress=False)
    assert isinstance(report, EncoderWarmupReport) and report.graphs == [(4, 16), (4, 32)]
    with hf_tpu.sim.stats() as s, torch.no_grad():
        tpu(torch.randint(5, 96, (3, 20)))
    assert s.compiles == 0
    with pytest.raises(UserError, match="compile cache does not hold encoder graphs"):
        hf_tpu.warmup(tpu, cache_dir="/tmp/unused", progress=False)


def test_warmup_names_why_it_has_no_graph_to_compile(encoder_dir):
    from transformers import AutoModel, AutoModelForPreTraining

    from hf_tpu.errors import UserError

    pretraining = AutoModelForPreTraining.from_pretrained(
        encoder_dir("bert", "AutoModelForPreTraining"), device_map="tpu"
    )
    with pytest.raises(UserError, match="no graph to compile: .*'prediction_logits' has padded axes"):
        warmup(pretraining.eval(), max_length=16, progress=False)
    tpu = AutoModel.from_pretrained(encoder_dir("bert"), device_map="tpu").eval()
    hf_tpu.disable("encoders")
    try:
        with pytest.raises(UserError, match=r"no bucketed forward: turn on .*hf_tpu.enable\(\)"):
            warmup(tpu, max_length=16, progress=False)
    finally:
        hf_tpu.enable("encoders")
