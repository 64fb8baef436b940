"""Per-request latency through the gateway against the same chat request sent directly to vLLM.

Same run, same vLLM CPU server (the tiny model), same messages. Each agent (one gateway session) runs a
conversation of N turns; at every turn the same ``messages`` go, in alternating order, to

- **direct**: vLLM's own ``POST /v1/chat/completions`` (vLLM renders the template and tokenizes the whole
  history itself);
- **gateway**: ``POST {session base_url}/chat/completions`` on a rollout server in its own process
  (``python -m prorl_server``, as in production; prefix check, only the new messages tokenized, token-in/token-out ``/v1/completions`` to the same vLLM,
  tool-call parsing, trajectory recording).

Both generate exactly ``--gen-tokens`` tokens a turn (``min_tokens = max_tokens``). The conversation then
continues with the gateway's answer and a new user message, so both sides always see identical messages.

``added`` = the gateway request's latency seen by the agent minus the time of the gateway's own HTTP exchange
with vLLM (``backend_http_s``): what the gateway adds on top of generation (HTTP hop, JSON, prefix check,
tokenization, parsing, recording), taken from the session's counters (``GET /sessions/{id}``, outside the
timed requests). ``inside`` = the part of it spent inside the gateway's handler (the rest is the HTTP hop and
waiting for the server's event loop, which 32 concurrent sessions on a busy 2-core machine share with vLLM).
The end-to-end p50/p99 of both sides are printed beside it.

Scenarios: 1 and 32 concurrent sessions with 8 turns, 1 session with 64 turns.

    python benchmarks/gateway_overhead.py [--address http://127.0.0.1:PORT] [--model-dir DIR]

(a server given with ``--address`` needs ``--enable-auto-tool-choice --tool-call-parser hermes``: the requests
carry ``tools``.)

Without ``--address`` it builds the tiny model (``.cache/tiny-model``) and starts its own vLLM server.
The last line printed is one JSON object with ``added_p50_ms_c1``, ``added_p50_ms_c32``,
``added_p50_ms_64turns`` (and p99s, the direct and gateway p50s of each scenario).
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import aiohttp  # noqa: E402


TOOLS = [{"type": "function", "function": {"name": "bash", "description": "Run a shell command.",
                                           "parameters": {"type": "object",
                                                          "properties": {"cmd": {"type": "string"}}}}}]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))
    return xs[k]


async def agent(http: aiohttp.ClientSession, server: str, vllm: str, model: str, turns: int, gen: int,
                seed: int, out: dict[str, list[float]]) -> None:
    async with http.post(f"{server}/sessions", json={}) as r:
        s = await r.json()

    async def counters() -> dict[str, float]:
        async with http.get(f"{server}/sessions/{s['session_id']}") as r:
            return (await r.json())["counters"]

    messages = [{"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": f"Fix the bug in file_{seed}.py."}]
    sp = {"max_tokens": gen, "min_tokens": gen, "temperature": 1.0}
    for turn in range(turns):
        body = {"model": model, "messages": messages, "tools": TOOLS, "seed": seed * 1000 + turn, **sp}

        async def direct() -> float:
            t0 = time.perf_counter()
            async with http.post(f"{vllm}/v1/chat/completions", json=body) as r:
                data = await r.json()
            assert "choices" in data, data
            return time.perf_counter() - t0

        async def gateway() -> tuple[float, dict]:
            t0 = time.perf_counter()
            async with http.post(f"{s['base_url']}/chat/completions", json=body) as r:
                data = await r.json()
            total = time.perf_counter() - t0
            assert "choices" in data, data
            return total, data

        before = await counters()
        if turn % 2 == 0:
            d = await direct()
            g, data = await gateway()
        else:
            g, data = await gateway()
            d = await direct()
        after = await counters()
        http_s = after["backend_http_s"] - before["backend_http_s"]
        out["direct"].append(d)
        out["gateway"].append(g)
        out["added"].append(g - http_s)
        out["inside"].append(after["gateway_s"] - before["gateway_s"] + after["llm_s"] - before["llm_s"] - http_s)
        msg = data["choices"][0]["message"]
        messages = messages + [msg, {"role": "user", "content": f"Now run the tests ({turn})."}]
    async with http.post(f"{server}/sessions/{s['session_id']}/finalize") as r:
        result = await r.json()
    assert len(result["trajectories"]) == 1 and not result["split_reasons"], result["split_reasons"]


async def scenario(http, server, vllm, model, sessions: int, turns: int, gen: int) -> dict:
    out: dict[str, list[float]] = {"direct": [], "gateway": [], "added": [], "inside": []}
    await asyncio.gather(*(agent(http, server, vllm, model, turns, gen, k, out) for k in range(sessions)))
    ms = 1e3
    return {"sessions": sessions, "turns": turns, "requests": len(out["added"]),
            "direct_p50_ms": pct(out["direct"], 50) * ms, "gateway_p50_ms": pct(out["gateway"], 50) * ms,
            "direct_p99_ms": pct(out["direct"], 99) * ms, "gateway_p99_ms": pct(out["gateway"], 99) * ms,
            "added_p50_ms": pct(out["added"], 50) * ms, "added_p99_ms": pct(out["added"], 99) * ms,
            "inside_p50_ms": pct(out["inside"], 50) * ms, "inside_p99_ms": pct(out["inside"], 99) * ms}


def start_server(vllm: str) -> tuple[subprocess.Popen, str]:
    """A rollout server in its own process (``prorl-server``), as agents see it in production."""
    ready = Path(tempfile.mkdtemp(prefix="gw-bench-")) / "ready.json"
    proc = subprocess.Popen([sys.executable, "-m", "prorl_server", "--port", "0", "--ready-file", str(ready),
                             "--backend", vllm, "--log-level", "WARNING"], cwd=ROOT)
    deadline = time.monotonic() + 120
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("the rollout server did not start")
        time.sleep(0.1)
    return proc, json.loads(ready.read_text())["url"]


async def run(vllm: str, gen: int) -> list[dict]:
    proc, server = start_server(vllm)
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
            async with http.get(f"{vllm}/v1/models") as r:
                model = (await r.json())["data"][0]["id"]
            await scenario(http, server, vllm, model, 2, 4, gen)  # warm-up: connections, tokenizer, caches
            return [await scenario(http, server, vllm, model, 1, 8, gen),
                    await scenario(http, server, vllm, model, 32, 8, gen),
                    await scenario(http, server, vllm, model, 1, 64, gen)]
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--address", help="an already running vLLM server (default: start one)")
    ap.add_argument("--model-dir", default=str(ROOT / ".cache" / "tiny-model"))
    ap.add_argument("--gen-tokens", type=int, default=16, help="tokens generated per turn")
    args = ap.parse_args()

    server = None
    if args.address is None:
        from prorl_server import tiny_model
        from prorl_server.vllm_launcher import start_vllm

        tiny_model.build(args.model_dir)
        t0 = time.monotonic()
        # vLLM parses hermes tool calls too, so both sides do the same work per answer
        server = start_vllm(args.model_dir, max_model_len=8192, max_num_batched_tokens=8192,
                            extra_args=["--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
        print(f"vLLM ready at {server.address} in {time.monotonic() - t0:.0f} s", flush=True)
        address = server.address
    else:
        address = args.address.rstrip("/")
    try:
        rows = asyncio.run(run(address, args.gen_tokens))
    finally:
        if server is not None:
            server.stop()

    cols = ["sessions", "turns", "requests", "direct_p50_ms", "gateway_p50_ms", "direct_p99_ms", "gateway_p99_ms",
            "added_p50_ms", "added_p99_ms", "inside_p50_ms", "inside_p99_ms"]
    print(" ".join(f"{c:>14}" for c in cols))
    for r in rows:
        print(" ".join(f"{r[c]:>14.2f}" if isinstance(r[c], float) else f"{r[c]:>14}" for c in cols))
    c1, c32, t64 = rows
    summary = {"added_p50_ms_c1": round(c1["added_p50_ms"], 3), "added_p50_ms_c32": round(c32["added_p50_ms"], 3),
               "added_p50_ms_64turns": round(t64["added_p50_ms"], 3),
               "added_p99_ms_c1": round(c1["added_p99_ms"], 3), "added_p99_ms_c32": round(c32["added_p99_ms"], 3),
               "added_p99_ms_64turns": round(t64["added_p99_ms"], 3)}
    for name, r in (("c1", c1), ("c32", c32), ("64turns", t64)):
        summary[f"inside_p50_ms_{name}"] = round(r["inside_p50_ms"], 3)
        summary[f"direct_p50_ms_{name}"] = round(r["direct_p50_ms"], 3)
        summary[f"gateway_p50_ms_{name}"] = round(r["gateway_p50_ms"], 3)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
