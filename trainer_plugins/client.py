"""Trainer-agnostic asyncio rollout client: groups, replenishment, DAPO dynamic sampling, Windowed FIFO,
bounded staleness, carry-over, and per-step metrics, over one or many rollout servers.

A trainer drives it step by step::

    async with RolloutClient("/shared/run1/servers.json", dataset, groups_per_step=64, n_samples=8,
                             window=16, max_staleness=1) as client:
        for step in range(num_steps):
            batch = await client.next_batch()        # 64 informative groups, lag <= 1
            train_on(batch.groups); log(batch.metrics.as_dict())
            await client.update_weights(step + 1)    # clear + re-register vLLM backends, version step + 1

What it does:

- **Servers**: a URL list, or ``servers.json`` read with :mod:`trainer_plugins.servers` (same-node servers
  first, bearer token from the file). Each group goes to the server its ``server_chooser`` picks
  (:class:`trainer_plugins.admission.ServerChooser`; default ``"least_in_flight"``: the fewest of this
  client's jobs in flight, ties broken in that order: same node first, then round-robin); all its samples run
  there, sent with the group's ``group_id`` so the server keeps them on one LLM backend (the prompt's prefix
  cache). Every job goes through :class:`trainer_plugins.jobs.JobSubmitter` (submit, cancel, 503 waits).
- **Groups**: every dataset item is sampled ``n_samples`` times (one job each, ``POST /process`` with a
  client-chosen ``job_id`` so it can be cancelled at once); a group is complete when all its jobs ended.
- **Replenishment**: a background task keeps as many groups outstanding (submitted and not yet consumed or
  discarded) as the staleness budget allows (:attr:`RolloutClient.capacity`: about ``(K + 1) * B`` plus
  ``oversubscribe``), drawing from a real iterator over epochs (``max_epochs``, optional per-epoch shuffle).
  Submission stops whenever one more group could not be consumed within the staleness bound.
- **DAPO dynamic sampling** (Yu et al. 2025, "DAPO", section 3.2): a complete group whose rewards are all equal
  carries no advantage signal and is dropped (its jobs' seconds are counted as wasted).
- **Filtered samples are regenerated, never trained on**: a result with ``filter: true`` (the server's
  ``failure_kind``: a dead sandbox, an unreachable backend, a harness fault, a timeout, a cancel it did not
  ask for; or no answer from the server at all) is replaced by a new job for the same group, on a server where
  the sample has not failed yet while there is one (the job client's failover rule), up to ``max_sample_retries`` times per sample; a sample still filtered after that drops its
  whole group (its other jobs are cancelled and the next dataset item takes its place). Counted per step:
  ``filtered_jobs``, ``samples_regenerated``, ``groups_dropped_filtered``, ``failure_kinds``.
- **Early termination**: when a step has its groups, groups that would exceed the staleness bound at the
  next weight version can no longer be used: their in-flight jobs are cancelled on the server
  (``POST /cancel``). With ``carry_over=False`` (the reference behaviour) every unfinished group is cancelled.
- **Carry-over**: every other unfinished group stays queued for the next step, *including the finished
  jobs of incomplete groups* (the reference implementation throws those away).
- **Windowed FIFO** (:class:`trainer_plugins.admission.WindowedFIFO`): groups are numbered in submission
  order and the trainer may take a complete group only from the first ``window`` positions; ``None`` is
  greedy, ``1`` strict FIFO.
- **Staleness**: a group's version is the oldest weight version its trajectories were generated with (as the
  server reports it, else the version current when it was submitted). ``lag = current - version``
  never exceeds ``max_staleness`` for a consumed group. The ``staleness_policy``
  (:class:`trainer_plugins.admission.StalenessPolicy`, or its name) decides the rest. ``"drop"``: a group that would
  exceed it is discarded (its running jobs cancelled; the next dataset item takes its place).
  ``"wait"`` (dropless, like verl's ``max_off_policy_strategy=wait``): a step first waits for and takes
  the groups that would exceed the bound at the next version, slow or not, so none is lost to staleness;
  only a group already over the bound (the version jumped by more than one in a step) is cancelled and its
  prompt regenerated at the current version.

Everything runs on the caller's event loop; nothing blocks it (servers.json is read in a thread).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import random
import time
import uuid
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterable, Iterator, Mapping, Optional, Sequence, Union

import aiohttp

from prorl_server.types import JobResult
from trainer_plugins.admission import (ServerChooser, StalenessPolicy, WindowedFIFO, as_server_chooser,
                                       as_staleness_policy)
from trainer_plugins.jobs import (CONFIGURATION_FAULTS, DEFAULT_MAX_CONNECTIONS, DRAINING, ROLLOUT_SERVER,
                                  InvalidInstanceError, JobSubmitter, RolloutAuthError,
                                  completion_time_weight as check_speed_weight, filtered_result, never_rerun,
                                  open_session, process_request, uses_retry)
from trainer_plugins.fleet import Fleet, is_fleet_dir, open_fleet
from trainer_plugins.servers import ServersFile, load_servers

log = logging.getLogger(__name__)

Instance = dict[str, Any]
Dataset = Union[Sequence[Any], Callable[[int], Iterable[Any]]]
"""A sequence (re-read every epoch, shuffled if asked) or ``epoch -> iterable`` for streamed data."""


# ------------------------------------------------------------------------------------------------ types


@dataclass
class Sample:
    """One job of a group. ``result`` is the server's job result. ``failed_on``: the servers on which this
    sample's earlier attempts were filtered."""

    job_id: str
    server: str
    result: Optional[JobResult] = None
    submitted_at: float = 0.0
    finished_at: Optional[float] = None
    cancel_requested: bool = False
    task: Optional[asyncio.Task] = field(default=None, repr=False)
    slot: int = 0  # which of the group's n samples this is
    retries: int = 0  # how many filtered results this slot had before this job that used up a retry
    drains: int = 0  # how many drain refusals before this job (they use up no retry: jobs.uses_retry)
    failed_on: set[str] = field(default_factory=set)

    @property
    def filtered(self) -> bool:
        """The server said not to train on this result (``filter: true``)."""
        return bool(self.result is not None and self.result.filter)

    @property
    def done(self) -> bool:
        return self.result is not None

    @property
    def counted_s(self) -> float:
        """Seconds the server spent on the job (init + run + eval), 0 when unknown."""
        return 0.0 if self.result is None else float(self.result.timing.counted_s)


