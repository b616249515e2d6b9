"""Tiny encoders for the encoder tests (:func:`hf_tpu.testing.tiny_encoder`), saved once per session.

The simulated device is on for the whole module, and hf_tpu's ``device_map`` (``pipeline(device="tpu")``) and
``encoders`` integrations with it.
"""

from __future__ import annotations

import pytest
import torch

import hf_tpu
import hf_tpu.sim


def texts(n: int = 64, seed: int = 0, longest: int = 60) -> list[str]:
    """``n`` texts of 1 to ``longest`` words of the tiny tokenizer (mixed lengths, seeded)."""
    from hf_tpu.testing import ENCODER_WORDS

    words = ENCODER_WORDS[5:]
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, longest + 1, (n,), generator=g).tolist()
    return [" ".join(words[int(i)] for i in torch.randint(0, len(words), (k,), generator=g)) for k in lengths]


@pytest.fixture(scope="session")
def encoder_dir(tmp_path_factory):
    """``encoder_dir(family, head="AutoModel") -> path``: a tiny encoder of ``family`` with that head, saved once."""
    from hf_tpu.testing import tiny_encoder

    made: dict[tuple[str, str], object] = {}

    def make(family: str = "bert", head: str = "AutoModel"):
        if (family, head) not in made:
            path = tmp_path_factory.mktemp(f"{family}-{head}")
            tiny_encoder(family, path, head=head)
            made[family, head] = path
        return made[family, head]

    return make


@pytest.fixture(scope="module", autouse=True)
def _encoders_enabled():
    hf_tpu.sim.enable()
    with hf_tpu.enabled("device_map", "encoders"):
        yield
