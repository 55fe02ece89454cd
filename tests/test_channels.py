"""Channels on real ZeroMQ sockets: rank-addressed ROUTER/DEALER, backpressure instead of drops."""

from __future__ import annotations

import asyncio
import socket

import pytest
import uvloop
import zmq

from flotilla.transport import endpoints as ep
from flotilla.transport.channels import ChannelOptions, Dealer, Inbox, Outbox, Router, new_context, rank_identity
from flotilla.transport.messages import AbortCmd, PingRequest, PongResult


def test_router_reaches_each_dealer_by_rank_and_hears_back_with_identities():
    async def main():
        ctx = new_context()
        router = Router(ctx, "inproc://router", (PongResult,))
        dealers = [Dealer(ctx, "inproc://router", rank_identity(r), (PingRequest,)) for r in range(2)]
        for d in dealers:  # a DEALER announces its identity by sending first
            await d.send(PongResult(seq=-1))
        assert sorted([(await router.recv())[0] for _ in dealers]) == [rank_identity(0), rank_identity(1)]
        for r in (1, 0):
            await router.send(rank_identity(r), PingRequest(seq=r))
        got = [await asyncio.wait_for(d.recv(), 5) for d in dealers]
        assert [m.seq for m in got] == [0, 1]
        await dealers[1].sock.send_multipart([b"\xc1junk"])  # malformed: dropped, then the next one arrives
        await dealers[1].send(PongResult(seq=7, echoed_by="rank-1"))
        ident, msg = await router.recv()
        assert (ident, msg.seq, router.dropped) == (rank_identity(1), 7, 1)
        with pytest.raises(zmq.ZMQError):  # ROUTER_MANDATORY: a wrong rank is an error, not a silent drop
            await router.send(rank_identity(5), PingRequest(seq=0))
        for s in (router, *dealers):
            s.close()
        ctx.term()

    uvloop.run(main())


def test_a_full_peer_makes_senders_wait_rather_than_lose_messages():
    async def main():
        ctx = new_context()
        small = ChannelOptions(send_hwm=4, recv_hwm=4, linger_ms=0)
        inbox = Inbox(ctx, "inproc://slow", (AbortCmd,), small)
        out = Outbox(ctx, "inproc://slow", small)
        sent = 0
        while out.send_nowait(AbortCmd(rid=str(sent))):  # nobody reads: the queues fill up
            sent += 1
            assert sent < 1000
        assert sent >= 4
        pending = asyncio.ensure_future(out.send(AbortCmd(rid=str(sent))))
        await asyncio.sleep(0.05)
        assert not pending.done()  # send awaits instead of dropping
        later = asyncio.ensure_future(out.send(AbortCmd(rid=str(sent + 1))))
        await asyncio.sleep(0)  # (it starts, and waits behind the first)
        assert out.send_nowait(AbortCmd(rid=str(sent + 2)))  # queued behind the waiting sends, never ahead
        got = [(await inbox.recv()).rid for _ in range(sent + 3)]
        await asyncio.wait_for(asyncio.gather(pending, later), 5)
        assert got == [str(i) for i in range(sent + 3)]  # every message, in order
        assert out.send_nowait(AbortCmd(rid="after"))  # nothing waits now: it goes out at once
        assert (await inbox.recv()).rid == "after"
        inbox.close()
        out.close()
        ctx.term()

    uvloop.run(main())


def test_a_message_whose_wake_up_was_consumed_is_still_received():
    """ZeroMQ's notification descriptor is edge-triggered: a read of the socket's events outside zmq.asyncio (as the
    plain socket's reads do) consumes the edge that a waiting receive needs. The receive must find the message
    anyway, not wait for the next one."""
    async def main():
        ctx = new_context()
        inbox = Inbox(ctx, "inproc://edge", (AbortCmd,))
        out = Outbox(ctx, "inproc://edge")
        waiting = asyncio.ensure_future(inbox.recv())
        await asyncio.sleep(0.05)  # the receive is waiting on the descriptor
        assert out.send_nowait(AbortCmd(rid="only"))
        assert inbox._plain_sock.getsockopt(zmq.EVENTS) & zmq.POLLIN  # the edge is consumed here
        assert (await asyncio.wait_for(waiting, 5)).rid == "only"
        inbox.close()
        out.close()
        ctx.term()

    uvloop.run(main())


def test_bench_transports_send_recv_rows_time_both_paths():
    from flotilla.scripts.dev import bench_transport

    rows = uvloop.run(bench_transport._send_recv_costs(50, reps=3))
    assert [r["message"] for r in rows] == ["StepResult, 1 token", "StepPlan, 256 sequences"]
    assert all(r["channels_us"] > 0 and r["zmq_asyncio_us"] > 0 for r in rows)


def test_free_ports_are_picked_below_the_ephemeral_range_where_no_outgoing_connection_takes_them():
    high = ep._ephemeral_start()
    for n in (1, 3):
        base = ep.free_port_block(n)
        assert ep.FIRST_FREE_PORT <= base and base + n <= high, (base, high)
        socks = [socket.socket() for _ in range(n)]
        try:
            for s, port in zip(socks, range(base, base + n)):
                s.bind(("127.0.0.1", port))  # each of them free, as promised
        finally:
            for s in socks:
                s.close()
