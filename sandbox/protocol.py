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

import json
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


def encode(msg: dict[str, Any]) -> bytes:
    """One message as a JSON line (bytes ending in ``\\n``)."""
    return json.dumps(msg, separators=(",", ":"), ensure_ascii=False).encode("utf-8") + b"\n"


def decode(line: bytes) -> dict[str, Any]:
    """Parse one JSON line. Raises ``ValueError`` if it is not a JSON object."""
    msg = json.loads(line)
    if not isinstance(msg, dict):
        raise ValueError("a message must be a JSON object")
    return msg
