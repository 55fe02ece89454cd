"""Make tests/ importable so tests can share helper modules (`from helpers_tiny_models import ...`), and,
without CUDA, run triton kernels under triton's CPU interpreter.

TRITON_INTERPRET must be set before any module that defines a triton kernel is imported (a kernel
defined earlier refuses the interpreter), and pytest imports every test module while collecting, in
any order the command line gives: so it is set here, once, before anything is collected.
"""

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
