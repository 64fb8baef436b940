"""Fuzz tier: schemathesis against the ``/openapi.json`` of a real ``prorl-server`` process (token configured,
default handlers, no sandbox runtime): every operation, with data that fits its schema and data that does
not. Every answer must be in the schema (declared status, body, content type, ``Allow`` on 405), no answer a
5xx other than a declared 503, valid data is accepted and invalid data refused.

Bounded: ``FUZZ_EXAMPLES`` examples per operation and mode (default 300: about two minutes on two cores), and the
server's own limits keep each job short (a 1-s backend wait, a 10-s job timeout)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import not_a_server_error, positive_data_acceptance  # noqa: E402

TOKEN = "fuzz-token"
EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "300"))


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    config = d / "server.yaml"
    # Short limits so a fuzzed job ends quickly whatever it asks for (a backend address nobody answers on,
    # an LLM handler without a backend).
    config.write_text("backend_wait_s: 1\ndefault_timeout_s: 10\nllm_timeout_s: 5\nhealth_interval_s: 3600\n"
                      "completion_time_wait_s: 1\n")  # a fuzzed completion_time group is never completed
    ready = d / "ready.json"
    env = dict(os.environ, PRORL_TOKEN=TOKEN)
    log = (d / "server.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "prorl_server", "--config", str(config), "--port", "0",
                             "--ready-file", str(ready), "--log-level", "WARNING"], env=env, stdout=log,
                            stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parents[2])
    try:
        for _ in range(1200):  # until it listens (the test's own bound: 120 s)
            if ready.exists() or proc.poll() is not None:
                break
            time.sleep(0.1)
        assert ready.exists(), (d / "server.log").read_text()
        yield json.loads(ready.read_text())["url"]
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        server_log = (d / "server.log").read_text()
        assert "Traceback" not in server_log, server_log[-4000:]


@pytest.fixture(scope="module")
def api_schema(server_url):
    import urllib.request

    req = urllib.request.Request(f"{server_url}/openapi.json", headers={"Authorization": f"Bearer {TOKEN}"})
    doc = json.loads(urllib.request.urlopen(req, timeout=30).read())
    doc["servers"] = [{"url": server_url}]
    return schemathesis.openapi.from_dict(doc)


def _operations():
    """Operation labels of the server's schema, built in-process from the same route table (collection runs
    before the server starts; the test fuzzes the server's own ``/openapi.json``)."""
    from prorl_server.app import ROUTES
    from prorl_server.gateway import AGENT_ROUTES, MANAGEMENT_ROUTES

    # POST /drain makes the server finish its jobs and exit (tests/trainer/test_fleet*.py test it): fuzzing it
    # would end the server every later operation is fuzzed on. The weight-swap routes (added by
    # prorl_server.weight_swap, not in these tables) hold every LLM call for a lease; their validation is tested
    # in tests/core/test_weight_swap_keep.py.
    return [f"{r.method} {r.path}" for r in ROUTES + AGENT_ROUTES + MANAGEMENT_ROUTES if r.path != "/drain"]


@pytest.mark.real
@pytest.mark.parametrize("mode", ["positive", "negative"])
@pytest.mark.parametrize("label", _operations())
def test_server_answers_what_its_schema_says(api_schema, server_url, label, mode):
    """Schemathesis's default checks (no 5xx but declared ones, status codes, content types, response
    bodies and headers in the schema, valid data accepted, invalid data refused, 405s with ``Allow``)."""
    from hypothesis import given

    op = api_schema.find_operation_by_label(label)
    assert op is not None, f"{label} is in the route table but not in /openapi.json"

    declared = {c for c in op.definition.raw["responses"] if c.isdigit()}

    def valid_data_accepted(ctx, response, case):
        """Schemathesis's positive_data_acceptance, less the 422 of a handler's instance model: the schema's
        ``instance`` is generic (a ``data_source`` and any keys); each handler's own model checks the rest at
        submit, naming the field (``instance.<field>``)."""
        positive = case.meta.generation.mode.is_positive
        if positive and response.status_code == 422 and label in ("POST /process", "POST /jobs"):
            field = response.json()["error"].get("field") or ""
            if field.startswith("instance.") or field == "instance" and case.body["instance"].get("data_source"):
                return None
        return positive_data_acceptance(ctx, response, case)

    def no_undeclared_server_error(ctx, response, case):
        """Schemathesis's not_a_server_error, less the 5xx the operation declares (503: no backend)."""
        if response.status_code >= 500 and str(response.status_code) not in declared:
            raise AssertionError(f"undeclared server error {response.status_code}: {response.text[:500]}")
        return None

    @given(case=op.as_strategy(generation_mode=schemathesis.GenerationMode(mode)))
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def fuzz(case):
        case.call_and_validate(base_url=server_url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60,
                               excluded_checks=[not_a_server_error, positive_data_acceptance],
                               additional_checks=[no_undeclared_server_error, valid_data_accepted])

    from hypothesis.errors import Unsatisfiable

    try:
        fuzz()
    except Unsatisfiable:  # no parameter or body to make invalid: only the positive run applies
        assert mode == "negative", label
        pytest.skip(f"{label} takes nothing that can be made invalid")
