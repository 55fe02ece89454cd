"""Actor runtime with real sockets and processes: placements, liveness, failures, malformed input."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import numpy as np
import pytest
import uvloop

from flotilla.actors.base import Actor, RuntimeOptions, handler_name
from flotilla.actors.runtime import ActorFailure, Runtime
from flotilla.actors.topology import ActorSpec, Topology
from flotilla.transport import endpoints as ep
from flotilla.transport.channels import Inbox, Outbox, end_context, new_context, raw_push
from flotilla.transport.messages import PingRequest, PongResult, StepResult
from helpers_procs import alive

FAST = RuntimeOptions(heartbeat_interval_s=0.1, heartbeat_timeout_s=2.0, ready_timeout_s=60.0, stop_grace_s=5.0)


def pingpong(placement: str, transport: str | None = None, relay_peer: str = "echo") -> Topology:
    return Topology(name="pp", placement=placement, transport=transport, options=FAST, actors=[
        ActorSpec(name="relay", kind="relay", config={"peer": relay_peer}),
        ActorSpec(name="echo", kind="echo", count=2),
    ])


class Client:
    """A client outside the topology: sends pings to the relay, collects pongs on its own inbox."""

    def __init__(self, rt: Runtime) -> None:
        self.zmq = rt.zmq if rt.topo.placement == "inline" else new_context()
        scheme = rt.topo.scheme
        self.address = {"inproc": ep.inproc(rt.run_id, "client"), "ipc": ep.ipc(rt.run_dir, "client") if rt.run_dir else "",
                        "tcp": ep.tcp("127.0.0.1", ep.free_tcp_port())}[scheme]
        self.inbox = Inbox(self.zmq, self.address, (PongResult,))
        self.out = Outbox(self.zmq, rt.endpoints.of("relay"))

    async def round(self, n: int, timeout: float = 20.0) -> list[tuple[int, list[int], str]]:
        for i in range(n):
            await self.out.send(PingRequest(seq=i, payload=np.arange(i, i + 3 + 40 * (i % 3), dtype=np.int32),
                                            reply_to=self.address))
        got = [await asyncio.wait_for(self.inbox.recv(), timeout) for _ in range(n)]
        return sorted((p.seq, p.payload.tolist(), p.echoed_by) for p in got)

    def close(self, own_context: bool) -> None:
        self.inbox.close()
        self.out.close()
        if own_context:
            self.zmq.term()


async def _pingpong_results(topo: Topology) -> tuple[list, dict]:
    rt = Runtime(topo)
    await rt.start()
    client = Client(rt)
    try:
        results = await client.round(30)
        pids = {k: ev.pid for k, ev in rt.ready.items()}
    finally:
        client.close(own_context=topo.placement != "inline")
        await rt.stop()
    if topo.placement == "process":
        assert all(p.returncode == 0 for p in rt.procs.values()), {k: p.returncode for k, p in rt.procs.items()}
        assert not rt.run_dir.exists()
    return results, pids


def test_pingpong_gives_identical_results_in_every_placement():
    inline, pids_inline = uvloop.run(_pingpong_results(pingpong("inline")))
    ipc, pids_ipc = uvloop.run(_pingpong_results(pingpong("process", "ipc")))
    tcp, _ = uvloop.run(_pingpong_results(pingpong("process", "tcp")))
    assert len(inline) == 30
    # the relay adds one to every payload; two echoes answer in turn
    assert inline[5] == (5, list(range(6, 6 + 3 + 80)), "echo/1")
    assert inline == ipc == tcp
    assert set(pids_inline.values()) == {os.getpid()}
    assert len(set(pids_ipc.values())) == 3 and os.getpid() not in pids_ipc.values()
    assert not any(alive(p) for p in pids_ipc.values())


def test_heartbeats_arrive_and_malformed_frames_are_dropped_while_serving():
    async def main():
        rt = Runtime(pingpong("inline"))
        await rt.start()
        client = Client(rt)
        try:
            seen = dict(rt.supervisor.last_seen)
            await asyncio.sleep(0.5)
            assert all(rt.supervisor.last_seen[k] > seen[k] for k in seen), "heartbeats must keep coming"
            raw = raw_push(rt.zmq, rt.endpoints.of("echo", 0))
            for frames in ([b"\x00garbage"], [b"\x92\xa3Bad\x01"], [b""]):
                await raw.send_multipart(frames)
            # a message of a type the echo does not accept is refused by its channel decoder too
            await Outbox(rt.zmq, rt.endpoints.of("echo", 0)).send(StepResult(step=1))
            # a handler that raises (no reply_to) is logged; the actor keeps serving
            await Outbox(rt.zmq, rt.endpoints.of("echo", 0)).send(PingRequest(seq=99))
            assert len(await client.round(4)) == 4
            assert rt.actors["echo/0"].dropped_messages == 4
            raw.close()
        finally:
            client.close(own_context=False)
            await rt.stop()
        assert not rt.failed.done()

    uvloop.run(main())


def test_a_stall_of_the_supervising_loop_is_not_taken_for_silent_actors():
    """The supervising process blocked for longer than the heartbeat timeout (e.g. a slow synchronous load while
    the engine starts): the actors' heartbeats queued meanwhile are read before anyone is judged silent."""
    async def main():
        rt = Runtime(pingpong("process", "ipc"))
        await rt.start()
        try:
            time.sleep(FAST.heartbeat_timeout_s * 1.5)  # noqa: ASYNC251 (the stall is the point)
            await asyncio.sleep(FAST.heartbeat_timeout_s / 2)
            assert not rt.failed.done(), rt.failed.result()
        finally:
            await rt.stop("test")

    uvloop.run(main())


