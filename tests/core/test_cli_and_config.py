"""Settings layering, handler registration, and the real `prorl-server` process."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import psutil
import pytest
from pydantic import ValidationError

from prorl_server.plugin.handler import AgentHandler
from prorl_server.plugin.registry import HandlerRegistry, UnknownHandlerError
from prorl_server.cli import run_event_loop, settings_from_args
from prorl_server.config import build_settings


def test_config_file_yaml_and_toml_with_flags_winning(tmp_path, monkeypatch):
    monkeypatch.delenv("PRORL_TOKEN", raising=False)
    y = tmp_path / "s.yaml"
    y.write_text("port: 9000\nrun_workers: 7\nbackends: ['http://127.0.0.1:8000']\n")
    s = settings_from_args(["--config", str(y), "--port", "9100"])
    assert (s.port, s.run_workers, s.init_workers, s.backends) == (9100, 7, 32, ["http://127.0.0.1:8000"])
    t = tmp_path / "s.toml"
    t.write_text('host = "0.0.0.0"\neval_workers = 3\nlog_level = "debug"\n')
    s = build_settings(str(t))
    assert (s.host, s.eval_workers, s.log_level) == ("0.0.0.0", 3, "DEBUG")
    assert build_settings().host == "127.0.0.1"  # safe default bind


def test_journal_off_and_on_unquoted_in_yaml_mean_what_they_say(tmp_path):
    """YAML 1.1 reads ``journal: off`` as the boolean false (a new user's first try, as docs/journal.md writes
    it): it is off, not a validation error; ``on``/``true`` are ``auto``."""
    from prorl_server.config import journal_path

    y = tmp_path / "j.yaml"
    for word, want in (("off", "off"), ("no", "off"), ("false", "off"), ("on", "auto"), ("true", "auto"),
                       ('"off"', "off"), ("/tmp/j.sqlite", "/tmp/j.sqlite")):
        y.write_text(f"journal: {word}\nport: 8123\n")
        assert build_settings(str(y)).journal == want, word
    y.write_text("journal: off\nport: 8123\n")
    assert journal_path(build_settings(str(y))) is None


def test_a_planted_journal_path_stops_the_server_with_one_line_naming_it(tmp_path, caplog):
    """A journal path that is a link another user planted is refused at start: exit status 2 and one error line
    naming the path and the fix, not a traceback (red team J1/J2)."""
    from prorl_server.cli import main

    (tmp_path / "j.sqlite").symlink_to(tmp_path / "elsewhere.sqlite")
    assert main(["--port", "0", "--journal", str(tmp_path / "j.sqlite"), "--sandbox-runtime", "local"]) == 2
    (line,) = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert line.startswith("cannot start: ") and str(tmp_path / "j.sqlite") in line and "link" in line
    assert not (tmp_path / "elsewhere.sqlite").exists()


def test_token_from_environment_and_a_token_file_overrides_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PRORL_TOKEN", "from-env")
    assert settings_from_args([]).token == "from-env"
    f = tmp_path / "token"
    f.write_text("from-file\n")
    f.chmod(0o600)
    assert settings_from_args(["--token-file", str(f)]).token == "from-file"
    cfg = tmp_path / "s.yaml"  # a config file's token_file is an earlier layer than the environment
    cfg.write_text(f"token_file: {f}\n")
    assert settings_from_args(["--config", str(cfg)]).token == "from-env"
    monkeypatch.delenv("PRORL_TOKEN")
    assert settings_from_args(["--config", str(cfg)]).token == "from-file"


@pytest.mark.parametrize("argv", [["--token", "s3cret"], ["--token=s3cret"]])
def test_a_token_on_the_command_line_is_refused_naming_both_alternatives(argv, capsys):
    # issue #33: `prorl-server --token` put the management token in argv, readable by every local user
    with pytest.raises(SystemExit) as e:
        settings_from_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--token-file" in err and "PRORL_TOKEN" in err and "s3cret" not in err


def test_a_token_file_others_may_read_or_that_is_not_a_regular_file_is_a_clear_usage_error(tmp_path, capsys):
    readable = tmp_path / "readable"
    readable.write_text("t")
    readable.chmod(0o640)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)  # opened without blocking: a FIFO is refused, not waited on
    empty = tmp_path / "empty"
    empty.write_text("")
    empty.chmod(0o600)
    for path, says in ((readable, "mode 0640"), (fifo, "not a regular file"), (tmp_path, "not a regular file"),
                       (empty, "empty"), (tmp_path / "absent", "No such file")):
        with pytest.raises(SystemExit) as e:
            settings_from_args(["--token-file", str(path)])
        assert e.value.code == 2
        assert says in capsys.readouterr().err, path


def test_bad_setting_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("run_workers: 0\n")
    with pytest.raises(ValidationError):
        build_settings(str(bad))
    unknown = tmp_path / "u.yaml"
    unknown.write_text("wrokers: 3\n")
    with pytest.raises(ValidationError, match="wrokers"):
        build_settings(str(unknown))
    with pytest.raises(SystemExit):
        settings_from_args(["--config", str(tmp_path / "missing.yaml")])
    with pytest.raises(ValidationError, match="unknown tool parser 'nope'; registered: \\[.*'hermes'"):
        build_settings(overrides={"gateway_tool_parser": "nope"})
    # red team F2: a fleet directory that is a file was a traceback after "listening"
    (tmp_path / "afile").write_text("")
    with pytest.raises(ValidationError, match="afile exists and is not a directory"):
        build_settings(overrides={"fleet_dir": str(tmp_path / "afile")})


def test_registry_resolves_aliases_and_entry_points():
    class Echo(AgentHandler):
        name = "echo"
        aliases = ("repeat",)

    r = HandlerRegistry()
    r.register(Echo, aliases=["say"])
    assert r.resolve("repeat")[0] == "echo" and r.resolve("say")[0] == "echo"
    with pytest.raises(UnknownHandlerError) as e:
        r.resolve("missing")
    assert "echo" in str(e.value)
    assert "arithmetic" in r.load_entry_points()  # declared in setup.cfg's entry points


@pytest.mark.real
def test_event_loop_setting_picks_uvloop_when_installed(monkeypatch):
    import uvloop

    async def loop_type():
        return type(asyncio.get_running_loop())

    assert settings_from_args([]).event_loop == "auto"
    assert settings_from_args(["--event-loop", "asyncio"]).event_loop == "asyncio"
    assert run_event_loop(loop_type(), "auto") is uvloop.Loop
    assert run_event_loop(loop_type(), "uvloop") is uvloop.Loop
    assert not issubclass(run_event_loop(loop_type(), "asyncio"), uvloop.Loop)
    monkeypatch.setitem(sys.modules, "uvloop", None)  # as if it were not installed: import fails
    assert not issubclass(run_event_loop(loop_type(), "auto"), uvloop.Loop)
    with pytest.raises(SystemExit, match="uvloop is not installed"):
        run_event_loop(loop_type(), "uvloop")


def test_server_process_serves_and_exits_cleanly_on_sigterm(tmp_path):
    ready = tmp_path / "ready.json"
    token = tmp_path / "token"
    token.write_text("t0k")
    token.chmod(0o600)
    proc = subprocess.Popen([sys.executable, "-m", "prorl_server", "--port", "0", "--ready-file", str(ready),
                             "--token-file", str(token), "--log-level", "warning"])
    try:
        for _ in range(200):
            if ready.exists():
                break
            time.sleep(0.05)
        info = json.loads(ready.read_text())
        assert info["pid"] == proc.pid and info["host"] == "127.0.0.1"
        assert "t0k" not in " ".join(psutil.Process(proc.pid).cmdline())  # the secret is not in argv
        req = urllib.request.Request(info["url"] + "/process", method="POST", headers={
            "Authorization": "Bearer t0k", "Content-Type": "application/json"},
            data=json.dumps({"instance": {"data_source": "arithmetic", "expression": "6*7", "answer": 42}}).encode())
        with urllib.request.urlopen(req, timeout=10) as r:
            assert json.load(r)["reward"] == 1.0
        children = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize("field,value", [("sandbox_pool_size", 1_000_000), ("sandbox_pool_size", 10**22),
                                         ("sandbox_pool_max_specs", 100_000_000),
                                         ("sandbox_pool_refill_concurrency", 10_000)])
def test_a_pool_setting_past_its_bound_is_refused(field, value):
    # red team (session 11): --sandbox-pool-size=1000000 started, then grew ~65 MB/s and stopped answering
    from pydantic import ValidationError

    from prorl_server.config import ServerSettings

    with pytest.raises(ValidationError, match=field):
        ServerSettings(**{field: value})
