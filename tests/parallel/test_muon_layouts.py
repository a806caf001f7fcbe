"""train.optimizer=muon on sharded layouts trains like one process (dp=4 ZeRO-1, dp=4 ZeRO-3, tp=2 x pp=2,
ep=2 with tp=2 and ZeRO-1, latent attention under tp=2 x ep=2 at ZeRO-3, multi-token prediction at tp=2 x
pp=2), and its momentum state moves between
layouts through a checkpoint. All cases run in one 4-process gloo group.

The reference is plain torch on one process in fp32: the model, torch.optim.AdamW over the AdamW parameters
and torch.optim.Muon over the Muon ones (a stack of experts one expert at a time, a fused gate_up_proj as gate
and up, as torch.optim.Muon takes 2-D parameters only), clip_grad_norm_. Our layouts reduce gradients in other
orders, so they differ from it by fp32 rounding (relative ~1e-7), and Muon casts its input to bf16 before
Newton-Schulz: where fp32 rounding moves an element across a bf16 rounding boundary, that element of the input
changes by one bf16 ulp (2**-8 relative). How much that moves the orthogonalised update depends on the matrix
(Newton-Schulz's slope near a small singular value is a = 3.4445 per iteration, a**5 ~ 490 over five), so the
reference measures it at every step: Newton-Schulz of its own input with every element moved by one ulp in a
random direction (_flip_sensitivity), more than the few flips rounding causes; a Muon weight may be off by
twice that times the step's adjusted lr, per step, plus fp32 rounding of the weight. Orthogonalising shards
instead of whole matrices errs by over 16 times 2**-5 of the largest update
(tests/parallel/test_muon.py::test_orthogonalising_shards_is_far_from_the_whole). The AdamW parameters may be
off by 2**-5 of their tensor's largest update per step: their gradients carry the Muon weights' differences of
earlier steps, and Adam's normalisation passes a gradient's relative error on (an embedding row that nearly
cancels has a large one); ADAM_EPS bounds what a gradient far below it can do. On this machine the worst
weight sat at a quarter of its bound. Losses and gradient norms meet the issues' relative gap ISSUE_GAP.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

from llmtrain import models
from llmtrain.checkpoint.convert import read_full
from llmtrain.parallel import Topology
from llmtrain.parallel.muon import muon_updates
from tests.parallel._dist import batches, parallel_run, spawn, tiny_job
from tests.parallel._muon import muon_blocks, torch_pair
from tests.parallel._reference import ISSUE_GAP, U32, worst_gap
from tests.parallel._resume import build_as_training, resume_failures, save, train_steps

STEPS, LR = 3, 1e-3
FLIP_MARGIN = 2.0
"""Muon tensors: twice the measured flip sensitivity (_flip_sensitivity) per step."""
UPDATE_SHARE = 2.0**-5
"""AdamW tensors: the fraction of a step's largest update of the tensor by which each element may differ."""
ADAM_EPS = 1e-4
"""Adam's eps in these runs (module docstring): a gradient element far below it moves its weight by at most
lr * |g| / eps, so its error does too."""
LAYOUTS = [
    ("llama", dict(dp=4, zero_stage=1)),
    ("llama", dict(dp=4, zero_stage=3)),
    ("mixtral", dict(tp=2, dp=2, ep=2, zero_stage=1)),
    ("deepseek_v3", dict(tp=2, dp=2, ep=2, zero_stage=3)),
    # tp=2 x pp=2, with multi-token prediction: its module's matrices on Muon, on the last stage with the
    # embedding's copy, beside every matrix a tp=2 x pp=2 llama without it has (no launch of its own).
    ("llama", dict(tp=2, pp=2, mtp_layers=1)),
]


def _muon_job(arch: str, **settings: object):
    return tiny_job(arch, optimizer="muon", adam_eps=ADAM_EPS, lr=LR, **settings)


def _flip_sensitivity(leaf: torch.nn.Parameter, opt: torch.optim.Muon, g: torch.Generator) -> float:
    """How far Newton-Schulz moves when every element of this step's input (Nesterov's look-ahead, rebuilt
    from the leaf's gradient and momentum) moves by one bf16 ulp, each in a random direction: more than
    the bf16 rounding flips that fp32 rounding differences can cause, which touch few elements by at most
    one ulp each."""
    group = opt.param_groups[0]
    mu = group["momentum"]
    update = (
        leaf.grad.lerp(opt.state[leaf]["momentum_buffer"], mu)
        if group["nesterov"]
        else opt.state[leaf]["momentum_buffer"]
    )
    signs = torch.randint(0, 2, update.shape, generator=g).float() * 2 - 1
    flipped = update * (1 + 2.0**-8 * signs)
    args = (group["ns_coefficients"], group["ns_steps"], group["eps"])
    moved = _zeropower_via_newtonschulz(flipped, *args).float()
    return (moved - _zeropower_via_newtonschulz(update, *args).float()).abs().max().item()


