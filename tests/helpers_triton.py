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
    is repaired (by conftest.py, repair_interpreter) to compute what the GPU computes. DEVICE: where the kernels run
    (the CPU under the interpreter)."""
    import pytest
    import torch

    pytest.importorskip("triton", reason="triton is not installed")
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    on_cuda = torch.cuda.is_available()
    if not on_cuda and not interpret:
        pytest.skip("no CUDA device and TRITON_INTERPRET is not 1", allow_module_level=True)
    return interpret, on_cuda, torch.device("cuda" if on_cuda and not interpret else "cpu")


def repair_interpreter() -> None:
    """Make triton's CPU interpreter compute what the GPU computes, where (as of triton 3.6) it does not; conftest.py
    calls it once under TRITON_INTERPRET=1, so that every test that runs a kernel (an engine's included) runs it
    repaired, whichever tests ran before. Only the interpreter's builder is patched: kernel bodies and compiled GPU
    runs are untouched.

    - Scalars become python ints through int(ndarray of shape (1,)), which numpy >= 2.4 rejects, so
      every loop with a runtime bound (`range(0, kv_end, BLOCK_N)`) fails; convert the one element.
    - numpy has no bfloat16, so bf16 tensors are raw uint16 bits and tl.dot multiplies the bits as
      integers; widen bf16 operands to float32 first (exact, as tensor cores take bf16 products).
    - fp32 -> bf16 casts truncate; the GPU (and torch) round to nearest even.
    - fp32 -> e4m3 (an FP8 KV cache) loses the carry when rounding up crosses a power of two (0.496 -> 0.25);
      the GPU (and torch) round to nearest even.
    - triton.language's @jit helpers (tl.max, tl.sum, tl.cdiv, ...) are compiled-mode JITFunctions,
      which the interpreter refuses to call, when triton was imported before TRITON_INTERPRET=1 was set.
    """
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter
    from triton.runtime.jit import JITFunction

    for name, module in list(sys.modules.items()):
        if name.startswith("triton.language") and module is not None:
            for attr, value in list(vars(module).items()):
                if isinstance(value, JITFunction):
                    setattr(module, attr, interpreter.InterpretedFunction(value.fn))

    builder = interpreter.InterpreterBuilder
    if getattr(builder, "_flotilla_repaired", False):
        return
    patch_tensor, create_dot, cast_impl = interpreter._patch_lang_tensor, builder.create_dot, builder.cast_impl
    fp_to_fp = builder.create_fp_to_fp

    def bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
        return (np.asarray(bits).astype(np.uint32) << 16).view(np.float32)

    def patch_lang_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    def widened_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a, b = (
            interpreter.TensorHandle(bf16_bits_to_f32(x.data), tl.float32) if x.dtype.scalar == tl.bfloat16 else x
            for x in (a, b)
        )
        return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    def rounding_cast(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rounded = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32)).to(torch.bfloat16)
            return interpreter.TensorHandle(rounded.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
        if src.dtype.scalar == tl.bfloat16 and dst_type.scalar == tl.float32:
            return interpreter.TensorHandle(bf16_bits_to_f32(src.data), tl.float32)
        return cast_impl(self, src, dst_type)

    def rounding_fp_to_fp(self, src, dst_type, rounding_mode):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.float8e4nv:
            rounded = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32)).to(torch.float8_e4m3fn)
            return interpreter.TensorHandle(rounded.view(torch.uint8).numpy(), tl.float8e4nv)
        return fp_to_fp(self, src, dst_type, rounding_mode)

    interpreter._patch_lang_tensor = patch_lang_tensor
    builder.create_dot = widened_dot
    builder.cast_impl = rounding_cast
    builder.create_fp_to_fp = rounding_fp_to_fp
    builder._flotilla_repaired = True


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
