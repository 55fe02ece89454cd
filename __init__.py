"""flotilla: an LLM inference engine over msgspec/ZeroMQ actors."""

__version__ = "0.1.0"
