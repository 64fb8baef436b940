"""servers.json: the launcher writes it, trainers read it (trainer_plugins/servers.py)."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from trainer_plugins.servers import (
    ServerEntry,
    ServersFileError,
    entry_from_ready_file,
    load_servers,
    remove_servers,
    wait_for_servers,
    write_servers,
)

REPO = Path(__file__).resolve().parents[2]


def entry(node: str, port: int) -> ServerEntry:
    return ServerEntry(url=f"http://10.0.0.{port % 200}:{port}", node=node, host=f"10.0.0.{port % 200}", port=port)


SERVERS = [entry("n1", 1001), entry("n2", 1002), entry("n3", 1003), entry("n2", 1004)]


def test_same_node_servers_come_first_and_the_rest_keep_file_order(tmp_path):
    write_servers(tmp_path / "servers.json", "77", "tok", SERVERS)
    sf = load_servers(tmp_path)  # a directory works too
    assert [s.port for s in sf.ordered("n2")] == [1002, 1004, 1001, 1003]
    assert [s.port for s in sf.ordered("n9")] == [1001, 1002, 1003, 1004]


def test_fully_qualified_host_name_matches_the_short_slurm_node_name(tmp_path):
    write_servers(tmp_path / "servers.json", "77", "tok", SERVERS)
    assert load_servers(tmp_path).urls("n3.cluster.example")[0].endswith(":1003")


def test_local_node_defaults_to_slurmd_nodename(tmp_path, monkeypatch):
    write_servers(tmp_path / "servers.json", "77", "tok", SERVERS)
    monkeypatch.setenv("SLURMD_NODENAME", "n3")
    assert load_servers(tmp_path).ordered()[0].port == 1003


def test_token_becomes_a_bearer_header_and_no_token_sends_none(tmp_path):
    write_servers(tmp_path / "a.json", "1", "s3cret", SERVERS)
    write_servers(tmp_path / "b.json", "1", None, SERVERS)
    assert load_servers(tmp_path / "a.json").headers == {"Authorization": "Bearer s3cret"}
    assert load_servers(tmp_path / "b.json").headers == {}


def test_file_holding_the_token_is_private_and_no_temporary_file_is_left(tmp_path):
    p = write_servers(tmp_path / "servers.json", "5", "tok", SERVERS)
    assert stat.S_IMODE(p.stat().st_mode) == 0o600
    assert sorted(x.name for x in tmp_path.iterdir()) == ["servers.json"]
    assert load_servers(p).servers == tuple(SERVERS)


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d["servers"][0].pop("url"), "servers[0]: missing field 'url'"),
    (lambda d: d["servers"][1].__setitem__("port", "1002"), "servers[1]: field 'port' has type str"),
    (lambda d: d.pop("job_id"), "missing field 'job_id'"),
    (lambda d: d.__setitem__("version", 99), "format version 99"),
    (lambda d: d["servers"][0].__setitem__("llm_backends", "http://x"), "llm_backends"),
])
def test_malformed_servers_json_names_the_bad_field(tmp_path, mutate, message):
    p = write_servers(tmp_path / "servers.json", "5", "tok", SERVERS)
    data = json.loads(p.read_text())
    mutate(data)
    p.write_text(json.dumps(data))
    with pytest.raises(ServersFileError, match=message.replace("[", r"\[").replace("]", r"\]")):
        load_servers(p)


def test_truncated_file_is_a_clear_error_not_a_json_traceback(tmp_path):
    (tmp_path / "servers.json").write_text('{"version": 1, "job_')
    with pytest.raises(ServersFileError, match="not JSON"):
        load_servers(tmp_path)


def test_remove_keeps_a_servers_json_that_another_job_wrote(tmp_path):
    p = write_servers(tmp_path / "servers.json", "new-job", "tok", SERVERS)
    assert remove_servers(p, "old-job") is False and p.exists()
    assert remove_servers(p, "new-job") is True and not p.exists()
    assert remove_servers(p, "new-job") is False


def test_wait_skips_a_stale_file_of_an_earlier_job(tmp_path):
    p = write_servers(tmp_path / "servers.json", "old", "tok", SERVERS)
    threading.Timer(0.3, write_servers, args=(p, "new", "tok2", SERVERS[:1])).start()
    sf = wait_for_servers(p, timeout_s=10, poll_s=0.05, job_id="new")
    assert sf.token == "tok2" and len(sf.servers) == 1


def test_wait_times_out_naming_the_path(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=str(tmp_path)):
        wait_for_servers(tmp_path / "servers.json", timeout_s=0.3, poll_s=0.05)
    assert time.monotonic() - t0 < 5


def test_server_bound_to_all_interfaces_is_advertised_at_the_node_address(tmp_path):
    ready = tmp_path / "n1.ready.json"
    ready.write_text(json.dumps({"host": "0.0.0.0", "port": 4321, "pid": 99, "url": "http://0.0.0.0:4321"}))
    e = entry_from_ready_file(ready, "n1.cluster.example", advertise_host="10.1.2.3")
    assert (e.url, e.node, e.pid) == ("http://10.1.2.3:4321", "n1", 99)
    with pytest.raises(ServersFileError, match="no advertised host"):
        entry_from_ready_file(ready, "n1", advertise_host=None)
    ready.write_text(json.dumps({"host": "127.0.0.1", "port": 4321, "pid": 99}))
    assert entry_from_ready_file(ready, "n1", advertise_host="10.1.2.3").url == "http://127.0.0.1:4321"


def test_show_cli_prints_same_node_first_and_fails_clearly_without_a_file(tmp_path):
    write_servers(tmp_path / "servers.json", "9", "tok", SERVERS)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-m", "trainer_plugins.servers", "show", str(tmp_path), "--node", "n3"],
                       capture_output=True, text=True, env=env, check=True)
    assert r.stdout.splitlines()[0] == "http://10.0.0.3:1003\tn3"
    r = subprocess.run([sys.executable, "-m", "trainer_plugins.servers", "show", str(tmp_path / "nope.json")],
                       capture_output=True, text=True, env=env)
    assert r.returncode == 1 and "nope.json" in r.stderr and "Traceback" not in r.stderr
