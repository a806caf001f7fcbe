"""train.optimizer=muon (llmtrain.parallel.muon) on one process: which parameters Muon updates,
torch.optim.Muon (with torch.optim.AdamW on the rest) step for step, bitwise, and the shapes it refuses."""

from __future__ import annotations

import pytest
import torch

from llmtrain import models
from llmtrain.errors import UserError
from llmtrain.parallel import Topology, build_optimizer, parallelize
from llmtrain.parallel.muon import fused_parts, muon_updates
from tests.parallel._dist import tiny_job
from tests.parallel._muon import muon_blocks, torch_pair


@pytest.mark.parametrize(
    "arch, settings",
    [
        # bf16 weights: CPU bf16 matmuls make this one ~25 s, so it runs with the slow tests.
        pytest.param("llama", dict(muon_lr=2e-3, muon_adjust_lr="original"), marks=pytest.mark.slow),
        ("mixtral", dict(muon_nesterov=False, muon_ns_steps=3, precision="fp32")),
    ],
)
def test_one_process_equals_torch_muon(arch: str, settings: dict) -> None:
    """Same gradients into our optimizer and into torch's pair: every weight bitwise equal after 3 steps.
    Bitwise is the right tolerance: on whole matrices we run torch's own arithmetic in torch's order
    (lerp, lerp, torch's Newton-Schulz in bf16, its lr adjustment, decay, add), and AdamW is torch's."""
    job = tiny_job(arch, optimizer="muon", grad_clip=0.0, lr=1e-3, **settings)
    topo = Topology.single()
    model = parallelize(models.empty_model(job.model, device="meta"), topo, job)
    opt = build_optimizer(model, topo, job)
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    muon = {n for n, p in named.items() if muon_updates(n, p.shape)}
    # torch's references: a clone of each AdamW parameter, and Muon's 2-D blocks as leaves of their own.
    ref = {
        n: [torch.nn.Parameter(b.clone()) for b in muon_blocks(n, p.detach())]
        if n in muon
        else [torch.nn.Parameter(p.detach().clone())]
        for n, p in named.items()
    }
    defaults = opt.optimizer.adamw.defaults
    adamw, ref_muon = torch_pair(
        job,
        {n: parts[0] for n, parts in ref.items() if n not in muon},
        [leaf for n in muon for leaf in ref[n]],
        fused=defaults.get("fused"),
        foreach=defaults.get("foreach"),
    )
    assert muon, "no parameter went to Muon"
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        opt.zero_grad()
        for n, p in named.items():
            grad = torch.randn(p.shape, generator=g) * 0.01
            p.main_grad.copy_(grad)
            for part, part_grad in zip(ref[n], muon_blocks(n, grad) if n in muon else [grad], strict=True):
                part.grad = part_grad.clone()
        opt.step(job.train.lr)
        adamw.step()
        ref_muon.step()
    for n, p in named.items():
        assert torch.equal(p.detach(), torch.cat(ref[n]).view(p.shape).detach()), n
    assert {k for s in opt.optimizer.state.values() for k in s} == {
        "momentum_buffer",
        "exp_avg",
        "exp_avg_sq",
        "step",
    }


def test_split_follows_the_rule() -> None:
    """Muon: attention, MLP, MLA and shared-expert matrices, routed experts; AdamW: embeddings, head,
    router, norms, biases."""
    job = tiny_job("deepseek_v3")
    model = models.build(job.model)
    muon = {n for n, p in model.named_parameters() if muon_updates(n, p.shape)}
    assert "layers.1.mlp.experts.gate_up_proj" in muon and "layers.1.attn.kv_b_proj.weight" in muon
    assert "layers.1.mlp.shared_experts.down_proj.weight" in muon
    for name in ("embed_tokens.weight", "lm_head.weight", "layers.1.mlp.router.weight", "final_norm.weight"):
        assert name not in muon
    # SwiGLU's fused gate and up are orthogonalised apart, as the recipes' separate w1 and w3.
    assert fused_parts("layers.1.mlp.experts.gate_up_proj") == 2
    assert fused_parts("layers.1.mlp.shared_experts.gate_up_proj.weight") == 2
    assert fused_parts("layers.0.mlp.down_proj.weight") == fused_parts("layers.1.attn.kv_b_proj.weight") == 1
    gpt = models.build(tiny_job("gpt").model)
    assert not {n for n, p in gpt.named_parameters() if muon_updates(n, p.shape) and "embed" in n}


def test_refuses_shapes_it_cannot_orthogonalise() -> None:
    with pytest.raises(UserError, match=r"train\.optimizer=muon .* set train\.optimizer=adamw"):
        muon_updates("layers.0.conv.weight", (4, 3, 2))
    with pytest.raises(UserError, match=r"train\.optimizer=muon cannot orthogonalise .* empty"):
        muon_updates("layers.0.mlp.down_proj.weight", (0, 8))


def test_orthogonalising_shards_is_far_from_the_whole() -> None:
    """The negative control of the sharded layouts' bound (tests/parallel/test_muon_layouts.py): Newton-Schulz
    on the two TP halves of a matrix differs from it on the whole matrix by far more than bf16 rounding."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    g = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))
    coefficients = (3.4445, -4.775, 2.0315)
    whole = _zeropower_via_newtonschulz(g, coefficients, 5, 1e-7).float()
    halves = torch.cat([_zeropower_via_newtonschulz(h, coefficients, 5, 1e-7) for h in g.chunk(2)]).float()
    assert (halves - whole).abs().max() > 16 * 2**-5 * whole.abs().max()
