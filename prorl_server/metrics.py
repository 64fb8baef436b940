"""Prometheus metrics of one server (prometheus-client, one registry per app: no process globals)."""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from prorl_server.types import TokenStats

#: What a split reason code or a family label may look like; anything else is counted as ``other`` (label
#: values stay a small fixed set: the codes and families are the server's own names).
_LABEL = re.compile(r"[a-z][a-z0-9_]{0,63}")

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)

#: ``LLMClient.counters`` key → (counter name on /metrics, help), see :meth:`Metrics.export_counts`.
LLM_CLIENT_COUNTS: Mapping[str, tuple[str, str]] = {
    "requests": ("prorl_llm_requests", "Generation requests an LLM backend answered"),
    "backend_failures": ("prorl_llm_backend_failures", "Generation attempts that failed on a backend "
                         "(connection error, timeout, 5xx, an answer that is not JSON)"),
    "failovers": ("prorl_llm_failovers", "Generation attempts sent to another backend after such a failure"),
    "pause_retries": ("prorl_llm_pause_retries", "Generation attempts retried because the backend was paused "
                      "(a weight update) or aborted the turn"),
    "request_errors": ("prorl_llm_request_errors", "Generation requests a backend refused with a 4xx"),
    "tokens_discarded": ("prorl_llm_tokens_discarded", "Generated tokens thrown away: turns a backend aborted "
                         "(a pause in abort mode) that were sent again"),
    "swap_held": ("prorl_llm_swap_held", "LLM calls held in the server while a weight swap paused the backends"),
    "swap_moved": ("prorl_llm_swap_moved", "LLM calls moved off a backend that failed a weight swap"),
}
#: ``Gateway.counters`` key → (counter name on /metrics, help).
#: ``sandbox.pool.SandboxPool.counters`` key → (counter name on /metrics, help).
SANDBOX_POOL_COUNTS: Mapping[str, tuple[str, str]] = {
    "hits": ("prorl_sandbox_pool_hits", "Sandboxes handed out from the warm pool"),
    "misses": ("prorl_sandbox_pool_misses", "Cold starts of pooled specs because their pool was empty"),
    "dead": ("prorl_sandbox_pool_dead", "Pooled sandboxes found dead on acquire (closed, never handed out)"),
    "cold_fallbacks": ("prorl_sandbox_pool_cold_fallbacks", "Cold starts of pooled specs whose refill was "
                       "failing (disk, leases, cgroups)"),
    "refill_starts": ("prorl_sandbox_pool_refill_starts", "Sandbox starts run by the pool's refill"),
    "refill_failures": ("prorl_sandbox_pool_refill_failures", "Refill starts that failed"),
}
GATEWAY_COUNTS: Mapping[str, tuple[str, str]] = {
    "sessions": ("prorl_gateway_sessions", "Gateway sessions opened"),
    "rejected_sessions": ("prorl_gateway_rejected_sessions", "Gateway sessions refused (max_sessions open)"),
    "requests": ("prorl_gateway_requests", "Chat completions served by the gateway"),
    "splits": ("prorl_gateway_splits", "Trajectories split because a request's history was not a prefix of "
               "the one served"),
    "expired": ("prorl_gateway_expired_sessions", "Gateway sessions ended for being idle"),
}


class _Counts(Collector):
    """Counter families read at scrape time from a component's own running counts (a plain dict it increments:
    no Prometheus call on its hot path)."""

    def __init__(self, families: Mapping[str, tuple[str, str]], read: Callable[[], Mapping[str, float]]) -> None:
        self._families, self._read = dict(families), read

    def describe(self) -> Iterator[CounterMetricFamily]:
        return (CounterMetricFamily(name, doc) for name, doc in self._families.values())

    def collect(self) -> Iterator[CounterMetricFamily]:
        counts = self._read()
        for key, (name, doc) in self._families.items():
            yield CounterMetricFamily(name, doc, value=counts.get(key, 0))


