"""The aiohttp application and the server's composition root: ``create_app(settings)``.

:func:`create_app` builds every component (metrics, backend pool, event-loop monitor, sandbox runtime and
opener, CPU pool, LLM context, gateway, pipeline) once, wires them by passing each what it needs (the jobs get
theirs as one :class:`~prorl_server.job.JobServices`), and starts and stops them in one explicit order
(:class:`Components`). No component finds another through the app. The app keys below expose them to
tests, benchmarks and the route handlers of this module.

The route table ``ROUTES`` is the one list of the rollout API's endpoints: it registers the handlers and
generates ``/openapi.json`` from the pydantic models in :mod:`prorl_server.types` (with the gateway's routes).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from typing import Any, Optional

import aiohttp
from aiohttp import web

from prorl_server.plugin.handler import InstanceValidationError
from prorl_server.plugin.registry import HandlerRegistry, UnknownHandlerError, default_registry
from prorl_server.balancer import BackendPool, NoBackendError
from prorl_server.completion_time import GroupConflictError
from prorl_server.config import ServerSettings, journal_path
from prorl_server.journal.store import Journal
from prorl_server.membership import FleetControl
from prorl_server.cpu_pool import DEFAULT_WORKERS, CpuPool
from prorl_server.admission import AdmissionGate
from prorl_server.gc_control import CollectorControl
from prorl_server.gateway import Gateway, add_gateway_routes, agent_app
from prorl_server.job import JobServices, SandboxOpener
from prorl_server.llm.context import LLMContext
from prorl_server.loop_monitor import LoopLagMonitor
from prorl_server.metrics import GATEWAY_COUNTS, LLM_CLIENT_COUNTS, SANDBOX_POOL_COUNTS, Metrics
from prorl_server.pipeline import (DuplicateJobError, FinishedJob, HandlerUnavailableError, JournalUnavailableError,
                                   MAX_GROUP_JOBS, Pipeline, ServerStoppedError)
from prorl_server.routes import (APP_ROUTES, ApiError, Route, add_routes, auth_middleware, error_middleware,
                                 json_response, openapi_schema, parse_body)
from prorl_server.weight_swap import SwapCoordinator, add_weight_routes
from prorl_server.types import (AddBackendRequest, CancelRequest, CancelResponse, GroupTree,
                                JobResult, JobStatusResponse, OkResponse, ProcessRequest, StatusResponse,
                                SubmitResponse, TokenizerResponse)

log = logging.getLogger(__name__)

SETTINGS = web.AppKey("settings", ServerSettings)
PIPELINE = web.AppKey("pipeline", Pipeline)
POOL = web.AppKey("pool", BackendPool)
METRICS = web.AppKey("metrics", Metrics)
REGISTRY = web.AppKey("registry", HandlerRegistry)
RUNTIME = web.AppKey("sandbox_runtime", object)
CPU_POOL = web.AppKey("cpu_pool", CpuPool)
LOOP_MONITOR = web.AppKey("loop_monitor", LoopLagMonitor)
FLEET = web.AppKey("fleet", FleetControl)


# ------------------------------------------------------------------------------------------ handlers


async def process(request: web.Request) -> web.Response:
    """Submit a job and block until it ends; answers the JobResult (ProRL-compatible)."""
    job = _submit(request, await parse_body(request, ProcessRequest))
    if isinstance(job, FinishedJob):  # a resubmitted id whose result the journal has: that result again
        return web.Response(body=job.result_json, content_type="application/json")
    await asyncio.shield(job.done)
    # the JSON serialized once when the job finished; GET /jobs/{id} keeps a summary only from now on
    return web.Response(body=request.app[PIPELINE].delivered(job), content_type="application/json")


async def submit_job(request: web.Request) -> web.Response:
    """Submit a job and return at once with its id (poll ``GET /jobs/{job_id}``)."""
    job = _submit(request, await parse_body(request, ProcessRequest))
    return json_response(SubmitResponse(job_id=job.job_id), status=202)


def _expired(request: web.Request, job_id: Optional[str]) -> None:
    """Raise 410 ``result_expired`` when the journal's retention deleted ``job_id``'s result: the job ran
    and its result was answered; running it again would give one id two samples (a trainer client counts
    the id as finished and does not resubmit it)."""
    journal = request.app[PIPELINE].journal
    if job_id and journal is not None and job_id not in request.app[PIPELINE].jobs and journal.expired(job_id):
        raise ApiError(410, "result_expired", f"job {job_id!r} finished on this server and its result was "
                       "answered; the journal's retention has since deleted it (journal_max_bytes / "
                       "journal_max_age_s): it is not run again", "job_id")


def _submit(request: web.Request, req: ProcessRequest):
    if request.app[FLEET].draining:  # a racing submit: the client takes it elsewhere (trainer_plugins.jobs)
        raise ApiError(503, "draining", "this server is draining: it finishes the jobs it holds and takes no "
                       "new one; submit elsewhere")
    _expired(request, req.job_id)
    try:
        return request.app[PIPELINE].submit(req)
    except UnknownHandlerError as e:
        raise ApiError(400, "unknown_handler", str(e), "instance.data_source") from None
    except InstanceValidationError as e:
        raise ApiError(422, "validation_error", str(e), e.field) from None
    except NoBackendError as e:
        raise ApiError(503, "no_backend", str(e)) from None
    except ServerStoppedError as e:
        raise ApiError(503, "stopped", str(e)) from None
    except JournalUnavailableError as e:  # a full disk: no job is run only to be discarded
        raise ApiError(503, "journal_unavailable", str(e)) from None
    except DuplicateJobError as e:
        raise ApiError(409, "duplicate_job", str(e), "job_id") from None
    except GroupConflictError as e:  # #35: a member its completion-time group cannot take
        raise ApiError(409, e.type, str(e), "group_size") from None
    except HandlerUnavailableError as e:  # a configuration fault: a 4xx a client stops on, never a 503 to retry
        raise ApiError(400, "handler_unavailable", str(e), "instance.data_source") from None


async def get_job(request: web.Request) -> web.Response:
    job_id = request.match_info["job_id"]
    job = request.app[PIPELINE].get(job_id)
    if job is None:
        _expired(request, job_id)
        if request.app[PIPELINE].interrupted(job_id):
            raise ApiError(404, "job_interrupted", f"job {job_id!r} was running on this server when it stopped "
                           "and never finished: resubmit it (its id is free)")
        raise ApiError(404, "unknown_job", f"no job with id {job_id!r} (never submitted, or expired)")
    if isinstance(job, FinishedJob):  # its result is kept as JSON: answered as it is, not parsed again
        return web.Response(body=b'{"job_id":%s,"state":"done","result":%s}' % (json.dumps(job_id).encode(),
                                                                               job.result_json),
                            content_type="application/json")
    return json_response(JobStatusResponse(job_id=job_id, state=job.status, result=job.result))


async def cancel(request: web.Request) -> web.Response:
    req = await parse_body(request, CancelRequest)
    try:
        cancelled, state = await request.app[PIPELINE].cancel(req.job_id, by_client=True)
    except KeyError:
        raise ApiError(404, "unknown_job", f"no job with id {req.job_id!r}", "job_id") from None
    return json_response(CancelResponse(job_id=req.job_id, cancelled=cancelled, state=state))


async def add_llm_server(request: web.Request) -> web.Response:
    req = await parse_body(request, AddBackendRequest)
    known = request.app[POOL].get(req.address)
    if known is not None and known.withdrawn is not None:
        # a weight swap withdrew it, maybe paused in its engine: resume it there first (best effort)
        try:
            async with request.app[COMPONENTS].llm.client.session.post(
                    f"{req.address}/resume", timeout=aiohttp.ClientTimeout(total=10)) as r:
                await r.read()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            log.warning("re-adding %s: its /resume failed (%r)", req.address, e)
    request.app[POOL].add(req.address, req.weight_version)
    return json_response(OkResponse(detail=f"backend {req.address} registered"))


async def clear_llm_server(request: web.Request) -> web.Response:
    """Take every backend out of the rotation (a weight update); re-adding an address revives the same backend
    with its new version, and jobs submitted meanwhile wait up to ``backend_wait_s``."""
    n = request.app[POOL].clear()
    return json_response(OkResponse(detail=f"{n} backend(s) removed"))


async def start(request: web.Request) -> web.Response:
    request.app[PIPELINE].resume()
    return json_response(OkResponse(detail="accepting jobs"))


async def stop(request: web.Request) -> web.Response:
    n = await request.app[PIPELINE].stop()
    return json_response(OkResponse(detail=f"stopped; {n} job(s) cancelled; POST /start to resume"))


async def drain(request: web.Request) -> web.Response:
    """Take no new job (``/process`` answers 503 ``draining``), finish the jobs held, then exit (the server's
    ``drain_timeout_s`` bounds the wait); the fleet record says ``draining`` before this answers."""
    await request.app[FLEET].start_drain()
    return json_response(OkResponse(detail=f"draining: {request.app[PIPELINE].in_flight} job(s) to finish, then "
                                    "exit"))


async def status(request: web.Request) -> web.Response:
    p = request.app[PIPELINE]
    return json_response(StatusResponse(
        accepting=p.accepting, stages=p.stage_status(), jobs_in_flight=p.in_flight,
        backends=[b.info() for b in request.app[POOL].backends], handlers=request.app[REGISTRY].names()))


async def tokenizer(request: web.Request) -> web.Response:
    """The fingerprint of the tokenizer and chat template jobs use (query ``backend``: for jobs on that backend;
    default: the ``tokenizer`` setting's, else the first healthy backend's), loaded if it is not yet: a trainer
    compares it with its policy's before training on the server's token ids (issue #32)."""
    from prorl_server.llm.client import LLMUnavailableError
    from prorl_server.llm.context import TokenizerUnavailableError
    pool, llm = request.app[POOL], request.app[COMPONENTS].llm
    address = request.query.get("backend")
    backend = None
    if address is not None:
        backend = pool.get(address)
        if backend is None:
            raise ApiError(404, "unknown_backend", f"no backend {address!r} is registered", "backend")
    elif llm.tokenizer_name is None:
        backend = next((b for b in pool.backends if b.healthy), None)
        if backend is None:
            raise ApiError(503, "no_backend", "no LLM backend is registered: the tokenizer is the served model's")
    try:
        name, fingerprint = await llm.tokenizer_info(backend)
    except TokenizerUnavailableError as e:
        raise ApiError(503, "tokenizer_unavailable", str(e)) from None
    except LLMUnavailableError as e:
        raise ApiError(502, "backend_unavailable", str(e)) from None
    return json_response(TokenizerResponse(name=name, backend=None if llm.tokenizer_name else backend.address,
                                           fingerprint=fingerprint))


async def group_tree(request: web.Request) -> web.Response:
    """``GET /groups/{group_id}/tree``: the verified prefix tree of the rows of the group's ended jobs
    (:mod:`prorl_server.tree`, issue #34); the jobs without rows (running, filtered, expired) are named in
    ``missing``. Results are parsed, the tree built, verified and serialized in a worker thread."""
    from prorl_server.tree import TreeInvariantError, tree_json, tree_of_results

    group_id = request.match_info["group_id"]
    pipeline = request.app[PIPELINE]
    members = pipeline.groups.get(group_id)
    if not members:
        raise ApiError(404, "unknown_group", f"no job of group {group_id!r} on this server (never submitted, or "
                       "forgotten: the newest keep_finished groups are kept)")
    ended: list[tuple[str, bytes]] = []
    missing: list[tuple[str, str]] = []
    runs: list[tuple[str, Optional[str]]] = []  # each member's run (a job id resubmitted runs again)
    for job_id in members:
        job = pipeline.get(job_id)
        runs.append((job_id, getattr(job, "trajectory_id", None)))
        if job is None:
            missing.append((job_id, "expired"))
        elif not job.finished:
            missing.append((job_id, job.status.value))
        elif isinstance(job, FinishedJob):
            if job.full:
                ended.append((job_id, job.result_json))
            else:
                missing.append((job_id, "delivered without retention"))
        elif job.result is not None:
            ended.append((job_id, job.result.model_dump_json().encode()))
        else:
            missing.append((job_id, "ending"))
    # asked again (a retry): the complete tree served before, while the group holds the same runs of the same jobs
    served = pipeline.served_tree(group_id, runs)
    if served is not None:
        return web.Response(body=served, content_type="application/json")
    overflow = pipeline.group_overflow.get(group_id, 0)
    if overflow:  # jobs the index never held: the tree must not say complete
        missing.append((f"{overflow} more jobs", f"not indexed: a group's tree holds its first {MAX_GROUP_JOBS}"))

    def build() -> tuple[bool, bytes]:
        tree = tree_of_results(group_id, ended, missing)
        return tree.complete, tree_json(tree)

    try:  # parsed, built, verified and serialized in a worker thread: a big group never holds the loop
        complete, body = await asyncio.to_thread(build)
    except TreeInvariantError as e:  # a bug of the build: never served
        log.error("group %s: its tree fails its invariants: %s", group_id, e)
        raise ApiError(500, "tree_invariant", f"the tree of group {group_id!r} fails its invariants: {e}") from None
    if complete:  # the tree the group's trainer wanted is out: its delivered results need not stay whole
        pipeline.keep_served_tree(group_id, runs, body)
        pipeline.release_group(group_id)
    return web.Response(body=body, content_type="application/json")


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    m = request.app[METRICS]
    return web.Response(body=m.render(), headers={"Content-Type": m.content_type})


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_schema(request.app[APP_ROUTES].values(),
                                            data_sources=request.app[REGISTRY].names()))


