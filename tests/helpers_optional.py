"""What a machine may lack that some tests need: optional packages (openai, redis, dlslime, triton, flashinfer) and
programs (redis-server). A test that needs a missing one skips with the reason, so `python3 -m pytest` passes on a
bare machine and every module collects on the GPU machine, whose bundle carries fewer packages than CI installs.

Under CI, which installs what CI_INSTALLS names (.ci/run: the system libraries and services a pip install cannot
bring), a missing one fails the test instead: CI must not go green by skipping them.

    openai = optional("openai")                          # the module or None, for tests marked with needs()
    @needs("openai", "the tests talk to the server through the real client")
    openai = require("openai", "the whole file talks through the real client")   # at a module's top: skips it all
    binary = program("redis-server", "the Redis registry's tests")                # its path or None
"""

from __future__ import annotations

import functools
import importlib
import os
import shutil
from types import ModuleType

import pytest

# dlslime loads Debian's libibverbs1 when imported; redis-server is a program. pip installs neither.
CI_INSTALLS = frozenset({"dlslime", "redis-server"})
ON_CI = bool(os.environ.get("CI"))


@functools.cache
def _load(module: str) -> tuple[ModuleType | None, str]:
    try:
        return importlib.import_module(module), ""
    except (ImportError, OSError) as e:  # OSError: the package is there but a shared library it loads is not
        return None, f"{type(e).__name__}: {e}"


def optional(module: str) -> ModuleType | None:
    """The module, or None where it is not installed or fails to load."""
    return _load(module)[0]


def _missing(name: str, reason: str) -> None:
    __tracebackhide__ = True  # a skip names the test module's line that needs the package, not this one
    if ON_CI and name in CI_INSTALLS:
        pytest.fail(f"CI installs {name} (.ci/run), but: {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def require(module: str, why: str) -> ModuleType:
    """The module; where it is missing, skip (at a module's top: the whole module) saying why it is needed."""
    __tracebackhide__ = True
    mod, error = _load(module)
    if mod is None:
        _missing(module.partition(".")[0], f"{why}: {error}")
    return mod


def needs(module: str, why: str) -> pytest.MarkDecorator:
    """A mark that skips the test where the module is missing."""
    mod, error = _load(module)
    return pytest.mark.skipif(mod is None, reason=f"{why}: {error}")


def program(name: str, why: str) -> str | None:
    """The path of an installed program, or None (under CI, a program in CI_INSTALLS that is missing fails)."""
    __tracebackhide__ = True
    path = shutil.which(name)
    if path is None and ON_CI and name in CI_INSTALLS:
        pytest.fail(f"CI installs {name} (.ci/run), but it is not on PATH: {why}", pytrace=False)
    return path
