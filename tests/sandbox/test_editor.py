"""str_replace_editor: commands (unit tests on a directory) and workspace confinement (also in bubblewrap)."""
from __future__ import annotations

import os

import pytest

from sandbox.editor import Editor
from sandbox.errors import EditorError, PathOutsideWorkspaceError


@pytest.fixture
def ed(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    return Editor(str(ws))


def test_create_view_replace_insert_undo_round_trip(ed):
    ed.run("create", "pkg/mod.py", file_text="a = 1\nb = 2\n")
    assert "     1\ta = 1\n     2\tb = 2" in ed.run("view", "pkg/mod.py")["output"]
    ed.run("str_replace", "pkg/mod.py", old_str="b = 2", new_str="b = 3")
    ed.run("insert", "pkg/mod.py", insert_line=0, new_str="# header")
    path = os.path.join(ed.workspace, "pkg/mod.py")
    assert open(path).read() == "# header\na = 1\nb = 3\n"
    ed.run("undo_edit", "pkg/mod.py")
    assert open(path).read() == "a = 1\nb = 3\n"
    ed.run("undo_edit", "pkg/mod.py")
    assert open(path).read() == "a = 1\nb = 2\n"
    with pytest.raises(EditorError, match="No edit history"):
        ed.run("undo_edit", "pkg/mod.py")


def test_view_range_shows_only_those_lines(ed):
    ed.run("create", "f.txt", file_text="\n".join(f"l{i}" for i in range(1, 11)))
    out = ed.run("view", "f.txt", view_range=[3, 4])["output"]
    assert "     3\tl3\n     4\tl4" in out and "l5" not in out and "l2" not in out
    with pytest.raises(EditorError, match="Invalid view_range"):
        ed.run("view", "f.txt", view_range=[0, 2])


def test_view_directory_lists_two_levels_without_hidden(ed):
    ed.run("create", "a/b/c/deep.txt", file_text="x")
    ed.run("create", ".hidden/x.txt", file_text="x")
    out = ed.run("view", ".")["output"]
    assert "a/b" in out and "deep.txt" not in out and ".hidden" not in out.split("\n", 2)[2]


def test_create_refuses_to_overwrite(ed):
    ed.run("create", "f.txt", file_text="one")
    with pytest.raises(EditorError, match="already exists"):
        ed.run("create", "f.txt", file_text="two")


def test_str_replace_refuses_missing_and_ambiguous_text(ed):
    ed.run("create", "f.txt", file_text="x\nx\ny\n")
    with pytest.raises(EditorError, match="did not appear verbatim"):
        ed.run("str_replace", "f.txt", old_str="zzz", new_str="q")
    with pytest.raises(EditorError, match=r"Multiple occurrences .* lines \[1, 2\]"):
        ed.run("str_replace", "f.txt", old_str="x", new_str="q")


def test_unknown_command_and_missing_file_are_clear_errors(ed):
    with pytest.raises(EditorError, match="Unknown command"):
        ed.run("delete", "f.txt")
    with pytest.raises(EditorError, match="does not exist"):
        ed.run("view", "nope.txt")


@pytest.mark.parametrize("path", ["../outside.txt", "/etc/passwd", "a/../../outside.txt", "/"])
def test_paths_leaving_the_workspace_are_refused(ed, path):
    with pytest.raises(PathOutsideWorkspaceError, match="outside the workspace"):
        ed.run("view", path)


def test_symlink_escape_is_refused_for_read_and_write(ed, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("do not touch")
    os.symlink(str(secret), os.path.join(ed.workspace, "link.txt"))
    os.symlink(str(tmp_path), os.path.join(ed.workspace, "dirlink"))
    with pytest.raises(PathOutsideWorkspaceError):
        ed.run("view", "link.txt")
    with pytest.raises(PathOutsideWorkspaceError):
        ed.run("str_replace", "link.txt", old_str="do", new_str="did")
    with pytest.raises(PathOutsideWorkspaceError):
        ed.run("create", "dirlink/new.txt", file_text="x")
    assert secret.read_text() == "do not touch"
    assert not (tmp_path / "new.txt").exists()


@pytest.mark.real
async def test_editor_in_sandbox_refuses_path_outside_workspace(sandbox):
    from sandbox import PathOutsideWorkspaceError as Err

    with pytest.raises(Err, match="outside the workspace"):
        await sandbox.editor("view", "/etc/passwd")
    await sandbox.bash("ln -s /etc etc-link")
    with pytest.raises(Err):
        await sandbox.editor("view", "etc-link/passwd")
    r = await sandbox.editor("create", "/workspace/ok.py", file_text="print(1)\n")
    assert r.path == "/workspace/ok.py"
    assert (await sandbox.bash("python3 ok.py")).output == "1\n"