def test_a_send_to_a_peer_that_stopped_first_does_not_hold_up_the_stop():
    """A handler waits to send to a peer that has stopped (its inbox closed: nothing takes the message). The
    runtime's stop still ends the actor at once: the StopCmd behind the message being handled is read while the
    send waits (without it the actor would sit out the whole grace period, then be cancelled)."""
    async def main():
        topo = Topology(name="pp", placement="inline", options=FAST, actors=[
            ActorSpec(name="relay", kind="relay", config={"peer": "echo"}), ActorSpec(name="echo", kind="echo")])
        rt = Runtime(topo)
        await rt.start()
        relay, echo = rt.actors["relay/0"], rt.actors["echo/0"]
        client = Client(rt)
        assert len(await client.round(2)) == 2  # the relay's pipe to the echo is up
        echo.request_stop("test")
        deadline = time.monotonic() + 10
        while not echo._closed and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await client.out.send(PingRequest(seq=9, payload=np.arange(3, dtype=np.int32), reply_to=client.address))
        waiting = relay._outbox(rt.endpoints.of("echo"))
        while not waiting._waiting and time.monotonic() < deadline:  # the relay's handler waits: no echo takes it
            await asyncio.sleep(0.01)
        assert waiting._waiting
        client.close(own_context=False)
        t0 = time.monotonic()
        await rt.stop("test")
        took = time.monotonic() - t0
        assert took < FAST.stop_grace_s / 2, f"the stop took {took:.1f} s"

    uvloop.run(main())


@pytest.mark.parametrize("how", ["kill", "hang"])
def test_a_dead_or_hung_actor_process_is_detected_within_bounded_time(how):
    async def main():
        rt = Runtime(pingpong("process", "ipc"))
        await rt.start()
        victim = rt.ready["echo/1"].pid
        pids = [ev.pid for ev in rt.ready.values()]
        t0 = time.monotonic()
        os.kill(victim, signal.SIGKILL if how == "kill" else signal.SIGSTOP)
        try:
            failure = await asyncio.wait_for(rt.wait(), timeout=10)
            took = time.monotonic() - t0
        finally:
            await rt.stop("test")
        assert (failure.actor, failure.instance) == ("echo", 1)
        assert ("signal 9" in failure.reason) if how == "kill" else ("no heartbeat" in failure.reason)
        assert took < FAST.heartbeat_timeout_s + 5
        deadline = time.monotonic() + 10
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert not any(alive(p) for p in pids)

    uvloop.run(main())


@pytest.mark.parametrize("placement", ["inline", "process"])
def test_an_actor_that_fails_at_start_fails_the_start_and_stops_the_rest(placement):
    async def main():
        rt = Runtime(pingpong(placement, relay_peer="nobody"))
        with pytest.raises(ActorFailure, match="relay/0.*nobody"):
            await rt.start()
        if placement == "process":
            assert all(p.returncode is not None for p in rt.procs.values())
            assert not rt.run_dir.exists()
        else:
            assert all(t.done() for t in rt._tasks.values())

    uvloop.run(main())


def test_actor_classes_must_handle_every_message_they_accept():
    with pytest.raises(TypeError, match="on_pong_result"):
        class Broken(Actor):
            inbox = (PongResult,)
    assert handler_name(StepResult) == "on_step_result"


