"""hf_tpu's version, in a module of its own so that any module can read it without importing the hf_tpu facade."""

__version__ = "0.1.0.dev0"
