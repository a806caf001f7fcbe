"""The reference of the equivalence tests: plain torch in float64, and the fp32 error bounds it gives.

Our runs compute in fp32, whose results depend on the summation order (BLAS blocking, SIMD width, the split
over micro-batches and ranks), so a fixed tolerance is either below fp32 noise on some CPU or loose
everywhere. Instead the reference runs plain torch (the model, ``torch.optim.AdamW`` or ``SGD``,
``clip_grad_norm_``) in float64, whose rounding is 2**29 times smaller, and every fp32 run -- torch's own and
each of our layouts -- must lie within bounds built from fp32's unit roundoff u and the run's magnitudes:

* Gradients. A weight-gradient element sums, over the step's tokens, products of activations and
  back-propagated gradients, themselves dot products over the hidden, FFN or vocabulary width. Rounding
  along such a chain of N = tokens * width terms grows like u * sqrt(N) relative to the magnitudes summed
  (Higham & Mary 2019, probabilistic rounding error analysis), so we take an element of module k's
  gradient to be wrong by at most GAMMA * G_k, G_k the largest gradient element of that module's
  parameters: an element that cancels to ~0 is summed from terms of its neighbours' size, and a bias
  sums the back-propagated gradient its weight multiplies by O(1) normed inputs. (The gpt key bias, whose
  exact gradient is 0 by the softmax's shift invariance, is the case that needs the module's scale.) An
  element no token reached (the embedding row of an absent token) is exactly 0 in any order.
* The update. SGD moves an element wrongly by lr times its gradient error. Adam's direction
  m / (sqrt(v) + eps) has, for every earlier gradient, a derivative of at most (1 + rho_t) / (sqrt(v_t) +
  eps) (rho_t from the betas by Cauchy-Schwarz, ~1 for a few steps): large where the gradient is tiny
  against its rounding, which is why a single absolute tolerance on the weights failed on one CPU and
  passed on another. Each update also rounds the weight: the decay factor 1 - lr * wd, the product and the
  sum, by at most 3 u (|theta| + |update|).
* Losses move first-order by the weight errors, |dL| <= GAMMA |L| + sum |g| bound; gradient norms by
  |g_hat . H e| <= sum |H g_hat| bound (H g_hat by double backward here) plus GAMMA |g|.

The bounds leave out how one step's weight errors perturb the next step's gradients, which grows like lr^2
against lr for what they cover: the tests run Adam at lr 1e-3 for a few steps (at 1e-2 the third step of an
8-layer model broke them, torch's own fp32 run included). Torch's own fp32 run meets them with the same
margin as ours (``test_single_process_stack_matches_torch``), which shows they sit at fp32 noise and not below
it, while a wrong update (a gradient off by a factor, a missing bias correction, weight decay on a norm)
misses them by orders of magnitude.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import pickle
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any
from unittest import mock

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from llmtrain import models
from llmtrain.config import JobConfig
from llmtrain.parallel import Topology
from llmtrain.parallel.optimizer import no_weight_decay
from tests.parallel._dist import batches, parallel_run, sgd, tiny_job

ISSUE_GAP = 1e-4
"""Worst relative gap of losses and gradient norms to one process that the issues accept (fp32 runs)."""
U32 = 2.0**-24  # unit roundoff of fp32 (round to nearest)


@contextlib.contextmanager
def _float64_math() -> Iterator[None]:
    """The kernels' PyTorch paths upcast statistics with ``.float()``, meaning "at least fp32": inside this
    context a float64 tensor stays float64, so the reference really computes in float64. Attention takes
    the math path, which (unlike the fused CPU kernel) has a double backward."""
    original = torch.Tensor.float

    def at_least_fp32(self: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return self if self.dtype == torch.float64 else original(self, *args, **kwargs)

    with mock.patch.object(torch.Tensor, "float", at_least_fp32), sdpa_kernel(SDPBackend.MATH):
        yield


def rounding_gamma(job: JobConfig, tokens: int) -> float:
    """u * sqrt(N), N = tokens * the widest dimension: relative rounding of the gradient of a step."""
    m = job.model
    return U32 * math.sqrt(tokens * max(m.hidden_size, m.ffn_size, m.vocab_size))


def _gradient_error(named: dict[str, torch.nn.Parameter], gamma: float) -> dict[str, torch.Tensor]:
    """Per element, GAMMA * the largest gradient element of its module, or 0 where the gradient is exactly
    0 (no token reached it)."""
    scale: dict[str, torch.Tensor] = {}
    for n, p in named.items():
        module = n.rpartition(".")[0]
        scale[module] = torch.maximum(scale.get(module, torch.zeros(())), p.grad.abs().max())
    return {n: torch.where(p.grad != 0, gamma * scale[n.rpartition(".")[0]], 0.0) for n, p in named.items()}


def _rho(t: int, beta1: float, beta2: float) -> float:
    """sqrt(sum_s a_s^2 / b_s) over Adam's bias-corrected moment weights at step t (a first, b second):
    |m_hat| <= rho_t sqrt(v_hat) by Cauchy-Schwarz."""
    a = [(1 - beta1) * beta1 ** (t - s) / (1 - beta1**t) for s in range(1, t + 1)]
    b = [(1 - beta2) * beta2 ** (t - s) / (1 - beta2**t) for s in range(1, t + 1)]
    return math.sqrt(sum(x * x / y for x, y in zip(a, b, strict=True)))


def worst_gap(got: Sequence[float], want: Sequence[float]) -> float:
    """The largest relative difference |got - want| / |want| over two equally long curves."""
    return max(abs(a - b) / abs(b) for a, b in zip(got, want, strict=True))


@dataclass
class Reference:
    """A plain-torch run: each step's loss (then the held-out loss, if any), each step's pre-clipping
    gradient norm and the final weights; in float64, with the bounds an fp32 run must stay within."""

    losses: list[float]
    grad_norms: list[float]
    state: dict[str, torch.Tensor]
    weight_bounds: dict[str, torch.Tensor] | None = None
    loss_tolerances: list[float] | None = None
    norm_tolerances: list[float] | None = None

    def check(
        self,
        name: str,
        losses: Sequence[float],
        grad_norms: Sequence[float],
        state: dict[str, torch.Tensor],
    ) -> list[str]:
        """What of an fp32 run (its losses, gradient norms before clipping and final full weights) lies
        outside the bounds, one line per failure."""
        assert self.weight_bounds is not None, "only a float64 reference has bounds"
        failures = []
        for kind, got, want, tol in (
            ("loss", losses, self.losses, self.loss_tolerances),
            ("grad norm", grad_norms, self.grad_norms, self.norm_tolerances),
        ):
            if len(got) != len(want):
                failures.append(f"{name}: {len(got)} values of the {kind} for {len(want)}")
                continue
            for step, (a, b, t) in enumerate(zip(got, want, tol, strict=True)):
                if not abs(a - b) <= t:
                    failures.append(f"{name}: {kind} {step} is {a!r}, float64 {b!r}: bound {t:.2e}")
        if set(state) != set(self.state):
            failures.append(f"{name}: weight names differ: {sorted(set(state) ^ set(self.state))}")
        for key in sorted(set(state) & set(self.state)):
            want, got = self.state[key], state[key].double()
            difference = (got - want).abs()
            ratio = torch.where(difference == 0, 0.0, difference / self.weight_bounds[key])
            if not ratio.max() <= 1.0:
                at = int(ratio.argmax())
                failures.append(
                    f"{name}: {key}[{at}] is {got.flatten()[at].item()!r}, float64 "
                    f"{want.flatten()[at].item()!r}: {ratio.max().item():.1f} times the bound "
                    f"{self.weight_bounds[key].flatten()[at].item():.2e}"
                )
        return failures

    def check_gap(
        self, name: str, losses: Sequence[float], grad_norms: Sequence[float], bound: float = ISSUE_GAP
    ) -> list[str]:
        """The issues' criterion on top of `check`: the worst relative gap of the losses and of the gradient
        norms to this one-process run at most `bound`, one line per failure."""
        failures = []
        for kind, got, want in (("loss", losses, self.losses), ("grad norm", grad_norms, self.grad_norms)):
            gap = worst_gap(got, want)
            if not gap <= bound:
                failures.append(f"{name}: {kind} relative gap {gap:.1e} to one process, bound {bound:.0e}")
        return failures


def torch_reference(
    job: JobConfig,
    batches: Sequence[torch.Tensor],
    lr: float,
    dtype: torch.dtype = torch.float64,
    sgd: bool = False,
    held_out: torch.Tensor | None = None,
    document_separator: int | None = None,
    micro_batch_size: int | None = None,
) -> Reference:
    """Plain torch on one process: the model on each whole global batch (b, s+1) token ids, the llmtrain
    weight-decay groups under AdamW (or ``sgd``: plain SGD over the same groups), clip_grad_norm_ at
    ``job.train.grad_clip`` (0: none), constant ``lr``. In float64 it also derives the fp32 bounds.
    ``document_separator``: packed documents split at that token (the model's document_separator).
    ``micro_batch_size``: the loss is the mean of the losses of the batch's micro-batches of that size, as
    training accumulates them (an MoE's router losses are per micro-batch); None: the whole batch at once."""
    t = job.train
    torch.manual_seed(t.seed)
    model = models.build(job.model).to(dtype)
    model.document_separator = document_separator
    # A frozen parameter (a router's score bias, which only the trainer's bias update moves) takes no part.
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    params = list(named.values())
    decay = [p for n, p in named.items() if not no_weight_decay(n, p)]
    rest = [p for n, p in named.items() if no_weight_decay(n, p)]
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": rest, "weight_decay": 0.0}]
    if sgd:
        opt: torch.optim.Optimizer = torch.optim.SGD(groups, lr=lr)
    else:
        opt = torch.optim.AdamW(groups, lr=lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps)
    bounded = dtype == torch.float64
    bounds = {n: torch.zeros_like(p) for n, p in named.items()}
    # Per element, the largest gradient error of the steps so far (Adam's direction depends on them all).
    gradient_error = {n: torch.zeros_like(p) for n, p in named.items()}
    losses, norms, loss_tol, norm_tol = [], [], [], []

    def loss_and_gradient(batch: torch.Tensor, with_hessian: bool) -> tuple[torch.Tensor, list, list | None]:
        """The loss, its gradient and (``with_hessian``) the Hessian times the gradient's direction."""
        with _float64_math() if bounded else contextlib.nullcontext():
            parts = batch.split(micro_batch_size or batch.shape[0])
            loss = torch.stack([model(mb[:, :-1], mb[:, 1:]) for mb in parts]).mean()
            grads = torch.autograd.grad(loss, params, create_graph=with_hessian)
            if not with_hessian:
                return loss.detach(), list(grads), None
            norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).detach()
            hessian = torch.autograd.grad(grads, params, grad_outputs=[g.detach() / norm for g in grads])
        return loss.detach(), [g.detach() for g in grads], list(hessian)

    def first_order(values: list[torch.Tensor]) -> float:
        return float(sum((v.abs() * bounds[n]).sum() for n, v in zip(named, values, strict=True)))

    for step, batch in enumerate(batches, start=1):
        gamma = rounding_gamma(job, batch.shape[0] * (batch.shape[1] - 1))
        loss, grads, hessian = loss_and_gradient(batch, with_hessian=bounded)
        losses.append(loss.item())
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        norms.append(torch.nn.utils.clip_grad_norm_(params, t.grad_clip or math.inf).item())
        if bounded:
            loss_tol.append(gamma * abs(losses[-1]) + first_order(grads))
            norm_tol.append(gamma * norms[-1] + first_order(hessian))
            step_error = _gradient_error(named, gamma)
        before = {n: p.detach().clone() for n, p in named.items()}
        opt.step()
        if not bounded:
            continue
        rho = _rho(step, t.adam_beta1, t.adam_beta2)
        for n, p in named.items():
            if sgd:
                direction_error = step_error[n]
            else:
                gradient_error[n] = torch.maximum(gradient_error[n], step_error[n])
                v_hat = opt.state[p]["exp_avg_sq"] / (1 - t.adam_beta2**step)
                direction_error = (1 + rho) * gradient_error[n] / (v_hat.sqrt() + t.adam_eps)
            rounding = 3 * U32 * (p.detach().abs() + (p.detach() - before[n]).abs())
            bounds[n] += lr * direction_error + rounding
    if held_out is not None:
        gamma = rounding_gamma(job, held_out.shape[0] * (held_out.shape[1] - 1))
        loss, grads, _ = loss_and_gradient(held_out, with_hessian=False)
        losses.append(loss.item())
        loss_tol.append(gamma * abs(losses[-1]) + first_order(grads))
    state = model.state_dict(keep_vars=True)
    # state_dict lists a tied weight under both names; both carry the parameter's bound. Frozen parameters
    # never move: their bound is 0.
    name_of = {id(p): n for n, p in named.items()}
    return Reference(
        losses,
        norms,
        {k: v.detach().clone() for k, v in state.items()},
        {k: bounds[name_of[id(v)]] if id(v) in name_of else torch.zeros_like(v) for k, v in state.items()}
        if bounded
        else None,
        loss_tol if bounded else None,
        norm_tol if bounded else None,
    )


STORE = "LLMTRAIN_TEST_REFERENCES"
"""Environment variable naming a folder where `stored_reference` keeps each float64 reference it computes,
for every later test and spawned rank of the session (tests/parallel/conftest.py sets it per session)."""


def stored_reference(job: JobConfig, batches: Sequence[torch.Tensor], lr: float, **kw: Any) -> Reference:
    """`torch_reference` (same arguments), computed once per test session: the same model, training
    settings, batches and arguments a second time, in this process, a later test or another spawned
    group, load it from the folder $LLMTRAIN_TEST_REFERENCES names (unset: computed afresh). The key is
    everything the reference reads, so a stored one is the one that computing would give."""
    folder = os.environ.get(STORE)
    if folder is None:
        return torch_reference(job, batches, lr, **kw)
    arguments = {k: v.tolist() if isinstance(v, torch.Tensor) else repr(v) for k, v in sorted(kw.items())}
    what = (repr(job.model), repr(job.train), [b.tolist() for b in batches], lr, arguments)
    path = os.path.join(folder, hashlib.sha256(pickle.dumps(what)).hexdigest() + ".pt")
    if os.path.exists(path):
        return torch.load(path, weights_only=False)
    reference = torch_reference(job, batches, lr, **kw)
    torch.save(reference, f"{path}.{os.getpid()}")
    os.replace(f"{path}.{os.getpid()}", path)  # whole or absent for a reader in another process
    return reference


STEPS = 3
"""Steps of the layout runs: enough for Adam's moments and updated weights to feed back into a gradient."""
LR, SGD_LR = 1e-3, 1.0
"""Adam at 1e-3 (the bounds' regime, see the module docstring); SGD at 1.0 moves the weights by the gradient
itself, so a gradient off by any factor shows in them (Adam would normalise it away)."""
EOD = 3
"""The end-of-document token of the packed-document layouts."""

Layout = tuple[str, dict[str, Any], str]
"""(arch, tiny_job settings, optimizer "adamw" or "sgd"); the setting packed=True makes the batches packed
documents of a few tokens each, ended by EOD."""
CheckRun = Callable[[str, JobConfig, Topology, dict[str, Any]], list[str]]
"""Extra checks of one layout's run on rank 0: (name, job, topology, parallel_run's result) -> failures."""


def train_layouts(
    rank: int, world: int, layouts: Sequence[Layout], check_run: CheckRun | None = None
) -> list[str]:
    """Run each layout on this rank of a `world`-process job (one process launch for them all) and, on rank
    0, compare its losses, gradient norms and final weights with the float64 one-process run: within the
    fp32 bounds and the issues' gap. The reference runs each micro-batch as training accumulates them (an
    MoE's router losses are per micro-batch); layouts whose models differ only in recompute share it, and
    each is computed once per session (`stored_reference`)."""
    failures: list[str] = []
    for arch, settings, optimizer in layouts:
        packed = settings.get("packed", False)
        job = tiny_job(arch, **{k: v for k, v in settings.items() if k != "packed"})
        lr = SGD_LR if optimizer == "sgd" else LR
        if optimizer == "sgd":
            job.train.grad_clip = job.train.weight_decay = 0.0
        data = batches(job, STEPS)
        separator = None
        if packed:
            g = torch.Generator().manual_seed(5)
            data = [torch.where(torch.rand(b.shape, generator=g) < 0.2, EOD, b) for b in data]
            separator = EOD

        def setup(model: torch.nn.Module, separator: int | None = separator) -> None:
            model.document_separator = separator

        topo = Topology(job.parallel, world, rank)
        make = sgd(lr) if optimizer == "sgd" else None
        run = parallel_run(job, topo, data, lr, make, setup=setup)
        if rank != 0:
            continue
        name = f"{arch} {optimizer} world={world} {' '.join(f'{k}={v}' for k, v in settings.items())}"
        if len(run["losses"]) != STEPS:
            failures.append(f"{name}: {len(run['losses'])} steps ran of {STEPS}")
        # Layouts whose models differ only in recompute share the reference (of the model without it), also
        # with the other world sizes and modules of the session (stored_reference).
        plain = replace(job, model=replace(job.model, recompute="none", recompute_layers=[]))
        ref = stored_reference(
            plain,
            data,
            lr,
            sgd=optimizer == "sgd",
            document_separator=separator,
            micro_batch_size=job.train.micro_batch_size,
        )
        if check_run is not None:
            failures += check_run(name, job, topo, run)
        failures += ref.check(name, run["losses"], run["grad_norms"], run["state"])
        failures += ref.check_gap(name, run["losses"], run["grad_norms"])
    return failures
