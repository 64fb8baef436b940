"""The scripted black-box agent of ``benchmarks/tree_training.py`` (issue #34 part 5). It runs as a ``cli_agent`` job
(``python3 agent.py`` in the job's sandbox, this file's text shipped as ``agent.py``), speaks the OpenAI Chat
Completions API to its gateway session (``OPENAI_BASE_URL`` / ``OPENAI_API_KEY``, set by the handler's
launcher) with the standard library only, and follows ``script.json`` in its working directory:

    {"model": str, "system": str, "task": str, "rewrite": bool, "reward": float,
     "turns": [{"seed": int, "tokens": int, "observation": str | null}, ...]}

Turn k asks for exactly ``tokens`` generated tokens (``min_tokens = max_tokens``, so the tiny model's end of
turn cannot cut it short) with ``seed`` at temperature 1, then appends the assistant's answer as served and
``observation`` as a user message (the tool output or user turn; none after the last turn). Two samples given
the same seeds and observations for their first turns get the same tokens there (vLLM's per-request seeded
sampler), so a GRPO group branches where its scripts do.

``rewrite``: the agent compacts its own history every turn: once answered, its reply is replaced in the
history by a one-line note (``(reply k elided)``), so every request rewrites the previous answer and the
gateway closes the session's trajectory each turn (``split_reason`` ``message_changed``): one row per turn,
each holding the whole compacted history as its prompt. (It keeps no reply verbatim: the gateway renders a
split's history afresh, and the tiny random model's sampled tokens rarely re-tokenize to themselves, so a
re-sent reply would not share its sampled tokens anyway.)

At the end it posts ``{"reward_info": {"reward": reward}}`` to ``$PRORL_SESSION_URL/complete`` (the job's
``eval="reward_info"``: the reward is scripted, the benchmark measures training cost and exactness) and exits.
Exit status 1 with the HTTP error on stderr if a request fails.
"""
from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request
from typing import Any, Optional


def post(url: str, body: dict[str, Any], key: Optional[str] = None, timeout_s: float = 600.0) -> dict[str, Any]:
    """POST ``body`` as JSON to ``url`` (bearer ``key`` if given); the JSON answer (an object)."""
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())


def answer_message(message: dict[str, Any]) -> dict[str, Any]:
    """The assistant message to send back as history: the served ``message``'s role, content and tool calls,
    as served (what the gateway compares a history with)."""
    return {k: message[k] for k in ("role", "content", "tool_calls") if message.get(k) is not None}


def next_messages(messages: list[dict[str, Any]], answer: dict[str, Any], turn: int, observation: Optional[str],
                  rewrite: bool) -> list[dict[str, Any]]:
    """The history for the next request: ``messages`` (the request of ``turn``), the answer (``rewrite``: a note
    in its place), then ``observation`` as a user message (None: nothing after the answer)."""
    reply = {"role": "assistant", "content": f"(reply {turn} elided)"} if rewrite else answer_message(answer)
    out = messages + [reply]
    if observation is not None:
        out.append({"role": "user", "content": observation})
    return out


def main() -> int:
    with open("script.json") as f:
        script = json.load(f)
    base, key = os.environ["OPENAI_BASE_URL"].rstrip("/"), os.environ.get("OPENAI_API_KEY")
    messages = [{"role": "system", "content": script["system"]}, {"role": "user", "content": script["task"]}]
    for k, turn in enumerate(script["turns"]):
        body = {"model": script["model"], "messages": messages, "temperature": 1.0, "seed": turn["seed"],
                "max_tokens": turn["tokens"], "min_tokens": turn["tokens"]}
        try:
            data = post(f"{base}/chat/completions", body, key)
        except urllib.error.HTTPError as e:
            print(f"turn {k}: HTTP {e.code}: {e.read()[:2000]!r}", file=sys.stderr)
            return 1
        messages = next_messages(messages, data["choices"][0]["message"], k, turn["observation"], script["rewrite"])
    post(os.environ["PRORL_SESSION_URL"] + "/complete", {"reward_info": {"reward": script["reward"]}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