ROUTES: tuple[Route, ...] = (
    Route("POST", "/process", process, "Run a job and wait for its result", ProcessRequest, JobResult,
          errors=(503,)),
    Route("POST", "/jobs", submit_job, "Submit a job without waiting", ProcessRequest, SubmitResponse,
          status=202, errors=(503,)),
    Route("GET", "/jobs/{job_id}", get_job, "State of a job, with its result once done", None,
          JobStatusResponse),
    Route("POST", "/cancel", cancel, "Cancel a job (idempotent)", CancelRequest, CancelResponse),
    Route("POST", "/add_llm_server", add_llm_server, "Register an LLM backend (idempotent)",
          AddBackendRequest, OkResponse),
    Route("POST", "/clear_llm_server", clear_llm_server, "Take every LLM backend out of the rotation (re-adding "
          "an address revives it with its new weight_version)", None, OkResponse),
    Route("POST", "/start", start, "Accept jobs again after /stop", None, OkResponse),
    Route("POST", "/stop", stop, "Refuse new jobs and cancel in-flight ones", None, OkResponse),
    Route("POST", "/drain", drain, "Take no new job, finish the jobs held, then exit (fleet draining)", None,
          OkResponse),
    Route("GET", "/status", status, "Queues, active jobs and backends", None, StatusResponse),
    Route("GET", "/tokenizer", tokenizer, "Fingerprint of the tokenizer and chat template jobs use (?backend=)",
          None, TokenizerResponse, errors=(502, 503)),
    Route("GET", "/groups/{group_id}/tree", group_tree, "The verified prefix tree of a group's ended jobs "
          "(issue #34)", None, GroupTree, errors=(500,)),
    Route("GET", "/health", health, "Liveness (no auth)", auth="none"),
    Route("GET", "/metrics", metrics, "Prometheus metrics (text format)"),
    Route("GET", "/openapi.json", openapi, "This API's OpenAPI 3.1 schema"),
)


