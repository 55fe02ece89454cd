"""Engine options as command-line flags: every EngineConfig field becomes one flag, 1:1, with its doc.

`--max-num-seqs 8` sets SchedulerConfig.max_num_seqs; the help text is the field's docstring, so
`flotilla serve --help`, `flotilla generate --help` and docs/engine-args.md explain every option without a
second copy. `python3 -m flotilla.server.cli --markdown > docs/engine-args.md` regenerates that page.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import sys
import typing
from typing import Any

import msgspec

from flotilla.config import (
    DEVICE_BATCH_OPTIONS,
    CacheConfig,
    DisaggConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    WorkerConfig,
)
from flotilla.server.reasoning_parser import REASONING_PARSERS
from flotilla.server.tool_parsers import TOOL_PARSERS
from flotilla.transport.auth import add_auth_arguments
from flotilla.transport.registry import shared_registry

_GROUPS: dict[str, type[msgspec.Struct]] = {
    "model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig, "worker": WorkerConfig,
    "parallel": ParallelConfig, "disaggregation": DisaggConfig,
}
_SKIP = {"model"}  # the model is a positional argument of serve / an option of generate


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the descriptions' line breaks and shows each flag's default once: appended as "(default: X)" unless
    the help already says "default: ...", or the default is unset (None), empty or an off switch, which the help
    explains."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if _states_default(action) or not _shows_default(action):
            return text
        return f"{text} (default: %(default)s)"


def _states_default(action: argparse.Action) -> bool:
    return "default:" in (action.help or "") or "%(default)" in (action.help or "")


def _shows_default(action: argparse.Action) -> bool:
    """Whether the default is worth printing: a value, not None, [], "" or SUPPRESS, nor a store_true switch's False."""
    d = action.default
    return (bool(action.option_strings) and d is not None and d is not argparse.SUPPRESS and d != [] and d != ""
            and not isinstance(action, argparse._StoreTrueAction))


def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a struct (the source is the single description of an option)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for prev, node in zip(body, body[1:]):
        if (isinstance(prev, ast.AnnAssign) and isinstance(prev.target, ast.Name) and isinstance(node, ast.Expr)
                and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)):
            docs[prev.target.id] = " ".join(node.value.value.split())
    return docs


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field, grouped by concern, defaults shown."""
    for group_name, cls in _GROUPS.items():
        group = parser.add_argument_group(f"{group_name} options")
        docs = field_docs(cls)
        hints = typing.get_type_hints(cls)
        for f in msgspec.structs.fields(cls):
            if f.name in _SKIP:
                continue
            flag = "--" + f.name.replace("_", "-")
            tp = hints[f.name]
            # (argparse %-formats help: a docstring's "8%" must reach it as "8%%")
            # (a device-dependent default is left unset here and resolved once the engine's GPU is known)
            kwargs: dict[str, Any] = {"dest": f.name, "default": None if f.name in DEVICE_BATCH_OPTIONS else f.default,
                                      "help": docs.get(f.name, "").replace("%", "%%")}
            if tp is bool:
                kwargs["action"] = argparse.BooleanOptionalAction
            else:
                args = [a for a in typing.get_args(tp) if a is not type(None)]
                base = args[0] if args and typing.get_origin(tp) is not typing.Literal else tp
                if typing.get_origin(tp) is typing.Literal:
                    kwargs["choices"] = list(typing.get_args(tp))
                else:
                    kwargs["type"] = (base if base in (int, float, str)
                                      else json.loads if isinstance(base, type) and issubclass(base, msgspec.Struct)
                                      else str)
            group.add_argument(flag, **kwargs)


def engine_config_from_args(args: argparse.Namespace, model: str | None, offline: bool = False,
                            device_defaults: bool = True) -> EngineConfig:
    """The EngineConfig the flags describe; the options whose defaults depend on the GPU, unless given, as vLLM sets
    them for it and for serving (or offline use); without device_defaults, the config's own."""
    from flotilla.server.engine_client import with_device_batch_defaults  # (zmq and the actors: not for --help)

    options = {f.name: getattr(args, f.name) for cls in _GROUPS.values() for f in msgspec.structs.fields(cls)
               if f.name not in _SKIP}
    given = {name for name in DEVICE_BATCH_OPTIONS if options[name] is not None}
    config = EngineConfig.from_options(model=model, **{k: v for k, v in options.items()
                                                       if k in given or k not in DEVICE_BATCH_OPTIONS})
    return with_device_batch_defaults(config, given, offline=offline) if device_defaults else config


