"""Circuit breaker over filtered samples: a fault that fails every sample stops the trainer with its reason.

A filtered sample (``filter: true``, still failing after the client's retries) is never trained on, and the
trainer plugins replace it (verl's replay buffer evicts and refills its group; TRL leaves the row out). That
is right for a fault that passes, and a spin for one that does not: a rollout server that cannot serve (a
dead relay, a handler that refuses every row, a sandbox runtime that never starts) made verl run 2,672 jobs and
0 steps with no log line. :class:`FaultBreaker` watches the groups as they complete and raises
:class:`PersistentFaultError` naming the ``failure_kind``, the count and the last error when, for one kind:

- ``consecutive`` prompt groups in a row were filtered for it, with no clean group in between (default 8), or
- more than ``max_share`` of the last ``window`` samples were filtered for it (default 90% of 64).

A sample the trainer itself cancelled (``failure_kind="cancelled"``: a stale group, a shut-down batch) is the
trainer's decision, not a fault, and counts neither way. Used by ``trainer_plugins.verl.replay_buffer`` and
``trainer_plugins.trl.rollout``.
"""
from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass
from typing import Iterable, Optional

#: ``failure_kind`` values that are the trainer's own decision, not a fault (counted neither way)
NOT_FAULTS = frozenset({"cancelled"})

#: what to check for a kind that stops training (the rest: the rollout servers' logs)
HINTS = {
    "llm_backend": "the LLM backends cannot serve the jobs: check that the trainer's inference servers (verl's "
                   "relay, or the vLLM servers given to prorl-server) answer, and the rollout servers' logs",
    "rollout_server": "the rollout servers do not answer or answer 5xx: check that they run (GET /health) and "
                      "their logs",
    "sandbox": "sandboxes cannot start or die: check the sandbox runtime on the rollout servers "
               "(prorl-server --check) and their logs",
    "harness": "the handler's harness or grader fails: check the rollout servers' logs for the handler",
    "agent_missing": "the agent program is not installed in the sandbox image",
    "timeout": "jobs run out of time before the model acts: raise job_timeout_s / request_timeout_s, or add "
               "rollout servers",
    "internal": "the rollout server itself fails: check its log",
    "handler": "a handler stage raises: a handler bug, see the rollout servers' logs",
    "truncated": "every sample is longer than the rollout lengths: raise rollout.prompt_length / "
                 "response_length, or lower the handler's turns and max_tokens",
}


class PersistentFaultError(RuntimeError):
    """Raised when one ``failure_kind`` filtered too many samples (see the module docstring). Attributes:
    ``kind`` (the failure kind), ``count`` (groups in a row, or samples in the window), ``last_error`` (the
    last filtered sample's error text, at most 2,000 characters)."""

    def __init__(self, message: str, kind: str, count: int, last_error: Optional[str]) -> None:
        super().__init__(message)
        self.kind, self.count, self.last_error = kind, count, last_error


@dataclass(frozen=True)
class Sample:
    """One sample as the breaker sees it: ``kind`` is its ``failure_kind`` when it was filtered, None when it
    can be trained on; ``error`` the filtered sample's error text."""

    kind: Optional[str] = None
    error: Optional[str] = None


class FaultBreaker:
    """Counts filtered prompt groups per ``failure_kind`` and raises :class:`PersistentFaultError` (see the
    module docstring).

    Args:
        consecutive: filtered groups in a row (no clean group between them) that stop training; 0 turns this
            rule off.
        window: the last samples the share is taken over; 0 turns the share rule off.
        max_share: a kind holding more than this share of a full window stops training (0 < share <= 1).
        what: how the stop names the trainer side (e.g. ``"ProRLReplayBuffer"``).

    Raises:
        ValueError: a negative count, or a share outside (0, 1].
    """

    def __init__(self, consecutive: int = 8, window: int = 64, max_share: float = 0.9, what: str = "training") -> None:
        if int(consecutive) < 0 or int(window) < 0:
            raise ValueError(f"consecutive and window must be >= 0 (0: off), got {consecutive}, {window}")
        if not 0.0 < float(max_share) <= 1.0:
            raise ValueError(f"max_share must be in (0, 1], got {max_share}")
        self.consecutive, self.window, self.max_share = int(consecutive), int(window), float(max_share)
        self.what = what
        self._in_a_row: Counter = Counter()  # kind -> filtered groups since the last clean group
        self._recent: deque = deque(maxlen=self.window or 1)  # kinds (None: clean) of the last samples
        self._last_error: dict[str, Optional[str]] = {}
        self.groups = 0
        self.filtered_groups: Counter = Counter()  # kind -> filtered groups seen, ever

    def record_group(self, samples: Iterable[Sample]) -> None:
        """One complete prompt group (its samples, any order).

        Raises:
            PersistentFaultError: a kind reached ``consecutive`` groups in a row, or more than ``max_share`` of
                a full window of samples.
        """
        samples = [s for s in samples if s.kind not in NOT_FAULTS]
        if not samples:
            return
        self.groups += 1
        kinds = Counter(s.kind for s in samples if s.kind is not None)
        for s in samples:
            if s.kind is not None:
                self._last_error[s.kind] = (s.error or "")[:2000] or self._last_error.get(s.kind)
            if self.window:
                self._recent.append(s.kind)
        if not kinds:
            self._in_a_row.clear()  # a group that trains: the faults so far were not persistent
        else:
            kind = kinds.most_common(1)[0][0]  # the group's fault: the kind most of its filtered samples had
            self._in_a_row[kind] += 1
            self.filtered_groups[kind] += 1
            if self.consecutive and self._in_a_row[kind] >= self.consecutive:
                self._trip(kind, self._in_a_row[kind],
                           f"{self._in_a_row[kind]} prompt groups in a row were filtered for failure_kind={kind!r} "
                           f"(no group could be trained on between them)")
        if self.window and len(self._recent) == self.window:
            shares = Counter(k for k in self._recent if k is not None)
            for kind, n in shares.most_common(1):
                if n > self.max_share * self.window:
                    self._trip(kind, n, f"{n} of the last {self.window} samples were filtered for "
                                        f"failure_kind={kind!r} (more than {self.max_share:.0%})")

    def _trip(self, kind: str, count: int, what_happened: str) -> None:
        last = self._last_error.get(kind)
        hint = HINTS.get(kind, "check the rollout servers' logs")
        raise PersistentFaultError(f"{self.what} stops: {what_happened}; {hint}. Last error: {last or '(none given)'}",
                                   kind, count, last)
