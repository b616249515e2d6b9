"""The ``generation`` integration: route ``GenerationMixin.generate`` on TPU-placed models through hf_tpu's loop.

Upstream's ``generate`` keeps doing all the argument handling; the replacement only adds a ``custom_generate``
loop (upstream's own extension point) when the model sits on a ``tpu`` device and the call is greedy search or
sampling. On every other device it calls upstream unchanged. Tested with transformers 5.23.0 and 5.25.0 (the names
that changed in between, ``past_key_values`` -> ``cache``, are read from the installed version:
:mod:`hf_tpu.transformers._upstream`); :func:`hf_tpu.disable` puts the original back. Smaller patches ride
with it: rotary frequencies answered from the device (:mod:`~hf_tpu.transformers._rope_on_device`) and sdpa's
grouped-query attention on tpu tensors (:mod:`~hf_tpu.transformers._sdpa_gqa`), the sdpa mask's padding as a
slice on tpu tensors (:func:`~hf_tpu.transformers._cache.static.apply_padding_mask`); Whisper's language detection
takes features left on the host (:mod:`~hf_tpu.transformers._whisper_door`); ``np.prod`` of a static shape is an
integer in the compiled graphs (:mod:`~hf_tpu.transformers._numpy_fold`: LLaVA-NeXT's image encoder), and so are
``tolist()``/``item()`` of a tensor built from constants only (:mod:`~hf_tpu.transformers._tolist_fold`: vision
encoders sizing their splits from the grids and image sizes, no read of a device value on the host).
"""

from __future__ import annotations

from hf_tpu._patch import patch

__all__ = ["FEATURE", "apply"]

FEATURE = "generation"


def apply() -> None:
    from transformers.generation.utils import GenerationMixin

    from hf_tpu.transformers import (
        _decode_attention,
        _numpy_fold,
        _rope_on_device,
        _sdpa_gqa,
        _tolist_fold,
        _upstream,
        _whisper_door,
        generation,
    )

    from hf_tpu.transformers._cache import static as _cache_static

    upstream = GenerationMixin.__dict__["generate"]
    upstream = getattr(upstream, "__hf_tpu_upstream__", upstream)
    _upstream._UPSTREAM_GENERATE = upstream
    generate = generation.entry(upstream)  # generation's own function, under upstream's name and signature
    patch(GenerationMixin, "generate", generate, feature=FEATURE, package="transformers", versions=">=5.23,<6")
    _rope_on_device.apply(FEATURE)  # one copy each way per decode step for models that rebuild rotary frequencies
    _sdpa_gqa.apply(FEATURE)  # KV heads reach sdpa unrepeated on tpu (no repeat_kv expansion in the graphs)
    _decode_attention.apply(FEATURE)  # one-token attention as grouped products, not the flash kernel's grid
    _cache_static.apply_padding_mask(FEATURE)  # the sdpa mask's padding as a slice, not a gather of single elements
    _whisper_door.apply(FEATURE)  # Whisper's language detection takes host input_features
    _numpy_fold.apply(FEATURE)  # np.prod of a static shape stays an int in a graph (LLaVA-NeXT's image encoder)
    _tolist_fold.apply(FEATURE)  # tolist()/item() of a tensor of constants: numbers, not host reads (vision splits)
