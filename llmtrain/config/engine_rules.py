"""Whether the training engine and precision can run a job: DeepSpeed, offloading (to CPU or NVMe), fp8.

As in llmtrain.config.layout_rules, each *_problem function returns "" or the message naming the field and
the fix. Whether an optional package is installed is asked without importing it (importlib.util.find_spec),
so validating a config imports no torch.
"""

from __future__ import annotations

import importlib.util

from llmtrain.config.schema import JobConfig, ModelConfig, ParallelConfig


def engine_problem(job: JobConfig) -> str:
    """Why parallel.engine / parallel.offload cannot run this job, naming the field and the nearest layout
    that can ("" if they can). DeepSpeed wraps one whole, unsplit model: its ZeRO engine shards over data
    parallelism only, so llmtrain's tensor and pipeline parallelism stay with parallel.engine=llmtrain."""
    p = job.parallel
    if p.engine == "llmtrain":
        if p.offload != "none":
            return (
                f"parallel.offload={p.offload} needs parallel.engine=deepspeed (llmtrain's own engine keeps "
                "everything on the device); set parallel.engine=deepspeed or parallel.offload=none"
            )
        return ""
    if importlib.util.find_spec("deepspeed") is None:
        return (
            "parallel.engine=deepspeed needs the deepspeed package, which is not installed; "
            "run pip install 'llmtrain[deepspeed]' or set parallel.engine=llmtrain"
        )
    if p.tp > 1 or p.pp > 1:
        return (
            f"parallel.engine=deepspeed runs data parallelism only, not tp={p.tp} pp={p.pp}; use tp=1 pp=1 "
            "with every process in dp (the nearest layout), or parallel.engine=llmtrain for tp/pp"
        )
    if p.zero_stage not in (1, 2, 3):
        return (
            f"parallel.engine=deepspeed shards with ZeRO; set parallel.zero_stage to 1, 2 or 3 "
            f"(got {p.zero_stage}), or use parallel.engine=llmtrain for plain data parallelism"
        )
    if p.dp_shard is not None:
        return (
            f"parallel.dp_shard={p.dp_shard} (hybrid sharding) is FSDP2's, on parallel.engine=llmtrain; "
            "leave parallel.dp_shard null with parallel.engine=deepspeed, or use parallel.engine=llmtrain"
        )
    if p.grad_reduce == "step":
        return (
            "parallel.grad_reduce=step is FSDP2's, on parallel.engine=llmtrain; DeepSpeed reduces its "
            "gradients as it accumulates them: leave it at microbatch, or use parallel.engine=llmtrain"
        )
    if p.offload == "optimizer+params" and p.zero_stage != 3:
        return (
            f"parallel.offload=optimizer+params needs parallel.zero_stage=3 (only ZeRO-3 partitions the "
            f"parameters; got {p.zero_stage}); set zero_stage=3 or parallel.offload=optimizer"
        )
    if job.train.precision == "fp16":
        return (
            "train.precision=fp16 is not supported with parallel.engine=deepspeed (DeepSpeed's own loss "
            "scaler would disagree with llmtrain's bad-step skipping); use bf16 or parallel.engine=llmtrain"
        )
    if job.train.precision == "fp8":
        return (
            "train.precision=fp8 (llmtrain.parallel.float8) is wired into llmtrain's engine only; use "
            "train.precision=bf16 with parallel.engine=deepspeed, or parallel.engine=llmtrain for fp8"
        )
    return ""


