"""Core wire and domain types of the rollout service: the one module every other part imports.

The pydantic models here are the single definition of the HTTP wire contract (``/openapi.json`` is generated
from them). The contract is compatible with ProRL Agent Server clients: ``POST /process`` takes
``{instance, sampling_params, job_id?}`` and returns a :class:`JobResult`.
"""
from __future__ import annotations

import enum
import itertools
import json
import re
from collections import OrderedDict
from typing import Annotated, Any, Literal, Optional, Sequence, TypeVar

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema,
                      computed_field, field_validator, model_validator)

CriticalError = Literal["init", "run", "eval", "timeout", "cancelled"]
Stage = Literal["init", "run", "eval"]
STAGES: tuple[Stage, ...] = ("init", "run", "eval")


class JobState(str, enum.Enum):
    """Lifecycle of a job. ``queued_*`` = waiting for a worker of that stage; ``done`` = result available."""

    queued_init = "queued_init"
    init = "init"
    queued_run = "queued_run"
    run = "run"
    queued_eval = "queued_eval"
    eval = "eval"
    done = "done"


# ---------------------------------------------------------------------------------------------- requests


#: Largest ``timeout_s`` a request may set, in seconds (one day). The longest shipped rollouts (SWE) take
#: minutes to an hour; a larger value is a client bug, and ``Infinity``/``1e308`` would overflow the
#: pipeline's deadline arithmetic.
MAX_TIMEOUT_S = 86400.0

#: Largest token id a request may name (``stop_token_ids``, ``allowed_token_ids``, ``logit_bias`` keys, the
#: gateway's ``logit_bias``): 2**31 - 1, above every vocabulary in use. The bound is what keeps sets and dicts
#: of ids cheap: Python hashes an int ``n`` as ``n mod (2**61 - 1)``, so ids that differ by multiples of
#: 2**61 - 1 all collide (a megabyte of them is seconds of quadratic inserts, here or in vLLM), while ids
#: below 2**61 - 1 hash to themselves.
MAX_TOKEN_ID = 2**31 - 1
#: Most entries of a list or map sampling parameter (``stop``, ``stop_token_ids``, ``bad_words``,
#: ``logit_bias``): vLLM checks each of them at every generated token.
MAX_SAMPLING_ENTRIES = 1024
#: Most entries of ``allowed_token_ids`` (a constrained vocabulary): 16384.
MAX_ALLOWED_TOKEN_IDS = 2**14
#: Most items (arrays, objects, strings and commas; ``sandbox.bounded_json``) in a body of the rollout API
#: (``/process``, ``/jobs`` and the management routes): 32768, at most ~4 ms of decoding (integers past
#: int64 cost ~120 ns each to parse, other items ~30-50 ns); its size is bounded by ``max_body_mb``.
MAX_BODY_ITEMS = 2**15

#: A token id: 0 ..= :data:`MAX_TOKEN_ID`.
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]


def _at_most(n: int, ids: bool = False) -> BeforeValidator:
    """A check, before pydantic validates the entries, that a list or map has at most ``n`` of them (and, with
    ``ids``, that each is a token id, stopping at the first that is not): pydantic reports one error per bad
    entry, and building 200k of them takes 0.6 s."""
    def check(v: Any) -> Any:
        if isinstance(v, (list, dict)) and len(v) > n:
            raise ValueError(f"at most {n} entries, not {len(v)}")
        if ids and isinstance(v, list):
            for i, x in enumerate(v):
                if type(x) is float and x.is_integer():  # JSON's 2510.0 is an integer (JSON Schema, pydantic)
                    x = int(x)
                if type(x) is not int or not 0 <= x <= MAX_TOKEN_ID:
                    raise ValueError(f"entry {i} ({str(x)[:24]}) is not a token id (an integer 0..{MAX_TOKEN_ID})")
        return v
    return BeforeValidator(check)


def _token_ids(n: int) -> Any:
    """The type of a list of at most ``n`` token ids."""
    return Annotated[list[TokenId], _at_most(n, ids=True), Field(max_length=n)]


#: A signed 64-bit integer (what vLLM's integer parameters are; larger JSON numbers are refused).
Int64 = Annotated[int, Field(ge=-2**63, le=2**63 - 1)]
def _json_integer(v: Any) -> Any:
    """A JSON integer (``5`` or, as JSON Schema counts it, ``5.0``), never ``true`` or ``"5"``."""
    if isinstance(v, (bool, str, bytes)):
        raise ValueError("must be a JSON integer, not a boolean or a string")
    return v


#: An int64 given as a JSON integer: ``true`` or ``"1"`` are refused (a weight version is an exact label: a
#: coerced one would be a silent mislabel); ``5.0`` is 5, as JSON Schema's ``integer`` allows.
StrictInt64 = Annotated[int, Field(ge=-2**63, le=2**63 - 1), BeforeValidator(_json_integer)]


#: A token id 0..:data:`MAX_TOKEN_ID` (2147483647) written in decimal, up to 10 leading zeros: the pattern the
#: OpenAPI schema states (``propertyNames``) and the check applies, so that the two agree.
TOKEN_ID_KEY_PATTERN = (r"^0{0,10}(?:[0-9]{1,9}|1[0-9]{9}|20[0-9]{8}|21[0-3][0-9]{7}|214[0-6][0-9]{6}"
                        r"|2147[0-3][0-9]{5}|21474[0-7][0-9]{4}|214748[0-2][0-9]{3}|2147483[0-5][0-9]{2}"
                        r"|21474836[0-3][0-9]|214748364[0-7])$")
_TOKEN_ID_KEY = re.compile(TOKEN_ID_KEY_PATTERN, re.ASCII)


def _token_id_key(k: str) -> str:
    if not _TOKEN_ID_KEY.fullmatch(k):
        raise ValueError(f"logit_bias key {k[:24]!r} is not a token id (a decimal integer 0..{MAX_TOKEN_ID})")
    return k


#: A ``logit_bias`` key: a token id written in decimal (JSON object keys are strings).
TokenIdKey = Annotated[str, Field(pattern=TOKEN_ID_KEY_PATTERN), AfterValidator(_token_id_key)]

_T = TypeVar("_T")
#: A list sampling parameter of at most :data:`MAX_SAMPLING_ENTRIES` entries.
_Entries = Annotated[list[_T], _at_most(MAX_SAMPLING_ENTRIES), Field(max_length=MAX_SAMPLING_ENTRIES)]

