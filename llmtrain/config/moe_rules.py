"""Whether a mixture-of-experts model can run: its expert and routing fields, and expert parallelism.

As in llmtrain.config.layout_rules, each *_problem function returns "" or the message naming the field and
the fix; config validation and the planner ask the same function.
"""

from __future__ import annotations

from llmtrain.config.schema import JobConfig, ModelConfig, ParallelConfig


def moe_problem(job: JobConfig) -> str:
    """Why the mixture-of-experts fields of `job` cannot run ("" if they can, or the arch is dense).

    What the experts do not support yet (DeepSpeed, router losses under full recompute) is refused
    here rather than failing (or silently mis-training) later; their tp limits are tensor_parallel_problem's,
    which checkpoint conversion and the planner ask too, and parallel.ep's expert_parallel_problem's.
    """
    m, p = job.model, job.parallel
    if not m.is_moe:
        return ""
    for name in ("num_experts", "num_experts_per_tok", "moe_layer_interval"):
        if getattr(m, name) < 1:
            return f"model.{name} must be at least 1 for model.arch={m.arch}; got {getattr(m, name)}"
    if m.num_experts_per_tok > m.num_experts:
        return (
            f"model.num_experts_per_tok={m.num_experts_per_tok} exceeds model.num_experts={m.num_experts}; "
            "route each token to at most num_experts experts"
        )
    if m.num_shared_experts and m.arch not in ("ernie_moe", "deepseek_v3"):
        return (
            f"model.num_shared_experts={m.num_shared_experts}: model.arch={m.arch} has no shared experts "
            "(ernie_moe and deepseek_v3 have); set model.num_shared_experts=0"
        )
    routing = routing_problem(m)
    if routing:
        return routing
    if m.use_bias:
        return (
            f"model.arch={m.arch} has no biases (its experts and router have none); set model.use_bias=false"
        )
    bad = [i for i in m.dense_layers if not 0 <= i < m.num_layers]
    if bad:
        return (
            f"model.dense_layers names layer {bad[0]}, outside 0..{m.num_layers - 1} (model.num_layers="
            f"{m.num_layers}); list existing layers only"
        )
    unsupported = [
        (p.engine == "deepspeed", "parallel.engine=deepspeed", "parallel.engine=llmtrain"),
        # Reentrant checkpointing runs the forward without autograd, so the router statistics the
        # router losses are built from would carry no gradient.
        (
            (m.recompute == "full" or "full" in m.recompute_layers)
            and (m.router_aux_loss_coef > 0 or m.router_z_loss_coef > 0),
            ("model.recompute=full" if m.recompute == "full" else "full in model.recompute_layers")
            + " with router losses",
            "model.recompute none or selective (no full in model.recompute_layers), or "
            "model.router_aux_loss_coef=0 and router_z_loss_coef=0",
        ),
    ]
    for is_set, setting, fix in unsupported:
        if is_set:
            return (
                f"model.arch={m.arch} (mixture of experts) does not support {setting} yet; use {fix}, "
                "or a dense arch"
            )
    return ""