def grouped_pair(name: str) -> Topology:
    """A relay and an echo in one process group."""
    return Topology(name=name, placement="process", options=FAST, actors=[
        ActorSpec(name="relay", kind="relay", config={"peer": "echo"}, process="pair"),
        ActorSpec(name="echo", kind="echo", process="pair"),
    ])


def test_actors_of_one_process_group_share_a_process():
    async def main():
        rt = Runtime(grouped_pair("grp"))
        await rt.start()
        client = Client(rt)
        try:
            assert rt.ready["relay/0"].pid == rt.ready["echo/0"].pid != os.getpid()
            assert [r[2] for r in await client.round(4)] == ["echo/0"] * 4
            pid = rt.ready["echo/0"].pid
            os.kill(pid, signal.SIGKILL)  # the shared process dies: the topology fails as a whole
            failure = await asyncio.wait_for(rt.wait(), timeout=10)
            assert failure.actor in ("relay", "echo") and "signal 9" in failure.reason
        finally:
            client.close(own_context=True)
            await rt.stop()
        assert not alive(pid)

    uvloop.run(main())


def test_a_process_group_needs_matching_counts():
    with pytest.raises(ValueError, match="same count"):
        Topology(actors=[ActorSpec(name="a", kind="echo", process="g"),
                         ActorSpec(name="b", kind="echo", count=2, process="g")])


def test_a_process_group_stops_cleanly():
    async def main():
        rt = Runtime(grouped_pair("grp2"))
        await rt.start()
        await rt.stop()
        procs = set(rt.procs.values())
        assert len(procs) == 1 and all(p.returncode == 0 for p in procs)

    uvloop.run(main())


def test_answers_to_another_nodes_front_end_that_reads_nothing_are_dropped_not_waited_for():
    """Actor.reply to a request's reply_to (another node's front end, which may be gone without anyone telling the
    engine): it never blocks; past the send queue (SEND_HWM unread) answers are dropped and counted. Answers to the
    engine's own front end (reply_to None) go through the topology's `frontend` peer."""
    from flotilla.actors.base import ActorContext
    from flotilla.transport.channels import SEND_HWM
    from flotilla.transport.messages import AbortCmd

    class Replier(Actor):
        kind = "replier"

    async def main():
        ctx = new_context()
        frontend = Inbox(ctx, "inproc://frontend/0", (AbortCmd,))
        eps = ep.Endpoints(supervisor="inproc://sup", actors={"replier/0": "inproc://replier/0",
                                                             "frontend/0": "inproc://frontend/0"})
        actor = Replier(ActorContext(name="replier", endpoints=eps), ctx)
        gone = f"tcp://127.0.0.1:{ep.free_tcp_port()}"  # nobody listens there
        for i in range(SEND_HWM + 50):  # each one returns at once (wait_for would fail a blocked one)
            await asyncio.wait_for(actor.reply(gone, AbortCmd(rid=str(i))), 5)
        assert 1 <= actor.dropped_replies <= 50 + 2, actor.dropped_replies
        await actor.reply(None, AbortCmd(rid="own"))
        assert (await asyncio.wait_for(frontend.recv(), 5)).rid == "own"
        actor._close()
        frontend.close()
        ctx.term()

    uvloop.run(main())


def test_a_request_that_leaves_the_rank_to_the_engine_goes_to_the_data_parallel_ranks_in_turn(tmp_path):
    """dp_rank -1 (another node's front end, which does not hear the ranks' loads): the tokenizer of a DP2 engine
    gives such requests to its schedulers in turn; an AbortCmd with dp_rank -1 reaches every rank; a rank the
    front end chose is kept."""
    from flotilla.actors.base import ActorContext
    from flotilla.actors.tokenizer import TokenizerActor
    from flotilla.config import EngineConfig
    from flotilla.sampling_params import SamplingParams
    from flotilla.transport.messages import AbortCmd, GenerateRequest, TokenizedRequest
    from helpers_engine import write_tiny_engine_model

    model = write_tiny_engine_model(tmp_path / "m")
    engine = EngineConfig.from_options(model=str(model), data_parallel_size=2).to_dict()

    async def main():
        ctx = new_context()
        addrs = {f"scheduler/{r}": f"inproc://scheduler/{r}" for r in range(2)}
        ranks = [Inbox(ctx, addrs[f"scheduler/{r}"], (TokenizedRequest, AbortCmd)) for r in range(2)]
        eps = ep.Endpoints(supervisor="inproc://sup", actors={"tokenizer/0": "inproc://tokenizer/0", **addrs})
        tok = TokenizerActor(ActorContext(name="tokenizer", endpoints=eps, config={"engine": engine}), ctx)
        await tok.setup()
        sp = SamplingParams(max_tokens=2)
        for i, rank in enumerate([-1, -1, -1, 1]):
            await tok.on_generate_request(GenerateRequest(rid=f"r{i}", prompt_token_ids=np.array([5, 6], np.int32),
                                                          sampling=sp, dp_rank=rank))  # fmt: skip
        got = [[(await asyncio.wait_for(ranks[r].recv(), 5)).rid for _ in range(n)] for r, n in ((0, 2), (1, 2))]
        assert got == [["r0", "r2"], ["r1", "r3"]]
        await tok.on_abort_cmd(AbortCmd(rid="r0", dp_rank=-1))
        assert [(await asyncio.wait_for(ranks[r].recv(), 5)).rid for r in range(2)] == ["r0", "r0"]
        tok._close()
        for inbox in ranks:
            inbox.close()
        ctx.term()

    uvloop.run(main())


