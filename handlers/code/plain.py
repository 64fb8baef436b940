"""Plain-data codec of the ``code`` handler's isolated grading: Python values as type-tagged JSON.

Loaded in three places: the candidate server in the solution's sandbox, the grader in the grader's sandbox,
and the host that relays between them. Standard library only (it runs with ``python -E -s`` from a read-only
directory), no project imports.

Only these exact types pass (``type(x) is int``, never ``isinstance``: a subclass of ``int`` or ``str`` with
its own ``__eq__`` is refused, as is any object of another class): ``None``, ``bool``, ``int``, ``float``
(``inf``/``nan`` included), ``complex``, ``str``, ``bytes``, ``list``, ``tuple``, ``dict``, ``set``,
``frozenset``, nested up to :data:`MAX_DEPTH`. Encoded forms (JSON arrays, tag first)::

    None -> ["n"]          bool -> ["b", true]        int -> ["i", "-1f"] (hex: no digit limit)
    float -> ["f", "0.1"]  complex -> ["c", "1.0", "-2.0"] (repr: round-trips exactly)
    str -> ["s", "..."]    bytes -> ["y", "<base64>"]
    list -> ["l", [...]]   tuple -> ["t", [...]]      set -> ["S", [...]]   frozenset -> ["F", [...]]
    dict -> ["d", [[key, value], ...]]

:func:`decode` is strict: anything else (an unknown tag, a wrong payload type, an unhashable dict key, too
deep) raises :class:`PlainDataError`. Messages are one JSON object per line (:func:`dumps_line`).
"""
from __future__ import annotations

import base64
import re
import binascii
import json
from typing import Optional

#: Deepest nesting accepted (containers inside containers). Also what bounds the recursion of both directions.
MAX_DEPTH = 64
#: Largest message (one line, newline included), in bytes, in either direction: what every side sends and
#: what every side accepts (the host decodes at most this much, ``handlers.code.grading.HOST_MESSAGE_BOUNDS``).
#: One constant for sender and receiver, so that a message built from the candidate's data can never be
#: accepted where it is built and refused where it arrives (a wrong answer turned into a grader fault).
MAX_MESSAGE_BYTES = 2 << 20
#: Most items of a message the host accepts (``sandbox.bounded_json``'s count: arrays, objects, strings and
#: commas outside strings). The candidate server and the grader check it before sending (:func:`count_items`).
MAX_ITEMS = 1 << 16
#: Longest text (an exception message, an error, a source line) put into a message, in characters: a test's
#: assertion message can quote the candidate's value, so every such text is cut at its source.
MAX_TEXT_CHARS = 2000
#: Bytes a relayed call may grow by on the host (``{"call": ...}`` from the grader becomes ``{"id": N, ...}``
#: for the candidate): the grader keeps its calls this much under :data:`MAX_MESSAGE_BYTES`.
RELAY_OVERHEAD_BYTES = 64


class PlainDataError(ValueError):
    """A value is not plain data (encoding), or an encoded form is malformed (decoding)."""


def encode(value, convert=None, _depth: int = 0):
    """The tagged JSON form of ``value`` (see the module docstring). Raises :class:`PlainDataError` for a
    value of any other type (subclasses included) or nested deeper than :data:`MAX_DEPTH` (cycles too).

    ``convert``: optional ``(value) -> value`` tried once on a value of another type (the candidate server
    turns numpy scalars into Python numbers with it); what it returns must be plain data itself."""
    if _depth > MAX_DEPTH:
        raise PlainDataError(f"nested deeper than {MAX_DEPTH}")
    t = type(value)
    if value is None:
        return ["n"]
    if t is bool:
        return ["b", value]
    if t is int:
        return ["i", format(value, "x")]
    if t is float:
        return ["f", repr(value)]
    if t is complex:
        return ["c", repr(value.real), repr(value.imag)]
    if t is str:
        return ["s", value]
    if t is bytes:
        return ["y", base64.b64encode(value).decode("ascii")]
    if t is list or t is tuple or t is set or t is frozenset:
        tag = {list: "l", tuple: "t", set: "S", frozenset: "F"}[t]
        # list(...) of the exact builtin type: no user-defined __iter__ can run.
        return [tag, [encode(v, convert, _depth + 1) for v in t.__iter__(value)]]
    if t is dict:
        return ["d", [[encode(k, convert, _depth + 1), encode(v, convert, _depth + 1)]
                      for k, v in dict.items(value)]]
    if convert is not None:
        converted = convert(value)
        if type(converted) is not t:
            return encode(converted, None, _depth)
    raise PlainDataError(f"not plain data: a value of type {t.__module__}.{t.__qualname__}")


