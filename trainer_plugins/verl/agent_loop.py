"""verl agent loop that runs each dataset row as a job on a ProRL rollout server (verl 0.9.1).

Registered through the YAML named by ``actor_rollout_ref.rollout.agent.agent_loop_config_path`` (see
``config/agent_loop.yaml``), not verl's ``@register`` decorator: the decorator only fills a registry in the
process that imports the module, and verl's ``AgentLoopWorker`` runs in a Ray worker that never imports it;
the YAML is read by every worker and instantiated with ``hydra.utils.instantiate``.

Per row, :meth:`ProRLAgentLoop.run`:

1. builds the instance (:meth:`ProRLAgentLoop.build_instance`): ``extra_info.instance`` when the dataset
   carries a full rollout-server instance, else the default mapping of a verl row (see ``build_instance``),
   which the shipped ``math`` and ``code`` handlers accept; a row that maps to no valid instance is an
   :class:`InvalidRowError` naming the row;
2. submits it with ``POST /process``, a job id of its own and ``group_id`` = the row's ``uid`` (the n samples
   of one prompt share it in verl), to the rollout server the ``server_chooser`` picks for the group (default
   ``"rendezvous"``, :class:`trainer_plugins.admission.RendezvousByGroup`: rendezvous hashing, so verl's
   workers agree with no shared state): every sample of a group goes to one server, which keeps them on one
   LLM backend (the prompt's prefix cache); rows without a ``uid`` go round-robin;
3. cancels the job on the server (``POST /cancel``) if the loop is cancelled (verl aborts a rollout) or the
   request outlives ``request_timeout_s``;
4. re-submits a sample that must not be trained on: a result with ``filter: true`` (the server's
   infrastructure faults: dead sandbox, unreachable backend, harness fault, job timeout, cancel), a request
   past ``request_timeout_s``, or a rollout server that is unreachable or answers 5xx (the next attempt goes
   to a server where the sample has not failed yet, while there is one). At most ``max_sample_retries`` times; then the row is a *filtered row* (below);
   a 503 (no LLM backend registered yet, a swap) is first offered again on the same server for 120 s.

Steps 2-4 are :meth:`trainer_plugins.jobs.JobSubmitter.run`, the one rollout client (``prorl-run``, the TRL
plugin and ``RolloutClient`` use it too; its module docstring has the full table and the cancel rule). A
401/403 is a :class:`trainer_plugins.jobs.RolloutAuthError`; a 400 ``handler_unavailable`` a
:class:`trainer_plugins.jobs.HandlerUnavailableError`; another 4xx or ``failure_kind="invalid_instance"`` an
:class:`InvalidRowError`: all configuration faults, which stop training (below).
5. returns every segment of the job's trajectory (a rollout split by a template or context rewrite has
   several), each an ``AgentLoopOutput``: the server's tokens (``prompt_ids``, ``response_ids``,
   ``response_mask`` = our ``loss_mask``, per-token ``response_logprobs``), ``reward_score`` = the job's
   reward, and ``extra_fields`` with ``reward_extra_info = {"acc": resolved, "score": reward}`` (DAPO's
   ``algorithm.filter_groups.metric``), integer ``min_global_steps`` / ``max_global_steps`` (the weight
   versions the segment was generated with; the V1 trainer's staleness tags need both) and ``prorl`` (job id,
   backend, ``failure_kind``, ``filter``, attempts, segment index, ``truncated``).

Truncation is never silent. verl's rows hold at most ``rollout.prompt_length`` prompt tokens and
``rollout.response_length`` response tokens; a segment longer than that is cut (the prompt from the left, the
response at the end) while the reward is the whole episode's, so a cut sample would teach the policy with a
reward earned by tokens it never sees. The ``truncation`` setting decides what happens to a sample with a cut
segment (DAPO, Yu et al. 2025, section 3.4, "overlong filtering", is the reference):

- ``"mask"`` (default): every segment of the sample gets ``response_mask`` 0: it trains nothing, its reward
  still counts in its group's baseline (DAPO's overlong filtering);
- ``"filter"``: the sample is a filtered row (below): ``ProRLReplayBuffer`` evicts its group and verl refills it.

Either way ``extra_fields.prorl.truncated`` = ``{"prompt": tokens cut, "response": tokens cut}``, the row is
logged, :attr:`ProRLAgentLoop.truncation_counts` counts it in the worker, and ``ProRLReplayBuffer`` reports
``training/prorl_truncated/samples`` per step. Raise ``rollout.prompt_length`` / ``response_length`` (or
lower the handler's turns and ``max_tokens``) when the count is not 0.

Segments and rewards. verl's V1 worker (``AgentLoopWorkerTQ``, the shipped configs' ``trainer.use_v1``) passes
``session_id`` and accepts a list: every segment is stored as ``{uid}_{session_id}_{index}``, the last
segment's reward is copied onto the others (``AgentLoopWorkerTQ._agent_loop_postprocess``), and GRPO computes
the advantage once per session from the last segment and gives it to every token of every segment
(``verl.trainer.ppo.v1.utils.compute_advantage_for_multi_trajectories``). So each segment carries the job's
reward here too, the reward counts once in the group's baseline, and every generated token of the episode is
trained with the episode's advantage. verl's legacy ``AgentLoopWorker`` takes one output per row: it gets the
last segment (the one that ends the episode), and ``extra_fields.prorl.segments`` says how many there were.

Filtered rows. verl needs a row for every sample it asked for, and V1 fails a whole prompt group when a
session raises, so a sample that still fails after its retries is returned as a row with zero loss: the row's
prompt, one response token (EOS; verl indexes the last response position) with ``response_mask`` 0 and
logprob 0, reward 0, ``extra_fields.prorl.filter`` true. ``ProRLReplayBuffer``
(:mod:`trainer_plugins.verl.replay_buffer`, set as the V1 sampler in ``prorl_base.yaml``) evicts the group of
such a row before it is trained, as verl evicts a failed group, and verl refills it with a fresh prompt
(metric ``training/prorl_filtered/evicted_samples``). Without that sampler (the legacy trainer, or another
sampler) the row trains nothing itself, but its reward 0 enters its group's GRPO baseline. verl's DAPO
``filter_groups`` cannot drop a group for one row (it drops groups whose metric is the same on every row), so
the filtered row's ``acc`` is 0.0 like any unsolved row.

Configuration faults. A fault no retry can fix stops training with its message: a refused bearer token
(:class:`trainer_plugins.jobs.RolloutAuthError`), a handler the rollout server cannot run (HTTP 400
``handler_unavailable``, e.g. no sandbox runtime: :class:`trainer_plugins.jobs.HandlerUnavailableError`) or
does not have (``unknown_handler``), a row that maps to no valid instance (:class:`InvalidRowError`), a relay
that cannot serve or register (:class:`trainer_plugins.verl.relay.RelayError`: verl reports no version, a
rollout server is unreachable, or the rollout server cannot reach the relay), a turn with no weight version
(:class:`MissingWeightVersionError`). Under verl's legacy worker the exception does it. verl's V1 worker
(``AgentLoopWorkerTQ._run_prompt``) catches every exception of a session and only marks its group failed, so
there :meth:`ProRLAgentLoop.run` returns a row marked ``extra_fields.prorl.fatal`` instead, and
``ProRLReplayBuffer`` (the V1 sampler of ``prorl_base.yaml``) raises it in the trainer process when it reads
the row: ``main_ppo`` ends with the fault's message. (Another V1 sampler would train that row as a zero-loss
row: keep ``ProRLReplayBuffer``.) Job faults (``filter: true``: a dead sandbox, a timeout, an unreachable
backend) are retried as above.

Completion time (issue #35; docs/http-api.md "Relative completion time"). ``completion_time_weight`` (``w``, in
[0, 10]; the YAML entry's key, else ``prorl.completion_time_weight``, default 0) > 0 sends each training row
with ``completion_time: true``, ``group_id`` (``verl-{uid}``), ``group_size`` (``rollout.n``) and
``reward_weights: {"speed": w}``: the server answers a group's rows when the group ends and their ``reward``
(this row's ``reward_score``) is outcome + ``w * speed``, with ``speed`` on the last turn's token in the
per-turn layout. ``extra_fields.prorl.reward_components.speed`` is the row's ``speed`` itself (unweighted), so
``ProRLReplayBuffer`` logs ``training/prorl_reward/speed`` next to the weighted components. Validation rows
(told apart by ``val_kwargs``' sampling params; verl passes no other sign) go without it, and a row scored by
verl's own scorer (``reward_source``) trains on that score, without ``speed``. With 0 none of these fields is
sent (a server from before #35 refuses unknown fields).

The reward is the rollout server's (its handler's eval stage), so verl's reward loop is not needed for these
rows, except for rows of verl's math datasets (``reward_source: auto``): the ``math`` handler reads only the
last ``\\boxed{}``, while gsm8k asks for ``#### 42`` and DAPO/AIME for ``Answer: 42``, so a model following
its prompt would score 0 there. Those rows get verl's own scorer for their ``data_source``
(``verl.utils.reward_score.default_compute_score``) on the job's final assistant message, the same reward
verl gives them; the server's is kept in ``extra_fields.prorl.server_reward``.
"""
from __future__ import annotations

