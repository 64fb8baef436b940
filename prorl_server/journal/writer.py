"""The journal's writer process (``python -m prorl_server.journal.writer CONFIG_JSON``), started by
:meth:`prorl_server.journal.store.Journal.start`: it owns the only writing connection to the SQLite file, so commits
never wait for the server's GIL (a writer thread in the server waited for it at every SQLite call: up to the
switch interval each while the event loop was busy).

Protocol (both directions: 4-byte little-endian length, then a pickle):
- in, on ``data_fd``: one ``(kind, params, perf_counter at enqueue)`` row per frame, in order;
- out, on ``ack_fd``: ``(rows committed so far, counters and last error, float64 latencies of the rows
  committed since the last report, as bytes)`` after a commit that held a ``flush`` row (the server waits for
  it) or that changed the last error, and after each failed commit attempt (then with the same count).

It takes everything the pipe holds, commits it in one transaction, then reports. End of file on ``data_fd``
(the server closed the journal, or died: SIGKILL included) makes it commit what it has read and exit, so a
row the server handed over before dying is not lost either. It ignores SIGINT and SIGTERM (a signal to the
server's process group must not stop the writer before the server's last results are committed); it holds
the journal's lock (``lock_fd``, inherited) until it exits.
"""
from __future__ import annotations

import array
import json
import logging
import os
import pickle
import signal
import struct
import sys

from prorl_server.journal.store import _Store

log = logging.getLogger("prorl_server.journal")
_LENGTH = struct.Struct("<I")


def main(argv: list[str]) -> int:
    """Run the writer: ``argv[0]`` is the JSON config :meth:`prorl_server.journal.store.Journal.start` passes (the
    journal's path, retention and busy timeout, and the numbers of the inherited ``data_fd``, ``ack_fd`` and
    ``lock_fd``). Returns 0 once the server closed the pipe (or died) and everything read is committed."""
    config = json.loads(argv[0])
    data_fd, ack_fd = config.pop("data_fd"), config.pop("ack_fd")
    config.pop("lock_fd")  # held open (inherited) for as long as this process lives
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    store = _Store(**config)
    store.open()
    done = 0
    parent_gone = False
    latencies: list[float] = []  # since the last report
    reported_error = None

    def report() -> None:
        nonlocal parent_gone, reported_error
        if parent_gone:
            return
        reported_error = store.last_error
        data = pickle.dumps((done, store.stats(), array.array("d", latencies).tobytes()), 5)
        latencies.clear()
        try:
            os.write(ack_fd, len(data).to_bytes(4, "little") + data)  # blocking: the server's ack thread reads
        except OSError:  # the server is gone: keep committing what it sent
            parent_gone = True

    report()  # hello: the file is open
    buf = bytearray()
    eof = False
    while not eof:
        data = os.read(data_fd, 1 << 20)
        if not data:
            eof = True
        buf += data
        rows = []
        off = 0
        end = len(buf)
        with memoryview(buf) as view:
            while end - off >= 4:
                (size,) = _LENGTH.unpack_from(view, off)
                if end - off - 4 < size:
                    break
                rows.append(pickle.loads(view[off + 4:off + 4 + size]))
                off += 4 + size
        del buf[:off]
        if rows:
            lat = store.write(rows, report)
            if lat is None:
                break
            done += len(rows)
            latencies.extend(lat)
            del latencies[:-100_000]
            # a report wakes the server's ack thread (its GIL): only when a flush waits for one, or news
            if any(r[0] == "flush" for r in rows) or store.last_error != reported_error:
                report()
            store.after_commit()
    store.close()
    if buf:
        log.error("journal %s: %d bytes of a row cut short by the server's exit were not recorded",
                  config["path"], len(buf))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
