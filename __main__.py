"""The ``flotilla`` command (also ``python -m flotilla``)."""

from __future__ import annotations

import argparse
import faulthandler
import gc
import importlib
import logging
import signal
import sys
from pathlib import Path

from flotilla import __version__
from flotilla.sampling_params import SamplingParams
from flotilla.server.cli import (
    SERVE_DESCRIPTION,
    HelpFormatter,
    add_engine_arguments,
    add_serve_arguments,
    engine_config_from_args,
)
from flotilla.actors.standalone import endpoints_for, run_actor
from flotilla.actors.topology import load_topology
from flotilla.scripts import launch
from flotilla.transport import auth

DESCRIPTION = """\
flotilla: an LLM inference engine with an OpenAI-compatible streaming server over msgspec/ZeroMQ actors.

`flotilla COMMAND --help` explains each command's flags.
"""


def _add_actor(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("actor", formatter_class=HelpFormatter, help="run one actor in the foreground, for debugging",
                       description="""\
Run one actor of a topology in the foreground, for debugging.

  attached to a running topology: launch it with `flotilla launch TOPO.toml --external NAME`, then
      flotilla actor NAME --topology TOPO.toml --endpoints /tmp/flotilla-XXXX/endpoints.json --trace
  against scripted peers (no topology running): every peer is faked by a sink that prints what it
  receives, and the script's messages (JSON lines: {"type": "PingRequest", "seq": 1, ...}) are fed
  to the actor's inbox:
      flotilla actor NAME --topology TOPO.toml --script messages.jsonl --trace
""")
    p.add_argument("name", help="actor name in the topology (NAME,NAME runs several in this one process)")
    p.add_argument("--topology", required=True, type=Path, help="topology file (TOML, or the JSON a runtime wrote)")
    p.add_argument("--endpoints", type=Path, default=None,
                   help="address table of the running topology (printed by `flotilla launch`)")
    p.add_argument("--instance", type=int, default=0, help="which instance of the actor to be")
    p.add_argument("--trace", action="store_true", help="print every message in and out, readable")
    p.add_argument("--script", type=Path, default=None,
                   help="JSON-lines file of messages to feed the actor; peers are replaced by printing sinks")
    p.add_argument("--idle", type=float, default=1.0,
                   help="with --script: stop after this many seconds without output")
    auth.add_auth_arguments(p)


def _run_actor(args: argparse.Namespace) -> int:
    try:
        topo = load_topology(args.topology)
        for name in args.name.split(","):
            topo.spec(name)
        endpoints = None if args.script else endpoints_for(topo, args.endpoints)
    except (ValueError, KeyError) as e:
        print(f"flotilla actor: {e}", file=sys.stderr)
        return 2
    rc = run_actor(topo, args.name, args.instance, endpoints=endpoints, trace=args.trace, script=args.script,
                   idle_s=args.idle)
    gc.freeze()  # the interpreter's last collection then skips torch's object graph (seconds for a worker)
    return rc


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", formatter_class=HelpFormatter, help="run prompts offline and print the completions",
                       description="""\
Run prompts through the engine offline (the same actors as `serve`, no HTTP) and print the completions.

  flotilla generate --prompt "The capital of France is"
  flotilla generate --chat --prompt "What is the capital of France?" --temperature 0
""")
    p.add_argument("--model", default=None, help="HF model folder; default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    p.add_argument("--chat", action="store_true", help="treat each prompt as a user message (the chat template)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold")
    p.add_argument("--placement", choices=["inline", "process"], default=None,
                   help="inline: every actor in this process; process: one process per actor; default: process on a "
                        "GPU or with --tensor-parallel-size / --data-parallel-size > 1, inline on CPU")
    add_engine_arguments(p)


def _run_generate(args: argparse.Namespace) -> int:
    try:
        config = engine_config_from_args(args, args.model, offline=True)
    except (TypeError, ValueError) as e:
        print(f"flotilla generate: {e}", file=sys.stderr)
        return 2
    from flotilla.llm import LLM  # heavy: see main()

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p)
    with LLM(config=config, placement=args.placement) as llm:
        if args.chat:
            outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
        else:
            outs = llm.generate(args.prompt, params)
    for prompt, out in zip(args.prompt, outs):
        print(f"--- {prompt!r}\n{out.outputs[0].text}\n[{len(out.outputs[0].token_ids)} tokens, "
              f"finish_reason={out.outputs[0].finish_reason}]", flush=True)
    return 0


