"""``code``: HumanEval-style program synthesis in a sandbox, scored by hidden tests. See README.md here."""
from handlers.code.grading import GraderError
from handlers.code.handler import CodeHandler, evaluate_solution

__all__ = ["CodeHandler", "GraderError", "evaluate_solution"]
