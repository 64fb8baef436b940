"""``swe``: SWE-Gym / R2E-Gym-style repository tasks scored by FAIL_TO_PASS / PASS_TO_PASS tests."""
from handlers.swe.handler import SweHandler, parse_pytest_report

__all__ = ["SweHandler", "parse_pytest_report"]
