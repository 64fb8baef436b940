"""TRL ``GRPOTrainer`` rollouts on ProRL rollout servers.

``GRPOTrainer(rollout_func=ProRLRollout(...))`` (trl 1.16): TRL calls the rollout function with the prompts of
one generation batch, each prompt repeated ``num_generations`` times in a row (its ``RepeatSampler``), and
expects, per prompt entry, ``prompt_ids``, ``completion_ids`` and ``logprobs``; ``env_mask`` (1: a token the
model generated, 0: an environment token) is its loss mask for multi-turn rollouts, and every other key is
forwarded to the reward functions (``GRPOTrainer._generate`` / ``_calculate_rewards``).

Per call, :meth:`ProRLRollout.__call__`:

1. maps each prompt to a rollout-server instance (:meth:`ProRLRollout.instance_for`: a table built from the
   instances, or a function); a prompt it cannot map is an :class:`UnknownPromptError` naming the prompt;
2. runs each entry as one job (``POST /process``) through the rollout client of :mod:`trainer_plugins.jobs`
   (its submit, cancel, retry and failover rules); the ``num_generations`` jobs of one prompt share a
   ``group_id`` and a rollout server (the ``server_chooser``, default ``"least_in_flight"``: the least loaded
   by this function's own count), so the server keeps them on one LLM backend (the prompt's prefix cache). A
   result with ``filter: true`` (sandbox died, backend unreachable, timeout, a dead rollout server) is
   re-submitted up to ``max_sample_retries`` times, on a server where the sample has not failed yet while
   there is one; a prompt the handler refuses is an :class:`~trainer_plugins.jobs.InvalidInstanceError`
   naming the prompt;
3. returns the job's trajectory as TRL's row: ``prompt_ids`` / ``completion_ids`` = the server's exact
   ``prompt_ids`` / ``response_ids`` (model turns *and* the environment's messages between them),
   ``logprobs`` = ``response_logprobs`` (0.0 on environment tokens), ``env_mask`` = the server's
   ``loss_mask``, and extra fields for the reward functions: ``prorl_reward`` (the server's reward; use
   :func:`server_reward` as the reward function), ``prorl_weight_versions`` (the distinct versions of the
   row), ``prorl_token_versions`` (per completion token: the weight version that generated it, None on
   environment tokens and where the server does not say), ``prorl_mixed_version_turns`` (turns whose tokens
   span a weight swap), ``prorl_prompt`` (the prompt the row was generated for), ``prorl_job_id``,
   ``prorl_filtered``, ``prorl_failure_kind``.

Per-token versions come from the trajectory's ``version_runs`` (``[[version or null, n_tokens], ...]``,
run-length over its generated tokens in order), written by rollout servers that orchestrate weight swaps; an
older server's trajectory has only ``weight_versions``, and its tokens get that version when there is one,
None otherwise.

Asynchronous rollouts (``prefetch=k``, ``True`` meaning 1): the jobs of the next ``k`` steps run while the
trainer trains on this one. TRL hands the rollout function the prompts of the batch it is about to train on,
never the next batch's, so a call submits the prompts it is given and returns the batch submitted ``k`` calls
earlier (``k`` steps off-policy at most; the first call fills the pipeline by running its prompts ``k + 1``
times: once for itself, ``k`` times in flight). With ``k = 2`` the servers always hold a batch of the next
steps while the trainer trains, even when one step's batch generates faster than the step trains. The rows'
``prorl_prompt`` names the prompt each row was generated for (TRL's own ``prompts`` argument of the reward
functions is then a later batch's: use :func:`server_reward` or ``prorl_prompt``). The tokens generated
before a weight swap carry the old version, those after it the new one (``prorl_token_versions``).

Staleness bound (issue #32 part 2): rows are at most :attr:`ProRLRollout.staleness_bound` weight versions behind
the trainer when they are trained: ``max_staleness`` when given, else, with ``prefetch = k``, ``k`` times the
versions one call spans (one per optimizer step: ``ceil(steps_per_generation * num_iterations /
gradient_accumulation_steps)`` of TRL's ``GRPOConfig``, 1 by default), the lag prefetch itself gives. Before a
call takes its batch, and after every weight push (:class:`~trainer_plugins.trl.weights.WeightPushCallback`), a
prefetched batch submitted more than the bound behind the trainer can no longer be trained: its running jobs are
cancelled on the servers (``POST /cancel``) and its prompts submitted again. At the end of training
(``on_train_end``) the prefetched batches cannot be trained at all and are cancelled. The jobs cancelled are
counted per call (:attr:`RolloutStats.stale_cancelled`, logged, and TRL's logged metric
``prorl/stale_cancelled``) and in all (:attr:`ProRLRollout.stale_cancelled`);
the callback also gives the bound to the servers' swap, which drops jobs staler than it.

Per-turn credit (issue #35 part 4; :mod:`trainer_plugins.credit`, shared with the verl plugin). Every row
carries ``prorl_token_rewards``: per completion token, each turn's share of the reward on its last sampled token
when the handler split the reward over turns (``JobResult.turns``; all of them in the row's segment, summing to
the reward), else the whole reward on the last token, as verl places it; ``[0.0]`` for a filtered row. With
``reward_to_go=True`` rows also carry ``prorl_token_returns``: every token of turn k gets
``G_k = r_k + gamma * G_{k+1}`` (0.0 outside the turns; a row from a server with no turn records is one turn).
TRL's ``GRPOTrainer`` trains on one reward per row (the reward functions'), so these fields change nothing by
themselves: they reach a reward function (as keyword arguments) or a trainer subclass that weights tokens.
The weighted reward components (``weight * value`` of ``JobResult.reward_components``), averaged over the
rows handed to TRL, are logged per step as ``prorl/reward/{name}`` (:attr:`RolloutStats.reward_components`).

Completion time (issue #35; docs/http-api.md "Relative completion time"). With ``completion_time_weight=w > 0``
every job goes with ``completion_time: true``, its prompt group's ``group_id`` and ``group_size`` (TRL's
``num_generations``) and ``reward_weights: {"speed": w}``: the server answers a group's rows when the group
ends, each with ``speed`` in [-1, 1] (its model time against the group's resolved median; 0 when unresolved)
and ``reward`` = outcome + ``w * speed``, so ``prorl_reward`` (what :func:`server_reward` trains on) and the
per-turn split (``speed`` on the last turn) already include it. ``prorl/reward/speed`` logs the batch's mean
``speed`` itself, unweighted. A filtered attempt is answered at once and its group waits for the
re-submission, which goes back to the group's server (``trainer_plugins/jobs.py``, "Retry and failover"); one
that comes after its group ended gets ``speed`` 0.
With 0 (the default) none of these fields is sent.

Importance sampling: TRL corrects the gap between the sampling policy and the trainer
(``vllm_importance_sampling_correction``, ``_mode``, ``_clip_min/max`` of ``GRPOConfig``: a truncated or
masked ratio ``exp(trainer logprob - sampling logprob)`` per token or sequence) only when ``use_vllm`` is
set, which a ``rollout_func`` run does not need. With the correction on (GRPOConfig's default), the rollout
function turns it on for the trainer on its first call: the rows' ``logprobs`` are the server's sampling
logprobs, TRL computes the trainer's at the start of the step and weights each token's loss by the ratio. TRL's
own vLLM weight sync is replaced by a no-op (:class:`WeightPushCallback` pushes the weights). vLLM reports
logprobs before temperature scaling unless started with ``--logprobs-mode processed_logprobs``: use that when
sampling at a temperature other than 1.

A rollout split into several segments by a template or context rewrite gives TRL its last segment (the one that
ends the episode; TRL takes one sequence per row); the others' tokens are counted in
``tokens_discarded``. A sample still filtered after its retries becomes a row TRL cannot learn from: one EOS
token with ``env_mask`` 0 and reward ``None`` (:func:`server_reward` returns None for it; TRL leaves a row
that every reward function scores None out of its group's baseline and gives it advantage 0).

Sampling: every job is sent TRL's ``temperature`` (TRL divides the trainer's logits by it, so the rollout must
sample at the same temperature for the importance ratio to be 1), ``top_p`` / ``top_k`` when set, and
``max_tokens`` (per model turn; default ``max_completion_length``).

Persistent faults stop training (issue #32): every prompt group of a call is shown to a
:class:`trainer_plugins.breaker.FaultBreaker` (kept across calls), and a call raises
:class:`trainer_plugins.breaker.PersistentFaultError`, naming the ``failure_kind``, the count and the last error,
once ``breaker_consecutive_groups`` (8) groups in a row were filtered for one kind, or more than
``breaker_max_share`` (90%) of the last ``breaker_window`` (64) rows. A row TRL cannot learn from trains nothing,
so without it a dead backend or a handler that refuses every row would spin silently.

Tokenizer handshake: before its jobs run, a call compares each rollout server's tokenizer and chat template
(``GET /tokenizer``) with the trainer's ``processing_class`` (:mod:`trainer_plugins.tokenizer_check`), once per
server (a server with no LLM backend yet is checked at a later call), and raises
:class:`trainer_plugins.tokenizer_check.TokenizerMismatchError` with both fingerprints on a mismatch.

Per call, :attr:`ProRLRollout.history` gets a :class:`RolloutStats` (rewards, versions, filtered rows,
discarded tokens, the first-batch importance ratio when ``measure_ratio`` is on).
"""
from __future__ import annotations