@dataclass
class Group:
    """``n`` samples of one dataset item. ``uid`` is ``e<epoch>-i<index>`` (stable across regenerations)."""

    uid: str
    item: Any
    instance: Instance
    epoch: int
    index: int
    submit_version: int
    attempt: int = 0
    samples: list[Sample] = field(default_factory=list)
    seq: int = -1
    discarded: bool = False
    server: Optional[str] = None  # every sample of the group runs there (see RolloutClient._pick_server)

    @property
    def complete(self) -> bool:
        return bool(self.samples) and all(s.done for s in self.samples)

    @property
    def results(self) -> list[JobResult]:
        """Job results in sample order (complete groups only)."""
        return [s.result for s in self.samples if s.result is not None]

    @property
    def rewards(self) -> list[float]:
        return [float(r.reward) for r in self.results]

    @property
    def informative(self) -> bool:
        """DAPO's filter: not every reward is the same (a group of one is never informative)."""
        return len(set(self.rewards)) > 1

    @property
    def version(self) -> int:
        """Oldest weight version the group was generated with: what the server reports
        (``result.weight_version`` / ``trajectories[].weight_versions``, the versions its backends were
        registered with), else the version current at submission."""
        versions = []
        for r in self.results:
            if r.weight_version is not None:
                versions.append(r.weight_version)
            for t in r.trajectories:
                versions.extend(t.weight_versions)
        return min(versions) if versions else self.submit_version

    @property
    def trajectories(self) -> list[dict]:
        """Every trajectory of every sample (``prompt_ids``, ``response_ids``, ``response_logprobs``,
        ``loss_mask``, ...: :class:`prorl_server.types.Trajectory` as a dict), with the sample's ``reward``
        and ``job_id`` added."""
        out = []
        for r in self.results:
            for t in r.trajectories:
                out.append({**t.model_dump(), "reward": float(r.reward), "job_id": r.job_id})
        return out


@dataclass
class StepMetrics:
    """What one :meth:`RolloutClient.next_batch` call saw. Counts are since the previous call.

    ``lag``: weight-version lag of each consumed group (``current - group.version``); ``lag_hist``:
    ``{lag: groups}``. ``cancelled_jobs``: jobs this client cancelled on a server; ``dropped_groups``:
    complete groups with all-equal rewards (DAPO filter); ``stale_groups``: groups over the staleness bound
    (discarded or, with ``staleness_policy="wait"``, regenerated: ``regenerated_groups``);
    ``waited_groups``: groups taken first because they would be over the bound next step (``"wait"``);
    ``carried_groups``: groups left queued for the next step, of which ``carried_finished_jobs`` jobs already
    finished and ``carried_inflight_jobs`` still run; ``wasted_rollout_s``: server seconds (counted time) of
    jobs whose result is not trained on; ``mean_reward``: over the consumed groups' samples;
    ``mean_reward_components``: ``{name: mean value}`` of each reward component (``speed`` with
    ``completion_time_weight`` > 0, the handler's terms) over the consumed samples that report it, as the TRL
    plugin logs ``prorl/reward/{name}``;
    ``trainer_wait_s``: how long ``next_batch`` waited for data. ``filtered_jobs``: results with
    ``filter: true`` (not trained on), by ``failure_kinds`` (``{failure_kind: jobs}``; ``rollout_server``
    when the server gave no result, ``draining`` when it refused the job because it leaves); ``samples_regenerated``: new jobs submitted in their place;
    ``groups_dropped_filtered``: groups dropped because a sample stayed filtered after
    ``max_sample_retries`` regenerations.
    """

    step: int
    weight_version: int
    groups: int = 0
    samples: int = 0
    lag: list[int] = field(default_factory=list)
    submitted_jobs: int = 0
    cancelled_jobs: int = 0
    failed_jobs: int = 0
    dropped_groups: int = 0
    stale_groups: int = 0
    regenerated_groups: int = 0
    waited_groups: int = 0
    carried_groups: int = 0
    carried_finished_jobs: int = 0
    carried_inflight_jobs: int = 0
    filtered_jobs: int = 0
    samples_regenerated: int = 0
    groups_dropped_filtered: int = 0
    failure_kinds: dict[str, int] = field(default_factory=dict)
    wasted_rollout_s: float = 0.0
    mean_reward: Optional[float] = None
    mean_reward_components: dict[str, float] = field(default_factory=dict)
    trainer_wait_s: float = 0.0
    epoch: int = 0

    @property
    def lag_hist(self) -> dict[int, int]:
        return dict(sorted(Counter(self.lag).items()))

    def as_dict(self) -> dict[str, Any]:
        """Flat dict for a logger (``rollout/…`` keys are the trainer's business)."""
        d = {k: v for k, v in self.__dict__.items() if k != "lag"}
        d["lag_mean"] = sum(self.lag) / len(self.lag) if self.lag else None
        d["lag_max"] = max(self.lag) if self.lag else None
        d["lag_hist"] = self.lag_hist
        return d


