"""Test-suite set-up: every test runs with the simulated ``tpu`` device registered in this process.

torch_tpu must not autoload on a host without chips (libtpu would look for the cloud metadata server), so
autoload is turned off before torch is imported.
"""

import os

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
