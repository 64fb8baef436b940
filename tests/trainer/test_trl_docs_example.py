"""The TRL page's example as written (issue #32 part 6): its Python block builds its instances from a shipped
dataset (a placeholder ``instances = [...]`` before), sets a learning rate that learns (GRPOConfig's default 1e-6
moved the tiny model nowhere), and its vLLM server binds 127.0.0.1 (the development endpoints listened on every
interface). The block runs here up to the trainer: ``GRPOTrainer`` is stood in for by a recorder of its arguments
(training itself is what ``benchmarks/learning_curve.py`` measures, with the same settings)."""
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