def _float(text) -> float:
    if type(text) is not str or len(text) > 64:
        raise PlainDataError("malformed float")
    try:
        return float(text)
    except ValueError:
        raise PlainDataError("malformed float") from None


def decode(obj, _depth: int = 0):
    """The value of an encoded form (as parsed from JSON). Raises :class:`PlainDataError` for anything that
    :func:`encode` could not have produced (type confusion included: JSON numbers are never values)."""
    if _depth > MAX_DEPTH:
        raise PlainDataError(f"nested deeper than {MAX_DEPTH}")
    if type(obj) is not list or not obj or type(obj[0]) is not str:
        raise PlainDataError("malformed value: not a tagged list")
    tag, n = obj[0], len(obj)
    if tag == "n" and n == 1:
        return None
    if tag == "b" and n == 2 and type(obj[1]) is bool:
        return obj[1]
    if tag == "i" and n == 2 and type(obj[1]) is str and 0 < len(obj[1]) <= MAX_MESSAGE_BYTES:
        text = obj[1]
        digits = text[1:] if text[0] == "-" else text
        if not digits or any(c not in "0123456789abcdef" for c in digits):
            raise PlainDataError("malformed int")
        return int(text, 16)
    if tag == "f" and n == 2:
        return _float(obj[1])
    if tag == "c" and n == 3:
        return complex(_float(obj[1]), _float(obj[2]))
    if tag == "s" and n == 2 and type(obj[1]) is str:
        return obj[1]
    if tag == "y" and n == 2 and type(obj[1]) is str:
        try:
            return base64.b64decode(obj[1].encode("ascii"), validate=True)
        except (binascii.Error, UnicodeEncodeError):
            raise PlainDataError("malformed bytes") from None
    if tag in ("l", "t", "S", "F", "d") and n == 2 and type(obj[1]) is list:
        items = obj[1]
        try:
            if tag == "d":
                out = {}
                for pair in items:
                    if type(pair) is not list or len(pair) != 2:
                        raise PlainDataError("malformed dict item")
                    out[decode(pair[0], _depth + 1)] = decode(pair[1], _depth + 1)
                return out
            values = [decode(v, _depth + 1) for v in items]
            return {"l": list, "t": tuple, "S": set, "F": frozenset}[tag](values)
        except TypeError:  # an unhashable key or set member (a list inside a set)
            raise PlainDataError("unhashable dict key or set member") from None
    raise PlainDataError(f"malformed value with tag {tag[:8]!r}")


_LEAF_TAGS = frozenset("nbifcsy")
_HEX_INT = re.compile(r"-?[0-9a-f]+")
_HASHABLE_CONTAINERS = frozenset("tF")


