"""Compiling triton kernels for an H100/H200 (sm_90) without a GPU.

Triton's CPU interpreter runs kernels as numpy and checks little of the language's typing, so each kernel is
also compiled for sm_90 (ptxas ships with triton) in a child process started without TRITON_INTERPRET.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_DRIVER = """
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
target = GPUTarget("cuda", int(sys.argv[1]), 32)
for module, name, pointers, floats, constexprs, num_warps in json.loads(sys.argv[2]):
    fn = getattr(importlib.import_module(module), name)
    # constexprs the spec leaves out take their defaults (e.g. USE_GDC, kernels/triton/pdl.py)
    constexprs = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **constexprs}
    signature = {a: "constexpr" if a in constexprs else pointers.get(a, "fp32" if a in floats else "i32")
                 for a in fn.arg_names}
    triton.compile(ASTSource(fn, signature, constexprs), target=target, options={"num_warps": num_warps})
"""

CompileSpec = tuple[str, str, dict[str, str], Sequence[str], dict[str, Any], int]
"""(module, kernel name, argument types of the pointers (and any typed scalar), the float scalars' names (other
scalars are i32), constexpr values, num_warps)."""


def compile_for_sm90(specs: Sequence[CompileSpec], cache_dir: Path, capability: int = 90) -> None:
    """Compile every spec for compute capability `capability` in child processes, one per core (up to 4; ptxas
    compiles one kernel at a time, and the suite runs one test at a time); AssertionError with a failing child's
    stderr. `cache_dir` keeps the children's triton cache out of the user's."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache_dir)
    n = max(1, min(len(specs), os.cpu_count() or 1, 4))
    children = [subprocess.Popen([sys.executable, "-c", _DRIVER, str(capability), json.dumps(list(specs[i::n]))],
                                 env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                for i in range(n)]  # fmt: skip
    errors = []
    for child in children:
        try:
            _, err = child.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            child.kill()
            _, err = child.communicate()
        if child.returncode != 0:
            errors.append(err[-4000:])
    assert not errors, "\n".join(errors)


def kernel_test_module() -> tuple[bool, bool, Any]:
    """(INTERPRET, ON_CUDA, DEVICE) for a module of triton kernel tests, called at its import: the module is skipped
    without triton, or without a CUDA device when TRITON_INTERPRET is not 1; under the interpreter, the interpreter
    is repaired to compute what the GPU computes (test_kernels_triton._repair_interpreter). DEVICE: where the
    kernels run (the CPU under the interpreter)."""
    import pytest
    import torch

    pytest.importorskip("triton", reason="triton is not installed")
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    on_cuda = torch.cuda.is_available()
    if not on_cuda and not interpret:
        pytest.skip("no CUDA device and TRITON_INTERPRET is not 1", allow_module_level=True)
    if interpret:
        from test_kernels_triton import _repair_interpreter

        _repair_interpreter()
    return interpret, on_cuda, torch.device("cuda" if on_cuda and not interpret else "cpu")


class Launches:
    """Stands in for a kernel and counts its launches (kernel[grid](...))."""

    def __init__(self, kernel: Any) -> None:
        self.kernel, self.count = kernel, 0

    def __getitem__(self, grid: Any) -> Any:
        self.count += 1
        return self.kernel[grid]


def nan_scratch(monkeypatch: Any) -> None:
    """torch.empty and torch.empty_like give NaN-filled tensors: a kernel that reads scratch it never wrote, or leaves
    an output row unwritten, shows in the result."""
    import torch

    for name in ("empty", "empty_like"):
        monkeypatch.setattr(torch, name, lambda *a, real=getattr(torch, name), **kw: real(*a, **kw).fill_(float("nan")))