import asyncio
import logging
import weakref
from collections import Counter
from typing import Any, Optional, Sequence, Union

import numpy as np
from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput

from prorl_server.types import JobResult, TokenizerFingerprint
from trainer_plugins.credit import fit_spans, token_rewards, turn_split
from trainer_plugins.admission import SERVER_CHOOSERS, ServerChooser, as_server_chooser
from trainer_plugins.client import resolve_servers
from trainer_plugins.jobs import (CONFIGURATION_FAULTS, ConfigurationError, InvalidInstanceError, JobSubmitter,
                                  RolloutAuthError, completion_time_weight, process_request)
from trainer_plugins.tokenizer_check import NotYet, check_tokenizer
from trainer_plugins.verl.prefix_grouper import prefix_grouper_refusal
from trainer_plugins.verl.relay import RelayError, relay_for_loop
from trainer_plugins.verl.stale import STALE_ROWS

log = logging.getLogger(__name__)

Servers = Union[str, Sequence[str], None]

#: verl's usual ``data_source`` names of math datasets (``verl.utils.reward_score.default_compute_score``) ->
#: the rollout server's ``math`` handler
VERL_MATH_SOURCES = ("openai/gsm8k", "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500",
                     "math_dapo", "math_dapo_reasoning")
#: characters of the final answer verl's scorers read (its end; they look for the last answer in it)
VERL_SCORE_MAX_CHARS = 20000
#: ``extra_info`` keys that are verl's bookkeeping, not task fields (everything else passes into the instance)
EXTRA_INFO_META = ("instance", "index", "split", "tools_kwargs", "interaction_kwargs", "need_tools_kwargs")


class ProRLAgentLoopOutput(AgentLoopOutput):
    """An ``AgentLoopOutput`` whose ``rm_scores`` can carry per-turn rewards (issue #35 part 4).

    ``token_rewards``: per response token, each turn's reward on its last sampled token
    (:func:`trainer_plugins.credit.token_rewards`, summing to the row's reward), or None: verl's own layout
    (``reward_score`` on the last response token, ``AgentLoopOutput.as_dict``). verl's V1 worker
    (``AgentLoopWorkerTQ``) stores what :meth:`as_dict` returns; the legacy worker reads ``reward_score`` only.
    """

    token_rewards: Optional[list[float]] = None

    def as_dict(self) -> dict[str, Any]:
        output = super().as_dict()
        token_rewards = output.pop("token_rewards", None)
        if token_rewards is not None and "rm_scores" in output:
            import torch  # verl's dependency; imported here so this module's import stays light

            output["rm_scores"] = torch.tensor(token_rewards, dtype=torch.float32)
        return output


def turn_credit(result: JobResult, trajectory_index: int) -> Optional[tuple[list[tuple[int, int]], list[float]]]:
    """:func:`trainer_plugins.credit.turn_split` of a job result (None: verl's last-token placement stays); a
    split whose shares do not sum to the reward is logged."""
    split = turn_split(result.turns, result.reward, trajectory_index)
    if split is None and len(result.turns) > 1 and abs(sum(t.reward for t in result.turns) - result.reward) > 1e-9:
        log.warning("job %s: its turns' rewards sum to %r, not its reward %r: reward kept on the last token",
                    result.job_id, sum(t.reward for t in result.turns), result.reward)
    return split


