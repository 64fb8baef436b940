"""Reward integrity of the ``math`` handler: answers that try to game the scorer score 0.0,
honest answers score 1.0. The policy is an adversary; each case below is a class of shortcut, tried as a
policy would. The rules are in handlers/math/README.md ("Scoring rules").

Everything is real: math-verify, reasoning-gym's scorers, the CPU pool and the server. The only double is
the agent's run (``AnswerMathHandler``: the final answer is given in the instance).
"""
from __future__ import annotations

import asyncio
import functools

import pytest

from handlers.math.data import load_reasoning_gym
from handlers.math.handler import MathHandler
from handlers.math.scoring import MAX_ANSWER_CHARS, score
from prorl_server.plugin.registry import HandlerRegistry
from prorl_server.app import create_app
from prorl_server.config import ServerSettings

# (gold, response): several candidates, only the last box counts, and a list never wins.
CANDIDATE_LISTS = [
    ("2", "\\boxed{1, 2, 3, 4, 5}"),
    ("2", "\\boxed{2} \\boxed{1}"),
    ("2", "\\boxed{2, 3}"),
    ("2", "\\boxed{2; 3}"),
    ("2", "\\boxed{2 \\text{ or } 3}"),
    ("3", "\\boxed{2 \\lor 3}"),  # math-verify's default extraction reads the right operand: 3
    ("3", "\\boxed{2 \\vee 3}"),
    ("2", "\\boxed{1 \\boxed{2}}"),  # a box in the box
    ("2", "\\boxed{1, \\fbox{2}}"),
    ("2", "\\boxed{@@ $2$}"),  # an unparsable box hiding a parsable fragment
    ("2", "\\boxed{\\{1,2,3\\} $2$}"),
    ("2", "\\boxed{2 \\pm 1}"),
    ("-2", "\\boxed{\\pm 2}"),
    ("2", "\\boxed{x = 1, 2, 3}"),
    ("2", "\\boxed{x \\in \\{1, 2, 3\\}}"),
    ("2", "\\boxed{x = 3 = 2}"),
    ("2", "\\boxed{3 = 2}"),
    ("2", "\\boxed{\\{2\\} \\cup \\{3\\}}"),
    ("2", "\\boxed{2, 2, 2}"),  # a set, even of one value: only a set gold matches a set
    ("2", "\\boxed{\\{2\\}}"),
]
# Sets and intervals that cover the gold, and sets against a gold of another shape.
COVERING = [
    ("2", "\\boxed{[1, 3]}"),
    ("2", "\\boxed{(0, 5)}"),
    ("2", "\\boxed{(-\\infty, \\infty)}"),
    ("2", "\\boxed{\\mathbb{R}}"),
    ("2", "\\boxed{x \\in \\mathbb{R}}"),
    ("2", "\\boxed{1 < x < 3}"),
    ("2", "\\boxed{x \\geq 0}"),
    ("(1,2)", "\\boxed{\\{1, 2\\}}"),  # an interval/point gold is not matched by a set
    ("\\{1, 2\\}", "\\boxed{(1, 2)}"),
    ("\\{1, 2\\}", "\\boxed{1, 2, 3}"),
]
# Free variables, infinities and near misses.
FREE_AND_NEAR = [
    ("2", "\\boxed{x}"),
    ("2", "\\boxed{n}"),
    ("2", "\\boxed{x, 2}"),
    ("2", "\\boxed{2x}"),
    ("x+1", "\\boxed{y+1}"),
    ("2", "\\boxed{\\infty}"),
    ("2", "\\boxed{\\emptyset}"),
    ("2", "\\boxed{2.000001}"),
    ("2", "\\boxed{2 \\text{ but maybe } 3}"),
    ("2", "\\boxed{}"),
    ("2", "\\boxed{2"),  # never closed
    ("2", "the answer is 2"),  # no box
]
HONEST = [
    ("2", "\\boxed{2}"),
    ("2", "I first thought \\boxed{3}, but checking again: \\boxed{2}"),
    ("2", "\\boxed{x = 2}"),
    ("2", "\\boxed{\\frac{4}{2}}"),
    ("2", "\\boxed{2 \\text{ apples}}"),  # units and words in \text are dropped (documented)
    ("2", "\\boxed{2}. (Not 3.)"),  # text outside the box is ignored
    ("0.5", "\\boxed{\\dfrac{1}{2}}"),
    ("\\sqrt{2}", "\\boxed{1.41421356}"),
    ("3\\sqrt{2}", "\\boxed{\\sqrt{18}}"),
    ("(x+1)^2", "\\boxed{x^2+2x+1}"),
    ("\\{1, 2\\}", "\\boxed{2, 1}"),
    ("\\{1, 2\\}", "\\boxed{x=1 \\text{ or } x=2}"),
    ("(1,2)", "\\boxed{(1, 2)}"),
    ("[1,3]", "\\boxed{[1, 3]}"),
    ("1 \\le x \\le 3", "\\boxed{[1, 3]}"),
    ("(-\\infty, 2]", "\\boxed{(-\\infty, 2]}"),
    ("\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}", "\\boxed{\\begin{pmatrix}1&2\\\\3&4\\end{pmatrix}}"),
    ("y = 2x+1", "\\boxed{2x+1}"),
    ("\\frac{1}{3}", "\\boxed{\\frac13}"),
    ("1000", "\\boxed{1,000}"),
    ("30", "\\boxed{30^\\circ}"),
    ("1", "\\boxed{\\sin^2(x)+\\cos^2(x)}"),  # a variable that cancels
]