SERVE_DESCRIPTION = """\
Start the OpenAI-compatible HTTP server and the engine behind it (one process per actor by default).

  flotilla serve                                   # the embedded SmolLM2-135M-Instruct on 127.0.0.1:8000
  flotilla serve /models/Qwen3-8B --port 8080 --max-num-seqs 128
  flotilla serve /models/Qwen3-8B --engines prefill,decode          # prefill-decode disaggregation (CPU KV)

Endpoints: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health, GET /metrics.
"""


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="HF model folder (config.json + safetensors + tokenizer); default: the embedded "
                        "SmolLM2-135M-Instruct")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    p.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on /v1 routes; default: $FLOTILLA_API_KEY, else no key")
    p.add_argument("--single-process", action="store_true",
                   help="run every engine actor inside the server process (debugging); default: one process each")
    p.add_argument("--max-in-flight", type=int, default=None,
                   help="HTTP requests served at once before answering 429; default: max_num_seqs + "
                        "max_waiting_requests")
    p.add_argument("--max-body-bytes", type=int, default=None,
                   help="largest request body accepted (413 above); default: 4 MiB, or 32 MiB for a model that takes "
                        "images (base64 images travel in the body)")
    p.add_argument("--allowed-media-domains", nargs="+", default=[], metavar="HOST",
                   help="hosts (and their subdomains) whose http(s) image URLs the server fetches for a chat "
                        "request's image_url parts; default: none, images come as base64 data URLs only (a server "
                        "that fetches any URL reaches whatever its network reaches)")
    p.add_argument("--media-fetch-timeout", type=float, default=5.0, metavar="S",
                   help="how long fetching one image URL may take, seconds")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, how long in-flight streams may take to finish, seconds")
    p.add_argument("--trace", action="store_true", help="every actor prints every message in and out")
    p.add_argument("--log-stats-interval", type=float, default=10.0, metavar="S",
                   help="while the engine is busy, log vLLM's stats line (prompt and generation throughput, running "
                        "and waiting requests, KV cache usage, prefix cache hit rate) every S seconds; 0: never")
    p.add_argument("--engine-restarts", type=int, default=3, metavar="N",
                   help="when an engine actor dies or hangs, stop the engine's actors and start them again, up to N "
                        "times in a row (waiting 1 s, 2 s, 4 s, ... up to 30 s first; an engine that served 10 "
                        "minutes starts the count over); meanwhile requests get 503 with Retry-After and /health is "
                        "503. 0: exit at the first failure (for an orchestrator that restarts the process)")
    p.add_argument("--engine-restart-backoff", type=float, default=1.0, metavar="S",
                   help="the wait before the first restart of a failed engine, seconds; it doubles with each failure "
                        "in a row, up to 30 s")
    p.add_argument("--heartbeat-timeout", type=float, default=10.0, metavar="S",
                   help="an engine actor silent this long (hung, stopped) counts as failed, seconds")
    p.add_argument("--tool-call-parser", default="hermes", choices=list(TOOL_PARSERS),
                   help="how the model writes tool calls, read from its output when a request gives tools and "
                        "tool_choice auto (vLLM's names): hermes (Hermes, Qwen2.5, Qwen3), deepseek_v3 (DeepSeek-V3, "
                        "R1-0528), deepseek_v31 (DeepSeek-V3.1, V3.2-Exp), kimi_k2, glm45 / glm47 (GLM-4.5 to GLM-5)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM's command lines: tool_choice auto is always on here")
    p.add_argument("--reasoning-parser", default=None, choices=list(REASONING_PARSERS),
                   help="split the model's <think>...</think> reasoning out of chat answers into reasoning_content "
                        "(vLLM's names): qwen3 (reasoning only when the output opens <think>), deepseek_r1 (the "
                        "output starts in the reasoning, as when the template opens <think>); default: none")
    p.add_argument("--engines", default=None, metavar="ROLE[,ROLE...]",
                   help="start several engines behind this server, one per role listed, each in its own supervised "
                        "processes, and route every request: `prefill,decode` = prefill-decode disaggregation "
                        "(1P1D), `prefill,decode,decode` = 1P2D, `both,both` = two colocated engines (data "
                        "parallel), `encoder,prefill,decode` = a vision encoder for the images of the prefills "
                        "(encoder-prefill-decode; the others get --image-encoder remote); default: one engine of "
                        "--role (which must then be both)")
    p.add_argument("--registry", default=None, metavar="URL",
                   help="service registry of the engines: `memory` (this process) or redis://HOST:PORT/DB (shared "
                        "with other nodes: front ends that share one route to each other's engines too, e.g. this "
                        "node's prefill engines with another node's decode engines); default: memory")
    p.add_argument("--engine-host", default="127.0.0.1", metavar="ADDR",
                   help="with a redis:// registry: the address of this node that other nodes' front ends reach its "
                        "engines and this front end at (the engines' actors listen on TCP there); never a wildcard; "
                        "127.0.0.1 serves the front ends of one machine")
    p.add_argument("--node-name", default=None, metavar="NAME",
                   help="with a redis:// registry: prefix of this node's engine ids (NAME-prefill-0, ...), which must "
                        "be unique among the front ends sharing the registry; default: none (prefill-0, ...)")
    add_auth_arguments(p)
    add_engine_arguments(p)


