"""``code``: HumanEval-style program synthesis in a sandbox, scored by hidden tests. See README.md here.

:mod:`handlers.code.task` is the task (instance model, sandbox, scorer); :mod:`handlers.code.handler` drives it
with the tool agent loop.
"""
from handlers.code.grading import GraderError
from handlers.code.handler import CodeHandler
from handlers.code.task import CodeInstance, CodeSettings, evaluate_solution

__all__ = ["CodeHandler", "CodeInstance", "CodeSettings", "GraderError", "evaluate_solution"]
