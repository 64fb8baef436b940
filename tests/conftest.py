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
    from prorl_server.dev.tiny_model import build

    return build(ROOT / ".cache" / "tiny-model")


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def start_vllm_server(model_dir: Path, tag: str):
    pytest.importorskip("vllm")
    from prorl_server.dev.vllm_launcher import start_vllm

    log = ROOT / ".cache" / "logs" / f"vllm-{tag}-{os.getpid()}.log"
    # max_num_batched_tokens = max_model_len: no chunked prefill, so seeded requests are safe on CPU
    # (see prorl_server.dev.vllm_launcher.plan_vllm).
    return start_vllm(model_dir, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=MAX_MODEL_LEN,
                      log_path=log, timeout_s=300)


@pytest.fixture(scope="session")
def vllm_server(tiny_model_dir):
    """The session's real vLLM CPU server (``.address``); dev mode on, so ``/pause`` and ``/resume`` work."""
    server = start_vllm_server(tiny_model_dir, "main")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def vllm_ext_server(tiny_model_dir):
    """A real vLLM CPU server started with the project's worker extension
    (``trainer_plugins.vllm_weights.WeightLoaderExtension``: weight loads and the progress report a weight
    swap reads), shared by the session's tests that load weights into a running engine."""
    pytest.importorskip("vllm")
    from prorl_server.dev.vllm_launcher import start_vllm

    log = ROOT / ".cache" / "logs" / f"vllm-ext-{os.getpid()}.log"
    server = start_vllm(tiny_model_dir, max_model_len=1024, max_num_batched_tokens=1024, log_path=log,
                        timeout_s=300,
                        extra_args=["--worker-extension-cls", "trainer_plugins.vllm_weights.WeightLoaderExtension"])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def fake_llm(request, tiny_model_dir):
    """``prorl_server.dev.timed_llm`` (8 tokens a turn), the labelled stand-in for a GPU vLLM whose turns take the test
    module's ``TURN_S`` seconds, in its own session: its URL; its process group is killed after the module.
    For the fleet tests (real processes, and the Slurm tier, whose nodes both reach this machine)."""
    model_dir, turn_s = tiny_model_dir, request.module.TURN_S
    import json
    import signal
    import subprocess
    import sys
    import tempfile
    import time

    port_file = Path(tempfile.mkdtemp(prefix="fleet-llm-")) / "port.json"
    proc = subprocess.Popen([sys.executable, "-m", "prorl_server.dev.timed_llm", "--model-dir", str(model_dir),
                             "--turn-s", str(turn_s), "--tokens", "8", "--port-file", str(port_file)],
                            cwd=str(ROOT), start_new_session=True)
    for _ in range(300):
        if port_file.exists():
            break
        time.sleep(0.1)
    else:
        proc.kill()
        pytest.fail("the fake LLM did not start")
    yield f"http://127.0.0.1:{json.loads(port_file.read_text())['port']}"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


# ------------------------------------------------------------------------------------------ sandboxes
def sandbox_processes() -> list:
    """Sandbox processes (bwrap launchers and execution servers) below this test process. Used to CHECK
    cleanup only; nothing is ever killed by name."""
    import psutil

    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if "sandbox.exec_server" in cmd or p.name() == "bwrap":
            out.append(p)
    return out


@pytest.fixture
def sandbox_procs():
    """The :func:`sandbox_processes` check, for tests."""
    return sandbox_processes


@pytest.fixture
def bwrap_runtime():
    import shutil

    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (apt-get install bubblewrap; .ci/install does it)")
    from sandbox import make_runtime

    return make_runtime("bubblewrap")


# ------------------------------------------------------------------------------------------ scripted policy
@pytest.fixture
def scripted_policy(aiohttp_server, tokenizer, tiny_model_dir):
    """A labelled TEST DOUBLE standing in for a capable model (the random tiny model writes no tool calls):
    an OpenAI-compatible ``/v1/completions`` server in vLLM's token-in/token-out dialect (``prompt`` = token
    ids; ``token_ids`` and ``logprobs`` in the answer) that replays a fixed script of assistant turns,
    tokenized with the tiny model's real tokenizer and ended with ``<|im_end|>`` as vLLM does.

    ``async (script) -> base URL``; ``script(prompt_text, turn) -> str`` is assistant turn ``turn`` (0-based)
    of the conversation whose rendered prompt is ``prompt_text``. Every completion returned is appended to
    ``start.returned`` as ``(token_ids, logprobs)``; a turn longer than ``max_tokens`` is cut
    (``finish_reason="length"``)."""
    from aiohttp import web

    end_id = tokenizer.convert_tokens_to_ids("<|im_end|>")

    async def start(script) -> str:
        async def models(request):
            return web.json_response({"data": [{"id": str(tiny_model_dir), "max_model_len": 16384}]})

        async def health(request):
            return web.Response()

        async def completions(request):
            body = await request.json()
            prompt = tokenizer.decode(body["prompt"])
            turn = prompt.count("<|im_start|>assistant") - 1
            ids = tokenizer.encode(script(prompt, turn), add_special_tokens=False) + [end_id]
            finish = "stop"
            if len(ids) > body["max_tokens"]:
                ids, finish = ids[:body["max_tokens"]], "length"
            lps = [-0.25 - 0.001 * k for k in range(len(ids))]
            start.returned.append((ids, lps))
            return web.json_response({"choices": [{
                "text": tokenizer.decode(ids), "token_ids": ids, "finish_reason": finish,
                "logprobs": {"tokens": [f"token_id:{i}" for i in ids], "token_logprobs": lps}}]})

        app = web.Application()
        app.router.add_get("/v1/models", models)
        app.router.add_get("/health", health)
        app.router.add_post("/v1/completions", completions)
        server = await aiohttp_server(app)
        return str(server.make_url("")).rstrip("/")

    start.returned = []
    return start
