"""flotilla: an LLM inference engine over msgspec/ZeroMQ actors."""

import os as _os
import sys as _sys


def _keep_checkout_root_off_sys_path() -> None:
    # The repository root is this package, so its folders (kernels, models, server, ...) are never top-level
    # modules. They are namespace packages, which any installed package of the same name wins over (Hugging Face's
    # `kernels`, which transformers imports); and `python -m ...` started in the root puts the root on sys.path,
    # which is dropped here so that nothing imported after flotilla can resolve to a folder of the checkout.
    root = _os.path.realpath(_os.path.dirname(__file__))
    _sys.path[:] = [p for p in _sys.path if _os.path.realpath(p or _os.curdir) != root]


_keep_checkout_root_off_sys_path()

__version__ = "0.1.0"

from flotilla.sampling_params import SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]
_LAZY = {"LLM", "RequestOutput", "CompletionOutput"}


def __getattr__(name: str):
    # LLM pulls in torch and transformers; importing `flotilla` (every actor process does) must not.
    if name in _LAZY:
        from flotilla import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'flotilla' has no attribute {name!r}")
