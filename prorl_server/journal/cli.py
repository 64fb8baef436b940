"""``prorl-journal``: re-grade, export and inspect a rollout server's journal (:mod:`prorl_server.journal.store`).

::

    prorl-journal regrade JOURNAL [--handler NAME] [--out FILE.jsonl] [--sandbox-runtime auto|bubblewrap|none]
                                  [--workers N] [--since UNIX_S] [--timeout-s S] [--config SETTINGS.yaml]
    prorl-journal export JOURNAL --format jsonl|verl|trl|trees --out PATH [--handler NAME] [--since UNIX_S]
                                 [--rewards REGRADE.jsonl]
    prorl-journal stats JOURNAL [--json]
    prorl-journal vacuum JOURNAL

``regrade`` grades every finished job again with the current handler code and no LLM backend
(:mod:`prorl_server.journal.regrade`) and writes one JSON line per job (``job_id``, ``old_reward``, ``new_reward``,
``changed``, ``failure_kind``, ``status``, ...; to ``--out`` or stdout), then a summary on stderr. ``export``
writes the finished results as trainer rows (:mod:`prorl_server.journal.export`; verl as Parquet when pyarrow is
installed and ``--out`` does not end in ``.jsonl``, else JSON lines with the same columns). ``stats`` counts jobs
by state and handler, completions and gateway exchanges, tombstones, and the file's size. ``vacuum`` converts,
with the server stopped, a journal created without ``auto_vacuum`` (before schema 3) and larger than
:data:`~prorl_server.journal.store.CONVERT_MAX_BYTES`, so retention can shrink it. Progress bars (tqdm) go to stderr
(``--quiet`` hides them).

Exit status: 0 done; 1 ``regrade`` re-graded nothing although jobs matched (every one refused or failed: the
summary says why), or an output cannot be written; 2 the journal is missing or unreadable, or a bad argument.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sqlite3
import sys
import time
import urllib.parse
from collections import Counter
from typing import Any, Iterator, Optional, Sequence

from prorl_server.journal.store import Journal, JournalError

#: Tables a file must hold to be read as a journal.
JOURNAL_TABLES = ("jobs", "completions")

Row = tuple[str, Optional[str], bytes, Optional[bytes]]


class CliError(Exception):
    """A fault the user can fix (a missing or unreadable journal, a bad argument): printed, exit status 2."""


# ------------------------------------------------------------------------------------------ reading
def _read_only(path: str) -> sqlite3.Connection:
    # check_same_thread off: ``regrade`` reads its rows from worker threads (one at a time)
    return sqlite3.connect(f"file:{urllib.parse.quote(os.path.abspath(path))}?mode=ro", uri=True, timeout=30,
                           check_same_thread=False)


def open_journal(path: str) -> Journal:
    """The journal at ``path`` for reading. Checked read-only first, so a missing file is not created and a
    database that is no journal is not given the journal's tables.

    Raises:
        CliError: no file there, not an SQLite database (corrupt or another file), or no journal tables.
    """
    if not os.path.exists(path):
        raise CliError(f"no journal at {path} (the server's journal setting, --journal, says where it writes one)")
    if not os.path.isfile(path):
        raise CliError(f"{path} is not a file")
    try:
        db = _read_only(path)
        try:
            # reading the schema finds a file that is no database or whose first pages are damaged; a full
            # integrity check would read all of a journal of many GB (damage further in is caught where read)
            tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        finally:
            db.close()
    except sqlite3.Error as e:
        raise CliError(f"{path} is not a readable journal: {e}") from None
    missing = [t for t in JOURNAL_TABLES if t not in tables]
    if missing:
        raise CliError(f"{path} is an SQLite database but not a journal (no table {', '.join(missing)})")
    try:
        return Journal(path, readonly=True)
    except JournalError as e:
        raise CliError(str(e)) from None



def _private_output(path: str):
    """``path`` opened for writing text, mode 0600 whatever the umask (as the journal's own files and the
    export's): a regrade's rows hold the journal's rewards and job ids, which other local users must not read."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    os.fchmod(fd, 0o600)  # a file left by an earlier run keeps its mode otherwise
    return os.fdopen(fd, "w", encoding="utf-8")

def refuse_journal_as_output(out: Optional[str], journal_path: str) -> None:
    """Raises :class:`CliError` when ``out`` is the journal or one of its files (writing it would destroy it)."""
    if out is not None and os.path.realpath(out) in {os.path.realpath(journal_path) + suffix
                                                      for suffix in ("", "-wal", "-shm", ".lock")}:
        raise CliError(f"--out {out} is the journal itself (or one of its files): write somewhere else")


def finished_rows(journal: Journal, since: Optional[float] = None) -> Iterator[Row]:
    """``(job_id, handler, request JSON, result JSON)`` of every finished job, oldest first; with ``since``, only
    jobs submitted at or after it (unix seconds)."""
    if since is None:
        yield from journal.iter_jobs("done")
        return
    db = _read_only(journal.path)
    try:
        # rowid order is submission order (a job's row is inserted at submit, replaced on resubmission) and
        # needs no sort of the rows, results included, that ORDER BY submitted (not indexed) would make
        yield from db.execute("SELECT job_id, handler, request, result FROM jobs WHERE state = 'done' AND "
                              "submitted >= ? ORDER BY rowid", (since,))
    finally:
        db.close()


def count_finished(journal: Journal, since: Optional[float] = None) -> int:
    if since is None:
        return journal.count_jobs("done")
    db = _read_only(journal.path)
    try:
        return db.execute("SELECT COUNT(*) FROM jobs WHERE state = 'done' AND submitted >= ?", (since,)).fetchone()[0]
    finally:
        db.close()


class HandlerFilter:
    """Whether a journalled job is of the handler ``name`` (aliases resolved through ``registry``: ``--handler
    humaneval`` matches jobs journalled as ``code``)."""

    def __init__(self, name: Optional[str], registry: Any) -> None:
        self.registry = registry
        self.name = self._canonical(name) if name else None

    def _canonical(self, name: str) -> str:
        try:
            return self.registry.resolve(name)[0]
        except KeyError:
            return name

    def __call__(self, handler: Optional[str], request_json: Optional[bytes]) -> bool:
        if self.name is None:
            return True
        if handler is None:
            try:
                handler = (json.loads(request_json or b"null") or {}).get("instance", {}).get("data_source")
            except (ValueError, AttributeError):
                return False
        return isinstance(handler, str) and self._canonical(handler) == self.name


def _registry() -> Any:
    from prorl_server.plugin.registry import HandlerRegistry

    r = HandlerRegistry()
    r.load_entry_points()
    return r


def _server_settings(path: Optional[str], registry: Any) -> Any:
    """The server's settings file (``--config``): its ``handlers`` sections configure ``registry`` (grading
    limits such as the code handler's ``eval_timeout_s``), its sandbox settings the runtime. None without one.

    Raises:
        CliError: the file cannot be read or its settings are invalid.
    """
    if path is None:
        return None
    from pydantic import ValidationError

    from prorl_server.config import build_settings

    try:
        settings = build_settings(path)
        registry.configure(settings.handlers)
    except (OSError, ValueError, ValidationError) as e:
        raise CliError(f"the settings file {path}: {e}") from None
    return settings


def _progress(total: Optional[int], desc: str, quiet: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="job", file=sys.stderr, disable=quiet, mininterval=0.5,
                dynamic_ncols=True)


# ------------------------------------------------------------------------------------------ regrade
async def _regrade(args: argparse.Namespace) -> int:
    from prorl_server.journal.regrade import Regrader

    refuse_journal_as_output(args.out, args.journal)
    journal = open_journal(args.journal)
    registry = _registry()
    settings = _server_settings(args.config, registry)
    runtime = args.sandbox_runtime or (settings.sandbox_runtime if settings is not None else "auto")
    matches = HandlerFilter(args.handler, registry)
    out = _private_output(args.out) if args.out else sys.stdout
    statuses: Counter = Counter()
    reasons: Counter = Counter()
    changed = 0
    old_sum = new_sum = 0.0
    rows = finished_rows(journal, args.since)
    queue: asyncio.Queue = asyncio.Queue(maxsize=2 * args.workers)
    bar = _progress(count_finished(journal, args.since), "regrade", args.quiet)
    try:
        async with Regrader(registry, sandbox_runtime=runtime, cpu_workers=min(args.workers, os.cpu_count() or 1),
                            sandbox_image=settings.sandbox_image if settings is not None else None,
                            sandbox_options=settings.sandbox_options if settings is not None else None,
                            timeout_s=args.timeout_s) as regrader:

            async def produce() -> None:
                try:
                    while True:  # the journal is read off the event loop
                        row = await asyncio.to_thread(next, rows, None)
                        if row is None:
                            break
                        if matches(row[1], row[2]):
                            await queue.put(row)
                        else:
                            bar.update(1)
                finally:
                    for _ in range(args.workers):
                        await queue.put(None)

            async def work() -> None:
                nonlocal changed, old_sum, new_sum
                while (row := await queue.get()) is not None:
                    outcome = await regrader.regrade(*row)
                    statuses[outcome.status] += 1
                    if outcome.status == "regraded":
                        changed += bool(outcome.changed)
                        old_sum += outcome.old_reward or 0.0
                        new_sum += outcome.new_reward or 0.0
                    elif outcome.reason:
                        reasons[(outcome.status, outcome.handler, outcome.reason[:300])] += 1
                    out.write(json.dumps(outcome.row(), ensure_ascii=False, default=repr) + "\n")
                    bar.update(1)
                    bar.set_postfix(changed=changed, refresh=False)

            try:
                async with asyncio.TaskGroup() as tg:  # a failure stops the others (gather leaves them running)
                    tg.create_task(produce())
                    for _ in range(args.workers):
                        tg.create_task(work())
            except BaseExceptionGroup as eg:  # the first failure, as itself (main reports a damaged journal)
                raise eg.exceptions[0] from None
    finally:
        rows.close()
        bar.close()
        if out is not sys.stdout:
            out.close()
        else:
            out.flush()
        journal.close()
    n = statuses["regraded"]
    print(f"regrade: {sum(statuses.values())} job(s): {n} re-graded, {changed} changed"
          + (f", mean reward {old_sum / n:.4f} -> {new_sum / n:.4f}" if n else "")
          + "".join(f"; {statuses[s]} {s}" for s in ("skipped", "not_regradable", "eval_failed", "error")
                    if statuses[s]), file=sys.stderr)
    for (status, handler, reason), k in reasons.most_common(10):
        print(f"  {k} {status} ({handler}): {reason}", file=sys.stderr)
    return 1 if statuses and n == 0 and (statuses.total() - statuses["skipped"]) > 0 else 0


# ------------------------------------------------------------------------------------------ export
def _export(args: argparse.Namespace) -> int:
    from prorl_server.journal.export import (VERL_COLUMNS, InvalidRecordError, RowWriter, parquet_available,
                                             result_row, trainable, trl_row, verl_rows)
    from prorl_server.types import JobResult

    path = args.out
    refuse_journal_as_output(path, args.journal)
    journal = open_journal(args.journal)
    matches = HandlerFilter(args.handler, _registry())
    parquet = False
    if args.format != "verl" and path.endswith(".parquet"):
        raise CliError(f"--format {args.format} writes JSON lines: give --out a .jsonl name (only verl rows are "
                       "written as Parquet)")
    if args.format == "verl" and not path.endswith(".jsonl"):
        parquet = parquet_available()
        if not parquet:
            print("export: pyarrow is not installed: writing verl rows as JSON lines", file=sys.stderr)
            if path.endswith(".parquet"):
                path = path[: -len(".parquet")] + ".jsonl"
    if args.format == "trees":
        return _export_trees(args, journal, matches, path)
    regraded = load_regraded(args.rewards) if args.rewards else {}
    counts: Counter = Counter()
    bar = _progress(count_finished(journal, args.since), f"export {args.format}", args.quiet)
    try:
        with RowWriter(path, parquet=parquet, columns=VERL_COLUMNS if parquet else None) as w:
            for job_id, handler, request, result_json in finished_rows(journal, args.since):
                bar.update(1)
                if not matches(handler, request):
                    continue
                counts["jobs"] += 1
                if result_json is None:
                    counts["no result"] += 1
                    continue
                new = regraded.get(job_id)
                counts["rewards from --rewards"] += new is not None
                if args.format == "jsonl":
                    row = result_row(result_json)
                    if new is not None:
                        was = {f"old_{k}": row.get(k) for k in new}
                        row["extra"] = {**(row.get("extra") or {}), "regrade": was}
                        row.update(new)
                    w.write(row)
                    continue
                try:
                    result = JobResult.model_validate_json(result_json)
                    if new is not None:
                        result = result.model_copy(update=new)
                    if not trainable(result):
                        counts["not trainable (filtered or no trajectory)"] += 1
                        continue
                    if args.format == "verl":
                        w.write_all(verl_rows(result))
                    else:
                        w.write(trl_row(result))
                except (InvalidRecordError, ValueError) as e:
                    counts["invalid"] += 1
                    print(f"export: job {job_id} left out: {e}", file=sys.stderr)
    finally:
        bar.close()
        journal.close()
    skipped = "".join(f"; {k} {v}" for k, v in counts.items() if k != "jobs" and v)
    print(f"export: {counts['jobs']} job(s) -> {w.rows} {args.format} row(s) in {path} "
          f"({'parquet' if parquet else 'jsonl'}){skipped}", file=sys.stderr)
    return 0


def _export_trees(args: argparse.Namespace, journal: Journal, matches: Any, path: str) -> int:
    """``export --format trees``: one JSON line per group (``group_id`` of the request) with the group's verified
    prefix tree, as ``GET /groups/{id}/tree`` answers it (:func:`prorl_server.tree.tree_of_results`). Two passes,
    so one group's results are in memory at a time: the group of every finished job, then each group's results
    read by job id. A group whose tree fails its invariants is left out with the reason."""
    from prorl_server.journal.export import RowWriter
    from prorl_server.tree import TreeInvariantError, tree_of_results

    groups: dict[str, list[str]] = {}
    try:
        for job_id, handler, request, _ in finished_rows(journal, args.since):
            if not matches(handler, request):
                continue
            try:
                group_id = json.loads(request).get("group_id") if request else None
            except ValueError:
                group_id = None
            if isinstance(group_id, str):
                groups.setdefault(group_id, []).append(job_id)
        counts: Counter = Counter()
        with RowWriter(path) as w:
            for group_id, members in groups.items():
                ended = []
                for job_id in members:
                    row = journal.job(job_id)
                    if row is not None and row[2] is not None:
                        ended.append((job_id, row[2]))
                try:
                    w.write(tree_of_results(group_id, ended).model_dump(mode="json"))
                except (TreeInvariantError, ValueError) as e:
                    counts["invalid"] += 1
                    print(f"export: group {group_id} left out: {e}", file=sys.stderr)
    finally:
        journal.close()
    print(f"export: {len(groups)} group(s) -> {w.rows} tree(s) in {path} (jsonl)"
          + ("".join(f"; {k} {v}" for k, v in counts.items())), file=sys.stderr)
    return 0


def load_regraded(path: str) -> dict[str, dict[str, Any]]:
    """``job_id -> {"reward", "resolved", "failure_kind", "critical_error", "filter"}`` of the ``regraded`` lines
    of a ``prorl-journal regrade`` output (``--rewards``): export writes those instead of the recorded ones.
    Lines of another status (skipped, refused, failed) change nothing.

    Raises:
        CliError: the file cannot be read, or a line is not a regrade line.
    """
    out: dict[str, dict[str, Any]] = {}
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    if row["status"] != "regraded":
                        continue
                    reward, resolved = row["new_reward"], row["new_resolved"]
                    if not isinstance(reward, (int, float)) or isinstance(reward, bool) or \
                            not isinstance(resolved, bool) or not isinstance(row["job_id"], str):
                        raise ValueError("new_reward, new_resolved or job_id has the wrong type")
                except (ValueError, KeyError, TypeError) as e:
                    raise CliError(f"--rewards {path} line {n} is not a prorl-journal regrade line: {e}") from None
                # a job whose old eval failed (filtered) and grades now is trainable: its new outcome, whole
                out[row["job_id"]] = {"reward": float(reward), "resolved": resolved,
                                      "failure_kind": row.get("failure_kind"),
                                      "critical_error": row.get("critical_error"), "filter": bool(row.get("filter"))}
    except OSError as e:
        raise CliError(f"--rewards {path}: {e}") from None
    return out


# ------------------------------------------------------------------------------------------ stats
def journal_stats(journal: Journal) -> dict[str, Any]:
    """Counts of a journal: ``jobs`` by state, ``done_by_handler``, ``completions`` (rows, owners, generated
    tokens), ``gateway`` (exchanges, sessions), ``oldest`` / ``newest`` submission (unix s), ``size_bytes``."""
    db = _read_only(journal.path)
    try:
        q = lambda sql: db.execute(sql).fetchall()  # noqa: E731
        by_state = dict(q("SELECT state, COUNT(*) FROM jobs GROUP BY state ORDER BY state"))
        by_handler = dict(q("SELECT COALESCE(handler, '?'), COUNT(*) FROM jobs WHERE state = 'done' "
                            "GROUP BY handler ORDER BY COUNT(*) DESC"))
        n, owners, tokens = q("SELECT COUNT(*), COUNT(DISTINCT owner), COALESCE(SUM(LENGTH(token_ids)), 0) / 4 "
                              "FROM completions")[0]
        tables = {r[0] for r in q("SELECT name FROM sqlite_master WHERE type = 'table'")}
        gw = q("SELECT COUNT(*), COUNT(DISTINCT session_id) FROM gateway")[0] if "gateway" in tables else (0, 0)
        expired = q("SELECT COUNT(*) FROM expired")[0][0] if "expired" in tables else 0
        oldest, newest = q("SELECT MIN(submitted), MAX(submitted) FROM jobs")[0]
    finally:
        db.close()
    return {"path": journal.path, "jobs": by_state, "jobs_total": sum(by_state.values()),
            "done_by_handler": by_handler,
            "completions": {"rows": n, "owners": owners, "generated_tokens": tokens},
            "gateway": {"exchanges": gw[0], "sessions": gw[1]}, "expired": expired, "oldest": oldest,
            "newest": newest,
            "size_bytes": journal.size_bytes()}


def _stats(args: argparse.Namespace) -> int:
    journal = open_journal(args.journal)
    try:
        s = journal_stats(journal)
    except sqlite3.Error as e:
        raise CliError(f"{args.journal} is not a readable journal: {e}") from None
    finally:
        journal.close()
    if args.json:
        print(json.dumps(s, indent=2))
        return 0
    when = lambda t: "-" if t is None else time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))  # noqa: E731
    print(f"journal {s['path']}: {s['size_bytes'] / 1e6:.1f} MB on disk")
    print(f"jobs: {s['jobs_total']} (" + ", ".join(f"{k} {v}" for k, v in s["jobs"].items()) + ")")
    if s["done_by_handler"]:
        print("finished by handler: " + ", ".join(f"{k} {v}" for k, v in s["done_by_handler"].items()))
    c, g = s["completions"], s["gateway"]
    print(f"completions: {c['rows']} of {c['owners']} owner(s), {c['generated_tokens']} generated tokens")
    print(f"gateway exchanges: {g['exchanges']} in {g['sessions']} session(s)")
    print(f"expired (results retention deleted; their ids answer 410): {s['expired']}")
    print(f"submitted: {when(s['oldest'])} .. {when(s['newest'])}")
    return 0


