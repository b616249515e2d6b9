"""The ``encoders`` integration: encoder forwards on a ``tpu`` device run bucketed and compiled.

The seam is the ``forward`` of each encoder class of the families in :data:`MODEL_TYPES` (``BertModel``,
``BertForSequenceClassification``, ..., ``ModernBertModel``, ...), patched at class level through
:mod:`hf_tpu._patch` when :func:`hf_tpu.enable` runs (their modeling modules are imported then, ~0.1 s), reverted
by :func:`hf_tpu.disable`. Why ``forward`` and not another seam:

- ``nn.Module.__call__`` (or a ``__call__`` on ``PreTrainedModel``) would miss sentence-transformers, which calls
  ``auto_model.forward(**features)`` directly, and would put a wrapper in front of every model's call, decoders
  inside generate's compiled graphs included;
- a placement hook (``PreTrainedModel.to``, ``from_pretrained``) would miss placements that never pass there:
  ``SentenceTransformer(..., device="tpu")`` moves its modules with ``nn.Module.to``, and that patch belongs to the
  ``device_map`` integration already;
- a per-instance ``forward`` (accelerate's hooks) would need finding every instance, and ``_patch`` records hold
  their owner for good.

A class-level ``forward`` is reached by ``model(**batch)``, pipelines and sentence-transformers alike, touches the
listed encoder classes only (not their ``GenerationMixin`` siblings such as ``BertLMHeadModel``), and on any device
but ``tpu`` it is upstream's call after one device check. Inside hf_tpu's own call (the graph's trace, the eager
fallback) the inner forwards a head calls (``self.bert``) are upstream's. Written for transformers 5.24 (checked:
5.24.0).
"""

from __future__ import annotations

import functools
import importlib
import inspect

from hf_tpu._patch import patch

__all__ = ["FEATURE", "MODEL_TYPES", "apply", "encoder_classes", "serves"]

FEATURE = "encoders"
_VERSIONS = ">=5.23,<6"

# config.model_type -> the modeling module whose encoder classes get the bucketed forward (each family is tested
# against CPU in tests/encoders).
MODEL_TYPES: dict[str, str] = {
    "bert": "transformers.models.bert.modeling_bert",
    "roberta": "transformers.models.roberta.modeling_roberta",
    "xlm-roberta": "transformers.models.xlm_roberta.modeling_xlm_roberta",
    "modernbert": "transformers.models.modernbert.modeling_modernbert",
    "distilbert": "transformers.models.distilbert.modeling_distilbert",
    "electra": "transformers.models.electra.modeling_electra",
    "deberta-v2": "transformers.models.deberta_v2.modeling_deberta_v2",
    "mpnet": "transformers.models.mpnet.modeling_mpnet",
}


def encoder_classes(module) -> list[type]:
    """The classes of ``module`` whose ``forward`` gets wrapped: models defined there with a forward of their own,
    without ``GenerationMixin`` (decoder heads keep upstream's forward)."""
    from transformers import PreTrainedModel
    from transformers.generation.utils import GenerationMixin

    found = []
    for _, cls in inspect.getmembers(module, inspect.isclass):
        if (
            cls.__module__ == module.__name__
            and issubclass(cls, PreTrainedModel)
            and not issubclass(cls, GenerationMixin)
            and "forward" in cls.__dict__
        ):
            found.append(cls)
    return found


def serves(model) -> bool:
    """Whether ``model``'s class has the bucketed forward (the ``encoders`` integration is on and wrapped it).

    Args:
        model: a model instance.

    Returns:
        True when its class's ``forward`` is hf_tpu's wrapper.
    """
    return hasattr(type(model).__dict__.get("forward") or getattr(type(model), "forward", None), "__hf_tpu_upstream__")


def _wrap(upstream):
    from hf_tpu.encoders import forward as _forward

    @functools.wraps(upstream)
    def forward(self, *args, **kwargs):
        import torch

        if torch.compiler.is_compiling():
            return upstream(self, *args, **kwargs)
        return _forward.call(self, upstream, args, kwargs)

    forward.__hf_tpu_upstream__ = upstream
    return forward


def apply() -> None:
    """Wrap the ``forward`` of every encoder class of :data:`MODEL_TYPES` (called by :func:`hf_tpu.enable`)."""
    for module_name in MODEL_TYPES.values():
        module = importlib.import_module(module_name)
        for cls in encoder_classes(module):
            upstream = cls.__dict__["forward"]
            upstream = getattr(upstream, "__hf_tpu_upstream__", upstream)
            patch(cls, "forward", _wrap(upstream), feature=FEATURE, package="transformers", versions=_VERSIONS)
