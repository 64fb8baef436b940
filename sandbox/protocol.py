"""Wire format between the host client and the in-sandbox execution server.

JSON lines over a Unix domain socket (one object per ``\\n``-terminated line; JSON escapes every newline inside
strings, so a line is always one message). Binary payloads travel base64-encoded.

Request:  ``{"id": int, "op": str, "args": {...}}``.  Ops: ``ping``, ``bash``, ``ipython``, ``editor``,
``upload``, ``download``, ``result`` (re-attach to request ``args.id`` after a dropped connection),
``shutdown``.
Response: ``{"id": int, "ok": true, "result": {...}}`` or
``{"id": int, "ok": false, "error": {"type": <name in sandbox.errors>, "message": str}}``.
"""
from __future__ import annotations

try:
    # CPython's C accelerator of the json module: json's own scanner and encoder, without json's imports of re
    # and enum, which cost ~10 ms at every sandbox start (this module runs in the execution server).
    import _json
except ImportError:  # another Python: the json module, slower to import, same results
    _json = None
# `typing` costs ~9 ms to import and this module runs in every sandbox start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

# Error type of a ``result`` request for an id the server never received.
UNKNOWN_REQUEST = "UnknownRequest"
# Longest accepted line, in bytes, and the largest file an upload/download carries (base64 grows it by 4/3).
MAX_LINE_BYTES = 64 * 1024 * 1024
MAX_TRANSFER_BYTES = 46 * 1024 * 1024
# Most items (arrays, objects, strings, commas outside strings; sandbox.bounded_json) in a response the host
# reads: a tool's result holds a handful (an IPython cell's images are one string each). Code in the sandbox
# can answer in the server's place, so a response is decoded within bounds (response_bytes, this) and checked
# (check_response) before the host reads a field of it.
MAX_RESPONSE_ITEMS = 4096
# Room for a response's fields and notes around the output it carries, in bytes.
RESPONSE_SLACK_BYTES = 64 * 1024


def response_bytes(op: str, args: dict[str, Any]) -> int:
    """Longest response line the host accepts for request ``op`` with ``args``, in bytes: for ``bash``, its
    ``max_output_bytes`` JSON-escaped (at most 6 bytes a byte, ``\\u00XX``) plus
    :data:`RESPONSE_SLACK_BYTES`; for ``download``, its ``max_bytes`` in base64 plus the slack; for every
    other op (or without those arguments) :data:`MAX_LINE_BYTES`."""
    key = {"bash": "max_output_bytes", "download": "max_bytes"}.get(op)
    n = args.get(key) if key else None
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        return MAX_LINE_BYTES
    payload = 6 * n if op == "bash" else 4 * ((n + 2) // 3)
    return min(MAX_LINE_BYTES, payload + RESPONSE_SLACK_BYTES)


def check_response(msg: Any) -> dict[str, Any]:
    """``msg`` if it has the shape of a response: an object whose ``id`` is an int or null, ``ok`` a bool,
    ``result`` (when ok) an object or null, ``error`` (when not) an object whose ``type`` and ``message`` are
    strings or absent. Raises ``ValueError`` naming what is wrong."""
    if not isinstance(msg, dict):
        raise ValueError("a response must be a JSON object")
    rid = msg.get("id")
    if rid is not None and (not isinstance(rid, int) or isinstance(rid, bool)):
        raise ValueError("a response's id must be an integer or null")
    if not isinstance(msg.get("ok"), bool):
        raise ValueError("a response's ok must be true or false")
    key = "result" if msg["ok"] else "error"
    part = msg.get(key)
    if part is not None and not isinstance(part, dict):
        raise ValueError(f"a response's {key} must be an object")
    if key == "error" and part and not all(isinstance(part.get(k, ""), str) for k in ("type", "message")):
        raise ValueError("a response's error type and message must be strings")
    return msg


def _not_serializable(o: Any) -> Any:
    raise TypeError(f"Object of type {o.__class__.__name__} is not JSON serializable")


class _DecodeOptions:
    """What ``json.JSONDecoder()`` passes its C scanner: the defaults of ``json.loads``."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int
    parse_constant = {"-Infinity": float("-inf"), "Infinity": float("inf"), "NaN": float("nan")}.__getitem__


_scan = _json.make_scanner(_DecodeOptions) if _json is not None else None
_JSON_SPACE = " \t\n\r"


def dumps(obj: Any) -> str:
    """``json.dumps(obj, separators=(",", ":"), ensure_ascii=False)``, through json's C encoder. Raises
    ``TypeError`` for a value JSON cannot hold, ``ValueError`` for a circular reference."""
    if _json is None:
        import json

        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    # a fresh circular-reference table per call, as json.dumps makes
    return "".join(_json.make_encoder({}, _not_serializable, _json.encode_basestring, None, ":", ",", False, False,
                                      True)(obj, 0))


def loads(text: str | bytes) -> Any:
    """``json.loads(text)`` (UTF-8 bytes or str), through json's C scanner. Raises ``ValueError`` for text that
    is not one JSON value (nesting too deep for the interpreter's stack included)."""
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode("utf-8", "surrogatepass")
    if _scan is None:
        import json

        try:
            return json.loads(text)
        except RecursionError:
            raise ValueError("JSON nested too deeply") from None
    start = len(text) - len(text.lstrip(_JSON_SPACE))
    try:
        obj, end = _scan(text, start)
    except StopIteration as e:
        raise ValueError(f"Expecting value at character {e.value}") from None
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    if text[end:].strip(_JSON_SPACE):
        raise ValueError(f"Extra data at character {end}")
    return obj


def encode(msg: dict[str, Any]) -> bytes:
    """One message as a JSON line (bytes ending in ``\\n``)."""
    return dumps(msg).encode("utf-8") + b"\n"


def decode(line: bytes) -> dict[str, Any]:
    """Parse one JSON line. Raises ``ValueError`` if it is not a JSON object."""
    msg = loads(line)
    if not isinstance(msg, dict):
        raise ValueError("a message must be a JSON object")
    return msg
