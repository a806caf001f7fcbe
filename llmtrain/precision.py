"""train.precision names and the torch dtypes they compute in: the one map every module reads."""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def torch_dtype(precision: str) -> torch.dtype:
    """The compute dtype of a train.precision value ('fp32', 'bf16' or 'fp16')."""
    try:
        return DTYPES[precision]
    except KeyError:
        raise ValueError(f"precision must be one of {', '.join(DTYPES)}; got {precision!r}") from None