def _vacuum(args: argparse.Namespace) -> int:
    """Rewrite the journal once with ``auto_vacuum=INCREMENTAL`` (a full VACUUM: needs the file's size free
    on disk, and no server writing it: the journal's lock is taken, or the command refused)."""
    open_journal(args.journal).close()  # a journal (never a file created, or another database changed)
    try:
        journal = Journal(args.journal)  # the lock: refused while a server writes it; upgrades the schema
    except JournalError as e:
        raise CliError(str(e)) from None
    try:
        before = journal.size_bytes()
        db = sqlite3.connect(journal.path, isolation_level=None)
        try:
            db.execute("PRAGMA auto_vacuum = INCREMENTAL")
            db.execute("VACUUM")
        finally:
            db.close()
        print(f"journal {journal.path}: {before / 1e6:.1f} MB -> {journal.size_bytes() / 1e6:.1f} MB, "
              "auto_vacuum=INCREMENTAL (retention now hands freed pages back)")
    finally:
        journal.close()
    return 0


# ------------------------------------------------------------------------------------------ main
def _positive_int(v: str) -> int:
    n = int(v)
    if n < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return n


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="prorl-journal", description="Re-grade, export and inspect a rollout "
                                "server's journal (the SQLite file of its jobs, results and completions).")
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp: argparse.ArgumentParser, since: bool = True) -> None:
        sp.add_argument("journal", help="the journal file (SQLite)")
        if since:
            sp.add_argument("--handler", help="only jobs of this handler (a name or an alias)")
            sp.add_argument("--since", type=float, metavar="UNIX_S",
                            help="only jobs submitted at or after this time (unix seconds)")
            sp.add_argument("--quiet", "-q", action="store_true", help="no progress bar")

    r = sub.add_parser("regrade", help="grade the finished jobs again with the current handler code, no LLM",
                       description="Grade every finished job again with the current handler code (its eval and "
                       "final_result) and no LLM backend; one JSON line per job, a summary on stderr.")
    common(r)
    r.add_argument("--out", help="write the JSON lines here (default: stdout)")
    r.add_argument("--sandbox-runtime",
                   help="runtime for the sandboxes eval opens (code grading): auto (bubblewrap where bwrap is "
                   "installed), bubblewrap or none (default: the --config file's sandbox_runtime, else auto)")
    r.add_argument("--config", help="the server's settings file (YAML/TOML): its handlers sections (grading "
                   "limits) and sandbox settings apply, as on the server that ran the jobs")
    r.add_argument("--workers", type=_positive_int, default=1, help="jobs graded at once (default: 1)")
    r.add_argument("--timeout-s", type=float, default=600.0,
                   help="seconds one job's eval may take (default: 600)")
    e = sub.add_parser("export", help="write the finished results as verl rows, TRL rows or JSONL",
                       description="Write the finished results as trainer rows: verl (one row per trajectory "
                       "segment; Parquet when pyarrow is installed), trl (one row per job) or jsonl (the results).")
    common(e)
    e.add_argument("--format", required=True, choices=("jsonl", "verl", "trl", "trees"),
                   help="trees: one line per group (group_id) with its verified prefix tree (issue #34)")
    e.add_argument("--out", required=True, help="output file")
    e.add_argument("--rewards", metavar="REGRADE.jsonl", help="a prorl-journal regrade output: its re-graded "
                   "jobs are exported with their new reward, resolved and failure_kind (jsonl rows keep the old "
                   "ones in extra.regrade)")
    s = sub.add_parser("stats", help="jobs by state, completions, size on disk")
    common(s, since=False)
    s.add_argument("--json", action="store_true", help="print the counts as JSON")
    v = sub.add_parser("vacuum", help="convert a journal of an older version so that retention can shrink it",
                       description="Rewrite the journal once with auto_vacuum=INCREMENTAL (server stopped; needs "
                       "the file's size free on disk). Journals this version creates, and older ones up to 256 "
                       "MiB (converted when a server opens them), need no such step.")
    common(v, since=False)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "regrade":
            return asyncio.run(_regrade(args))
        if args.command == "export":
            return _export(args)
        if args.command == "vacuum":
            return _vacuum(args)
        return _stats(args)
    except CliError as e:
        print(f"prorl-journal: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # an output that cannot be written (missing or read-only directory, full disk)
        print(f"prorl-journal: {e}", file=sys.stderr)
        return 1
    except sqlite3.DatabaseError as e:  # damaged past what open_journal's check reads
        print(f"prorl-journal: {args.journal} could not be read: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("prorl-journal: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
