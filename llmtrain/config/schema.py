"""Typed configuration of a training job: one dataclass per concern.

Every field has a default and a one-line docstring right below it; `llmtrain.config.reference`
turns those docstrings into the configuration reference, so keep them to one line.
Field names are a public contract (YAML files, `key.path=value` overrides, sweeps).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

Arch = Literal["gpt", "llama", "ernie", "mixtral", "qwen3_moe", "ernie_moe", "deepseek_v3"]
KernelImpl = Literal["auto", "triton", "torch"]
Recompute = Literal["none", "selective", "full"]
Schedule = Literal["gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zb_v", "dualpipe_v", "interleaved_zb"]
Precision = Literal["fp32", "bf16", "fp16", "fp8"]
LrDecay = Literal["cosine", "linear", "constant"]
CompileMode = Literal["none", "blocks"]
OnSaveError = Literal["continue", "stop"]
Engine = Literal["llmtrain", "deepspeed"]
OffloadDevice = Literal["cpu", "nvme"]
RopeScaling = Literal["none", "yarn"]
Offload = Literal["none", "optimizer", "optimizer+params"]
OnBadDocument = Literal["skip", "error"]
CpComm = Literal["ring", "all_to_all"]
GradReduce = Literal["microbatch", "step"]
DpReduce = Literal["all_reduce", "tree"]
OptimizerName = Literal["adamw", "muon"]
MuonLrAdjust = Literal["match_rms_adamw", "original"]
Fp8Recipe = Literal["tensorwise", "rowwise"]
Fp8Filter = Literal["all", "auto"]
Fp8GroupedMM = Literal["auto", "rowwise", "mxfp8", "bf16"]

MOE_ARCHS = ("mixtral", "qwen3_moe", "ernie_moe", "deepseek_v3")
"""The architectures whose MLPs are (partly) mixtures of experts (llmtrain.models.moe)."""


@dataclass
class ModelConfig:
    """The architecture and its size."""

    arch: Arch = "ernie"
    """Architecture: gpt, llama, ernie; mixtures of experts: mixtral, qwen3_moe, ernie_moe, deepseek_v3."""
    num_layers: int = 4
    """Number of transformer blocks."""
    hidden_size: int = 256
    """Width of the residual stream."""
    num_attention_heads: int = 4
    """Number of query heads."""
    num_kv_heads: int | None = None
    """Number of key/value heads for grouped-query attention; null means equal to num_attention_heads."""
    head_dim: int | None = None
    """Width of one attention head; null means hidden_size / num_attention_heads."""
    ffn_hidden_size: int | None = None
    """Inner width of the MLP; null means 4*hidden (gpt) or 8/3*hidden rounded up to a multiple of 64."""
    vocab_size: int = 8192
    """Vocabulary size of the embedding and output layers (at least the tokenizer's vocabulary)."""
    seq_length: int = 256
    """Tokens per training sample."""
    max_position_embeddings: int | None = None
    """Rows of the learned position table (gpt) or the rotary horizon; null means seq_length."""
    norm_eps: float = 1e-5
    """Epsilon of LayerNorm / RMSNorm."""
    rope_theta: float = 10000.0
    """Base of the rotary frequencies (llama, ernie)."""
    rope_scaling: RopeScaling = "none"
    """Rotary frequency scaling: none, or yarn (deepseek_v3 only, as DeepSeek extends its context)."""
    rope_scaling_factor: float = 1.0
    """yarn: how many times the original context the frequencies are stretched to."""
    rope_original_max_positions: int = 4096
    """yarn: the context length the rotary frequencies were first trained at."""
    rope_mscale: float = 1.0
    """yarn: the mscale of the cos/sin factor (DeepSeek's rope_scaling.mscale)."""
    rope_mscale_all_dim: float = 0.0
    """yarn: mscale_all_dim, which also scales the attention softmax (0: not)."""
    tie_word_embeddings: bool | None = None
    """Share input embedding and output head weights; null means the architecture's default."""
    use_bias: bool | None = None
    """Biases in the linear layers; null means the architecture's default (gpt yes, llama/ernie no)."""
    hidden_dropout: float = 0.0
    """Dropout probability on the residual branches and embeddings."""
    attention_dropout: float = 0.0
    """Dropout probability on the attention weights."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of weights."""
    kernels: KernelImpl = "auto"
    """Kernel implementation: auto (Triton on CUDA but SDPA attention, PyTorch elsewhere), triton or torch."""
    recompute: Recompute = "none"
    """Activation recomputation: none, selective (attention core) or full (whole layers)."""
    recompute_layers: list[str] = field(default_factory=list)
    """Recompute mode per layer (none/selective/full, one per layer) instead of recompute; empty: uniform."""
    num_experts: int = 8
    """MoE archs (mixtral, qwen3_moe, ernie_moe, deepseek_v3): routed experts per MoE layer."""
    num_experts_per_tok: int = 2
    """MoE archs: experts each token is routed to (top-k)."""
    moe_ffn_hidden_size: int | None = None
    """MoE archs: inner width of one expert's SwiGLU MLP; null means the resolved ffn_hidden_size."""
    num_shared_experts: int = 0
    """ernie_moe, deepseek_v3: experts every token goes through (one SwiGLU MLP, num_shared x expert wide)."""
    norm_topk_prob: bool = True
    """MoE archs: renormalise the top-k router weights to sum to 1 (mixtral and ernie_moe always do)."""
    router_aux_loss_coef: float = 0.001
    """MoE archs: weight of the load-balancing loss added to the training loss (0 disables it)."""
    moe_layer_start: int = 0
    """MoE archs: first layer (0-based) that may be an MoE layer; the layers before it are dense."""
    moe_layer_interval: int = 1
    """MoE archs: layer i at or after moe_layer_start is MoE when (i + 1) is a multiple of this."""
    dense_layers: list[int] = field(default_factory=list)
    """MoE archs: layers (0-based) that keep a dense MLP of ffn_hidden_size whatever the rules above say."""
    num_expert_groups: int = 1
    """deepseek_v3: groups the routed experts are split into for group-limited routing (n_group)."""
    topk_expert_groups: int = 1
    """deepseek_v3: groups (ranked by their two best scores) a token's top-k experts are chosen from."""
    routed_scaling_factor: float = 1.0
    """deepseek_v3: factor on the routed experts' top-k weights (after norm_topk_prob)."""
    moe_capacity_factor: float | None = None
    """MoE archs: ceil(factor * micro-batch tokens * top-k / experts) slots an expert; null: dropless."""
    router_z_loss_coef: float = 0.0
    """MoE archs: weight of the router z-loss (ST-MoE: mean squared logsumexp of router logits; 0 off)."""
    router_bias_update_rate: float | None = None
    """ernie_moe, deepseek_v3: per-step score-bias update toward balance; null: 1e-3 (deepseek_v3) else 0."""
    q_lora_rank: int | None = None
    """deepseek_v3: rank of the compressed query (q_a_proj, norm, q_b_proj); null: one full q_proj."""
    kv_lora_rank: int = 512
    """deepseek_v3: rank of the compressed key/value latent (kv_a_proj, norm, kv_b_proj)."""
    qk_nope_head_dim: int = 128
    """deepseek_v3: query/key width per head without the rotary embedding."""
    qk_rope_head_dim: int = 64
    """deepseek_v3: query/key width per head with the rotary embedding (one key part shared by all heads)."""
    v_head_dim: int = 128
    """deepseek_v3: value width per head."""
    mtp_layers: int = 0
    """Multi-token prediction depth D (DeepSeek-V3: 1): modules predicting 2..D+1 tokens ahead; 0: off."""
    mtp_loss_weight: float = 0.3
    """lambda: weight of the multi-token prediction loss (mean cross-entropy over the D depths)."""
    mtp_loss_weight_later: float | None = None
    """lambda once mtp_loss_weight_tokens tokens are trained (DeepSeek-V3: 0.1 after 10T); null: constant."""
    mtp_loss_weight_tokens: int = 0
    """Trained tokens after which mtp_loss_weight_later replaces mtp_loss_weight."""

    # Resolved values of the fields whose null means "derive it"; downstream code reads these.
    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_attention_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        if self.arch == "gpt":
            return 4 * self.hidden_size
        return -(-(8 * self.hidden_size // 3) // 64) * 64

    @property
    def is_moe(self) -> bool:
        return self.arch in MOE_ARCHS

    @property
    def expert_ffn_size(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_size

    @property
    def rope_dim(self) -> int:
        """Width of each head that the rotary embedding turns."""
        return self.qk_rope_head_dim if self.arch == "deepseek_v3" else self.head_size

    @property
    def bias_update_rate(self) -> float:
        if self.router_bias_update_rate is not None:
            return self.router_bias_update_rate
        return 1e-3 if self.arch == "deepseek_v3" else 0.0

    def is_moe_layer(self, index: int) -> bool:
        """Whether block `index` (0-based) has routed experts instead of a dense MLP."""
        return (
            self.is_moe
            and index >= self.moe_layer_start
            and (index + 1) % self.moe_layer_interval == 0
            and index not in self.dense_layers
        )

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings or self.seq_length

    @property
    def tied_embeddings(self) -> bool:
        if self.tie_word_embeddings is not None:
            return self.tie_word_embeddings
        return self.arch in ("gpt", "ernie", "ernie_moe")

    @property
    def bias(self) -> bool:
        return self.use_bias if self.use_bias is not None else self.arch == "gpt"


@dataclass
class ParallelConfig:
    """How the job is split over processes."""

    tp: int = 1
    """Tensor-parallel degree (shards heads, MLP and vocabulary)."""
    pp: int = 1
    """Pipeline-parallel degree (splits the layers into stages)."""
    dp: int | None = None
    """Data-parallel degree; null means world_size / (tp * cp * pp)."""
    cp: int = 1
    """Context-parallel degree: each sequence split over cp ranks, two mirrored chunks each (balanced)."""
    ep: int = 1
    """Expert-parallel degree: MoE experts split over ep of the tp x cp x dp ranks, tokens sent all-to-all."""
    cp_comm: CpComm = "ring"
    """Context-parallel attention: ring (K/V passed around) or all_to_all (Ulysses, heads scattered)."""
    sequence_parallel: bool = False
    """Shard activations outside attention/MLP along the sequence (needs tp > 1 to have an effect)."""
    zero_stage: int = 0
    """0: replicated; 1: optimizer state sharded over DP; 2: + gradients (FSDP2); 3: + parameters (FSDP2)."""
    dp_shard: int | None = None
    """zero_stage 2/3: DP ranks (and their CP ranks) sharing one sharded copy, dp / dp_shard copies (HSDP)."""
    grad_reduce: GradReduce = "microbatch"
    """zero_stage 2/3: reduce gradients after every micro-batch, or once a step (4 bytes/param more)."""
    schedule: Schedule = "1f1b"
    """Pipeline schedule: gpipe, 1f1b, interleaved_1f1b, zb_h1, zb_v, dualpipe_v or interleaved_zb."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (interleaved_1f1b/interleaved_zb: any; zb_v/dualpipe_v: 2)."""
    balance_stages: bool = True
    """Split layers over pipeline stages by FLOPs, the output layer counted on the last (false: evenly)."""
    stage_layers: list[int] = field(default_factory=list)
    """Layers per model chunk (pp * virtual_stages counts, in order), over balance_stages; empty: auto."""
    order: str = "tp-dp-pp"
    """Rank order of the parallel dimensions, innermost first; cp, unless named, sits just inside dp."""
    dp_bucket_mb: float = 25.0
    """Size of a data-parallel gradient-reduction bucket in MiB."""
    overlap_param_gather: bool = True
    """zero_stage 1: overlap each bucket's parameter all-gather with the next forward instead of waiting."""
    auto: bool = False
    """Ask the planner for tp/pp/dp/micro-batch/recompute/zero for this world size at launch."""
    cluster: str | None = None
    """Cluster description YAML used by parallel.auto; null means a measured description of this machine."""
    backend: str = "auto"
    """torch.distributed backend: auto (nccl on CUDA, gloo on CPU), gloo or nccl."""
    engine: Engine = "llmtrain"
    """Who runs data parallelism and the optimizer: llmtrain, or deepspeed (ZeRO 1-3 with CPU offload)."""
    offload: Offload = "none"
    """engine=deepspeed: keep in CPU memory none, the optimizer (CPU Adam), or optimizer+params (zero 3)."""
    offload_device: OffloadDevice = "cpu"
    """Where parallel.offload keeps what it offloads: cpu memory, or nvme files (zero 3, needs libaio)."""
    nvme_path: str | None = None
    """offload_device=nvme: a directory on a local NVMe drive for DeepSpeed's swap files."""
    dp_reduce: DpReduce = "all_reduce"
    """zero_stage 0 DP gradient sum: all_reduce, or tree (same bits on any 2^k ranks; dp/2x the traffic)."""


@dataclass
class TrainConfig:
    """The optimisation loop.

    With `optimizer: muon` the parameters split as Keller Jordan's and Moonlight's recipes split them: Muon
    updates every 2-D matrix of the transformer blocks (attention, MLP, shared experts, latent attention's
    projections) and each routed expert's matrix on its own; AdamW (the adam_* fields) updates the token and
    position embeddings, the output layer, norms, biases and the MoE router. Muon's update is
    torch.optim.Muon's on whole matrices at every parallel layout (docs/parallelism.md#muon).
    """

    steps: int = 200
    """Number of optimizer steps."""
    lr: float = 1e-3
    """Peak learning rate."""
    min_lr: float = 1e-4
    """Learning rate at the end of the decay."""
    warmup_steps: int = 20
    """Steps of linear warmup from 0 to lr."""
    lr_decay: LrDecay = "cosine"
    """Decay after warmup: cosine, linear or constant."""
    weight_decay: float = 0.1
    """Decoupled weight decay (not applied to norms, biases and embeddings' positions)."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.95
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    grad_clip: float = 1.0
    """Clip gradients to this global L2 norm; 0 disables clipping."""
    global_batch_size: int = 16
    """Samples per optimizer step over all data-parallel ranks."""
    micro_batch_size: int = 4
    """Samples per forward/backward on one rank; the rest is gradient accumulation."""
    dp_micro_batches: list[int] = field(default_factory=list)
    """Micro-batches per data-parallel replica (dp counts summing to global/micro); empty: equal shares."""
    seed: int = 1234
    """Seed of initialisation, data order and dropout."""
    precision: Precision = "fp32"
    """Compute precision: fp32, bf16 (fp32 master weights), fp16 (loss scaling) or fp8 (torchao float8)."""
    compile: CompileMode = "none"
    """torch.compile each transformer block (blocks: one graph per block, compiled once per shape) or none."""
    initial_loss_scale: float = 65536.0
    """Starting loss scale for fp16."""
    eval_interval: int = 50
    """Evaluate on the held-out split every this many steps (and at the end); 0 disables."""
    eval_batches: int = 4
    """Global batches per evaluation."""
    max_bad_steps: int = 5
    """Stop, keeping the last good checkpoint, after this many skipped steps in a row (non-finite, spike)."""
    loss_spike_factor: float = 2.0
    """Skip an update whose loss is over this times the recent good steps' mean (2: real spikes); 0: off."""
    loss_spike_window: int = 100
    """Good steps in the mean loss_spike_factor compares to (100 smooths batch noise); checked once full."""
    straggler_factor: float = 1.5
    """Name in the progress line a rank whose step compute time is over this times the median; 0: off."""
    num_threads: int = 0
    """torch intra-op threads on CPU; 0 keeps torch's default."""
    hang_timeout_s: float = 300.0
    """Seconds a rank may wait without progress; then every rank reports where it waits and the job exits."""
    optimizer: OptimizerName = "adamw"
    """adamw, or muon: Muon on blocks' matrices (per expert), AdamW on embeddings, head, norms, router."""
    muon_lr: float | None = None
    """Muon's peak learning rate, on train.lr's schedule; null: train.lr (Moonlight's choice)."""
    muon_momentum: float = 0.95
    """Muon's momentum coefficient mu (buffer = mu * buffer + gradient)."""
    muon_nesterov: bool = True
    """Muon orthogonalises the Nesterov look-ahead gradient + mu * buffer instead of the buffer."""
    muon_ns_steps: int = 5
    """Newton-Schulz iterations per orthogonalisation (1 to 99)."""
    muon_ns_coefficients: list[float] = field(default_factory=lambda: [3.4445, -4.775, 2.0315])
    """The quintic Newton-Schulz coefficients (a, b, c) (Keller Jordan's, torch.optim.Muon's default)."""
    muon_weight_decay: float | None = None
    """Decoupled weight decay of the Muon matrices; null: train.weight_decay."""
    muon_adjust_lr: MuonLrAdjust = "match_rms_adamw"
    """Per-matrix lr scale: match_rms_adamw 0.2*sqrt(max(A,B)) (Moonlight), original sqrt(max(1,A/B))."""
    fp8_recipe: Fp8Recipe = "tensorwise"
    """torchao float8 scaling under precision=fp8: tensorwise (a scale per tensor) or rowwise (per row)."""
    fp8_filter: Fp8Filter = "all"
    """Which block linears run fp8: all, or auto (not the shapes torchao finds slower in fp8 on H100)."""
    fp8_all_gather: bool | None = None
    """ZeRO-3 all-gathers fp8 weights (1 byte each, torchao); null: on where it applies (tensorwise, tp 1)."""
    fp8_grouped_mm: Fp8GroupedMM = "auto"
    """Experts' grouped GEMM in fp8: auto (sm90 rowwise, sm100+ mxfp8, else bf16), rowwise, mxfp8, bf16."""


@dataclass
class DataConfig:
    """Where the tokens come from."""

    corpus: str = "stdlib"
    """Built-in corpus used when no prefixes are given: stdlib (the Python standard library's sources)."""
    prefixes: list[str] = field(default_factory=list)
    """Indexed-dataset prefixes (path without .bin/.idx); empty means the built-in corpus."""
    weights: list[float] = field(default_factory=list)
    """Blend weights, one per prefix; empty means proportional to size."""
    tokenizer: str | None = None
    """SentencePiece model file or Hugging Face tokenizer directory; null means train one on the corpus."""
    split: str = "98,2,0"
    """Train/valid/test proportions of the documents."""
    cache_dir: str = "~/.cache/llmtrain"
    """Where prepared corpora, tokenizers and index files are cached."""
    num_workers: int = 0
    """DataLoader worker processes per rank."""
    reset_attention_mask: bool = False
    """Packed documents: attention stays inside each document (ended by its eod token), positions restart."""
    sources: list[str] = field(default_factory=list)
    """Raw documents tokenized while training: .jsonl[.gz]/.parquet/.txt files, save_to_disk dirs, hf:NAME."""
    text_key: str = "text"
    """The field (JSON key, column) of data.sources records that holds the document text."""
    on_bad_document: OnBadDocument = "skip"
    """An unreadable data.sources record (bad JSON, missing key, not UTF-8): skip and count it, or error."""
    shuffle_documents: bool = False
    """data.sources: take each chunk of 2048 records in an order drawn from train.seed (false: file order)."""


@dataclass
class CheckpointConfig:
    """Saving and resuming."""

    interval: int = 100
    """Save every this many steps (and at the end, and on SIGINT/SIGTERM); 0 disables step-based saves."""
    interval_minutes: float = 30.0
    """Also save when this many minutes of wall-clock time passed since the last save; 0 disables."""
    keep: int = 2
    """Number of most recent checkpoints kept."""
    async_save: bool = False
    """Write checkpoints in the background while training continues."""
    load: str | None = None
    """Where a fresh run starts from (step, optimizer, data position); output_dir's own checkpoint wins."""
    resume: bool = True
    """Resume from output_dir's latest checkpoint; false refuses to start in an output_dir holding a run."""
    archive_existing: bool = False
    """Move a run found in output_dir to <output_dir>/archive/<timestamp>/ and start this one afresh."""
    on_save_error: OnSaveError = "continue"
    """A failed save (full disk, write error) keeps the last good checkpoint; continue training or stop."""
    export_hf: bool = False
    """At the end of training also write the final weights and tokenizer as a Hugging Face model directory."""


@dataclass
class WandbConfig:
    """Weights & Biases: the same scalars as TensorBoard, and the config, from rank 0 (pip install wandb)."""

    project: str | None = None
    """W&B project to log to; null: no W&B (WANDB_MODE=offline logs to <output_dir>/wandb, no account)."""
    name: str | None = None
    """Display name of the W&B run; null: the name of output_dir."""
    entity: str | None = None
    """W&B user or team that owns the project; null: your default entity."""
    tags: list[str] = field(default_factory=list)
    """Tags of the W&B run."""


@dataclass
class LoggingConfig:
    """What a run reports."""

    interval: int = 10
    """Log metrics every this many steps (and always the last)."""
    tensorboard: bool = True
    """Write TensorBoard event files to <output_dir>/tensorboard."""
    time_breakdown: bool = False
    """Measure forward, backward, optimizer and communication time per step (adds synchronisation)."""
    profile_steps: list[int] = field(default_factory=list)
    """[first, last] steps to trace with torch.profiler; empty disables."""
    peak_tflops: float | None = None
    """Dense peak TFLOP/s of one device for MFU; null: a GPU's datasheet or measured figure, none on CPU."""
    memory: bool = False
    """CPU: track each rank's peak bytes of live tensors (slows every op), else peak RSS; CUDA: allocator."""
    wandb: WandbConfig = field(default_factory=WandbConfig)
    """Weights & Biases logging (off unless wandb.project is set)."""


@dataclass
class JobConfig:
    """A whole training job."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The architecture."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """The parallel layout."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """The optimisation loop."""
    data: DataConfig = field(default_factory=DataConfig)
    """The data."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpointing."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metrics and progress."""
    output_dir: str = "runs/default"
    """Directory for metrics, TensorBoard logs and checkpoints."""
