"""Reward integrity of the ``math`` handler on reasoning-gym tasks (docs/reward-integrity.md, I1): nothing the
policy wrote is executed or evaluated outside a sandbox, and a scorer that chokes on an answer scores it 0.0.

reasoning-gym's own scorers evaluate some answers as Python (``eval``, sympy's ``parse_expr``). Before the
answer grammars, ``\\boxed{__import__('os').system('touch F')}`` on a countdown instance created F on the host
and an answer could read the target out of the scorer's frame and score 1.0. Everything here is real: the
installed reasoning-gym, its generators and scorers, math-verify, and the server with its CPU pool.
"""
from __future__ import annotations

import inspect
import re
import sys
import types

import pytest

from handlers.math.data import load_reasoning_gym
from handlers.math.rg_answers import GRAMMAR_OF, PLAIN_TASKS, SERVED_TASKS, grammar_error
from handlers.math.scoring import score


def hostile_answers(marker: str) -> dict[str, str]:
    """Answers that run code, read the gold out of the scorer, or end the scoring process, if evaluated."""
    return {
        "system": f"__import__('os').system('touch {marker}')",
        "exec": f"exec(\"open('{marker}', 'w')\")",
        "open": f"open('{marker}', 'w')",
        "frame_target": "__import__('sys')._getframe(1).f_locals['entry']['metadata']['target']",
        "frame_answer": "__import__('inspect').stack()[1].frame.f_locals['entry']['answer']",
        "exit": "exit(0)",
        "os_exit": "__import__('os')._exit(0)",
        "breakpoint": "breakpoint()",
        "lambda": "(lambda: open('" + marker + "', 'w'))()",
        "attribute": "x.__class__.__mro__[1].__subclasses__()",
        "globals": "globals()['np'].save('" + marker + "', 1)",
        "builtins_list": "[c for c in ().__class__.__base__.__subclasses__()]",
        "fstring": "f\"{open('" + marker + "', 'w')}\"",
        "walrus": "(y := open('" + marker + "', 'w'))",
        "unicode_name": "ｅｘｉｔ(0)",  # NFKC-normalised to exit by Python's parser
        "tower": "9**9**9**9",
        "factorial": "99999!!",
    }


@pytest.fixture(scope="module")
def entries():
    """Three real entries of every task whose scorer evaluates the answer."""
    return {task: load_reasoning_gym(task, limit=3, seed=7) for task in GRAMMAR_OF}


@pytest.mark.parametrize("task", sorted(GRAMMAR_OF))
def test_hostile_answers_never_reach_an_evaluating_scorer(tmp_path, entries, task):
    marker = tmp_path / "F"
    for name, answer in hostile_answers(str(marker)).items():
        assert grammar_error(task, answer) is not None, (task, name)  # so the scorer never sees it
        for inst in entries[task]:
            reward, info = score(inst, "\\boxed{" + answer + "}")
            assert reward == 0.0, (task, name, info)
            assert not marker.exists(), f"{task}: {name} ran on the host"


@pytest.mark.parametrize("task", sorted(GRAMMAR_OF))
def test_honest_answers_of_every_evaluating_task_still_score(entries, task):
    for inst in entries[task]:
        if "Integral(" in inst["answer"]:  # reasoning-gym could not integrate it: an answer naming Integral is not one
            continue
        reward, info = score(inst, "Done. \\boxed{" + inst["answer"] + "}")
        assert reward == 1.0, (task, inst["answer"], info)


def test_the_grammars_in_detail():
    ok = {"countdown": ["6*(98 - 54) - 34 - 66", "(1 + 2) / 3"],
          "polynomial_multiplication": ["-417560*y**6 + 295723*y**5", "x**2 - (3*x - 1)"],
          "simple_integration": ["-34*x**8/15 - 5*x/4 + C", "exp(x)*sin(x) + 1.5*x + C", "log(x, 2) + pi",
                                 "-4*(-2*x - 8)**(3/2)/3 + C", "x**-1", "sqrt(x)**(-1/2)"],
          "n_queens": ["_ Q _ _\n_ _ _ Q"]}
    refused = {"countdown": ["2**3", "x", "6*(98 - 54)!", "1 if 1 else 2", "1e3", "(((((((((((((((((((((((((((((((("
                             "((1))))))))))))))))))))))))))))))))))"],
               "polynomial_multiplication": ["xx", "N(x)", "S(1)", "x**999", "x**2**2", "x._", "9**99**99"],
               "simple_integration": ["Integral(x, x)", "Q", "N(x)", "x.diff()", "sin.__call__", "x**2**x",
                                      "_", "9**99999", "9**(9*9*9*9)", "x* *2", "exp(x)**(99999)"],
               "n_queens": ["_ Q (", "Q._", "'Q'", "[Q]", "Q+Q"]}
    for task, answers in ok.items():
        for a in answers:
            assert grammar_error(task, a) is None, (task, a)
    for task, answers in refused.items():
        for a in answers:
            assert grammar_error(task, a) is not None, (task, a)
    assert grammar_error("simple_integration", "X**2/2 + C", variable="X") is None
    assert grammar_error("simple_integration", "X**2/2 + C") is not None


