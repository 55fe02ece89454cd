"""envs.py, the one module that reads flotilla's environment variables: values read when asked for, bad ones refused
with the variable's name, docs/environment.md generated from the table, and no other module of the tree reading a
FLOTILLA_* variable itself. The settings that are engine options are config fields with flags instead."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from flotilla import envs

ROOT = Path(envs.__file__).resolve().parent


def test_values_are_read_when_asked_for_and_unset_or_empty_gives_the_default(monkeypatch) -> None:
    monkeypatch.delenv("FLOTILLA_MOE_TILES", raising=False)
    assert envs.FLOTILLA_MOE_TILES == ""
    monkeypatch.setenv("FLOTILLA_MOE_TILES", "m=16")
    assert envs.FLOTILLA_MOE_TILES == "m=16"
    for text, want in (("0", False), ("1", True), ("false", False), ("on", True), ("", True)):
        monkeypatch.setenv("FLOTILLA_PDL", text)
        assert envs.FLOTILLA_PDL is want, text
    monkeypatch.delenv("FLOTILLA_CACHE_DIR", raising=False)
    assert envs.FLOTILLA_CACHE_DIR is None
    monkeypatch.setenv("FLOTILLA_GEMV_BLOCK_K", "4096")
    assert envs.FLOTILLA_GEMV_BLOCK_K == 4096
    assert {"FLOTILLA_PDL", "FLOTILLA_CACHE_DIR"} <= set(dir(envs))


def test_other_programs_variables_are_read_here_too(monkeypatch) -> None:
    """XDG_CACHE_HOME places the cache, TRITON_INTERPRET lets the triton kernels run on the CPU, OPENAI_API_KEY is
    bench_serving's last resort: read through envs as flotilla's own are."""
    from flotilla.models.default_model import cache_root

    monkeypatch.delenv("FLOTILLA_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "/srv/cache")
    assert cache_root() == Path("/srv/cache/flotilla")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert envs.TRITON_INTERPRET is False
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert envs.TRITON_INTERPRET is True
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    assert envs.OPENAI_API_KEY == "sk-test"


def test_a_value_that_does_not_parse_names_its_variable(monkeypatch) -> None:
    for name, text in (("FLOTILLA_PDL", "maybe"), ("FLOTILLA_GEMV_BLOCK_K", "3000"),
                       ("FLOTILLA_FLASHINFER_DECODE_ABOVE", "-1"), ("FLOTILLA_PARENT_PID", "x")):  # fmt: skip
        monkeypatch.setenv(name, text)
        with pytest.raises(ValueError, match=f"{name}='{text}'"):
            getattr(envs, name)
    with pytest.raises(AttributeError):
        envs.FLOTILLA_NO_SUCH_VARIABLE  # noqa: B018


def test_every_variable_is_declared_for_type_checkers_and_documented() -> None:
    """The TYPE_CHECKING block names exactly the table's variables; each has a group of GROUPS and a doc."""
    tree = ast.parse((ROOT / "envs.py").read_text())
    block = next(node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING")
    declared = [node.target.id for node in block.body if isinstance(node, ast.AnnAssign)]
    assert declared == list(envs.VARIABLES)
    for name, var in envs.VARIABLES.items():
        assert name.startswith("FLOTILLA_") == (var.group != "external"), name  # (others' variables: external)
        assert var.group in envs.GROUPS and var.doc.endswith("."), name


def test_docs_environment_md_is_the_generated_page() -> None:
    """docs/environment.md is `python -m flotilla.envs --markdown`'s output: regenerate it after editing envs.py."""
    page = ROOT / "docs" / "environment.md"
    assert page.read_text() == envs.markdown(), "docs/environment.md is stale: python -m flotilla.envs --markdown"
    for name in envs.VARIABLES:
        assert f"`{name}`" in page.read_text()


def test_child_processes_get_the_internal_variables(monkeypatch) -> None:
    env = envs.child_environment(progress=True)
    assert set(env) == {"FLOTILLA_PARENT_PID", "FLOTILLA_PROGRESS"}
    for name, text in env.items():
        monkeypatch.setenv(name, text)
    assert envs.FLOTILLA_PARENT_PID == __import__("os").getpid() and envs.FLOTILLA_PROGRESS
    assert "FLOTILLA_PROGRESS" not in envs.child_environment(progress=False)


_READ_CALLS = {"os.environ.get", "os.getenv", "environ.get", "getenv", "os.environ.pop", "os.environ.setdefault"}


def _flotilla_reads(path: Path) -> list[int]:
    """The lines of a module that read a FLOTILLA_* variable from os.environ: os.environ.get / os.getenv calls,
    os.environ[...] loads and `... in os.environ`, keyed by a FLOTILLA_ string or a module-level name bound to one."""
    tree = ast.parse(path.read_text())
    names = {target.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
             and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
             for target in node.targets if isinstance(target, ast.Name)}  # fmt: skip

    def flotilla(key: ast.AST) -> bool:
        value = key.value if isinstance(key, ast.Constant) else names.get(key.id) if isinstance(key, ast.Name) else None
        return isinstance(value, str) and value.startswith("FLOTILLA_")

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and ast.unparse(node.func) in _READ_CALLS \
                and flotilla(node.args[0]):
            found.append(node.lineno)
        elif (isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load)
              and ast.unparse(node.value).endswith("environ") and flotilla(node.slice)):
            found.append(node.lineno)
        elif (isinstance(node, ast.Compare) and any(isinstance(op, ast.In | ast.NotIn) for op in node.ops)
              and any(ast.unparse(c).endswith("environ") for c in node.comparators) and flotilla(node.left)):
            found.append(node.lineno)
    return sorted(found)


