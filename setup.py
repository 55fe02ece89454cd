"""Package discovery under the root mapping (pyproject.toml holds the metadata): every folder with an __init__.py
is a `flotilla.` subpackage, so no hand-kept list can fall behind the tree. The developer tools (scripts/dev) and
the tests are not shipped, nor is this file."""

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py


class BuildPy(build_py):
    def find_package_modules(self, package, package_dir):
        modules = super().find_package_modules(package, package_dir)
        return [m for m in modules if (m[0], m[1]) != ("flotilla", "setup")]


PACKAGES = ["flotilla"] + [f"flotilla.{p}" for p in find_packages(exclude=["tests*", "scripts.dev*", "docs*"])]

setup(packages=PACKAGES, cmdclass={"build_py": BuildPy})