@dataclass
class StepBatch:
    """The groups of one step, in the order they were taken (oldest submission first within a take)."""

    groups: list[Group]
    metrics: StepMetrics


# ------------------------------------------------------------------------------------------------ client


def _describe(instance: Mapping[str, Any], limit: int = 200) -> str:
    """A short name of an instance for error messages: its id, else its JSON, cut to ``limit`` characters."""
    import json

    ident = instance.get("instance_id", instance.get("id"))
    text = f"instance_id={ident!r}" if ident is not None else json.dumps(instance, default=str)
    return text if len(text) <= limit else text[:limit] + "..."


def resolve_servers(servers: Union[str, os.PathLike, ServersFile, Sequence[str]],
                    local_node: Optional[str] = None,
                    token: Optional[str] = None) -> tuple[list[str], dict[str, str], dict[str, list[str]]]:
    """Rollout servers from URLs, a :class:`ServersFile` or the path of ``servers.json``: ``(urls in same-node
    first order, headers with the bearer token, {url: llm_backends})``. Reading a path blocks (small file).
    A fleet directory (:func:`trainer_plugins.fleet.is_fleet_dir`) or a :class:`~trainer_plugins.fleet.Fleet`
    gives the fleet itself as the URLs: a live sequence of its routable members (the token from ``DIR/token``).
    ``token``: the bearer token the caller will send; a fleet opened here admits only members whose records are
    signed with it (:mod:`trainer_plugins.fleet`, "Proof of membership").

    Raises:
        ValueError: no server. FileNotFoundError / ServersFileError: servers.json is missing or malformed.
    """
    if isinstance(servers, (str, os.PathLike)) and not str(servers).startswith(("http://", "https://")) \
            and is_fleet_dir(servers):
        servers = open_fleet(servers, local_node=local_node, token=token)
    if isinstance(servers, Fleet):  # a live view: the caller follows the fleet as it changes
        return servers, servers.headers, {}  # type: ignore[return-value]
    if isinstance(servers, (str, os.PathLike)) and not str(servers).startswith(("http://", "https://")):
        servers = load_servers(servers)
    if isinstance(servers, ServersFile):
        ordered = servers.ordered(local_node)
        return [s.url for s in ordered], servers.headers, {s.url: list(s.llm_backends) for s in ordered}
    if isinstance(servers, str):
        servers = [u.strip() for u in servers.split(",") if u.strip()]  # "http://a:1,http://b:2"
    urls = [u.rstrip("/") for u in servers]
    if not urls:
        raise ValueError("no rollout server given")
    return urls, {}, {u: [] for u in urls}


class BackendUnreachableError(RuntimeError):
    """An LLM backend did not answer ``GET /health`` from the process registering it: a rollout server
    given it would route jobs to a backend that cannot serve them. The message names the backend."""


async def register_backends(session: aiohttp.ClientSession, server: str, backends: Sequence[str],
                            version: int, *, clear: bool = True, probe_timeout_s: Optional[float] = None,
                            headers: Optional[Mapping[str, str]] = None) -> None:
    """Register LLM backends with one rollout server under ``weight_version=version`` (ProRL Agent paper,
    section 3.3: the trainer re-registers its inference servers after each weight update).

    Args:
        session: the caller's HTTP session (its default headers carry the bearer token, or pass ``headers``).
        server: rollout server base URL. backends: OpenAI-compatible base URLs.
        version: the trainer step whose weights the backends serve (int; never None: a backend without a
            version would make its trajectories look on-policy).
        clear: ``POST /clear_llm_server`` first (the caller owns every backend of that server). With
            False the backends are added beside the others; re-adding a known address updates its version.
        probe_timeout_s: when given, each backend must answer ``GET {backend}/health`` within that many
            seconds before it is registered.

    Raises:
        BackendUnreachableError: a backend did not answer its probe (nothing was registered).
        RuntimeError: the rollout server is unreachable or refused (its answer is in the message).
    """
    if not isinstance(version, int) or isinstance(version, bool):
        raise TypeError(f"weight version must be an int, got {version!r}")
    if probe_timeout_s is not None:
        for b in backends:
            try:
                async with session.get(f"{b}/health", timeout=aiohttp.ClientTimeout(total=probe_timeout_s)) as r:
                    if r.status != 200:
                        raise BackendUnreachableError(f"LLM backend {b} answered GET /health with {r.status}")
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                raise BackendUnreachableError(f"LLM backend {b} is unreachable (GET /health: {e!r}); "
                                              f"not registering it with {server}") from None
    calls = ([("/clear_llm_server", None)] if clear else []) + [
        ("/add_llm_server", {"address": b, "weight_version": version}) for b in backends]
    for path, body in calls:
        try:
            async with session.post(f"{server}{path}", json=body, headers=headers) as r:
                if r.status != 200:
                    raise RuntimeError(f"{server}{path} {body or ''} answered {r.status}: {await r.text()}")
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            raise RuntimeError(f"rollout server {server} is unreachable ({path}: {e!r})") from None


Register = Callable[[str, Sequence[str], int], Awaitable[None]]


