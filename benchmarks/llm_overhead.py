"""Per-turn overhead of the token-in/token-out client + conversation state, against a bare request.

Same run, same vLLM CPU server (the tiny model), same token ids. Each turn of a rollout does, in
alternating order (so neither side always gets the other's prefix-cache warm-up):

- **bare**: one ``POST /v1/completions`` with the conversation's current token ids, the JSON answer
  parsed, nothing else (what any client must pay);
- **ours**: ``LLMClient.complete`` (same body) + ``Conversation.add_completion`` (decode) +
  ``Conversation.add_messages`` (render the template delta, tokenize only the new observation).

``added`` = our turn time minus the time of its own HTTP exchange (server, wire and JSON (de)coding, which
the bare request pays identically), i.e. what our code adds per turn; the end-to-end p50s of both sides
are printed beside it. A third column shows what re-rendering and re-tokenizing the whole conversation
each turn would cost instead (the approach that grows with the history).

Scenarios: short (~100-token) and 4k-token initial contexts, rollouts of 8 and 128 turns.

    python benchmarks/llm_overhead.py [--address http://127.0.0.1:PORT] [--model-dir DIR]

Without ``--address`` it builds the tiny model (``.cache/tiny-model``) and starts its own vLLM server.
The last line printed is one JSON object (``added_p50_ms_8turns``, ``added_p50_ms_128turns``,
``added_p99_ms_8turns``, ...); each is the larger of the short- and 4k-context figures.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import aiohttp  # noqa: E402

from _common import print_table, vllm_address  # noqa: E402 (benchmarks/, the script's folder)
from prorl_server.llm.conversation import Conversation  # noqa: E402
from prorl_server.llm.client import LLMClient  # noqa: E402
from prorl_server.stats import percentile  # noqa: E402



def long_text(n_chars: int) -> str:
    import textwrap

    src = Path(textwrap.__file__).read_text()
    return (src * (n_chars // len(src) + 1))[:n_chars]


async def scenario(address: str, tok, model: str, llm: LLMClient, session: aiohttp.ClientSession,
                   context: str, turns: int, gen_tokens: int) -> dict:
    user = "Fix the bug." if context == "short" else "Read this file:\n" + long_text(13_000)
    messages = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": user}]
    tools = [{"type": "function", "function": {"name": "bash", "description": "Run a shell command.",
                                               "parameters": {"type": "object",
                                                              "properties": {"cmd": {"type": "string"}}}}}]
    conv = Conversation(tok, messages, tools=tools, max_context_tokens=16384)
    initial = conv.num_tokens
    sp = {"temperature": 1.0}
    bare_s, ours_s, added_s, retok_s = [], [], [], []
    for turn in range(turns):
        ids = conv.token_ids
        body = {"model": model, "prompt": ids, "max_tokens": gen_tokens, "logprobs": 0,
                "return_tokens_as_token_ids": True, "n": 1, "stream": False, "echo": False,
                "add_special_tokens": False, **sp}

        async def bare() -> float:
            t0 = time.perf_counter()
            async with session.post(f"{address}/v1/completions", json=body) as r:
                data = json.loads(await r.read())
            assert "choices" in data, data
            return time.perf_counter() - t0

        async def ours() -> tuple[float, float]:
            t0 = time.perf_counter()
            comp = await llm.complete(conv.token_ids, backend=address, max_tokens=gen_tokens, sampling_params=sp)
            conv.add_completion(comp)
            obs = [{"role": "tool", "content": f"$ ls\nfile_{turn}.py  README.md\nexit code 0"}]
            assert await conv.add_messages(obs)
            total = time.perf_counter() - t0
            return total, total - comp.http_s

        if turn % 2 == 0:
            b = await bare()
            o, a = await ours()
        else:
            o, a = await ours()
            b = await bare()
        bare_s.append(b)
        ours_s.append(o)
        added_s.append(a)
        if turn in (turns // 2, turns - 1):  # what re-tokenizing everything would cost at this length
            t0 = time.perf_counter()
            text = tok.apply_chat_template([{k: v for k, v in m.items() if k != "tool_calls"}
                                            for m in conv.messages], tools=tools, tokenize=False,
                                           add_generation_prompt=True)
            tok.encode(text, add_special_tokens=False)
            retok_s.append(time.perf_counter() - t0)
    ms = 1e3
    return {
        "context": context, "turns": turns, "initial_tokens": initial, "final_tokens": conv.num_tokens,
        "bare_p50_ms": percentile(bare_s, 50) * ms, "bare_p99_ms": percentile(bare_s, 99) * ms,
        "ours_p50_ms": percentile(ours_s, 50) * ms, "ours_p99_ms": percentile(ours_s, 99) * ms,
        "added_p50_ms": percentile(added_s, 50) * ms, "added_p99_ms": percentile(added_s, 99) * ms,
        "added_mean_ms": statistics.fmean(added_s) * ms,
        "full_retokenize_last_ms": retok_s[-1] * ms,
    }


async def run(address: str, model_dir: str, gen_tokens: int) -> list[dict]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    async with aiohttp.ClientSession() as session, LLMClient(session) as llm:
        model = (await llm.model_info(address)).id
        # warm-up: connection, server compile paths, tokenizer caches
        await scenario(address, tok, model, llm, session, "short", 4, gen_tokens)
        rows = []
        for context in ("short", "4k"):
            for turns in (8, 128):
                rows.append(await scenario(address, tok, model, llm, session, context, turns, gen_tokens))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--address", help="an already running vLLM server (default: start one)")
    ap.add_argument("--model-dir", default=str(ROOT / ".cache" / "tiny-model"))
    ap.add_argument("--gen-tokens", type=int, default=16, help="tokens generated per turn")
    args = ap.parse_args()

    with vllm_address(args.address, args.model_dir, max_model_len=16384, max_num_batched_tokens=16384) as address:
        rows = asyncio.run(run(address, args.model_dir, args.gen_tokens))

    cols = ["context", "turns", "initial_tokens", "final_tokens", "bare_p50_ms", "ours_p50_ms", "bare_p99_ms",
            "ours_p99_ms", "added_p50_ms", "added_p99_ms", "full_retokenize_last_ms"]
    print_table(rows, cols)
    by = {(r["context"], r["turns"]): r for r in rows}
    s8, s128 = by[("4k", 8)], by[("4k", 128)]
    summary = {
        "added_p50_ms_8turns": round(max(s8["added_p50_ms"], by[("short", 8)]["added_p50_ms"]), 3),
        "added_p50_ms_128turns": round(max(s128["added_p50_ms"], by[("short", 128)]["added_p50_ms"]), 3),
        "added_p99_ms_8turns": round(max(s8["added_p99_ms"], by[("short", 8)]["added_p99_ms"]), 3),
        "added_p99_ms_128turns": round(max(s128["added_p99_ms"], by[("short", 128)]["added_p99_ms"]), 3),
        "bare_p50_ms_8turns": round(s8["bare_p50_ms"], 3),
        "ours_p50_ms_8turns": round(s8["ours_p50_ms"], 3),
        "bare_p50_ms_128turns": round(s128["bare_p50_ms"], 3),
        "ours_p50_ms_128turns": round(s128["ours_p50_ms"], 3),
        "full_retokenize_ms_128turns": round(s128["full_retokenize_last_ms"], 3),
    }
    summary["ratio_128_to_8"] = round(summary["added_p50_ms_128turns"] / summary["added_p50_ms_8turns"], 3)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
