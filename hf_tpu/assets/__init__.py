"""Files that ship inside the hf_tpu package: the default demo and test model.

``tiny-lm`` is a 1.3M-parameter Llama (byte-level BPE, 4096 tokens, context 256) trained by this project
on Shakespeare's plays (public domain) with ``scripts/train_tiny_lm.py``. It exists so that the demo
(``hf-tpu generate --simulate``) prints recognisable text with no download, and so that tests run real,
non-random weights. It is not a useful language model for anything else; see its ``README.md``.

Importing this module imports neither torch nor transformers.

Example:
    >>> from hf_tpu.assets import default_model_path
    >>> (default_model_path() / "config.json").is_file()
    True
"""

from __future__ import annotations

from pathlib import Path

from hf_tpu.errors import MissingFileError

__all__ = ["DEFAULT_MODEL_NAME", "default_model_path"]

#: Folder name of the default model under ``hf_tpu/assets``.
DEFAULT_MODEL_NAME = "tiny-lm"


def default_model_path() -> Path:
    """Return the folder of the shipped default model, ready for ``from_pretrained``.

    The folder holds ``config.json``, ``model.safetensors``, ``generation_config.json``, the tokenizer
    files and a model card. It raises ``FileNotFoundError`` when the package was installed without its data
    files (for example from a source tree whose assets were removed).

    Example:
        >>> from transformers import AutoModelForCausalLM, AutoTokenizer   # doctest: +SKIP
        >>> path = default_model_path()
        >>> tok = AutoTokenizer.from_pretrained(path)                     # doctest: +SKIP
        >>> model = AutoModelForCausalLM.from_pretrained(path)            # doctest: +SKIP
    """
    path = Path(__file__).resolve().parent / DEFAULT_MODEL_NAME
    missing = [name for name in ("config.json", "model.safetensors", "tokenizer.json") if not (path / name).is_file()]
    if missing:
        raise MissingFileError(
            f"hf_tpu's default model is incomplete: {', '.join(missing)} not found in {path}. "
            "Reinstall hf-tpu (its wheel ships these files), or regenerate them with "
            "`python scripts/train_tiny_lm.py --out hf_tpu/assets/tiny-lm` from a source checkout."
        )
    return path
