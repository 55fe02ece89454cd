"""Benchmarks, profiling, GPU-machine scripts: run from a source checkout; not shipped in the installed package."""