#: litellm/OpenAI-style sampling names and the vLLM name each one is sent as.
SAMPLING_ALIASES: dict[str, str] = {
    "max_output_tokens": "max_tokens",       # litellm responses API / Gemini
    "max_completion_tokens": "max_tokens",   # OpenAI chat completions (o-series)
    "max_new_tokens": "max_tokens",          # transformers / TGI
    "stop_sequences": "stop",                # Anthropic / Gemini
}
#: Sampling names that are agent-loop limits, not vLLM parameters: copied into the instance under the name
#: the handlers read, unless the instance sets it itself.
AGENT_LIMIT_ALIASES: dict[str, str] = {"max_iterations": "max_turns", "max_turns": "max_turns"}


#: Keys the reference ProRL trainer's litellm client puts in its sampling parameters (which model to call,
#: with which key, through which provider, and whether generation is token-level): they describe the client's
#: own call, not sampling. ``POST /process`` accepts and drops them (the rollout server picks the backend and
#: always generates token-in/token-out); ``api_key`` is never logged or forwarded.
CLIENT_SIDE_KEYS: frozenset[str] = frozenset({"model", "api_key", "api_base", "custom_llm_provider",
                                              "token_level_generation"})


#: Names that mean the same thing: a request may give at most one of each group (present at all, even null).
_SYNONYMS: list[list[str]] = [[name, *sorted(a for a, n in SAMPLING_ALIASES.items() if n == name)]
                              for name in sorted(set(SAMPLING_ALIASES.values()))] + [sorted(AGENT_LIMIT_ALIASES)]
_SYNONYM_PAIRS = [(a, b) for group in _SYNONYMS for i, a in enumerate(group) for b in group[i + 1:]]


