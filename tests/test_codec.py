"""Codec: every message round-trips (hypothesis), arrays travel zero-copy, bad frames are refused."""

from __future__ import annotations

import types
import typing

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flotilla.sampling_params import SamplingParams
from flotilla.transport import messages as m
from flotilla.transport.codec import INLINE_THRESHOLD, Decoder, DecodeError, Encoder, format_message, message_from_dict

_json = st.recursive(st.none() | st.booleans() | st.integers(-2**53, 2**53) | st.text(max_size=8),
                     lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
                     max_leaves=6)
_arrays = st.sampled_from([np.int32, np.int64, np.float32, np.uint8, np.float64]).flatmap(
    lambda dt: st.integers(0, 3 * INLINE_THRESHOLD // np.dtype(dt).itemsize).flatmap(
        lambda n: st.lists(st.integers(0, 100), min_size=n, max_size=n).map(lambda xs: np.asarray(xs, dtype=dt))))
_sampling = st.builds(SamplingParams, n=st.integers(1, 4), temperature=st.floats(0, 2), top_p=st.floats(0.01, 1),
                      top_k=st.integers(-1, 100), seed=st.none() | st.integers(0, 2**31),
                      max_tokens=st.none() | st.integers(1, 4096), stop=st.lists(st.text(min_size=1, max_size=4), max_size=2),
                      stop_token_ids=st.lists(st.integers(0, 10**5), max_size=3), logprobs=st.none() | st.integers(0, 20))


def _strategy(tp: typing.Any) -> st.SearchStrategy:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is np.ndarray:
        return _arrays
    if tp is SamplingParams:
        return _sampling
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct):  # messages and the structs inside them
        return _message(tp)
    if origin in (typing.Union, types.UnionType):
        return st.one_of([_strategy(a) for a in args])
    if origin is list:
        return st.lists(_strategy(args[0]), max_size=3)
    if origin is tuple:  # (fixed length: msgspec decodes a tuple field back to a tuple)
        return st.tuples(*[_strategy(a) for a in args])
    if origin is dict:
        return st.dictionaries(st.text(max_size=6), _strategy(args[1]) if args[1] is not typing.Any else _json, max_size=3)
    return {int: st.integers(-2**63, 2**63 - 1), float: st.floats(allow_nan=False), str: st.text(max_size=12),
            bytes: st.binary(max_size=24), bool: st.booleans(), type(None): st.none(), typing.Any: _json}[tp]


def _message(cls: type[m.Message]) -> st.SearchStrategy:
    hints = typing.get_type_hints(cls)  # (in its own module: the data plane's structs live apart)
    fields = msgspec.structs.fields(cls)
    return st.builds(cls, **{f.name: _strategy(hints[f.name]) for f in fields})


def _same(a: typing.Any, b: typing.Any) -> bool:
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    if isinstance(a, msgspec.Struct):
        return type(a) is type(b) and all(_same(getattr(a, f), getattr(b, f)) for f in a.__struct_fields__)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b and type(a) is type(b)


@pytest.mark.parametrize("cls", m.ALL_MESSAGES, ids=lambda c: c.__name__)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_every_message_round_trips(cls, data):
    msg = data.draw(_message(cls))
    frames = Encoder().encode(msg)
    for decoder in (Decoder(), Decoder([cls])):
        back = decoder.decode([bytes(memoryview(f).cast("B")) for f in frames])
        assert _same(msg, back), (msg, back)


def test_large_arrays_travel_as_extra_frames_and_decode_without_copy():
    ids = np.arange(10_000, dtype=np.int32)
    msg = m.TokenizedRequest(rid="r", prompt_ids=ids, sampling=SamplingParams())
    frames = Encoder().encode(msg)
    assert len(frames) == 2 and memoryview(frames[1]).nbytes == ids.nbytes
    buf = bytearray(memoryview(frames[1]).cast("B"))
    back = Decoder([m.TokenizedRequest]).decode([frames[0], buf])
    assert np.array_equal(back.prompt_ids, ids)
    buf[0] = 99  # the decoded array is a view over the received frame, not a copy
    assert back.prompt_ids[0] == 99


def test_small_arrays_stay_inline():
    frames = Encoder().encode(m.StepResult(step=1, rids=["a"], token_ids=np.array([7], np.int32)))
    assert len(frames) == 1


@pytest.mark.parametrize("frames", [
    [],
    [b"\xc1garbage"],
    [msgspec.msgpack.encode(["NoSuchMessage", 1])],
    [msgspec.msgpack.encode(["PingRequest", "not-an-int"])],
    [msgspec.msgpack.encode(["PingRequest", 1, 0, msgspec.msgpack.Ext(1, msgspec.msgpack.encode((3, "<i4", [2])))])],
    [msgspec.msgpack.encode(["PingRequest", 1, 0, msgspec.msgpack.Ext(2, msgspec.msgpack.encode(("|O", [1], b"x")))])],
    [msgspec.msgpack.encode(["PingRequest", 1, 0, msgspec.msgpack.Ext(9, b"")])],
])
def test_malformed_frames_raise_decode_error(frames):
    with pytest.raises(DecodeError):
        Decoder().decode(frames)


def test_channel_decoder_refuses_messages_of_other_channels():
    frames = Encoder().encode(m.AbortCmd(rid="x"))
    with pytest.raises(DecodeError):
        Decoder([m.StepPlan, m.StopCmd]).decode(frames)


def test_non_numeric_arrays_and_foreign_objects_cannot_be_sent():
    with pytest.raises(TypeError):
        Encoder().encode(m.PingRequest(seq=1, payload=np.array(["a"], dtype=object)))
    with pytest.raises(TypeError):
        Encoder().encode(m.ReadyEvent(actor="a", instance=0, pid=1, host="h", address="x", detail={"k": object()}))


def test_trace_format_is_readable_and_summarises_arrays():
    line = format_message(m.PingRequest(seq=3, payload=np.arange(100, dtype=np.int32)))
    assert line.startswith("PingRequest{") and '"seq":3' in line and "int32[100]" in line and "...+84" in line


def test_message_from_dict_builds_nested_messages_and_validates():
    plan = message_from_dict({"type": "StepPlan", "step": 2, "rids": ["a"], "num_new_tokens": [4],
                              "new_seqs": [{"rid": "a", "token_ids": [1, 2, 3, 4], "num_computed_tokens": 0,
                                            "block_ids": [5], "sampling": {"temperature": 0}}]})
    assert plan.new_seqs[0].token_ids.dtype == np.int32 and plan.new_seqs[0].sampling.temperature == 0
    with pytest.raises(ValueError, match="unknown message type"):
        message_from_dict({"type": "Nope"})
    with pytest.raises(ValueError, match="no field"):
        message_from_dict({"type": "AbortCmd", "rid": "a", "bogus": 1})
    with pytest.raises(ValueError, match="temperature"):
        message_from_dict({"type": "GenerateRequest", "rid": "a", "sampling": {"temperature": -1}})
