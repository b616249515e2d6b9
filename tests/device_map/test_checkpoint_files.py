"""A truncated or corrupt safetensors file is named, with the fix, where hf_tpu is in the call (from_pretrained
with the integration on): safetensors' own error has no path, which leaves the user guessing which shard broke."""

from __future__ import annotations

import json
import struct

import pytest
from safetensors import SafetensorError

import hf_tpu
from hf_tpu.device_map.files import bad_safetensors_files, safetensors_problem
from hf_tpu.errors import CheckpointFileError, UserError
from hf_tpu.testing import tiny_model


@pytest.fixture
def sharded(tmp_path):
    """A tiny Llama saved in several safetensors shards."""
    model = tiny_model("llama")
    model.save_pretrained(tmp_path, max_shard_size="60KB")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) >= 2, shards
    return tmp_path, shards


def _cut(file, keep_fraction: float = 0.5) -> None:
    size = file.stat().st_size
    with open(file, "r+b") as f:
        f.truncate(int(size * keep_fraction))


def test_whole_files_have_no_problem(sharded):
    path, shards = sharded
    assert bad_safetensors_files(path) == []
    assert all(safetensors_problem(s) is None for s in shards)


def test_from_pretrained_names_the_truncated_shard(sharded):
    from transformers import AutoModelForCausalLM

    path, shards = sharded
    _cut(shards[-1])
    with hf_tpu.enabled("device_map"), pytest.raises(CheckpointFileError) as caught:
        AutoModelForCausalLM.from_pretrained(path)
    message = str(caught.value)
    assert f"{shards[-1]} is " in message and "(truncated)" in message
    assert all(str(s) not in message for s in shards[:-1])  # the whole shards are not blamed
    assert "Download it again" in message and "save_pretrained" in message
    assert isinstance(caught.value, OSError) and isinstance(caught.value, UserError)  # old except clauses still hold
    assert isinstance(caught.value.__cause__, SafetensorError)
    # the integration off: exactly upstream's error
    with pytest.raises(SafetensorError):
        AutoModelForCausalLM.from_pretrained(path)


def test_corrupt_header_and_short_file(tmp_path):
    header = b"{not json"
    (tmp_path / "a.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    (tmp_path / "b.safetensors").write_bytes(b"\x01\x02")
    meta = json.dumps({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}).encode()
    (tmp_path / "c.safetensors").write_bytes(struct.pack("<Q", len(meta)) + meta + b"\x00" * 20)  # 4 bytes extra
    problems = {f.name: p for f, p in bad_safetensors_files(tmp_path)}
    assert "not valid JSON (corrupt)" in problems["a.safetensors"]
    assert "shorter than the 8-byte header length" in problems["b.safetensors"]
    assert "(corrupt)" in problems["c.safetensors"]
