"""Which part of the compiled-gradient bug is which: the k-is-v case (fp32) with each fix on or off.

  distinct: apply_distinct (a repeated tensor passed to autograd.Function.apply as a view)
  ops:      the launches as custom ops under compile (off: Triton launches traced into Inductor's graph)
"""
import itertools
import json
import sys

import torch

sys.path.insert(0, ".")
import kernels  # noqa: E402
from kernels import attention, glu, grouped_gemm, loss, norms, rotary  # noqa: E402
from tests.kernels import test_compile as tc  # noqa: E402

MODULES = (attention, glu, grouped_gemm, loss, norms, rotary)
LAUNCHES = {m: {n: f for n in dir(m) if getattr(f := getattr(m, n), "__code__", None) is not None and f.__code__.co_name == "dispatch"} for m in MODULES}
DISTINCT = {m: m.apply_distinct for m in MODULES}


def configure(distinct: bool, ops: bool) -> None:
    for m in MODULES:
        m.apply_distinct = DISTINCT[m] if distinct else (lambda f, *a: f.apply(*a))
        for n, fn in LAUNCHES[m].items():
            setattr(m, n, fn if ops else fn.__wrapped__)


results = []
for case, dtype in itertools.product(["attention-k-is-v", "torch-attention-k-is-v", "rms-norm-residual-is-input"], [torch.float32, torch.bfloat16]):
    for distinct, ops in itertools.product([False, True], [False, True]):
        configure(distinct, ops)
        fn, w_shape = tc.CASES[case]
        torch._dynamo.reset()
        torch.manual_seed(0)
        x = tc.randn(1, 64, 128, dtype=dtype, scale=0.5)
        w = tc.randn(*w_shape, dtype=dtype)
        row = {"case": case, "dtype": str(dtype), "distinct": distinct, "ops": ops}
        try:
            got, got_g = tc._grads(torch.compile(fn, dynamic=False), x, w)
            exp, exp_g = tc._grads(fn, x, w)
            row["max_abs_err"] = {n: (a.double() - e.double()).abs().max().item() for n, a, e in zip(("x", "w"), got_g, exp_g)}
            row["max_abs_grad"] = {n: e.double().abs().max().item() for n, e in zip(("x", "w"), exp_g)}
        except Exception as exc:  # noqa: BLE001
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        print(json.dumps(row), flush=True)
        results.append(row)
json.dump(results, open(sys.argv[1], "w"), indent=1)
