"""What the PD deployment tests share (`import helpers_pd as pdh`): the requests they send (chat and
completion, streamed or not, over shared prefixes), running them through the real `openai` client, and reading
the front end's /metrics per engine."""

from __future__ import annotations

import contextlib
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

from flotilla.transport.endpoints import free_tcp_port
from helpers_optional import optional, program, require

openai = require("openai", "the PD deployment tests send their requests through the real openai client")
redis = optional("redis")

ENGINE_OPTIONS = ["--block-size", "4", "--kv-cache-blocks", "160", "--max-num-seqs", "16"]
WORDS = ("The quick brown fox jumps over the lazy dog . What is the capital of France ? Paris is . "
         "Continuous batching keeps the GPU busy ; paged attention keeps memory tidy").split()


def prompt(i: int) -> str:
    # shared prefixes (the decode side's prefix cache skips blocks it holds) and lengths over many blocks
    return " ".join(WORDS[: 3 + (i * 7) % 28]) + f" {i % 5}"


def requests(n: int, offset: int = 0) -> list[dict]:
    out = []
    for i in range(offset, offset + n):
        kind = "chat" if i % 2 else "completion"
        out.append({"kind": kind, "stream": (i // 2) % 2 == 1, "prompt": prompt(i),
                    "max_tokens": (1, 3, 8, 17)[i % 4]})
    return out


def run(client: openai.OpenAI, r: dict) -> str:
    common = dict(model="m", max_tokens=r["max_tokens"], temperature=0, stream=r["stream"],
                  extra_body=r.get("extra_body"))
    if r["kind"] == "chat":
        res = client.chat.completions.create(messages=[{"role": "user", "content": r["prompt"]}], **common)
        if r["stream"]:
            return "".join(c.choices[0].delta.content or "" for c in res if c.choices)
        return res.choices[0].message.content
    res = client.completions.create(prompt=r["prompt"], **common)
    if r["stream"]:
        return "".join(c.choices[0].text for c in res if c.choices)
    return res.choices[0].text


def run_all(url: str, reqs: list[dict]) -> list[str]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(lambda r: run(client, r), reqs))


def check_pair_equals_colocated(model: str, common: list[str], pd_options: tuple[str, ...] = (), n: int = 16,
                                 offset: int = 3, backend: str = "dlslime_tcp", timeout: float = 180) -> None:
    """A 1P1D pair over `backend` answers `n` requests (chat and completion, streamed or not) as one colocated
    engine does, moves KV bytes, and ends with neither engine holding anything; both servers stopped after."""
    from helpers_server import start_servers

    colocated, pd = start_servers(((model, "--single-process", *common), {"timeout": timeout}),
                                  ((model, "--engines", "prefill,decode", "--kv-transfer-backend", backend,
                                    *pd_options, *common), {"timeout": timeout}))  # (both start at once)
    try:
        reqs = requests(n, offset=offset)
        assert run_all(pd.url, reqs) == run_all(colocated.url, reqs)
        m = wait_idle(pd.url, ["prefill-0", "decode-0"])
        assert engine_metric(m, "flotilla_kv_migration_bytes_total", "decode-0") > 0
    finally:
        colocated.stop()
        assert pd.stop() == 0, "".join(pd.log[-30:])


def metrics(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def engine_metric(m: dict[str, float], metric: str, engine: str, default: float | None = None) -> float:
    """`metric`'s sample for `engine`; `default` when the engine has not reported it yet (an error without one)."""
    found = [v for k, v in m.items() if k.startswith(metric + "{") and f'engine="{engine}"' in k]
    assert found or default is not None, f"no {metric} sample for engine {engine}"
    return found[0] if found else default


def wait_idle(url: str, engines: list[str], timeout: float = 15.0, transfers: bool = True) -> dict[str, float]:
    """Every engine's KV blocks free and (transfers) no transfer held (stats arrive when an engine idles; an engine
    whose stats have not arrived yet counts as busy)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        busy = [(e, engine_metric(m, "flotilla_engine_kv_cache_usage_perc", e, default=-1),
                 engine_metric(m, "flotilla_kv_transfers_in_flight", e, default=-1) if transfers else 0)
                for e in engines]
        if all(u == 0 and t == 0 for _, u, t in busy):
            return m
        assert time.monotonic() < deadline, f"engines still hold KV blocks or transfers: {busy}"
        time.sleep(0.05)


@contextlib.contextmanager
def redis_server() -> Iterator[str | None]:
    """A real redis-server on a free port for the block: its URL, or None when it or the redis client is not
    installed (a failure under CI, which installs redis-server: .ci/run)."""
    binary = program("redis-server", "the deployments' Redis registry")
    if binary is None or redis is None:
        yield None
        return
    port = free_tcp_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    r = redis.Redis.from_url(url)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                r.ping()
                break
            except redis.exceptions.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)
        yield url
    finally:
        r.close()
        proc.terminate()
        proc.wait(timeout=10)


def wait_health(url: str, status: int, timeout: float = 20.0) -> None:
    """Until GET /health answers `status` (200 ready, 503 nothing can be served)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = urllib.request.urlopen(url + "/health", timeout=10).status
        except urllib.error.HTTPError as e:
            got = e.code
        if got == status:
            return
        assert time.monotonic() < deadline, f"/health still answers {got}, not {status}"
        time.sleep(0.05)


def wait_restarted(pd, engine: str, times: int = 1, timeout: float = 120.0) -> dict[str, float]:
    """Until `engine`, failed `times` times, is alive again after as many restarts: the metrics then."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(pd.url)
        if engine_metric(m, "flotilla_engine_alive", engine) == 1 and any(
                f"engine {engine} restarted ({times} since start)" in x for x in pd.log):
            break
        assert time.monotonic() < deadline, f"engine {engine} was not restarted: " + "".join(pd.log[-20:])
        time.sleep(0.1)
    failed = [x for x in pd.log if f"engine {engine}: the restart failed" in x]
    assert engine_metric(m, "flotilla_engine_restarts_total", engine) == times, "".join(pd.log[-20:])
    # (a restart that fails, e.g. one begun while the failed engine's last process is still exiting, is a failure
    # of its own, which the next attempt follows)
    assert engine_metric(m, "flotilla_engine_failures_total", engine) == times + len(failed), "".join(pd.log[-20:])
    return m