def _reference(arch: str, data: list[torch.Tensor], mtp_layers: int = 0) -> dict:
    """Plain torch fp32 on one process (module docstring): losses, gradient norms, final weights and each
    tensor's bound."""
    job = _muon_job(arch, mtp_layers=mtp_layers)
    t = job.train
    torch.manual_seed(t.seed)
    model = models.build(job.model)
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    muon = {n: p for n, p in named.items() if muon_updates(n, p.shape)}
    # torch.optim.Muon over 2-D leaves (muon_blocks: a matrix, one per expert, gate and up apart), copied in
    # and out.
    leaves = {n: [torch.nn.Parameter(b.detach().clone()) for b in muon_blocks(n, p)] for n, p in muon.items()}
    adamw, ref_muon = torch_pair(
        job,
        {n: p for n, p in named.items() if n not in muon},
        [leaf for parts in leaves.values() for leaf in parts],
    )
    bounds = {n: torch.zeros_like(p) for n, p in named.items()}
    g = torch.Generator().manual_seed(7)
    losses, norms = [], []
    for batch in data:
        micro = batch.split(t.micro_batch_size)
        loss = torch.stack([model(mb[:, :-1], mb[:, 1:]) for mb in micro]).mean()
        model.zero_grad()
        loss.backward()
        losses.append(loss.item())
        norms.append(torch.nn.utils.clip_grad_norm_(list(named.values()), t.grad_clip).item())
        before = {n: p.detach().clone() for n, p in named.items()}
        adamw.step()
        for n, p in muon.items():
            for leaf, value, grad in zip(leaves[n], muon_blocks(n, p), muon_blocks(n, p.grad), strict=True):
                leaf.data.copy_(value.detach())
                leaf.grad = grad.clone()
        ref_muon.step()
        with torch.no_grad():
            for n, p in muon.items():
                p.copy_(torch.cat(leaves[n]).view(p.shape))
                sensitivity = [_flip_sensitivity(leaf, ref_muon, g) for leaf in leaves[n]]
                adjusted = _adjust_lr(LR, t.muon_adjust_lr, leaves[n][0].shape)
                bounds[n] += FLIP_MARGIN * adjusted * max(sensitivity)
        for n, p in named.items():
            step = (p.detach() - before[n]).abs()
            if n not in muon:
                bounds[n] += UPDATE_SHARE * step.max()
            bounds[n] += 4 * U32 * p.detach().abs()
    return {"losses": losses, "norms": norms, "state": model.state_dict(), "bounds": bounds}


def _failures(name: str, run: dict, ref: dict) -> list[str]:
    failures = []
    for kind, got, want in (
        ("loss", run["losses"], ref["losses"]),
        ("grad norm", run["grad_norms"], ref["norms"]),
    ):
        if not worst_gap(got, want) <= ISSUE_GAP:
            failures.append(f"{name}: {kind} {got}, one process {want}")
    for key, bound in ref["bounds"].items():
        excess = ((run["state"][key] - ref["state"][key]).abs() / bound).max().item()
        if not excess <= 1.0:
            failures.append(f"{name}: {key} is {excess:.1f} times its bound from one process")
    return failures


def _layouts(rank: int, world: int, tmp: str) -> list[str]:
    failures: list[str] = []
    references: dict[tuple[str, int], dict] = {}
    for arch, settings in LAYOUTS:
        job = _muon_job(arch, **settings)
        data = batches(job, STEPS)
        run = parallel_run(job, Topology(job.parallel, world, rank), data, LR)
        if rank != 0:
            continue
        key = (arch, job.model.mtp_layers)
        if key not in references:
            references[key] = _reference(arch, data, job.model.mtp_layers)
        failures += _failures(f"{arch} {settings}", run, references[key])
    failures += _resume(rank, world, Path(tmp))
    return failures


def _resume(rank: int, world: int, root: Path) -> list[str]:
    """Saved at dp=4 ZeRO-1 (momentum in flat shards) after 2 steps, resumed at tp=2 dp=2 ZeRO-3 (FSDP
    shards of TP slices): the same state re-saved bitwise, the uninterrupted run's losses continued."""

    def job(out: str, **settings: object):
        j = _muon_job("llama", **settings)
        j.output_dir = str(root / out)
        return j

    data = batches(job("x"), 4)
    # The uninterrupted run is the saving one continued after its save (a save reads the state, changes
    # none of it), as in test_mla_tensor_parallel: no third model of 4 ranks built to repeat its 2 steps.
    saving = build_as_training(job("zero1", dp=4, zero_stage=1), rank, world)
    train_steps(saving, data[:2], LR)
    save(saving, 2)
    expected = train_steps(saving, data[2:], LR)
    loading = build_as_training(job("tp2_zero3", tp=2, dp=2, zero_stage=3), rank, world)
    saved = root / "zero1" / "checkpoints"
    failures = resume_failures("zero1 -> tp2 zero3", saved, loading, 2, data[2:], expected, LR)
    if rank == 0:
        state = read_full(saved, prefix="optim.")
        if "layers.0.attn.q_proj.weight.momentum_buffer" not in state or not math.isfinite(
            state["layers.0.attn.q_proj.weight.momentum_buffer"].abs().sum().item()
        ):
            failures.append(f"no momentum of q_proj in the checkpoint: {sorted(state)[:8]}")
    return failures


@pytest.mark.slow
def test_muon_layouts_train_like_one_process(tmp_path: Path) -> None:
    failures = [f for r in spawn(4, _layouts, str(tmp_path)) for f in r]
    assert not failures, "\n".join(failures)
