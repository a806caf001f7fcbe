"""Session-wide test setup, loaded before any test module.

Triton picks interpreted or compiled kernels when a @triton.jit function is defined, so on a machine
without CUDA the interpreter must be on before any test module (of any folder) imports a kernel module.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