class Metrics:
    """The server's metrics. ``render()`` gives the Prometheus text exposition format (bytes)."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.jobs_total = Counter("prorl_jobs_total", "Jobs finished, by handler and outcome "
                                  "(ok or the critical_error: init/run/eval/timeout/cancelled)",
                                  ["handler", "outcome"], registry=r)
        self.jobs_in_flight = Gauge("prorl_jobs_in_flight", "Jobs accepted and not yet finished", registry=r)
        self.queue_depth = Gauge("prorl_stage_queue_depth", "Jobs waiting for a worker, per stage",
                                 ["stage"], registry=r)
        self.active = Gauge("prorl_stage_active", "Jobs being worked on, per stage", ["stage"], registry=r)
        self.stage_latency = Histogram("prorl_stage_latency_seconds", "Wall time of one stage of one job",
                                       ["stage"], buckets=_LATENCY_BUCKETS, registry=r)
        self.reward = Histogram("prorl_job_reward", "Reward of finished jobs", ["handler"],
                                buckets=(0.0, 0.25, 0.5, 0.75, 1.0), registry=r)
        # the named components of each scored result (#35 part 2): what each process term did, weighted or not
        self.reward_component = Histogram("prorl_reward_component", "Value of each named reward component of "
                                          "finished jobs (outcome and the handler's process terms)",
                                          ["handler", "component"],
                                          buckets=(-1.0, -0.5, -0.25, -0.1, 0.0, 0.1, 0.25, 0.5, 1.0), registry=r)
        self.backend_in_flight = Gauge("prorl_backend_in_flight", "Jobs assigned to an LLM backend",
                                       ["backend"], registry=r)
        self.backend_healthy = Gauge("prorl_backend_healthy", "1 if the backend is in rotation",
                                     ["backend"], registry=r)
        self.backend_affinity = Counter("prorl_backend_affinity", "Jobs of a group (group_id) placed on their "
                                        "group's backend (hit) or elsewhere because of load or health (miss); "
                                        "a group's first job is not counted", ["outcome"], registry=r)
        for outcome in ("hit", "miss"):
            self.backend_affinity.labels(outcome)
        self.jobs_filtered = Counter("prorl_jobs_filtered_total", "Jobs whose result says filter=true (not to be "
                                     "trained on), by handler and failure_kind (sandbox, llm_backend, harness, "
                                     "agent_missing, timeout, cancelled, invalid_instance, handler, internal)",
                                     ["handler", "failure_kind"], registry=r)
        self.jobs_failed = Counter("prorl_jobs_failed_total", "Jobs that ended with a failure_kind, by handler, "
                                   "kind and whether the result is filtered: the scored kinds (model_crashed_sandbox, "
                                   "model_stalled_sandbox, model_timeout, model_crashed_grader, model_error) are what "
                                   "the model caused, scored 0.0 and trained on; a rising rate of one of them is a "
                                   "policy learning to crash or an infrastructure problem",
                                   ["handler", "failure_kind", "filtered"], registry=r)
        self.flagged_artifacts = Counter("prorl_flagged_artifacts_total", "Artifacts a handler's check flagged "
                                         "before grading (scored 0.0, not run; e.g. a SWE patch that touches the "
                                         "test machinery), by handler and rule", ["handler", "rule"], registry=r)
        self.tool_parse_errors = Counter("prorl_tool_parse_errors_total",
                                         "Malformed tool calls turned into error observations",
                                         ["handler"], registry=r)
        self.event_loop_lag = Histogram("prorl_event_loop_lag_seconds", "How late a task sleeping 50 ms woke up "
                                        "(anything holding the event loop delays every request by as much)",
                                        buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                                                 1, 2.5, 5, 10), registry=r)
        self.event_loop_lag_max = Gauge("prorl_event_loop_lag_max_seconds",
                                        "Largest event-loop lag of the last 10 s", registry=r)
        self.gc_seconds = Histogram("prorl_gc_seconds", "Garbage-collector pauses by generation (2 = full: every "
                                    "unfrozen object is walked, the event loop stopped meanwhile); see "
                                    "prorl_server.gc_control", ["generation"],
                                    buckets=(0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
                                    registry=r)
        self.gc_frozen_objects = Gauge("prorl_gc_frozen_objects", "Long-lived objects moved out of the "
                                       "collector's view (gc.freeze) at start and after large imports", registry=r)
        self._gc_by_generation = [self.gc_seconds.labels(str(g)) for g in range(3)]
        self.admission_limit = Gauge("prorl_admission_limit", "Jobs the admission gate lets run their stages at "
                                     "once (adapted to the event-loop lag; prorl_server.admission)", registry=r)
        self.admission_admitted = Gauge("prorl_admission_admitted", "Jobs admitted into their stages now",
                                        registry=r)
        self.admission_waiting = Gauge("prorl_admission_waiting", "Jobs waiting for admission (their wait is "
                                       "queue time, not charged to their timeout)", registry=r)
        self._backend_children: dict[str, tuple[Any, Any]] = {}
        self.trajectory_splits = Counter("prorl_trajectory_splits_total", "Trajectories split, by reason code "
                                         "(template_drops_generated_text, template_not_append_only: the chat "
                                         "template rewrote history; message_changed, history_truncated, "
                                         "tools_changed, unanswered_messages: a gateway agent's request did not "
                                         "extend the served history) and model family, counted when a job "
                                         "or a job-less gateway session ends", ["reason", "family"], registry=r)
        self.turns = Counter("prorl_turns_total", "Generated turns of finished jobs and gateway sessions, by model "
                             "family", ["family"], registry=r)
        self.continued_turns = Counter("prorl_continued_turns_total", "Generated turns the chat template would "
                                       "render differently (reformatting only), kept as generated, by model "
                                       "family", ["family"], registry=r)
        self.cpu_tasks = Counter("prorl_cpu_tasks_total", "Calls run in the CPU process pool (scoring), by "
                                 "outcome: ok, error (the function raised), timeout (worker killed), crashed",
                                 ["outcome"], registry=r)
        # Per-stage children resolved once: labels() costs a lock and a dict lookup on every job's hot path.
        stages = ("init", "run", "eval")
        self.stage_queue_depth = {s: self.queue_depth.labels(s) for s in stages}
        self.stage_active = {s: self.active.labels(s) for s in stages}
        self.stage_seconds = {s: self.stage_latency.labels(s) for s in stages}
        for s in stages:
            self.stage_queue_depth[s].set(0)
            self.stage_active[s].set(0)

    def admission_changed(self, limit: int, admitted: int, waiting: int) -> None:
        """The admission gate's state changed (:class:`prorl_server.admission.AdmissionGate` ``on_change``)."""
        self.admission_limit.set(limit)
        self.admission_admitted.set(admitted)
        self.admission_waiting.set(waiting)

    def gc_collected(self, generation: int, seconds: float) -> None:
        """One collection of ``generation`` (0-2) took ``seconds``
        (:class:`prorl_server.gc_control.CollectorControl`)."""
        self._gc_by_generation[generation].observe(seconds)

    def backend_changed(self, backend) -> None:
        if not backend.registered and backend.in_flight == 0:
            # Cleared and no job holds it: drop its series, or every address ever registered (relays on fresh
            # ports each weight update) stays in /metrics forever. A later add brings the series back.
            self._backend_children.pop(backend.address, None)
            for gauge in (self.backend_in_flight, self.backend_healthy):
                try:
                    gauge.remove(backend.address)
                except KeyError:
                    pass
            return
        children = self._backend_children.get(backend.address)
        if children is None:  # labels() takes a lock and builds a key: once per address, not per job
            children = self._backend_children[backend.address] = (self.backend_in_flight.labels(backend.address),
                                                                   self.backend_healthy.labels(backend.address))
        children[0].set(backend.in_flight)
        # "in rotation": a backend taken out by /clear_llm_server reads 0 until it is re-added
        children[1].set(1 if backend.in_rotation else 0)

    def export_counts(self, families: Mapping[str, tuple[str, str]],
                      read: Callable[[], Mapping[str, float]]) -> None:
        """Expose a component's running counts on /metrics: for each ``key -> (name, help)`` of ``families``
        (e.g. :data:`LLM_CLIENT_COUNTS`), the counter ``<name>_total`` with the value ``read()[key]`` (0 when
        absent) at every scrape. ``read`` must be cheap and must not raise. Raises ``ValueError`` when a name is
        already registered."""
        self.registry.register(_Counts(families, read))

    def count_token_stats(self, stats: "TokenStats") -> None:
        """Add one finished rollout's drift report (a job's, or a gateway session's without a job) to
        ``prorl_turns_total``, ``prorl_continued_turns_total`` and ``prorl_trajectory_splits_total``. A reason
        code or family that is not a plain lower-case name is counted as ``other``."""
        family = _label(stats.family or "unknown")
        if stats.turns:
            self.turns.labels(family).inc(stats.turns)
        if stats.continued:
            self.continued_turns.labels(family).inc(stats.continued)
        for code, n in stats.splits.items():
            if n > 0:
                self.trajectory_splits.labels(_label(code), family).inc(n)

    def affinity_decided(self, outcome: str) -> None:
        self.backend_affinity.labels(outcome).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _label(value: str) -> str:
    return value if _LABEL.fullmatch(value) else "other"
