"""train.precision=fp8: the transformer blocks' linear layers compute their GEMMs in float8 via torchao.

torchao's float8 training (`convert_to_float8_training`, tensorwise dynamic scaling: e4m3 inputs and
weights, e5m2 output gradients) swaps `nn.Linear` modules for `Float8Linear`, which keeps the same weight
Parameter. Everything else stays as bf16 training has it: parameters in bf16 views of the flat buffers
(data_parallel), fp32 master weights in the optimizer, norms, attention, SwiGLU and the loss in bf16/fp32.

Only nn.Linear is swapped, so tensor parallelism (its own Column/RowParallelLinear modules) is rejected
at config time (llmtrain.config.engine_rules.float8_problem), as are pipeline stages, which this path has not
been verified with. The LM head stays bf16, as torchtitan keeps its output projection: the logits feed the
softmax directly, and the vocabulary need not be a multiple of 16.
"""

from __future__ import annotations

from torch import nn


def _in_a_block(module: nn.Module, fqn: str) -> bool:
    return isinstance(module, nn.Linear) and fqn.startswith("layers.")


def apply_float8(model: nn.Module, precision: str) -> nn.Module:
    """With precision 'fp8', swap the transformer blocks' nn.Linear for torchao's Float8Linear, in place."""
    if precision != "fp8":
        return model
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    return convert_to_float8_training(model, module_filter_fn=_in_a_block, config=Float8LinearConfig())
