"""Shared by the MTP speculation tests (test_spec_decode.py, test_spec_graphs.py, test_qwen3_5_moe.py,
test_deepseek_v4.py): a random MTP layer written into a tiny DeepSeek-V3, Qwen3.5-MoE or DeepSeek-V4 checkpoint, a
runner, a mixed batch of requests driven to the end one step at a time, a draft hook that hands plain decoding's
tokens (forced acceptance, some corrupted), and the check of speculating-step graphs against eager speculation."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from flotilla import SamplingParams
from flotilla.actors.batching import BatchScheduler
from flotilla.actors.block_manager import BlockManager
from flotilla.actors.model_runner import ModelRunner
from flotilla.actors.spec_graphs import SpecGraphs
from flotilla.config import EngineConfig, SchedulerConfig
from flotilla.transport.messages import TokenizedRequest
from safetensors.torch import load_file, save_file

VOCAB = 320
STOP_TOKEN = 64
"""A stop token id request r5 is given (the test picks a prompt whose greedy output holds it)."""


def add_mtp_layer(model_dir: Path, seed: int = 5) -> Path:
    """Append a random MTP layer (DeepSeek-V3's names, at layer num_hidden_layers) to a tiny checkpoint: a
    decoder block made from layer 1's tensors (MoE) plus noise, enorm / hnorm / eh_proj / shared_head, and
    copies of the embedding and LM head as DeepSeek ships them."""
    config = json.loads((model_dir / "config.json").read_text())
    n = config["num_hidden_layers"]
    weights = load_file(str(model_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    hidden = config["hidden_size"]
    mtp = {}
    for name, t in weights.items():
        if name.startswith("model.layers.1."):
            noise = torch.randn(t.shape, generator=gen) * 0.02 * (t.float().std() if t.numel() > 1 else 0)
            mtp[name.replace("model.layers.1.", f"model.layers.{n}.")] = (t + noise.to(t.dtype)).contiguous()
    p = f"model.layers.{n}."
    mtp[p + "enorm.weight"] = 1 + 0.1 * torch.randn(hidden, generator=gen)
    mtp[p + "hnorm.weight"] = 1 + 0.1 * torch.randn(hidden, generator=gen)
    mtp[p + "eh_proj.weight"] = 0.1 * torch.randn(hidden, 2 * hidden, generator=gen)
    mtp[p + "shared_head.norm.weight"] = 1 + 0.1 * torch.randn(hidden, generator=gen)
    mtp[p + "embed_tokens.weight"] = weights["model.embed_tokens.weight"].clone()
    mtp[p + "shared_head.head.weight"] = weights["lm_head.weight"].clone()
    save_file({**weights, **mtp}, str(model_dir / "model.safetensors"))
    (model_dir / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    return model_dir


def add_qwen35_mtp_layer(model_dir: Path, seed: int = 5) -> Path:
    """Append a random MTP layer (Qwen3.5's `mtp.*` names) to a tiny Qwen3.5-MoE checkpoint: a full-attention MoE
    decoder layer made from the checkpoint's attention layer's tensors plus noise, fc and the zero-centred norms."""
    config = json.loads((model_dir / "config.json").read_text())
    attention = next(i for i, t in enumerate(config["layer_types"]) if t == "full_attention")
    weights = load_file(str(model_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    hidden = config["hidden_size"]
    mtp = {}
    for name, t in weights.items():
        if name.startswith(f"model.layers.{attention}."):
            noise = torch.randn(t.shape, generator=gen) * 0.02 * (t.float().std() if t.numel() > 1 else 0)
            mtp[name.replace(f"model.layers.{attention}.", "mtp.layers.0.")] = (t + noise.to(t.dtype)).contiguous()
    mtp["mtp.fc.weight"] = 0.1 * torch.randn(hidden, 2 * hidden, generator=gen)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{norm}.weight"] = 0.1 * torch.randn(hidden, generator=gen)  # (stored as w of x * (1 + w))
    save_file({**weights, **mtp}, str(model_dir / "model.safetensors"))
    (model_dir / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
    return model_dir


def add_v4_mtp_layer(model_dir: Path, seed: int = 5) -> Path:
    """Append a random MTP layer (DeepSeek-V4's `mtp.0.*` names) to a tiny DeepSeek-V4 checkpoint: a sliding-window
    decoder layer with routed experts made from layer 0's attention and layer 1's experts plus noise, enorm / hnorm /
    e_proj / h_proj, its own hc_head and norm, and copies of the embedding and LM head as DeepSeek ships them."""
    config = json.loads((model_dir / "config.json").read_text())
    weights = load_file(str(model_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    hidden, n = config["hidden_size"], config["hc_mult"]
    mtp = {}
    for name, t in weights.items():
        for layer, own in ((0, lambda rest: not rest.startswith(("ffn.", "ffn_norm"))),
                           (1, lambda rest: rest.startswith(("ffn.", "ffn_norm")))):
            rest = name.removeprefix(f"model.layers.{layer}.")
            if rest != name and own(rest):
                noise = torch.randn(t.shape, generator=gen) * 0.02 * (t.float().std() if t.numel() > 1 else 0)
                mtp[f"mtp.0.{rest}"] = (t + noise.to(t.dtype)).contiguous()
    mtp["mtp.0.enorm.weight"] = 1 + 0.1 * torch.randn(hidden, generator=gen)
    mtp["mtp.0.hnorm.weight"] = 1 + 0.1 * torch.randn(hidden, generator=gen)
    mtp["mtp.0.e_proj.weight"] = 0.1 * torch.randn(hidden, hidden, generator=gen)
    mtp["mtp.0.h_proj.weight"] = 0.1 * torch.randn(hidden, hidden, generator=gen)
    mtp["mtp.0.hc_head_fn"] = 0.1 * torch.randn(n, n * hidden, generator=gen)
    mtp["mtp.0.hc_head_base"] = 0.1 * torch.randn(n, generator=gen)
    mtp["mtp.0.hc_head_scale"] = 1 + 0.1 * torch.randn(1, generator=gen)
    mtp["mtp.0.norm.weight"] = 1 + 0.1 * torch.randn(hidden, generator=gen)
    mtp["mtp.0.emb.tok_emb.weight"] = weights["model.embed_tokens.weight"].clone()
    mtp["mtp.0.head.weight"] = weights["head.weight"].clone()
    save_file({**weights, **mtp}, str(model_dir / "model.safetensors"))
    (model_dir / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    return model_dir


def make_runner(model_dir: Path, spec: int | None, num_blocks: int = 300, device: str = "cpu",
                enforce_eager: bool = False, **options: object) -> ModelRunner:
    options = {"model": str(model_dir), "device": device, "dtype": "float32", "kv_cache_blocks": num_blocks,
               "block_size": 4, "max_num_seqs": 6, "enforce_eager": enforce_eager, **options}
    if spec is not None:
        options["speculative_config"] = {"method": "mtp", "num_speculative_tokens": spec}
    return ModelRunner(EngineConfig.from_options(**options), progress=False)


def requests() -> list[TokenizedRequest]:
    rng = np.random.default_rng(3)
    kinds = [
        SamplingParams(max_tokens=14, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=9, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.8, seed=11, ignore_eos=True),  # seeded: the same noise
        SamplingParams(max_tokens=10, temperature=0, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0, repetition_penalty=1.3, ignore_eos=True),  # gets no drafts
        SamplingParams(max_tokens=16, temperature=0, stop_token_ids=[STOP_TOKEN]),
    ]
    lengths = [3, 31, 9, 22, 5, 14, 40, 1, 17, 6, 27, 11]
    reqs = [TokenizedRequest(rid=f"r{i}", prompt_ids=rng.integers(4, VOCAB, n).astype(np.int32), eos_token_ids=[2],
                             sampling=kinds[i % len(kinds)]) for i, n in enumerate(lengths)]
    shared = reqs[1].prompt_ids[:21]  # later requests that hit r1's prompt in the prefix cache
    for i, n in ((12, 6), (13, 1)):
        prompt = np.concatenate((shared, rng.integers(4, VOCAB, n).astype(np.int32)))
        reqs.append(TokenizedRequest(rid=f"r{i}", prompt_ids=prompt, eos_token_ids=[2], sampling=kinds[0]))
    return reqs


def run(runner: ModelRunner, budget: int = 16, rows: list | None = None, drop: tuple[str, ...] = (),
        reqs: list[TokenizedRequest] | None = None) -> tuple[dict, dict, BatchScheduler, list[tuple[int, int]]]:
    """Every request (requests() unless reqs; but those in `drop`) to the end, one step at a time; also (drafts
    planned, tokens got) of each verify row, and the same with the row's request id first in `rows` when given."""
    cfg = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=budget, max_steps_in_flight=1,
                          speculative_config=runner.config.scheduler.speculative_config)
    blocks = BlockManager(runner.num_blocks, runner.block_size, recompute_last_hit=cfg.speculative_config is not None,
                          num_state_snapshots=runner.num_state_snapshots)
    sched = BatchScheduler(cfg, blocks, max_model_len=256)
    for req in reqs or requests():
        assert req.rid in drop or sched.add(req)
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[float]] = {}
    verified: list[tuple[int, int]] = []
    for _ in range(5_000):
        plan = sched.schedule()
        if plan is None:
            break
        drafts = {seq.rid: d for seq, _, d in sched.inflight[plan.step] if d}
        result = runner.execute(plan)
        assert result.error is None
        if result.num_tokens is not None:
            verified += [(drafts[rid], int(n)) for rid, n in zip(result.rids, result.num_tokens) if rid in drafts]
            if rows is not None:
                rows += [(rid, drafts[rid], int(n)) for rid, n in zip(result.rids, result.num_tokens) if rid in drafts]
        for d in sched.update(result):
            tokens.setdefault(d.rid, []).extend(d.token_ids)
            if d.logprobs is not None:
                logprobs.setdefault(d.rid, []).extend(d.logprobs)
    assert not sched.seqs
    # r12 and r13 reused r1's prompt blocks (a hybrid model's hits need a state snapshot there: not assured here)
    assert reqs is not None or blocks.hit_tokens > 0 or blocks.num_blocks < 100 or blocks.num_state_snapshots
    return tokens, logprobs, sched, verified


def run_ahead(runner: ModelRunner, reqs: list[TokenizedRequest], budget: int = 64) -> tuple[dict, dict, BatchScheduler,
                                                                                           list[tuple[int, int]]]:
    """run() as the worker drives a runner whose scheduler plans steps ahead: up to two steps launched, the oldest
    finished, its result applied, and the next steps planned before the later one is back."""
    cfg = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=budget, max_steps_in_flight=2,
                          speculative_config=runner.config.scheduler.speculative_config)
    blocks = BlockManager(runner.num_blocks, runner.block_size, recompute_last_hit=True,
                          num_state_snapshots=runner.num_state_snapshots)
    sched = BatchScheduler(cfg, blocks, max_model_len=256)
    sched.plan_ahead = True
    for req in reqs:
        assert sched.add(req)
    tokens: dict[str, list[int]] = {}
    logprobs: dict[str, list[float]] = {}
    verified: list[tuple[int, int]] = []
    inflight: list[dict[str, int]] = []
    for _ in range(5_000):
        while len(inflight) < 2 and (plan := sched.schedule()) is not None:
            inflight.append({seq.rid: d for seq, _, d in sched.inflight[plan.step] if d})
            runner.launch(plan)
        if not inflight:
            break
        result = runner.finish_oldest()
        drafts = inflight.pop(0)
        assert result.error is None
        if result.num_tokens is not None:
            verified += [(drafts[rid], int(n)) for rid, n in zip(result.rids, result.num_tokens) if rid in drafts]
        for d in sched.update(result):
            tokens.setdefault(d.rid, []).extend(d.token_ids)
            if d.logprobs is not None:
                logprobs.setdefault(d.rid, []).extend(d.logprobs)
    assert not sched.seqs and not sched.inflight and blocks.num_free_blocks == blocks.num_blocks
    return tokens, logprobs, sched, verified