def test_the_detokenizer_stops_a_sequence_on_its_own_rank_and_sends_text_where_the_request_asked(tmp_path):
    """A stop string in a sequence of data-parallel rank 1: the AbortCmd goes to rank 1's scheduler (not rank
    0's, which does not know the sequence: rank 1 would compute on). A sequence whose first delta names a
    reply_to (another node's front end) has its text sent there; the others' go to the engine's front end."""
    from flotilla.actors.base import ActorContext
    from flotilla.actors.detokenizer import DetokenizerActor
    from flotilla.models.model_folder import load_tokenizer
    from flotilla.config import EngineConfig
    from flotilla.sampling_params import SamplingParams
    from flotilla.transport.messages import AbortCmd, SeqTokens, TextDelta, TokenDelta
    from helpers_engine import write_tiny_engine_model

    model = write_tiny_engine_model(tmp_path / "m")
    engine = EngineConfig.from_options(model=str(model), data_parallel_size=2).to_dict()
    ids = [40, 41, 42, 43]
    text = load_tokenizer(model).decode(ids)
    assert len(text.strip()) >= 2, text

    async def main():
        ctx = new_context()
        addrs = {f"scheduler/{r}": f"inproc://scheduler/{r}" for r in range(2)}
        addrs |= {"frontend/0": "inproc://frontend/0", "detokenizer/0": "inproc://detokenizer/0"}
        ranks = [Inbox(ctx, addrs[f"scheduler/{r}"], (AbortCmd,)) for r in range(2)]
        frontend = Inbox(ctx, addrs["frontend/0"], (TextDelta,))
        other_node = Inbox(ctx, "inproc://other-node", (TextDelta,))
        eps = ep.Endpoints(supervisor="inproc://sup", actors=addrs)
        detok = DetokenizerActor(ActorContext(name="detokenizer", endpoints=eps, config={"engine": engine}), ctx)
        await detok.setup()
        stop = SamplingParams(max_tokens=50, stop=[text.strip()[-2:]])
        plain = SamplingParams(max_tokens=50)
        await detok.on_token_delta(TokenDelta(dp_rank=1, items=[
            SeqTokens(rid="stops", token_ids=ids, sampling=stop, prompt_tail=[]),
            SeqTokens(rid="remote", token_ids=ids[:2], sampling=plain, prompt_tail=[], reply_to="inproc://other-node"),
            SeqTokens(rid="local", token_ids=ids[:2], sampling=plain, prompt_tail=[])]))
        abort = await asyncio.wait_for(ranks[1].recv(), 5)
        assert (abort.rid, abort.dp_rank) == ("stops", 1)
        here = await asyncio.wait_for(frontend.recv(), 5)
        assert sorted(i.rid for i in here.items) == ["local", "stops"]
        assert next(i for i in here.items if i.rid == "stops").finish_reason == "stop"
        there = await asyncio.wait_for(other_node.recv(), 5)
        assert [i.rid for i in there.items] == ["remote"]
        # later deltas of the remote sequence follow its first one's route, and its final delta ends the route
        await detok.on_token_delta(TokenDelta(dp_rank=1, items=[SeqTokens(rid="remote", token_ids=[44],
                                                                          finish_reason="length")]))
        assert [i.rid for i in (await asyncio.wait_for(other_node.recv(), 5)).items] == ["remote"]
        assert detok.routes == {}
        with pytest.raises(asyncio.TimeoutError):  # rank 0's scheduler heard nothing
            await asyncio.wait_for(ranks[0].recv(), 0.2)
        await detok.teardown()
        detok._close()
        for inbox in (*ranks, frontend, other_node):
            inbox.close()
        ctx.term()

    uvloop.run(main())