import asyncio
import logging
import math
import os
import threading
import time
import uuid
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from trainer_plugins.admission import ServerChooser, as_server_chooser
from trainer_plugins.breaker import FaultBreaker, Sample
from trainer_plugins.tokenizer_check import NotYet, check_tokenizer
from trainer_plugins.client import resolve_servers
from trainer_plugins.credit import row_token_credit, row_token_returns, turn_split
from trainer_plugins.jobs import JobOutcome, JobSubmitter, completion_time_weight as check_speed_weight, process_request
from trainer_plugins.servers import ServersFile

log = logging.getLogger(__name__)

Prompt = Union[str, list]
Instances = Union[Sequence[Mapping[str, Any]], Mapping[str, Mapping[str, Any]], Callable[[Prompt], Mapping[str, Any]]]


class UnknownPromptError(KeyError):
    """A prompt of the dataset maps to no rollout-server instance. The message names the prompt."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown prompt"


def prompt_key(prompt: Prompt) -> str:
    """The text a prompt is looked up by: the prompt itself (a string), or the content of the last ``user``
    message of a conversational prompt (list of ``{role, content}``)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, (list, tuple)):
        for m in reversed(prompt):
            if isinstance(m, Mapping) and m.get("role") == "user":
                content = m.get("content")
                if isinstance(content, list):
                    content = "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
                return str(content)
    raise UnknownPromptError(f"prompt {_short(prompt)} is neither a string nor a conversation with a user message")


def server_reward(prompts: list, completions: list, prorl_reward: Optional[list] = None, **kwargs: Any) -> list:
    """TRL reward function: the rollout server's reward of each row (``prorl_reward``, forwarded by
    :class:`ProRLRollout`); ``None`` for a row that must not be trained on.

    Raises:
        ValueError: the rows did not come from :class:`ProRLRollout` (no ``prorl_reward``).
    """
    if prorl_reward is None:
        raise ValueError("server_reward needs the prorl_reward field: use it with rollout_func=ProRLRollout(...)")
    return list(prorl_reward)


