"""The ``math`` handler: scoring truth on real reasoning-gym problems and math-verify, and a real rollout.
Reward integrity (gamed answers score 0.0) is in test_reward_integrity_math.py; the CPU pool that scoring
runs in, in tests/core/test_cpu_pool.py."""
from __future__ import annotations

import pytest

from handlers.math.data import load_reasoning_gym
from handlers.math.scoring import last_boxed, score
from prorl_server.datasets import DatasetError, load_dataset


@pytest.mark.parametrize("task", ["gsm_symbolic", "basic_arithmetic", "chain_sum"])
def test_reasoning_gym_reference_answers_score_one_and_wrong_answers_do_not(task):
    instances = load_reasoning_gym(task, limit=8, seed=7)
    assert len({i["question"] for i in instances}) > 1
    for inst in instances:
        assert score(inst, f"The answer is \\boxed{{{inst['answer']}}}")[0] == 1.0
        wrong, info = score(inst, "\\boxed{-987654321.5}")
        assert wrong < 1.0 and info["scorer"] == "reasoning_gym"
        assert score(inst, "I don't know")[0] == 0.0


def test_reasoning_gym_generation_is_seeded():
    assert load_reasoning_gym("gsm_symbolic", limit=3, seed=1) == load_reasoning_gym("gsm_symbolic", limit=3, seed=1)
    assert load_reasoning_gym("gsm_symbolic", limit=3, seed=1) != load_reasoning_gym("gsm_symbolic", limit=3, seed=2)


def test_math_verify_inline_answers():
    assert score({"answer": "1/2"}, "so \\boxed{\\frac{1}{2}}")[0] == 1.0
    assert score({"answer": "0.5"}, "\\boxed{\\frac{1}{2}}")[0] == 1.0
    assert score({"answer": "3"}, "\\boxed{4}")[0] == 0.0
    assert last_boxed("a \\boxed{x^{2}} then \\boxed{\\frac{a}{b}}") == "\\frac{a}{b}"


def test_serving_math_imports_no_scorer_on_the_event_loop():
    # math-verify/sympy/reasoning-gym take ~0.5-2 s to import: a server importing them lazily on its event
    # loop would stall every job the first time an answer is scored. Only the CPU pool's workers import them.
    import subprocess
    import sys

    code = ("import sys; from prorl_server.plugin.registry import HandlerRegistry; HandlerRegistry().load_entry_points(); "
            "import prorl_server.app, handlers.math.handler; "
            "print(sorted(m for m in ('sympy', 'math_verify', 'reasoning_gym') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_reasoning_gym_partial_credit_is_kept_as_information_only():
    inst = load_reasoning_gym("basic_arithmetic", limit=1, seed=7)[0]
    reward, info = score(inst, f"\\boxed{{{inst['answer']}0}}")
    assert reward == 0.0 and 0.0 < info["scorer_score"] < 1.0 and "partial credit" in info["reason"], info


def test_unknown_reasoning_gym_task_is_a_clear_error():
    with pytest.raises(DatasetError, match="no task 'not_a_task'"):
        load_dataset("reasoning-gym:not_a_task")


@pytest.mark.real
async def test_tiny_model_math_rollout_is_well_formed(sandbox_procs, rollout_server, vllm_server):
    client = await rollout_server([vllm_server.address])
    inst = load_reasoning_gym("basic_arithmetic", limit=1, seed=3)[0]
    r = await (await client.post("/process", json={"instance": {**inst, "max_turns": 2},
                                                   "sampling_params": {"max_tokens": 32}})).json()
    assert r["critical_error"] is None, r["error"]
    ev = r["extra"]["eval"]
    assert isinstance(r["reward"], float) and 0.0 <= r["reward"] <= 1.0
    assert ev.get("scorer") == "reasoning_gym" or ev.get("reason") == "no \\boxed{} answer", ev
    (traj, *_) = r["trajectories"]
    assert len(traj["response_ids"]) == len(traj["loss_mask"]) and sum(traj["loss_mask"]) >= 1
    assert not sandbox_procs()