# ------------------------------------------------------------------------------------------ composition root


@dataclass
class Components:
    """Every component of one server, built and wired by :func:`build_components`.

    :meth:`start` (on the running loop) and :meth:`close` run in one written order: started are the event-loop
    monitor, the sandbox runtime (orphans of a crashed earlier server reaped), the pipeline's workers, the
    gateway's janitor and the backend health probe, then the collector control (what exists now is long-lived:
    frozen); closed in reverse: the collector control, the gateway (its sessions end), the health
    probe, the pipeline (every job cancelled, its sandboxes closed), the LLM client, the CPU pool (no job
    scores anymore), the sandbox runtime (any sandbox left), the monitor. A component whose close fails is
    logged and the others still close.
    """

    settings: ServerSettings
    registry: HandlerRegistry
    metrics: Metrics
    pool: BackendPool
    loop_monitor: LoopLagMonitor
    runtime: Any  # a sandbox runtime, or None
    own_runtime: bool  # built here from the settings (reap its orphans at start), not injected
    cpu_pool: CpuPool
    llm: LLMContext
    gateway: Gateway
    services: JobServices
    pipeline: Pipeline
    collector: Optional[CollectorControl] = None
    journal: Any = None  # a prorl_server.journal.store.Journal, or None
    sandbox_pool: Any = None  # a sandbox.pool.SandboxPool over runtime, or None
    _health: Optional[asyncio.Task] = field(default=None, repr=False)
    _health_session: Optional[aiohttp.ClientSession] = field(default=None, repr=False)
    _started: list[str] = field(default_factory=list, repr=False)

    async def start(self) -> None:
        """Start what runs on the event loop. On a failure, what had started is closed and the error raised."""
        try:
            self.loop_monitor.start()
            self._started.append("loop_monitor")
            self._started.append("runtime")
            if self.runtime is not None and self.own_runtime:
                reaped = await self.runtime.reap_orphans()
                if reaped:
                    log.warning("reaped %d sandbox(es) left by a crashed earlier server", reaped)
                self.runtime.start_reaper()  # and those a server of this node leaves while this one runs
            if self.journal is not None:
                self.journal.start()
                self._started.append("journal")
            self._started += ["cpu_pool", "llm"]  # they start on first use; closed all the same
            self.pipeline.start_workers()
            self._started.append("pipeline")
            self._health_session = aiohttp.ClientSession()
            self._health = asyncio.create_task(
                self.pool.probe_forever(self._health_session, self.settings.health_interval_s),
                name="backend-health")
            self._started.append("health")
            self.gateway.start()
            self._started.append("gateway")
            if self.collector is not None:
                self.collector.start()
                self._started.append("collector")
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        """Stop everything that was started, in the order of the class docstring. Idempotent."""
        for name, stop in (("collector", self._stop_collector), ("gateway", self.gateway.close),
                           ("health", self._stop_health),
                           ("pipeline", self.pipeline.shutdown), ("journal", self._close_journal),
                           ("llm", self.llm.close),
                           ("cpu_pool", self.cpu_pool.close), ("runtime", self._close_sandboxes),
                           ("loop_monitor", self.loop_monitor.stop)):
            if name not in self._started:
                continue
            self._started.remove(name)
            try:
                await stop()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("closing the %s failed", name)

    async def _close_journal(self) -> None:
        if self.journal is not None:
            await asyncio.to_thread(self.journal.close)

    async def _stop_collector(self) -> None:
        if self.collector is not None:
            await self.collector.stop()

    async def _stop_health(self) -> None:
        if self._health is not None:
            self._health.cancel()
            await asyncio.gather(self._health, return_exceptions=True)
        if self._health_session is not None:
            await self._health_session.close()

    async def _close_sandboxes(self) -> None:
        if self.sandbox_pool is not None:
            await self.sandbox_pool.close()
        if self.runtime is not None:
            await self.runtime.close_all()


