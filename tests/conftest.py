"""Session-wide test setup, loaded before any test module.

Triton picks interpreted or compiled kernels when a @triton.jit function is defined, so on a machine
without CUDA the interpreter must be on before any test module (of any folder) imports a kernel module.

The suite runs as two pytest-xdist workers on two cores, each starting rank processes of its own, so every
process keeps one intra-op thread, as torchrun gives each of its ranks: with torch's default (a thread per
core) the workers' OpenMP threads spin on cores the other worker and its ranks need (the quick subset ran
10% faster with one thread: 101 s against 113 s).
"""

import os

import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")  # the processes tests start
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # this one: torch read the variable on import

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
