"""Server settings: defaults < config file (YAML or TOML) < environment (``PRORL_TOKEN``) < command-line flags.

``token_file`` (``--token-file``) is read where its layer is: a config file's ``token_file`` gives way to
``PRORL_TOKEN``, and ``--token-file`` overrides both. A token never comes from argv.

The ``handlers`` section holds each handler's own settings (``handlers: {code: {max_turns: 12}}``), validated
against that handler's ``settings_model`` (:meth:`prorl_server.plugin.HandlerRegistry.configure`).
"""
from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator

from prorl_server.membership import read_token_file
from prorl_server.plugin.registry import default_registry
from prorl_server.llm.turn import AUTO, check_parser_name


class ServerSettings(BaseModel):
    """Every setting of ``prorl-server``. Units: seconds for ``*_s``, MiB for ``max_body_mb``."""

    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535, description="0 picks a free port (see ready_file)")
    init_workers: int = Field(default=32, ge=1)
    run_workers: int = Field(default=32, ge=1)
    eval_workers: int = Field(default=32, ge=1)
    default_timeout_s: Optional[float] = Field(default=3600.0, gt=0,
                                               description="counted-time limit of a job that sets none")
    token: Optional[str] = Field(default=None, description="bearer token for every endpoint but /health (and "
                                 "the key that signs this server's fleet record)")
    token_file: Optional[str] = Field(default=None, description="file holding the token (a regular file of mode "
                                      "600), read at start into token; how prorl-server --token-file sets it")
    backends: list[str] = Field(default_factory=list, description="LLM backend URLs registered at start")
    backend_wait_s: float = Field(default=60.0, ge=0,
                                  description="how long a job waits for a backend before its stage fails")
    affinity_slack: int = Field(default=8, ge=0, description="in-flight jobs a group's backend may have above "
                                "the least-loaded backend and still get the group's next job (prefix-cache "
                                "reuse); 0: only when tied")
    tokenizer: Optional[str] = Field(default=None, description="tokenizer path/name (a hub name may "
                                     "download); default: the model path the backend serves (root in GET "
                                     "/v1/models), from local files only, failing at once if not local")
    llm_timeout_s: float = Field(default=600.0, gt=0, description="timeout of one generation request")
    health_interval_s: float = Field(default=10.0, gt=0, description="backend health probe period")
    keep_finished: int = Field(default=10000, ge=0, description="finished jobs kept for GET /jobs/{id}")
    keep_finished_mb: float = Field(default=512.0, ge=0, description="MiB of finished results kept for "
                                    "GET /jobs/{id} (estimated from token counts; oldest forgotten first)")
    group_retention_s: float = Field(default=600.0, ge=0, description="seconds a group's delivered results stay "
                                     "whole for GET /groups/{id}/tree after its newest job ended, unless a "
                                     "complete tree of it is served first (then they are reduced at once)")
    completion_time_wait_s: float = Field(default=600.0, gt=0, description="seconds a completion_time group "
                                          "waits for its missing members after its first member ended (#35)")
    max_body_mb: float = Field(default=64.0, gt=0)
    sandbox_runtime: Optional[str] = Field(default="auto",
                                           description="auto (bubblewrap where bwrap is installed, else none) | "
                                           "bubblewrap | singularity | local | none (no sandboxes: handlers that "
                                           "need one refuse their jobs at submit)")
    sandbox_options: dict[str, Any] = Field(default_factory=dict,
                                            description="options of the runtime (sandbox.make_runtime)")
    sandbox_image: Optional[str] = Field(default=None, description="image for sandboxes whose spec names none "
                                         "(a .sif for singularity, a rootfs directory for bubblewrap)")
    sandbox_pool_size: int = Field(default=4, ge=0, le=256, description="started sandboxes kept ready per pooled "
                                   "spec (sandbox.pool.SandboxPool: handed out once, refilled in the background); "
                                   "0 = off, at most 256")
    sandbox_pool_max_specs: int = Field(default=8, ge=1, le=64, description="distinct sandbox specs pooled at most "
                                        "(the first asked for without per-job binds or workspace), 1..64")
    sandbox_pool_refill_concurrency: int = Field(default=2, ge=1, le=64,
                                                 description="sandbox starts the pool runs at once, 1..64")
    ready_file: Optional[str] = Field(default=None,
                                      description="write {host, port, pid, url} here once listening")
    gateway_max_sessions: int = Field(default=1024, ge=1, description="open gateway sessions at most "
                                      "(POST /sessions answers 429 beyond)")
    gateway_idle_timeout_s: float = Field(default=900.0, gt=0, description="an open gateway session without a "
                                          "job, unused this long, expires (its tokens stay for finalize)")
    gateway_keep_finished: int = Field(default=1024, ge=0, description="ended gateway sessions kept for "
                                       "finalize and GET /sessions/{id}")
    gateway_tool_parser: str = Field(default=AUTO, description="how the gateway parses tool calls out of "
                                     "generated text: auto (the served model family's parser, from its chat "
                                     "template) or a name of prorl_server.llm.tool_parser.PARSERS")
    cpu_workers: Optional[int] = Field(default=None, ge=1, description="processes of the pool that runs "
                                       "CPU-bound scoring off the event loop; default min(4, CPU count)")
    handlers: dict[str, dict[str, Any]] = Field(default_factory=dict, description="each handler's own "
                                                 "settings by handler name, e.g. {code: {max_turns: 12}}: the "
                                                 "keys of its settings_model (see docs/handlers.md)")
    listen_backlog: int = Field(default=4096, ge=1, le=1 << 20, description="connections the kernel queues "
                                "before the server accepts them (listen(2)); the kernel caps it at "
                                "net.core.somaxconn. aiohttp's default, 128, drops connections when thousands "
                                "of clients connect at once")
    gc_freeze: bool = Field(default=True, description="move long-lived objects (libraries, the tokenizer's "
                            "torch/transformers) out of the garbage collector's view at start and after large "
                            "imports, so full collections walk only the live jobs (prorl_server.gc_control)")
    gc_gen0_threshold: Optional[int] = Field(default=50_000, ge=1, description="allocations between "
                                             "generation-0 collections (CPython's default: 700); null keeps "
                                             "Python's thresholds")
    admission_target_lag_ms: Optional[float] = Field(default=None, ge=0, le=10_000, description="admission "
                                                     "control (prorl_server.admission): jobs start their stages "
                                                     "only while the event loop keeps within this lag, ms; the "
                                                     "limit adapts (AIMD on the lag of a busy loop); 0: off, every "
                                                     "job starts at once; null (the default of an app built in "
                                                     "code): off; prorl-server uses 5")
    admission_min_jobs: int = Field(default=16, ge=1, description="the admission limit never goes below "
                                    "this many jobs in their stages")
    processes: int = Field(default=1, ge=0, le=1024, description="server processes to run (prorl-server "
                           "only): each is its own member with its own port (port, port+1, ...; or each a free "
                           "port with port 0), listed in the ready file's members; 0 = one per CPU core")
    journal: Optional[str] = Field(default=None, description="the SQLite journal of jobs, results and "
                                   "completions (prorl_server.journal.store): a file path, 'auto' "
                                   "(~/.local/state/prorl/journal/<host>_<port>.sqlite; what prorl-server uses "
                                   "when this is not set) or 'off'; null (the default of an app built in code) "
                                   "is off")
    journal_max_bytes: Optional[int] = Field(default=16 << 30, ge=1 << 20, description="the journal's size cap "
                                             "in bytes (the oldest finished jobs are deleted first); null: none")
    journal_max_age_s: Optional[float] = Field(default=7 * 86400.0, gt=0, description="finished jobs older "
                                               "than this are deleted from the journal; null: kept")
    journal_prealloc_wal: Optional[bool] = Field(default=None, description="write the journal's WAL file "
                                                 "(97 MiB of zeros, ~0.1 s at start) before the first "
                                                 "commit, so commits overwrite allocated space instead of "
                                                 "appending (commit p99 at 5,000 completions/s, see "
                                                 "docs/journal.md); null: on for prorl-server, off for an app "
                                                 "built in code")
    fleet_dir: Optional[str] = Field(default=None, description="fleet directory on a shared file system "
                                     "(prorl_server.membership): this server holds a leased record in it, leaves "
                                     "it on exit, drains on SIGTERM and exits when an end sentinel appears; "
                                     "null: no fleet")
    fleet_ttl_s: float = Field(default=5.0, gt=0, le=3600, description="lease of the fleet record, seconds "
                               "(renewed every ttl/3); readers drop a member whose lease stops moving this long")
    advertise_host: Optional[str] = Field(default=None, description="address clients use to reach this server, "
                                          "written to the fleet record (default: PRORL_ADVERTISE_HOST, else the "
                                          "bind address, else for a wildcard bind this host's address)")
    drain_timeout_s: float = Field(default=20.0, ge=0, description="a draining server (SIGTERM in a fleet, "
                                   "POST /drain) waits this long for the jobs it holds before cancelling them "
                                   "and exiting; keep it under the launcher's PRORL_STOP_GRACE")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    event_loop: Literal["auto", "uvloop", "asyncio"] = Field(
        default="auto", description="auto: uvloop when it is installed (faster sockets under many concurrent "
        "requests), else asyncio's own")

    @field_validator("gateway_tool_parser")
    @classmethod
    def _known_parser(cls, v: str) -> str:
        return check_parser_name(v)

    @field_validator("fleet_dir")
    @classmethod
    def _fleet_dir_is_a_directory(cls, v: Optional[str]) -> Optional[str]:
        # checked here, not when the server first writes its record: that came after "listening", as a traceback
        if v is not None and os.path.exists(v) and not os.path.isdir(v):
            raise ValueError(f"{v} exists and is not a directory")
        return v

    @field_validator("journal", mode="before")
    @classmethod
    def _journal_yaml_words(cls, v: Any) -> Any:
        # YAML 1.1 reads an unquoted `journal: off` (or no/false) as False, and on/yes/true as True
        if isinstance(v, bool):
            return "auto" if v else "off"
        return v

    @field_validator("log_level", mode="before")
    @classmethod
    def _upper(cls, v: Any) -> Any:
        return v.upper() if isinstance(v, str) else v

    def workers(self) -> dict[str, int]:
        return {"init": self.init_workers, "run": self.run_workers, "eval": self.eval_workers}


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML (``.yaml``/``.yml``) or TOML (``.toml``) settings file into a dict.

    Raises:
        ValueError: unknown extension, or the file does not hold a mapping.
        OSError: the file cannot be read.
    """
    p = Path(path)
    text = p.read_text()
    if p.suffix == ".toml":
        data = tomllib.loads(text)
    elif p.suffix in (".yaml", ".yml"):
        data = yaml.safe_load(text) or {}
    else:
        raise ValueError(f"config file {p} must end in .yaml, .yml or .toml")
    if not isinstance(data, dict):
        raise ValueError(f"config file {p} must hold a mapping of settings")
    return data


def build_settings(file: Optional[str] = None, overrides: Optional[dict[str, Any]] = None) -> ServerSettings:
    """Merge the layers: defaults, then ``file``, then ``PRORL_TOKEN``, then ``overrides`` (flags; None
    values are ignored so an unset flag never hides the file's value).

    A ``handlers`` section is checked against the handlers the server would serve (the process-wide
    registry with every entry-point handler), so a misspelt handler or setting stops the server at startup.

    Raises:
        pydantic.ValidationError: a setting has the wrong type or range, or is unknown.
        prorl_server.plugin.HandlerSettingsError: a ``handlers`` section names an unknown handler or setting,
            or has a bad value.
        ValueError / OSError: a ``token_file`` others may read, not a regular file, or unreadable
            (:func:`prorl_server.membership.read_token_file`).
    """
    data: dict[str, Any] = _read_token_file(load_config_file(file) if file else {})
    if os.environ.get("PRORL_TOKEN"):
        data["token"] = os.environ["PRORL_TOKEN"]
    data.update(_read_token_file({k: v for k, v in (overrides or {}).items() if v is not None}))
    settings = ServerSettings.model_validate(data)
    if settings.handlers:
        default_registry.load_entry_points()
        default_registry.configure(settings.handlers)
    return settings


def _read_token_file(layer: dict[str, Any]) -> dict[str, Any]:
    """A settings layer with its ``token_file`` read into ``token`` (so a later layer's token_file wins over an
    earlier token, as any later setting does).

    Raises:
        ValueError: the file is not a regular file of mode 600 (others could read the secret), or is empty.
        OSError: it cannot be read.
    """
    if layer.get("token_file"):
        layer = {**layer, "token": read_token_file(layer["token_file"])}
    return layer


def journal_path(settings: ServerSettings) -> Optional[str]:
    """Where ``settings.journal`` says the journal is: None for off (null, ``off``, or ``auto`` with port 0,
    whose port is not known before binding), else a file path."""
    value = settings.journal
    if value is None or value.lower() in ("off", "none", "false", ""):
        return None
    if value.lower() == "auto":
        if settings.port == 0:
            return None
        host = settings.host.replace(":", "_").replace("/", "_")
        return str(Path.home() / ".local" / "state" / "prorl" / "journal" / f"{host}_{settings.port}.sqlite")
    return value
