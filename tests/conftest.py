"""Keep the checkout root off sys.path, make tests/ importable so tests can share helper modules (`from helpers_tiny_models import ...`), and,
without CUDA, run triton kernels under triton's CPU interpreter.

TRITON_INTERPRET must be set before any module that defines a triton kernel is imported (a kernel
defined earlier refuses the interpreter), and pytest imports every test module while collecting, in
any order the command line gives: so it is set here, once, before anything is collected; the interpreter is
repaired here too (helpers_triton.repair_interpreter), so a test gives the same result alone and in the suite.
"""

import os
import sys
from pathlib import Path

# First: importing flotilla drops the checkout root that `python -m pytest` put on sys.path, before any test
# imports transformers (whose `kernels` import the root's kernels/ would otherwise shadow).
import flotilla  # noqa: F401
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    try:
        import triton  # noqa: F401
    except ImportError:  # a CPU-only install: the kernel tests skip
        pass
    else:
        from helpers_triton import repair_interpreter

        repair_interpreter()