def routing_problem(m: ModelConfig) -> str:
    """Why the routing fields of MoE model `m` cannot work ("" if they can): groups, capacity, score bias."""
    if m.arch != "deepseek_v3":
        for name, default in (
            ("num_expert_groups", 1),
            ("topk_expert_groups", 1),
            ("routed_scaling_factor", 1.0),
        ):
            if getattr(m, name) != default:
                return (
                    f"model.{name}={getattr(m, name)}: model.arch={m.arch} has no group-limited, scaled "
                    f"sigmoid routing (deepseek_v3 has); set model.{name}={default}"
                )
    else:
        if m.num_kv_heads not in (None, m.num_attention_heads):
            return (
                f"model.num_kv_heads={m.num_kv_heads}: deepseek_v3's latent attention expands keys and "
                "values to every query head; set model.num_kv_heads=null"
            )
        groups, chosen = m.num_expert_groups, m.topk_expert_groups
        if m.num_experts % groups:
            return (
                f"model.num_expert_groups={groups} does not divide model.num_experts={m.num_experts}; "
                "choose a divisor"
            )
        size = m.num_experts // groups
        if groups > 1 and size < 2:
            return (
                f"model.num_expert_groups={groups} leaves {size} expert per group, but a group is ranked by "
                "its two best scores; use at most num_experts / 2 groups"
            )
        if chosen > groups:
            return (
                f"model.topk_expert_groups={chosen} exceeds model.num_expert_groups={groups}; "
                "choose at most num_expert_groups"
            )
        if m.num_experts_per_tok > chosen * size:
            return (
                f"model.num_experts_per_tok={m.num_experts_per_tok} exceeds the {chosen * size} experts of "
                f"model.topk_expert_groups={chosen} groups of {size}; raise topk_expert_groups or lower top-k"
            )
    if m.moe_capacity_factor is not None and m.moe_capacity_factor < 1.0:
        return (
            f"model.moe_capacity_factor={m.moe_capacity_factor} gives the experts fewer slots than tokens "
            f"x top-k ({m.num_experts_per_tok}) even when perfectly balanced; use at least 1.0, or null "
            "(dropless)"
        )
    if m.bias_update_rate and m.arch not in ("ernie_moe", "deepseek_v3"):
        return (
            f"model.router_bias_update_rate={m.router_bias_update_rate}: model.arch={m.arch} routers have no "
            "score bias (ernie_moe and deepseek_v3 have); set it to 0 or null"
        )
    return ""


def expert_parallel_problem(job: JobConfig) -> str:
    """Why parallel.ep cannot shard `job`'s experts ("" if it can); the world-size part is
    expert_layout_problem."""
    m, p = job.model, job.parallel
    if p.ep < 1:
        return f"parallel.ep must be at least 1; got {p.ep}"
    if p.ep == 1:
        return ""
    if not m.is_moe:
        return (
            f"parallel.ep={p.ep} shards mixture-of-experts layers, but model.arch={m.arch} is dense; "
            "set parallel.ep=1 or use an MoE arch (mixtral, qwen3_moe, ernie_moe, deepseek_v3)"
        )
    if m.num_experts % p.ep:
        return (
            f"parallel.ep={p.ep} does not divide model.num_experts={m.num_experts}; choose an ep dividing "
            "the expert count (every EP rank holds num_experts / ep experts)"
        )
    if p.zero_stage >= 2 and p.dp_shard is not None:
        return (
            f"parallel.ep={p.ep} with parallel.zero_stage={p.zero_stage} shards the experts over all the "
            "ranks holding them; hybrid sharding is not supported for them yet: set parallel.dp_shard=null"
        )
    if p.dp is not None:
        return expert_layout_problem(p, p.dp)
    return ""


def expert_layout_problem(p: ParallelConfig, dp: int) -> str:
    """Why parallel.ep cannot be carved out of the tp x cp x dp ranks at data-parallel degree `dp` ("" if it
    can). EP takes consecutive ranks of the expert domain, dp innermost, then cp, then tp
    (llmtrain.parallel.topology): it lies inside the dp ranks when ep divides dp, spans whole dp groups of
    several CP ranks when it is dp times a divisor of cp, and of several TP ranks beyond dp * cp."""
    if p.ep == 1:
        return ""
    inside = dp * p.cp
    if dp % p.ep == 0 or (p.ep % dp == 0 and p.cp % (p.ep // dp) == 0):
        return ""
    if p.ep % inside == 0 and p.tp % (p.ep // inside) == 0:
        return ""
    return (
        f"parallel.ep={p.ep} cannot be carved out of the tp x cp x dp = {p.tp}x{p.cp}x{dp} ranks; choose an "
        f"ep dividing the data-parallel degree {dp}, dp times a divisor of parallel.cp={p.cp}, or dp * cp = "
        f"{inside} times a divisor of parallel.tp={p.tp}"
    )