def sandbox_opener(runtime: Any, default_image: Optional[str], pool: Any = None) -> SandboxOpener:
    """``async (spec=None, **spec_fields) -> handle``: start a sandbox from ``runtime``, or take a started one
    from ``pool`` (a :class:`sandbox.pool.SandboxPool`; it cold-starts what it does not pool); a spec naming no
    image gets ``default_image`` (the ``sandbox_image`` setting)."""

    async def open_sandbox(spec: Any = None, **kw: Any) -> Any:
        from sandbox import SandboxSpec

        spec = spec if spec is not None else SandboxSpec(**kw)
        if spec.image is None and default_image:
            spec.image = default_image
        return await (pool.acquire(spec) if pool is not None else runtime.start(spec))

    return open_sandbox


def resolve_sandbox_runtime(setting: Optional[str]) -> Optional[str]:
    """The runtime name the ``sandbox_runtime`` setting means: ``"auto"`` is ``"bubblewrap"`` where ``bwrap``
    is on PATH, else None; ``None`` / ``"none"`` is None; any other name is itself (checked by
    :func:`sandbox.make_runtime`)."""
    if setting is None or setting.lower() == "none":
        return None
    if setting.lower() == "auto":
        return "bubblewrap" if shutil.which("bwrap") else None
    return setting


