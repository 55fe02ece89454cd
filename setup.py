"""Package discovery under the root mapping (pyproject.toml holds the metadata): every folder of the checkout that
holds Python modules is a `flotilla.` subpackage, so no hand-kept list can fall behind the tree. The top-level code
folders have no __init__.py (see flotilla/__init__.py), hence namespace discovery. The developer tools (scripts/dev),
the tests, docs and examples are not shipped as code, nor is this file."""

from pathlib import Path

from setuptools import find_namespace_packages, setup
from setuptools.command.build_py import build_py


class BuildPy(build_py):
    def find_package_modules(self, package, package_dir):
        modules = super().find_package_modules(package, package_dir)
        return [m for m in modules if (m[0], m[1]) != ("flotilla", "setup")]


def _code_packages() -> list[str]:
    found = find_namespace_packages(exclude=["tests*", "docs*", "examples*", "scripts.dev*", "build*", "dist*",
                                             "*__pycache__*"])
    return [p for p in found if any(Path(*p.split(".")).glob("*.py"))]


setup(packages=["flotilla"] + [f"flotilla.{p}" for p in _code_packages()], cmdclass={"build_py": BuildPy})