def test_a_scorer_that_raises_on_the_answer_scores_zero():
    """Scorers that raise on some answers (prime_factorization: ValueError on ``(``; coin_flip: OverflowError on
    ``1e999999``): the answer's 0.0, never an exception that fails the job and gets it re-rolled."""
    for task, answer, raised in (("prime_factorization", "(", "ValueError"),
                                 ("coin_flip", "1e999999", "OverflowError")):
        (inst,) = load_reasoning_gym(task, limit=1)
        reward, info = score(inst, "\\boxed{" + answer + "}")
        assert reward == 0.0 and raised in info.get("reason", ""), (task, info)


# What counts as evaluating the answer in a scorer's source (reasoning-gym's own modules, transitively).
_EVALUATING = re.compile(r"\beval\(|\bexec\(|parse_expr|sympify|literal_eval|\bpickle\b|\bmarshal\b|__import__")
# Served as plain although their modules contain one of those: read, and the call never sees the answer.
_REVIEWED = {"basic_arithmetic": "eval of the generated expression (generation only)",
             "bitwise_arithmetic": "eval of the entry's problem (the gold); the answer goes through int(s, 0)",
             "number_sorting": "eval of the entry's answer (the gold); the answer goes through json.loads",
             "codeio": "exec of the dataset's own code (generation only)",
             "propositional_logic": "its own recursive-descent parser is named parse_expr"}


def _reasoning_gym_modules(module: types.ModuleType, seen: set[str]) -> None:
    if module.__name__ in seen:
        return
    seen.add(module.__name__)
    for value in vars(module).values():
        m = value if isinstance(value, types.ModuleType) else sys.modules.get(getattr(value, "__module__", "") or "")
        if m is not None and m.__name__.startswith("reasoning_gym.") and m.__name__ not in (
                "reasoning_gym.factory", "reasoning_gym.dataset", "reasoning_gym.composite"):
            _reasoning_gym_modules(m, seen)


def test_every_reasoning_gym_task_is_classified_and_plain_scorers_do_not_evaluate():
    """A reasoning-gym upgrade that adds a task, or makes a plain task's scorer evaluate, fails here (and the
    task is refused at submit until it is read and listed in handlers/math/rg_answers.py)."""
    from reasoning_gym.factory import DATASETS

    assert set(DATASETS) - {"composite"} == SERVED_TASKS
    assert not set(GRAMMAR_OF) & PLAIN_TASKS
    unreviewed = {}
    for task in sorted(PLAIN_TASKS):
        seen: set[str] = set()
        _reasoning_gym_modules(inspect.getmodule(DATASETS[task][0]), seen)
        hits = {name: sorted(set(_EVALUATING.findall(inspect.getsource(sys.modules[name])))) for name in seen}
        hits = {k: v for k, v in hits.items() if v}
        if hits and task not in _REVIEWED:
            unreviewed[task] = hits
    assert not unreviewed, unreviewed


async def test_an_unserved_task_is_refused_at_submit_with_the_field_named(aiohttp_client):
    from prorl_server.app import create_app
    from prorl_server.config import ServerSettings
    from prorl_server.plugin.registry import HandlerRegistry

    registry = HandlerRegistry()
    registry.load_entry_points()
    client = await aiohttp_client(create_app(ServerSettings(backends=["http://127.0.0.1:9"], health_interval_s=3600),
                                             registry=registry))
    (inst,) = load_reasoning_gym("countdown", limit=1)
    for source in ("composite", "a_task_added_later", 3):
        bad = {**inst, "rg_entry": {**inst["rg_entry"], "metadata": {**inst["rg_entry"]["metadata"],
                                                                      "source_dataset": source}}}
        r = await client.post("/jobs", json={"instance": bad})
        assert r.status == 422, await r.text()
        body = await r.json()
        assert body["error"]["field"].startswith("instance.rg_entry"), body
    with pytest.raises(ValueError, match="not served"):
        from handlers.math import rg_answers

        saved = rg_answers.PLAIN_TASKS
        try:
            rg_answers.PLAIN_TASKS = saved - {"chain_sum"}
            rg_answers.SERVED_TASKS = frozenset(rg_answers.GRAMMAR_OF) | rg_answers.PLAIN_TASKS
            load_reasoning_gym("chain_sum", limit=1)
        finally:
            rg_answers.PLAIN_TASKS = saved
            rg_answers.SERVED_TASKS = frozenset(rg_answers.GRAMMAR_OF) | saved