def build_components(settings: ServerSettings, registry: HandlerRegistry,
                     sandbox_runtime: Any = None) -> Components:
    """Build and wire every component of a server (nothing is started; see :meth:`Components.start`).

    Raises:
        ValueError: ``settings.sandbox_runtime`` names no runtime.
        sandbox.errors.SandboxError: that runtime's binary is missing.
    """
    m = Metrics()
    pool = BackendPool(on_change=m.backend_changed, affinity_slack=settings.affinity_slack,
                       on_affinity=m.affinity_decided)
    for address in settings.backends:
        pool.add(AddBackendRequest(address=address).address)
    admission = None
    if settings.admission_target_lag_ms:  # None (an app built in code) or 0: off
        admission = AdmissionGate(target_lag_s=settings.admission_target_lag_ms / 1000,
                                  min_limit=settings.admission_min_jobs,
                                  initial_limit=max(settings.admission_min_jobs, 256),
                                  on_change=m.admission_changed)
    monitor = LoopLagMonitor(histogram=m.event_loop_lag, max_gauge=m.event_loop_lag_max,
                             on_probe=admission.observe if admission is not None else None)
    runtime, own_runtime = sandbox_runtime, False
    kind = resolve_sandbox_runtime(settings.sandbox_runtime) if runtime is None else None
    if kind is not None:
        from sandbox import make_runtime

        runtime, own_runtime = make_runtime(kind, **settings.sandbox_options), True
    if sandbox_runtime is None:
        if runtime is not None:
            log.info("sandbox runtime: %s%s", kind, " (auto: bwrap is installed)"
                     if (settings.sandbox_runtime or "").lower() == "auto" else "")
        else:
            needing = [n for n in registry.names() if registry.resolve(n)[0] == n and registry.resolve(n)[1].needs_sandbox]
            log.warning("no sandbox runtime (sandbox_runtime=%s%s): jobs of the handlers that need one (%s) are "
                        "refused at submit; install bubblewrap or set --sandbox-runtime",
                        settings.sandbox_runtime, ", and bwrap is not installed"
                        if (settings.sandbox_runtime or "").lower() == "auto" else "", ", ".join(needing) or "none")
    # CPU workers start on first use: a server that never scores a CPU-heavy answer never starts one.
    cpu_tasks = m.cpu_tasks
    cpu_pool = CpuPool(settings.cpu_workers or DEFAULT_WORKERS,
                       on_outcome=lambda outcome: cpu_tasks.labels(outcome).inc())
    llm = LLMContext(pool, tokenizer=settings.tokenizer, request_timeout_s=settings.llm_timeout_s)
    m.export_counts(LLM_CLIENT_COUNTS, lambda: llm.client.counters)
    gateway = Gateway(llm, pool, max_sessions=settings.gateway_max_sessions,
                      idle_timeout_s=settings.gateway_idle_timeout_s, keep_finished=settings.gateway_keep_finished,
                      parser=settings.gateway_tool_parser, on_token_stats=m.count_token_stats, agent_app=agent_app)
    m.export_counts(GATEWAY_COUNTS, lambda: gateway.counters)
    sandbox_pool = None
    if runtime is not None and own_runtime and settings.sandbox_pool_size > 0:  # an injected runtime: not pooled
        from sandbox.pool import SandboxPool

        sandbox_pool = SandboxPool(runtime, size=settings.sandbox_pool_size, max_specs=settings.sandbox_pool_max_specs,
                                   refill_concurrency=settings.sandbox_pool_refill_concurrency)
        m.export_counts(SANDBOX_POOL_COUNTS, lambda: sandbox_pool.counters)
    services = JobServices(pool=pool, backend_wait_s=settings.backend_wait_s,
                           sandbox_opener=sandbox_opener(runtime, settings.sandbox_image, sandbox_pool)
                           if runtime is not None
                           else None, llm=llm, cpu_pool=cpu_pool, gateway=gateway)
    pipeline = Pipeline(registry, pool, m, settings.workers(), default_timeout_s=settings.default_timeout_s,
                        keep_finished=settings.keep_finished, keep_finished_mb=settings.keep_finished_mb,
                        services=services, group_retention_s=settings.group_retention_s)
    pipeline.admission = admission
    pipeline.completion_groups.wait_s = settings.completion_time_wait_s
    collector = CollectorControl(freeze=settings.gc_freeze, gen0_threshold=settings.gc_gen0_threshold,
                                 on_collection=m.gc_collected, on_frozen=m.gc_frozen_objects.set)
    journal = None
    path = journal_path(settings)
    if path is not None:
        journal = Journal(path, max_bytes=settings.journal_max_bytes, max_age_s=settings.journal_max_age_s,
                          prealloc_wal=bool(settings.journal_prealloc_wal))
        pipeline.journal = llm.client.journal = journal
        log.info("journal: %s", path)
    elif (settings.journal or "").lower() == "auto":  # prorl-server's default, with --port 0 (the launcher's)
        log.warning("journal: off (auto needs a fixed --port; with --port 0 give --journal PATH): a crash of "
                    "this server loses the results of its jobs in flight and ones not yet delivered")
    from prorl_server import tree

    if tree._tree_c is None:  # an install without a C compiler: trees work, slower
        log.warning("group trees: built in Python (prorl_server._tree_c is not compiled: reinstall with a C "
                    "compiler, `pip install -e .`); GET /groups/{id}/tree is 2-10x slower")
    return Components(settings=settings, registry=registry, metrics=m, pool=pool, loop_monitor=monitor,
                      runtime=runtime, own_runtime=own_runtime, cpu_pool=cpu_pool, llm=llm, gateway=gateway,
                      services=services, pipeline=pipeline, collector=collector, journal=journal,
                      sandbox_pool=sandbox_pool)


