"""Compiling triton kernels for an H100/H200 (sm_90) without a GPU.

Triton's CPU interpreter runs kernels as numpy and checks little of the language's typing, so each kernel is
also compiled for sm_90 (ptxas ships with triton) in a child process started without TRITON_INTERPRET.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_SERVER = """
import importlib, json, os, sys, tempfile, traceback
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def compile_queue(capability, specs, queue):
    # the specs whose indices this worker takes from the queue (a pipe of 4-byte indices) until it is empty: the
    # workers share the specs out as they go, so a slow kernel holds up one worker only
    target = GPUTarget("cuda", capability, 32)
    while index := os.read(queue, 4):
        module, name, pointers, floats, constexprs, num_warps = specs[int.from_bytes(index, "little")]
        fn = getattr(importlib.import_module(module), name)
        # constexprs the spec leaves out take their defaults (e.g. USE_GDC, kernels/triton/pdl.py)
        constexprs = {**{p.name: p.default for p in fn.params if p.is_constexpr and p.has_default}, **constexprs}
        signature = {a: "constexpr" if a in constexprs else pointers.get(a, "fp32" if a in floats else "i32")
                     for a in fn.arg_names}
        triton.compile(ASTSource(fn, signature, constexprs), target=target, options={"num_warps": num_warps})


def serve(request):
    os.environ.clear()
    os.environ.update(request["env"])
    specs = request["specs"]
    try:  # once here, so that the workers forked below share the imports
        for module in sorted({spec[0] for spec in specs}):
            importlib.import_module(module)
    except BaseException:
        return [traceback.format_exc()[-4000:]]
    queue, fill = os.pipe()  # (64 KiB: room for 16,384 specs)
    os.write(fill, b"".join(i.to_bytes(4, "little") for i in range(len(specs))))
    os.close(fill)  # (before the fork: a worker reads EOF once the queue is empty)
    workers = []
    for _ in range(request["workers"]):
        log = tempfile.TemporaryFile("w+")
        pid = os.fork()
        if pid == 0:  # a worker: stdout is the reply channel, so both streams go to its log
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            code = 0
            try:
                compile_queue(request["capability"], specs, queue)
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        workers.append((pid, log))
    os.close(queue)
    errors = []
    for pid, log in workers:
        if os.waitpid(pid, 0)[1] != 0:
            log.seek(0)
            errors.append(log.read()[-4000:] or f"worker {pid} died")
        log.close()
    return errors


for line in sys.stdin:
    print(json.dumps(serve(json.loads(line))), flush=True)
"""
"""A compile server: it imports triton (and, with the first kernel module, torch and flotilla) once per session,
then forks each request's workers, which share its specs out."""

CompileSpec = tuple[str, str, dict[str, str], Sequence[str], dict[str, Any], int]
"""(module, kernel name, argument types of the pointers (and any typed scalar), the float scalars' names (other
scalars are i32), constexpr values, num_warps)."""

_server: subprocess.Popen | None = None


def _kill_server(server: subprocess.Popen) -> None:
    os.killpg(server.pid, signal.SIGKILL)  # its workers too (a session of their own)
    server.wait()


def _stop_server() -> None:
    if _server is not None and _server.poll() is None:
        _server.stdin.close()  # the server leaves its loop at EOF
        try:
            _server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            _kill_server(_server)


atexit.register(_stop_server)


def compile_for_sm90(specs: Sequence[CompileSpec], cache_dir: Path, capability: int = 90) -> None:
    """Compile every spec for compute capability `capability` in child processes without TRITON_INTERPRET, one per
    core (up to 4; ptxas compiles one kernel at a time, and the suite runs one test at a time); AssertionError with
    a failing child's stderr. The children are forked by one compile server that the session starts at its first
    call (so torch and triton are imported once, not by every child of every call); each call's children see the
    caller's environment then. `cache_dir` keeps the children's triton cache out of the user's."""
    global _server
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache_dir)
    n = max(1, min(len(specs), os.cpu_count() or 1, 4))
    request = {"env": env, "capability": capability, "specs": list(specs), "workers": n}
    if _server is None or _server.poll() is not None:
        _server = subprocess.Popen([sys.executable, "-c", _SERVER], env=env, stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                   start_new_session=True)  # fmt: skip
    server = _server
    try:
        server.stdin.write(json.dumps(request) + "\n")
        server.stdin.flush()
        # the bound each child had, the children waited for one after another
        if not select.select([server.stdout], [], [], 240 * n)[0]:
            raise AssertionError(f"compiling for sm_{capability} took over {240 * n} s")
        reply = server.stdout.readline()
    except BaseException:  # (a timeout, or the test interrupted: the next call starts a new server)
        _kill_server(server)
        raise
    assert reply, f"the compile server exited ({server.wait()})"
    errors = json.loads(reply)
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
