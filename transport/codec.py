"""Wire codec: msgpack for the message, numeric arrays as extra zero-copy frames. No pickle, ever.

A message becomes the frames ``[payload, buf_0, buf_1, ...]``. Inside the payload every numpy array
is a msgpack extension: either a reference ``(index, dtype, shape)`` to an extra frame (large arrays;
zero-copy on both sides) or, below ``inline_threshold`` bytes, the raw bytes inline (an extra frame
costs more than copying a few token ids). Each channel decodes with its own typed Decoder, so a
message that does not belong on a channel is a decode error, not a surprise in a handler.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Union

import msgspec
import numpy as np

from flotilla.transport.messages import ALL_MESSAGES, Message

_EXT_FRAME = 1  # array stored in an extra frame
_EXT_INLINE = 2  # array bytes stored inside the payload

INLINE_THRESHOLD = 256
"""Arrays smaller than this many bytes travel inside the payload."""

_ALLOWED_KINDS = frozenset("biuf")  # bool, signed, unsigned, float: numbers only, never objects


class DecodeError(ValueError):
    """A frame set that is not a valid message for this channel (logged and dropped by actors)."""


class Encoder:
    """Encodes messages into frames; one per sending socket (not thread-safe, not re-entrant)."""

    def __init__(self, inline_threshold: int = INLINE_THRESHOLD) -> None:
        self._inline_threshold = inline_threshold
        self._buffers: list[Any] = []
        self._encoder = msgspec.msgpack.Encoder(enc_hook=self._enc_hook)

    def encode(self, msg: Message) -> list[Any]:
        """Return ``[payload, *buffers]``; buffers are memoryviews over the arrays (no copy)."""
        self._buffers = buffers = []
        try:
            payload = self._encoder.encode(msg)
        finally:
            self._buffers = []
        return [payload, *buffers]

    def _enc_hook(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            if obj.dtype.kind not in _ALLOWED_KINDS:
                raise TypeError(f"only numeric arrays may travel, got dtype {obj.dtype}")
            arr = np.ascontiguousarray(obj)
            header = (arr.dtype.str, arr.shape)
            if arr.nbytes < self._inline_threshold:
                return msgspec.msgpack.Ext(_EXT_INLINE, msgspec.msgpack.encode((*header, arr.tobytes())))
            self._buffers.append(memoryview(arr).cast("B"))
            return msgspec.msgpack.Ext(_EXT_FRAME, msgspec.msgpack.encode((len(self._buffers) - 1, *header)))
        raise TypeError(f"cannot encode {type(obj).__name__} on the control plane")


class Decoder:
    """Decodes frames into one of a channel's message types; arrays are read-only zero-copy views."""

    def __init__(self, types: Sequence[type[Message]] = ALL_MESSAGES) -> None:
        self.types = tuple(types)
        union = self.types[0] if len(self.types) == 1 else Union[self.types]  # type: ignore[valid-type]
        self._frames: Sequence[Any] = ()
        self._decoder = msgspec.msgpack.Decoder(union, ext_hook=self._ext_hook, dec_hook=_dec_hook)

    def decode(self, frames: Sequence[Any]) -> Message:
        """Decode ``[payload, *buffers]`` (bytes, memoryviews or zmq Frames); raises DecodeError."""
        if not frames:
            raise DecodeError("empty message")
        self._frames = [_as_buffer(f) for f in frames]
        try:
            return self._decoder.decode(self._frames[0])
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError, IndexError) as e:
            raise DecodeError(str(e)) from e
        finally:
            self._frames = ()

    def _ext_hook(self, code: int, data: memoryview) -> np.ndarray:
        if code == _EXT_INLINE:
            dtype, shape, raw = msgspec.msgpack.decode(data)
            return _array(raw, dtype, shape)
        if code == _EXT_FRAME:
            index, dtype, shape = msgspec.msgpack.decode(data)
            if not 0 < index + 1 < len(self._frames):
                raise DecodeError(f"array refers to frame {index + 1} of {len(self._frames)}")
            return _array(self._frames[index + 1], dtype, shape)
        raise DecodeError(f"unknown msgpack extension code {code}")


def _array(buf: Any, dtype: str, shape: Sequence[int]) -> np.ndarray:
    dt = np.dtype(dtype)
    if dt.kind not in _ALLOWED_KINDS:
        raise DecodeError(f"refusing non-numeric array dtype {dtype}")
    return np.frombuffer(buf, dtype=dt).reshape(shape)


def _dec_hook(tp: type, obj: Any) -> Any:
    if tp is np.ndarray and isinstance(obj, np.ndarray):
        return obj
    raise TypeError(f"expected {tp.__name__}, got {type(obj).__name__}")


def _as_buffer(frame: Any) -> Any:
    # zmq.Frame exposes .buffer (a memoryview over ZeroMQ's own memory); bytes pass through.
    return getattr(frame, "buffer", frame)


def format_message(msg: Message, max_items: int = 16) -> str:
    """One readable line for --trace: arrays summarised, long lists cut."""
    return f"{type(msg).__name__}{msgspec.json.encode(_summarise(msg, max_items)).decode()}"


def _summarise(obj: Any, max_items: int) -> Any:
    if isinstance(obj, np.ndarray):
        flat = obj.reshape(-1)
        head = flat[:max_items].tolist()
        more = f"...+{flat.size - max_items}" if flat.size > max_items else ""
        return f"{obj.dtype}{list(obj.shape)}{head}{more}"
    if isinstance(obj, msgspec.Struct):
        return {f: _summarise(getattr(obj, f), max_items) for f in obj.__struct_fields__}
    if isinstance(obj, list):
        items = [_summarise(v, max_items) for v in obj[:max_items]]
        return items + ([f"...+{len(obj) - max_items}"] if len(obj) > max_items else [])
    if isinstance(obj, dict):
        return {str(k): _summarise(v, max_items) for k, v in obj.items()}
    return obj


def message_from_dict(obj: dict[str, Any]) -> Message:
    """Build a message from a readable dict ``{"type": "PingRequest", "seq": 1, ...}`` (scripts, tools).

    Arrays may be given as lists (ints become int32, floats float32). Validation is the messages' own.
    """
    by_name = {cls.__name__: cls for cls in ALL_MESSAGES}
    name = obj.get("type")
    if name not in by_name:
        raise ValueError(f"unknown message type {name!r}; known: {', '.join(sorted(by_name))}")
    return _build(by_name[name], obj)


def _build(cls: type[msgspec.Struct], obj: dict[str, Any]) -> Any:
    hints = {f.name: f.type for f in msgspec.structs.fields(cls)}
    unknown = set(obj) - set(hints) - {"type"}
    if unknown:
        raise ValueError(f"{cls.__name__} has no field(s) {', '.join(sorted(unknown))}")
    return cls(**{k: _value(hints[k], v) for k, v in obj.items() if k != "type"})


def _value(tp: Any, v: Any) -> Any:
    if v is None:
        return None
    args = getattr(tp, "__args__", ()) or ()
    candidates = [tp, *args]
    if np.ndarray in candidates and isinstance(v, list):
        arr = np.asarray(v)
        return arr.astype(np.int32 if arr.dtype.kind in "iu" else np.float32)
    structs = [c for c in candidates if isinstance(c, type) and issubclass(c, msgspec.Struct)]
    if structs and isinstance(v, dict):
        return _build(structs[0], v)
    if isinstance(v, list) and args and getattr(tp, "__origin__", None) is list:
        return [_value(args[0], x) for x in v]
    return msgspec.convert(v, tp)
