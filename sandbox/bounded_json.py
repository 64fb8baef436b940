"""Decoding JSON that an adversary wrote, bounded in size, shape and time (docs/reward-integrity.md, I4).

The policy being trained, a gateway client it drives and code in its sandbox all write JSON that the host
decodes: HTTP bodies of the rollout API and the gateway, tool-call arguments in generated text, the execution
server's answers. Decoded naively, a few hundred kilobytes stall the event loop for seconds: ``json.loads``
raises ``RecursionError`` (not ``ValueError``) on deep nesting; a megabyte of ``[[],[],...]`` is 300 000
lists and 50 ms (150 ms with the cyclic GC running) of C code holding the GIL, so a worker thread does not
help; a 4300-digit integer costs quadratic time to parse.

:func:`loads` / :func:`aloads` bound every decode before any object is built:

- **bytes**: the encoded size is at most ``JsonBounds.max_bytes``;
- **items**: a scan of the raw bytes (C-speed ``bytes`` methods over 64 KiB chunks; :func:`aloads` yields to
  the event loop after each chunk) counts the arrays, objects, strings and commas outside strings, an upper
  bound of the number of values and keys the decode would build, and refuses more than ``max_items``;
- **numbers**: a run of more than :data:`MAX_NUMBER_DIGITS` digits outside strings is refused (parse cost);
- **depth**: the decoder is pydantic-core's (jiter, Rust, iterative), which refuses nesting past
  :data:`MAX_DEPTH` as invalid JSON instead of raising ``RecursionError``; ``NaN``/``Infinity`` are refused
  (not JSON, RFC 8259); the cyclic GC is paused while the decoded objects are built.

What is left on the thread that decodes is linear in what the bounds allow (measured on this repository's
2-core machine: ~0.9 ms per MB of strings, ~50 ns per item); :data:`sandbox.protocol` lines and HTTP bodies
set their bounds so that this stays a few milliseconds. Integers that become token ids or dictionary keys
are range-checked where they are read (``prorl_server.types.MAX_TOKEN_ID``): Python hashes an int ``n`` as
``n mod (2**61 - 1)``, so unbounded ints collide in a set or dict by construction.

This module is in :mod:`sandbox`, the lowest layer, because the sandbox client needs it and that layer imports
nothing of the project; the server's HTTP routes, gateway and tool parser use it too. Host side only: the
execution server inside the sandbox never imports it (it would pay for pydantic-core at every start).
"""
from __future__ import annotations

import asyncio
import gc
from dataclasses import dataclass
from typing import Any, Iterator, Union

from pydantic_core import from_json

#: Deepest nesting of arrays and objects a decode accepts: pydantic-core's JSON parser (jiter) stops at its
#: recursion limit (201 levels accepted, 202 refused as invalid JSON), far above what a tool schema, a
#: message list or a tool call's arguments need and far below Python's own recursion limit, so code that
#: walks a decoded value recursively (``json.dumps``, ``copy.deepcopy``, pydantic) is safe.
MAX_DEPTH = 200
#: Longest run of digits outside strings, in digits: 100 covers every float and int64 with room to spare,
#: while CPython parses an n-digit int in O(n**2) time (a 4300-digit one, its limit, takes ~20 us: a body
#: of them, milliseconds).
MAX_NUMBER_DIGITS = 100
#: Bytes scanned between two yields to the event loop by :func:`aloads` (one chunk costs < 1 ms).
SCAN_CHUNK_BYTES = 64 * 1024

_DIGITS = b"0123456789"
#: Bytes the scan drops once escapes are paired: all but quotes, ``[``, ``{``, commas and digits (a number's
#: sign, point and exponent go too, so its digit runs join: only longer, never shorter).
_NOT_COUNTED = bytes(b for b in range(256) if b not in b'"[{,' + _DIGITS)
#: Digits as ``0``, so that a too long run is a substring search (a regex tries every position).
_ZERO_DIGITS = bytes.maketrans(_DIGITS, b"0" * 10)
_LONG_NUMBER = b"0" * (MAX_NUMBER_DIGITS + 1)


