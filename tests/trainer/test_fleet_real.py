"""Issue #24 with real processes: rollout servers (``python -m prorl_server --port 0 --fleet-dir D``) join, die,
drain and end while one trainer-side client (the project's JobSubmitter following a Fleet) keeps submitting
multi-turn ``shout`` jobs, with the issue's figures asserted: a joining server gets its first job within 5 s of
listening; a SIGKILLed one is out at once for the client that had requests on it and within 2 x TTL (10 s) for
a reader that sent it nothing, and its in-flight jobs come back and run elsewhere, none delivered twice; a
drained one finishes every job it holds (0 aborted) and takes no new one; the end sentinel stops every member
within 30 s. The LLM is a labelled stand-in whose turns take 0.5 s (prorl_server/dev/timed_llm.py)."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from prorl_server.membership import MemberRecord, members_dir
from trainer_plugins.admission import LeastInFlight
from trainer_plugins.fleet import Fleet
from trainer_plugins.jobs import JobSubmitter, process_request

pytestmark = pytest.mark.real

ROOT = Path(__file__).resolve().parents[2]
TURN_S = 0.5
TTL_S = 5.0  # the default lease


class FleetServer:
    """One ``python -m prorl_server --fleet-dir`` process in its own session. ``ready_at``: monotonic time its
    ready file appeared (it listens: ``/health`` answers)."""

    def __init__(self, fleet_dir: Path, backend: str, *flags: str) -> None:
        tmp = Path(tempfile.mkdtemp(prefix="fleet-srv-"))
        ready = tmp / "ready.json"
        self.log = tmp / "server.log"
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        env.pop("PRORL_TOKEN", None)
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "prorl_server", "--port", "0", "--ready-file", str(ready), "--fleet-dir",
                 str(fleet_dir), "--backend", backend, "--sandbox-runtime", "none", "--journal", "off",
                 "--log-level", "INFO", *flags], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
        for _ in range(1200):  # hang guard: 60 s
            if ready.exists():
                break
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        if not ready.exists():
            self.kill()
            pytest.fail(f"the server did not start: {self.log.read_text()[-2000:]}")
        self.ready_at = time.monotonic()
        self.url = json.loads(ready.read_text())["url"]

    def record(self) -> MemberRecord | None:
        path = next(iter(members_dir(self.fleet_dir_of()).glob(f"*-{self.proc.pid}-*.json")), None)
        return None if path is None else MemberRecord.model_validate_json(path.read_bytes())

    def fleet_dir_of(self) -> Path:
        args = self.proc.args
        return Path(args[args.index("--fleet-dir") + 1])

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


@pytest.fixture
def fleet_dir(tmp_path):
    return tmp_path / "fleet"


@pytest.fixture
def servers(fleet_dir, fake_llm):
    started: list[FleetServer] = []

    def start(*flags: str) -> FleetServer:
        started.append(FleetServer(fleet_dir, fake_llm, *flags))
        return started[-1]

    yield start
    for s in started:
        s.kill()


class Recording(LeastInFlight):
    """The default chooser, recording ``(monotonic time, server)`` of every job it sends."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[tuple[float, str]] = []

    def started(self, server, group_id=None):
        self.sent.append((time.monotonic(), server))
        super().started(server, group_id)


def shout(i: int, turns: int = 2) -> dict:
    return {"data_source": "shout", "instance_id": f"shout-{i}", "prompt": "Say something about the sea.",
            "turns": turns}


async def wait_until(pred, timeout_s: float, poll_s: float = 0.05) -> float:
    """Seconds until ``pred()`` held; fails the test after ``timeout_s``."""
    t0 = time.monotonic()
    while not pred():
        if time.monotonic() - t0 > timeout_s:
            pytest.fail(f"not within {timeout_s} s")
        await asyncio.sleep(poll_s)
    return time.monotonic() - t0


class Load:
    """``workers`` loops, each running one sample after another through ``JobSubmitter.run(fleet)``."""

    def __init__(self, jobs: JobSubmitter, fleet: Fleet, workers: int, turns: int = 2) -> None:
        self.chooser = Recording()
        self.outcomes = []
        self._stop = False
        self._tasks = [asyncio.create_task(self._loop(jobs, fleet, w, turns)) for w in range(workers)]

    async def _loop(self, jobs, fleet, w, turns):
        i = 0
        while not self._stop:
            req = process_request(shout(i, turns), {"max_tokens": 8})
            self.outcomes.append(await jobs.run(fleet, req, chooser=self.chooser, job_prefix=f"w{w}-{i}"))
            i += 1

    async def stop(self):
        self._stop = True
        await asyncio.gather(*self._tasks)


async def test_a_server_started_during_a_run_gets_its_first_job_within_5_s_of_listening(servers, fleet_dir):
    a = servers()
    fleet = Fleet(fleet_dir)
    try:
        async with JobSubmitter(fleet=fleet) as jobs:
            load = Load(jobs, fleet, workers=3)
            await wait_until(lambda: len(load.outcomes) >= 3, 60)
            b = await asyncio.to_thread(servers)
            await wait_until(lambda: any(s == b.url for _, s in load.chooser.sent), 10)
            first = min(t for t, s in load.chooser.sent if s == b.url)
            await wait_until(lambda: any(o.server == b.url for o in load.outcomes), 60)
            await load.stop()
    finally:
        fleet.close()
    latency = first - b.ready_at
    print(f"join: first job on the new server {latency:.2f} s after it listened")
    assert latency < 5.0
    assert not any(o.filtered for o in load.outcomes)
    assert {o.server for o in load.outcomes} == {a.url, b.url}