# ------------------------------------------------------------------------------------------ factory

COMPONENTS = web.AppKey("components", Components)


def create_app(settings: Optional[ServerSettings] = None, registry: Optional[HandlerRegistry] = None,
               sandbox_runtime: Any = None) -> web.Application:
    """Build the rollout server application (its components built and wired here; started with the app).

    Args:
        settings: server settings (defaults if None).
        registry: handlers to serve; default: the process-wide registry plus every entry-point handler.
        sandbox_runtime: a ready ``sandbox`` runtime to use instead of building one from
            ``settings.sandbox_runtime`` (tests inject one). An injected runtime's sandboxes are still closed
            when the server stops.

    Raises:
        prorl_server.plugin.HandlerSettingsError: a handler's settings section is bad.
        ValueError / sandbox.errors.SandboxError: see :func:`build_components`.
    """
    settings = settings or ServerSettings()
    if registry is None:
        registry = default_registry
        registry.load_entry_points()
    registry.configure(settings.handlers)  # each handler's settings section (HandlerSettingsError if bad)
    middlewares = [error_middleware]
    if settings.token:
        middlewares.append(auth_middleware(settings.token))
    app = web.Application(middlewares=middlewares, client_max_size=int(settings.max_body_mb * 1024 * 1024))
    c = build_components(settings, registry, sandbox_runtime)
    app[COMPONENTS] = c
    app[SETTINGS], app[METRICS], app[POOL], app[REGISTRY], app[RUNTIME] = (settings, c.metrics, c.pool, registry,
                                                                          c.runtime)
    app[CPU_POOL], app[LOOP_MONITOR], app[PIPELINE] = c.cpu_pool, c.loop_monitor, c.pipeline
    app[FLEET] = FleetControl()
    app[APP_ROUTES] = {}
    add_routes(app, ROUTES)
    add_gateway_routes(app, c.gateway)
    add_weight_routes(app, SwapCoordinator(c.pool, lambda: c.llm.client, live_jobs=lambda: c.pipeline.jobs.values(),
                                           cancel_job=c.pipeline.cancel), c.metrics)
    app.cleanup_ctx.append(_lifetime)
    app.on_shutdown.append(_cancel_jobs_on_shutdown)
    return app


async def _lifetime(app: web.Application):
    c = app[COMPONENTS]
    await c.start()
    yield
    await c.close()


async def _cancel_jobs_on_shutdown(app: web.Application) -> None:
    # on_shutdown runs before the runner waits for open requests: a blocking /process answers its client the
    # cancelled result now instead of the server waiting (up to its shutdown timeout) for the job to end.
    await app[PIPELINE].shutdown()


def write_ready_file(path: str, host: str, port: int) -> None:
    """Atomically write ``{host, port, pid, url}`` to ``path`` (launchers wait for it)."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"host": host, "port": port, "pid": os.getpid(), "url": f"http://{host}:{port}"}, f)
    os.replace(tmp, path)
