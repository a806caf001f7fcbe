"""FLOPs per token and parameter counts: the project's one source of truth (trainer MFU, planner, benchmarks).

Counting follows Narayanan et al. 2021 (Megatron-LM, SC21, appendix): a matmul of (m x k) by (k x n) costs
2mnk FLOPs; attention scores and attention-over-values are counted over the full s x s square (no causal
halving); the backward pass costs twice the forward. So a GPT layer's forward is 24*s*h^2 + 4*s^2*h FLOPs per
sequence and the logits 2*s*h*V. Training FLOPs are 3x the forward; with full activation recomputation the
layers run their forward once more (4 passes) while the logits do not, which gives the paper's
96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h)).

Architecture facts that change the counts: grouped-query attention (k/v projections of kv_heads*head_dim),
gated MLPs (gate and up projections: 3 matrices of h x ffn), LayerNorm (weight and bias, gpt) versus RMSNorm
(weight only), learned position table (gpt), tied input/output embeddings. A mixture-of-experts layer counts
the FLOPs its tokens run (router, top-k experts, shared experts) and holds every expert's parameters; the
per-layer figures are those of a dense layer, MoE layers' differences going to the totals; the routed experts'
parameters (what expert parallelism shards) are counted apart by expert_parameters.
"""

from __future__ import annotations

from dataclasses import dataclass

from llmtrain.config.schema import ModelConfig

RECOMPUTE_MODES = ("none", "selective", "full")


def is_gated(model: ModelConfig) -> bool:
    """True when the MLP is gated (SwiGLU: llama, ernie), False for the GELU MLP (gpt)."""
    return model.arch != "gpt"


@dataclass(frozen=True)
class LayerFlops:
    """Forward FLOPs of one transformer layer for one token (sequence length s), by operation."""

    qkv: float
    attention_core: float
    """QK^T plus attention over values: 4*s*heads*head_dim (full square, as Megatron counts)."""
    out_proj: float
    mlp: float

    @property
    def total(self) -> float:
        return self.qkv + self.attention_core + self.out_proj + self.mlp


def layer_flops_per_token(model: ModelConfig, seq_length: int | None = None) -> LayerFlops:
    """Forward FLOPs of one layer per token, split into the projections, the attention core and the MLP."""
    s = seq_length or model.seq_length
    h, d, a, kv = model.hidden_size, model.head_size, model.num_attention_heads, model.kv_heads
    mlp = _mlp_flops(model, moe=False)
    moe_layers = moe_layer_count(model)
    if moe_layers:
        # The mean layer's: the router's scores, then the top-k and the shared experts' gated MLPs.
        moe = _mlp_flops(model, moe=True)
        mlp = (mlp * (model.num_layers - moe_layers) + moe * moe_layers) / model.num_layers
    if model.arch == "deepseek_v3":
        qk, v = model.qk_nope_head_dim + model.qk_rope_head_dim, model.v_head_dim
        return LayerFlops(
            qkv=2.0 * latent_projection_params(model),
            attention_core=2.0 * s * a * (qk + v),
            out_proj=2.0 * a * v * h,
            mlp=mlp,
        )
    return LayerFlops(
        qkv=2.0 * h * (a + 2 * kv) * d,
        attention_core=4.0 * s * a * d,
        out_proj=2.0 * a * d * h,
        mlp=mlp,
    )


def latent_projection_params(model: ModelConfig) -> int:
    """deepseek_v3: weights of the query and key/value projections of latent attention (o_proj and the
    latent norms not included): each is one multiply-add per token."""
    h, a, rank = model.hidden_size, model.num_attention_heads, model.q_lora_rank
    qk = model.qk_nope_head_dim + model.qk_rope_head_dim
    query = h * a * qk if rank is None else h * rank + rank * a * qk
    kv = h * (model.kv_lora_rank + model.qk_rope_head_dim)
    return query + kv + model.kv_lora_rank * a * (model.qk_nope_head_dim + model.v_head_dim)


def latent_attention_parameters(model: ModelConfig) -> int:
    """deepseek_v3: a layer's latent attention weights: the projections, o_proj and the latent norms (no
    biases)."""
    norms = model.kv_lora_rank + (model.q_lora_rank or 0)
    o_proj = model.num_attention_heads * model.v_head_dim * model.hidden_size
    return latent_projection_params(model) + o_proj + norms


