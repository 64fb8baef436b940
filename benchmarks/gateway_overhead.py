"""Per-request latency through the gateway against the same chat request sent directly to vLLM.

Same run, same vLLM CPU server (the tiny model), same messages. Each agent (one gateway session) runs a
conversation of N turns. Every turn, all agents of a scenario start together, and each sends the same
``messages`` at the same moment to

- **direct**: vLLM's own ``POST /v1/chat/completions`` (vLLM renders the template and tokenizes the whole
  history itself);
- **gateway**: ``POST {session base_url}/chat/completions`` on a rollout server in its own process
  (``python -m prorl_server``, as in production: prefix check, only the new messages tokenized,
  token-in/token-out ``/v1/completions`` to the same vLLM, tool-call parsing, trajectory recording).

The two requests of a pair land in the same vLLM batch, so the engine's step-to-step variance (large on a
2-core machine: hundreds of ms at 32 sessions) cancels out of their difference. Both generate exactly
``--gen-tokens`` tokens (``min_tokens = max_tokens``) and both ask for the sampled tokens' logprobs: the
gateway needs them for training (they are the behaviour policy's logprobs in each trajectory), so the direct
baseline does the same generation work. What vLLM itself spends producing those logprobs is printed
separately (1 session: direct alone with minus direct alone without). The cost is per engine step, paid once
by a batch in which any request asks for logprobs, as every request does in training. The conversation continues with the gateway's answer and a
new user message, so both sides always see identical messages.

Per request:

- ``added`` = gateway latency − direct latency of the same pair, as the agent sees them (the target: p50 under
  2 ms, flat in turn count).
- ``outside_backend`` = gateway latency − the gateway's own HTTP exchange with vLLM (``backend`` in the
  response's ``Server-Timing`` header): the hop to the gateway plus its work plus the waiting for its event
  loop (which, at 32 sessions, a busy 2-core machine shares with vLLM and this client).
- ``inside`` = the gateway handler's own time (``gateway`` in ``Server-Timing``: body parsing, prefix check,
  tokenization, tool-call parsing, recording).
- ``server_cpu_ms_per_request``: the rollout server process's CPU time (user + system) per gateway request.

Scenarios: 1 session (8 turns, 4 sessions one after another), 32 concurrent sessions (8 turns), 1 session with
64 turns; then the same 1-session scenario with the agent on the gateway's Anthropic Messages route
(``POST {base}/v1/messages``) and on its OpenAI Responses route (``POST {base}/v1/responses``), each paired with
the same conversation sent to vLLM's ``/v1/chat/completions``. Those two APIs have no ``seed`` nor
``min_tokens``, so neither side of their pairs has them: a pair counts only when both sides generated the same
number of tokens (``pairs_dropped`` says how many did not).

    python benchmarks/gateway_overhead.py [--address http://127.0.0.1:PORT] [--model-dir DIR]
        [--event-loop auto|uvloop|asyncio]

(a server given with ``--address`` needs ``--enable-auto-tool-choice --tool-call-parser hermes``: the requests
carry ``tools``.)

Without ``--address`` it builds the tiny model (``.cache/tiny-model``) and starts its own vLLM server.
The last line printed is one JSON object with ``added_p50_ms_c1``, ``added_p50_ms_c32``,
``added_p50_ms_64turns``, ``added_p50_ms_messages``, ``added_p50_ms_responses`` (and p99s, ``outside_backend`` and ``inside`` p50s, the direct and gateway p50s
of each scenario, ``logprobs_cost_p50_ms_c1``, and ``direct_reconnects``: direct requests sent again because
vLLM closed this client's idle keep-alive connection as they went out, a race of the client's connection pool
on a loaded machine; the gateway's own client to vLLM does the same).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import aiohttp  # noqa: E402
import psutil  # noqa: E402

from _common import print_table, vllm_address  # noqa: E402 (benchmarks/, the script's folder)
from prorl_server.llm.client import KEEPALIVE_S  # noqa: E402
from prorl_server.stats import percentile  # noqa: E402


TOOLS = [{"type": "function", "function": {"name": "bash", "description": "Run a shell command.",
                                           "parameters": {"type": "object",
                                                          "properties": {"cmd": {"type": "string"}}}}}]


def api_request(api: str, base_url: str, messages: list[dict], gen: int) -> tuple[str, dict[str, Any]]:
    """(URL, body) of the gateway request of ``api`` (``messages`` or ``responses``) carrying the Chat
    Completions ``messages`` (a system message, then user / plain assistant turns) and :data:`TOOLS`."""
    system, rest = messages[0]["content"], messages[1:]
    fn = TOOLS[0]["function"]
    if api == "messages":
        return f"{base_url}/messages", {
            "model": "m", "system": system, "messages": rest, "max_tokens": gen, "temperature": 1.0,
            "tools": [{"name": fn["name"], "description": fn["description"], "input_schema": fn["parameters"]}]}
    items = [{"role": m["role"], "content": m["content"]} for m in rest]
    return f"{base_url}/responses", {
        "model": "m", "instructions": system, "input": items, "max_output_tokens": gen, "temperature": 1.0,
        "store": False, "tools": [{"type": "function", **fn}]}


def api_answer(api: str, data: dict[str, Any]) -> tuple[str, int]:
    """(the assistant's text, generated tokens) of a ``chat``, ``messages`` or ``responses`` answer."""
    if api == "chat":
        return data["choices"][0]["message"]["content"] or "", data["usage"]["completion_tokens"]
    if api == "messages":
        text = "".join(b["text"] for b in data["content"] if b["type"] == "text")
        return text, data["usage"]["output_tokens"]
    text = "".join(c["text"] for o in data["output"] if o["type"] == "message" for c in o["content"])
    return text, data["usage"]["output_tokens"]



def server_timing(header: str) -> dict[str, float]:
    """``Server-Timing`` (W3C) → ``{name: seconds}``."""
    out = {}
    for part in header.split(","):
        name, _, dur = part.strip().partition(";dur=")
        out[name] = float(dur) / 1e3
    return out


async def agent(http: aiohttp.ClientSession, server: str, vllm: str, model: str, turns: int, gen: int,
                seed: int, out: dict[str, list[float]], without_logprobs: bool, barrier: asyncio.Barrier,
                api: str = "chat") -> None:
    """One agent's conversation. Every turn, all agents of the scenario start together (``barrier``) and each
    sends its messages direct and through the gateway at the same moment: the pair lands in the same vLLM
    batch, so the engine's step-to-step variance cancels out of their difference. ``api``: the gateway route
    the agent uses (``chat``, ``messages``, ``responses``)."""
    async with http.post(f"{server}/sessions", json={}) as r:
        s = await r.json()

    messages = [{"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": f"Fix the bug in file_{seed}.py."}]
    sp = {"max_tokens": gen, "min_tokens": gen, "temperature": 1.0}
    if api != "chat":  # what the translated APIs can say
        sp = {"max_tokens": gen, "temperature": 1.0}
    for turn in range(turns):
        body = {"model": model, "messages": messages, "tools": TOOLS, **sp}
        if api == "chat":
            body["seed"] = seed * 1000 + turn
        got: dict[str, Any] = {}

        async def direct(logprobs: bool = True, key: str = "direct") -> None:
            for attempt in range(2):
                t0 = time.perf_counter()
                try:
                    async with http.post(f"{vllm}/v1/chat/completions", json={**body, "logprobs": logprobs}) as r:
                        data = await r.json()
                    break
                except aiohttp.ServerDisconnectedError:
                    # vLLM closed this client's pooled keep-alive connection as the request went out (idle
                    # past uvicorn's 5 s by its clock: a loaded machine delays when this client releases a
                    # connection). A client artifact, not a request vLLM served: sent again, and counted.
                    if attempt:
                        raise
                    out["direct_reconnects"].append(1.0)
            got[key] = time.perf_counter() - t0
            assert "choices" in data, data
            got[key + "_data"] = data

        async def gateway() -> None:
            url, req = (f"{s['base_url']}/chat/completions", body) if api == "chat" else \
                api_request(api, s["base_url"], messages, gen)
            t0 = time.perf_counter()
            async with http.post(url, json=req) as r:
                data = await r.json()
                timing = server_timing(r.headers["Server-Timing"])
            got["gateway"] = time.perf_counter() - t0
            assert r.status == 200, data
            got["data"], got["timing"] = data, timing

        await barrier.wait()
        await asyncio.gather(direct(), gateway())
        if without_logprobs:
            # vLLM's own cost of the logprobs, one request at a time: the cost is per engine step (a batch
            # pays it once if any of its requests asks), so a pair in one batch would hide it
            await barrier.wait()
            await direct(key="direct_lp")
            await barrier.wait()
            await direct(logprobs=False, key="direct_nolp")
            out["direct_nolp"].append(got["direct_nolp"])
            out["logprobs_cost"].append(got["direct_lp"] - got["direct_nolp"])
        g, d, timing = got["gateway"], got["direct"], got["timing"]
        text, generated = api_answer(api, got["data"])
        if generated == got["direct_data"]["usage"]["completion_tokens"]:
            out["direct"].append(d)
            out["gateway"].append(g)
            out["added"].append(g - d)
            out["outside_backend"].append(g - timing["backend"])
            out["inside"].append(timing["gateway"])
        else:  # one side stopped early (no min_tokens on the translated APIs): not the same work
            out["pairs_dropped"].append(1.0)
        msg = got["data"]["choices"][0]["message"] if api == "chat" else {"role": "assistant", "content": text}
        messages = messages + [msg, {"role": "user", "content": f"Now run the tests ({turn})."}]
    async with http.post(f"{server}/sessions/{s['session_id']}/finalize") as r:
        result = await r.json()
    assert len(result["trajectories"]) == 1 and not result["split_reasons"], result["split_reasons"]


async def scenario(http, server, vllm, model, sessions: int, turns: int, gen: int, repeat: int = 1,
                   without_logprobs: bool = False, server_proc: Optional[psutil.Process] = None,
                   api: str = "chat") -> dict:
    """``sessions`` concurrent agents of ``turns`` turns each, ``repeat`` times in a row, on route ``api``."""
    out: dict[str, list[float]] = {k: [] for k in ("direct", "direct_nolp", "logprobs_cost", "gateway", "added",
                                                   "outside_backend", "inside", "direct_reconnects",
                                                   "pairs_dropped")}
    cpu0 = sum(server_proc.cpu_times()[:2]) if server_proc else 0.0
    for r in range(repeat):
        barrier = asyncio.Barrier(sessions)
        await asyncio.gather(*(agent(http, server, vllm, model, turns, gen, r * sessions + k, out, without_logprobs,
                                     barrier, api) for k in range(sessions)))
    ms = 1e3
    row = {"api": api, "sessions": sessions, "turns": turns, "requests": len(out["added"]),
           "pairs_dropped": len(out.pop("pairs_dropped"))}
    if server_proc:  # the rollout server's CPU time (user + system) per gateway request
        row["server_cpu_ms_per_request"] = (sum(server_proc.cpu_times()[:2]) - cpu0) / len(out["added"]) * ms
    row["direct_reconnects"] = len(out.pop("direct_reconnects"))
    for k, v in out.items():
        if v:
            row[f"{k}_p50_ms"] = percentile(v, 50) * ms
            row[f"{k}_p99_ms"] = percentile(v, 99) * ms
    return row


def start_server(vllm: str, event_loop: str) -> tuple[subprocess.Popen, str]:
    """A rollout server in its own process (``prorl-server``), as agents see it in production."""
    ready = Path(tempfile.mkdtemp(prefix="gw-bench-")) / "ready.json"
    proc = subprocess.Popen([sys.executable, "-m", "prorl_server", "--port", "0", "--ready-file", str(ready),
                             "--backend", vllm, "--log-level", "WARNING", "--event-loop", event_loop], cwd=ROOT)
    deadline = time.monotonic() + 120
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("the rollout server did not start")
        time.sleep(0.1)
    return proc, json.loads(ready.read_text())["url"]


async def run(vllm: str, gen: int, event_loop: str) -> list[dict]:
    proc, server = start_server(vllm, event_loop)
    sp = psutil.Process(proc.pid)
    try:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
        async with aiohttp.ClientSession(connector=connector) as http:
            async with http.get(f"{vllm}/v1/models") as r:
                model = (await r.json())["data"][0]["id"]
            await scenario(http, server, vllm, model, 2, 4, gen)  # warm-up: connections, tokenizer, caches
            return [await scenario(http, server, vllm, model, 1, 8, gen, repeat=4, without_logprobs=True,
                                   server_proc=sp),
                    await scenario(http, server, vllm, model, 32, 8, gen, server_proc=sp),
                    await scenario(http, server, vllm, model, 1, 64, gen, server_proc=sp),
                    await scenario(http, server, vllm, model, 1, 8, gen, repeat=4, server_proc=sp, api="messages"),
                    await scenario(http, server, vllm, model, 1, 8, gen, repeat=4, server_proc=sp, api="responses")]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--address", help="an already running vLLM server (default: start one)")
    ap.add_argument("--model-dir", default=str(ROOT / ".cache" / "tiny-model"))
    ap.add_argument("--gen-tokens", type=int, default=16, help="tokens generated per turn")
    ap.add_argument("--event-loop", default="auto", choices=["auto", "uvloop", "asyncio"],
                    help="the rollout server's event loop (prorl-server --event-loop)")
    args = ap.parse_args()

    # vLLM parses hermes tool calls too, so both sides do the same work per answer
    with vllm_address(args.address, args.model_dir, max_model_len=8192, max_num_batched_tokens=8192,
                      extra_args=["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]) as address:
        rows = asyncio.run(run(address, args.gen_tokens, args.event_loop))

    cols = ["api", "sessions", "turns", "requests", "pairs_dropped",
            "direct_p50_ms", "gateway_p50_ms", "direct_p99_ms", "gateway_p99_ms",
            "added_p50_ms", "added_p99_ms", "outside_backend_p50_ms", "inside_p50_ms", "inside_p99_ms",
            "server_cpu_ms_per_request"]
    print_table(rows, cols)
    c1, c32, t64, messages, responses = rows
    lp_cost = c1["logprobs_cost_p50_ms"]
    print(f"vLLM's own cost of the logprobs the gateway records (direct alone with minus without, 1 session, p50): "
          f"{lp_cost:.2f} ms")
    summary = {}
    for name, r in (("c1", c1), ("c32", c32), ("64turns", t64), ("messages", messages), ("responses", responses)):
        for k in ("added_p50_ms", "added_p99_ms", "outside_backend_p50_ms", "inside_p50_ms", "direct_p50_ms",
                  "gateway_p50_ms", "server_cpu_ms_per_request"):
            summary[f"{k}_{name}"] = round(r[k], 3)
    summary["direct_reconnects"] = sum(r["direct_reconnects"] for r in rows)
    summary["pairs_dropped"] = sum(r["pairs_dropped"] for r in rows)
    summary["direct_nolp_p50_ms_c1"] = round(c1["direct_nolp_p50_ms"], 3)
    summary["logprobs_cost_p50_ms_c1"] = round(lp_cost, 3)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