def device_oracle(plain_tokens: dict, reqs: list[TokenizedRequest], device: torch.device, corrupt: bool = True):
    """A device draft hook (MTPSpeculator.device_draft_hook) giving the tokens plain decoding produced at each draft's
    position; with `corrupt`, every draft at a position divisible by 3 is wrong."""
    full = {tuple(r.prompt_ids.tolist()): r.prompt_ids.tolist() + plain_tokens[r.rid] for r in reqs}
    width = max(map(len, full.values())) + 8
    table = torch.zeros((len(full), width), dtype=torch.int64)
    index = {}
    for i, (prompt, ref) in enumerate(full.items()):
        table[i, :len(ref)] = torch.tensor(ref)
        index[prompt] = i
    table = table.to(device)

    def hook(seqs: list, at: torch.Tensor, k: int) -> torch.Tensor:
        rows = torch.tensor([index[tuple(s.buffer[:s.num_prompt_tokens].tolist())] for s in seqs], device=device)
        pos = (at[:, None] + 2 + torch.arange(k, device=device)[None, :]).clamp(max=width - 1)
        drafts = table[rows[:, None], pos]
        return torch.where(pos % 3 == 0, (drafts + 1) % VOCAB, drafts) if corrupt else drafts
    return hook


def oracle(plain_tokens: dict, corrupt: bool, reqs: list[TokenizedRequest] | None = None):
    """A draft hook giving the tokens plain decoding produced next (every third step one of them is wrong)."""
    full = {tuple(r.prompt_ids.tolist()): r.prompt_ids.tolist() + plain_tokens[r.rid] for r in reqs or requests()}

    def hook(tokens: np.ndarray, n: int, drafts: Callable[[], list[int]]) -> list[int]:
        seq = tokens.tolist()
        ref = next(f for p, f in full.items() if seq[:len(p)] == list(p))
        want = ref[len(seq):len(seq) + n]
        out = want + (drafts()[len(want):] if len(want) < n else [])  # the model's own past plain decoding's end
        if corrupt and len(seq) % 3 == 0:
            j = (len(seq) // 3) % len(out)
            out[j] = (out[j] + 1) % VOCAB
        return out
    return hook


def check_all_accepted(rows: list[tuple[str, int, int]], want_tokens: dict) -> None:
    """Every verify row at forced acceptance yields its drafts plus one token, except the stop-token request's last:
    past its stop token the oracle has no tokens left to hand, so its last drafts are the model's own, rejected (with
    three drafts the stop token falls inside such a row)."""
    assert rows
    short = [(i, rid) for i, (rid, k, n) in enumerate(rows) if n != k + 1]
    last = {rid: i for i, (rid, _, _) in enumerate(rows)}
    for i, rid in short:
        assert want_tokens[rid][-1] == STOP_TOKEN and last[rid] == i, rows[i]


def check_same(got: tuple[dict, dict], want: tuple[dict, dict]) -> None:
    assert got[0].keys() == want[0].keys()
    for rid, tokens in want[0].items():  # (the first token that differs, if one does)
        at = next((i for i, (a, b) in enumerate(zip(got[0][rid], tokens)) if a != b),
                  min(len(tokens), len(got[0][rid])))
        assert got[0][rid] == tokens, (rid, at, got[0][rid][at:at + 3], tokens[at:at + 3])
    assert got[1].keys() == want[1].keys()
    for rid in want[1]:
        np.testing.assert_allclose(got[1][rid], want[1][rid], rtol=1e-4, atol=1e-5)


def plain_decoding(model_dir: Path, reqs: list[TokenizedRequest] | None = None) -> tuple[dict, dict]:
    """(tokens, logprobs) of every request (requests() unless reqs) without speculation."""
    tokens, logprobs, _, verified = run(make_runner(model_dir, None), reqs=reqs)
    assert not verified
    return tokens, logprobs


def only(plain: tuple[dict, dict], reqs: list[TokenizedRequest]) -> tuple[dict, dict]:
    """Plain decoding's (tokens, logprobs) of `reqs` only."""
    rids = {r.rid for r in reqs}
    return tuple({rid: v for rid, v in d.items() if rid in rids} for d in plain[:2])


def check_speculation_follows_plain(runner: ModelRunner, plain: tuple[dict, dict], num_spec: int,
                                    reqs: list[TokenizedRequest] | None = None) -> None:
    """With the oracle's drafts (plain decoding's tokens, some wrong) the speculating runner gives plain decoding's
    tokens, seeded samples and logprobs, with none, some and all of a step's drafts accepted. reqs: requests()
    unless given (plain may hold more)."""
    runner.spec.draft_hook = oracle(plain[0], corrupt=True, reqs=reqs)
    tokens, logprobs, sched, verified = run(runner, reqs=reqs)
    check_same((tokens, logprobs), plain if reqs is None else only(plain, reqs))
    assert 0 < sched.spec_accepted_tokens < sched.spec_draft_tokens
    assert {n for _, n in verified} == set(range(1, num_spec + 2))


def ahead_requests(n: int = 7) -> list[TokenizedRequest]:
    """Greedy requests (seven: one more than the six running places, so the seventh waits for the first to end), one
    with logprobs, one with a stop token, long enough for steps planned ahead."""
    rng = np.random.default_rng(8)
    kinds = [SamplingParams(max_tokens=28, temperature=0, ignore_eos=True),
             SamplingParams(max_tokens=19, temperature=0, logprobs=2, ignore_eos=True),
             SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[STOP_TOKEN]),
             SamplingParams(max_tokens=33, temperature=0, ignore_eos=True)]
    lengths = [5, 23, 2, 14, 9, 30, 7][:n]
    return [TokenizedRequest(rid=f"a{i}", prompt_ids=rng.integers(4, VOCAB, m).astype(np.int32), eos_token_ids=[2],
                             sampling=kinds[i % len(kinds)]) for i, m in enumerate(lengths)]


