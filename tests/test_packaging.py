"""The wheel ships every package of the tree and the example topologies, and nothing of the developer tools."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from flotilla.actors.topology import EXAMPLES, load_topology

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel_files(tmp_path_factory) -> set[str]:
    out, src = tmp_path_factory.mktemp("dist"), tmp_path_factory.mktemp("src")
    # from a copy of the tree: building in place would leave build/ in the checkout
    shutil.copytree(ROOT, src, dirs_exist_ok=True, ignore=shutil.ignore_patterns(".*", "build", "dist", "*.egg-info",
                                                                                 "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(src)], check=True, capture_output=True, timeout=300)
    (wheel,) = out.glob("flotilla-*.whl")
    return set(zipfile.ZipFile(wheel).namelist())


def test_the_wheel_holds_every_module_of_the_tree(wheel_files):
    not_shipped = {"tests", "docs", "examples", "build", "dist"}  # and hidden folders (.git, a checkout's caches)
    shipped = {f"flotilla/{p.relative_to(ROOT)}" for p in ROOT.rglob("*.py")
               if not not_shipped & set(p.relative_to(ROOT).parts) and p.relative_to(ROOT).parts[:2] != ("scripts", "dev")
               and not any(part.startswith(".") for part in p.relative_to(ROOT).parts) and p.name != "setup.py"}
    assert {"flotilla/kernels/quant/__init__.py", "flotilla/__init__.py", "flotilla/actors/worker.py"} <= shipped
    assert shipped <= wheel_files, sorted(shipped - wheel_files)


def test_the_wheel_ships_the_example_topologies_and_no_developer_tools(wheel_files):
    for toml in EXAMPLES.glob("*.toml"):
        assert f"flotilla/examples/topologies/{toml.name}" in wheel_files
    assert not [f for f in wheel_files if f.startswith(("flotilla/scripts/dev/", "flotilla/tests/"))
                or f in ("flotilla/setup.py", "flotilla/conftest.py")]
    assert "flotilla/scripts/launch.py" in wheel_files


def test_a_shipped_example_loads_by_name():
    assert load_topology("pingpong").name == "pingpong"
    with pytest.raises(ValueError, match="shipped examples: .*pingpong"):
        load_topology("no-such-topology")
