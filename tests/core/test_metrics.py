"""GET /metrics carries every metric the server defines, and the components' own running counts reach it.

A metric is "defined" where the source constructs a prometheus-client ``Counter``/``Gauge``/``Histogram``/
``Summary``/``Info``/``Enum`` with a literal name (found with ``ast``, so a new one is covered without editing
this test), or where a running-counts table (``LLM_CLIENT_COUNTS``, ``GATEWAY_COUNTS``) names one.
"""
from __future__ import annotations

import ast
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from prorl_server.gateway import GATEWAY
from prorl_server.llm.client import LLMClient
from prorl_server.metrics import GATEWAY_COUNTS, LLM_CLIENT_COUNTS

ROOT = Path(__file__).resolve().parents[2]
METRIC_KINDS = {"Counter", "Gauge", "Histogram", "Summary", "Info", "Enum"}
PACKAGES = ("prorl_server", "handlers", "sandbox", "trainer_plugins", "singularity")


def defined_metrics() -> dict[str, str]:
    """Family name (as the text format's parser reports it: a counter without ``_total``) → where it is
    defined."""
    out: dict[str, str] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.Call) or not node.args:
                    continue
                kind = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                first = node.args[0]
                if kind in METRIC_KINDS and isinstance(first, ast.Constant) and isinstance(first.value, str):
                    name = first.value.removesuffix("_total") if kind == "Counter" else first.value
                    out[name] = f"{path.relative_to(ROOT)}:{node.lineno}"
    for table in (LLM_CLIENT_COUNTS, GATEWAY_COUNTS):
        for name, _ in table.values():
            out[name] = "prorl_server/metrics.py (running counts)"
    return out


def families(text: str) -> dict[str, list]:
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def test_the_scan_finds_the_server_metrics():
    # Guards the scan itself: if it found nothing, the next test could not fail.
    found = defined_metrics()
    for name in ("prorl_jobs", "prorl_stage_latency_seconds", "prorl_event_loop_lag_max_seconds",
                 "prorl_llm_failovers", "prorl_gateway_sessions"):
        assert name in found, sorted(found)


async def test_every_defined_metric_is_on_the_metrics_endpoint(make_client):
    client = await make_client()
    r = await client.get("/metrics")
    assert r.status == 200
    exported = families(await r.text())
    missing = {name: where for name, where in defined_metrics().items() if name not in exported}
    assert not missing, f"defined but not on /metrics: {missing}"


async def test_running_counts_are_all_exported_and_move_on_metrics(make_client):
    # Every key a component counts has a counter on /metrics (a new key must be added to its table).
    assert set(LLMClient().counters) == set(LLM_CLIENT_COUNTS)
    client = await make_client()
    assert set(client.app[GATEWAY].counters) == set(GATEWAY_COUNTS)

    r = await client.post("/process", json={"instance": {"data_source": "arithmetic", "expression": "2+3",
                                                         "answer": 5}})
    assert r.status == 200 and (await r.json())["reward"] == 1.0
    assert (await client.post("/sessions", json={})).status == 201
    exported = families(await (await client.get("/metrics")).text())
    assert [s.value for s in exported["prorl_gateway_sessions"] if s.name.endswith("_total")] == [1.0]
    jobs = {(s.labels["handler"], s.labels["outcome"]): s.value for s in exported["prorl_jobs"]
            if s.name.endswith("_total")}
    assert jobs == {("arithmetic", "ok"): 1.0}
