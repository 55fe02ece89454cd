"""flotilla's environment variables: the one module that reads them.

Everything a user sets to run an engine is an EngineConfig field and a command-line flag (config.py); what is left
here is what has no place there: where files go and a key that should stay off the command line, kernel tuning knobs
for benchmark sweeps, switches that rule a kernel out while debugging, and variables the runtime sets for the
processes it spawns, and the few variables of other programs that flotilla reads too. Each entry of VARIABLES says
what its variable does; docs/environment.md is generated from them
(`python -m flotilla.envs --markdown > docs/environment.md`, checked by tests/test_envs.py).

Values are read when asked for (`envs.FLOTILLA_MOE_TILES`, through the module's __getattr__, as vLLM's envs.py
does), so a test sets a variable with monkeypatch.setenv. A module that needs a value on every kernel launch reads it
once at import instead and says so; tests then patch that module's constant. An unset or empty variable gives the
default; a value that does not parse is a ValueError naming the variable.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    FLOTILLA_CACHE_DIR: str | None
    FLOTILLA_API_KEY: str | None
    FLOTILLA_LOG_JIT: bool
    FLOTILLA_PDL: bool
    FLOTILLA_GEMV: bool
    FLOTILLA_GEMV_BLOCK_K: int
    FLOTILLA_MOE_TILES: str
    FLOTILLA_FP8_TILES: str
    FLOTILLA_FLASHINFER_DECODE_ABOVE: int
    FLOTILLA_FLASHINFER_FAST_PLAN: bool
    FLOTILLA_PARENT_PID: int | None
    FLOTILLA_PROGRESS: bool
    FLOTILLA_BENCH_EP_FAULT: str
    XDG_CACHE_HOME: str | None
    TRITON_INTERPRET: bool
    OPENAI_API_KEY: str | None


def _flag(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{text!r} is not 0 or 1")


def _power_of_two(text: str) -> int:
    value = int(text)
    if value < 1 or value & (value - 1):
        raise ValueError(f"{value} is not a power of two")
    return value


def _count(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(f"{value} is negative")
    return value


@dataclass(frozen=True)
class Variable:
    """One environment variable: how its text is parsed, its value when unset, what it does, and who sets it."""

    parse: Callable[[str], Any]
    default: Any
    doc: str
    group: str
    """settings (users), debugging, tuning (benchmark sweeps) or internal (set by flotilla itself)."""

    def read(self, name: str) -> Any:
        text = os.environ.get(name, "")
        if not text:
            return self.default
        try:
            return self.parse(text)
        except ValueError as exc:
            raise ValueError(f"{name}={text!r}: {exc}") from None


GROUPS = {
    "settings": "Settings",
    "debugging": "Debugging",
    "tuning": "Tuning knobs (benchmark sweeps)",
    "internal": "Internal (set by flotilla)",
    "external": "Other programs' variables flotilla reads",
}
"""The groups of docs/environment.md, in its order."""

VARIABLES: dict[str, Variable] = {
    "FLOTILLA_CACHE_DIR": Variable(
        str, None, "flotilla's cache folder, where the embedded default model is converted once (default: "
        "$XDG_CACHE_HOME/flotilla, else ~/.cache/flotilla).", "settings"),
    "FLOTILLA_API_KEY": Variable(
        str, None, "The API key `flotilla serve` requires (`Authorization: Bearer KEY` on /v1 routes) when "
        "--api-key is not given, and the key bench_serving sends; kept out of the command line, where other users "
        "of the machine could read it.", "settings"),
    "FLOTILLA_LOG_JIT": Variable(
        _flag, False, "1: a log line for every triton kernel specialization the worker compiles (or loads from "
        "triton's disk cache), with its time and the step that needed it (kernels/jit_log.py).", "debugging"),
    "FLOTILLA_PDL": Variable(
        _flag, True, "0: the batch-1 triton kernels launch without programmatic dependent launch (on by default on "
        "Hopper and later, kernels/triton/pdl.py), to rule it out when a kernel misbehaves. Read at import: every "
        "launch asks.", "debugging"),
    "FLOTILLA_GEMV": Variable(
        _flag, True, "0: one-row linear layers (batch-1 decode) on cuBLAS instead of the triton matrix-vector kernel "
        "(kernels/linear.py), to rule the kernel out or compare with cuBLAS. Read at import: every linear layer "
        "asks.", "debugging"),
    "FLOTILLA_GEMV_BLOCK_K": Variable(
        _power_of_two, 2048, "Columns per step of the triton matrix-vector kernel (kernels/triton/gemv.py), a power "
        "of two. Read at import: it is the kernel's compile-time tile.", "tuning"),
    "FLOTILLA_MOE_TILES": Variable(
        str, "", "The triton expert kernels' tiles, warps and stages, e.g. `m=16,n=128,k=128,w=4,s=3` (any subset; "
        "kernels/moe/triton_experts.py TILE_KEYS lists the keys: the sorted GEMMs' m/n/k/w/s and their down "
        "pass's pn/pk/pw/ps, the small-batch path's t/sn/sk/dn/dk/dw/ds); the caller's keyword arguments win. "
        "`bench_kernels --only moe --moe-tiles 'A;B'` compares several.", "tuning"),
    "FLOTILLA_FP8_TILES": Variable(
        str, "", "The triton FP8 GEMM's tiles and K split, e.g. `m=16,n=64,sk=4,w=4,s=3,r=1` (any subset; "
        "kernels/quant/fp8_triton.py TILE_KEYS; r=0 adds a K split's partials in a second launch). "
        "`bench_kernels --only fp8_gemm --fp8-tiles 'A;B'` compares several.", "tuning"),
    "FLOTILLA_FLASHINFER_DECODE_ABOVE": Variable(
        _count, 64, "The flashinfer_triton attention backend decodes steps of more sequences than this with "
        "FlashInfer's kernel and smaller ones with triton's (0: FlashInfer's throughout). Read at import: every "
        "layer's decode asks.", "tuning"),
    "FLOTILLA_FLASHINFER_FAST_PLAN": Variable(
        _flag, True, "0: re-plan FlashInfer's captured decode wrappers with its public plan() before each graph "
        "replay instead of fast_plan_graph's copies (kernels/attention/flashinfer_backend.py), for comparing the "
        "two.", "tuning"),
    "FLOTILLA_PARENT_PID": Variable(
        int, None, "Set by the runtime for each actor process it spawns: its own pid, so the child dies with it "
        "(actors/standalone.py die_with_parent).", "internal"),
    "FLOTILLA_PROGRESS": Variable(
        _flag, False, "Set by the runtime for the actor processes it spawns when its stderr is a terminal: their "
        "stderr is a pipe to it, but their progress bars end on that terminal (models/progress.py).", "internal"),
    "FLOTILLA_BENCH_EP_FAULT": Variable(
        str, "", "`RANK:raise|hang|corrupt`: that rank of the bench_ep benchmark fails, hangs or corrupts a row on "
        "purpose (its tests of those failures).", "internal"),
    "XDG_CACHE_HOME": Variable(
        str, None, "The user's cache folder (the XDG base directory spec): flotilla's cache is its flotilla/ folder "
        "when FLOTILLA_CACHE_DIR is unset (default: ~/.cache).", "external"),
    "TRITON_INTERPRET": Variable(
        _flag, False, "Triton's CPU interpreter: with it on, flotilla's triton kernels run without a GPU (slowly; "
        "the test suite's way of running them); set before the kernels are imported.", "external"),
    "OPENAI_API_KEY": Variable(
        str, None, "The key bench_serving sends when neither --api-key nor FLOTILLA_API_KEY is given, as the "
        "openai client does.", "external"),
}
"""Every variable flotilla reads, its own (FLOTILLA_*) and other programs': name -> Variable."""