def attention_whole_parameters(model: ModelConfig) -> int:
    """A layer's attention weights every TP rank holds whole, whose gradients are partial sums over TP (each
    rank's heads contribute): latent attention's down-projections and their norms (deepseek_v3: q_a_proj,
    q_a_norm, kv_a_proj with the shared rotary key part, kv_a_norm), or the QK-norms (qwen3_moe: one
    head_dim-wide weight each for q and k); 0 for the other archs."""
    if model.arch == "qwen3_moe":
        return 2 * model.head_size
    if model.arch != "deepseek_v3":
        return 0
    h, rank, kv = model.hidden_size, model.q_lora_rank, model.kv_lora_rank
    query = 0 if rank is None else h * rank + rank
    return query + h * (kv + model.qk_rope_head_dim) + kv


def latent_down_projection_params(model: ModelConfig) -> int:
    """deepseek_v3: the weights of the down-projections (q_a_proj, kv_a_proj) among latent_projection_params:
    the matmuls every TP rank runs whole."""
    rank = model.q_lora_rank or 0
    return model.hidden_size * (rank + model.kv_lora_rank + model.qk_rope_head_dim)


def logits_flops_per_token(model: ModelConfig) -> float:
    """Forward FLOPs of the output layer per token (2*h*V)."""
    return 2.0 * model.hidden_size * model.vocab_size


def head_cost_in_layers(model: ModelConfig, seq_length: int | None = None) -> float:
    """The output layer's FLOPs in units of one layer's: the extra load of the last pipeline stage."""
    return logits_flops_per_token(model) / layer_flops_per_token(model, seq_length).total


def forward_flops_per_token(model: ModelConfig, seq_length: int | None = None) -> float:
    """Forward FLOPs per token of the whole model: all layers plus the logits, and the multi-token
    prediction modules in training (mtp_flops_per_token)."""
    main = model.num_layers * layer_flops_per_token(model, seq_length).total + logits_flops_per_token(model)
    return main + mtp_flops_per_token(model, seq_length)


def mtp_flops_per_token(model: ModelConfig, seq_length: int | None = None) -> float:
    """Forward FLOPs per token of the model.mtp_layers multi-token prediction modules (llmtrain.models.mtp),
    which every training forward runs on the full sequence: per depth eh_proj (2h -> h), one transformer
    block (an MoE one where layer num_layers + depth is) and the shared output layer's logits."""
    if not model.mtp_layers:
        return 0.0
    h = model.hidden_size
    attention = layer_flops_per_token(model, seq_length)
    attention_total = attention.total - attention.mlp
    total = 0.0
    for depth in range(model.mtp_layers):
        moe = model.is_moe_layer(model.num_layers + depth)
        total += 2.0 * 2 * h * h + attention_total + _mlp_flops(model, moe) + logits_flops_per_token(model)
    return total


def _mlp_flops(model: ModelConfig, moe: bool) -> float:
    """Forward FLOPs per token of one dense MLP, or of an MoE one (router, top-k and shared experts)."""
    h = model.hidden_size
    if moe:
        active = model.num_experts_per_tok + model.num_shared_experts
        return 2.0 * h * model.num_experts + 2.0 * 3 * h * model.expert_ffn_size * active
    return 2.0 * (3 if is_gated(model) else 2) * h * model.ffn_size


def model_flops_per_token(model: ModelConfig, seq_length: int | None = None) -> float:
    """Training FLOPs per token: 3x the forward (forward + backward), attention included, recompute not
    counted. The numerator of MFU."""
    return 3.0 * forward_flops_per_token(model, seq_length)


def training_flops_per_token(
    model: ModelConfig, seq_length: int | None = None, recompute: str = "none"
) -> float:
    """FLOPs per token executed for a recompute mode ("hardware FLOPs"): full adds one more forward of
    every layer (not of the logits), selective adds the attention core's forward."""
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE_MODES)}; got {recompute!r}")
    layer = layer_flops_per_token(model, seq_length)
    extra = {"none": 0.0, "selective": layer.attention_core, "full": layer.total}[recompute]
    return model_flops_per_token(model, seq_length) + model.num_layers * extra


