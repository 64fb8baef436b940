"""Reward parity with verl (issue #22 item 7): rows of each data source the plugin maps get the reward verl's own
scorer (``verl.utils.reward_score.default_compute_score``) gives them.

Before: every row of verl's math datasets went to the ``math`` handler, whose scorer reads only the last
``\\boxed{}``; gsm8k asks for ``#### 72`` and DAPO/AIME for ``Answer: 42``, so a model that followed its prompt
scored 0 there. Now those rows get verl's scorer for their ``data_source`` (``reward_source: auto``).

Real: the rollout server (loopback), the agent loop as verl instantiates it, verl's scorers. Stand-in:
``FixedTrajectoryHandler`` (conftest) returns the final answer given, with the reward the ``math`` handler's
scorer gives that answer (checked below against the real scorer).
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("verl")
from verl.utils.reward_score import default_compute_score  # noqa: E402

from handlers.math.scoring import score as math_handler_score  # noqa: E402

_spec = importlib.util.spec_from_file_location("_verl_plugin_helpers4", Path(__file__).with_name("test_verl_plugin.py"))
plugin = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plugin)
cfg, worker = plugin.cfg, plugin.worker  # fixtures

# (data_source, final answer as the dataset's prompt asks for it, ground truth): right and wrong answers
SAMPLES = [
    ("openai/gsm8k", "48 / 2 = 24 clips in May, 48 + 24 = 72.\n#### 72", "72"),
    ("openai/gsm8k", "She sold 71.\n#### 71", "72"),
    ("lighteval/MATH", "So the probability is $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}"),
    ("DigitalLearningGmbH/MATH-lighteval", "Hence $\\boxed{5}$.", "5"),
    ("HuggingFaceH4/MATH-500", "The answer is $\\boxed{3}$.", "4"),
    ("math_dapo", "Adding them up gives 42.\nAnswer: 42", "42"),
    ("math_dapo", "Answer: 41", "42"),
    ("math_dapo_reasoning", "Answer: 7", "7"),
    ("aime2024", "Therefore m + n = 204.\nAnswer: 204", "204"),
    ("aime2025", "Answer: 12", "70"),
]


def verl_reward(source: str, text: str, truth: str) -> float:
    res = default_compute_score(source, text, truth)
    return float(res["score"]) if isinstance(res, dict) else float(res)


def row(source: str, text: str, truth: str) -> dict:
    """A verl row of ``source`` whose job ends with the assistant message ``text``; the server's reward is what
    the ``math`` handler's scorer gives it (the handler those rows were mapped to)."""
    server_reward, _ = math_handler_score({"answer": truth}, text)
    traj = {"prompt_ids": [1, 2, 3], "response_ids": [4, 5], "response_logprobs": [-0.1, -0.2], "loss_mask": [1, 1],
            "weight_versions": [0]}
    instance = {"data_source": "fixed", "trajectory": traj, "reward": server_reward,
                "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": text}]}
    return {"raw_prompt": np.array([{"role": "user", "content": "q"}], dtype=object), "data_source": source,
            "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {"index": 1, "instance": instance}, "index": 1}


@pytest.fixture
async def loop_on_server(cfg, worker, tokenizer, start_llm_server, monkeypatch):
    monkeypatch.setenv("PRORL_SERVERS", await start_llm_server())
    return lambda **settings: plugin.make_loop(cfg, tokenizer, **settings)


@pytest.mark.parametrize("source, text, truth", SAMPLES)
async def test_each_mapped_source_gets_verls_reward(loop_on_server, source, text, truth):
    out = await loop_on_server().run({}, **row(source, text, truth))
    expected = verl_reward(source, text, truth)
    assert out.reward_score == expected
    assert out.extra_fields["reward_extra_info"]["acc"] == float(expected >= 1.0)
    assert out.extra_fields["prorl"]["reward_source"] == "verl"


def test_the_math_handlers_scorer_alone_disagrees_with_verl_on_gsm8k_and_dapo_answers():
    """Why the plugin does not take the server's reward for these rows (what it did before)."""
    for source, text, truth in SAMPLES:
        ours, _ = math_handler_score({"answer": truth}, text)
        if "boxed" in text:
            assert ours == verl_reward(source, text, truth)  # MATH: both read the last box
        elif verl_reward(source, text, truth) == 1.0:
            assert ours == 0.0  # a right "#### 72" / "Answer: 42" scores 0 on \\boxed{} alone


async def test_reward_source_server_keeps_the_servers_reward(loop_on_server):
    out = await loop_on_server(reward_source="server").run({}, **row("math_dapo", "Answer: 42", "42"))
    assert out.reward_score == 0.0 and out.extra_fields["prorl"]["reward_source"] == "server"
