"""FLOTILLA_LOG_JIT=1: a log line for every triton kernel specialization this process compiles (or loads from
triton's disk cache), with the time it took and the step that needed it.

Triton compiles a kernel once per specialization: each distinct set of constexpr values, and for the other
arguments whether an integer is 1 or a multiple of 16 (or needs 64 bits) and whether a pointer is 16-byte aligned.
A specialization first met while serving compiles inside that step, which then takes several times its usual
time on a fresh machine. With this on, the worker logs which kernel and which specialization that was, so the
engine's warm-up can compile it before the engine says it is ready.

Off by default: two hooks in triton's JIT (triton.knobs.runtime.jit_cache_hook, called before a compile, and
jit_post_compile_hook, after), installed once per process; hooks already there are still called.
"""

from __future__ import annotations

import logging
import time

from flotilla import envs

log = logging.getLogger("flotilla.jit")

context = ""
"""What the process is doing, set by its caller (ModelRunner: "step N"); appended to each line."""
_started: dict[str, float] = {}
_installed = False


def _describe(fn, compile: dict) -> str:
    """kernel(constexprs; other arguments' types) warps, stages. triton keys the constants by their argument's path
    (a tuple of indices into the signature's order; a name in older releases): named here."""
    signature = compile.get("signature") or {}
    names = list(signature)

    def name(path) -> str:
        if not isinstance(path, tuple):
            return str(path)
        head = names[path[0]] if path and path[0] < len(names) else str(path)
        return head + "".join(f"[{i}]" for i in path[1:])

    constants = ", ".join(f"{name(k)}={v}" for k, v in (compile.get("constants") or {}).items())
    args = ", ".join(f"{k}: {v}" for k, v in signature.items() if v != "constexpr")
    launch = f"warps={compile.get('num_warps')} stages={compile.get('num_stages')}"
    text = f"{fn.module}.{fn.name}({constants}; {args}) {launch}"
    return text if len(text) <= 600 else text[:597] + "..."


def _chain(previous, mine):
    if previous is None:
        return mine

    def both(**kwargs):
        mine(**kwargs)
        return previous(**kwargs)

    return both


def before_compile(*, key, fn, compile, **_) -> bool:
    """triton's jit_cache_hook: note the start; False, so that triton compiles."""
    _started[f"{fn.module}.{fn.name}:{key}"] = time.perf_counter()
    return False


def after_compile(*, key, fn, compile, **_) -> None:
    """triton's jit_post_compile_hook: the log line."""
    start = _started.pop(f"{fn.module}.{fn.name}:{key}", None)
    ms = (time.perf_counter() - start) * 1000 if start is not None else float("nan")
    log.warning("triton JIT %.1f ms%s: %s", ms, f" ({context})" if context else "", _describe(fn, compile))


def install() -> bool:
    """Install the two hooks in this process (once); False where triton has no knobs (or is not installed)."""
    global _installed
    if _installed:
        return True
    try:
        from triton import knobs
    except ImportError:
        return False
    runtime = knobs.runtime
    runtime.jit_cache_hook = _chain(runtime.jit_cache_hook, before_compile)
    runtime.jit_post_compile_hook = _chain(runtime.jit_post_compile_hook, after_compile)
    _installed = True
    return True


def install_from_env() -> bool:
    """install() when FLOTILLA_LOG_JIT=1; whether the hooks are in."""
    return envs.FLOTILLA_LOG_JIT and install()