class FleetRegistrar:
    """Keeps the LLM backends a trainer serves registered with every member of a fleet at the current weight
    version, members that join later included (issue #24: a server started during a run gets its first job
    within 5 s of being healthy, so it must have backends by then). The one implementation of "register with
    joiners": :class:`RolloutClient`, the TRL weight sync (``trainer_plugins.trl.weights``), the verl relay
    (``trainer_plugins.verl.relay``) and ``prorl-run --fleet-dir`` each hold one.

    :meth:`set` says what every member must have (``backends`` at ``version``); :meth:`sync` registers them with
    each live member (:meth:`Fleet.known_urls`, suspects included) that has not got that version from this
    registrar, and :meth:`follow` does so every ``fleet.poll_s`` seconds (0.25 s) until cancelled. A failed
    registration is logged and tried again at the next poll.

    Args:
        fleet: the fleet followed.
        register: ``await register(server_url, backends, version)``; raises ``RuntimeError`` on a refusal or an
            unreachable server (default: :func:`register_backends` with ``clear`` on ``session``).
        session, clear: for the default ``register``.
    """

    def __init__(self, fleet: Fleet, register: Optional[Register] = None, *,
                 session: Optional[aiohttp.ClientSession] = None, clear: bool = True) -> None:
        if register is None:
            if session is None:
                raise ValueError("FleetRegistrar needs a register function or a session")

            async def register(server: str, backends: Sequence[str], version: int) -> None:
                await register_backends(session, server, backends, version, clear=clear)

        self.fleet = fleet
        self._register = register
        self.backends: Optional[list[str]] = None
        self.version: Optional[int] = None
        self.registered: dict[str, int] = {}  # member URL -> the version registered with it
        self.registrations = 0  # registrations with joining members (not those :meth:`set` was told of)

    def set(self, backends: Sequence[str], version: int, registered: Sequence[str] = ()) -> None:
        """From now on every member must serve ``backends`` at ``version``; ``registered``: members the caller
        has just registered with itself (not done again)."""
        self.backends, self.version = list(backends), version
        self.registered.update((u, version) for u in registered)

    def forget(self, server: str) -> None:
        """``server`` must be registered with again (e.g. it restarted)."""
        self.registered.pop(server, None)

    async def sync(self) -> list[str]:
        """Register with every live member that lacks the current version. Returns the members registered."""
        if not self.backends or self.version is None:
            return []
        done = []
        for url in self.fleet.known_urls():
            version = self.version
            if self.registered.get(url) == version:
                continue
            self.registered[url] = version
            try:
                await self._register(url, self.backends, version)
            except RuntimeError as e:
                self.registered.pop(url, None)
                log.warning("fleet: could not register backends with %s: %s", url, e)
                continue
            self.registrations += 1
            done.append(url)
            log.info("fleet: registered %d backend(s) with %s (joined; weight_version %d)", len(self.backends),
                     url, version)
        return done

    async def follow(self) -> None:
        """:meth:`sync` every ``fleet.poll_s`` seconds, forever (cancel the task to stop)."""
        while True:
            await asyncio.sleep(self.fleet.poll_s)
            try:
                await self.sync()
            except Exception:  # never let the follower die: the next poll tries again
                log.exception("fleet: registering backends with joining members failed")


