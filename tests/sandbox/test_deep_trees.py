"""A tree the sandbox shaped, however deep, never outlives it and never stops a server from starting.

A model that made a directory 1,200 levels deep in its workspace (``os.mkdir('d'); os.chdir('d')`` in a loop)
left the workspace on the host: ``shutil.rmtree`` recursed into a ``RecursionError`` that ``ignore_errors`` does
not catch, and the next server on that state directory died in ``reap_orphans``. No external process: the
trees are made here, as the sandbox's code would make them.
"""
from __future__ import annotations

import os
import shutil
import time

import pytest

from sandbox import make_runtime
from sandbox.remove import remove_tree


def deep_tree(top: str, depth: int) -> None:
    """``top/d/d/.../d`` ``depth`` levels deep, a file in each, a symlink to /etc and a mode-000 directory at
    the bottom (made through descriptors: the path is longer than PATH_MAX)."""
    os.mkdir(top)
    cur = os.open(top, os.O_RDONLY)
    for _ in range(depth):
        os.mkdir("d", dir_fd=cur)
        os.close(os.open("f", os.O_CREAT | os.O_WRONLY, dir_fd=cur))
        nxt = os.open("d", os.O_RDONLY, dir_fd=cur)
        os.close(cur)
        cur = nxt
    os.symlink("/etc", "link", dir_fd=cur)
    os.mkdir("locked", mode=0, dir_fd=cur)
    os.close(cur)


def test_shutil_rmtree_fails_on_such_a_tree_and_remove_tree_does_not(tmp_path):
    top = str(tmp_path / "ws")
    deep_tree(top, 1500)
    with pytest.raises(RecursionError):  # what the cleanup used (Python 3.11)
        shutil.rmtree(top, ignore_errors=True)
    assert remove_tree(top) and not os.path.lexists(top)
    assert os.path.exists("/etc/passwd")  # the link was removed, not followed
    assert remove_tree(top)  # a missing path is fine


async def test_reap_orphans_cleans_a_deep_workspace_and_a_bad_record_does_not_stop_the_start(tmp_path):
    runtime = make_runtime("local", state_dir=str(tmp_path / "state"), workspace_root=str(tmp_path / "ws"))
    # named as the runtime names workspaces: a reaper removes no other directory
    workspace, run_dir = str(tmp_path / "ws" / "prorl-sb-deep-0123abcd"), str(tmp_path / "state" / "run" / "sb-deep")
    os.makedirs(tmp_path / "ws", exist_ok=True)
    deep_tree(workspace, 1500)
    os.makedirs(run_dir)
    dead = {"owner_pid": 2 ** 22 + 7, "owner_create_time": 1.0, "pid": 2 ** 22 + 8, "create_time": 1.0,
            "started_at": time.time(), "runtime": "local"}
    runtime.store.write({**dead, "sandbox_id": "sb-deep", "run_dir": run_dir, "workspace": workspace,
                         "workspace_created": True})
    runtime.store.write({**dead, "sandbox_id": "sb-bad", "run_dir": 17, "workspace": ["not", "a", "path"],
                         "workspace_created": True})
    reaped = await runtime.reap_orphans()  # before: RecursionError out of the server's start
    assert reaped >= 1 and not os.path.lexists(workspace)
    assert [r["sandbox_id"] for r in runtime.store.records()] in ([], ["sb-bad"])
