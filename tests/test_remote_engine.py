"""RemoteEngine (server/remote_engine.py), the front end's handle on another node's engine, over real ZeroMQ TCP
sockets: a request goes to that engine's tokenizer with this front end's reply inbox in it, and a stream the client
leaves early (an HTTP client that disconnects) is aborted there, since no other front end would ever read it. A
stream that ended, or whose engine died, sends nothing more.
"""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from flotilla.sampling_params import SamplingParams
from flotilla.server.engine_client import EngineDeadError
from flotilla.server.remote_engine import RemoteEngine
from flotilla.transport.codec import Decoder
from flotilla.transport.endpoints import free_tcp_port
from flotilla.transport.messages import AbortCmd, GenerateRequest, SeqText
from flotilla.transport.registry import EngineInfo

REPLY_TO = "tcp://127.0.0.1:1"  # never connected to here: the engine side of these tests is a bare socket


async def _tokenizer_and_engine():
    """A PULL socket standing in for the other node's tokenizer, and a RemoteEngine pointed at it."""
    ctx = zmq.asyncio.Context()
    inbox = ctx.socket(zmq.PULL)
    address = f"tcp://127.0.0.1:{free_tcp_port()}"
    inbox.bind(address)
    info = EngineInfo(engine_id="n2-engine-0", role="both", model="m", addresses={"tokenizer/0": address},
                      kv_capacity_tokens=1024)  # fmt: skip
    return ctx, inbox, RemoteEngine(info, ctx, REPLY_TO)


async def _next(inbox, decoder: Decoder):
    return decoder.decode(await asyncio.wait_for(inbox.recv_multipart(), timeout=10))


def _request(rid: str) -> GenerateRequest:
    return GenerateRequest(rid=rid, sampling=SamplingParams(max_tokens=50), prompt="hi", dp_rank=0)


@pytest.mark.parametrize("how", ["left early", "ended", "engine died"])
def test_a_stream_left_early_is_aborted_on_the_other_nodes_engine(how: str) -> None:
    async def main() -> None:
        ctx, inbox, engine = await _tokenizer_and_engine()
        decoder = Decoder()
        try:
            stream = engine.stream(_request("r1"))
            first = asyncio.ensure_future(stream.__anext__())
            sent = await _next(inbox, decoder)
            assert isinstance(sent, GenerateRequest) and sent.rid == "r1"
            assert sent.reply_to == REPLY_TO and sent.dp_rank == -1  # the other node's tokenizer picks the rank
            engine._pending["r1"].put_nowait(SeqText(rid="r1", text="a", token_ids=[5]))  # as the reply inbox would
            assert (await first).text == "a"
            if how == "ended":
                engine._pending["r1"].put_nowait(SeqText(rid="r1", text="b", token_ids=[6], finish_reason="length"))
                assert [d.text async for d in stream] == ["b"]
            elif how == "engine died":
                engine.died("engine n2-engine-0 left the registry")
                with pytest.raises(EngineDeadError, match="left the registry"):
                    await stream.__anext__()
            await stream.aclose()  # the HTTP handler's generator closing: a disconnected client
            assert engine.num_pending == 0
            if how == "left early":
                abort = await _next(inbox, decoder)
                assert isinstance(abort, AbortCmd) and abort.rid == "r1" and abort.dp_rank == -1
            else:  # nothing went out: a marker sent on the same socket afterwards is the next message
                await engine.to_tokenizer.send(AbortCmd(rid="marker"))
                assert (await _next(inbox, decoder)).rid == "marker"
        finally:
            engine.close()
            inbox.close(linger=0)
            ctx.term()

    asyncio.run(main())
