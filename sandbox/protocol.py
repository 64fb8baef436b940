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


def encode(msg: dict[str, Any]) -> bytes:
    """One message as a JSON line (bytes ending in ``\\n``)."""
    return json.dumps(msg, separators=(",", ":"), ensure_ascii=False).encode("utf-8") + b"\n"


def decode(line: bytes) -> dict[str, Any]:
    """Parse one JSON line. Raises ``ValueError`` if it is not a JSON object."""
    msg = json.loads(line)
    if not isinstance(msg, dict):
        raise ValueError("a message must be a JSON object")
    return msg
