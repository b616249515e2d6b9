"""Fixed-shape batches for training on TPU: pad every batch to one of a few lengths (and, optionally, rows).

On TPU each new input shape compiles (an eager op per new shape, or a whole graph under ``torch.compile``), so a
training loop that feeds batches padded to their longest example compiles again and again. ``BucketingCollator``
pads the sequence length up to the smallest bucket that fits, so a run has at most ``len(buckets)`` shapes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hf_tpu.errors import InvalidArgumentError

__all__ = ["BucketingCollator"]

IGNORE_INDEX = -100


class BucketingCollator:
    """Collate ``{"input_ids": [...], "attention_mask"?: [...], "labels"?: [...]}`` examples into padded tensors.

    Args:
        buckets: allowed sequence lengths, e.g. ``(32, 64, 128)``; a batch is padded (on the right) to the smallest
            one that holds its longest example.
        pad_token_id: id written into padded ``input_ids`` positions.
        batch_size: if given, every batch also gets this many rows (padding rows are fully masked and ignored by
            the loss), so that a short last batch does not make a new shape.
        truncate: cut examples longer than the largest bucket instead of raising.
        return_attention_mask: include ``attention_mask``. transformers checks on the host whether a mask is all
            ones and then takes another attention path (a host sync, and a second set of shapes per bucket when some
            batches need no padding). A causal LM padded on the right computes the same loss without the mask (no
            real token attends to the padding after it, and padded labels are ignored), so ``False`` gives exactly
            one set of shapes per bucket; keep ``True`` for bidirectional models.

    Labels default to ``input_ids`` (causal LM); padded positions get ``-100``, which the loss ignores.

    Example:
        >>> from hf_tpu.training import BucketingCollator
        >>> collate = BucketingCollator(buckets=(8, 16), pad_token_id=0)
        >>> batch = collate([{"input_ids": [5, 6, 7]}, {"input_ids": [5, 6, 7, 8, 9]}])
        >>> tuple(batch["input_ids"].shape), batch["labels"][0].tolist()
        ((2, 8), [5, 6, 7, -100, -100, -100, -100, -100])
    """

    def __init__(
        self,
        buckets: Sequence[int] = (64, 128, 256, 512),
        pad_token_id: int = 0,
        *,
        batch_size: int | None = None,
        truncate: bool = False,
        return_attention_mask: bool = True,
    ) -> None:
        if not buckets or any(int(b) <= 0 for b in buckets):
            raise InvalidArgumentError(f"buckets must be positive sequence lengths, got {buckets!r}")
        if batch_size is not None and batch_size <= 0:
            raise InvalidArgumentError(f"batch_size must be positive, got {batch_size!r}")
        self.buckets = tuple(sorted({int(b) for b in buckets}))
        self.pad_token_id = int(pad_token_id)
        self.batch_size = batch_size
        self.truncate = truncate
        self.return_attention_mask = return_attention_mask

    def bucket_for(self, length: int) -> int:
        """The padded length of a batch whose longest example has ``length`` tokens.

        Args:
            length: the longest example's token count.

        Returns:
            The smallest bucket that holds it (the largest bucket when ``truncate`` and none does).

        Raises:
            ValueError (InvalidArgumentError): ``length`` exceeds the largest bucket and ``truncate`` is off.
        """
        for b in self.buckets:
            if length <= b:
                return b
        if self.truncate:
            return self.buckets[-1]
        raise InvalidArgumentError(
            f"an example has {length} tokens, longer than the largest bucket {self.buckets[-1]}; add a larger "
            "bucket, shorten the data, or pass truncate=True"
        )

    def __call__(self, features: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        import torch

        if not features:
            raise InvalidArgumentError("BucketingCollator got an empty batch")
        rows = len(features)
        if self.batch_size is not None:
            if rows > self.batch_size:
                raise InvalidArgumentError(f"a batch of {rows} examples is larger than batch_size={self.batch_size}")
            rows = self.batch_size
        ids = [list(map(int, f["input_ids"])) for f in features]
        width = self.bucket_for(max(len(x) for x in ids))
        input_ids = torch.full((rows, width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((rows, width), dtype=torch.long)
        labels = torch.full((rows, width), IGNORE_INDEX, dtype=torch.long)
        for row, (f, x) in enumerate(zip(features, ids, strict=True)):
            x = x[:width]
            n = len(x)
            input_ids[row, :n] = torch.tensor(x, dtype=torch.long)
            mask = f.get("attention_mask")
            attention_mask[row, :n] = torch.tensor(list(mask)[:n], dtype=torch.long) if mask is not None else 1
            lab = f.get("labels")
            lab = torch.tensor(list(map(int, lab))[:n], dtype=torch.long) if lab is not None else input_ids[row, :n]
            labels[row, :n] = torch.where(attention_mask[row, :n].bool(), lab, IGNORE_INDEX)
        batch = {"input_ids": input_ids, "labels": labels}
        if self.return_attention_mask:
            batch["attention_mask"] = attention_mask
        return batch
