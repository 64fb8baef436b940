"""The TRL page's example as written (issue #32 part 6): its Python block builds its instances from a shipped
dataset (a placeholder ``instances = [...]`` before), sets a learning rate that learns (GRPOConfig's default 1e-6
moved the tiny model nowhere), and its vLLM server binds 127.0.0.1 (the development endpoints listened on every
interface). The first test runs the block up to the trainer (``GRPOTrainer`` stood in for by a recorder of its
arguments); the second (real tier) runs the page's three steps for real to TRL's first optimizer step and its
weight push (learning itself is what ``benchmarks/learning_curve.py`` measures, with the same settings)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("trl")

PAGE = Path(__file__).resolve().parents[2] / "docs" / "training-trl.md"


def test_the_trl_example_builds_real_instances_and_a_learning_rate_that_learns():
    text = PAGE.read_text()
    block = re.findall(r"```python\n(.*?)```", text, re.S)[0]
    calls = {}

    def recorder(**kwargs):  # stands for GRPOTrainer: what the page builds it with
        calls.update(kwargs)
        return type("T", (), {"train": lambda self: calls.setdefault("trained", True)})()

    exec(compile(block.replace("from trl import GRPOConfig, GRPOTrainer", "from trl import GRPOConfig"), "page",
                 "exec"), {"GRPOTrainer": recorder})
    assert calls.get("trained")
    rows = list(calls["train_dataset"])
    assert len(rows) >= 8 and all(r["prompt"] for r in rows)
    assert calls["args"].learning_rate >= 1e-3, calls["args"].learning_rate  # the tiny model learns at 3e-3
    vllm = [line for line in re.findall(r"```bash\n(.*?)```", text, re.S)[0].splitlines() if "--model" in line]
    assert vllm and all("--host 127.0.0.1" in line for line in vllm), vllm


@pytest.mark.real
def test_the_trl_example_runs_as_written_to_one_optimizer_step(vllm_ext_server, tiny_model_dir, tmp_path):
    """Issue #32 part 6: the page's three steps run for real, to TRL's first optimizer step and its weight push.
    Step 1's vLLM is the session's server started with the page's worker extension, fp32 and eager, on 127.0.0.1
    (tests/conftest.py: the tier's one start of it; another port than 8000); step 2's ``prorl-server --backend``
    runs as a process on a free port; step 3's Python block runs as written with these addresses, the tiny
    model for ``/shared/models/my-model``, a temporary directory for ``/shared/run1`` and ``output_dir``, and
    ``max_steps=1`` added to its ``GRPOConfig`` (the page's recipe trains whole epochs)."""
    pytest.importorskip("vllm")
    import json
    import os
    import signal
    import subprocess
    import sys
    import time
    import urllib.request

    import trl

    text = PAGE.read_text()
    commands = re.findall(r"```bash\n(.*?)```", text, re.S)[0]
    server_line = next(line for line in commands.splitlines() if line.startswith("prorl-server"))
    assert "--backend http://127.0.0.1:8000" in server_line, server_line
    ready = tmp_path / "ready.json"
    args = server_line.replace("http://127.0.0.1:8000", vllm_ext_server.address).replace("--port 8080", "--port 0")
    server = subprocess.Popen([sys.executable, "-m", "prorl_server", *args.split()[1:], "--host", "127.0.0.1",
                               "--ready-file", str(ready)], cwd=tmp_path, start_new_session=True,
                              stdout=open(tmp_path / "server.log", "wb"), stderr=subprocess.STDOUT)
    try:
        for _ in range(600):
            if ready.exists() or server.poll() is not None:
                break
            time.sleep(0.1)
        assert ready.exists(), (tmp_path / "server.log").read_text()[-3000:]
        url = json.loads(ready.read_text())["url"]
        block = re.findall(r"```python\n(.*?)```", text, re.S)[0]
        block = (block.replace("http://127.0.0.1:8080", url).replace("http://127.0.0.1:8000", vllm_ext_server.address)
                 .replace("/shared/models/my-model", str(tiny_model_dir)).replace("/shared/run1", str(tmp_path / "run1"))
                 .replace('output_dir="out"', f'output_dir="{tmp_path / "out"}"'))

        def one_step_config(**kwargs):  # the page's GRPOConfig, stopped after one optimizer step
            return trl.GRPOConfig(**kwargs, max_steps=1, report_to="none")

        scope = {"GRPOConfig": one_step_config}
        code = block.replace("from trl import GRPOConfig, GRPOTrainer", "from trl import GRPOTrainer")
        t0 = time.monotonic()
        exec(compile(code, "docs/training-trl.md", "exec"), scope)
        wall = time.monotonic() - t0
        assert scope["trainer"].state.global_step == 1
        with urllib.request.urlopen(f"{url}/status", timeout=10) as r:
            backends = json.loads(r.read())["backends"]
        # WeightPushCallback pushed step 1's weights into vLLM and relabelled the backend with that version
        assert {b["address"]: b["weight_version"] for b in backends} == {vllm_ext_server.address: 1}, backends
        print(f"the TRL page's example: one optimizer step and its weight push in {wall:.0f} s")
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
        # the session's vLLM serves the next tests: give it the tiny model's own weights back
        import asyncio

        from trainer_plugins.trl.weights import load_into_backend, reset_prefix_cache

        async def restore():
            import aiohttp

            async with aiohttp.ClientSession() as s:
                await load_into_backend(s, vllm_ext_server.address, str(tiny_model_dir / "model.safetensors"), "")
                await reset_prefix_cache(s, vllm_ext_server.address)

        asyncio.run(restore())
