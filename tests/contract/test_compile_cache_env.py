"""The compilation-cache environment variables hf_tpu.compile_cache names are the ones torch_tpu's runtime reads.

torch_tpu reads them in C++ (no Python source names them): the strings are in the glue library built for the
installed torch, ``csrc/common/glue_<torch>/libpywrap_<torch>_common.so``.
"""

from pathlib import Path

import torch
import torch_tpu

from hf_tpu import compile_cache


def _glue_library() -> Path:
    version = "_".join(torch.__version__.split("+")[0].split(".")[:3])
    (lib,) = (Path(torch_tpu.__file__).parent / "csrc" / "common" / f"glue_{version}").glob("libpywrap_*_common.so")
    return lib


def test_the_cache_variables_are_read_by_the_runtime():
    data = _glue_library().read_bytes()
    for name in (compile_cache.TORCH_TPU_TIER2_ENV, compile_cache.TORCH_TPU_TIER3_ENV):
        assert name.encode() + b"\0" in data, name
    assert b"GetTier2CompilationCachePath" in data and b"GetTier3CacheRootDir" in data
