"""Structured output in the compiled continuous-batching step (hf_tpu/serving/_grammar.py) on the simulated TPU:
every output of a JSON schema parses and validates, and greedy decoding under a grammar equals CPU transformers'
``generate`` with a logits processor that applies the same llguidance grammar on the CPU (:class:`CpuGrammar`)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
import transformers as T
from _timeouts import SAFETY_TIMEOUT_S

import hf_tpu.sim
from hf_tpu import serving
from hf_tpu.assets import default_model_path
from hf_tpu.serving import _grammar

llguidance = pytest.importorskip("llguidance")
from llguidance.torch import apply_token_bitmask_inplace, fill_next_token_bitmask  # noqa: E402

NEW = 48
EOS = 2

# Three schemas whose documents end within NEW tokens of the tiny model (bounded strings and integers, enums).
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"mood": {"enum": ["happy", "sad", "angry"]}, "loud": {"type": "boolean"}},
     "required": ["mood", "loud"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1,
                                               "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
]  # fmt: skip
PROMPTS = ["KING HENRY:", "First Citizen:", "ROMEO:", "JULIET:", "HAMLET:", "Enter the ghost.", "O, what a rogue",
           "To be, or not", "MACBETH:", "Good morrow,", "Sirrah,", "My lord,", "Exeunt.", "FALSTAFF:", "What, ho!",
           "Now is the winter", "Alas, poor", "Friends, Romans,", "LEAR:", "Come, come,"]  # fmt: skip


class CpuGrammar(T.LogitsProcessor):
    """The CPU reference: an llguidance matcher per row, advanced by the row's last token, its bitmask applied to
    the scores (the tokens it forbids at -inf) before greedy search picks."""

    def __init__(self, grammar: str, ll_tokenizer, prompt_len: int, vocab: int) -> None:
        self.grammar, self.tok, self.prompt_len = grammar, ll_tokenizer, prompt_len
        self.matchers: list = []
        self.mask = torch.full(((vocab + 31) // 32,), -1, dtype=torch.int32)[None]

    def __call__(self, input_ids, scores):
        if not self.matchers:
            self.matchers = [llguidance.LLMatcher(self.tok, self.grammar) for _ in range(input_ids.shape[0])]
        for row, matcher in enumerate(self.matchers):
            if input_ids.shape[1] > self.prompt_len:
                assert matcher.consume_token(int(input_ids[row, -1])), matcher.get_error()
            fill_next_token_bitmask(matcher, self.mask, 0)
            apply_token_bitmask_inplace(scores[row : row + 1], self.mask)
        return scores


@pytest.fixture(scope="module")
def tiny():
    """(tokenizer, cpu model, a started continuous-batching manager of the tpu model) of the shipped tiny-lm: 8 slots,
    compact JSON; the manager warmed up (its step graphs compiled) before the tests run."""
    import dataclasses

    hf_tpu.sim.enable()
    saved = dataclasses.asdict(serving.SETTINGS)
    serving.configure(max_batch_tokens=64, q_min=64, slots=8, page_size=64, kv_factor=16, json_whitespace=False)
    path = default_model_path()
    tok = T.AutoTokenizer.from_pretrained(path)
    cpu = T.AutoModelForCausalLM.from_pretrained(path).eval()
    with hf_tpu.enabled():
        tpu = T.AutoModelForCausalLM.from_pretrained(path).eval().to("tpu")
        manager = tpu.init_continuous_batching(generation_config=_config())
        _grammar.attach(manager, tok)
        manager.batch_processor = manager._create_batch_processor()  # as hf-tpu serve warms up: every step shape
        manager.warmup()
        manager.start()
        try:
            yield tok, cpu, manager
        finally:
            manager.stop(block=True, timeout=SAFETY_TIMEOUT_S)
    serving.configure(**saved)


def _config():
    return T.GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=EOS, pad_token_id=0,
                              repetition_penalty=1.0)  # fmt: skip


_COUNT = [0]


def _run(manager, requests: list[tuple[list[int], dict]]) -> list[list[int]]:
    """Each ``(prompt ids, add_request kwargs)`` through the manager: the generated tokens of each, in order."""
    ids = []
    for prompt, kw in requests:
        _COUNT[0] += 1
        ids.append(f"r{_COUNT[0]}")
        manager.add_request(prompt, request_id=ids[-1], max_new_tokens=NEW, temperature=0.0, **kw)
    out = {}
    for _ in requests:
        result = manager.get_result(timeout=SAFETY_TIMEOUT_S)
        assert result is not None, "a request did not finish"
        assert result.error is None, result.error
        out[result.request_id] = result.generated_tokens
    return [out[i] for i in ids]


def _cpu(cpu, ids: list[int], grammar: str | None, ll_tok) -> list[int]:
    procs = [CpuGrammar(grammar, ll_tok, len(ids), cpu.config.vocab_size)] if grammar else []
    out = cpu.generate(torch.tensor([ids]), generation_config=_config(), logits_processor=T.LogitsProcessorList(procs))
    tokens = out[0, len(ids) :].tolist()
    return tokens


def _text(tok, tokens: list[int]) -> str:
    return tok.decode([t for t in tokens if t != EOS], skip_special_tokens=True)


def test_json_schemas_parse_validate_and_equal_cpu_greedy(tiny):
    tok, cpu, manager = tiny
    ll_tok = _grammar.llguidance_tokenizer(tok, cpu.config.vocab_size)
    grammars = [_grammar.grammar_of({"response_format": {"type": "json_schema", "json_schema": {"name": f"s{i}",
                                     "schema": s}}})[0] for i, s in enumerate(SCHEMAS)]  # fmt: skip
    requests, expected = [], []
    for p, prompt in enumerate(PROMPTS):
        ids = tok(prompt)["input_ids"]
        for g, grammar in enumerate(grammars):
            requests.append((ids, {"grammar": grammar}))
            expected.append((g, ids, grammar))
        if p % 5 == 0:  # an unconstrained request in the same steps keeps its own (CPU-equal) tokens
            requests.append((ids, {}))
            expected.append((None, ids, None))
    with hf_tpu.sim.stats() as s:
        got = _run(manager, requests)
    for i, (g, ids, grammar) in enumerate(expected):
        tokens = got[i]
        assert tokens == _cpu(cpu, ids, grammar, ll_tok), f"request {i} (schema {g}): {_text(tok, tokens)!r}"
        if g is not None:
            assert tokens[-1] == EOS, f"request {i} did not end its document: {_text(tok, tokens)!r}"
            jsonschema.validate(json.loads(_text(tok, tokens)), SCHEMAS[g])
    assert s.compiles == 0  # the masks are data of the warmed step graphs


def test_choice_regex_and_json_object(tiny):
    tok, cpu, manager = tiny
    ll_tok = _grammar.llguidance_tokenizer(tok, cpu.config.vocab_size)
    bodies = [{"guided_choice": ["yes", "no", "perhaps"]}, {"guided_regex": r"[0-9]{3}-[a-z]{2}"},
              {"structured_outputs": {"choice": ["red", "green"]}}, {"response_format": {"type": "json_object"}},
              {"guided_json": json.dumps(SCHEMAS[1])}]  # fmt: skip
    prompts = [tok(p)["input_ids"] for p in PROMPTS[:4]]
    requests = [(ids, {"grammar": _grammar.grammar_of(b)[0]}) for b in bodies for ids in prompts]
    got = _run(manager, requests)
    for i, (ids, kw) in enumerate(requests):
        assert got[i] == _cpu(cpu, ids, kw["grammar"], ll_tok), f"request {i}"
    texts = [_text(tok, tokens) for tokens in got]
    n = len(prompts)
    assert all(t in ("yes", "no", "perhaps") for t in texts[:n])
    import re

    assert all(re.fullmatch(r"[0-9]{3}-[a-z]{2}", t) for t in texts[n : 2 * n]), texts[n : 2 * n]
    assert all(t in ("red", "green") for t in texts[2 * n : 3 * n])
    for tokens in got[3 * n : 4 * n]:  # JSON object mode: the tiny model never closes its first key within the
        # budget, so each output is checked as a prefix its grammar takes whole (an object once it ends)
        body = [t for t in tokens if t != EOS]
        assert llguidance.LLMatcher(ll_tok, requests[3 * n][1]["grammar"]).validate_tokens(body) == len(body)
        assert _text(tok, tokens).startswith("{")
    for t in texts[4 * n :]:
        jsonschema.validate(json.loads(t), SCHEMAS[1])


def test_one_constraint_per_request_and_named_errors():
    assert _grammar.grammar_of({"prompt": "x"}) == (None, None)
    assert _grammar.grammar_of({"response_format": {"type": "text"}}) == (None, None)
    from hf_tpu.errors import InvalidArgumentError

    for body, words in [
        ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_regex and guided_choice"),
        ({"structured_outputs": {"json": {}, "regex": "a"}}, "exactly one of"),
        ({"structured_outputs": {"yaml": "x"}}, "exactly one of"),
        ({"guided_choice": []}, "non-empty list"),
        ({"guided_json": "{not json"}, "not a JSON schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "needs its 'schema'"),
    ]:
        with pytest.raises(InvalidArgumentError, match=words):
            _grammar.grammar_of(body)


def test_protocol_takes_the_fields_and_names_bad_ones():
    from hf_tpu.serving._openai import RequestError
    from hf_tpu.serving.protocol import validate

    validate("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                      "response_format": {"type": "json_schema",
                                                          "json_schema": {"name": "x", "schema": SCHEMAS[0]}}})
    validate("/v1/completions", {"prompt": "hi", "guided_choice": ["a", "b"], "guided_decoding_backend": "guidance"})
    for body, param in [({"prompt": "hi", "guided_choice": "a"}, "guided_choice"),
                        ({"prompt": "hi", "guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
                        ({"prompt": "hi", "structural_tag": "x"}, "structural_tag"),
                        ({"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
                         "response_format")]:  # fmt: skip
        with pytest.raises(RequestError) as info:
            validate("/v1/completions", body)
        assert info.value.param.startswith(param), (body, info.value.param)
