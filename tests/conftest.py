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
import pytest
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


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread in this process and OMP_NUM_THREADS=1 in the engine processes a module starts (it names this
    in its pytestmark): they share the machine's few cores, where torch's thread pools wait on each other and a tiny
    model's step costs many times its compute."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        yield
    torch.set_num_threads(threads)
