"""Actor kinds by name, imported lazily so a light actor never imports torch."""

from __future__ import annotations

import importlib

from flotilla.actors.base import Actor

ACTOR_KINDS: dict[str, str] = {
    "echo": "flotilla.actors.diagnostics:EchoActor",
    "relay": "flotilla.actors.diagnostics:RelayActor",
    "tokenizer": "flotilla.actors.tokenizer:TokenizerActor",
    "scheduler": "flotilla.actors.scheduler:SchedulerActor",
    "worker": "flotilla.actors.worker:GPUWorkerActor",
    "detokenizer": "flotilla.actors.detokenizer:DetokenizerActor",
    "kv_migration": "flotilla.actors.kv_migration:KVMigrationActor",
    "encoder": "flotilla.actors.encoder_actor:EncoderActor",
    "vision_encoder": "flotilla.actors.vision_encoder:VisionEncoderActor",
}
"""kind -> "module:Class"."""


def actor_class(kind: str) -> type[Actor]:
    """The Actor class of a kind; a clear error listing the known kinds."""
    try:
        target = ACTOR_KINDS[kind]
    except KeyError:
        raise ValueError(f"unknown actor kind {kind!r}; known kinds: {', '.join(sorted(ACTOR_KINDS))}") from None
    module, _, name = target.partition(":")
    cls = getattr(importlib.import_module(module), name)
    if not (isinstance(cls, type) and issubclass(cls, Actor)):
        raise TypeError(f"{target} is not an Actor")
    return cls
