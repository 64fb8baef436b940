"""Shared pytest configuration. tests/ is not a package (verl ships a top-level ``tests`` package)."""
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


# ------------------------------------------------------------------------------------------ LLM tier
# Shared by every test directory so one vLLM server serves the whole session.
import pytest  # noqa: E402

# The test server's context: small enough that the context-limit test fills it in seconds.
MAX_MODEL_LEN = 2048


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tiny random Qwen2 model + locally trained tokenizer (built once, cached in .cache/tiny-model)."""
    pytest.importorskip("transformers")
    from prorl_server.tiny_model import build

    return build(ROOT / ".cache" / "tiny-model")


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def start_vllm_server(model_dir: Path, tag: str):
    pytest.importorskip("vllm")
    from prorl_server.vllm_launcher import start_vllm

    log = ROOT / ".cache" / "logs" / f"vllm-{tag}-{os.getpid()}.log"
    # max_num_batched_tokens = max_model_len: no chunked prefill, so seeded requests are safe on CPU
    # (see prorl_server.vllm_launcher.plan_vllm).
    return start_vllm(model_dir, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=MAX_MODEL_LEN,
                      log_path=log, timeout_s=300)


@pytest.fixture(scope="session")
def vllm_server(tiny_model_dir):
    """The session's real vLLM CPU server (``.address``); dev mode on, so ``/pause`` and ``/resume`` work."""
    server = start_vllm_server(tiny_model_dir, "main")
    yield server
    server.stop()