def test_the_token_that_stopped_a_sequence_is_not_text(tmp_path):
    """As in vLLM: the EOS or stop token that ends a sequence (the scheduler's finish_reason "stop") is left out of the
    text, also with skip_special_tokens off (which a tool-call format whose tags are special tokens asks for);
    include_stop_str_in_output keeps it, and a sequence cut by its length keeps its last token."""
    from flotilla.actors.base import ActorContext
    from flotilla.actors.detokenizer import DetokenizerActor
    from flotilla.config import EngineConfig
    from flotilla.models.model_folder import load_tokenizer
    from flotilla.sampling_params import SamplingParams
    from flotilla.transport.messages import SeqTokens
    from helpers_engine import write_tiny_engine_model

    model = write_tiny_engine_model(tmp_path / "m")
    tok = load_tokenizer(model)
    ids = [40, 41, tok.convert_tokens_to_ids("<|im_end|>")]
    keep = SamplingParams(skip_special_tokens=False)

    async def main():
        ctx = new_context()
        eps = ep.Endpoints(supervisor="inproc://sup", actors={"detokenizer/0": "inproc://detokenizer/0"})
        engine = EngineConfig.from_options(model=str(model)).to_dict()
        detok = DetokenizerActor(ActorContext(name="detokenizer", endpoints=eps, config={"engine": engine}), ctx)
        await detok.setup()
        for rid, sampling, finish, want in (
                ("eos", keep, "stop", ids[:2]),
                ("included", SamplingParams(skip_special_tokens=False, include_stop_str_in_output=True), "stop", ids),
                ("length", keep, "length", ids)):
            out = detok._text(SeqTokens(rid=rid, token_ids=ids, sampling=sampling, prompt_tail=[],
                                        finish_reason=finish), [])
            assert out.text == tok.decode(want, skip_special_tokens=False), rid
            assert out.token_ids == ids and out.num_output_tokens == 3
        assert "<|im_end|>" not in tok.decode(ids[:2], skip_special_tokens=False)
        await detok.teardown()
        detok._close()
        ctx.term()

    uvloop.run(main())


async def _watched_front_end(ctx, watch) -> tuple[str, Inbox, Outbox]:
    """A front end (an inbox at a free TCP address) and the outbox that sends to it, connected under `watch`, with
    one message through."""
    from flotilla.transport.messages import AbortCmd

    address = f"tcp://127.0.0.1:{ep.free_tcp_port()}"
    front_end = Inbox(ctx, address, (AbortCmd,))
    out = Outbox(ctx, address, connect=False)
    watch.watch(address, out.sock)
    out.sock.connect(address)
    await out.send(AbortCmd(rid="a"))
    assert (await asyncio.wait_for(front_end.recv(), 5)).rid == "a"
    return address, front_end, out


async def _bind_again(ctx, address: str) -> Inbox:
    """An inbox at the address a closed one held: ZeroMQ releases a closed socket's port from its I/O thread, a
    moment later, so an immediate bind may meet EADDRINUSE; retried for up to 5 s."""
    import zmq

    from flotilla.transport.messages import AbortCmd

    for _ in range(100):
        try:
            return Inbox(ctx, address, (AbortCmd,))
        except zmq.ZMQError as e:
            if e.errno != zmq.EADDRINUSE:
                raise
            await asyncio.sleep(0.05)
    return Inbox(ctx, address, (AbortCmd,))


def test_a_front_end_that_returns_within_the_grace_is_never_reported_gone():
    """A front end restarted at the same address before the grace ends: the watch sees the disconnect and then the
    reconnect (the monitor's events arrive in order, however late the task reads them), so nothing is aborted."""
    from flotilla.actors.front_end_watch import FrontEndWatch
    from flotilla.transport.messages import AbortCmd

    async def main():
        ctx = new_context()
        try:
            gone: list[str] = []

            async def on_gone(address: str) -> None:
                gone.append(address)

            watch = FrontEndWatch(on_gone, grace_s=2.0, connect_s=2.0)  # room for _bind_again's retries
            address, front_end, out = await _watched_front_end(ctx, watch)
            front_end.close()
            front_end = await _bind_again(ctx, address)  # back at once
            # a PUSH socket that has not yet noticed its peer's disconnect queues to the dead pipe, and ZeroMQ drops
            # that message with the pipe (under load the only one sent can be lost so): resend until one arrives over
            # the new connection
            for attempt in range(20):
                await out.send(AbortCmd(rid=f"b{attempt}"))
                try:
                    assert (await asyncio.wait_for(front_end.recv(), 0.5)).rid.startswith("b")
                    break
                except TimeoutError:
                    continue
            else:
                raise AssertionError("the front end bound again never received a message in 10 s")
            await asyncio.sleep(2.5)  # past the grace of the disconnect
            assert gone == [] and address not in watch.gone
            await watch.close()
            for s in (front_end, out):
                s.close()
        finally:
            end_context(ctx)  # (a failed run's sockets closed too: left to the collector, term() blocks in __del__)

    uvloop.run(main())