class MissingWeightVersionError(ConfigurationError, ValueError):
    """A turn was generated with no weight version although verl's replicas serve the jobs (the relay): its
    staleness cannot be known. verl's trainer never set a step on its replicas; retrying cannot help."""


class InvalidRowError(InvalidInstanceError):
    """A dataset row maps to no instance the rollout server accepts (no handler name, the server answered 4xx,
    or the job failed with ``failure_kind="invalid_instance"``). The message names the row (``data_source``,
    ``extra_info.index``, ``uid``) and the server's reason. Retrying cannot help: it is the dataset's or the
    mapping's fault."""


def row_name(row: dict[str, Any]) -> str:
    """``data_source=..., index=..., uid=...`` of a verl row, for error messages."""
    extra = row.get("extra_info")
    index = extra.get("index") if hasattr(extra, "get") else None
    return ", ".join(f"{k}={_jsonable(v)!r}" for k, v in (("data_source", row.get("data_source")),
                                                          ("index", index), ("uid", row.get("uid")))
                     if v is not None) or "a row with no data_source, index or uid"


def last_user_text(messages: Any) -> Optional[str]:
    """The text of the last ``user`` message of a chat (OpenAI message dicts; a content given as parts
    contributes its ``text`` parts), or None."""
    for m in reversed(messages if isinstance(messages, list) else []):
        if isinstance(m, dict) and m.get("role") == "user":
            content = m.get("content")
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            return content if isinstance(content, str) and content else None
    return None


def _jsonable(x: Any) -> Any:
    """numpy scalars/arrays (verl's non-tensor batch) and OmegaConf containers -> plain JSON types."""
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, np.ndarray):
        return [_jsonable(v) for v in x.tolist()]
    if isinstance(x, dict) or hasattr(x, "items"):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)) or (hasattr(x, "__iter__") and not isinstance(x, (str, bytes))):
        return [_jsonable(v) for v in x]
    return x


#: errors that stop training (retrying cannot help): see "Configuration faults" in the module docstring
STOPS_TRAINING: tuple[type[BaseException], ...] = (*CONFIGURATION_FAULTS, RelayError)


