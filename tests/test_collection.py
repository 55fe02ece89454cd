"""Every test module collects on a machine that lacks the optional packages (the GPU machine's bundle has no openai
or redis; a bare machine has no libibverbs for dlslime): a missing one skips the tests that need it with the
reason, instead of a collection error that stops the whole run (`pytest -m gpu` included) before any test runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# A pytest plugin (loaded with -p before conftest.py and the test modules) that hides packages from the path finder,
# so that `import X` raises ModuleNotFoundError and importlib.util.find_spec("X") is None, or lets a package be
# found and then fail to load the way dlslime does without libibverbs (OSError).
BLOCKER = '''
import importlib.abc, importlib.machinery, sys

RULES = {"openai": None, "redis": None, "triton": None, "flashinfer": None, "dlslime": OSError}


class Failing(importlib.abc.Loader):
    def __init__(self, exc):
        self.exc = exc

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise self.exc("libibverbs.so.1: cannot open shared object file: No such file or directory")


_find = importlib.machinery.PathFinder.find_spec


def find_spec(fullname, path=None, target=None):
    top = fullname.partition(".")[0]
    if top in RULES and RULES[top] is None:
        return None
    spec = _find(fullname, path, target)
    if spec is not None and top in RULES:
        spec.loader = Failing(RULES[top])
    return spec


importlib.machinery.PathFinder.find_spec = staticmethod(find_spec)
for name in [n for n in sys.modules if n.partition(".")[0] in RULES]:
    del sys.modules[name]
'''


@pytest.mark.slow
def test_every_module_collects_without_the_optional_packages(tmp_path):
    (tmp_path / "block_optional.py").write_text(BLOCKER)
    tests = Path(__file__).resolve().parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])}
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "-p", "block_optional", "--rootdir", str(tests.parent), str(tests)],
                         capture_output=True, text=True, timeout=240, env=env, cwd=tests.parent)
    tail = out.stdout[-3000:] + out.stderr[-2000:]
    assert out.returncode == 0 and " error" not in out.stdout.splitlines()[-1], tail
    skips = [line for line in out.stdout.splitlines() if line.startswith("SKIPPED")]
    # the blocker took effect (each package's modules skip, saying which package is missing and why it is needed)
    assert any("test_protocol.py" in s and "No module named 'openai'" in s for s in skips), tail
    assert any("helpers_pd.py" in s and "No module named 'openai'" in s for s in skips), tail
    assert any("test_kernels_triton.py" in s and "triton" in s for s in skips), tail
    # and the file that needs them all still collects its other tests: the in-memory registry's need no redis
    assert "tests/test_registry.py::test_in_memory_registry_evicts_silent_engines" in out.stdout, tail


def test_a_package_that_fails_to_load_counts_as_missing(tmp_path, monkeypatch):
    """dlslime without libibverbs raises OSError (or ImportError) on import: optional() gives None and require()
    skips with the reason and the error, as for a package that is not installed."""
    import helpers_optional

    for name, error in (("gs_broken_os", "OSError"), ("gs_broken_import", "ImportError")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"raise {error}('libibverbs.so.1: cannot open shared object')")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(helpers_optional, "ON_CI", False)
    assert helpers_optional.optional("gs_broken_os") is None and helpers_optional.optional("gs_broken_import") is None
    assert helpers_optional.optional("gs_not_installed_anywhere") is None
    with pytest.raises(pytest.skip.Exception, match="the data plane: OSError: libibverbs.so.1"):
        helpers_optional.require("gs_broken_os", "the data plane")
    assert helpers_optional.needs("gs_broken_import", "why").kwargs["reason"].startswith("why: ImportError")
    assert helpers_optional.require("json", "stdlib").dumps([]) == "[]"
    monkeypatch.setattr(helpers_optional, "ON_CI", True)  # CI installs dlslime and redis-server: missing fails there
    monkeypatch.setattr(helpers_optional, "CI_INSTALLS", frozenset({"gs_broken_os", "gs-no-such-program"}))
    with pytest.raises(pytest.fail.Exception, match="CI installs gs_broken_os"):
        helpers_optional.require("gs_broken_os", "the data plane")
    with pytest.raises(pytest.fail.Exception, match="CI installs gs-no-such-program"):
        helpers_optional.program("gs-no-such-program", "a service")
    assert helpers_optional.program("gs-not-needed-on-ci", "a service") is None
