"""ZeRO-3's weight all-gathers in float8 (``train.fp8_all_gather``): torchao's FSDP2 float8 all-gather.

Under train.precision=fp8 a float8 linear casts its gathered bf16 weight to e4m3 before every GEMM anyway
(tensorwise: one scale per weight). With this option each rank casts its fp32 shard instead, with the scale
of the whole weight, and FSDP2 all-gathers the float8 bytes: 1 byte a weight element on the wire instead
of bf16's 2, and the gathered weight is already the GEMM's float8 operand (llmtrain.parallel.gemms uses it
as it comes). torchao provides the mechanism: its ``WeightWithDynamicFloat8CastTensor`` parameter wrapper
implements FSDP2's ``fsdp_pre_all_gather`` (cast the shard, gather ``_data``) and ``fsdp_post_all_gather``
(a ``Float8TrainingTensor`` of the gathered bytes and the scale).

The scale: without a precomputed one, torchao's pre-all-gather all-reduces each weight's amax over the FSDP
mesh, once per gather (twice a step at ZeRO-3). ``precompute_weight_scales`` runs after each optimizer step
(and after a checkpoint is loaded): one all-reduce (MAX) of every float8 weight's shard amax over the shard
group, turned into scales by torchao's own ``amax_to_scale`` -- the same scales, one collective a step
(torchao's ``precompute_float8_dynamic_scale_for_fsdp`` does this for its own Float8Linear modules only).

Against one fp8 process, which casts the fp32 master rounded to bf16: here the fp32 shard is cast directly,
with the amax of the fp32 values. Both differ from the bf16 route by at most a bf16 rounding (2^-8
relative) before the e4m3 rounding, so an element lands one e4m3 step (2^-4 relative) away with
probability about 1/16 -- the effect tests/parallel/test_float8_layouts.py already bounds for a bf16
input one ulp off.

Applies where llmtrain.config.engine_rules.float8_all_gather says: tensorwise scaling (one scale per
weight), zero_stage 3, and tp 1 -- the shard group then spans the whole weight, so its amax is the
tensor's; under TP each rank's weight is a slice whose amax llmtrain's float8 GEMMs all-reduce over the TP
group, which torchao's gather does not.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from llmtrain.parallel.comm import all_reduce
from llmtrain.parallel.gemms import Float8Gemms


def wrap_float8_weights(model: nn.Module) -> int:
    """Before fully_shard: make every float8 linear's weight torchao's float8-all-gather parameter (same
    values, device and dtype; FSDP2 then shards the wrapper). Returns how many were wrapped."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    wrapped = 0
    for module in model.modules():
        gemms = getattr(module, "gemms", None)
        if not isinstance(gemms, Float8Gemms) or isinstance(module.weight, WeightWithDynamicFloat8CastTensor):
            continue
        weight = module.weight
        cast = WeightWithDynamicFloat8CastTensor(
            weight.data, gemms.mm_config, gemms.config.cast_config_weight.target_dtype
        )
        module.weight = nn.Parameter(cast, requires_grad=weight.requires_grad)
        wrapped += 1
    return wrapped


def _float8_shards(model: nn.Module) -> list[DTensor]:
    """The sharded float8-all-gather weights of ``model`` (FSDP2's DTensors around torchao's wrapper)."""
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor as wrapper

    return [p for p in model.parameters() if isinstance(p, DTensor) and isinstance(p._local_tensor, wrapper)]


@torch.no_grad()
def precompute_weight_scales(model: nn.Module) -> None:
    """Set every float8-all-gather weight's scale from its current values (after the optimizer step): the
    amaxes of this rank's shards, all-reduced (MAX) over the shard group in one collective. Callers call it
    only where train.fp8_all_gather wrapped the weights (engine_rules.float8_all_gather): it imports torchao,
    which costs CPU and prints its extension-loading warnings on stderr."""
    weights = _float8_shards(model)
    if not weights:
        return
    from torchao.float8.float8_utils import amax_to_scale

    shards = [w._local_tensor for w in weights]
    amax = torch.stack([s._tensor.abs().max() if s.numel() else s._tensor.new_zeros(()) for s in shards])
    amax = amax.float()
    mesh = weights[0].device_mesh
    group = mesh.get_group("shard")
    if dist.get_world_size(group) > 1:
        all_reduce(amax, op=dist.ReduceOp.MAX, group=group, detail="float8 weight amax")
    for shard, a in zip(shards, amax, strict=True):
        shard._precomputed_scale = amax_to_scale(a, shard._dtype)
