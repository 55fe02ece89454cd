"""The repository root is the package `flotilla`: its folders must never resolve as top-level modules."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_the_checkout_root_is_not_on_sys_path_while_tests_run():
    assert [p for p in sys.path if os.path.realpath(p or os.curdir) == str(ROOT)] == []


def test_the_top_level_code_folders_are_namespace_packages():
    # A regular package anywhere on sys.path wins over a namespace portion found earlier, so kernels/ (no
    # __init__.py) cannot shadow Hugging Face's `kernels` even where the root is first on sys.path.
    assert [p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()] == []


@pytest.mark.parametrize("first", ["", "import flotilla; "], ids=["transformers-first", "flotilla-first"])
def test_python_started_in_the_checkout_root_imports_transformers_model_code(first):
    # transformers.activations imports Hugging Face's `kernels`, the name the root's kernels/ would shadow.
    pytest.importorskip("kernels")
    pytest.importorskip("transformers")
    code = (f"{first}import kernels, transformers.activations, sys\n"
            "assert not kernels.__file__.startswith(sys.argv[1]), kernels.__file__")
    out = subprocess.run([sys.executable, "-c", code, str(ROOT)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
