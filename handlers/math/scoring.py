"""Reward for the ``math`` handler: the last ``\\boxed{...}`` of the final answer, checked with math-verify
(inline instances) or with reasoning-gym's own ``score_answer`` (reasoning-gym instances)."""
from __future__ import annotations

from typing import Any, Optional


def last_boxed(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{...}`` in ``text`` (balanced braces), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i = start + len("\\boxed{")
    depth = 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i:j]
    return None


def score(instance: dict[str, Any], response: str) -> tuple[float, dict[str, Any]]:
    """Reward in [0, 1] for ``response`` (the agent's final text) and details for the result.

    The extracted answer is the last ``\\boxed{}``; with none, the reward is 0.0.
    """
    answer = last_boxed(response)
    info: dict[str, Any] = {"extracted_answer": answer}
    if answer is None:
        info["reason"] = "no \\boxed{} answer"
        return 0.0, info
    entry = instance.get("rg_entry")
    if entry is not None:
        from reasoning_gym import get_score_answer_fn

        fn = get_score_answer_fn(entry["metadata"]["source_dataset"])
        reward = float(fn(answer, entry))
        info["scorer"] = "reasoning_gym"
        return reward, info
    from math_verify import parse, verify

    gold = parse(f"${instance['answer']}$")
    pred = parse(f"\\boxed{{{answer}}}")
    info["scorer"] = "math_verify"
    return (1.0 if verify(gold, pred) else 0.0), info