def check_steps_planned_ahead(model_dir: Path, num_spec: int, device: str, reqs: list[TokenizedRequest] | None = None,
                              plain: tuple[dict, dict] | None = None,
                              prepare: Callable[[ModelRunner], None] | None = None) -> None:
    """The scheduler plans the next uniform step while one is in flight, as if it accepted every draft; the runner
    launches it before the host knows what was accepted, its positions, slots, lengths and inputs corrected on the
    device. Forced drafts (plain decoding's tokens, every third position wrong) on the device: plain decoding's
    tokens and logprobs, with none, some and all of a chained step's drafts accepted. reqs: ahead_requests() unless
    given, with plain decoding's (tokens, logprobs) of them (run here unless given); prepare: called on each runner
    this makes before it runs."""
    reqs = reqs or ahead_requests()
    runner = make_runner(model_dir, num_spec, device=device)
    if plain is None:
        plain_runner = make_runner(model_dir, None, device=device)
        if prepare is not None:
            prepare(plain_runner)
        plain = run(plain_runner, reqs=reqs)
    rids = {r.rid for r in reqs}
    want = tuple({rid: v for rid, v in d.items() if rid in rids} for d in plain[:2])
    if prepare is not None:
        prepare(runner)
    if device == "cpu":
        attach_step_graphs(runner)
    runner.spec.defer = True  # (a CUDA runner takes steps ahead by itself with one draft only)
    counts = count_step_graphs(runner.spec.graphs)
    runner.spec.device_draft_hook = device_oracle(want[0], reqs, runner.device)
    tokens, logprobs, sched, verified = run_ahead(runner, reqs)
    check_same((tokens, logprobs), want)
    assert counts["chained"] >= 3, counts
    assert {n for _, n in verified} == set(range(1, num_spec + 2))
    assert 0 < sched.spec_accepted_tokens < sched.spec_draft_tokens


