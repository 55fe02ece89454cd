"""flotilla: an LLM inference engine over msgspec/ZeroMQ actors."""

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
