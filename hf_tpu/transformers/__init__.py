"""hf_tpu's transformers integrations: generation on TPU (static cache, buckets, compiled graphs, warm-up).

Importing this package does not import transformers; the submodules do, when used.
"""
