"""The ``code`` handler: its eval scores truth on all 164 HumanEval problems, a scripted policy reaches reward
1.0 through the real server, and a real tiny-model rollout yields complete, token-true trajectories."""
from __future__ import annotations

import asyncio
import json

import pytest

from handlers.code import evaluate_solution
from handlers.code.data import humaneval_problems, load_dataset, to_instance, validate_instance



def tool_call(name: str, **arguments) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def test_humaneval_ships_164_problems_and_inline_instances_are_checked():
    assert len(load_dataset()) == 164
    inst = load_dataset(limit=1)[0]
    assert inst["instance_id"] == "HumanEval/0" and "canonical_solution" not in inst
    validate_instance(inst)
    with pytest.raises(ValueError, match="entry_point"):
        validate_instance({"prompt": "def f(): ...", "tests": "def check(c): pass"})


@pytest.mark.real
async def test_eval_scores_all_164_canonical_solutions_and_rejects_stubbed_bodies(sandbox_procs, bwrap_runtime):
    problems = list(humaneval_problems().values())
    sem = asyncio.Semaphore(6)

    async def score(problem, body):
        async with sem:
            return await evaluate_solution(bwrap_runtime.start, to_instance(problem), problem["prompt"] + body,
                                           timeout_s=30)

    good = await asyncio.gather(*(score(p, p["canonical_solution"]) for p in problems))
    assert sum(r for r, _ in good) == 164, [p["task_id"] for p, (r, _) in zip(problems, good) if r != 1.0]
    stubbed = await asyncio.gather(*(score(p, "    pass\n") for p in problems))
    raising = await asyncio.gather(*(score(p, "    raise NotImplementedError\n") for p in problems[:40]))
    assert sum(r for r, _ in stubbed) == 0 and sum(r for r, _ in raising) == 0
    assert all(info["error"] for _, info in stubbed)
    await bwrap_runtime.close_all()
    assert not sandbox_procs()


@pytest.mark.real
async def test_eval_reports_timeout_and_missing_solution(sandbox_procs, bwrap_runtime):
    problem = humaneval_problems()["HumanEval/0"]
    inst = to_instance(problem)
    reward, info = await evaluate_solution(bwrap_runtime.start, inst,
                                           problem["prompt"] + "    while True:\n        pass\n", timeout_s=2)
    assert reward == 0.0 and info["timed_out"] is True
    reward, info = await evaluate_solution(bwrap_runtime.start, inst, None)
    assert reward == 0.0 and "no solution.py" in info["error"]
    assert not sandbox_procs()


@pytest.mark.real
async def test_scripted_policy_solves_humaneval_through_real_server(sandbox_procs, rollout_server, scripted_policy):
    problems = [humaneval_problems()[f"HumanEval/{i}"] for i in (0, 2, 7)]
    solutions = {p["entry_point"]: p["prompt"] + p["canonical_solution"] for p in problems}

    def script(prompt: str, turn: int) -> str:
        entry = next(e for e in solutions if f"def {e}(" in prompt)
        if turn == 0:
            return "I will write the solution.\n" + tool_call("str_replace_editor", command="create",
                                                              path="/workspace/check.py", file_text="print(1)\n") \
                + tool_call("bash", command=f"cat > solution.py <<'EOF'\n{solutions[entry]}\nEOF\npython3 check.py")
        return tool_call("finish", answer="done")

    client = await rollout_server([await scripted_policy(script)])
    bodies = await asyncio.gather(*(client.post("/process", json={"instance": to_instance(p),
                                                                  "sampling_params": {"max_tokens": 2048}})
                                    for p in problems))
    results = [await b.json() for b in bodies]
    for r in results:
        assert r["critical_error"] is None, r["error"]
        assert r["reward"] == 1.0 and r["resolved"] is True, r["extra"].get("eval")
        assert r["extra"]["agent"]["finish_reason"] == "stop"
        (traj,) = r["trajectories"]
        assert traj["num_turns"] == 2
        assert len(traj["response_ids"]) == len(traj["loss_mask"]) == len(traj["response_logprobs"])
        gen = [lp for lp, m in zip(traj["response_logprobs"], traj["loss_mask"]) if m]
        policy_turns = [lps for _, lps in scripted_policy.returned]
        # exactly the policy's turns are trained on: the masked-in logprobs are two of its answers, in order
        assert any(gen == a + b for a in policy_turns for b in policy_turns)
        assert any(m == 0 for m in traj["loss_mask"])  # the tool observations are in, masked out
    assert not sandbox_procs()


@pytest.mark.real
async def test_tiny_model_rollout_is_complete_and_token_true(sandbox_procs, rollout_server, vllm_server, tokenizer):
    client = await rollout_server([vllm_server.address])
    inst = load_dataset(limit=1)[0]
    r = await (await client.post("/process", json={"instance": {**inst, "max_turns": 3},
                                                   "sampling_params": {"max_tokens": 48, "temperature": 1.0}})).json()
    assert r["critical_error"] is None, r["error"]
    assert r["reward"] == 0.0 and r["extra"]["eval"]["passed"] is False  # a random model solves nothing
    assert r["backend"] == vllm_server.address
    for traj in r["trajectories"]:
        n = len(traj["response_ids"])
        assert n and n == len(traj["loss_mask"]) == len(traj["response_logprobs"])
        assert sum(traj["loss_mask"]) >= 1
        assert all(lp == 0.0 for lp, m in zip(traj["response_logprobs"], traj["loss_mask"]) if not m)
        text = tokenizer.decode(traj["prompt_ids"] + traj["response_ids"])
        assert inst["prompt"].strip()[:60] in text
    assert not sandbox_procs()
