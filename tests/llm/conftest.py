"""Fixtures of the LLM tier: the tiny model (built once, cached under ``<repo>/.cache/tiny-model``), its
tokenizer, and one real vLLM CPU server per session (started on first use, stopped at the end)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# The test server's context: small enough that the context-limit test fills it in seconds.
MAX_MODEL_LEN = 2048


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from prorl_server.tiny_model import build

    return build(ROOT / ".cache" / "tiny-model")


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def start_server(model_dir: Path, tag: str):
    pytest.importorskip("vllm")
    from prorl_server.vllm_launcher import start_vllm

    log = ROOT / ".cache" / "logs" / f"vllm-{tag}-{os.getpid()}.log"
    # max_num_batched_tokens = max_model_len: no chunked prefill, so seeded requests are safe on CPU
    # (see prorl_server.vllm_launcher.plan_vllm).
    return start_vllm(model_dir, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=MAX_MODEL_LEN,
                      log_path=log, timeout_s=300)


@pytest.fixture(scope="session")
def vllm_server(tiny_model_dir):
    """The session's vLLM server (``.address``); dev mode on, so ``/pause`` and ``/resume`` work."""
    server = start_server(tiny_model_dir, "main")
    yield server
    server.stop()


@pytest.fixture
def second_vllm_server(tiny_model_dir):
    """A second server for failover tests (the test may kill it; stopping a dead one is a no-op)."""
    server = start_server(tiny_model_dir, "second")
    yield server
    server.stop()