def test_a_front_end_that_stops_listening_is_reported_gone_after_the_grace_and_back_when_it_returns():
    """FrontEndWatch on real TCP sockets: a front end (an inbox) that closes is reported gone once the grace has
    passed; bound again at the same address it is back, and what was sent meanwhile arrives; an address nobody
    ever listened at is reported gone too."""
    from flotilla.actors.front_end_watch import FrontEndWatch
    from flotilla.transport.messages import AbortCmd

    async def main():
        ctx = new_context()
        gone: list[str] = []
        reported = asyncio.Event()

        async def on_gone(address: str) -> None:
            gone.append(address)
            reported.set()

        watch = FrontEndWatch(on_gone, grace_s=0.2, connect_s=0.2)
        address, front_end, out = await _watched_front_end(ctx, watch)
        await asyncio.sleep(0.4)  # connected: the grace passes without a report
        assert gone == []
        front_end.close()
        await asyncio.wait_for(reported.wait(), 10)
        assert gone == [address] and address in watch.gone
        await out.send(AbortCmd(rid="b"))  # queued for it
        front_end = await _bind_again(ctx, address)
        assert (await asyncio.wait_for(front_end.recv(), 10)).rid == "b"
        for _ in range(100):
            if address not in watch.gone:
                break
            await asyncio.sleep(0.05)
        assert address not in watch.gone
        reported.clear()
        nobody = f"tcp://127.0.0.1:{ep.free_tcp_port()}"
        out2 = Outbox(ctx, nobody, connect=False)
        watch.watch(nobody, out2.sock)
        out2.sock.connect(nobody)
        await asyncio.wait_for(reported.wait(), 10)
        assert gone == [address, nobody]
        await watch.close()
        for s in (front_end, out, out2):
            s.close()
        ctx.term()

    uvloop.run(main())


def test_ray_placement_without_ray_says_how_to_install_it(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "ray", None)  # (import ray fails as where it is not installed)
    with pytest.raises(RuntimeError, match=r"pip install 'flotilla\[ray\]'"):
        uvloop.run(Runtime(pingpong("ray")).start())


def test_a_stop_whose_caller_is_cancelled_still_tears_everything_down():
    """An engine's recovery task stopping its dead runtime may be cancelled by the front end's own stop: the teardown
    goes on, and the later stop() waits for it instead of returning at once with processes (or a Ray placement
    group) left behind."""
    async def main():
        rt = Runtime(pingpong("process", "ipc"))
        await rt.start()
        first = asyncio.create_task(rt.stop("engine failed"))
        await asyncio.sleep(0)
        first.cancel()
        await rt.stop("front end stopping")
        return rt

    rt = uvloop.run(main())
    assert rt.procs and all(p.returncode is not None for p in rt.procs.values())
    assert not rt.run_dir.exists()


def test_a_process_freezes_what_its_actors_built_once_every_one_is_ready():
    """actors/standalone.py: the collector stops scanning the setup's objects only after the last actor of the
    process is ready (a worker's model load would otherwise be scanned again at every full collection)."""
    import gc
    import types

    from flotilla.actors.standalone import freeze_when_ready

    async def run() -> list[int]:
        actors = [types.SimpleNamespace(ready=asyncio.Event()) for _ in range(2)]
        freezer = asyncio.create_task(freeze_when_ready(actors))
        seen = []
        for a in actors:
            await asyncio.sleep(0)
            seen.append(gc.get_freeze_count())
            a.ready.set()
        await freezer
        return [*seen, gc.get_freeze_count()]

    gc.unfreeze()
    try:
        before_first, before_second, after = uvloop.run(run())
        assert before_first == before_second == 0 and after > 0
    finally:
        gc.unfreeze()  # (the test process's objects go back to the collector)