def megatron_flops_per_iteration(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """The closed form of Narayanan et al. 2021 for GPT with full recomputation:
    96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h))."""
    return 96.0 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


@dataclass(frozen=True)
class ParamCounts:
    """Parameters by place: per transformer layer, the input embeddings (tokens + positions), the output
    head (0 when tied) and the final norm."""

    per_layer: int
    embedding: int
    head: int
    final_norm: int
    num_layers: int
    moe_extra: int = 0
    """What the MoE layers hold beyond a dense layer's per_layer (routers, experts, shared experts)."""
    mtp: int = 0
    """The multi-token prediction modules (model.mtp_layers): per depth two norms, eh_proj, a block (MoE
    where layer num_layers + depth is) and its final norm; they share the embedding and head."""

    @property
    def total(self) -> int:
        body = self.num_layers * self.per_layer + self.moe_extra
        return body + self.embedding + self.head + self.final_norm + self.mtp


def parameter_counts(model: ModelConfig) -> ParamCounts:
    """Parameter counts by place (see ParamCounts)."""
    h, d, a, kv, f, v = (
        model.hidden_size,
        model.head_size,
        model.num_attention_heads,
        model.kv_heads,
        model.ffn_size,
        model.vocab_size,
    )
    bias = model.bias
    norm = 2 * h if model.arch == "gpt" else h  # LayerNorm has weight and bias, RMSNorm a weight only
    attn = h * (a + 2 * kv) * d + a * d * h + ((a + 2 * kv) * d + h if bias else 0)
    if model.arch == "deepseek_v3":
        attn = latent_attention_parameters(model)
    if is_gated(model):
        mlp = 3 * h * f + (2 * f + h if bias else 0)
    else:
        mlp = 2 * h * f + (f + h if bias else 0)
    embedding = v * h + (model.max_positions * h if model.arch == "gpt" else 0)
    head = 0 if model.tied_embeddings else v * h
    # MoE: router, experts and shared experts (no biases) instead of the dense MLP; qwen3_moe's q/k norms.
    experts = model.num_experts + model.num_shared_experts
    moe_mlp = model.num_experts * h + 3 * h * model.expert_ffn_size * experts
    moe_layers = moe_layer_count(model)
    qk_norm = 2 * d if model.arch == "qwen3_moe" else 0
    per_layer = attn + mlp + 2 * norm + qk_norm
    mtp = sum(
        3 * norm + 2 * h * h + per_layer + (moe_mlp - mlp if model.is_moe_layer(model.num_layers + k) else 0)
        for k in range(model.mtp_layers)
    )
    return ParamCounts(per_layer, embedding, head, norm, model.num_layers, moe_layers * (moe_mlp - mlp), mtp)


def moe_layer_count(model: ModelConfig) -> int:
    """Blocks with routed experts instead of a dense MLP (0 for a dense arch)."""
    if not model.is_moe:
        return 0  # the planner asks for every layout it evaluates: skip the walk over the layers
    return sum(model.is_moe_layer(i) for i in range(model.num_layers))


def moe_whole_parameters(model: ModelConfig) -> int:
    """Parameters of all MoE layers' routers and shared experts: what every TP rank holds whole (the trainer
    splits the sequence, not the MoE weights, over TP: llmtrain.parallel.tensor_parallel._shard_moe)."""
    h = model.hidden_size
    per_layer = model.num_experts * h + 3 * h * model.expert_ffn_size * model.num_shared_experts
    return moe_layer_count(model) * per_layer


def expert_parameters(model: ModelConfig) -> int:
    """Parameters of the routed experts of all MoE layers (gated MLPs of expert_ffn_size, no biases): what
    expert parallelism divides over its ranks; routers and shared experts stay replicated."""
    per_expert = 3 * model.hidden_size * model.expert_ffn_size
    return moe_layer_count(model) * model.num_experts * per_expert


def num_parameters(model: ModelConfig) -> int:
    """Number of trainable parameters (tied embeddings counted once)."""
    return parameter_counts(model).total
