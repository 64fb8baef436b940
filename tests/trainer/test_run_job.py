"""The main job (`prorl-run`): outputs, summary, dataset errors, and Ctrl-C cancelling on the server."""
from __future__ import annotations

import asyncio
import json
import signal
import sys

import pytest

from prorl_server.datasets import DatasetError, load_dataset
from trainer_plugins.run_job import build_parser, run


async def test_main_job_writes_results_and_summary(tmp_path, capsys):
    args = build_parser().parse_args(["--dataset", "arithmetic", "--limit", "5", "--samples", "3",
                                      "--out", str(tmp_path)])
    summary = await run(args)
    lines = [json.loads(x) for x in (tmp_path / "trajectories.jsonl").read_text().splitlines()]
    assert len(lines) == 15
    assert {r["instance_id"] for r in lines} == {f"arith-0-{i}" for i in range(5)}
    assert all(r["reward"] == 1.0 for r in lines)
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["jobs_finished"] == 15 and saved["mean_reward"] == 1.0 and saved["failures_by_phase"] == {}
    assert saved == json.loads(json.dumps(summary))
    assert "mean reward     1.000" in capsys.readouterr().out


def test_jsonl_dataset_and_clear_errors(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"data_source": "arithmetic", "expression": "1+1"}\n\n{"data_source": "calc", "expression": "2"}\n')
    insts = load_dataset(str(f))
    assert [i["instance_id"] for i in insts] == ["d-1", "d-3"]
    (tmp_path / "bad.jsonl").write_text('{"expression": "1"}\n')
    with pytest.raises(DatasetError, match="bad.jsonl:1"):
        load_dataset(str(tmp_path / "bad.jsonl"))
    with pytest.raises(DatasetError, match="unknown dataset"):
        load_dataset("no-such-dataset")


async def status(url: str) -> dict:
    import aiohttp

    async with aiohttp.ClientSession() as s:
        async with s.get(f"{url}/status") as r:
            return await r.json()


@pytest.mark.real
async def test_ctrl_c_cancels_outstanding_jobs_on_server_and_keeps_finished(serve_handlers, varied, tmp_path):
    url = await serve_handlers(varied)  # "varied": a stand-in handler that sleeps in run as the instance says
    data = tmp_path / "slow.jsonl"
    with data.open("w") as f:
        f.write(json.dumps({"data_source": "varied", "instance_id": "fast", "id": "fast"}) + "\n")
        for i in range(3):
            f.write(json.dumps({"data_source": "varied", "instance_id": f"slow{i}", "id": f"slow{i}",
                                "sleeps": [60]}) + "\n")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "trainer_plugins.run_job", "--dataset", str(data), "--server", url,
        "--concurrency", "4", "--out", str(tmp_path / "out"))
    for _ in range(1500):
        if (await status(url))["stages"]["run"]["active"] == 3:
            break
        await asyncio.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    assert await asyncio.wait_for(proc.wait(), 30) == 130
    results = [json.loads(x) for x in (tmp_path / "out" / "trajectories.jsonl").read_text().splitlines()]
    by_id = {r["instance_id"]: r for r in results}
    assert by_id["fast"]["reward"] == 1.0
    assert all(by_id[f"slow{i}"]["critical_error"] == "cancelled" for i in range(3))
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["interrupted"] is True
    assert (await status(url))["jobs_in_flight"] == 0


async def test_a_run_a_server_fault_stops_still_writes_its_summary_with_the_reason(serve_handlers, varied, tmp_path):
    # red team F10: prorl-run stopped on a job no server could run (every fleet member drained) with a
    # traceback and no summary.json, so the jobs that had finished were reported nowhere
    from prorl_server.dev.vllm_launcher import free_port

    good = await serve_handlers(varied)
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: each job sent there fails as rollout_server
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"data_source": "varied", "instance_id": f"i{i}", "id": f"i{i}"}) + "\n"
                            for i in range(6)))
    args = build_parser().parse_args(["--dataset", str(data), "--server", good, "--server", dead,
                                      "--max-sample-retries", "0", "--concurrency", "2", "--out", str(tmp_path)])
    with pytest.raises(RuntimeError, match="did not answer"):
        await run(args)
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["error"].startswith("RuntimeError: job ") and "did not answer" in saved["error"]
    assert saved["jobs_finished"] == len((tmp_path / "trajectories.jsonl").read_text().splitlines())