class JsonBoundError(ValueError):
    """JSON refused by its bounds or as invalid. ``reason``: ``"too_large"`` (bytes), ``"too_many_items"``,
    ``"number_too_long"``, ``"too_deep"`` or ``"invalid"`` (not JSON, NaN/Infinity, lone surrogates...).
    ``message`` says which bound and by how much, for the client or model to read, phrased to follow the
    name of what was decoded: ``f"tool call {e}"`` reads "tool call is not valid JSON: ..."."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason, self.message = reason, message


@dataclass(frozen=True)
class JsonBounds:
    """Bounds of one kind of JSON document. ``max_bytes``: its encoded size (UTF-8 bytes). ``max_items``:
    arrays + objects + strings + commas outside strings (at least the number of values and keys, less one)."""

    max_bytes: int
    max_items: int


class _Scan:
    """The structure of a JSON text fed chunk by chunk, without building it: counts items, checks numbers.

    Escapes are paired left to right (``\\\\\\\\`` first, then ``\\\\"``), so the quotes left delimit strings
    exactly; a backslash ending a chunk escapes the next chunk's first byte. Multi-byte UTF-8 sequences hold
    no ASCII byte, so scanning bytes is exact. On invalid JSON the counts may be off past the first invalid
    byte, which is harmless: the decoder stops there without building what follows.
    """

    def __init__(self, bounds: JsonBounds) -> None:
        self.max_items = bounds.max_items
        self.quotes = 0
        self.structure = 0  # arrays, objects and commas outside strings
        self.in_string = False
        self.escaped = False  # the last chunk ended with a backslash escaping the next byte
        self.digits = 0  # the run of digits outside strings that ended the last chunk

    def feed(self, chunk: bytes) -> None:
        if self.in_string and not self.escaped and b'"' not in chunk and b"\\" not in chunk:
            return  # inside a long string (a file's base64): two memchr passes
        if self.escaped:
            chunk = b"_" + chunk[1:]
            self.escaped = False
        if b"\\" in chunk:
            chunk = chunk.replace(b"\\\\", b"__").replace(b'\\"', b"__")
            self.escaped = chunk.endswith(b"\\")
        chunk = chunk.translate(None, _NOT_COUNTED)  # what is left: quotes, brackets, commas, digits
        started_outside = not self.in_string
        quotes = chunk.count(b'"')
        self.quotes += quotes
        self._check()  # before split(): the strings alone may already be too many
        if quotes == 0:
            outside = chunk if started_outside else b""
        else:
            parts = chunk.split(b'"')
            outside = b"".join(parts[0::2] if started_outside else parts[1::2])
            self.in_string ^= quotes % 2 == 1
        if not outside:
            self.digits = 0
            return
        self.structure += outside.count(b"[") + outside.count(b"{") + outside.count(b",")
        head = len(outside) - len(outside.lstrip(_DIGITS)) if started_outside else 0
        if self.digits + head > MAX_NUMBER_DIGITS or _LONG_NUMBER in outside.translate(_ZERO_DIGITS):
            raise JsonBoundError("number_too_long", f"has a number of more than {MAX_NUMBER_DIGITS} digits")
        tail = len(outside) - len(outside.rstrip(_DIGITS)) if not self.in_string else 0
        self.digits = self.digits + tail if tail == len(outside) and started_outside else tail
        self._check()

    def _check(self) -> None:
        items = self.structure + self.quotes // 2
        if items > self.max_items:
            raise JsonBoundError("too_many_items", f"has more than {self.max_items} items (arrays, objects, "
                                 "strings and commas)")


def _encoded(data: Union[bytes, bytearray, str], bounds: JsonBounds) -> bytes:
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    if len(raw) > bounds.max_bytes:
        raise JsonBoundError("too_large", f"is {len(raw)} bytes, more than the limit of {bounds.max_bytes} bytes")
    return raw


def decode(raw: Union[bytes, str]) -> Any:
    """``raw`` decoded by pydantic-core's JSON parser, with the cyclic GC paused (3-5x faster on input dense
    in arrays and objects). Nesting deeper than :data:`MAX_DEPTH` and ``NaN``/``Infinity`` are refused; an
    overflowing exponent (``1e400``) reads as ``inf``, as with ``json.loads``. No size or item bound: for input
    the host trusts or has bounded; everything else goes through :func:`loads` / :func:`aloads`.

    Raises:
        JsonBoundError: ``too_deep`` or ``invalid``.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        return from_json(raw, allow_inf_nan=False)
    except ValueError as e:
        msg = str(e)
        if msg.startswith("recursion limit exceeded"):
            raise JsonBoundError("too_deep", f"is nested more than {MAX_DEPTH} levels deep") from None
        if msg.startswith("number out of range"):
            raise JsonBoundError("number_too_long", f"has a number too large to parse ({msg})") from None
        raise JsonBoundError("invalid", f"is not valid JSON: {msg}") from None
    finally:
        if enabled:
            gc.enable()