@dataclass
class RolloutStats:
    """One :meth:`ProRLRollout.__call__`. ``rewards``: per row (None for filtered rows); ``versions``: the
    distinct weight versions the batch's turns were generated with; ``filtered_rows``: rows still filtered after
    their retries; ``retries``: re-submissions; ``failure_kinds``: ``{failure_kind: attempts}`` over every
    filtered attempt; ``tokens_generated``: response tokens with ``env_mask`` 1 handed to TRL;
    ``tokens_discarded``: generated tokens not handed to TRL (filtered attempts' are unknown and not counted;
    earlier segments of split rollouts are); ``ratio_dev``: mean ``|exp(trainer logprob - rollout logprob) - 1|``
    over the rows' generated tokens, measured before this batch is trained on (``measure_ratio``; else None);
    ``wall_s``: seconds the call took; ``weight_version``: the version the trainer was at;
    ``token_versions``: ``{version: generated tokens}`` over the rows handed to TRL (``None``: unknown);
    ``mixed_version_turns``: turns that span a weight swap; ``aborted_turns``: generation attempts the servers'
    LLM clients re-sent because a backend aborted them (``llm_pause_retries`` of agent-loop handlers);
    ``prompt_lag``: how many calls before this one the rows' prompts were submitted (0 without ``prefetch``);
    ``stale_cancelled``: jobs cancelled on the servers since the previous call because their prompt group could
    no longer be trained within the staleness bound (module docstring, "Staleness bound");
    ``reward_components``: ``{name: mean of weight * value}`` over the rows handed to TRL (issue #35 part 4),
    logged by TRL as ``prorl/reward/{name}``; ``speed`` (with ``completion_time_weight`` > 0) is the mean
    ``speed`` itself, unweighted."""

    step: int
    weight_version: int
    rewards: list[Optional[float]] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    filtered_rows: int = 0
    retries: int = 0
    failure_kinds: dict[str, int] = field(default_factory=dict)
    tokens_generated: int = 0
    tokens_discarded: int = 0
    ratio_dev: Optional[float] = None
    wall_s: float = 0.0
    token_versions: dict[Optional[int], int] = field(default_factory=dict)
    mixed_version_turns: int = 0
    aborted_turns: int = 0
    prompt_lag: int = 0
    stale_cancelled: int = 0
    reward_components: dict[str, float] = field(default_factory=dict)

    @property
    def mean_reward(self) -> Optional[float]:
        xs = [r for r in self.rewards if r is not None]
        return sum(xs) / len(xs) if xs else None