@pytest.mark.parametrize("gold,response", CANDIDATE_LISTS + COVERING + FREE_AND_NEAR)
def test_gamed_answers_score_zero(gold, response):
    reward, info = score({"answer": gold}, response)
    assert reward == 0.0, info


@pytest.mark.parametrize("gold,response", HONEST)
def test_honest_answers_score_one(gold, response):
    reward, info = score({"answer": gold}, response)
    assert reward == 1.0, info


@pytest.mark.parametrize("response", [
    "\\boxed{1, \\boxed{2}}", "\\boxed{2, 3}", "\\boxed{[1, 3]}", "\\boxed{x}", "\\boxed{}"])
def test_gamed_answers_say_why(response):
    reward, info = score({"answer": "2"}, response)
    assert reward == 0.0 and info.get("reason"), info


def test_an_answer_too_long_to_score_is_refused_unread():
    reward, info = score({"answer": "2"}, "\\boxed{" + "1+" * MAX_ANSWER_CHARS + "1}")
    assert reward == 0.0 and "longer than" in info["reason"]


@pytest.mark.parametrize("response", [
    "\\boxed{10^{10^{10^{10}}}}",  # comparing evaluates a tower of powers
    "\\boxed{(10^{10})!}",
    "\\boxed{2^{2^{31}} - 1}",
])
def test_answers_that_make_the_scorer_time_out_score_zero(response):
    # math-verify's own limits, made short here (the handler keeps its defaults): 0.0 and a reason.
    reward, info = score({"answer": "2"}, response, parse_timeout_s=1, verify_timeout_s=1)
    assert reward == 0.0 and "timed out" in info["reason"], info


@pytest.mark.parametrize("task", ["gsm_symbolic", "basic_arithmetic", "chain_sum"])
def test_reasoning_gym_candidate_lists_and_partial_credit_score_zero(task):
    inst = load_reasoning_gym(task, limit=1, seed=7)[0]
    gold = inst["answer"]
    assert score(inst, f"\\boxed{{{gold}}}")[0] == 1.0
    for gamed in (f"\\boxed{{1, {gold}, 3}}", f"\\boxed{{{gold} \\text{{ or }} 5}}", f"\\boxed{{[{gold}, {gold}]}}",
                  f"\\boxed{{{gold}}} \\boxed{{5}}", f"\\boxed{{5 \\text{{ or }} {gold}}}"):
        reward, info = score(inst, gamed)
        assert reward == 0.0, (gamed, info)


class AnswerMathHandler(MathHandler):
    """The real ``math`` handler's eval (CPU pool, limits), with its run replaced by a TEST DOUBLE standing
    in for the agent: the final answer is ``instance["response"]`` (no LLM, no sandbox)."""

    name = "math_answer"
    aliases = ()
    needs_llm = False
    score_timeout_s = 3.0  # below math-verify's own 5 s: the server's hard limit is what ends the slow one

    async def init(self, job):
        pass

    async def run(self, job):
        job.state.final_answer = job.instance["response"]


async def test_an_answer_that_hangs_the_scorer_scores_zero_without_stalling_other_jobs(aiohttp_client):
    registry = HandlerRegistry()
    registry.register(AnswerMathHandler())
    client = await aiohttp_client(create_app(ServerSettings(cpu_workers=2, health_interval_s=3600),
                                             registry=registry))

    async def process(response: str) -> dict:
        body = {"instance": {"data_source": "math_answer", "question": "1+1?", "answer": "2", "response": response}}
        return await (await client.post("/process", json=body)).json()

    # Both workers started and math-verify imported in each, so the honest job below costs only its scoring.
    assert [r["reward"] for r in await asyncio.gather(process("\\boxed{2}"), process("\\boxed{2}"))] == [1, 1]
    slow = asyncio.create_task(process("\\boxed{10^{10^{10^{10}}}}"))
    await asyncio.sleep(0.5)
    honest = asyncio.create_task(process("\\boxed{2}"))
    done, _ = await asyncio.wait({slow, honest}, return_when=asyncio.FIRST_COMPLETED)
    assert honest in done  # the slow answer holds one worker, not the server
    r = honest.result()
    assert r["reward"] == 1.0 and r["critical_error"] is None, r
    r = await slow
    assert r["critical_error"] is None and r["reward"] == 0.0, r
    assert "ran past 3 s" in r["extra"]["eval"]["reason"]
    r = await process("\\boxed{\\frac{4}{2}}")  # the replaced worker serves the next job
    assert r["reward"] == 1.0, r


def test_scoring_is_deterministic_across_calls():
    # A pool worker keeps math-verify's caches between jobs: a gamed answer must not score differently
    # after an honest one was scored for the same gold (or the reverse).
    s = functools.partial(score, {"answer": "2"})
    assert [s("\\boxed{2}")[0], s("\\boxed{2, 3}")[0], s("\\boxed{2}")[0], s("\\boxed{2, 3}")[0]] == [1, 0, 1, 0]
