"""Every remedy a generation error names exists and works (issue #16).

The messages are produced by the real code paths; each ``hf_tpu.<...>(...)`` call a message names is resolved by
import, and each keyword it shows must be a parameter of that function.
"""

from __future__ import annotations

import importlib
import inspect
import re

import pytest

import hf_tpu
from hf_tpu.transformers import _graphs, _settings, configure
from hf_tpu.transformers._graph_key import GraphKind
from hf_tpu.transformers.buckets import BucketLadder, BucketOverflowError
from hf_tpu.transformers.generation import RecompileError, plan_shapes

CALL = re.compile(r"\b(hf_tpu(?:\.[A-Za-z_]\w*)+)\(([^()]*)\)")


class _Config:
    max_position_embeddings = 64
    is_encoder_decoder = False

    def get_text_config(self, decoder=True):
        return self


class _Model:
    def __init__(self):
        self.config = _Config()


def _resolve(dotted: str):
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


def _messages() -> list[str]:
    model = _Model()
    found = []
    for raise_it in (
        lambda: BucketLadder((16, 32)).bucket(40, "the prompt"),
        lambda: plan_shapes(model, 1, 65, 1),
        lambda: plan_shapes(model, 1, 60, 10),
        lambda: plan_shapes(model, 1, 1, 80, encoder_len=8),
        lambda: plan_shapes(model, 1, 1, 1, encoder_len=100),
    ):
        with pytest.raises(BucketOverflowError) as info:
            raise_it()
        found.append(str(info.value))
    state = _settings.ModelState(warmed=True)
    state.settings.strict = True
    with pytest.raises(RecompileError) as info:
        _graphs.run_graph(None, state, (GraphKind("decode"), 1, 32))
    found.append(str(info.value))
    return found


def test_every_named_remedy_resolves_and_takes_the_keywords_shown():
    checked = 0
    for message in _messages():
        calls = CALL.findall(message)
        assert calls, f"no remedy named in: {message}"
        for dotted, args in calls:
            fn = _resolve(dotted)
            params = inspect.signature(fn).parameters
            for keyword in re.findall(r"(\w+)=", args):
                assert keyword in params, f"{dotted} has no parameter {keyword!r} (message: {message})"
            checked += 1
    assert checked >= 6


def test_the_remedy_fixes_the_overflow():
    model = _Model()
    with pytest.raises(BucketOverflowError, match=r"hf_tpu\.transformers\.configure\(model, buckets="):
        plan_shapes(model, 1, 65, 1)
    hf_tpu.transformers.configure(model, buckets=[16, 32, 64, 128])
    assert plan_shapes(model, 1, 65, 1).prompt_bucket == 128
    assert configure is _settings.configure