def nvme_problem(p: ParallelConfig) -> str:
    """Why parallel.offload_device / parallel.nvme_path cannot run ("" if they can). DeepSpeed swaps to
    NVMe at zero stage 3 only (ZeRO-Infinity), through its async_io op, which builds against libaio."""
    if p.offload_device == "cpu":
        if p.nvme_path is not None:
            return (
                f"parallel.nvme_path={p.nvme_path} is read only with parallel.offload_device=nvme; set "
                "parallel.offload_device=nvme or leave parallel.nvme_path null"
            )
        return ""
    if p.engine != "deepspeed" or p.offload == "none":
        return (
            "parallel.offload_device=nvme says where parallel.offload puts what it offloads; set "
            "parallel.engine=deepspeed and parallel.offload=optimizer or optimizer+params, or "
            "parallel.offload_device=cpu"
        )
    if p.zero_stage != 3:
        return (
            f"parallel.offload_device=nvme needs parallel.zero_stage=3 (DeepSpeed swaps to NVMe at ZeRO-3 "
            f"only; got {p.zero_stage}); set zero_stage=3 or parallel.offload_device=cpu"
        )
    if not p.nvme_path:
        return (
            "parallel.offload_device=nvme needs parallel.nvme_path, a directory on a local NVMe drive for "
            "DeepSpeed's swap files"
        )
    if not async_io_available():
        return (
            "parallel.offload_device=nvme needs DeepSpeed's async_io op, which needs libaio (headers and "
            "library not found): apt install libaio-dev (yum install libaio-devel), or set "
            "parallel.offload_device=cpu"
        )
    return ""


def async_io_available() -> bool:
    """Whether DeepSpeed's async_io op (NVMe swapping) can build here: it compiles a test against libaio."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    return bool(AsyncIOBuilder().is_compatible(verbose=False))


# torch._scaled_mm needs every GEMM dimension to be a multiple of 16: in and out features (of this rank's
# slice under TP), and the token count (of this CP rank), the reduction dimension of the weight gradient.
FP8_MULTIPLE = 16
# The experts' float8 grouped GEMMs reduce over the hidden size (forward of gate_up, input gradient of down)
# and the expert ffn size (the others): torch._scaled_grouped_mm needs multiples of 16 (rowwise), MXFP8 its
# scaling blocks of 32 elements. (auto resolves by device; its choices hold on the dims they run at.)
GROUPED_MM_MULTIPLE = {"rowwise": 16, "mxfp8": 32}


def grouped_mm_misfit(mode: str, model: ModelConfig) -> tuple[str, int, int] | None:
    """The first of the experts' grouped-GEMM dimensions that grouped GEMM ``mode`` cannot take: (the
    field, its value, the multiple it needs); None where every one fits (or ``mode`` has no multiple)."""
    block = GROUPED_MM_MULTIPLE.get(mode)
    if block:
        for name, value in (
            ("model.hidden_size", model.hidden_size),
            ("model.moe_ffn_hidden_size (resolved)", model.expert_ffn_size),
        ):
            if value % block:
                return name, value, block
    return None


def small_gemm(recipe: str, out_features: int, in_features: int) -> bool:
    """Whether torchao's H100 tables find this (full) weight shape slower in float8 than in bf16
    (``train.fp8_filter=auto``, as llmtrain.parallel.float8 applies it and the planner models it): the
    thresholds of torchao.float8's auto filter for each recipe."""
    n, k = out_features, in_features
    if recipe == "tensorwise":
        return k <= 4096 and n <= 1024
    return n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048)


def float8_all_gather_blocker(
    precision: str, fp8_recipe: str, zero_stage: int, tp: int, engine: str = "llmtrain"
) -> str:
    """What keeps ZeRO-3's weight all-gathers from running in float8 (torchao's FSDP2 float8 all-gather,
    llmtrain.parallel.float8_gather), as 'field=needed (got value)', or '' when they can: the weight's one
    scale must be over the whole tensor, which the FSDP mesh holds only without TP, and only tensorwise
    scaling has one."""
    for name, value, needed in (
        ("train.precision", precision, "fp8"),
        ("train.fp8_recipe", fp8_recipe, "tensorwise"),
        ("parallel.zero_stage", zero_stage, 3),
        ("parallel.tp", tp, 1),
        ("parallel.engine", engine, "llmtrain"),
    ):
        if value != needed:
            return f"{name}={needed} (got {value})"
    return ""


def float8_all_gather(job: JobConfig) -> bool:
    """Whether ZeRO-3 gathers the float8 linears' weights in float8 (train.fp8_all_gather; null: wherever
    it applies, as torchtitan recommends it with tensorwise scaling under FSDP2)."""
    return job.train.fp8_all_gather is not False and not _job_blocker(job)


def _job_blocker(job: JobConfig) -> str:
    p, t = job.parallel, job.train
    return float8_all_gather_blocker(t.precision, t.fp8_recipe, p.zero_stage, p.tp, p.engine)