# ---- speculating-step graphs (actors/spec_graphs.py) on a CPU or a GPU ----------------------------------------


def count_step_graphs(g: SpecGraphs) -> dict[str, int]:
    """Counts of the passes a runner's SpecGraphs run (verify steps, padded ones, draft chains), filled in as the
    runner steps."""
    counts = {"verify": 0, "draft": 0, "padded": 0, "drafts_on_device": 0, "chained": 0}
    verify, draft = g.verify, g.draft

    def counted_verify(ids, cached, tables, drafts=None, state_slots=None):
        counts["verify"] += 1
        counts["padded"] += g.padded_size(len(cached)) > len(cached)
        counts["drafts_on_device"] += drafts is not None
        counts["chained"] += drafts is not None and drafts[3]
        return verify(ids, cached, tables, drafts, state_slots)

    def counted_draft(*args):
        counts["draft"] += 1
        return draft(*args)

    g.verify, g.draft = counted_verify, counted_draft
    return counts


def attach_step_graphs(runner: ModelRunner) -> SpecGraphs:
    """Give a CPU runner the speculating-step graphs: on a CPU they rerun their passes eagerly over the same static
    buffers and tables the CUDA graphs read."""
    spec = runner.spec
    hybrid = runner.num_state_slots > 0
    spec.graphs = SpecGraphs(runner.model, runner.kv_caches, runner.block_size, runner.num_blocks, max_batch=6,
                             max_blocks_per_seq=256 // runner.block_size,
                             num_speculative_tokens=spec.num_speculative_tokens, device=runner.device,
                             history_base=runner.num_state_slots + runner.num_state_snapshots if hybrid else None)
    return spec.graphs