async def test_a_sigkilled_server_is_out_within_2_ttl_and_its_jobs_run_elsewhere_once(servers, fleet_dir):
    a, b = servers(), servers()
    fleet = Fleet(fleet_dir)
    # readers that send nothing: on this node a dead pid takes the server out; on another node (where a pid
    # means nothing) only the lease can
    passive = Fleet(fleet_dir)
    remote = Fleet(fleet_dir, local_node="another-node")
    try:
        await wait_until(lambda: len(fleet) == 2 and len(passive) == 2 and len(remote) == 2, 10)
        async with JobSubmitter(fleet=fleet) as jobs:
            load = Load(jobs, fleet, workers=4, turns=4)  # 2 s jobs
            await wait_until(lambda: sum(1 for _, s in load.chooser.sent if s == a.url) >= 2, 60)
            await asyncio.sleep(0.5)  # its jobs are mid-turn
            a.kill()
            t_kill = time.monotonic()
            out_client = await wait_until(lambda: a.url not in fleet, 10, 0.01)
            out_pid = await wait_until(lambda: a.url not in passive, 2 * TTL_S + 1, 0.01)
            out_lease = await wait_until(lambda: a.url not in remote, 2 * TTL_S + 1, 0.01)
            sent_after = [s for t, s in load.chooser.sent if t > t_kill + out_client]
            await asyncio.sleep(1.0)
            await load.stop()
    finally:
        fleet.close()
        passive.close()
        remote.close()
    print(f"SIGKILL: out for the client in {out_client:.2f} s, for a reader on the node {out_pid:.2f} s, by the "
          f"lease alone {out_lease:.2f} s")
    assert out_pid <= 2 * TTL_S and out_lease <= 2 * TTL_S
    assert out_client < 1.0  # its requests failed: out at once
    assert a.url not in sent_after  # never a job to a server known dead
    moved = [o for o in load.outcomes if any(at.server == a.url for at in o.attempts)]
    assert moved, "the killed server held jobs: they come back resubmittable"
    assert all(o.server == b.url and not o.filtered for o in moved)
    assert not any(o.filtered for o in load.outcomes)
    delivered = [o.result.job_id for o in load.outcomes]
    assert len(delivered) == len(set(delivered))  # nothing delivered twice


async def test_a_drained_server_finishes_every_job_it_holds_takes_no_new_one_and_leaves(servers, fleet_dir):
    a, b = servers("--drain-timeout-s", "30"), servers()
    fleet = Fleet(fleet_dir)
    try:
        await wait_until(lambda: len(fleet) == 2, 10)
        async with JobSubmitter(fleet=fleet) as jobs:
            held = [asyncio.create_task(jobs.submit(a.url, process_request(shout(i, turns=6), {"max_tokens": 8},
                                                                           job_id=f"held-{i}")))
                    for i in range(4)]  # 3 s jobs, all on the server to drain
            await wait_until(lambda: (a.record() or MemberRecord.model_construct(in_flight=0)).in_flight == 4, 30)
            os.kill(a.proc.pid, signal.SIGTERM)
            t_term = time.monotonic()
            out = await wait_until(lambda: a.url not in fleet, 5, 0.01)
            assert a.proc.poll() is None  # still finishing its jobs
            racing = await jobs.submit(a.url, process_request(shout(99), {"max_tokens": 8}, job_id="racing"))
            load = Load(jobs, fleet, workers=2)  # new work meanwhile goes to the other server only
            results = await asyncio.gather(*held)
            finished = time.monotonic() - t_term
            rc = await asyncio.to_thread(a.proc.wait, 30)
            exited = time.monotonic() - t_term
            await load.stop()
    finally:
        fleet.close()
    print(f"drain: out of the rotation {out:.2f} s after SIGTERM; the 4 held jobs finished {finished:.2f} s after "
          f"it, the server exited {exited:.2f} s after it")
    aborted = [r for r in results if r.filter or r.critical_error]
    assert aborted == []  # 0 jobs aborted
    assert racing.filter and "draining" in racing.error  # a racing submit is refused, never run
    assert {o.server for o in load.outcomes} == {b.url} and not any(o.filtered for o in load.outcomes)
    assert rc == 0 and a.record() is None  # left cleanly, its record removed
    assert out < 1.0


async def test_the_end_sentinel_stops_every_member_within_30_s(servers, fleet_dir):
    a, b = servers(), servers("--processes", "2")
    fleet = Fleet(fleet_dir)
    try:
        await wait_until(lambda: len(fleet) == 3, 15)
        # one member of the two-process server drains by the management call and leaves alone
        drained = next(u for u in fleet if u != a.url)
        req = urllib.request.Request(f"{drained}/drain", data=b"{}", headers={"Content-Type": "application/json"})
        await asyncio.to_thread(urllib.request.urlopen, req, None, 10)
        await wait_until(lambda: drained not in fleet and len(fleet) == 2, 10)
        await wait_until(lambda: len(list(members_dir(fleet_dir).glob("*.json"))) == 2, 10)
        assert b.proc.poll() is None  # its supervisor and the other member stay
        t0 = time.monotonic()
        await asyncio.to_thread(fleet.end, "test: the trainer ended")
        await asyncio.to_thread(a.proc.wait, 30)
        await asyncio.to_thread(b.proc.wait, 30)
        took = time.monotonic() - t0
    finally:
        fleet.close()
    print(f"end: every member exited {took:.2f} s after the sentinel")
    assert took < 30
    assert list(members_dir(fleet_dir).glob("*.json")) == []