class RolloutClient:
    """Async rollout scheduler over one or many rollout servers (see the module docstring).

    Args:
        servers: base URLs (same-node first), a :class:`ServersFile`, or the path of ``servers.json`` (file
            or directory; read once, at construction); or a fleet directory / :class:`trainer_plugins.fleet.Fleet`,
            followed as servers join, drain and die (new groups go to its routable members of the moment).
        end_fleet: with a fleet, :meth:`close` writes its end sentinel: the rollout allocation is released.
            With a fleet, the backends given to :meth:`update_weights` as one list are also registered with
            every member that joins later (at the current weight version, within a poll of the fleet).
        dataset: :data:`Dataset`. Items are instances (dicts with ``data_source``) unless ``instance_fn``
            maps them.
        groups_per_step: B, informative groups per :meth:`next_batch`.
        n_samples: jobs per group (GRPO/DAPO ``n``).
        window: Windowed FIFO width W in groups (None: greedy; 1: strict FIFO).
        max_staleness: K, the largest weight-version lag of a consumed group (None: unbounded, then
            ``max_outstanding_groups`` or ``2 * B`` bounds submission).
        staleness_policy: a :class:`trainer_plugins.admission.StalenessPolicy`, or its name: ``"drop"`` or
            ``"wait"`` (dropless), see the module docstring.
        server_chooser: a :class:`trainer_plugins.admission.ServerChooser`, or its name
            (``"least_in_flight"``, ``"rendezvous"``).
        oversubscribe: groups submitted beyond the staleness budget, to make up for DAPO drops; those that
            cannot be used in time are cancelled.
        dynamic_sampling: drop all-equal-reward groups (DAPO). carry_over: keep unfinished groups across
            steps (False cancels them at every step, the reference behaviour).
        max_epochs: stop after this many passes over the dataset (None: forever). shuffle/seed: per-epoch
            shuffle of a sequence dataset with ``random.Random(seed + epoch)``.
        sampling_params, timeout_s: sent with every job (``timeout_s`` in seconds of counted time).
        headers: extra HTTP headers (the token of a ServersFile is added automatically); token: bearer token.
        local_node: node name for same-node-first ordering of a ServersFile (default: this node).
        job_prefix: prefix of the job ids (default: a random one per client).
        initial_weight_version: the version before the first :meth:`update_weights`.
        unavailable_retry_s: how long a job the server answers 503 (no LLM backend yet, server stopped) is
            offered again, every 0.25 s, before it counts as failed.
        max_sample_retries: how many times a sample whose result says ``filter: true`` (a failure the model
            did not cause: ``failure_kind``) is regenerated as a new job of the same group; one still filtered
            after that drops its group (default 2; 0: drop at the first).
        max_connections: HTTP connections to the servers at most, all servers together (0, the default: no
            cap, the jobs in flight are bounded by the admission above; aiohttp's own default of 100 would
            hold a trainer to 100 jobs in flight). See :func:`trainer_plugins.jobs.open_session`.
        completion_time_weight: weight ``w`` of the relative completion time reward (issue #35; docs/http-api.md
            "Relative completion time"), a number in [0, 10]; 0 (the default) sends none of its fields. With
            ``w > 0`` every job goes with ``completion_time: true``, its group's ``group_id`` and ``group_size``
            (``n_samples``) and ``reward_weights: {"speed": w}``, as the TRL and verl plugins send them: each
            result then carries ``speed`` in [-1, 1] and ``reward`` = outcome + ``w * speed`` (what DAPO's
            dynamic sampling compares), answered when its group ends. A filtered sample's replacement goes back
            to its group's server (which waits for it) unless that server was the fault.

    Raises:
        ValueError: ``groups_per_step`` or ``n_samples`` < 1, a negative ``max_sample_retries``,
            ``max_connections`` or ``max_staleness``, an unknown ``staleness_policy`` or ``server_chooser``, or a
            ``completion_time_weight`` that is not a number in [0, 10] (a bool, a string, NaN, inf).
    """

    def __init__(self, servers: Union[str, os.PathLike, ServersFile, Sequence[str]], dataset: Dataset, *,
                 groups_per_step: int, n_samples: int = 1, window: Optional[int] = None,
                 max_staleness: Optional[int] = 1, staleness_policy: Union[str, StalenessPolicy] = "drop",
                 server_chooser: Union[str, ServerChooser] = "least_in_flight", oversubscribe: int = 0,
                 dynamic_sampling: bool = True, carry_over: bool = True, max_epochs: Optional[int] = None,
                 shuffle: bool = False, seed: int = 0, sampling_params: Optional[dict] = None,
                 timeout_s: Optional[float] = None, headers: Optional[Mapping[str, str]] = None,
                 token: Optional[str] = None, local_node: Optional[str] = None,
                 instance_fn: Optional[Callable[[Any], Instance]] = None,
                 max_outstanding_groups: Optional[int] = None, job_prefix: Optional[str] = None,
                 initial_weight_version: int = 0, unavailable_retry_s: float = 120.0,
                 max_sample_retries: int = 2, max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 end_fleet: bool = False, completion_time_weight: float = 0.0) -> None:
        if groups_per_step < 1 or n_samples < 1:
            raise ValueError("groups_per_step and n_samples must be >= 1")
        if max_sample_retries < 0:
            raise ValueError("max_sample_retries must be >= 0")
        if max_connections < 0:
            raise ValueError(f"max_connections must be >= 0 (0: no cap), got {max_connections}")
        #: weight of ``speed`` in the server's reward; > 0: jobs go with completion_time (issue #35)
        self.completion_time_weight = check_speed_weight(completion_time_weight)
        self.max_connections = max_connections
        if max_staleness is not None and max_staleness < 0:
            raise ValueError("max_staleness must be >= 0 or None")
        self.urls, file_headers, self.server_backends = resolve_servers(servers, local_node, token)
        self.fleet: Optional[Fleet] = self.urls if isinstance(self.urls, Fleet) else None
        self.end_fleet = end_fleet
        #: with a fleet: registers the backends of the last update_weights with members that join later
        self.registrar: Optional[FleetRegistrar] = (
            FleetRegistrar(self.fleet, lambda u, b, v: self._register(u, b, v)) if self.fleet is not None else None)
        self._follower: Optional[asyncio.Task] = None
        self.headers = {**file_headers, **(headers or {})}
        if token:
            self.headers["Authorization"] = f"Bearer {token}"
        self.dataset = dataset
        self.B = groups_per_step
        self.n = n_samples
        self.max_staleness = max_staleness
        self.staleness_policy = as_staleness_policy(staleness_policy)  # ValueError for an unknown name
        self.chooser = as_server_chooser(server_chooser)
        self.oversubscribe = oversubscribe
        self.dynamic_sampling = dynamic_sampling
        self.carry_over = carry_over
        self.max_epochs = max_epochs
        self.shuffle = shuffle
        self.seed = seed
        self.sampling_params = dict(sampling_params or {})
        self.timeout_s = timeout_s
        self.instance_fn = instance_fn
        self.max_outstanding_groups = max_outstanding_groups
        self.job_prefix = job_prefix or uuid.uuid4().hex[:8]
        self.unavailable_retry_s = unavailable_retry_s
        self.max_sample_retries = max_sample_retries
        self.weight_version = initial_weight_version
        self._first_version = initial_weight_version
        self._consumed = 0  # groups handed to the trainer, over all steps

        self.queue: WindowedFIFO[Group] = WindowedFIFO(window)
        self.step = 0
        self.epoch = 0
        self.exhausted = False
        self._items: Optional[Iterator[tuple[int, int, Any]]] = None
        self._regen: deque[Group] = deque()
        self._in_flight: Counter = Counter({u: 0 for u in self.urls})  # a fleet's members come and go
        self._session: Optional[aiohttp.ClientSession] = None
        self._replenisher: Optional[asyncio.Task] = None
        self._wake = asyncio.Event()
        self._changed = asyncio.Event()
        self._counters: Counter = Counter()
        self._failure_kinds: Counter = Counter()
        self._cancelling: set[asyncio.Task] = set()
        self._wasted_s = 0.0
        self._closed = False
        self._tasks: set[asyncio.Task] = set()
        self._jobs: Optional[JobSubmitter] = None
        self._error: Optional[Exception] = None  # a refused instance or token: raised by next_batch

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> "RolloutClient":
        """Open the HTTP session and start replenishing (idempotent)."""
        if self._session is None:
            self._session = open_session(self.headers, max_connections=self.max_connections)
            self._jobs = JobSubmitter(session=self._session, unavailable_retry_s=self.unavailable_retry_s,
                                      fleet=self.fleet)
        if self._replenisher is None:
            self._replenisher = asyncio.create_task(self._replenish_forever())
        if self.registrar is not None and self._follower is None:
            self._follower = asyncio.create_task(self.registrar.follow())
        return self

    async def close(self, cancel_jobs: bool = True) -> None:
        """Stop submitting; with ``cancel_jobs`` cancel every job still running on a server; close HTTP."""
        self._closed = True
        for task in (self._replenisher, self._follower):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if cancel_jobs:
            await self._cancel_groups([g for _, g in self.queue] + list(self._regen), "close")
            # cancels already under way (groups dropped for a filtered sample) finish: their jobs must not
            # keep running on a server
            await asyncio.gather(*self._cancelling, return_exceptions=True)
        # every request still open, including those of discarded groups waiting for their cancelled result
        tasks = list(self._tasks)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._jobs is not None:
            await self._jobs.close()  # its session is ours (closed below); this stops its lease watch
        if self._session is not None:
            await self._session.close()
            self._session = None
        if self.fleet is not None and self.end_fleet:
            await asyncio.to_thread(self.fleet.end, "the trainer's RolloutClient closed")

    async def __aenter__(self) -> "RolloutClient":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def __aiter__(self):
        return self

    async def __anext__(self) -> StepBatch:
        return await self.next_batch()

    # ------------------------------------------------------------------ data
    def _iter_items(self) -> Iterator[tuple[int, int, Any]]:
        for epoch in itertools.count():
            if self.max_epochs is not None and epoch >= self.max_epochs:
                return
            self.epoch = epoch
            if callable(self.dataset):
                items = enumerate(self.dataset(epoch))
            else:
                order = list(range(len(self.dataset)))
                if self.shuffle:
                    random.Random(self.seed + epoch).shuffle(order)
                items = ((i, self.dataset[i]) for i in order)
            empty = True
            for index, item in items:
                empty = False
                yield epoch, index, item
            if empty:
                return

    def _next_group(self) -> Optional[Group]:
        if self._regen:
            old = self._regen.popleft()
            return Group(uid=old.uid, item=old.item, instance=old.instance, epoch=old.epoch, index=old.index,
                         submit_version=self.weight_version, attempt=old.attempt + 1)
        if self.exhausted:
            return None
        if self._items is None:
            self._items = self._iter_items()
        try:
            epoch, index, item = next(self._items)
        except StopIteration:
            self.exhausted = True
            return None
        instance = self.instance_fn(item) if self.instance_fn else item
        if not isinstance(instance, dict) or "data_source" not in instance:
            raise ValueError(f"dataset item {index} of epoch {epoch} is not an instance with data_source")
        return Group(uid=f"e{epoch}-i{index}", item=item, instance=instance, epoch=epoch, index=index,
                     submit_version=self.weight_version)

    # ------------------------------------------------------------------ submission
    @property
    def capacity(self) -> int:
        """Groups that may be outstanding now (submitted, not consumed or discarded).

        With a staleness bound K this is the staleness-aware submission rule of AReaL (Fu et al. 2025): counting
        consumed groups too, at most ``(version + K + 1) * B`` groups may have been submitted by weight version
        ``version`` (versions counted from the first), plus ``oversubscribe``. A group submitted now is then
        consumed within K versions if groups are consumed in order; so after a step takes its groups, nothing
        new is submitted until the weights advance.
        """
        if self.max_staleness is None:
            return self.max_outstanding_groups or 2 * self.B
        versions = self.weight_version - self._first_version
        cap = (versions + self.max_staleness + 1) * self.B + self.oversubscribe - self._consumed
        return min(cap, self.max_outstanding_groups) if self.max_outstanding_groups else cap

    def _group_id(self, group: Group) -> str:
        # A group made again (dropped, or over the staleness bound) is a new group on the server: under the old
        # id a completion-time group that ended would answer its members at once with speed 0.
        return f"{self.job_prefix}-{group.uid}" + (f"-a{group.attempt}" if group.attempt else "")

    def _pick_server(self, group: Group) -> str:
        """The rollout server for a job of ``group``, as the server chooser picks it (least-in-flight keeps a
        group's samples on its first sample's server: they share the prompt, and that server keeps them on one
        backend through ``group_id``: prefix-cache reuse); the first pick becomes ``group.server``."""
        server = self.chooser.choose(self._servers(), self._group_id(group))
        if group.server is None:
            group.server = server
        return server

    def _servers(self) -> Sequence[str]:
        """The servers a job may go to now: the URLs, or a fleet's routable members (those with a live lease
        when none is routable: a job sent there comes back filtered and is regenerated)."""
        if self.fleet is not None:  # a snapshot: the fleet's reading thread changes it under us
            return list(self.fleet) or self.fleet.known_urls()
        return self.urls

    async def _replenish_forever(self) -> None:
        while not self._closed:
            if self.fleet is not None and not self._servers():  # no member yet (or none left): wait for one
                await self.fleet.wait_for_members(3600.0)
                continue
            while len(self.queue) < self.capacity and self._servers():
                group = self._next_group()
                if group is None:
                    break
                self._submit(group)
            self._changed.set()
            self._wake.clear()
            await self._wake.wait()

    def _submit(self, group: Group) -> None:
        group.seq = self.queue.push(group)
        for i in range(self.n):
            group.samples.append(self._start_sample(group, i, 0, self._pick_server(group)))

    def _start_sample(self, group: Group, slot: int, retries: int, server: str,
                      failed_on: Optional[set[str]] = None, drains: int = 0) -> Sample:
        self._in_flight[server] += 1
        self.chooser.started(server, self._group_id(group))
        jid = (f"{self.job_prefix}-{group.uid}-a{group.attempt}-s{slot}" + (f"-r{retries}" if retries else "")
               + (f"-d{drains}" if drains else ""))
        sample = Sample(job_id=jid, server=server, submitted_at=time.monotonic(), slot=slot, retries=retries,
                        failed_on=set(failed_on or ()), drains=drains)
        sample.task = asyncio.create_task(self._run_sample(group, sample))
        self._tasks.add(sample.task)
        sample.task.add_done_callback(self._tasks.discard)
        self._counters["submitted_jobs"] += 1
        return sample

    async def _run_sample(self, group: Group, sample: Sample) -> None:
        request = process_request(group.instance, self.sampling_params, job_id=sample.job_id,
                                  group_id=self._group_id(group), timeout_s=self.timeout_s, group_size=self.n,
                                  speed_weight=self.completion_time_weight)
        # The job client's rules (trainer_plugins.jobs): 503 offered again for unavailable_retry_s; a server
        # that fails or vanishes gives a filtered result (no outcome of the model: regenerated like one the
        # server filtered); a cancelled job is never sent if it was not yet; a refused instance or token is an
        # error for the trainer, raised by next_batch.
        try:
            result = await self._jobs.submit(sample.server, request, what=f"dataset item {group.index} of "
                                             f"epoch {group.epoch} ({_describe(group.instance)})")
        except CONFIGURATION_FAULTS as e:  # token, handler unavailable or unknown, refused instance
            self._error = self._error or e
            sample.result = filtered_result(sample.job_id, "invalid_instance", str(e))
            sample.finished_at = time.monotonic()
            self._discard(group)  # not regenerated: the next next_batch call raises the error
            return
        finally:
            self._in_flight[sample.server] -= 1
            self.chooser.finished(sample.server, self._group_id(group))
        sample.result = result
        sample.finished_at = time.monotonic()
        if result.critical_error and result.critical_error != "cancelled":
            self._counters["failed_jobs"] += 1
        self._on_sample_done(group, sample)

    def _on_sample_done(self, group: Group, sample: Sample) -> None:
        if group.discarded:
            self._wasted_s += sample.counted_s
            return
        if sample.filtered:
            self._on_filtered(group, sample)
        elif group.complete:
            if self.dynamic_sampling and not group.informative:
                self._discard(group)
                self._counters["dropped_groups"] += 1
                self._wasted_s += sum(s.counted_s for s in group.samples)
            else:
                self.queue.mark_ready(group.seq)
        self._changed.set()
        self._wake.set()

    def _on_filtered(self, group: Group, sample: Sample) -> None:
        """A result not to be trained on: regenerate its sample (a new job of the same group, on another
        server when there is one) or, past ``max_sample_retries``, drop the group and cancel its other jobs."""
        assert sample.result is not None
        self._counters["filtered_jobs"] += 1
        self._failure_kinds[sample.result.failure_kind or sample.result.critical_error or "unspecified"] += 1
        servers = self._servers()
        counted = uses_retry(sample.result, sample.server, sample.failed_on)
        if (not counted or sample.retries < self.max_sample_retries) and not self._closed and servers \
                and not never_rerun(sample.result):  # an expired id ran once: never a second sample of it
            self._wasted_s += sample.counted_s
            failed_on = set(sample.failed_on)
            # a completion-time group lives on its server, which waits for the replacement: elsewhere it would
            # be a group of its own (trainer_plugins.jobs, "Retry and failover")
            if not self.completion_time_weight or sample.result.failure_kind in (ROLLOUT_SERVER, DRAINING):
                failed_on.add(sample.server)
            server = self._jobs.retry_server(servers, self._group_id(group), failed_on, self.chooser)
            group.samples[group.samples.index(sample)] = self._start_sample(
                group, sample.slot, sample.retries + counted, server, failed_on, sample.drains + (not counted))
            self._counters["samples_regenerated"] += 1
            return
        self._counters["groups_dropped_filtered"] += 1
        log.info("group %s dropped: sample %d still filtered after %d regeneration(s) (%s)", group.uid,
                 sample.slot, sample.retries, sample.result.failure_kind)
        self._wasted_s += sum(s.counted_s for s in group.samples if s.done)
        self._discard(group)
        if not self._closed and any(not s.done for s in group.samples):
            task = asyncio.create_task(self._cancel_groups([group], "a sample stayed filtered"))
            self._cancelling.add(task)
            task.add_done_callback(self._cancelling.discard)

    def _discard(self, group: Group) -> None:
        group.discarded = True
        if group.seq in self.queue:
            self.queue.remove(group.seq)
        self._wake.set()
        self._changed.set()

    async def _cancel_groups(self, groups: Iterable[Group], why: str) -> None:
        """Discard groups; cancel their running jobs on the servers; count finished jobs as wasted."""
        calls = []
        for g in groups:
            if not g.discarded:
                self._discard(g)
                self._wasted_s += sum(s.counted_s for s in g.samples if s.done)
            for s in g.samples:
                if not s.done and not s.cancel_requested:
                    s.cancel_requested = True
                    calls.append(self._cancel_job(s))
        if calls:
            log.debug("cancelling %d job(s): %s", len(calls), why)
            await asyncio.gather(*calls)

    async def _cancel_job(self, sample: Sample) -> None:
        # the job client's cancel: also when /process has not reached the server yet (see trainer_plugins.jobs)
        if await self._jobs.cancel(sample.server, sample.job_id):
            self._counters["cancelled_jobs"] += 1

    # ------------------------------------------------------------------ staleness
    def lag(self, group: Group, version: Optional[int] = None) -> int:
        return (self.weight_version if version is None else version) - group.version

    def _over_bound(self, group: Group, version: Optional[int] = None) -> bool:
        return self.max_staleness is not None and self.lag(group, version) > self.max_staleness

    def _due(self) -> set[int]:
        """``seq`` of the queued groups this step must take first, as the staleness policy says (``"wait"``:
        those that would be over the bound at the next version; verl's ``max_off_policy_strategy=wait``)."""
        if self.max_staleness is None:
            return set()
        return {s for s, g in self.queue
                if self.staleness_policy.due(self.lag(g, self.weight_version + 1), self.max_staleness)}

    async def _handle_stale(self, groups: list[Group]) -> None:
        if not groups:
            return
        self._counters["stale_groups"] += len(groups)
        await self._cancel_groups(groups, "stale")
        if self.staleness_policy.regenerate():
            self._regen.extend(groups)
            self._counters["regenerated_groups"] += len(groups)
        self._wake.set()

    # ------------------------------------------------------------------ trainer API
    async def next_batch(self) -> StepBatch:
        """Wait for ``groups_per_step`` informative groups admissible under the window and the staleness
        bound; take them; cancel what can no longer be used (early termination); report metrics.

        Returns fewer groups only when the dataset is exhausted. Raises ``StopAsyncIteration`` when it is
        exhausted and nothing is left; :class:`trainer_plugins.jobs.InvalidInstanceError` (naming the dataset
        item) when a server or its handler refused an instance, :class:`trainer_plugins.jobs.RolloutAuthError`
        when a server refused the token: both are the trainer's configuration to fix, never retried.
        """
        await self.start()
        t0 = time.monotonic()
        taken: list[Group] = []
        while len(taken) < self.B:
            if self._error is not None:
                raise self._error
            # One at a time: taking the head slides the window and may bring ready groups into it.
            ready = self.queue.takeable()
            due = self._due()
            if due:  # "wait": groups that would be over the bound next step go first, finished or not
                ready = [s for s in ready if s in due]
                if not ready:
                    self._changed.clear()
                    self._wake.set()
                    await self._changed.wait()
                    continue
                self._counters["waited_groups"] += 1
            if ready:
                group = self.queue.get(ready[0])
                if self._over_bound(group):
                    await self._handle_stale([group])
                else:
                    taken.append(self.queue.take(ready[0]))
                continue
            if self.exhausted and not self._regen and len(self.queue) == 0:
                break
            self._changed.clear()
            self._wake.set()
            await self._changed.wait()
        waited = time.monotonic() - t0
        self._consumed += len(taken)
        if not taken:
            raise StopAsyncIteration

        # Early termination: what cannot be consumed within the bound at the next version is cancelled now.
        remaining = [g for _, g in self.queue]
        if not self.carry_over:
            await self._cancel_groups(remaining, "no carry-over")
        else:
            await self._handle_stale([g for g in remaining if self._over_bound(g, self.weight_version + 1)])

        m = StepMetrics(step=self.step, weight_version=self.weight_version, epoch=self.epoch)
        m.groups = len(taken)
        m.samples = sum(len(g.samples) for g in taken)
        m.lag = [self.lag(g) for g in taken]
        rewards = [r for g in taken for r in g.rewards]
        m.mean_reward = sum(rewards) / len(rewards) if rewards else None
        values: dict[str, list[float]] = {}
        for g in taken:
            for r in g.results:
                for name, c in r.reward_components.items():
                    values.setdefault(name, []).append(c.value)
        m.mean_reward_components = {name: sum(v) / len(v) for name, v in sorted(values.items())}
        m.trainer_wait_s = waited
        for k in ("submitted_jobs", "cancelled_jobs", "failed_jobs", "dropped_groups", "stale_groups",
                  "regenerated_groups", "waited_groups", "filtered_jobs", "samples_regenerated",
                  "groups_dropped_filtered"):
            setattr(m, k, self._counters.pop(k, 0))
        m.failure_kinds, self._failure_kinds = dict(self._failure_kinds), Counter()
        carried = [g for _, g in self.queue]
        m.carried_groups = len(carried)
        m.carried_finished_jobs = sum(1 for g in carried for s in g.samples if s.done)
        m.carried_inflight_jobs = sum(1 for g in carried for s in g.samples if not s.done)
        m.wasted_rollout_s, self._wasted_s = self._wasted_s, 0.0
        self.step += 1
        self._wake.set()
        return StepBatch(groups=taken, metrics=m)

    async def update_weights(self, version: Optional[int] = None,
                             backends: Union[None, Sequence[str], Mapping[str, Sequence[str]]] = None,
                             register: bool = True) -> int:
        """Advance the weight version (default: +1) after the trainer pushed new weights to its vLLM
        servers; with ``register``, clear and re-register the LLM backends on every rollout server with the
        new ``weight_version`` (``backends``: one list for all servers, ``{server_url: [backend, ...]}``, or
        None for the ``llm_backends`` of servers.json; nothing is registered where the list is empty).
        Groups now over the staleness bound are handled by the policy. Returns the new version.

        Raises:
            RuntimeError: a server refused the registration (its answer is in the message).
        """
        await self.start()
        version = self.weight_version + 1 if version is None else version
        if register:
            if backends is None:
                per_server = self.server_backends
            elif isinstance(backends, Mapping):
                per_server = {u: list(backends.get(u, ())) for u in self.urls}
            else:
                per_server = {u: list(backends) for u in self.urls}
            targets = [u for u in self.urls if per_server.get(u)]
            await asyncio.gather(*(self._register(u, per_server[u], version) for u in targets))
            if self.registrar is not None and backends is not None and not isinstance(backends, Mapping):
                self.registrar.set(backends, version, registered=targets)  # members that join later get them
        self.weight_version = version
        await self._handle_stale([g for _, g in self.queue if self._over_bound(g)])
        self._wake.set()
        return version

    async def _register(self, server: str, backends: Sequence[str], version: int) -> None:
        await register_backends(self._session, server, backends, version, clear=True)

    def in_flight(self) -> dict[str, int]:
        """This client's running jobs per server URL."""
        return dict(self._in_flight)
