"""Whisper's language detection takes its ``input_features`` where the caller left them.

``WhisperForConditionalGeneration.generate`` (transformers 5.24, ``WhisperGenerationMixin``) detects the language,
when none is given to a multilingual model, by calling the model on ``input_features`` as they are
(``detect_language``): features left on the host, as the feature extractor returns them and as hf_tpu's loop takes
them, reach the first convolution against TPU weights, which fails ("Input type (torch.FloatTensor) and weight type
(tpuFloatType) should be the same"; on a chip the host convolution is ``aten::_slow_conv2d_forward``, which
torch_tpu refuses). On a model on a ``tpu`` device the patched method moves the features there first; the rest of
Whisper's ``generate`` keeps them where they are (its ``super().generate(...)`` reaches hf_tpu's loop, which moves
them itself). The detection itself stays upstream's: one eager encoder and decoder forward per call.
"""

from __future__ import annotations

import functools

from hf_tpu._patch import original, patch
from hf_tpu.transformers._settings import DEVICE_TYPES

__all__ = ["apply"]


def apply(feature: str) -> None:
    try:
        from transformers.models.whisper.generation_whisper import WhisperGenerationMixin
    except ImportError:  # pragma: no cover - a transformers without Whisper
        return
    upstream = original(WhisperGenerationMixin, "detect_language")

    @functools.wraps(upstream)
    def detect_language(self, input_features=None, *args, **kwargs):
        device = getattr(self, "device", None)
        if input_features is not None and device is not None and device.type in DEVICE_TYPES:
            input_features = input_features.to(device)
        return upstream(self, input_features, *args, **kwargs)

    patch(
        WhisperGenerationMixin, "detect_language", detect_language, feature=feature, package="transformers",
        versions=">=5.0,<6",
    )  # fmt: skip