def test_no_module_but_envs_reads_a_flotilla_variable() -> None:
    """Every module of the tree (scripts included; tests set variables, they do not read them) goes through envs."""
    modules = [p for p in ROOT.rglob("*.py") if p.name != "envs.py" and "tests" not in p.relative_to(ROOT).parts
               and not any(part.startswith(".") or part in ("build", "dist") for part in p.relative_to(ROOT).parts)]
    assert len(modules) > 100
    assert [f"{p.relative_to(ROOT)}:{line}" for p in modules for line in _flotilla_reads(p)] == []


def test_the_read_finder_finds_each_form_of_read(tmp_path: Path) -> None:
    """_flotilla_reads on a module with each form (a test of the test: it cannot pass by finding nothing)."""
    module = tmp_path / "m.py"
    module.write_text('import os\nNAME = "FLOTILLA_X"\na = os.environ.get("FLOTILLA_A")\nb = os.getenv(NAME)\n'
                      'c = os.environ["FLOTILLA_C"]\nd = "FLOTILLA_D" in os.environ\nos.environ["FLOTILLA_E"] = "1"\n'
                      'f = os.environ.get("HOME")\ng = {**os.environ, "FLOTILLA_G": "1"}\n')
    assert _flotilla_reads(module) == [3, 4, 5, 6]


def test_the_engine_settings_that_left_the_environment_are_flags() -> None:
    """The CUDA-graph switches, the step trace and the front-end grace: EngineConfig fields with their flags, the
    defaults as before (graphs of prompt chunks for the MLA backends, none under TP / EP, no trace, 5 s)."""
    import argparse

    from flotilla.config import EngineConfig
    from flotilla.server.cli import add_engine_arguments, engine_config_from_args

    default = EngineConfig()
    assert (default.worker.prefill_cuda_graphs, default.worker.tp_cuda_graphs, default.worker.ep_cuda_graphs,
            default.worker.step_trace, default.disagg.frontend_grace_s) == ("auto", False, False, None, 5.0)
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    help_text = parser.format_help()
    for flag in ("--prefill-cuda-graphs", "--tp-cuda-graphs", "--ep-cuda-graphs", "--step-trace",
                 "--frontend-grace-s"):  # fmt: skip
        assert flag in help_text, flag
    args = parser.parse_args(["--prefill-cuda-graphs", "off", "--tp-cuda-graphs", "--ep-cuda-graphs",
                              "--step-trace", "/tmp/t.jsonl", "--frontend-grace-s", "1.5"])  # fmt: skip
    config = engine_config_from_args(args, None)
    assert (config.worker.prefill_cuda_graphs, config.worker.tp_cuda_graphs, config.worker.ep_cuda_graphs,
            config.worker.step_trace, config.disagg.frontend_grace_s) == ("off", True, True, "/tmp/t.jsonl", 1.5)
    with pytest.raises(SystemExit):
        parser.parse_args(["--prefill-cuda-graphs", "1"])
    assert not re.search(r"FLOTILLA_(TP|EP|PREFILL)_GRAPHS|FLOTILLA_STEP_TRACE|FLOTILLA_FRONTEND", help_text)
