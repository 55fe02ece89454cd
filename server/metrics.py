"""Prometheus metrics of the OpenAI server (GET /metrics): flotilla's own (flotilla_*), and where vLLM has the same
quantity, the same again under vLLM's name (vllm:*), so that dashboards and alerts made for vLLM read flotilla.

Request-level numbers (status, latency histograms, tokens) are observed here in the front end, where
the client's experience is; engine state (running / waiting, KV usage, prefix-cache hit rate,
preemptions) comes from the scheduler's SchedulerStatsEvent. One registry per app, so several servers
in one process (tests) do not share counters. `StatsLine` writes vLLM's periodic log line from the same numbers.
"""

from __future__ import annotations

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from flotilla.transport.messages import SchedulerStatsEvent

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                    80.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    """Every metric the server exports."""

    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        labels = ["model_name"]
        self.model = model_name
        self.requests = Counter("flotilla_requests", "Finished HTTP requests by endpoint and status code.",
                                ["model_name", "endpoint", "status"], registry=r)
        self.ttft = Histogram("flotilla_time_to_first_token_seconds", "Time from arrival to the first token.",
                              labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("flotilla_inter_token_latency_seconds", "Time between consecutive streamed deltas.",
                             labels, buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("flotilla_e2e_request_latency_seconds", "Time from arrival to the last token.",
                             labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("flotilla_prompt_tokens", "Prompt tokens of finished requests.", labels,
                                     registry=r)
        self.generation_tokens = Counter("flotilla_generation_tokens", "Generated tokens of finished requests.",
                                         labels, registry=r)
        self.cached_tokens = Counter("flotilla_prefix_cached_tokens", "Prompt tokens served from the prefix cache.",
                                     labels, registry=r)
        self.running = Gauge("flotilla_num_requests_running", "Sequences in the running batch.", labels, registry=r)
        self.waiting = Gauge("flotilla_num_requests_waiting", "Sequences waiting for admission.", labels, registry=r)
        self.in_flight = Gauge("flotilla_num_requests_in_flight", "HTTP requests being served.", labels, registry=r)
        self.kv_usage = Gauge("flotilla_kv_cache_usage_perc", "Fraction of KV cache blocks in use.", labels,
                              registry=r)
        self.prefix_hit_rate = Gauge("flotilla_prefix_cache_hit_rate",
                                     "Prompt tokens found in the prefix cache / prompt tokens looked up.", labels,
                                     registry=r)
        self.preemptions = Gauge("flotilla_num_preemptions", "Sequences preempted since start.", labels, registry=r)
        self.kv_capacity = Gauge("flotilla_kv_cache_capacity_tokens", "KV cache capacity in tokens.", labels,
                                 registry=r)
        self.spec_draft_tokens = Counter("flotilla_spec_decode_draft_tokens", "Speculative decoding: draft tokens "
                                         "the main model verified.", labels, registry=r)
        self.spec_accepted_tokens = Counter("flotilla_spec_decode_accepted_tokens", "Speculative decoding: draft "
                                            "tokens accepted (acceptance rate = accepted / draft).", labels,
                                            registry=r)
        # vLLM's names for the same quantities
        v = "vllm:"
        self.v_ttft = Histogram(v + "time_to_first_token_seconds", "Time to first token.", labels,
                                buckets=_LATENCY_BUCKETS, registry=r)
        self.v_itl = Histogram(v + "inter_token_latency_seconds", "Time between consecutive streamed deltas.",
                               labels, buckets=_ITL_BUCKETS, registry=r)
        self.v_e2e = Histogram(v + "e2e_request_latency_seconds", "End to end request latency.", labels,
                               buckets=_LATENCY_BUCKETS, registry=r)
        self.v_queue = Histogram(v + "request_queue_time_seconds", "Time from arrival to the first scheduled step.",
                                 labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.v_prefill = Histogram(v + "request_prefill_time_seconds", "Time from the first scheduled step to the "
                                   "first token.", labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.v_decode = Histogram(v + "request_decode_time_seconds", "Time from the first token to the last.",
                                  labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.v_inference = Histogram(v + "request_inference_time_seconds", "Time from the first scheduled step to "
                                     "the last token.", labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.v_success = Counter(v + "request_success", "Finished requests by finish reason.",
                                 [*labels, "finished_reason"], registry=r)
        self.v_prompt_tokens_hist = Histogram(v + "request_prompt_tokens", "Prompt tokens per request.", labels,
                                              buckets=_TOKEN_BUCKETS, registry=r)
        self.v_generation_tokens_hist = Histogram(v + "request_generation_tokens", "Generated tokens per request.",
                                                  labels, buckets=_TOKEN_BUCKETS, registry=r)
        self.v_prompt_tokens = Counter(v + "prompt_tokens", "Prompt tokens processed.", labels, registry=r)
        self.v_generation_tokens = Counter(v + "generation_tokens", "Tokens generated.", labels, registry=r)
        self.v_running = Gauge(v + "num_requests_running", "Requests running on the engine.", labels, registry=r)
        self.v_waiting = Gauge(v + "num_requests_waiting", "Requests waiting to be scheduled.", labels, registry=r)
        self.v_kv_usage = Gauge(v + "kv_cache_usage_perc", "KV cache usage (1 = 100%).", labels, registry=r)
        self.v_preemptions = Counter(v + "num_preemptions", "Preemptions since start.", labels, registry=r)
        self.v_prefix_queries = Counter(v + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                        labels, registry=r)
        self.v_prefix_hits = Counter(v + "prefix_cache_hits", "Prompt tokens found in the prefix cache.", labels,
                                     registry=r)
        self.v_spec_drafts = Counter(v + "spec_decode_num_draft_tokens", "Draft tokens verified.", labels,
                                     registry=r)
        self.v_spec_accepted = Counter(v + "spec_decode_num_accepted_tokens", "Draft tokens accepted.", labels,
                                       registry=r)
        self._totals: dict[str, int] = {}
        self.tokens_prefilled = 0
        """Prompt tokens of requests past their prefill (their first token out), since start (StatsLine)."""
        self.tokens_generated = 0
        """Tokens streamed out since start (StatsLine)."""
        # several engines behind one front end (server/fleet.py): per engine
        per_engine = ["model_name", "engine", "role"]
        self.engine_alive = Gauge("flotilla_engine_alive", "1 while the engine serves, 0 once it died.", per_engine,
                                  registry=r)
        self.engine_kv_usage = Gauge("flotilla_engine_kv_cache_usage_perc", "Fraction of the engine's KV blocks "
                                     "held by sequences or migration pins.", per_engine, registry=r)
        self.engine_load = Gauge("flotilla_engine_num_requests", "Sequences running or waiting in the engine.",
                                 per_engine, registry=r)
        self.kv_transfers = Gauge("flotilla_kv_transfers_in_flight", "Disaggregated transfers the engine holds KV "
                                  "blocks for (prefill: pinned until the decode side releases them).", per_engine,
                                  registry=r)
        self.kv_migration_bytes = Counter("flotilla_kv_migration_bytes", "KV bytes pulled into the engine over the "
                                          "KV data plane (decode role).", per_engine, registry=r)
        self.engine_failures = Counter("flotilla_engine_failures", "Times the engine failed: an actor died or went "
                                       "silent, or a restart did not come up.", ["model_name", "engine"], registry=r)
        self.engine_restarts = Counter("flotilla_engine_restarts", "Times a failed engine was started again and "
                                       "came up.", ["model_name", "engine"], registry=r)
        self._restart_counts: dict[str, tuple[int, int]] = {}
        self.engine_routed = Counter("flotilla_engine_requests_routed", "Requests the router gave the engine (a "
                                     "disaggregated one counts for its prefill and its decode engine).", per_engine,
                                     registry=r)
        # expert parallelism: each routed expert's load, for expert-placement balancing (EPLB)
        self.expert_tokens = Counter("flotilla_expert_tokens", "(token, expert) pairs routed to each expert, summed "
                                     "over the data-parallel ranks; layer = the MoE layer's index among the "
                                     "model's MoE layers.", ["model_name", "layer", "expert"], registry=r)
        self._migrated: dict[str, int] = {}
        self._routed: dict[str, int] = {}
        self._expert_tokens: np.ndarray | None = None
        self.dp_routed = Counter("flotilla_dp_requests_routed", "Requests the coordinator gave each data-parallel "
                                 "rank of the engine.", ["model_name", "dp_rank"], registry=r)
        self._dp_routed: list[int] = []

    def observe_engine(self, stats: SchedulerStatsEvent | None) -> None:
        if stats is None:
            return
        m = self.model
        self.running.labels(m).set(stats.num_running)
        self.waiting.labels(m).set(stats.num_waiting)
        self.kv_usage.labels(m).set(stats.kv_usage)
        self.prefix_hit_rate.labels(m).set(stats.prefix_cache_hit_rate)
        self.preemptions.labels(m).set(stats.num_preemptions)
        self.kv_capacity.labels(m).set(stats.kv_capacity_tokens)
        self.v_running.labels(m).set(stats.num_running)
        self.v_waiting.labels(m).set(stats.num_waiting)
        self.v_kv_usage.labels(m).set(stats.kv_usage)
        for name, total, counters in (
                ("drafts", stats.spec_draft_tokens, (self.spec_draft_tokens, self.v_spec_drafts)),
                ("accepted", stats.spec_accepted_tokens, (self.spec_accepted_tokens, self.v_spec_accepted)),
                ("preemptions", stats.num_preemptions, (self.v_preemptions,)),
                ("prefix_queries", stats.prefix_cache_queries, (self.v_prefix_queries,)),
                ("prefix_hits", stats.prefix_cache_hits, (self.v_prefix_hits,))):
            seen = self._totals.get(name, 0)
            grown = total - seen if total >= seen else total  # (smaller: an engine restarted; its count started over)
            for counter in counters:
                counter.labels(m).inc(grown)
            self._totals[name] = total

    def observe_engines(self, engines: dict[str, tuple[str, SchedulerStatsEvent | None, bool, int]]) -> None:
        """Per-engine state: engine id -> (role, latest stats, alive, requests routed to it)."""
        m = self.model
        for name, (role, stats, alive, routed) in engines.items():
            self.engine_alive.labels(m, name, role).set(1 if alive else 0)
            self.engine_routed.labels(m, name, role).inc(routed - self._routed.get(name, 0))
            self._routed[name] = routed
            if stats is None:
                continue
            self.engine_kv_usage.labels(m, name, role).set(stats.kv_usage)
            self.engine_load.labels(m, name, role).set(stats.num_running + stats.num_waiting)
            self.kv_transfers.labels(m, name, role).set(stats.num_transfers)
            grown = stats.kv_migrated_bytes - self._migrated.get(name, 0)
            if grown > 0:
                self.kv_migration_bytes.labels(m, name, role).inc(grown)
                self._migrated[name] = stats.kv_migrated_bytes

    def observe_restarts(self, counts: dict[str, tuple[int, int]]) -> None:
        """Engine id -> (failures, restarts) since start."""
        for name, (failures, restarts) in counts.items():
            seen_failures, seen_restarts = self._restart_counts.get(name, (0, 0))
            self.engine_failures.labels(self.model, name).inc(failures - seen_failures)
            self.engine_restarts.labels(self.model, name).inc(restarts - seen_restarts)
            self._restart_counts[name] = (failures, restarts)

    def observe_expert_tokens(self, counts: np.ndarray | None) -> None:
        """int64 [moe layers, experts] tokens routed to each expert since start (server/dp_coordinator.py)."""
        if counts is None:
            return
        seen = self._expert_tokens
        if seen is None or seen.shape != counts.shape:
            seen = np.zeros_like(counts)
            for layer, expert in np.ndindex(counts.shape):  # every expert shows, also one never chosen
                self.expert_tokens.labels(self.model, str(layer), str(expert))
        for layer, expert in np.argwhere(counts > seen).tolist():
            self.expert_tokens.labels(self.model, str(layer), str(expert)).inc(int(counts[layer, expert]
                                                                                   - seen[layer, expert]))
        self._expert_tokens = counts.copy()

    def observe_dp_routed(self, assigned: list[int] | None) -> None:
        """Requests given to each data-parallel rank since start (server/dp_coordinator.py)."""
        if assigned is None:
            return
        seen = self._dp_routed + [0] * (len(assigned) - len(self._dp_routed))
        for rank, (now, before) in enumerate(zip(assigned, seen)):
            self.dp_routed.labels(self.model, str(rank)).inc(now - before)
        self._dp_routed = list(assigned)

    def render(self, stats: SchedulerStatsEvent | None,
               engines: dict[str, tuple[str, SchedulerStatsEvent | None, bool, int]] | None = None,
               expert_tokens: np.ndarray | None = None, dp_routed: list[int] | None = None,
               restarts: dict[str, tuple[int, int]] | None = None) -> bytes:
        self.observe_engine(stats)
        if restarts:
            self.observe_restarts(restarts)
        if engines:
            self.observe_engines(engines)
        self.observe_expert_tokens(expert_tokens)
        self.observe_dp_routed(dp_routed)
        return generate_latest(self.registry)


class RequestTimer:
    """TTFT / inter-token / end-to-end timing of one request, fed by its deltas."""

    __slots__ = ("metrics", "start", "last", "first")

    def __init__(self, metrics: ServerMetrics, start: float) -> None:
        self.metrics, self.start, self.last, self.first = metrics, start, None, None

    def delta(self, now: float) -> None:
        m = self.metrics
        if self.last is None:
            self.first = now
            m.ttft.labels(m.model).observe(now - self.start)
            m.v_ttft.labels(m.model).observe(now - self.start)
        else:
            m.itl.labels(m.model).observe(now - self.last)
            m.v_itl.labels(m.model).observe(now - self.last)
        self.last = now

    def done(self, now: float, prompt_tokens: int, output_tokens: int, cached_tokens: int,
             finish_reasons: list[str] = (), queue_time: float | None = None) -> None:
        """The request ended: queue_time, the engine's (None: unknown) splits its time before the first token into
        queueing and prefill, as vLLM's request timings do."""
        m, model = self.metrics, self.metrics.model
        m.e2e.labels(model).observe(now - self.start)
        m.v_e2e.labels(model).observe(now - self.start)
        m.prompt_tokens.labels(model).inc(prompt_tokens)
        m.generation_tokens.labels(model).inc(output_tokens)
        m.cached_tokens.labels(model).inc(cached_tokens)
        m.v_prompt_tokens.labels(model).inc(prompt_tokens)
        m.v_generation_tokens.labels(model).inc(output_tokens)
        m.v_prompt_tokens_hist.labels(model).observe(prompt_tokens)
        m.v_generation_tokens_hist.labels(model).observe(output_tokens)
        for reason in finish_reasons:
            m.v_success.labels(model, reason).inc()
        if self.first is not None:
            m.v_decode.labels(model).observe(now - self.first)
            if queue_time is not None:
                m.v_queue.labels(model).observe(queue_time)
                m.v_prefill.labels(model).observe(max(self.first - self.start - queue_time, 0.0))
                m.v_inference.labels(model).observe(max(now - self.start - queue_time, 0.0))


class StatsLine:
    """vLLM's periodic log line while the engine is busy: prompt and generation throughput since the last line,
    running and waiting requests, KV cache usage, prefix cache hit rate."""

    def __init__(self, metrics: ServerMetrics, now: float) -> None:
        self.metrics = metrics
        self._at, self._prefilled, self._generated = now, 0, 0

    def line(self, stats: SchedulerStatsEvent | None, now: float) -> str | None:
        """The line for the interval that ends now; None when the engine had nothing to do in it."""
        m = self.metrics
        prefilled, generated = m.tokens_prefilled - self._prefilled, m.tokens_generated - self._generated
        elapsed = max(now - self._at, 1e-9)
        self._at, self._prefilled, self._generated = now, m.tokens_prefilled, m.tokens_generated
        busy = stats is not None and (stats.num_running or stats.num_waiting)
        if not (prefilled or generated or busy):
            return None
        running, waiting = (stats.num_running, stats.num_waiting) if stats is not None else (0, 0)
        usage = stats.kv_usage if stats is not None else 0.0
        hit = stats.prefix_cache_hit_rate if stats is not None else 0.0
        return (f"Avg prompt throughput: {prefilled / elapsed:.1f} tokens/s, Avg generation throughput: "
                f"{generated / elapsed:.1f} tokens/s, Running: {running} reqs, Waiting: {waiting} reqs, "
                f"KV cache usage: {usage * 100:.1f}%, Prefix cache hit rate: {hit * 100:.1f}%")
