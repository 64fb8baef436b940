"""Fixtures of the LLM tier beyond the shared ones in tests/conftest.py (``tiny_model_dir``, ``tokenizer``,
``vllm_server``: one server for the whole session): a second server for failover tests, and the family test
models (``family_model_dir``)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def second_vllm_server(tiny_model_dir, vllm_server):
    """A second server like ``vllm_server`` (same context length) that a failover test may kill; stopping a
    dead one is a no-op."""
    pytest.importorskip("vllm")
    from prorl_server.dev.vllm_launcher import start_vllm

    limit = vllm_server.plan.argv[vllm_server.plan.argv.index("--max-model-len") + 1]
    server = start_vllm(tiny_model_dir, max_model_len=int(limit), max_num_batched_tokens=int(limit),
                        log_path=ROOT / ".cache" / "logs" / f"vllm-second-{os.getpid()}.log", timeout_s=300)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def family_model_dir():
    """``family_model_dir(template) -> Path``: the tiny model carrying a bundled family chat template
    (:func:`prorl_server.dev.tiny_model.build` ``template=``), built once per template into .cache/tiny-model-<name>."""
    pytest.importorskip("transformers")
    from prorl_server.dev.tiny_model import build

    return lambda template: build(ROOT / ".cache" / f"tiny-model-{template}", template=template)
