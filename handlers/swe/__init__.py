"""``swe``: SWE-Gym / R2E-Gym-style repository tasks scored by FAIL_TO_PASS / PASS_TO_PASS tests on a clean
test harness (see README.md here)."""
from handlers.swe.handler import SweHandler
from handlers.swe.harness import harness_paths, junit_key, parse_junit, report_statuses

__all__ = ["SweHandler", "harness_paths", "junit_key", "parse_junit", "report_statuses"]
