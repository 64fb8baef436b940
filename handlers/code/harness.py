"""Hidden-test harness for the ``code`` handler, run INSIDE the eval sandbox:

    python -m handlers.code.harness SOLUTION.py TESTS.py ENTRY_POINT

Executes the solution, then the tests' ``check(candidate)`` on ``ENTRY_POINT`` (the HumanEval protocol), and
prints one JSON line: ``{"passed": bool, "error": str|None, "failed_test": str|None}``; ``failed_test`` is the
source line of the assertion that failed. Exit status 0 when passed, 1 otherwise. The caller enforces the
time limit.
"""
from __future__ import annotations

import json
import sys
import traceback


def run(solution_path: str, tests_path: str, entry_point: str) -> dict:
    ns: dict = {"__name__": "__solution__"}
    try:
        with open(solution_path) as f:
            exec(compile(f.read(), solution_path, "exec"), ns)
    except FileNotFoundError:
        return {"passed": False, "error": f"no solution file at {solution_path}", "failed_test": None}
    except BaseException as e:  # the solution may raise anything, SystemExit included
        return {"passed": False, "error": f"solution failed to load: {type(e).__name__}: {e}", "failed_test": None}
    if entry_point not in ns or not callable(ns[entry_point]):
        return {"passed": False, "error": f"solution defines no function {entry_point!r}", "failed_test": None}
    try:
        with open(tests_path) as f:
            exec(compile(f.read(), tests_path, "exec"), ns)
        ns["check"](ns[entry_point])
    except BaseException as e:
        frames = [fr for fr in traceback.extract_tb(e.__traceback__) if fr.filename == tests_path]
        failed = frames[-1].line if frames else None
        return {"passed": False, "error": f"{type(e).__name__}: {e}".strip(), "failed_test": failed}
    return {"passed": True, "error": None, "failed_test": None}


def main() -> int:
    if len(sys.argv) != 4:
        print("usage: python -m handlers.code.harness SOLUTION.py TESTS.py ENTRY_POINT", file=sys.stderr)
        return 2
    result = run(*sys.argv[1:])
    sys.stdout.flush()
    print("HARNESS_RESULT " + json.dumps(result), flush=True)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
