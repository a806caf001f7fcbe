"""train.precision names and the torch dtypes they compute in: the one map every module reads."""

from __future__ import annotations

import torch

# fp8 keeps parameters and every non-GEMM op in bf16; only the linear layers' matmuls run in float8
# (llmtrain.parallel.float8), so its parameter/compute dtype is bf16.
DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": torch.bfloat16,
}


def torch_dtype(precision: str) -> torch.dtype:
    """The parameter and compute dtype of a train.precision value ('fp32', 'bf16', 'fp16' or 'fp8')."""
    try:
        return DTYPES[precision]
    except KeyError:
        raise ValueError(f"precision must be one of {', '.join(DTYPES)}; got {precision!r}") from None