class ProRLAgentLoop(AgentLoopBase):
    """``AgentLoopBase`` whose rollouts run on ProRL rollout servers.

    Keyword settings (from the YAML entry; a setting the entry leaves null comes from the ``prorl`` section of
    verl's config, ``prorl_base.yaml``, which is resolved in the trainer's process and shipped to every worker;
    the other arguments are verl's, passed by ``AgentLoopWorker``):
        servers: rollout servers: a comma-separated URL list, a list of URLs, or the path of ``servers.json``
            (file or directory; token and same-node ordering come from it). Required.
        token: bearer token (servers.json brings its own).
        handler: force ``instance.data_source`` (when the dataset's data_source is not a handler name).
        job_timeout_s: the job's ``timeout_s`` (counted seconds on the server; None: the server default).
        request_timeout_s: wall-clock limit of one attempt, queue waits included (None: none); the job is
            cancelled on the server when it passes and the sample is re-submitted (a row may take up to
            ``(1 + max_sample_retries) * request_timeout_s``).
        max_tokens: per-turn ``max_tokens`` sent to the server (default: ``rollout.response_length``).
        max_sample_retries: how many times a sample that must not be trained on (``filter: true``, timed
            out, server unreachable) is re-submitted before it becomes a filtered row (default 2).
        server_chooser: how a row's rollout server is picked (:data:`trainer_plugins.admission.SERVER_CHOOSERS`:
            ``"rendezvous"``, the default, or ``"least_in_flight"``, which counts this worker's jobs only).
        truncation: what a sample cut to the rollout lengths becomes: ``"mask"`` (default: zero loss, DAPO's
            overlong filtering) or ``"filter"`` (a filtered row; its group is dropped). See the module docstring.
        backends: ``"relay"`` (default: verl's replicas, through the relay) or ``"external"``.
        relay_host: where the relay binds and what it advertises, per node
            (:func:`trainer_plugins.verl.relay.resolve_relay_host`): null (each worker's Ray node IP), an
            interface name (``ib0``) or a network (``10.1.0.0/16``) resolved on each node, or one address.
        tokenizer_path: the model id the relay reports at ``/v1/models``, from which a rollout server started
            without ``--tokenizer`` loads its tokenizer (default: ``actor_rollout_ref.model.path``, which may
            not exist on the rollout servers' nodes).
        reward_source: ``"auto"`` (default): rows of verl's math datasets (:data:`VERL_MATH_SOURCES`,
            ``aime*``) get verl's own reward for their ``data_source`` (``verl.utils.reward_score``: gsm8k's
            ``#### 42``, MATH's ``\\boxed{}``, DAPO/AIME's ``Answer: 42``) on the job's final answer, every other
            row the rollout server's; ``"server"``: always the server's; ``"verl"``: always verl's.
        log_level: the plugin's log level in the workers (``INFO`` shows the relay's versions and one line
            per row with its weight versions and reward).
    """

    #: what a cut sample becomes (see the module docstring)
    TRUNCATION_MODES = ("mask", "filter")
    #: samples this process cut, by mode (``{"mask": n, "filter": n}``)
    truncation_counts: "Counter[str]" = Counter()

    # server_chooser name -> the chooser every loop of this process shares (its round-robin and counts)
    _choosers: dict[str, ServerChooser] = {}
    _resolved: dict[str, tuple[list[str], dict[str, str]]] = {}  # servers setting -> (urls, headers)
    _policy_fingerprint: Optional[TokenizerFingerprint] = None  # of this process's policy tokenizer
    _tokenizer_checked: set[str] = set()  # rollout servers whose tokenizer matched the policy's (external)
    # event loop -> (servers, token, request_timeout_s) -> the submitter (one HTTP session) its loops share
    _submitters: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple, JobSubmitter]]" = \
        weakref.WeakKeyDictionary()

    def __init__(self, *args: Any, servers: Servers = None, token: Optional[str] = None,
                 handler: Optional[str] = None, job_timeout_s: Optional[float] = None,
                 request_timeout_s: Optional[float] = None, max_tokens: Optional[int] = None,
                 backends: Optional[str] = None, relay_host: Optional[str] = None,
                 relay_heartbeat_s: Optional[float] = 30.0, max_sample_retries: int = 2,
                 server_chooser: str = "rendezvous", truncation: Optional[str] = None,
                 tokenizer_path: Optional[str] = None, log_level: Optional[str] = None,
                 reward_source: Optional[str] = None, completion_time_weight: Any = None, **kwargs: Any) -> None:
        kwargs.pop("name", None)  # the registry entry's own name
        kwargs.pop("tools", None)  # tools run in the rollout server's sandboxes, not here
        super().__init__(*args, **kwargs)
        # The verl config's `prorl` section (prorl_base.yaml) fills every setting the YAML entry leaves null: it
        # is resolved in the trainer's process and travels inside verl's config to every worker on every node,
        # where a worker's own environment may differ from the driver's.
        section = _jsonable(self.config.get("prorl") or {}) if hasattr(self.config, "get") else {}
        section = section if isinstance(section, dict) else {}
        refusal = prefix_grouper_refusal(self.config)  # issue #34 part 4: trainer_plugins/verl/prefix_grouper.py
        if refusal:
            raise ValueError(refusal)

        def pick(value: Any, name: str, default: Any = None) -> Any:
            for v in (value, section.get(name)):
                if v not in (None, ""):
                    return v
            return default

        servers, token, handler = pick(servers, "servers"), pick(token, "token"), pick(handler, "handler")
        max_tokens, backends = pick(max_tokens, "max_tokens"), pick(backends, "backends", "relay")
        relay_host, truncation = pick(relay_host, "relay_host"), pick(truncation, "truncation", "mask")
        self.tokenizer_path = pick(tokenizer_path, "tokenizer_path")
        self.reward_source = pick(reward_source, "reward_source", "auto")
        if self.reward_source not in ("auto", "server", "verl"):
            raise ValueError(f"reward_source must be auto, server or verl, got {self.reward_source!r}")
        level = pick(log_level, "log_level")
        if level:  # verl sets the root logger to WARNING; the relay's versions and per-row lines are INFO
            logging.getLogger("trainer_plugins").setLevel(str(level).upper())
        if not servers:
            raise ValueError("ProRLAgentLoop needs `servers` (URLs or servers.json): set prorl.servers in verl's "
                             "config (or PRORL_SERVERS where the trainer starts)")
        self.servers = servers if isinstance(servers, str) else ",".join(servers)
        self.token = token
        self.handler = handler
        self.job_timeout_s = job_timeout_s
        self.request_timeout_s = request_timeout_s
        self.prompt_length = int(self.rollout_config.prompt_length)
        self.response_length = int(self.rollout_config.response_length)
        self.max_tokens = int(max_tokens) if max_tokens not in (None, "") else self.response_length
        if int(max_sample_retries) < 0:
            raise ValueError(f"max_sample_retries must be >= 0, got {max_sample_retries!r}")
        self.max_sample_retries = int(max_sample_retries)
        if server_chooser not in SERVER_CHOOSERS:
            raise ValueError(f"server_chooser must be one of {sorted(SERVER_CHOOSERS)}, got {server_chooser!r}")
        self.chooser = self._choosers.setdefault(server_chooser, as_server_chooser(server_chooser))
        if truncation not in self.TRUNCATION_MODES:
            raise ValueError(f"truncation must be one of {list(self.TRUNCATION_MODES)}, got {truncation!r}")
        self.truncation = truncation
        if backends not in ("relay", "external"):
            raise ValueError(f"backends must be 'relay' or 'external', got {backends!r}")
        # relay: verl's replicas serve the jobs through this worker's relay (trainer_plugins/verl/relay.py)
        self.managed = backends == "relay" and self.server_manager is not None
        self.relay_host, self.relay_heartbeat_s, self.relay = relay_host, relay_heartbeat_s, None
        self._completion_time_settings(pick(completion_time_weight, "completion_time_weight", 0.0))

    def _completion_time_settings(self, weight: Any) -> None:
        """Check ``completion_time_weight`` (module docstring, "Completion time") and read the group sizes.

        Raises:
            ValueError: the weight is not a number in [0, 10], or it is on while validation rows (``val_kwargs.n``
                samples a prompt) cannot be told from training rows (``rollout.n``) by their sampling params.
        """
        #: weight of ``speed`` in the server's reward; > 0: training rows go with completion_time (issue #35)
        self.completion_time_weight = completion_time_weight(weight)
        r = self.rollout_config
        self.group_size = int(_jsonable(r.get("n", 1)) or 1)
        val = r.get("val_kwargs") or {}
        self._val_params = tuple(_jsonable(val.get(k)) for k in ("temperature", "top_p", "top_k"))
        train = tuple(_jsonable(r.get(k)) for k in ("temperature", "top_p", "top_k"))
        #: validation rows are told apart by the sampling params verl gives them (it passes no other sign)
        self._val_distinct = self._val_params != train
        val_n = int(_jsonable(val.get("n", 1)) or 1)
        if self.completion_time_weight and val_n != self.group_size and not self._val_distinct:
            raise ValueError(
                f"completion_time_weight {self.completion_time_weight:g}: validation samples {val_n} per prompt "
                f"and training {self.group_size}, with the same temperature/top_p/top_k, so a row's group size is "
                "unknown here (verl does not pass it) and a validation group would wait for members that never "
                "come; set rollout.val_kwargs.n to rollout.n, or give validation other sampling params")

    def completion_time_fields(self, sampling_params: dict[str, Any]) -> dict[str, Any]:
        """``process_request`` keywords of the relative completion time reward for a row sampled with
        ``sampling_params`` (verl's): ``group_size`` (``rollout.n``) and ``speed_weight``; none for a validation
        row (its sampling params are ``val_kwargs``'), which trains nothing."""
        if not self.completion_time_weight:
            return {}
        got = tuple(_jsonable(sampling_params.get(k)) for k in ("temperature", "top_p", "top_k"))
        if self._val_distinct and got == self._val_params:
            return {}
        return {"group_size": self.group_size, "speed_weight": self.completion_time_weight}

    # ------------------------------------------------------------------ servers
    async def _servers(self) -> tuple[list[str], dict[str, str]]:
        cached = self._resolved.get(self.servers)
        if cached is None:
            urls, headers, _ = await asyncio.to_thread(resolve_servers, self.servers)  # may read servers.json
            cached = self._resolved[self.servers] = (urls, headers)
        urls, headers = cached
        if self.token:
            headers = {**headers, "Authorization": f"Bearer {self.token}"}
        return urls, headers

    async def _check_tokenizers(self, urls: Sequence[str], headers: dict[str, str]) -> None:
        """``backends: external``: compare each rollout server's tokenizer with the policy's, once per server and
        process (:mod:`trainer_plugins.tokenizer_check`; a server with no backend yet is checked at a later row).

        Raises:
            trainer_plugins.tokenizer_check.TokenizerMismatchError: a server's tokenizer is not the policy's.
        """
        if not hasattr(self.tokenizer, "get_vocab"):
            return
        cls = type(self)
        if cls._policy_fingerprint is None:
            cls._policy_fingerprint = await asyncio.to_thread(TokenizerFingerprint.of, self.tokenizer)
        session = self._jobs(headers).session
        for url in urls:
            if url in cls._tokenizer_checked:
                continue
            try:
                await check_tokenizer(session, url, cls._policy_fingerprint, timeout_s=120.0)
            except NotYet:
                continue
            cls._tokenizer_checked.add(url)

    def _jobs(self, headers: dict[str, str]) -> JobSubmitter:
        """The :class:`trainer_plugins.jobs.JobSubmitter` of this process's event loop for these servers,
        token and ``request_timeout_s``: every row of a worker shares its HTTP session (an aiohttp session is
        bound to the loop it was opened on, hence one per loop)."""
        per_loop = self._submitters.setdefault(asyncio.get_running_loop(), {})
        key = (self.servers, self.token, self.request_timeout_s)
        if key not in per_loop:
            per_loop[key] = JobSubmitter(headers, request_timeout_s=self.request_timeout_s)
        return per_loop[key]

    # ------------------------------------------------------------------ row -> instance
    def build_instance(self, row: dict[str, Any]) -> dict[str, Any]:
        """The rollout-server instance for one verl dataset row (its non-tensor fields).

        ``extra_info.instance``, when the row carries one, is the instance as it is (``reward_model.ground_truth``
        fills ``answer`` if it has none). Otherwise the default mapping, for rows as verl's preprocessing
        scripts write them (``data_source``, ``prompt``/``raw_prompt``, ``reward_model``, ``extra_info``):

        - every ``extra_info`` field but verl's bookkeeping (``index``, ``split``, tool kwargs) passes through,
          so a row whose ``extra_info`` holds ``prompt``/``tests``/``entry_point`` is a ``code`` instance;
        - ``answer`` = ``reward_model.ground_truth`` (over ``extra_info.answer``: verl's gsm8k rows keep the
          worked solution there);
        - ``question`` = ``extra_info.question`` if present, else the text of ``raw_prompt``'s last user
          message (the ``math`` handler's field);
        - ``messages`` = ``raw_prompt`` (handlers that take the chat as it is);
        - ``data_source`` = the ``handler`` setting, else the row's, with verl's math dataset names
          (:data:`VERL_MATH_SOURCES`, ``aime*``) read as ``math``;
        - ``instance_id`` = ``extra_info.index``.

        Returns:
            the instance (plain JSON types).
        Raises:
            InvalidRowError: the row names no handler, or ``extra_info.instance`` is not an object.
        """
        extra = _jsonable(row.get("extra_info") or {})
        extra = extra if isinstance(extra, dict) else {}
        ground_truth = _jsonable(row.get("reward_model") or {})
        ground_truth = ground_truth.get("ground_truth") if isinstance(ground_truth, dict) else None
        messages = _jsonable(row["raw_prompt"]) if row.get("raw_prompt") is not None else None
        if extra.get("instance") is not None:
            if not isinstance(extra["instance"], dict):
                raise InvalidRowError(f"row ({row_name(row)}): extra_info.instance must be an object, got "
                                      f"{type(extra['instance']).__name__}")
            instance = dict(extra["instance"])
            if ground_truth is not None:
                instance.setdefault("answer", ground_truth)
        else:
            instance = {k: v for k, v in extra.items() if k not in EXTRA_INFO_META}
            if ground_truth is not None:
                instance["answer"] = ground_truth
            if "question" not in instance and last_user_text(messages) is not None:
                instance["question"] = last_user_text(messages)
            source = _jsonable(row.get("data_source"))
            if isinstance(source, str) and (source in VERL_MATH_SOURCES or source.startswith("aime")):
                source = "math"
            instance["data_source"] = source
        if self.handler:
            instance["data_source"] = self.handler
        if messages is not None:
            instance.setdefault("messages", messages)
        if "index" in extra:
            instance.setdefault("instance_id", str(extra["index"]))
        if not isinstance(instance.get("data_source"), str) or not instance["data_source"]:
            raise InvalidRowError(f"row ({row_name(row)}) names no handler: give it a data_source, set "
                                  "extra_info.instance.data_source, or set the agent loop's `handler`")
        return instance

    def sampling_params_for_server(self, sampling_params: dict[str, Any]) -> dict[str, Any]:
        """verl's sampling params -> vLLM completions parameters (the server always asks for logprobs)."""
        sp = {k: _jsonable(v) for k, v in sampling_params.items() if k in ("temperature", "top_p", "top_k",
                                                                        "repetition_penalty", "seed")}
        if sp.get("top_k") in (-1, 0, None):
            sp.pop("top_k", None)
        sp["max_tokens"] = self.max_tokens
        return sp

    # ------------------------------------------------------------------ run
    async def run(self, sampling_params: dict[str, Any],
                  **kwargs: Any) -> Union[AgentLoopOutput, list[AgentLoopOutput]]:
        """Run one row as a job on a rollout server (:meth:`run_row`), with configuration faults made to stop
        training under verl's V1 worker too (see "Configuration faults" in the module docstring).

        Returns: what :meth:`run_row` returns; under V1, a row marked ``extra_fields.prorl.fatal`` for a
        configuration fault (``ProRLReplayBuffer`` then stops training with its message), or a zero-loss row
        marked ``extra_fields.prorl.stale`` when the trainer cancelled the row's group as stale
        (:mod:`trainer_plugins.verl.stale`).
        Raises: what :meth:`run_row` raises, under the legacy worker (which stops training on it).
        """
        try:
            if "session_id" not in kwargs or _jsonable(kwargs.get("uid")) in (None, ""):
                return await self.run_row(sampling_params, **kwargs)
            return await self._run_unless_stale(sampling_params, kwargs)
        except STOPS_TRAINING as e:
            if "session_id" not in kwargs:  # the legacy worker: the exception reaches the trainer and stops it
                raise
            message = f"{type(e).__name__}: {e}"
            log.error("row (%s): %s; training stops (ProRLReplayBuffer raises it in the trainer)",
                      row_name(kwargs), message)
            return [await self.fatal_output(kwargs, message)]

    async def _run_unless_stale(self, sampling_params: dict[str, Any],
                                kwargs: dict[str, Any]) -> Union[AgentLoopOutput, list[AgentLoopOutput]]:
        """:meth:`run_row` as a task the trainer can cancel when the row's group becomes stale (verl's V1 worker;
        :mod:`trainer_plugins.verl.stale`): the cancel reaches the job on its rollout server through the
        rollout client, and the row ends as :meth:`stale_output`. A cancel of this loop itself (verl's) still
        raises CancelledError."""
        uid = str(_jsonable(kwargs["uid"]))
        if STALE_ROWS.is_stale(uid):  # declared stale before this row started: no job at all
            return [await self.stale_output(kwargs)]
        task = asyncio.ensure_future(self.run_row(sampling_params, **kwargs))
        STALE_ROWS.add(uid, task)
        try:
            return await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if (current is not None and current.cancelling()) or not STALE_ROWS.is_stale(uid):
                raise
            return [await self.stale_output(kwargs)]
        finally:
            STALE_ROWS.discard(uid, task)

    async def stale_output(self, row: dict[str, Any]) -> AgentLoopOutput:
        """The zero-loss row of a sample the trainer cancelled because its prompt group can no longer be trained
        (``extra_fields.prorl``: ``stale`` true, ``filter`` true, ``failure_kind`` ``cancelled``): verl evicts
        its group as stale; the circuit breaker does not count it as a fault."""
        out = await self.fatal_output(row, "")
        out.extra_fields["prorl"].update(fatal=None, stale=True, failure_kind="cancelled",
                                         error="cancelled by the trainer: its prompt group is past "
                                               "max_off_policy_threshold")
        log.info("row (%s): cancelled, its prompt group can no longer be trained (stale)", row_name(row))
        return out

    async def fatal_output(self, row: dict[str, Any], message: str) -> AgentLoopOutput:
        """A zero-loss row (the row's prompt, one EOS response token with mask 0, reward 0) whose
        ``extra_fields.prorl.fatal`` carries ``message``: how a configuration fault leaves verl's V1 worker
        (which catches every exception of a session) and reaches the trainer process."""
        prompt_ids: list[int] = []
        messages = _jsonable(row["raw_prompt"]) if row.get("raw_prompt") is not None else None
        if messages:
            try:
                prompt_ids = list(await self.ct_build_initial_tokens(messages))[-self.prompt_length:]
            except Exception:  # the fault may be the row itself; the row only has to carry the message
                prompt_ids = []
        eos = self._eos_id()
        return AgentLoopOutput(
            prompt_ids=prompt_ids or [eos], response_ids=[eos], response_mask=[0], response_logprobs=[0.0],
            reward_score=0.0, num_turns=1, metrics=AgentLoopMetrics(),
            extra_fields={"reward_extra_info": {"acc": 0.0, "score": 0.0},
                          "min_global_steps": int(_jsonable(row.get("global_steps")) or 0),
                          "max_global_steps": int(_jsonable(row.get("global_steps")) or 0),
                          "turn_scores": [], "tool_rewards": [],
                          "prorl": {"fatal": message, "filter": True, "job_id": None, "truncated": None,
                                    "segment": 0, "segments": 1}})

    async def run_row(self, sampling_params: dict[str, Any],
                      **kwargs: Any) -> Union[AgentLoopOutput, list[AgentLoopOutput]]:
        """Run one row as a job on a rollout server; see the module docstring.

        Returns:
            under verl's V1 worker (``session_id`` among the row's fields): a list with one
            ``AgentLoopOutput`` per trajectory segment (one zero-loss row for a filtered sample); under the
            legacy worker: the last segment.
        Raises:
            asyncio.CancelledError: the loop was cancelled (the job is cancelled on the server first).
            InvalidRowError: the row maps to no valid instance (the server answered 4xx, or the job failed
                with ``failure_kind="invalid_instance"``).
            trainer_plugins.jobs.RolloutAuthError: a rollout server refused our bearer token (401/403; a
                RuntimeError).
            trainer_plugins.jobs.HandlerUnavailableError: a rollout server cannot run the row's handler (e.g. it
                has no sandbox runtime); the server's message.
            trainer_plugins.verl.relay.RelayError: the relay could not serve (no version from verl, a rollout
                server or the relay's own address unreachable).
            MissingWeightVersionError: a turn was generated with no weight version.
        """
        urls, headers = await self._servers()
        if self.managed:  # registers the trainer's replicas (through the relay) before the first job
            self.relay = await relay_for_loop(self, urls, headers)
            if self.relay.refused:  # a rollout server that joined later failed the tokenizer handshake
                raise RelayError(self.relay.refused)
        else:  # the servers' own backends: their tokenizer must still be the policy's
            await self._check_tokenizers(urls, headers)
        request = process_request(self.build_instance(kwargs), self.sampling_params_for_server(sampling_params),
                                  group_id=self.group_id(kwargs), timeout_s=self.job_timeout_s,
                                  **self.completion_time_fields(sampling_params))
        try:
            outcome = await self._jobs(headers).run(urls, request, max_sample_retries=self.max_sample_retries,
                                                    chooser=self.chooser, what="the row", job_prefix="verl")
        except InvalidInstanceError as e:
            raise InvalidRowError(f"row ({row_name(kwargs)}): {e}") from e
        except RolloutAuthError as e:
            raise RolloutAuthError(f"{e}; set `token` (PRORL_TOKEN) or use the servers.json that carries it") from e
        result = outcome.result
        if outcome.filtered and self.relay is not None and self.relay.fatal:
            # the relay refused a turn with no weight version: the job failed as an LLM fault, but it is verl's
            raise MissingWeightVersionError(self.relay.fatal)
        attempts = [vars(a) for a in outcome.attempts]  # job_id, server, failure_kind, error
        if outcome.filtered:  # the last attempt is listed too: every job the row cost, for the metadata
            attempts.append({"job_id": result.job_id, "server": outcome.server,
                             "failure_kind": result.failure_kind, "error": result.error})
            log.warning("row (%s): giving up after %d attempts: a filtered row", row_name(kwargs),
                        len(attempts) + 1)
        outputs = await self.to_outputs(result, kwargs, attempts)
        log.info("row (%s): job %s reward %.4f weight versions %s filter %s truncated %s", row_name(kwargs),
                 result.job_id, outputs[-1].reward_score,
                 [[o.extra_fields["min_global_steps"], o.extra_fields["max_global_steps"]] for o in outputs],
                 outputs[-1].extra_fields["prorl"]["filter"], outputs[-1].extra_fields["prorl"]["truncated"])
        if "session_id" in kwargs:  # verl's V1 worker (AgentLoopWorkerTQ) stores every output
            return outputs
        return outputs[-1]

    def group_id(self, row: dict[str, Any]) -> Optional[str]:
        """The row's group: verl gives the n samples of one prompt the same ``uid`` (the V1 trainer per prompt
        before ``AgentLoopWorkerTQ`` runs its n sessions; the legacy trainer before repeating the batch)."""
        uid = _jsonable(row.get("uid"))
        return f"verl-{uid}"[:200] if uid not in (None, "") else None

    # ------------------------------------------------------------------ result -> AgentLoopOutput
    async def to_outputs(self, result: Union[JobResult, dict[str, Any]], row: dict[str, Any],
                         attempts: Sequence[dict[str, Any]] = ()) -> list[AgentLoopOutput]:
        """Job result -> one ``AgentLoopOutput`` per trajectory segment, in order (see the module docstring;
        lengths capped to the rollout config). A job with no trajectory, or one that must not be trained on
        (``filter``), yields one zero-loss row: the row's prompt, one EOS response token with mask 0.

        ``result``: the job result (a dict in the wire shape is parsed into :class:`JobResult`).

        Raises:
            ValueError: a segment's ``loss_mask`` or logprobs do not match its response tokens, or (relay
                backends) tokens were generated without a weight version; pydantic.ValidationError: a dict
                that is no job result.
        """
        if not isinstance(result, JobResult):
            result = JobResult.model_validate(result)
        filtered = bool(result.filter)
        segments = [] if filtered else [t.model_dump() for t in result.trajectories if t.prompt_ids]
        cut = self.cut_tokens(segments)
        if cut is not None:
            self.truncation_counts[self.truncation] += 1
            log.warning("row (%s), job %s: %d prompt and %d response tokens beyond the rollout lengths "
                        "(prompt_length=%d, response_length=%d): the sample is %s", row_name(row), result.job_id,
                        cut["prompt"], cut["response"], self.prompt_length, self.response_length,
                        "masked (zero loss)" if self.truncation == "mask" else "filtered (its group is dropped)")
            if self.truncation == "filter":
                filtered, segments = True, []
        reward = 0.0 if filtered else float(result.reward)
        acc = 1.0 if result.resolved and not filtered else 0.0
        server_reward = reward
        scorer = self.verl_scorer_source(row)
        if scorer is not None and not filtered:
            reward, acc = await self.verl_score(scorer, result, row)
        timing = result.timing.model_dump()
        kept = [j for j, t in enumerate(result.trajectories) if t.prompt_ids]
        # per-turn rewards only where the row is the whole episode: verl's V1 GRPO scores a split episode by
        # its last segment's rm_scores alone, so a split episode keeps the whole reward on each segment's end
        credit = (turn_credit(result, kept[0]) if len(segments) == 1 and len(kept) == 1 and scorer is None
                  and not filtered else None)
        components = {name: c.weight * c.value for name, c in result.reward_components.items()} if not filtered else {}
        if self.completion_time_weight and result.speed is not None and not filtered:
            components["speed"] = float(result.speed)  # the group-relative speed itself, unweighted
        if not segments:
            messages = self.build_instance(row).get("messages") or []
            prompt_ids = await self.ct_build_initial_tokens(messages) if messages else []
            segments = [{"prompt_ids": prompt_ids, "response_ids": [], "loss_mask": [], "response_logprobs": []}]
        outputs = []
        for i, traj in enumerate(segments):
            response_ids = [int(t) for t in traj.get("response_ids") or []]
            response_mask = [int(m) for m in traj.get("loss_mask") or []]
            logprobs = [float(x) for x in traj.get("response_logprobs") or []] or [0.0] * len(response_ids)
            if len(response_mask) != len(response_ids):
                raise ValueError(f"job {result.job_id} segment {i}: loss_mask has {len(response_mask)} "
                                 f"entries for {len(response_ids)} response tokens")
            if len(logprobs) != len(response_ids):
                raise ValueError(f"job {result.job_id} segment {i}: {len(logprobs)} logprobs for "
                                 f"{len(response_ids)} tokens")
            response_ids, response_mask, logprobs = (x[:self.response_length] for x in
                                                     (response_ids, response_mask, logprobs))
            if cut is not None:  # truncation "mask": the sample trains nothing (DAPO's overlong filtering)
                response_mask = [0] * len(response_mask)
            if not response_ids:  # verl writes the reward at the last response position: one untrained token
                response_ids, response_mask, logprobs = [self._eos_id()], [0], [0.0]
            versions = self._versions(traj, result, row, generated=any(response_mask))
            routes = self._routes(traj, len(response_ids))
            per_token = None
            if credit is not None:
                spans, shares = fit_spans(len(response_ids), *credit)
                per_token = token_rewards(len(response_ids), spans, shares) if spans else None
            outputs.append(ProRLAgentLoopOutput(
                token_rewards=per_token,
                prompt_ids=list(traj["prompt_ids"])[-self.prompt_length:],
                response_ids=response_ids,
                response_mask=response_mask,
                response_logprobs=logprobs,
                routed_experts=routes,
                reward_score=reward,
                num_turns=int(traj.get("num_turns") or 0) or len(result.messages) or 2,
                metrics=AgentLoopMetrics(generate_sequences=float(timing.get("run_s") or 0.0),
                                         compute_score=float(timing.get("eval_s") or 0.0)),
                extra_fields={
                    "reward_extra_info": {"acc": acc, "score": reward},
                    "min_global_steps": int(min(versions)),
                    "max_global_steps": int(max(versions)),
                    "turn_scores": [],
                    "tool_rewards": [],
                    "prorl": {"job_id": result.job_id, "backend": result.backend,
                              "critical_error": result.critical_error,
                              "failure_kind": result.failure_kind, "filter": filtered,
                              "error": result.error if filtered else None, "attempts": list(attempts),
                              "segment": i, "segments": len(segments),
                              "finish_reason": traj.get("finish_reason"), "truncated": cut,
                              "truncation": self.truncation if cut is not None else None,
                              "reward_source": "verl" if scorer is not None else "server",
                              "server_reward": server_reward,
                              "credit": "turns" if per_token is not None else "last_token",
                              "reward_components": components,
                              "timing": timing},
                },
            ))
        return outputs

    def _routes(self, traj: dict[str, Any], n_response: int) -> Any:
        """The row's routed experts (R3) in verl's layout: an int16 array ``[positions, layers, top_k]`` for the
        positions of the output row (``prompt_ids[-prompt_length:] + response_ids[:response_length]``) from
        its first, as verl's tool agent loop gives its last turn's ``TokenOutput.routed_experts``
        (``AgentLoopOutput.as_dict`` zero-pads the positions past its end; verl's R3 replay leaves the last
        row native). None when the trajectory has no record. The record is the trajectory's own (one per
        segment of a split episode), so the routes stay on the tokens they were computed for."""
        routes = traj.get("routed_experts")
        if not routes:
            return None
        import numpy as np  # verl's dependency

        P = len(traj.get("prompt_ids") or [])
        cut = max(0, P - self.prompt_length)  # the prompt is cut from the left (to_outputs)
        kept = routes[cut:P + n_response]
        return np.asarray(kept, dtype=np.int16) if kept else None

    def verl_scorer_source(self, row: dict[str, Any]) -> Optional[str]:
        """The row's ``data_source`` when its reward comes from verl's own scorer (``reward_source``), else None."""
        source = _jsonable(row.get("data_source"))
        if self.reward_source == "server" or not isinstance(source, str):
            return None
        if source in VERL_MATH_SOURCES or source.startswith("aime"):
            return source
        if self.reward_source == "verl":
            # verl's scorers for other sources parse the answer with what can execute (prime_math: sympy's
            # parse_expr) or run it (sandbox_fusion): not on model-written text in the trainer
            # (docs/reward-integrity.md, I1). These are string and regex work only.
            raise ValueError(f"reward_source=verl: verl's scorer for data_source {source!r} is not one this plugin "
                             f"runs on model-written text (only {', '.join(VERL_MATH_SOURCES)}, aime*); use "
                             "reward_source=server for it")
        return None

    async def verl_score(self, data_source: str, result: JobResult, row: dict[str, Any]) -> tuple[float, float]:
        """``(reward, acc)`` of a job by ``verl.utils.reward_score.default_compute_score`` for ``data_source``, on
        the text of the job's last assistant message (at most :data:`VERL_SCORE_MAX_CHARS`, its end) and the
        row's ``reward_model.ground_truth``; run in a thread (string processing only, no evaluation)."""
        from verl.utils.reward_score import default_compute_score

        text = next((m.get("content") for m in reversed(result.messages or [])
                     if isinstance(m, dict) and m.get("role") == "assistant"), None)
        if isinstance(text, list):
            text = "".join(p.get("text", "") for p in text if isinstance(p, dict))
        text = text[-VERL_SCORE_MAX_CHARS:] if isinstance(text, str) else ""
        truth = _jsonable(row.get("reward_model") or {})
        truth = truth.get("ground_truth") if isinstance(truth, dict) else None
        if truth is None or not text:
            return 0.0, 0.0
        res = await asyncio.to_thread(default_compute_score, data_source, text, str(truth))
        if isinstance(res, dict):
            score = float(res.get("score", 0.0))
            return score, float(bool(res.get("acc", score >= 1.0)))
        return float(res), float(float(res) >= 1.0)

    def cut_tokens(self, segments: Sequence[dict[str, Any]]) -> Optional[dict[str, int]]:
        """``{"prompt": tokens, "response": tokens}`` the rollout lengths would cut from ``segments`` (summed
        over segments), or None when every segment fits."""
        prompt = sum(max(0, len(t.get("prompt_ids") or ()) - self.prompt_length) for t in segments)
        response = sum(max(0, len(t.get("response_ids") or ()) - self.response_length) for t in segments)
        return {"prompt": prompt, "response": response} if prompt or response else None

    async def to_output(self, result: Union[JobResult, dict[str, Any]], row: dict[str, Any]) -> AgentLoopOutput:
        """The last segment of :meth:`to_outputs` (what verl's legacy worker takes)."""
        return (await self.to_outputs(result, row))[-1]

    def _eos_id(self) -> int:
        for tid in (self.tokenizer.eos_token_id, self.tokenizer.pad_token_id):
            if isinstance(tid, int):
                return tid
        return 0

    def _versions(self, traj: dict[str, Any], result: JobResult, row: dict[str, Any],
                  generated: bool) -> list[int]:
        """The weight versions a segment was generated with (its turns' ``weight_versions``, else the job's
        ``weight_version``); for a segment with none, see the cases below."""
        versions = [v for v in traj.get("weight_versions") or () if isinstance(v, int)]
        if not versions and result.weight_version is not None:
            versions = [result.weight_version]
        if not versions and self.managed:  # the relay versions every turn: none is an error, not a guess
            if generated:
                raise MissingWeightVersionError(f"job {result.job_id}: generated tokens with no weight version")
            if self.relay is not None:
                versions = [self.relay.version]  # nothing generated: the weights current when the row ended
        if not versions:  # backends=external and the server knows no version: the row's trainer step
            gs = row.get("global_steps")
            versions = [int(_jsonable(gs)) if gs is not None else 0]
        return versions