def _add_launch(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("launch", formatter_class=HelpFormatter,
                       help="start every process of a topology file and supervise them",
                       description=launch.__doc__)
    launch.add_arguments(p)


def _run_launch(args: argparse.Namespace) -> int:
    return launch.main(args)


def _add_keygen(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("keygen", formatter_class=HelpFormatter,
                       help="create the cluster key that authenticates a deployment's tcp endpoints",
                       description="""\
Create a cluster key: a ZeroMQ CURVE keypair in a file of mode 0600. Every actor and front end of one deployment
authenticates its tcp:// control-plane endpoints with it (docs/serving.md, "Who may talk to an engine"):

  flotilla keygen /etc/flotilla/cluster.key
  scp -p /etc/flotilla/cluster.key node2:/etc/flotilla/      # the same file on every host
  flotilla launch two-hosts.toml --host node1 --auth-key-file /etc/flotilla/cluster.key
""")
    p.add_argument("path", type=Path, help="where to write the key; an existing file is never replaced")


def _run_keygen(args: argparse.Namespace) -> int:
    try:
        auth.create_key_file(args.path)
    except OSError as e:
        print(f"flotilla keygen: {e}", file=sys.stderr)
        return 2
    print(f"cluster key written to {args.path}: copy it (mode 0600) to every host of the deployment and pass "
          f"--auth-key-file {args.path}", flush=True)
    return 0


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", formatter_class=HelpFormatter,
                       help="benchmarks (transport, offline throughput, serving)",
                       description="Benchmarks: `flotilla bench transport` (control plane), `flotilla bench offline` "
                                   "(throughput through the engine), `flotilla bench serving` (TTFT / TPOT / ITL / "
                                   "throughput of a running OpenAI-compatible server, flotilla or vLLM, over HTTP "
                                   "with SSE), `flotilla bench schedule` (the batching policy alone on the same "
                                   "workloads, no model). `flotilla bench WHAT --help` lists each one's flags.")
    p.add_argument("what", choices=["transport", "offline", "serving", "schedule"], help="which benchmark")
    p.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's own flags (see its --help)")


def _run_bench(args: argparse.Namespace) -> int:
    # The benchmarks live in the checkout's scripts/dev/, which the installed package does not ship.
    try:
        bench = importlib.import_module(f"flotilla.scripts.dev.bench_{args.what}")
    except ModuleNotFoundError as e:
        if not (e.name or "").startswith("flotilla.scripts.dev"):
            raise
        print("flotilla bench runs from a source checkout (scripts/dev/); this installation has no benchmarks",
              file=sys.stderr)
        return 2
    return bench.main(args.rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flotilla", description=DESCRIPTION, formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"flotilla {__version__}")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="logging verbosity")
    sub = parser.add_subparsers(title="commands", dest="command", metavar="COMMAND")
    sub.required = True
    p = sub.add_parser("serve", formatter_class=HelpFormatter,
                       help="start the OpenAI-compatible HTTP server and its engine",
                       description=SERVE_DESCRIPTION)
    add_serve_arguments(p)
    _add_generate(sub)
    _add_actor(sub)
    _add_launch(sub)
    _add_keygen(sub)
    _add_bench(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(process)d %(name)s: %(message)s")
    # `kill -USR1 PID` prints every thread's Python stack to stderr: a process that hangs says where (every flotilla
    # process, actors included, starts here)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    if hasattr(args, "auth"):  # every command that runs actors or front ends
        try:
            auth.configure(auth.settings_from_args(args))
        except auth.AuthError as e:
            print(f"flotilla {args.command}: {e}", file=sys.stderr)
            return 2
    if args.command == "serve":
        # torch, transformers and uvicorn load only for the commands that use them: `flotilla actor echo`
        # and `flotilla --help` stay fast
        from flotilla.server import serve

        return serve.main(args)
    if args.command == "generate":
        return _run_generate(args)
    if args.command == "actor":
        return _run_actor(args)
    if args.command == "launch":
        return _run_launch(args)
    if args.command == "keygen":
        return _run_keygen(args)
    return _run_bench(args)


if __name__ == "__main__":
    sys.exit(main())