def float8_problem(job: JobConfig) -> str:
    """Why `job` cannot train with train.precision=fp8 (llmtrain.parallel.float8), or '' when it can."""
    if job.train.fp8_all_gather:
        blocker = _job_blocker(job)
        if blocker:
            return (
                f"train.fp8_all_gather=true (float8 weight all-gather under ZeRO-3) needs {blocker}; "
                "set train.fp8_all_gather=null (on where it applies) or false"
            )
    if job.train.precision != "fp8":
        return ""
    m, p, t = job.model, job.parallel, job.train
    if importlib.util.find_spec("torchao") is None:
        return "train.precision=fp8 needs torchao (pip install 'llmtrain[fp8]'); or use train.precision=bf16"
    tp, tokens = p.tp, t.micro_batch_size * m.seq_length // p.cp
    hd = m.head_size
    sizes = {
        "model.hidden_size": m.hidden_size,
        "model.num_attention_heads x head size / parallel.tp": m.num_attention_heads * hd // tp,
        "model.num_kv_heads x head size / parallel.tp (one head at least)": max(m.kv_heads // tp, 1) * hd,
        "train.micro_batch_size x model.seq_length / parallel.cp (tokens per GEMM)": tokens,
    }
    if not m.is_moe or m.dense_layers or m.moe_layer_start > 0 or m.moe_layer_interval > 1:
        sizes["model.ffn_hidden_size (resolved) / parallel.tp"] = m.ffn_size // tp
    if m.is_moe:
        # Shared experts are fp8 linears over the 1/tp of the tokens each TP rank routes; the routed experts'
        # grouped GEMM is fp8 as train.fp8_grouped_mm says (llmtrain.parallel.float8_experts).
        misfit = grouped_mm_misfit(t.fp8_grouped_mm, m)
        if misfit:
            name, value, block = misfit
            return (
                f"train.fp8_grouped_mm={t.fp8_grouped_mm} needs {name} to be a multiple of {block} "
                f"(its scaling blocks); got {value}: change it or set train.fp8_grouped_mm=bf16"
            )
        if m.num_shared_experts:
            sizes["model.num_shared_experts x expert ffn size"] = m.num_shared_experts * m.expert_ffn_size
        sizes["tokens per GEMM / parallel.tp in a mixture-of-experts layer"] = tokens // tp
    if m.arch == "deepseek_v3":
        heads, nope = m.num_attention_heads // tp, m.qk_nope_head_dim
        if m.q_lora_rank:
            sizes["model.q_lora_rank"] = m.q_lora_rank
        sizes |= {
            "model.kv_lora_rank + model.qk_rope_head_dim": m.kv_lora_rank + m.qk_rope_head_dim,
            "heads / parallel.tp x (qk_nope + qk_rope head dims)": heads * (nope + m.qk_rope_head_dim),
            "heads / parallel.tp x (qk_nope_head_dim + v_head_dim)": heads * (nope + m.v_head_dim),
            "heads / parallel.tp x v_head_dim": heads * m.v_head_dim,
        }
    for name, value in sizes.items():
        if value % FP8_MULTIPLE:
            return (
                f"train.precision=fp8 needs {name} to be a multiple of {FP8_MULTIPLE} (float8 GEMMs); "
                f"got {value}; change it or use train.precision=bf16"
            )
    return ""


def compile_problem(job: JobConfig) -> str:
    """Why train.compile=blocks cannot run this job, or '' when it can. Compiled blocks are verified on one
    model replica (data parallelism and ZeRO around them): the tensor-, context- and expert-parallel layers
    call collectives inside a block, and pipeline stages patch the blocks' linear layers, which no compiled
    run has been checked against yet."""
    p = job.parallel
    if job.train.compile == "none":
        return ""
    for name, value in (("tp", p.tp), ("pp", p.pp), ("cp", p.cp), ("ep", p.ep)):
        if value > 1:
            return (
                f"train.compile={job.train.compile} is verified without model parallelism; parallel.{name}="
                f"{value}: set parallel.{name}=1 or train.compile=none"
            )
    if p.engine != "llmtrain":
        return f"train.compile={job.train.compile} needs parallel.engine=llmtrain; or set train.compile=none"
    return ""