def child_environment(progress: bool) -> dict[str, str]:
    """The internal variables the runtime sets for an actor process it spawns (progress: its stderr is a
    terminal)."""
    env = {"FLOTILLA_PARENT_PID": str(os.getpid())}
    if progress:
        env["FLOTILLA_PROGRESS"] = "1"
    return env


def __getattr__(name: str) -> Any:
    if name in VARIABLES:
        return VARIABLES[name].read(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *VARIABLES])


def _default_text(var: Variable) -> str:
    if var.default is None or var.default == "":
        return "unset"
    if isinstance(var.default, bool):
        return f"`{int(var.default)}`"
    return f"`{var.default}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")  # a bare | ends a table cell, inside backticks too


def markdown() -> str:
    """docs/environment.md: every variable of VARIABLES by group, with its default and what it does."""
    lines = [
        "# Environment variables",
        "",
        "<!-- Generated by `python -m flotilla.envs --markdown > docs/environment.md` from envs.py; edit that. -->",
        "",
        "Engine options are command-line flags and `LLM(...)` keywords (docs/engine-args.md). These are the few",
        "settings read from the environment instead, and the kernel knobs that benchmark sweeps on the GPU machine",
        "set; envs.py is the only module that reads them.",
    ]
    for group, title in GROUPS.items():
        names = [name for name, var in VARIABLES.items() if var.group == group]
        if not names:
            continue
        lines += ["", f"## {title}", "", "| variable | default | what it does |", "|---|---|---|"]
        lines += [f"| `{name}` | {_default_text(VARIABLES[name])} | {_cell(VARIABLES[name].doc)} |" for name in names]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] != ["--markdown"]:
        sys.exit("usage: python -m flotilla.envs --markdown > docs/environment.md")
    sys.stdout.write(markdown())