class _LoopThread:
    """An asyncio event loop on a daemon thread: TRL calls the rollout function and callbacks synchronously,
    and the HTTP session must outlive one call."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="prorl-trl-loop", daemon=True)
        self.thread.start()

    def run(self, coro, timeout: Optional[float] = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(timeout=10)


class ProRLRollout:
    """TRL ``rollout_func`` that runs each prompt as jobs on ProRL rollout servers (see the module docstring).

    Args:
        servers: rollout servers: URLs (a list or a comma-separated string), a :class:`ServersFile`, or the
            path of ``servers.json`` (same-node servers first; its bearer token is used).
        instances: how a prompt becomes an instance: a list of instances (looked up by ``instance[prompt_field]``,
            the text the dataset's ``prompt`` column holds, see :meth:`dataset_rows`), a mapping
            ``prompt text -> instance``, or a function ``prompt -> instance``.
        prompt_field: the instance field holding the prompt text (for a list of instances).
        max_tokens: per model turn (default: the trainer's ``max_completion_length``).
        sampling_params: extra vLLM sampling parameters (temperature/top_p/top_k come from the trainer).
        job_timeout_s: the job's ``timeout_s`` (counted seconds on the server; None: the server's default).
        request_timeout_s: wall-clock limit of one attempt, queue waits included; the job is then cancelled and
            re-submitted (None: none).
        max_sample_retries: re-submissions of a filtered sample before its row is left out of training.
        token: bearer token (servers.json brings its own). local_node: for same-node-first ordering.
        measure_ratio: also run the trainer's model over each batch before it is trained on and record
            ``ratio_dev`` (costs one forward pass per batch).
        unavailable_retry_s: how long a job the server answers 503 is offered again (seconds).
        server_chooser: a :class:`trainer_plugins.admission.ServerChooser` or its name (``"least_in_flight"``,
            the default; ``"rendezvous"``).
        prefetch: how many steps' jobs run ahead while the trainer trains (module docstring, "Asynchronous
            rollouts"; True: 1); 0 / False: each call runs and returns its own prompts (on-policy).
        breaker_consecutive_groups, breaker_window, breaker_max_share: when a persistent fault stops training
            (module docstring; :class:`trainer_plugins.breaker.FaultBreaker`; 0 turns a rule off).
        max_staleness: the largest lag, in weight versions, of a trained row (module docstring, "Staleness
            bound"); None: the bound ``prefetch`` gives (none without ``prefetch``).
        server_trees: fetch each group's verified prefix tree from its server after the call
            (``GET /groups/{id}/tree``), check it here (:func:`trainer_plugins.tree.verified_tree`) and keep it
            in :attr:`server_trees` (:class:`trainer_plugins.trl.tree_pack.ServerTrees`) for the tree-packing
            mixin (``TreePackedLogps``), which then packs the servers' trees instead of building its own.
        reward_to_go: rows also carry ``prorl_token_returns`` (module docstring, "Per-turn credit"); default off.
        gamma: its discount per turn, in ``[0, 1]`` (default 1.0: undiscounted).
        completion_time_weight: weight ``w`` of the relative completion time reward (issue #35; module
            docstring, "Completion time"), in ``[0, 10]``; 0 (default): off, and no field of it is sent.

    Raises:
        ValueError: a setting out of range (``gamma`` outside ``[0, 1]``, a negative ``prefetch``...).
    """

    def __init__(self, servers: Union[str, os.PathLike, ServersFile, Sequence[str]], instances: Instances, *,
                 prompt_field: str = "prompt", max_tokens: Optional[int] = None,
                 sampling_params: Optional[Mapping[str, Any]] = None, job_timeout_s: Optional[float] = None,
                 request_timeout_s: Optional[float] = None, max_sample_retries: int = 2,
                 token: Optional[str] = None, local_node: Optional[str] = None, measure_ratio: bool = False,
                 unavailable_retry_s: float = 120.0, run_id: Optional[str] = None,
                 server_chooser: Union[str, ServerChooser] = "least_in_flight",
                 prefetch: Union[bool, int] = False, breaker_consecutive_groups: int = 8,
                 breaker_window: int = 64, breaker_max_share: float = 0.9,
                 max_staleness: Optional[int] = None, server_trees: bool = False,
                 reward_to_go: bool = False, gamma: float = 1.0, completion_time_weight: float = 0.0) -> None:
        self.breaker = FaultBreaker(breaker_consecutive_groups, breaker_window, breaker_max_share,
                                    what="training (ProRLRollout)")
        self.urls, headers, self.server_backends = resolve_servers(servers, local_node)
        if token:
            headers = {**headers, "Authorization": f"Bearer {token}"}
        self.headers = headers
        self.prompt_field = prompt_field
        self._table: Optional[dict[str, Mapping[str, Any]]] = None
        self._fn: Optional[Callable[[Prompt], Mapping[str, Any]]] = None
        if callable(instances) and not isinstance(instances, Mapping):
            self._fn = instances
        elif isinstance(instances, Mapping):
            self._table = {str(k): v for k, v in instances.items()}
        else:
            self._table = {}
            for i, inst in enumerate(instances):
                if not isinstance(inst, Mapping) or not isinstance(inst.get(prompt_field), str):
                    raise ValueError(f"instance {i} has no string field {prompt_field!r} to look it up by")
                self._table[inst[prompt_field]] = inst
        if max_sample_retries < 0:
            raise ValueError("max_sample_retries must be >= 0")
        self.max_tokens = max_tokens
        self.sampling_params = dict(sampling_params or {})
        self.job_timeout_s = job_timeout_s
        self.max_sample_retries = max_sample_retries
        self.measure_ratio = measure_ratio
        self.run_id = run_id or uuid.uuid4().hex[:8]
        self.weight_version = 0  # advanced by WeightPushCallback after each push
        self.history: list[RolloutStats] = []
        self._calls = 0
        self.chooser = as_server_chooser(server_chooser)
        self._loop: Optional[_LoopThread] = None
        self._submitter_args = dict(unavailable_retry_s=unavailable_retry_s, request_timeout_s=request_timeout_s)
        self._jobs: Optional[JobSubmitter] = None
        # bool is an int; 1.5 or "2" would be truncated or parsed without a word (red team): refused
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch must be False, True or an int >= 0, got {prefetch!r}")
        self.prefetch = int(prefetch)
        if max_staleness is not None and (not isinstance(max_staleness, int) or isinstance(max_staleness, bool)
                                          or max_staleness < 0):
            raise ValueError(f"max_staleness must be an int >= 0 or None, got {max_staleness!r}")
        if max_staleness == 0 and self.prefetch:
            raise ValueError(f"max_staleness=0 with prefetch={prefetch!r} would cancel every prefetched batch (each is "
                             "at least one weight version behind): use prefetch=False to train on-policy, or "
                             "max_staleness >= 1")
        self.max_staleness = max_staleness
        #: weight versions one call spans (one per optimizer step), read from the trainer's config at each call
        self.versions_per_call = 1
        #: jobs cancelled on the servers because their prompt group could no longer be trained, in all
        self.stale_cancelled = 0
        self._stale_since_call = 0
        self._pending: "deque[_Batch]" = deque()
        self._batches = 0
        self._tokenizer_checked: set[str] = set()  # servers whose tokenizer matched the policy's
        #: the servers' verified group trees of the last calls, for tree-packed training (issue #34), or None
        self.server_trees = None
        if server_trees:
            from trainer_plugins.trl.tree_pack import ServerTrees

            self.server_trees = ServerTrees()
        self._policy_fingerprint: Any = None
        if not (isinstance(gamma, (int, float)) and not isinstance(gamma, bool) and 0.0 <= gamma <= 1.0):
            raise ValueError(f"gamma must be a number in [0, 1], got {gamma!r}")
        #: rows carry ``prorl_token_returns`` (per-turn reward-to-go, discounted per turn by :attr:`gamma`)
        self.reward_to_go, self.gamma = bool(reward_to_go), float(gamma)
        #: weight of ``speed`` in the server's reward (> 0: jobs go with completion_time, group_size, reward_weights)
        self.completion_time_weight = check_speed_weight(completion_time_weight)

    # ------------------------------------------------------------------ plumbing
    @property
    def loop(self) -> _LoopThread:
        if self._loop is None:
            self._loop = _LoopThread()
        return self._loop

    def run_async(self, coro, timeout: Optional[float] = None):
        """Run ``coro`` on this rollout's event loop thread and wait for it (for callbacks)."""
        return self.loop.run(coro, timeout)

    @property
    def staleness_bound(self) -> Optional[int]:
        """The largest weight-version lag of a trained row (module docstring, "Staleness bound"); None:
        unbounded (no ``prefetch`` and no ``max_staleness``)."""
        if self.max_staleness is not None:
            return self.max_staleness
        return self.prefetch * self.versions_per_call if self.prefetch else None

    def cancel_stale(self) -> int:
        """Cancel the prefetched batches submitted more than :attr:`staleness_bound` versions before
        :attr:`weight_version` (their running jobs get ``POST /cancel``) and submit their prompts again. Called
        by :class:`~trainer_plugins.trl.weights.WeightPushCallback` after each push and before each call takes
        its batch. Returns the jobs cancelled."""
        bound = self.staleness_bound
        if bound is None or self._loop is None:
            return 0
        n = 0
        for i, batch in enumerate(list(self._pending)):
            if self.weight_version - batch.version <= bound:
                continue
            n += self._unfinished(batch)
            self._loop.run(_cancel(batch.task), timeout=120)
            fresh = self._start(batch.prompts, batch.instances, batch.sp, batch.n, batch.step)
            fresh.call = batch.call  # still the batch of that call (its place in the pipeline)
            self._pending[i] = fresh
        if n:
            log.warning("cancelled %d job(s) of prefetched prompt groups more than %d weight version(s) behind "
                        "the trainer (v%d); their prompts were submitted again", n, bound, self.weight_version)
        self._count_cancelled(n)
        return n

    def cancel_pending(self, why: str = "training ended") -> int:
        """Cancel every prefetched batch (``why``: they can no longer be trained); returns the jobs cancelled on
        the servers. The next call starts the pipeline again."""
        if self._loop is None:
            self._pending.clear()
            return 0
        n = 0
        while self._pending:
            batch = self._pending.popleft()
            n += self._unfinished(batch)
            try:
                self._loop.run(_cancel(batch.task), timeout=120)
            except Exception as e:  # the others must still be cancelled
                log.warning("cancelling a prefetched batch: %r", e)
        if n:
            log.info("%s: cancelled %d job(s) of prefetched prompt groups", why, n)
        self._count_cancelled(n)
        return n

    def _count_cancelled(self, n: int) -> None:
        self.stale_cancelled += n
        self._stale_since_call += n

    @staticmethod
    def _unfinished(batch: "_Batch") -> int:
        return 0 if batch.task is None or batch.task.done() else len(batch.prompts) - batch.finished

    def jobs_in_flight(self) -> int:
        """Row jobs of the prefetched batch not finished yet (what runs while the trainer trains; 0 without
        ``prefetch``)."""
        return sum(len(b.prompts) - b.finished for b in list(self._pending) if not b.task.done())

    def close(self) -> None:
        """Cancel a prefetched batch (its jobs are cancelled on the servers), close the HTTP session and stop
        the loop thread (idempotent)."""
        if self._loop is not None:
            while self._pending:
                try:
                    self._loop.run(_cancel(self._pending.pop().task), timeout=120)
                except Exception as e:  # close goes on: the session and the loop must still end
                    log.warning("cancelling a prefetched batch: %r", e)
            if self._jobs is not None:
                self._loop.run(self._jobs.close())
                self._jobs = None
            self._loop.stop()
            self._loop = None

    def __del__(self) -> None:  # a loop thread is a daemon; the session should still be closed
        try:
            self.close()
        except Exception:
            pass

    def _submitter(self) -> JobSubmitter:
        if self._jobs is None:
            self._jobs = JobSubmitter(self.headers, **self._submitter_args)
        return self._jobs

    # ------------------------------------------------------------------ prompts
    def instance_for(self, prompt: Prompt) -> dict[str, Any]:
        """The instance of one prompt (a copy).

        Raises:
            UnknownPromptError: the table has no such prompt, or the function raised KeyError/ValueError or gave
                no instance with a ``data_source``; the message names the prompt.
        """
        key = prompt_key(prompt)
        try:
            inst = self._fn(prompt) if self._fn is not None else self._table[key]  # type: ignore[index]
        except (KeyError, ValueError) as e:
            raise UnknownPromptError(f"prompt {_short(prompt)} maps to no rollout-server instance ({e!r}); "
                                     f"{self._known_hint()}") from None
        if not isinstance(inst, Mapping) or not isinstance(inst.get("data_source"), str):
            raise UnknownPromptError(f"prompt {_short(prompt)} maps to {_short(inst)}, not an instance with a "
                                     "data_source")
        return dict(inst)

    def _known_hint(self) -> str:
        if self._table is None:
            return "the instance function refused it"
        return f"{len(self._table)} prompts are known, e.g. {_short(next(iter(self._table), None))}"

    @staticmethod
    def dataset_rows(instances: Sequence[Mapping[str, Any]], prompt_field: str = "prompt") -> list[dict[str, Any]]:
        """Rows for a TRL dataset (``datasets.Dataset.from_list``): ``{"prompt": instance[prompt_field]}`` per
        instance (the text :meth:`instance_for` looks the instance up by)."""
        return [{"prompt": inst[prompt_field]} for inst in instances]

    # ------------------------------------------------------------------ TRL entry point
    def __call__(self, prompts: list, trainer: Any) -> dict[str, list]:
        """TRL's ``rollout_func(prompts, trainer)`` (see the module docstring).

        Raises:
            UnknownPromptError, trainer_plugins.jobs.InvalidInstanceError: a prompt with no instance, or one the
                server's handler refuses (each names the prompt).
            trainer_plugins.jobs.RolloutAuthError: a server refused the token.
        """
        t0 = time.monotonic()
        n = int(getattr(trainer, "num_generations", 1) or 1) if trainer is not None else 1
        step = int(getattr(getattr(trainer, "state", None), "global_step", self._calls) or 0)
        instances = [self.instance_for(p) for p in prompts]  # every prompt is checked before any job runs
        self.loop.run(self.check_tokenizers(trainer))
        sp = self._sampling_params(trainer)
        if trainer is not None:
            enable_importance_sampling(trainer)
        if trainer is not None:
            self.versions_per_call = versions_per_call(getattr(trainer, "args", None))
        if self.prefetch:
            self.cancel_stale()  # a batch the trainer has moved too far past is regenerated before it is taken
            if not self._pending:  # the first call: one batch for now (and k more in flight while it trains)
                self._pending.append(self._start(prompts, instances, sp, n, step))
            batch = self._pending.popleft()
            outcomes = batch.future.result()
            # this call's jobs (k of them on the first call) start now and run while the trainer trains
            while len(self._pending) < self.prefetch:
                self._pending.append(self._start(prompts, instances, sp, n, step + 1 + len(self._pending)))
            lag = self._calls - batch.call
            prompts = batch.prompts
        else:
            batch = self._start(prompts, instances, sp, n, step)
            outcomes = batch.future.result()
            lag = 0
        self._record_faults(outcomes, n)  # a persistent fault raises here, before TRL trains on nothing
        rows = self._rows(prompts, outcomes, trainer, step)
        if self.server_trees is not None:
            self.loop.run(self._collect_trees(_tree_groups(batch.groups, outcomes)))
        self._calls += 1
        stats = rows.pop("_stats")
        stats.prompt_lag = lag
        stats.stale_cancelled, self._stale_since_call = self._stale_since_call, 0
        _log_metric(trainer, "prorl/stale_cancelled", stats.stale_cancelled)
        for name, mean in stats.reward_components.items():
            _log_metric(trainer, f"prorl/reward/{name}", mean)
        if self.measure_ratio and trainer is not None:
            stats.ratio_dev = ratio_deviation(trainer, rows)
        stats.wall_s = time.monotonic() - t0
        self.history.append(stats)
        log.info("rollout step %d: %d rows, mean reward %s, versions %s, %d filtered, %d stale job(s) cancelled, "
                 "%.1f s", step, len(prompts), stats.mean_reward, stats.versions, stats.filtered_rows,
                 stats.stale_cancelled, stats.wall_s)
        return rows

    async def _collect_trees(self, groups: list) -> None:
        # on the rollout's loop: the submitter's session lives there
        await self.server_trees.collect(self._submitter().session, self.headers, groups)

    async def check_tokenizers(self, trainer: Any) -> None:
        """Compare each rollout server's tokenizer with the trainer's ``processing_class`` (module docstring,
        "Tokenizer handshake"); a server not checked yet (no backend, unreachable) is checked at the next call.
        Nothing is checked when the trainer has no tokenizer with a vocabulary.

        Raises:
            trainer_plugins.tokenizer_check.TokenizerMismatchError: a server's tokenizer is not the policy's.
            trainer_plugins.jobs.ConfigurationError: a server cannot load its tokenizer.
        """
        tok = getattr(trainer, "processing_class", None)
        if not hasattr(getattr(tok, "tokenizer", tok), "get_vocab"):
            return
        if self._policy_fingerprint is None:
            from prorl_server.types import TokenizerFingerprint

            self._policy_fingerprint = await asyncio.to_thread(TokenizerFingerprint.of, tok)
        session = self._submitter().session
        for url in self.urls:
            if url in self._tokenizer_checked:
                continue
            try:
                await check_tokenizer(session, url, self._policy_fingerprint, timeout_s=30.0)
            except NotYet as e:
                log.info("%s; checked at the next call", e)
                continue
            self._tokenizer_checked.add(url)

    def _record_faults(self, outcomes: Sequence[JobOutcome], n: int) -> None:
        """Show each prompt group of a call (``n`` rows in a row, TRL's ``RepeatSampler``) to :attr:`breaker`.

        Raises:
            trainer_plugins.breaker.PersistentFaultError: see the module docstring.
        """
        for start in range(0, len(outcomes), max(1, n)):
            group = []
            for oc in outcomes[start:start + max(1, n)]:
                r = oc.result
                if oc.filtered:
                    group.append(Sample(r.failure_kind or "unspecified", r.error))
                elif not any(t.prompt_ids for t in r.trajectories):
                    group.append(Sample("no_trajectory", f"job {r.job_id} returned no trajectory"))
                else:
                    group.append(Sample())
            self.breaker.record_group(group)

    def _sampling_params(self, trainer: Any) -> dict[str, Any]:
        sp = dict(self.sampling_params)
        args = getattr(trainer, "args", None)
        if args is not None:
            sp.setdefault("temperature", float(getattr(trainer, "temperature", args.temperature)))
            if getattr(args, "top_p", None) not in (None, 1.0):
                sp.setdefault("top_p", float(args.top_p))
            if getattr(args, "top_k", None) not in (None, 0, -1):
                sp.setdefault("top_k", int(args.top_k))
        max_tokens = self.max_tokens or (getattr(args, "max_completion_length", None) if args is not None else None)
        if max_tokens:
            sp["max_tokens"] = int(max_tokens)
        return sp

    def _start(self, prompts: list, instances: list[dict], sp: dict, n: int, step: int) -> "_Batch":
        self._batches += 1
        batch = _Batch(prompts=prompts, call=self._calls, version=self.weight_version, instances=instances, sp=sp,
                       n=n, step=step)
        batch.task = self.loop.run(_spawn(self._run_batch(prompts, instances, sp, n, step, self._batches, batch)))
        batch.future = asyncio.run_coroutine_threadsafe(_wait(batch.task), self.loop.loop)
        return batch

    async def _run_batch(self, prompts: list, instances: list[dict], sp: dict, n: int,
                         step: int, batch: int = 0, record: Optional["_Batch"] = None) -> list[JobOutcome]:
        jobs = self._submitter()

        async def one(i: int) -> JobOutcome:
            gid = f"trl-{self.run_id}-s{step}-b{batch}-g{i // n}"  # TRL's RepeatSampler: n rows per prompt
            if record is not None:
                record.groups[i] = gid
            request = process_request(instances[i], sp, group_id=gid, timeout_s=self.job_timeout_s, group_size=n,
                                      speed_weight=self.completion_time_weight)
            try:
                return await jobs.run(self.urls, request, max_sample_retries=self.max_sample_retries,
                                      chooser=self.chooser, what=f"prompt {_short(prompts[i])} (row {i})",
                                      job_prefix=gid)
            finally:
                if record is not None:
                    record.finished += 1

        # each task picks its server before its first await, in row order: a group's rows share its server
        tasks = [asyncio.ensure_future(one(i)) for i in range(len(prompts))]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            # one row's error (a refused prompt) ends the batch: cancel the others' jobs on the servers
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    def _rows(self, prompts: list, outcomes: list[JobOutcome], trainer: Any, step: int) -> dict[str, list]:
        stats = RolloutStats(step=step, weight_version=self.weight_version)
        out: dict[str, list] = {k: [] for k in ("prompt_ids", "completion_ids", "logprobs", "env_mask",
                                                "prorl_reward", "prorl_weight_versions", "prorl_token_versions",
                                                "prorl_mixed_version_turns", "prorl_prompt", "prorl_job_id",
                                                "prorl_filtered", "prorl_failure_kind", "prorl_token_rewards")}
        if self.reward_to_go:
            out["prorl_token_returns"] = []
        components: dict[str, list[float]] = {}
        speeds: list[float] = []
        fallback_prompt: dict[str, list[int]] = {}
        pending: list[int] = []
        kinds: Counter = Counter()
        for i, oc in enumerate(outcomes):
            stats.retries += len(oc.attempts)
            kinds.update(a.failure_kind or "unspecified" for a in oc.attempts)
            r = oc.result
            agent = r.extra.get("agent") if isinstance(r.extra, Mapping) else None
            if isinstance(agent, Mapping) and isinstance(agent.get("llm_pause_retries"), (int, float)):
                stats.aborted_turns += int(agent["llm_pause_retries"])
            segments = [t for t in r.trajectories if t.prompt_ids]
            if oc.filtered or not segments:
                if oc.filtered:
                    kinds[r.failure_kind or "unspecified"] += 1
                stats.filtered_rows += 1
                pending.append(i)
                for k in out:
                    out[k].append(None)
                out["prorl_job_id"][i] = r.job_id
                out["prorl_filtered"][i] = True
                out["prorl_failure_kind"][i] = r.failure_kind or "no_trajectory"
                out["prorl_weight_versions"][i] = []
                out["prorl_token_versions"][i] = [None]
                out["prorl_mixed_version_turns"][i] = 0
                out["prorl_prompt"][i] = prompts[i]
                continue
            seg = segments[-1]
            stats.tokens_discarded += sum(sum(s.loss_mask) for s in segments[:-1])
            ids = list(seg.response_ids)
            mask = list(seg.loss_mask) or [1] * len(ids)
            lps = list(seg.response_logprobs)
            if len(mask) != len(ids) or len(lps) != len(ids):
                raise ValueError(f"job {r.job_id}: {len(ids)} response tokens, {len(mask)} mask entries, "
                                 f"{len(lps)} logprobs")
            versions = list(seg.weight_versions)
            if not versions and r.weight_version is not None:
                versions = [r.weight_version]
            token_versions = per_token_versions(seg, mask, versions)
            mixed = int(getattr(seg, "mixed_version_turns", 0) or 0)
            out["prompt_ids"].append(list(seg.prompt_ids))
            out["completion_ids"].append(ids)
            out["logprobs"].append(lps)
            out["env_mask"].append(mask)
            out["prorl_reward"].append(float(r.reward))
            out["prorl_weight_versions"].append(versions)
            out["prorl_token_versions"].append(token_versions)
            out["prorl_mixed_version_turns"].append(mixed)
            out["prorl_prompt"].append(prompts[i])
            out["prorl_job_id"].append(r.job_id)
            out["prorl_filtered"].append(False)
            out["prorl_failure_kind"].append(None)
            # issue #35 part 4 (trainer_plugins/credit.py): the turns' shares on their last tokens, or the
            # whole reward on the last token; the turns of earlier segments are not in this row
            kept = max(j for j, t in enumerate(r.trajectories) if t.prompt_ids)
            out["prorl_token_rewards"].append(
                row_token_credit(len(ids), r.reward, turn_split(r.turns, r.reward, kept)) if ids else [])
            if self.reward_to_go:
                out["prorl_token_returns"].append(
                    row_token_returns(len(ids), r.reward, r.turns, kept, mask, self.gamma))
            for name, c in r.reward_components.items():
                components.setdefault(name, []).append(c.weight * c.value)
            if self.completion_time_weight and r.speed is not None:
                speeds.append(float(r.speed))
            fallback_prompt.setdefault(prompt_key(prompts[i]), out["prompt_ids"][-1])
            stats.tokens_generated += sum(mask)
            stats.mixed_version_turns += mixed
            for v, m in zip(token_versions, mask):
                if m:
                    stats.token_versions[v] = stats.token_versions.get(v, 0) + 1
            for v in list(versions) + [v for v in token_versions if v is not None]:
                if v not in stats.versions:
                    stats.versions.append(v)
        eos = _eos_id(trainer)
        for i in pending:
            # A row TRL cannot learn from: the prompt (a sibling's tokens, else the chat template's), one EOS
            # token outside the loss, and reward None (out of the group baseline, advantage 0).
            out["prompt_ids"][i] = fallback_prompt.get(prompt_key(prompts[i])) or _render_prompt(trainer, prompts[i])
            out["completion_ids"][i] = [eos]
            out["logprobs"][i] = [0.0]
            out["env_mask"][i] = [0]
            out["prorl_token_rewards"][i] = [0.0]
            if self.reward_to_go:
                out["prorl_token_returns"][i] = [0.0]
        stats.rewards = list(out["prorl_reward"])
        stats.reward_components = {name: sum(v) / len(v) for name, v in sorted(components.items())}
        if speeds:  # the group-relative speed itself, unweighted: what the run is asked to raise
            stats.reward_components["speed"] = sum(speeds) / len(speeds)
        stats.failure_kinds = dict(kinds)
        allowed = set(range(self.weight_version - self.prefetch, self.weight_version + 1))
        stale = [v for v in stats.versions if v not in allowed]
        if stale:
            log.warning("rollout step %d: turns generated with weight versions %s while the trainer is at %d",
                        step, stale, self.weight_version)
        out["_stats"] = stats  # type: ignore[assignment]
        return out


@dataclass
class _Batch:
    """One submitted batch: the prompts it was submitted for (and their instances, sampling parameters, group
    size and step, to submit them again), the call and weight version it was submitted at, its task on the
    rollout's loop, a future of its outcomes for the calling thread, and how many of its rows have finished."""

    prompts: list
    call: int = 0
    version: int = 0
    instances: list = field(default_factory=list)
    sp: dict = field(default_factory=dict)
    n: int = 1
    step: int = 0
    task: Any = None
    future: Any = None
    finished: int = 0
    groups: dict = field(default_factory=dict)  # row -> its group id


def _tree_groups(groups: Mapping[int, str], outcomes: Sequence[JobOutcome]) -> list[tuple[str, str, list, list]]:
    """What :meth:`ServerTrees.collect` fetches: per group and server, the unfiltered results there and the
    index of the trajectory each row trains on (the last with a prompt, as :meth:`ProRLRollout._rows`)."""
    out: dict[tuple[str, str], tuple[list, list]] = {}
    for i, oc in enumerate(outcomes):
        r = oc.result
        last = [k for k, t in enumerate(r.trajectories) if t.prompt_ids]
        if oc.filtered or not last or i not in groups:
            continue
        results, trained = out.setdefault((groups[i], oc.server), ([], []))
        results.append(r)
        trained.append(last[-1])
    return [(gid, server, results, trained) for (gid, server), (results, trained) in out.items()]


async def _spawn(coro) -> "asyncio.Task":
    return asyncio.ensure_future(coro)


async def _wait(task: "asyncio.Task") -> Any:
    return await task


async def _cancel(task: "asyncio.Task") -> None:
    """Cancel a batch and wait until its jobs are cancelled on the servers."""
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def _log_metric(trainer: Any, name: str, value: float) -> None:
    """Add ``value`` to the metrics ``GRPOTrainer`` logs at its next step (its ``_metrics["train"]``, trl 1.16:
    averaged over the step's calls into ``trainer.state.log_history``); nothing for a trainer without them."""
    metrics = getattr(trainer, "_metrics", None)
    train = metrics.get("train") if isinstance(metrics, dict) else None
    if isinstance(train, dict):
        train.setdefault(name, []).append(float(value))


def versions_per_call(args: Any) -> int:
    """Weight versions (optimizer steps, one push each) between two calls of TRL's rollout function:
    ``ceil(steps_per_generation * num_iterations / gradient_accumulation_steps)`` (``GRPOTrainer`` generates
    every ``steps_per_generation * num_iterations`` micro-steps, trl 1.16 ``_prepare_inputs``); 1 when the
    config does not say."""
    try:
        spg = int(getattr(args, "steps_per_generation", None) or getattr(args, "gradient_accumulation_steps", 1) or 1)
        gas = int(getattr(args, "gradient_accumulation_steps", None) or 1)
        iters = int(getattr(args, "num_iterations", None) or 1)
    except (TypeError, ValueError):
        return 1
    return max(1, math.ceil(spg * iters / max(1, gas)))


def per_token_versions(seg: Any, mask: Sequence[int], versions: Sequence[int]) -> list[Optional[int]]:
    """The weight version of each response token of a trajectory segment (list of length R, aligned with
    ``response_ids``): from its ``version_runs`` (``[[version or None, n], ...]`` over the generated tokens,
    ``mask`` 1, in order), else the single version of ``versions`` when there is one; None on environment
    tokens (``mask`` 0) and where unknown.

    Raises:
        ValueError: ``version_runs`` covers a different number of tokens than ``mask`` marks generated.
    """
    runs = getattr(seg, "version_runs", None)
    if runs is None and isinstance(seg, Mapping):
        runs = seg.get("version_runs")
    n_gen = sum(1 for m in mask if m)
    if runs:
        flat: list[Optional[int]] = []
        for v, k in runs:
            flat.extend([None if v is None else int(v)] * int(k))
        if len(flat) != n_gen:
            raise ValueError(f"version_runs covers {len(flat)} tokens, the loss mask marks {n_gen} generated")
        it = iter(flat)
        return [next(it) if m else None for m in mask]
    only = versions[0] if len(set(versions)) == 1 else None
    return [only if m else None for m in mask]


class _WeightsPushedElsewhere:
    """Stands in for TRL's ``vllm_generation`` when a ``rollout_func`` run turns on TRL's importance-sampling
    correction: TRL calls ``sync_weights()`` before each rollout, and :class:`WeightPushCallback` has already
    pushed the weights by then."""

    def sync_weights(self) -> None:
        return None


def enable_importance_sampling(trainer: Any) -> bool:
    """Turn on TRL's vLLM importance-sampling correction for a ``GRPOTrainer`` whose rollouts come from the
    rollout servers (module docstring, "Importance sampling"), when its config asks for it
    (``vllm_importance_sampling_correction``, TRL's default True) and TRL's own vLLM is not in use. Idempotent.
    Returns whether the correction is on."""
    args = getattr(trainer, "args", None)
    if not getattr(args, "vllm_importance_sampling_correction", False):
        return False
    if getattr(trainer, "use_vllm", False):
        return bool(getattr(trainer, "vllm_importance_sampling_correction", False))
    if not hasattr(trainer, "vllm_importance_sampling_correction"):
        return False  # not a GRPOTrainer
    trainer.vllm_generation = _WeightsPushedElsewhere()
    trainer._last_loaded_step = getattr(getattr(trainer, "state", None), "global_step", 0)
    trainer.vllm_importance_sampling_correction = True
    trainer.use_vllm = True
    return True


def ratio_deviation(trainer: Any, rows: Mapping[str, list]) -> Optional[float]:
    """Mean ``|exp(trainer logprob - rollout logprob) - 1|`` over the generated tokens (``env_mask`` 1) of
    ``rows``, with the trainer's model as it is now, its logits divided by TRL's temperature (what TRL's loss
    sees). None when no row has a generated token."""
    import torch

    model = trainer.model
    temp = float(getattr(trainer, "temperature", 1.0) or 1.0)
    device = next(model.parameters()).device
    devs: list[float] = []
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for p, c, lps, mask in zip(rows["prompt_ids"], rows["completion_ids"], rows["logprobs"], rows["env_mask"]):
                if not any(mask):
                    continue
                ids = torch.tensor([list(p) + list(c)], device=device)
                logits = model(input_ids=ids).logits[0, len(p) - 1:-1].float() / temp
                lp = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(c, device=device)[:, None])[:, 0]
                for k, m in enumerate(mask):
                    if m:
                        devs.append(abs(math.exp(float(lp[k]) - lps[k]) - 1.0))
    finally:
        model.train(was_training)
    return sum(devs) / len(devs) if devs else None


def _eos_id(trainer: Any) -> int:
    tok = getattr(trainer, "processing_class", None)
    tok = getattr(tok, "tokenizer", tok)
    for tid in (getattr(tok, "eos_token_id", None), getattr(tok, "pad_token_id", None)):
        if isinstance(tid, int):
            return tid
    return 0


def _render_prompt(trainer: Any, prompt: Prompt) -> list[int]:
    tok = getattr(trainer, "processing_class", None)
    tok = getattr(tok, "tokenizer", tok)
    if tok is None:
        return [0]
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if isinstance(ids, Mapping) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(t) for t in ids] or [0]


def _short(x: Any, limit: int = 160) -> str:
    s = repr(x)
    return s if len(s) <= limit else s[:limit] + "..."