def check_step_graphs(model_dir: Path, num_spec: int, device: str, plain_tokens: tuple,
                      prepare: Callable[[ModelRunner], None] | None = None,
                      reqs: list[TokenizedRequest] | None = None) -> None:
    """Speculation with the step graphs against speculation without, on the same requests and drafts: the tokens
    and logprobs of plain decoding, the MTP layer's own drafts at every step, and the same KV cache (and a hybrid
    model's recurrent-state pools) afterwards. prepare: called on each runner before it runs; reqs: requests() but
    the penalised ones unless given (plain_tokens may hold more)."""
    penalised = ("r4", "r10")  # they get no drafts, so every step they are in runs eager
    drop = penalised if reqs is None else ()
    want = only(plain_tokens, reqs or [r for r in requests() if r.rid not in penalised])
    drafted: list[dict] = []
    caches: list[list[torch.Tensor]] = []
    for graphs in (False, True):
        runner = make_runner(model_dir, num_spec, device=device, enforce_eager=not graphs)
        if prepare is not None:
            prepare(runner)
        if graphs and device == "cpu":
            attach_step_graphs(runner)
        assert (runner.spec.graphs is not None) == graphs
        counts = count_step_graphs(runner.spec.graphs) if graphs else {}
        hook, seen = oracle(plain_tokens[0], corrupt=True, reqs=reqs), {}
        drafted.append(seen)

        def record(tokens: np.ndarray, n: int, drafts: Callable[[], list[int]], hook=hook, seen=seen) -> list[int]:
            own = seen[tuple(tokens.tolist())] = drafts()  # the MTP layer's own drafts, before the oracle's
            assert len(own) == n
            return hook(tokens, n, drafts)

        runner.spec.draft_hook = record
        rows: list[tuple[str, int, int]] = []
        tokens, logprobs, sched, verified = run(runner, budget=64, rows=rows, drop=drop, reqs=reqs)
        check_same((tokens, logprobs), want)
        caches.append([c[:runner.num_blocks] for c in runner.kv_caches] + runner.state_pools)  # (no scratch block)
    assert drafted[0] == drafted[1] and len(drafted[0]) > 20  # the graphs' MTP passes draft what eager ones do
    for eager, graphed in zip(*caches):  # and every pass wrote the same latents in the same slots
        torch.testing.assert_close(graphed, eager, rtol=1e-4, atol=1e-5)
    # (with 3 drafts few steps are uniform: the short requests get fewer drafts near their max_tokens)
    assert counts["verify"] >= (6 if num_spec == 1 else 2) and counts["draft"] > 0
    assert counts["padded"] > 0 or num_spec == 3
    assert {n for _, n in verified} == set(range(1, num_spec + 2))
    assert sched.spec_draft_tokens - sched.spec_accepted_tokens == sum(k + 1 - n for _, k, n in rows)