class SamplingParams(BaseModel):
    """The sampling parameters ``POST /process`` accepts: vLLM's completion ``SamplingParams`` fields (vLLM
    0.31, ``vllm.SamplingParams``), the litellm-style aliases of :data:`SAMPLING_ALIASES` (mapped to their
    vLLM names) and ``max_iterations``/``max_turns`` (the agent's turn limit, moved into the instance).
    Any other name is refused (422 naming it) rather than silently dropped by vLLM, and so are two names of
    one meaning (``max_tokens`` with ``max_output_tokens``, ``max_iterations`` with ``max_turns``). A null
    value means the parameter is not set.

    ``logprobs``, ``n`` (only 1), ``stream``, ``echo``, ``return_tokens_as_token_ids``, ``return_token_ids``
    and ``add_special_tokens`` are accepted and ignored: the server always sets them itself (token ids and
    logprobs are always returned). The litellm client keys of :data:`CLIENT_SIDE_KEYS` (``model``,
    ``api_key``, ``api_base``, ``custom_llm_provider``, ``token_level_generation``, sent by the reference ProRL
    trainer) are accepted and dropped. ``max_tokens`` is the per-turn budget in tokens.

    Bounds (422 naming the field beyond them): token ids 0..:data:`MAX_TOKEN_ID`, ``logit_bias`` keys the
    same written in decimal and values in [-100, 100], at most :data:`MAX_SAMPLING_ENTRIES` entries in
    ``stop``, ``stop_token_ids``, ``bad_words`` and ``logit_bias`` and :data:`MAX_ALLOWED_TOKEN_IDS` in
    ``allowed_token_ids``; integers are signed 64-bit, floats finite.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, json_schema_extra=lambda s: s.update(
        allOf=[{"not": {"required": list(pair)}} for pair in _SYNONYM_PAIRS]))

    temperature: Optional[float] = Field(default=None, ge=0)
    top_p: Optional[float] = Field(default=None, gt=0, le=1)
    top_k: Optional[Int64] = None
    min_p: Optional[float] = Field(default=None, ge=0, le=1)
    max_tokens: Optional[Int64] = Field(default=None, ge=1)
    min_tokens: Optional[Int64] = Field(default=None, ge=0)
    seed: Optional[Int64] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = Field(default=None, gt=0)
    length_penalty: Optional[float] = None
    stop: Annotated[Optional[list[str] | str], _at_most(MAX_SAMPLING_ENTRIES)] = None
    stop_token_ids: Optional[_token_ids(MAX_SAMPLING_ENTRIES)] = None
    bad_words: Optional[_Entries[str]] = None
    allowed_token_ids: Optional[_token_ids(MAX_ALLOWED_TOKEN_IDS)] = None
    logit_bias: Optional[Annotated[dict[TokenIdKey, Annotated[float, Field(ge=-100, le=100)]],
                                   _at_most(MAX_SAMPLING_ENTRIES),
                                   WithJsonSchema({"type": "object", "maxProperties": MAX_SAMPLING_ENTRIES,
                                                   "propertyNames": {"pattern": TOKEN_ID_KEY_PATTERN},
                                                   "additionalProperties": {"type": "number", "minimum": -100,
                                                                            "maximum": 100}})]] = None
    ignore_eos: Optional[bool] = None
    include_stop_str_in_output: Optional[bool] = None
    skip_special_tokens: Optional[bool] = None
    spaces_between_special_tokens: Optional[bool] = None
    thinking_token_budget: Optional[Int64] = None
    structured_outputs: Optional[dict[str, Any]] = None
    # litellm-style aliases (SAMPLING_ALIASES)
    max_output_tokens: Optional[Int64] = Field(default=None, ge=1)
    max_completion_tokens: Optional[Int64] = Field(default=None, ge=1)
    max_new_tokens: Optional[Int64] = Field(default=None, ge=1)
    stop_sequences: Annotated[Optional[list[str] | str], _at_most(MAX_SAMPLING_ENTRIES)] = None
    # agent-loop limits (AGENT_LIMIT_ALIASES)
    max_iterations: Optional[Int64] = Field(default=None, ge=1)
    max_turns: Optional[Int64] = Field(default=None, ge=1)
    # set by the server; accepted for clients that always send them, ignored
    logprobs: Optional[Int64 | bool] = None
    n: Optional[Literal[1]] = None
    stream: Optional[bool] = None
    echo: Optional[bool] = None
    return_tokens_as_token_ids: Optional[bool] = None
    return_token_ids: Optional[bool] = None
    add_special_tokens: Optional[bool] = None
    # the reference ProRL trainer's litellm client keys (CLIENT_SIDE_KEYS): accepted, dropped, never forwarded
    model: Optional[Annotated[str, Field(max_length=1000)]] = None
    api_key: Optional[Annotated[str, Field(max_length=1000)]] = Field(default=None, repr=False)
    api_base: Optional[Annotated[str, Field(max_length=1000)]] = None
    custom_llm_provider: Optional[Annotated[str, Field(max_length=200)]] = None
    token_level_generation: Optional[bool] = None


#: Validated sampling parameters remembered by their JSON (scalar values only): a trainer sends the same few
#: sets with every job, and validating one costs ~19 us of the ~28 us a ``POST /process`` body takes.
SAMPLING_CACHE_SIZE = 256
_SAMPLING_CACHE_MAX_BYTES = 4096
_SCALARS = (str, int, float, bool, type(None))
_sampling_cache: "OrderedDict[str, dict[str, Any]]" = OrderedDict()


def _sampling_to_vllm(v: Any) -> Any:
    """Validate against :class:`SamplingParams` and rename aliases to vLLM's names; the answer for a set of
    scalar values seen before (the same JSON, key order included) is remembered (:data:`SAMPLING_CACHE_SIZE`
    sets) and returned as a fresh dict.

    Raises:
        ValueError: an unknown name, a bad value, or two names of one meaning.
    """
    if not isinstance(v, dict):
        return v  # the dict type check reports it
    key = None
    if len(v) <= 64 and all(type(k) is str and type(x) in _SCALARS for k, x in v.items()):
        try:  # 1, 1.0 and true are three keys, as they are three JSON values
            key = json.dumps(v, allow_nan=False)
        except ValueError:  # NaN or an infinity: validated (and refused) every time
            key = None
        if key is not None and len(key) <= _SAMPLING_CACHE_MAX_BYTES:
            hit = _sampling_cache.get(key)
            if hit is not None:
                return dict(hit)
        else:
            key = None
    out = _validate_sampling(v)
    if key is not None:
        _sampling_cache[key] = dict(out)
        if len(_sampling_cache) > SAMPLING_CACHE_SIZE:
            _sampling_cache.popitem(last=False)
    return out


def _validate_sampling(v: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(v) - set(SamplingParams.model_fields))
    if unknown:
        raise ValueError(f"unknown sampling parameter(s) {unknown}: accepted are vLLM's SamplingParams names "
                         f"and the aliases {sorted(SAMPLING_ALIASES)} (see the sampling table of docs/http-api.md)")
    for group in _SYNONYMS:
        given = [k for k in group if k in v]
        if len(given) > 1:
            raise ValueError(f"sampling parameters {given} mean the same thing: give one of them")
    out = {k: x for k, x in SamplingParams.model_validate(v).model_dump(exclude_unset=True).items()
           if x is not None and k not in CLIENT_SIDE_KEYS}
    for alias, name in SAMPLING_ALIASES.items():
        if alias in out:
            out[name] = out.pop(alias)
    return out


_INSTANCE_SCHEMA = {
    "type": "object", "required": ["data_source"], "additionalProperties": True,
    "properties": {"data_source": {"type": "string", "minLength": 1,
                                   "description": "the handler name or an alias"},
                   "instance_id": {"type": "string", "description": "with only data_source: a problem of "
                                   "the data source's shipped dataset, by id (e.g. HumanEval/0)"}}}


#: Most named components a result carries (``outcome`` plus a handler's process terms).
MAX_REWARD_COMPONENTS = 32
#: What a reward component's name looks like: a lower-case identifier of at most 64 characters.
REWARD_COMPONENT_PATTERN = r"^[a-z][a-z0-9_]{0,63}$"


#: Job and group ids: no control characters (they end up in logs, journal rows and URLs).
ID_PATTERN = r"^[^\x00-\x1f\x7f]+$"


class ProcessRequest(BaseModel):
    """Body of ``POST /process`` and ``POST /jobs``.

    ``instance`` must carry ``data_source`` (the handler name or an alias). At submit its handler completes
    one that names a shipped problem only by ``instance_id`` (``{"data_source": "code", "instance_id":
    "HumanEval/0"}``) and validates it against its instance model (``AgentHandler.prepare_instance``: a
    malformed instance is a 422 naming ``instance.<field>``). ``sampling_params``: see
    :class:`SamplingParams` (unknown names are refused; aliases are renamed to vLLM's names).
    ``timeout_s`` bounds the counted time (init + run + eval, queue waits excluded), in seconds: a finite
    JSON number in (0, :data:`MAX_TIMEOUT_S`].
    ``group_id`` names the group (the n samples of one prompt): the server runs a group's jobs on one LLM
    backend when load allows, so the prompt's prefix cache is shared (see ``affinity_slack``).
    """

    model_config = ConfigDict(extra="forbid", json_schema_extra={
        # _completion_time_needs_a_group, said in the schema: completion_time true needs group_id and group_size
        "if": {"properties": {"completion_time": {"const": True}}, "required": ["completion_time"]},
        "then": {"required": ["group_id", "group_size"],
                 "properties": {"group_id": {"type": "string"}, "group_size": {"type": "integer"}}}})

    instance: Annotated[dict[str, Any], WithJsonSchema(_INSTANCE_SCHEMA)]
    sampling_params: Annotated[dict[str, Any], BeforeValidator(_sampling_to_vllm),
                               WithJsonSchema(SamplingParams.model_json_schema())] = \
        Field(default_factory=dict)
    job_id: Optional[str] = Field(default=None, min_length=1, max_length=200, pattern=ID_PATTERN)
    timeout_s: Optional[float] = Field(default=None, gt=0, le=MAX_TIMEOUT_S, strict=True, allow_inf_nan=False)
    group_id: Optional[str] = Field(default=None, min_length=1, max_length=200, pattern=ID_PATTERN)
    reward_weights: Optional[Annotated[dict[Annotated[str, Field(pattern=REWARD_COMPONENT_PATTERN)],
                                            Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False, strict=True)]],
                                       _at_most(MAX_REWARD_COMPONENTS),
                                       WithJsonSchema({  # pydantic's schema lets any other key through
                                           "type": "object", "maxProperties": MAX_REWARD_COMPONENTS,
                                           "propertyNames": {"pattern": REWARD_COMPONENT_PATTERN},
                                           "additionalProperties": {"type": "number", "minimum": -100,
                                                                    "maximum": 100}})]] = Field(
        default=None, description="weights of the handler's process reward terms (name -> weight); a term not "
        "named here has weight 0, so the reward is the outcome alone unless a request opts in")
    completion_time: Optional[bool] = Field(default=None, strict=True, description=(
        "relative completion time (#35 part 3): the result is answered when its group ends, with `speed` set "
        "from the members' model times (generation + critical-path tool time, never waiting); needs group_id and "
        "group_size"))
    group_size: Optional[Annotated[int, Field(ge=1, le=4096), BeforeValidator(_json_integer)]] = Field(
        default=None, description=(
        "the number of jobs of group_id that opt in to completion_time (the group's n samples)"))

    @field_validator("instance")
    @classmethod
    def _has_data_source(cls, v: dict[str, Any]) -> dict[str, Any]:
        ds = v.get("data_source")
        if not isinstance(ds, str) or not ds:
            raise ValueError("instance.data_source must be a non-empty string naming a handler")
        return v

    @model_validator(mode="after")
    def _completion_time_needs_a_group(self) -> "ProcessRequest":
        if self.completion_time and (self.group_id is None or self.group_size is None):
            raise ValueError("completion_time needs group_id and group_size (the group's number of samples)")
        return self

    @model_validator(mode="after")
    def _agent_limits_into_instance(self) -> "ProcessRequest":
        for alias, name in AGENT_LIMIT_ALIASES.items():
            if alias in self.sampling_params:
                value = self.sampling_params.pop(alias)
                self.instance.setdefault(name, value)
        return self


class CancelRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    job_id: str = Field(min_length=1, max_length=200)


#: What ``/add_llm_server`` accepts as an address (in the schema and in validation alike).
ADDRESS_PATTERN = r"^https?://[A-Za-z0-9._~-]+(:[0-9]{1,5})?(/[A-Za-z0-9._~/-]*)?$"


class AddBackendRequest(BaseModel):
    """Body of ``POST /add_llm_server``: an OpenAI-compatible server's base URL (http or https)."""

    model_config = ConfigDict(extra="forbid")
    address: str = Field(pattern=ADDRESS_PATTERN, description="http(s)://host[:port][/path]; a trailing /v1 "
                         "(the OpenAI base URL) is removed")
    weight_version: Optional[StrictInt64] = None

    @field_validator("address")
    @classmethod
    def _http_url(cls, v: str) -> str:
        from urllib.parse import urlsplit

        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("address must be an http(s) URL such as http://127.0.0.1:8000")
        return normalise_backend_address(v)


def normalise_backend_address(address: str) -> str:
    """The server root of an OpenAI-compatible backend URL: trailing ``/`` and one trailing ``/v1`` removed
    (``http://h:8000/v1/`` -> ``http://h:8000``), since the client appends ``/v1/...`` itself and clients
    such as the reference ProRL trainer register the OpenAI base URL."""
    v = address.rstrip("/")
    if v.endswith("/v1"):
        v = v[: -len("/v1")].rstrip("/")
    return v


# ---------------------------------------------------------------------------------------------- results


SegmentKind = Literal["prompt", "sampled", "observation"]


class Segment(BaseModel):
    """One ``[start, end)`` span of a trajectory's token stream ``prompt_ids + response_ids`` (token positions)
    and what made it (issue #34): ``prompt`` (``prompt_ids``), ``sampled`` (a run of ``loss_mask`` 1: one
    generated turn) or ``observation`` (a run of ``loss_mask`` 0 after the prompt: tool results, user turns,
    template text).

    ``hash``: 32 hex digits, the cumulative BLAKE2b-128 of the stream up to ``end``: the previous segment's
    digest, the kind, the token ids (int64 little-endian) and, for sampled tokens, their weight-version runs
    and routed-expert records (:func:`segment_hash`). Two trajectories with equal hashes at a boundary have
    the same tokens with the same provenance up to it, so a trainer builds the prefix tree of a set of rows
    from equal hashes plus a longest common prefix inside the first segment that differs."""

    start: int = Field(ge=0)
    end: int = Field(ge=0)
    kind: SegmentKind
    hash: str


def _int64_bytes(ids: list[int]) -> Optional[bytes]:
    """``ids`` as int64 little-endian, or None when one is outside int64 (no tokenizer has such an id)."""
    import array
    import sys

    try:
        a = array.array("q", ids)
    except OverflowError:
        return None
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def _token_bytes(ids: list[int]) -> bytes:
    """``ids`` as int64 little-endian (an id outside int64 makes it their decimal text)."""
    b = _int64_bytes(ids)
    return b if b is not None else ",".join(map(str, ids)).encode()


def segment_hash(previous: str, kind: str, ids: list[int], provenance: Any = None) -> str:
    """The cumulative hash of one segment (:class:`Segment`): BLAKE2b with a 16-byte digest over
    ``previous`` (hex, ``""`` for the first), ``kind``, the number of tokens, the token ids (int64
    little-endian) and ``provenance`` written as compact JSON (for sampled tokens ``{"v": version runs, "r":
    routed experts}``; null otherwise)."""
    return _segment_hash(previous, kind, len(ids), _token_bytes(ids),
                         json.dumps(provenance, separators=(",", ":"), default=repr).encode())


def _segment_hash(previous: str, kind: str, n: int, token_bytes: Any, provenance_json: bytes) -> str:
    import hashlib

    h = hashlib.blake2b(digest_size=16)
    h.update(bytes.fromhex(previous))
    h.update(kind.encode() + b"\0")
    h.update(n.to_bytes(8, "little"))
    h.update(token_bytes)
    h.update(provenance_json)
    return h.hexdigest()


def sampled_runs_versions(version_runs: list, n_sampled: int) -> list[Optional[int]]:
    """The weight version of each of ``n_sampled`` generated tokens from ``version_runs``; when the runs do
    not count ``n_sampled`` tokens (a result without version runs) every version is None (unknown)."""
    if sum(n for _, n in version_runs) != n_sampled:
        return [None] * n_sampled
    out: list[Optional[int]] = []
    for v, n in version_runs:
        out += [v] * n
    return out


def mask_runs(mask: list[int], n: int) -> list[tuple[int, int, bool]]:
    """The maximal runs ``(start, end, generated)`` of ``mask`` over its first ``n`` positions (a missing
    entry reads as 0; an entry counts as generated when it is 1), found on the mask as bytes with
    ``bytes.find`` (memchr), not a token at a time."""
    m = mask if len(mask) == n else list(mask[:n]) + [0] * (n - min(n, len(mask)))
    try:
        b = bytes(m)  # one C pass; a value outside 0..255 (or not an int) raises
    except (ValueError, TypeError):
        b = b""
    if len(b) != n or b.count(0) + b.count(1) != n:  # another value (2, True is 1): count it as not generated
        b = bytes(1 if x == 1 else 0 for x in m)
    out: list[tuple[int, int, bool]] = []
    i = 0
    while i < n:
        bit = b[i]
        j = b.find(1 - bit, i)
        j = n if j < 0 else j
        out.append((i, j, bit == 1))
        i = j
    return out


class RunCursor:
    """Reads a run-length encoding ``[[value, count], ...]`` front to back: :meth:`take` gives the encoding of
    the next ``n`` positions, merged (positions past its end are left out). Callers that read consecutive spans
    (a trajectory's sampled segments, a node's sampled runs) walk the runs once in all; slicing from the start
    for each span was quadratic in segments x version runs (a red team's one-token turns, a version each: 5.7 s
    for a 10k-token row)."""

    __slots__ = ("runs", "i", "used")

    def __init__(self, runs: Sequence[Sequence[Any]]) -> None:
        self.runs, self.i, self.used = runs, 0, 0

    def take(self, n: int) -> list[list]:
        out: list[list] = []
        runs = self.runs
        while n > 0 and self.i < len(runs):
            v, c = runs[self.i]
            k = min(c - self.used, n)
            if k > 0:
                if out and out[-1][0] == v:
                    out[-1][1] += k
                else:
                    out.append([v, k])
                n -= k
                self.used += k
            if self.used >= c:
                self.i, self.used = self.i + 1, 0
        return out


#: Bounds on a routed-expert record (MoE routing replay, R3), checked where a backend's answer is read
#: (``prorl_server/llm/client.py``) and again on :class:`Trajectory`: MoE layers per token, experts per token and
#: layer (top-k), and ints per trajectory (positions x layers x top-k; 2**24 is ~44k tokens of a 48-layer top-8
#: model, ~128 MB of list pointers). Expert indices are below 2**15: verl stores routes as int16.
MAX_ROUTE_LAYERS = 512
MAX_ROUTE_TOP_K = 64
MAX_ROUTE_INTS = 1 << 24
MAX_EXPERT_INDEX = (1 << 15) - 1

#: A routed-expert record on the wire: checked by :func:`route_shape_error` (a flat pass at C speed, ~0.1 s per
#: million ints), not element by element by pydantic (~0.3 s per million); the schema says the shape.
RouteRecord = Annotated[list[Any], WithJsonSchema({
    "type": "array", "maxItems": MAX_ROUTE_INTS,
    "items": {"type": "array", "minItems": 1, "maxItems": MAX_ROUTE_LAYERS,
              "items": {"type": "array", "minItems": 1, "maxItems": MAX_ROUTE_TOP_K,
                        "items": {"type": "integer", "minimum": 0, "maximum": MAX_EXPERT_INDEX}}}})]


def route_shape_error(routes: list, max_positions: int) -> Optional[str]:
    """Why ``routes`` is not a bounded routed-expert record, or None: a list of at most ``max_positions``
    entries, each ``[layers][top_k]`` ints with the same ``layers`` (1..:data:`MAX_ROUTE_LAYERS`) and ``top_k``
    (1..:data:`MAX_ROUTE_TOP_K`) for every entry, ints in ``0..MAX_EXPERT_INDEX``, at most :data:`MAX_ROUTE_INTS`
    ints in all. Checks the sizes before it reads an int, so an oversized record costs O(1) to refuse; the ints
    are checked in one flat pass (``type`` is exactly int: no bool, float or str)."""
    if not isinstance(routes, list):
        return "routed_experts is not a list"
    if len(routes) > max_positions:
        return f"routed_experts has {len(routes)} positions for {max_positions} tokens"
    if not routes:
        return None
    first = routes[0]
    if not isinstance(first, list) or not 1 <= len(first) <= MAX_ROUTE_LAYERS \
            or not isinstance(first[0], list) or not 1 <= len(first[0]) <= MAX_ROUTE_TOP_K:
        return (f"routed_experts entries must be [layers][top_k] with 1..{MAX_ROUTE_LAYERS} layers and "
                f"1..{MAX_ROUTE_TOP_K} experts per layer")
    L, K = len(first), len(first[0])
    if len(routes) * L * K > MAX_ROUTE_INTS:
        return (f"routed_experts holds {len(routes)} x {L} x {K} ints, over the bound of {MAX_ROUTE_INTS} "
                "(prorl_server.types.MAX_ROUTE_INTS)")
    chain = itertools.chain.from_iterable
    layers = list(chain(routes)) if set(map(type, routes)) == {list} and set(map(len, routes)) == {L} else None
    if layers is None or set(map(type, layers)) != {list} or set(map(len, layers)) != {K}:
        for p, entry in enumerate(routes):  # find the position for the message
            if not isinstance(entry, list) or len(entry) != L:
                return f"routed_experts position {p}: not {L} layers"
            for layer in entry:
                if not isinstance(layer, list) or len(layer) != K:
                    return f"routed_experts position {p}: a layer without {K} experts"
    flat = list(chain(layers))
    if set(map(type, flat)) != {int} or min(flat) < 0 or max(flat) > MAX_EXPERT_INDEX:
        bad = next(e for e in flat if type(e) is not int or not 0 <= e <= MAX_EXPERT_INDEX)
        p = flat.index(bad) // (L * K) if type(bad) is int else "?"
        return f"routed_experts position {p}: expert index {str(bad)[:40]!r} is not an int in 0..{MAX_EXPERT_INDEX}"
    return None


class Trajectory(BaseModel):
    """One token-level segment of a rollout.

    ``prompt_ids``: list[int] of length P (the context before the first generated token).
    ``response_ids``: list[int] of length R (everything after the prompt: generated tokens and the
    observation tokens appended between turns). ``response_logprobs`` and ``loss_mask`` have length R;
    ``loss_mask[i]`` is 1 for tokens the model generated and 0 for everything else, and
    ``response_logprobs[i]`` is 0.0 where the mask is 0.
    ``weight_versions``: the distinct weight versions that generated it, in order of first use.
    ``version_runs``: the weight version of every generated token (the ``loss_mask`` 1 positions, in order),
    run-length encoded as ``[[version, n_tokens], ...]`` (counts sum to ``sum(loss_mask)``; version None:
    unknown, e.g. a turn split by a weight swap at a point the backend could not report).
    ``mixed_version_turns``: turns generated across a weight update (an old-version prefix and a new-version
    suffix; see ``POST /weights/pause``).
    ``routed_experts``: MoE routing replay (R3, verl's ``AgentLoopOutput.routed_experts``): for row position
    ``t`` of ``prompt_ids + response_ids``, the experts that processed token ``t`` as the backend's input, as
    ``[layers][top_k]`` expert indices (list[list[list[int]]] of length at most T = P + R; usually T - 1, since
    the row's last generated token was never fed through the model); positions past its end have no route.
    Recorded per trajectory from the backend's answers (its prompt's prefill plus decoding), so a row that
    starts again after a rewritten context holds the routes of its own tokens. None: the backend reported none
    (a dense model, routing replay off). Bounded by :func:`route_shape_error`.
    """

    prompt_ids: list[int] = Field(default_factory=list)
    response_ids: list[int] = Field(default_factory=list)
    response_logprobs: list[float] = Field(default_factory=list)
    loss_mask: list[int] = Field(default_factory=list)
    num_turns: int = 0
    weight_versions: list[int] = Field(default_factory=list)
    version_runs: list[tuple[Optional[int], int]] = Field(default_factory=list)
    mixed_version_turns: int = 0
    finish_reason: Optional[str] = None
    split_reason: Optional[str] = None
    routed_experts: Optional[RouteRecord] = Field(default=None, max_length=MAX_ROUTE_INTS)

    @model_validator(mode="after")
    def _bounded_routes(self) -> "Trajectory":
        if self.routed_experts is not None:
            why = route_shape_error(self.routed_experts, len(self.prompt_ids) + len(self.response_ids))
            if why is not None:
                raise ValueError(why)
        return self

    def sampled_routes(self) -> Optional[list[Any]]:
        """The route of each generated token (the ``loss_mask`` 1 positions in order; length
        ``sum(loss_mask)``, None where the record ends before it), or None when no route was recorded."""
        routes = self.routed_experts
        if routes is None:
            return None
        P, n = len(self.prompt_ids), len(routes)
        return [routes[P + i] if P + i < n else None
                for i, (_, m) in enumerate(zip(self.response_ids, self.loss_mask)) if m == 1]

    @computed_field  # type: ignore[prop-decorator]
    @property
    def segments(self) -> list[Segment]:
        """``[start, end)`` spans of ``prompt_ids + response_ids`` with their kind and cumulative hash
        (:class:`Segment`): the prompt, then one span per run of ``loss_mask``. Derived from the token fields
        each time (a client's copy is recomputed from the tokens it received, never taken on trust)."""
        P = len(self.prompt_ids)
        out: list[Segment] = []
        h = ""
        null = b"null"
        if P:
            h = _segment_hash(h, "prompt", P, _token_bytes(self.prompt_ids), null)
            out.append(Segment(start=0, end=P, kind="prompt", hash=h))
        runs = mask_runs(self.loss_mask, len(self.response_ids))
        n_sampled = sum(j - i for i, j, generated in runs if generated)
        versions = (self.version_runs if sum(n for _, n in self.version_runs) == n_sampled
                    else [[None, n_sampled]])  # unknown: sampled_runs_versions
        routes = self.sampled_routes()  # per generated token (#32 part 7), when recorded
        whole = _int64_bytes(self.response_ids)  # sliced per segment: one conversion, not one per segment
        response = memoryview(whole) if whole is not None else None
        k = 0  # generated tokens before this span
        cursor = RunCursor(versions)
        for i, j, sampled in runs:
            provenance = null
            if sampled:
                provenance = json.dumps({"v": cursor.take(j - i),
                                         "r": routes[k:k + j - i] if isinstance(routes, list) else None},
                                        separators=(",", ":"), default=repr).encode()
                k += j - i
            kind = "sampled" if sampled else "observation"
            ids = response[i * 8:j * 8] if response is not None else _token_bytes(self.response_ids[i:j])
            h = _segment_hash(h, kind, j - i, ids, provenance)
            out.append(Segment(start=P + i, end=P + j, kind=kind, hash=h))
        return out

    def token_versions(self) -> list[Optional[int]]:
        """The weight version of each generated token (length ``sum(loss_mask)``), from ``version_runs``."""
        return [v for v, n in self.version_runs for _ in range(n)]

    def spans(self, generated: bool = True) -> list[tuple[int, list[int]]]:
        """The runs of ``response_ids`` the model generated (``loss_mask`` 1; with ``generated=False``: the
        runs it did not, i.e. observations and template text), as ``(offset in response_ids, token ids)``
        in order: one generated span per turn."""
        out: list[tuple[int, list[int]]] = []
        want = 1 if generated else 0
        for i, (t, m) in enumerate(zip(self.response_ids, self.loss_mask)):
            if m == want:
                if out and out[-1][0] + len(out[-1][1]) == i:
                    out[-1][1].append(t)
                else:
                    out.append((i, [t]))
        return out


class Timing(BaseModel):
    """Per-phase wall time of a job, in seconds. ``counted_s`` = init + run + eval (what the timeout
    charges); ``queue_s`` = time spent waiting for a worker (reported, not charged)."""

    init_s: float = 0.0
    run_s: float = 0.0
    eval_s: float = 0.0
    queue_s: float = 0.0
    counted_s: float = 0.0
    timeout_triggered: bool = False


class TokenStats(BaseModel):
    """The drift report of one rollout: how true its token stream stayed to the model's chat template
    (:meth:`prorl_server.llm.conversation.Conversation.token_stats`, summed over a job's or a session's
    conversations with ``+``).

    ``family``: the chat-template family (``prorl_server.llm.chat_templates.FAMILIES``; ``"mixed"`` when summed
    stats disagree; null before any conversation). ``turns``: generated turns. ``splits``: trajectories
    closed because the template rewrote history (``template_drops_generated_text``,
    ``template_not_append_only``) or, in a gateway session, the agent's request did not extend the served
    history (``message_changed``, ``history_truncated``, ``tools_changed``, ``unanswered_messages``), by
    reason code (the ``split_reason`` text before ``":"``). ``continued``: turns the template would render
    differently (reformatting only) that were kept as generated. ``rerendered_chars``: generated characters in
    those turns. A healthy template shows ``splits == {}``.
    """

    family: Optional[str] = None
    turns: int = Field(default=0, ge=0)
    splits: dict[str, int] = Field(default_factory=dict)
    continued: int = Field(default=0, ge=0)
    rerendered_chars: int = Field(default=0, ge=0)

    def __add__(self, other: "TokenStats") -> "TokenStats":
        if not isinstance(other, TokenStats):
            return NotImplemented
        families = {f for f in (self.family, other.family) if f is not None}
        splits = dict(self.splits)
        for code, n in other.splits.items():
            splits[code] = splits.get(code, 0) + n
        return TokenStats(family=families.pop() if len(families) == 1 else ("mixed" if families else None),
                          turns=self.turns + other.turns, splits=splits, continued=self.continued + other.continued,
                          rerendered_chars=self.rerendered_chars + other.rerendered_chars)


class RewardComponent(BaseModel):
    """One named term of a job's reward (issue #35 part 2; NeMo Gym's ``reward_components``, verifiers' weighted
    rubric): ``reward`` is the sum of ``weight * value`` over a result's components (``math.fsum``, checked by the
    server to 1e-12 before it answers, :mod:`prorl_server.rewards`).

    ``value``: the term's value for the whole job (finite). ``weight``: its weight (finite; a process term is
    weighted 0 unless the request opts in through ``reward_weights``). ``per_turn``: the value split over the
    result's ``turns`` (length ``len(turns)``, summing to ``value``), or null: the whole value belongs to the
    last turn."""

    model_config = ConfigDict(allow_inf_nan=False)

    value: float
    weight: float = 1.0
    per_turn: Optional[list[float]] = None


class TurnRecord(BaseModel):
    """What one model turn cost (issue #35 part 1; SkyRL's per-trajectory LLM/environment time, Forge's
    completion time split into the model's seconds and the system's).

    ``trajectory_index``: index into the result's ``trajectories``. ``response_start`` / ``response_end``: the
    turn's sampled tokens as the half-open span ``[start, end)`` of that trajectory's ``response_ids`` (token
    positions); over a result, the spans tile the tokens with ``loss_mask`` 1 exactly (one span per turn, no
    gap, no overlap; an empty span for a turn that sampled nothing). ``weight_version``: the policy version
    that generated the turn (null: the backend had none). ``finish_reason``: vLLM's (``stop``, ``length``,
    ``abort``...). ``tool_calls``: tool calls the turn made; ``tool_call_errors``: those whose call text did
    not parse (the model's fault, a process term of part 2).

    Times are seconds of the host's monotonic clock (``time.monotonic``), never a value the sandbox wrote:
    ``t_llm_s`` generation (request sent to last token received, retries on the same backend included);
    ``t_tool_s`` the turn's tool calls summed; ``t_tool_critical_s`` their critical path, the wall time they took
    (a batch run in parallel counts once, as long as its longest call; equals ``t_tool_s`` when calls run one by
    one: :attr:`prorl_server.llm.agent_loop.AgentConfig.parallel_tool_calls`);
    ``t_wait_s`` the system's time charged to this turn: waiting for a backend (queue, a weight-swap or pause
    hold, failover to another backend, back-off), rendering observations, and on the first turn the run stage's
    time outside any turn (set-up such as a sandbox started in ``run``, wrap-up after the last turn:
    :func:`prorl_server.turn_records.charge_run_time`). The turns' ``t_llm_s + t_tool_critical_s + t_wait_s`` add
    up to ``timing.run_s``; the job-level :class:`Timing` covers the rest (``queue_s``, ``init_s``: sandbox start in
    init, ``eval_s``), so ``queue_s + init_s + run_s + eval_s`` is the job's wall time. In a gateway session the
    agent program's time between an answer and its next request is the turn's ``t_tool_s``.
    ``reward``: the turn's share of the result's ``reward`` (the last turn carries the whole reward unless the
    handler splits it per turn); ``sum(t.reward for t in turns) == reward`` for every finished result.
    """

    model_config = ConfigDict(allow_inf_nan=False)

    trajectory_index: int = Field(default=0, ge=0)
    response_start: int = Field(default=0, ge=0)
    response_end: int = Field(default=0, ge=0)
    weight_version: Optional[int] = None
    finish_reason: Optional[str] = None
    tool_calls: int = Field(default=0, ge=0)
    tool_call_errors: int = Field(default=0, ge=0)
    t_llm_s: float = Field(default=0.0, ge=0)
    t_tool_s: float = Field(default=0.0, ge=0)
    t_tool_critical_s: float = Field(default=0.0, ge=0)
    t_wait_s: float = Field(default=0.0, ge=0)
    reward: float = 0.0


class JobResult(BaseModel):
    """What a job returns, successful or not. ``reward`` is always a float (0.0 on failure).

    ``failure_kind``: why the job failed (one of :data:`prorl_server.failures.FAILURE_KINDS`). Outside the
    model's reach (``sandbox``, ``llm_backend``, ``harness``, ``agent_missing``, ``timeout``, ``cancelled``,
    ``invalid_instance``, ``handler``, ``internal``): ``filter`` is true, the sample must not be trained on and
    a trainer regenerates it. Caused by the model after it acted (``model_crashed_sandbox``,
    ``model_stalled_sandbox``, ``model_timeout``, ``model_crashed_grader``, ``model_error``): a scored result,
    reward 0.0, ``filter`` false, trajectories kept. Null for a normal outcome (a wrong answer, a bad tool
    call, its own command timing out). ``filter`` is also true when the handler asked for it.
    ``token_stats``: the drift report of the job's conversations (:class:`TokenStats`, summed when it had
    several); null for a job that generated nothing through a conversation.
    """

    job_id: str
    instance_id: Optional[str] = None
    trajectory_id: str
    handler: str
    reward: float = 0.0
    resolved: bool = False
    critical_error: Optional[CriticalError] = None
    error: Optional[str] = None
    traceback: Optional[str] = None
    filter: bool = False
    failure_kind: Optional[str] = None
    messages: list[dict[str, Any]] = Field(default_factory=list)
    trajectories: list[Trajectory] = Field(default_factory=list)
    timing: Timing = Field(default_factory=Timing)
    backend: Optional[str] = None
    weight_version: Optional[int] = None
    token_stats: Optional[TokenStats] = None
    #: name -> :class:`RewardComponent`: ``outcome`` (the task's score) and the handler's process terms;
    #: ``reward`` is their weighted sum (a handler that sets none gets ``{"outcome": {value: reward, weight: 1}}``)
    reward_components: dict[str, RewardComponent] = Field(default_factory=dict)
    #: one :class:`TurnRecord` per model turn, in the order generated (empty for a job that generated nothing)
    turns: list[TurnRecord] = Field(default_factory=list)
    #: relative completion time within its group, in [-1, 1] (:mod:`prorl_server.completion_time`); null unless the
    #: request set ``completion_time``
    speed: Optional[float] = None
    extra: dict[str, Any] = Field(default_factory=dict)


class SubmitResponse(BaseModel):
    job_id: str


class JobStatusResponse(BaseModel):
    job_id: str
    state: JobState
    result: Optional[JobResult] = None


class CancelResponse(BaseModel):
    job_id: str
    cancelled: bool = Field(description="True if this call stopped the job; False if it had already ended.")
    state: JobState


class BackendInfo(BaseModel):
    address: str
    in_flight: int
    healthy: bool
    weight_version: Optional[int] = None


class StageStatus(BaseModel):
    queued: int
    active: int
    workers: int


class StatusResponse(BaseModel):
    accepting: bool
    stages: dict[str, StageStatus]
    jobs_in_flight: int
    backends: list[BackendInfo]
    handlers: list[str]


class OkResponse(BaseModel):
    ok: bool = True
    detail: Optional[str] = None


class ErrorDetail(BaseModel):
    type: str
    message: str
    field: Optional[str] = None


class ErrorResponse(BaseModel):
    """Every 4xx/5xx answer of the server has this body."""

    error: ErrorDetail


# ---------------------------------------------------------------------------------------------- tokenizer handshake


class TokenizerFingerprint(BaseModel):
    """What must be equal between a trainer's policy tokenizer and a rollout server's for the server's token ids
    to be the policy's: the vocabulary (every token string and id, added tokens included), the BOS/EOS/UNK ids,
    and the chat template (the prompts the policy is trained on are rendered with it). Built by
    :meth:`of` on both sides (``GET /tokenizer`` on the server, the trainer plugins on theirs).

    The pad token is left out on purpose: trainers set it themselves (verl's ``hf_tokenizer`` and TRL's
    ``GRPOTrainer`` make it the EOS when the model has none), and it never reaches a rollout.
    """

    vocab_size: int = Field(description="tokens in the vocabulary, added tokens included")
    vocab_sha256: str = Field(description="sha256 of the JSON list of [id, token] pairs sorted by id")
    special_tokens: dict[str, Optional[int]] = Field(description="ids of bos, eos, unk (null: none)")
    chat_template_sha256: Optional[str] = Field(
        description="sha256 of the chat template (a named set: of its JSON, keys sorted); null: none")

    @classmethod
    def of(cls, tokenizer: Any) -> "TokenizerFingerprint":
        """The fingerprint of a transformers tokenizer (or a processor: its ``tokenizer``, with the processor's
        own chat template when it has one). Costs one pass over the vocabulary (~0.1 s for 150k tokens): compute
        it once per tokenizer."""
        import hashlib

        outer = tokenizer
        tok = getattr(tokenizer, "tokenizer", None) or tokenizer
        vocab = sorted(((int(i), str(t)) for t, i in tok.get_vocab().items()), key=lambda p: p[0])
        template = getattr(outer, "chat_template", None) or getattr(tok, "chat_template", None)
        if isinstance(template, dict):
            template = json.dumps(template, sort_keys=True)

        def ident(name: str) -> Optional[int]:
            v = getattr(tok, f"{name}_token_id", None)
            return v if isinstance(v, int) and not isinstance(v, bool) else None

        return cls(vocab_size=len(vocab),
                   vocab_sha256=hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest(),
                   special_tokens={name: ident(name) for name in ("bos", "eos", "unk")},
                   chat_template_sha256=hashlib.sha256(template.encode()).hexdigest() if template else None)

    def differences(self, other: "TokenizerFingerprint") -> list[str]:
        """The parts that differ (``"vocabulary"``, ``"special tokens"``, ``"chat template"``); empty when the
        two tokenizers give the same token ids and render the same prompts."""
        out = []
        if (self.vocab_size, self.vocab_sha256) != (other.vocab_size, other.vocab_sha256):
            out.append("vocabulary")
        if self.special_tokens != other.special_tokens:
            out.append("special tokens")
        if self.chat_template_sha256 != other.chat_template_sha256:
            out.append("chat template")
        return out

    def __str__(self) -> str:
        specials = ", ".join(f"{k}={v}" for k, v in self.special_tokens.items())
        template = self.chat_template_sha256[:12] if self.chat_template_sha256 else "none"
        return (f"vocab {self.vocab_size} tokens sha256:{self.vocab_sha256[:12]}, {specials}, chat template "
                f"sha256:{template}")


class TokenizerResponse(BaseModel):
    """``GET /tokenizer``: the tokenizer the server renders and tokenizes with for jobs on ``backend``."""

    name: str = Field(description="what the tokenizer was loaded from (the --tokenizer setting, or the model the "
                                  "backend serves)")
    backend: Optional[str] = Field(default=None, description="the backend it serves (null: --tokenizer is set)")
    fingerprint: TokenizerFingerprint


# ---------------------------------------------------------------------------------------------- trajectory trees


class TreeNode(BaseModel):
    """One node of a group's prefix tree (issue #34): a run of tokens every row below it shares, with compatible
    provenance at every position (rows that sampled a token agree on its weight version and routed experts; a
    row may hold as context a token another sampled when neither recorded routes).

    ``id``: its index in :attr:`GroupTree.nodes` (a parent comes before its children). ``parent``: the parent's
    id (null: a root). ``depth``: the row position of its first token (the lengths of its ancestors summed).
    ``token_ids``: list[int] of length L. ``sampled``: ``[[start, end), ...]`` offsets in the node of the tokens
    some row below it generated (format 2: the union of its rows' ``loss_mask`` 1 tokens; which of them a row
    trains on is its leaf's ``sampled``). ``logprobs``: list[float] of length L, the behaviour logprob of each
    sampled token (0.0 elsewhere; rows that sampled it share one). ``version_runs``: the weight version of each
    sampled token, run-length encoded as ``[[version, n], ...]``. ``routed_experts``: the routed-expert record of
    each sampled token (null: none recorded)."""

    id: int
    parent: Optional[int] = None
    depth: int = Field(ge=0)
    token_ids: list[int]
    sampled: list[tuple[int, int]] = Field(default_factory=list)
    logprobs: list[float] = Field(default_factory=list)
    version_runs: list[tuple[Optional[int], int]] = Field(default_factory=list)
    routed_experts: Optional[list[Any]] = None


class TreeLeaf(BaseModel):
    """One row of a group's tree: trajectory ``trajectory_index`` of job ``job_id``. Concatenating the
    ``token_ids`` of the nodes of ``path`` (root first) gives the row's ``prompt_ids + response_ids``, of which
    the first ``prompt_len`` are its prompt. ``sampled``: the row's own generated tokens, ``[[start, end), ...]``
    row positions (sorted, disjoint): its ``loss_mask`` 1 runs, each inside its nodes' ``sampled`` runs, whose
    behaviour logprobs, version runs and routes it takes (null, format 1: the union of its nodes' ``sampled``
    runs)."""

    job_id: str
    trajectory_index: int = Field(ge=0)
    path: list[int]
    prompt_len: int = Field(ge=0)
    length: int = Field(ge=0, description="tokens in the row: prompt_len + len(response_ids)")
    reward: float
    sampled: Optional[list[tuple[int, int]]] = None


class MissingJob(BaseModel):
    """A job of the group that has no rows in its tree, and why (``running``, ``queued_*``, ``filtered: <kind>``,
    ``delivered without retention``, ``expired``)."""

    job_id: str
    reason: str


class GroupTree(BaseModel):
    """``GET /groups/{group_id}/tree``: the prefix tree of the rows of the group's ended jobs (issue #34).

    ``flat_tokens``: tokens in all rows (what a per-row forward computes); ``tree_tokens``: tokens in all nodes
    (what a tree-packed forward computes); ``tree_token_ratio`` = tree / flat (1.0 for no rows).
    ``max_logprob_spread``: the largest difference between the behaviour logprobs rows gave one shared sampled
    token (the node keeps the first row's). ``complete``: every job of the group ended with rows (``missing``
    empty). The server checks the invariants (:func:`prorl_server.tree.verify_tree`) before it answers.
    ``format_version``: 2 = leaves carry their own ``sampled`` runs and a node's are the union of its rows'
    (a token sampled in one row may be context in another); 1 (absent) = a node's ``sampled`` runs are every
    one of its rows' ``loss_mask``. A reader refuses a version it does not know."""

    group_id: str
    format_version: int = 1
    nodes: list[TreeNode] = Field(default_factory=list)
    leaves: list[TreeLeaf] = Field(default_factory=list)
    missing: list[MissingJob] = Field(default_factory=list)
    complete: bool = True
    flat_tokens: int = 0
    tree_tokens: int = 0
    tree_token_ratio: float = 1.0
    max_logprob_spread: float = 0.0