def scan(data: Union[bytes, bytearray, str], bounds: JsonBounds) -> bytes:
    """Check ``data`` against ``bounds`` without decoding it (bytes, items, numbers; depth is the decoder's);
    returns it as UTF-8 bytes. For a caller that decodes with its own parser (pydantic's
    ``model_validate_json``, the same jiter), after this check. ~1-4 ms per MB on the calling thread.

    Raises:
        JsonBoundError: too large, too many items, or too long a number.
    """
    raw = _encoded(data, bounds)
    for _ in _fed(raw, bounds):
        pass
    return raw


def _fed(raw: bytes, bounds: JsonBounds) -> Iterator[None]:
    """Feed ``raw`` to a scan chunk by chunk, yielding between chunks (where :func:`ascan` yields to the loop).

    Raises:
        JsonBoundError: as :func:`scan`.
    """
    s = _Scan(bounds)
    for start in range(0, len(raw), SCAN_CHUNK_BYTES):
        s.feed(raw[start:start + SCAN_CHUNK_BYTES])
        if start + SCAN_CHUNK_BYTES < len(raw):
            yield


async def ascan(data: Union[bytes, bytearray, str], bounds: JsonBounds) -> bytes:
    """:func:`scan` on the event loop, yielding to it after each :data:`SCAN_CHUNK_BYTES`, so a large or
    hostile document never holds the loop for more than one chunk (< 1 ms) before it is refused.

    Raises:
        JsonBoundError: too large, too many items, or too long a number.
    """
    raw = _encoded(data, bounds)
    for _ in _fed(raw, bounds):
        await asyncio.sleep(0)
    return raw


def loads(data: Union[bytes, bytearray, str], bounds: JsonBounds) -> Any:
    """Decode ``data`` (UTF-8 bytes or text) within ``bounds`` on the calling thread (:func:`scan`, then
    :func:`decode`): for documents whose ``max_bytes`` keeps that short (tool-call arguments); larger ones,
    on the event loop, go through :func:`aloads`.

    Raises:
        JsonBoundError: too large, too many items, too long a number, too deep, or invalid JSON.
    """
    return decode(scan(data, bounds))


async def aloads(data: Union[bytes, bytearray, str], bounds: JsonBounds) -> Any:
    """:func:`loads` on the event loop: :func:`ascan` (yielding to the loop), then :func:`decode`, which holds
    the loop for the linear cost the bounds allow (~1-4 ms per MB of strings, ~50 ns per item).

    Raises:
        JsonBoundError: too large, too many items, too long a number, too deep, or invalid JSON.
    """
    return decode(await ascan(data, bounds))