def engine_args_markdown() -> str:
    """docs/engine-args.md: every `flotilla serve` flag with its type, default and help, read from the same parser
    (and so the same config.py docstrings) as `flotilla serve --help`."""
    parser = argparse.ArgumentParser(prog="flotilla serve")
    add_serve_arguments(parser)
    lines = ["# Engine arguments", "",
             "<!-- Generated from config.py and server/cli.py by "
             "`python3 -m flotilla.server.cli --markdown > docs/engine-args.md`; do not edit by hand. -->", "",
             "Every flag of `flotilla serve`, as `flotilla serve --help` prints them. The engine options (every "
             "group after the server's) are also flags of `flotilla generate` and `flotilla bench offline`, and "
             "keyword arguments of the offline API with `_` for `-`: `--max-num-seqs 8` is `LLM(max_num_seqs=8)`.",
             ""]
    groups: dict[str, list[argparse.Action]] = {}
    for group in parser._action_groups:
        title = "server options" if group.title in ("options", "positional arguments") else group.title
        groups.setdefault(title, []).extend(a for a in group._group_actions if a.dest != "help")
    for title, actions in groups.items():
        lines += [f"## {title}", "", "| flag | type | default | meaning |", "|---|---|---|---|"]
        for a in actions:
            flag = " / ".join(f"`{o}`" for o in a.option_strings) or f"`{a.dest.upper()}`"
            default = f"`{a.default}`" if _shows_default(a) else "unset" if a.default is None else "off"
            help_text = (a.help or "").replace("%%", "%").replace("|", "\\|")
            lines.append(f"| {flag} | {_type_name(a)} | {default} | {help_text} |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _type_name(a: argparse.Action) -> str:
    if isinstance(a, argparse.BooleanOptionalAction):
        return "bool"
    if isinstance(a, argparse._StoreTrueAction):
        return "switch"
    if a.choices:
        return " \\| ".join(f"`{c}`" for c in a.choices)
    if a.type is json.loads:
        return "JSON"
    return getattr(a.type, "__name__", "str")


def fleet_engines(spec: str | None, config: EngineConfig, registry: str | None,
                  node_name: str | None = None) -> list[tuple[str, EngineConfig]] | None:
    """The engines of `--engines` as (name, config) with each role set; None = one plain engine (no fleet).

    Names are ROLE-INDEX (prefill-0, decode-0, decode-1, engine-0 for a colocated one), after NODE- with a node
    name. With a shared registry a node may run prefill engines only (or decode engines only, or one engine of
    --role): another node's engines are their partners."""
    shared = shared_registry(registry)
    if node_name is not None and (not node_name or "/" in node_name or not node_name.isprintable()):
        raise ValueError(f"--node-name must be a non-empty printable name without '/', got {node_name!r}")
    prefix = f"{node_name}-" if node_name else ""
    if spec is None:
        if config.disagg.role != "both" and not shared:
            raise ValueError(f"a {config.disagg.role} engine alone cannot serve requests: start the pair with "
                             "--engines prefill,decode (or `flotilla launch examples/topologies/pd-1p1d.toml`), or "
                             "share a redis:// --registry with another node's engines")
        if registry is None:
            return None
        spec = config.disagg.role
    roles = [r.strip() for r in spec.split(",") if r.strip()]
    if not roles or any(r not in ("prefill", "decode", "both", "encoder") for r in roles):
        raise ValueError(f"--engines takes roles prefill, decode, both or encoder, comma-separated; got {spec!r}")
    if ("prefill" in roles) != ("decode" in roles) and not shared:
        raise ValueError(f"--engines {spec}: prefill engines need decode engines and the other way round (or a "
                         "redis:// --registry shared with another node's)")
    if set(roles) == {"encoder"} and not shared:
        raise ValueError(f"--engines {spec}: encoder engines run the vision tower for other engines' prefills: list "
                         "prefill,decode or both engines too (or share a redis:// --registry with another node's)")
    counts: dict[str, int] = {}
    engines = []
    for role in roles:
        i = counts[role] = counts.get(role, -1) + 1
        name = f"{prefix}{'engine' if role == 'both' else role}-{i}"
        worker = config.worker
        if "encoder" in roles and role != "encoder":  # beside encoder engines the others read their embeddings
            worker = msgspec.structs.replace(worker, image_encoder="remote")
        engines.append((name, msgspec.structs.replace(config, worker=worker, disagg=msgspec.structs.replace(
            config.disagg, role=role))))
    return _own_gpus(engines)


def _own_gpus(engines: list[tuple[str, EngineConfig]]) -> list[tuple[str, EngineConfig]]:
    """Give each engine of a fleet its own GPUs when the machine has enough: engine k starts at GPU
    first + k x (tensor_parallel_size x data_parallel_size). Otherwise (CPU, or too few GPUs) they share the
    device they were given. NCCL cannot pair two ranks on one GPU (torch_dist KV transfer)."""
    from flotilla.server.engine_client import cuda_available

    config = engines[0][1]
    device = config.worker.device
    if len(engines) < 2 or device == "cpu" or not cuda_available():
        return engines
    import torch

    if device not in ("auto", "cuda") and not device.startswith("cuda:"):
        return engines
    first = int(device.partition(":")[2] or 0)
    per = config.parallel.tensor_parallel_size * config.parallel.data_parallel_size
    if first + len(engines) * per > torch.cuda.device_count():
        return engines
    return [(name, msgspec.structs.replace(cfg, worker=msgspec.structs.replace(cfg.worker,
                                                                              device=f"cuda:{first + k * per}")))
            for k, (name, cfg) in enumerate(engines)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m flotilla.server.cli",
                                description="Print docs/engine-args.md: `python3 -m flotilla.server.cli --markdown "
                                            "> docs/engine-args.md`.")
    p.add_argument("--markdown", action="store_true", required=True, help="print the engine-arguments page")
    p.parse_args(argv)
    sys.stdout.write(engine_args_markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
