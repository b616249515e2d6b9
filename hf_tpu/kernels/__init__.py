"""Hub kernels on TPU: the kernel repositories shipped with hf_tpu and their registration in transformers.

- :func:`use_ragged_dot_experts` loads the ragged-dot MoE kernel (``hub/ragged-dot-tpu``) and registers it in
  transformers' experts interface; pass the returned name as ``experts_implementation``.
- :func:`register_experts` registers any kernel's ``experts_forward`` (say one from ``kernels.get_kernel``).
- :func:`load_local_kernel` / :func:`load_ragged_dot_kernel` load a Hub-layout kernel folder with ``kernels``;
  :func:`load_decode_attention_kernel` the ragged decode attention kernel (``hub/decode-attention-tpu``), which
  ``HF_TPU_DECODE_ATTENTION=ragged_kernel`` runs as a decode step's attention.
- ``hf_tpu.enable()`` on a TPU VM also lets plain ``kernels.get_kernel`` find ``torch-tpu`` build variants where
  ``kernels`` does not detect the ``tpu`` backend by itself (:func:`expose_tpu_backend`; kernels 0.17 looks for a
  ``torch.backends.tpu`` that torch-tpu 0.2.0 does not set); :func:`kernels_backend` is ``kernels``' own answer.

Example:
    >>> import hf_tpu.kernels
    >>> impl = hf_tpu.kernels.use_ragged_dot_experts()                                  # doctest: +SKIP
    >>> model = AutoModelForCausalLM.from_pretrained(path, experts_implementation=impl)  # doctest: +SKIP
"""

from __future__ import annotations

from hf_tpu.kernels.loader import (
    DECODE_ATTENTION_REPO,
    HUB_DIR,
    RAGGED_DOT_REPO,
    KernelsDetectionError,
    expose_tpu_backend,
    kernels_backend,
    load_decode_attention_kernel,
    load_local_kernel,
    load_ragged_dot_kernel,
    tpu_variant_selection,
)
from hf_tpu.kernels.registry import (
    RAGGED_DOT_NAME,
    apply,
    register_experts,
    registered_experts,
    unregister_experts,
    use_ragged_dot_experts,
)

__all__ = [
    "DECODE_ATTENTION_REPO",
    "HUB_DIR",
    "RAGGED_DOT_NAME",
    "RAGGED_DOT_REPO",
    "KernelsDetectionError",
    "apply",
    "expose_tpu_backend",
    "kernels_backend",
    "load_decode_attention_kernel",
    "load_local_kernel",
    "load_ragged_dot_kernel",
    "register_experts",
    "registered_experts",
    "tpu_variant_selection",
    "unregister_experts",
    "use_ragged_dot_experts",
]
