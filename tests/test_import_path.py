"""The repository root is the package `flotilla`: its folders must never resolve as top-level modules."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_the_checkout_root_is_not_on_sys_path_while_tests_run():
    assert [p for p in sys.path if os.path.realpath(p or os.curdir) == str(ROOT)] == []


def test_python_started_in_the_checkout_root_imports_transformers_model_code():
    # transformers.activations imports Hugging Face's `kernels`, the name the root's kernels/ would shadow.
    pytest.importorskip("kernels")
    pytest.importorskip("transformers")
    code = ("import flotilla, kernels, transformers.activations, sys\n"
            "assert not kernels.__file__.startswith(sys.argv[1]), kernels.__file__")
    out = subprocess.run([sys.executable, "-c", code, str(ROOT)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