def reencode(obj, _depth: int = 0):
    """The canonical encoded form of an encoded form, checked as strictly as :func:`decode` checks it, but
    without building a set, frozenset or dict: what the host relays from the solution's process to the grader.
    Building them would hash values the solution chose, and values can be chosen to collide (ints that differ
    by multiples of ``2**61 - 1``, complex numbers ``(1000003 k, -k)``): ~1 s of quadratic inserts per answer
    on the host's event loop. The grader builds them, in its own sandbox, under the test run's time limit.

    Raises:
        PlainDataError: as :func:`decode` (an unhashable dict key or set member included).
    """
    if _depth > MAX_DEPTH:
        raise PlainDataError(f"nested deeper than {MAX_DEPTH}")
    if type(obj) is not list or not obj or type(obj[0]) is not str:
        raise PlainDataError("malformed value: not a tagged list")
    tag = obj[0]
    if tag == "i" and len(obj) == 2 and type(obj[1]) is str and _HEX_INT.fullmatch(obj[1]):
        digits = obj[1].lstrip("-").lstrip("0") or "0"  # canonical, as encode writes it, without parsing it
        return ["i", digits if digits == "0" or obj[1][0] != "-" else "-" + digits]
    if tag == "s" and len(obj) == 2 and type(obj[1]) is str:
        return ["s", obj[1]]
    if tag in _LEAF_TAGS:
        return encode(decode(obj, _depth))
    if tag in ("l", "t", "S", "F", "d") and len(obj) == 2 and type(obj[1]) is list:
        if tag == "d":
            out = []
            for pair in obj[1]:
                if type(pair) is not list or len(pair) != 2:
                    raise PlainDataError("malformed dict item")
                key = reencode(pair[0], _depth + 1)
                _check_hashable(key)
                out.append([key, reencode(pair[1], _depth + 1)])
            return ["d", out]
        values = [reencode(v, _depth + 1) for v in obj[1]]
        if tag in ("S", "F"):
            for v in values:
                _check_hashable(v)
        return [tag, values]
    raise PlainDataError(f"malformed value with tag {tag[:8]!r}")


def _check_hashable(form) -> None:
    """Raise :class:`PlainDataError` unless the value of the (already checked) encoded ``form`` is hashable."""
    stack = [form]
    while stack:
        f = stack.pop()
        if f[0] in _LEAF_TAGS:
            continue
        if f[0] not in _HASHABLE_CONTAINERS:
            raise PlainDataError("unhashable dict key or set member")
        stack.extend(f[1])


def text(value: object) -> str:
    """``str(value)`` cut to :data:`MAX_TEXT_CHARS` characters (``""`` if ``str`` raises): every text a message
    carries goes through it where the message is built."""
    try:
        return str(value)[:MAX_TEXT_CHARS]
    except Exception:  # a __str__ that raises
        return ""


def count_items(line: bytes) -> int:
    """The items of a line :func:`dumps_line` wrote, counted as the host's bounded decoder counts them
    (``sandbox.bounded_json``: arrays, objects and commas outside strings, plus strings). ``json.dumps`` writes
    a quote or backslash inside a string only escaped, so pairing the escapes first leaves only the quotes that
    delimit strings."""
    parts = line.replace(b"\\\\", b"__").replace(b'\\"', b"__").split(b'"')
    outside = b"".join(parts[0::2])
    return outside.count(b"[") + outside.count(b"{") + outside.count(b",") + (len(parts) - 1) // 2


def dumps_line(message: dict, max_bytes: int = MAX_MESSAGE_BYTES, max_items: Optional[int] = None) -> bytes:
    """One protocol message as a newline-terminated line of ASCII JSON. Raises :class:`PlainDataError` if
    it is larger than ``max_bytes`` (default :data:`MAX_MESSAGE_BYTES`) or, with ``max_items`` (what a side
    sending to the host passes: :data:`MAX_ITEMS`), has more items (:func:`count_items`)."""
    line = json.dumps(message, ensure_ascii=True, separators=(",", ":"), allow_nan=False).encode("ascii") + b"\n"
    if len(line) > max_bytes:
        raise PlainDataError(f"message of {len(line)} bytes is larger than {max_bytes}")
    if max_items is not None and count_items(line) > max_items:
        raise PlainDataError(f"message of more than {max_items} items")
    return line


def _no_constant(name: str):
    raise PlainDataError(f"JSON constant {name} is not allowed")


def loads_line(line: bytes) -> dict:
    """Parse one protocol message (a JSON object). Raises :class:`PlainDataError` for anything else: invalid
    JSON or UTF-8, a non-object, NaN/Infinity constants, nesting too deep for the parser."""
    if len(line) > MAX_MESSAGE_BYTES:
        raise PlainDataError("message too large")
    try:
        msg = json.loads(line, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise PlainDataError(f"malformed message: {type(e).__name__}") from None
    if type(msg) is not dict:
        raise PlainDataError("malformed message: not an object")
    return msg
