"""``str_replace_editor``: view / create / str_replace / insert / undo_edit, confined to the workspace.

Command set and messages follow the editor tool of SWE-agent / OpenHands / Anthropic's ``str_replace_editor``
(view shows ``cat -n``-style numbered lines; ``str_replace`` needs ``old_str`` to occur exactly once).
Confinement: a path is resolved (relative to the workspace, ``..`` and every symlink followed) and must end
inside the workspace's real path; the final open uses ``O_NOFOLLOW``. Runs inside the sandbox.
"""
from __future__ import annotations

import os
# `typing` costs ~9 ms to import and this module runs in every sandbox start: annotations only.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any, Optional

from .errors import EditorError, PathOutsideWorkspaceError

MAX_VIEW_CHARS = 16000
SNIPPET_LINES = 4
COMMANDS = ("view", "create", "str_replace", "insert", "undo_edit")


class Editor:
    """One editor per sandbox; keeps an undo history per file (in memory, lost with the sandbox)."""

    def __init__(self, workspace: str) -> None:
        self.workspace = os.path.realpath(workspace)
        self._history: dict[str, list[str]] = {}

    def resolve(self, path: str) -> str:
        """Absolute real path of ``path`` (relative = to the workspace). Raises
        :class:`PathOutsideWorkspaceError` if it leaves the workspace, :class:`EditorError` if empty."""
        if not isinstance(path, str) or not path:
            raise EditorError("path must be a non-empty string")
        full = path if os.path.isabs(path) else os.path.join(self.workspace, path)
        real = os.path.realpath(full)
        if real != self.workspace and not real.startswith(self.workspace + os.sep):
            raise PathOutsideWorkspaceError(
                f"The path {path} is outside the workspace {self.workspace} (it resolves to {real}); the editor "
                "only works on files inside the workspace.")
        return real

    def run(self, command: str, path: str, **kw: Any) -> dict[str, str]:
        """Execute one command; returns ``{"output": str, "path": str}``. Raises :class:`EditorError`."""
        if command not in COMMANDS:
            raise EditorError(f"Unknown command {command!r}; allowed: {', '.join(COMMANDS)}")
        real = self.resolve(path)
        out = getattr(self, "_" + command)(real, **kw)
        return {"output": out, "path": real}

    # ----------------------------------------------------------------------------------------- commands
    def _view(self, path: str, view_range: Optional[list[int]] = None) -> str:
        if os.path.isdir(path):
            if view_range:
                raise EditorError("view_range is not allowed when path is a directory")
            lines = []
            base_depth = path.rstrip(os.sep).count(os.sep)
            for root, dirs, files in os.walk(path):
                dirs[:] = sorted(d for d in dirs if not d.startswith("."))
                depth = root.rstrip(os.sep).count(os.sep) - base_depth
                if depth >= 2:
                    dirs[:] = []
                for name in sorted(dirs) + sorted(f for f in files if not f.startswith(".")):
                    lines.append(os.path.join(root, name))
            body = "\n".join(lines)
            return _clip(f"Files and directories up to 2 levels deep in {path}, excluding hidden items:\n"
                         f"{path}\n{body}\n")
        text = self._read(path)
        file_lines = text.split("\n")
        start = 1
        if view_range:
            if len(view_range) != 2 or not all(isinstance(i, int) for i in view_range):
                raise EditorError("view_range must be a list of two integers [start, end]")
            start, end = view_range
            n = len(file_lines)
            if start < 1 or start > n:
                raise EditorError(f"Invalid view_range {view_range}: start must be within [1, {n}]")
            if end == -1:
                end = n
            if end < start or end > n:
                raise EditorError(f"Invalid view_range {view_range}: end must be -1 or within [{start}, {n}]")
            file_lines = file_lines[start - 1:end]
        return _clip(f"Here's the result of running `cat -n` on {path}:\n" + _numbered(file_lines, start) + "\n")

    def _create(self, path: str, file_text: Optional[str] = None) -> str:
        if file_text is None:
            raise EditorError("Parameter `file_text` is required for command: create")
        if os.path.lexists(path):
            raise EditorError(f"File already exists at: {path}. Cannot overwrite files using command `create`.")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self._write(path, file_text, create=True)
        self._history.setdefault(path, [])
        return f"File created successfully at: {path}"

    def _str_replace(self, path: str, old_str: Optional[str] = None, new_str: Optional[str] = None) -> str:
        if old_str is None or old_str == "":
            raise EditorError("Parameter `old_str` is required (and non-empty) for command: str_replace")
        new_str = "" if new_str is None else new_str
        text = self._read(path)
        count = text.count(old_str)
        if count == 0:
            raise EditorError(f"No replacement was performed, old_str `{old_str}` did not appear verbatim in "
                              f"{path}.")
        if count > 1:
            lines = sorted({text[:i].count("\n") + 1 for i in _find_all(text, old_str)})
            raise EditorError(f"No replacement was performed. Multiple occurrences of old_str `{old_str}` in "
                              f"lines {lines}. Please ensure it is unique")
        new_text = text.replace(old_str, new_str, 1)
        self._history.setdefault(path, []).append(text)
        self._write(path, new_text)
        at = text.split(old_str, 1)[0].count("\n")
        return (f"The file {path} has been edited. "
                + self._snippet(new_text, at, new_str.count("\n"), path)
                + "Review the changes and make sure they are as expected. Edit the file again if necessary.")

    def _insert(self, path: str, insert_line: Optional[int] = None, new_str: Optional[str] = None) -> str:
        if new_str is None:
            raise EditorError("Parameter `new_str` is required for command: insert")
        if not isinstance(insert_line, int):
            raise EditorError("Parameter `insert_line` (an integer) is required for command: insert")
        text = self._read(path)
        lines = text.split("\n")
        if insert_line < 0 or insert_line > len(lines):
            raise EditorError(f"Invalid `insert_line` parameter: {insert_line}. It should be within the range of "
                              f"lines of the file: [0, {len(lines)}]")
        new_lines = new_str.split("\n")
        new_text = "\n".join(lines[:insert_line] + new_lines + lines[insert_line:])
        self._history.setdefault(path, []).append(text)
        self._write(path, new_text)
        return (f"The file {path} has been edited. "
                + self._snippet(new_text, insert_line, len(new_lines) - 1, path)
                + "Review the changes and make sure they are as expected (correct indentation, no duplicate "
                  "lines, etc). Edit the file again if necessary.")

    def _undo_edit(self, path: str) -> str:
        hist = self._history.get(path)
        if not hist:
            raise EditorError(f"No edit history found for {path}.")
        old = hist.pop()
        self._write(path, old)
        return f"Last edit to {path} undone successfully. " + self._snippet(old, 0, 0, path, whole=True)

    # ------------------------------------------------------------------------------------------- helpers
    def _read(self, path: str) -> str:
        if not os.path.lexists(path):
            raise EditorError(f"The path {path} does not exist. Please provide a valid path.")
        if os.path.isdir(path):
            raise EditorError(f"The path {path} is a directory; only `view` works on directories.")
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as e:
            raise EditorError(f"Cannot open {path}: {e.strerror}") from None
        with os.fdopen(fd, "rb") as f:
            data = f.read()
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise EditorError(f"{path} is not a UTF-8 text file; the editor only edits text.") from None

    def _write(self, path: str, text: str, create: bool = False) -> None:
        flags = os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW | os.O_CREAT | (os.O_EXCL if create else 0)
        try:
            fd = os.open(path, flags, 0o644)
        except OSError as e:
            raise EditorError(f"Cannot write {path}: {e.strerror}") from None
        with os.fdopen(fd, "wb") as f:
            f.write(text.encode("utf-8"))

    @staticmethod
    def _snippet(text: str, at_line: int, added: int, path: str, whole: bool = False) -> str:
        lines = text.split("\n")
        if whole:
            start, end = 0, len(lines)
        else:
            start = max(0, at_line - SNIPPET_LINES)
            end = min(len(lines), at_line + added + SNIPPET_LINES + 1)
        return (f"Here's the result of running `cat -n` on a snippet of {path}:\n"
                + _clip(_numbered(lines[start:end], start + 1)) + "\n")


def _numbered(lines: list[str], start: int) -> str:
    return "\n".join(f"{i:6}\t{line}" for i, line in enumerate(lines, start))


def _clip(s: str) -> str:
    if len(s) <= MAX_VIEW_CHARS:
        return s
    return s[:MAX_VIEW_CHARS] + (f"\n[output clipped at {MAX_VIEW_CHARS} characters; use view_range to see a part "
                                 "of the file]\n")


def _find_all(text: str, sub: str):
    i = text.find(sub)
    while i != -1:
        yield i
        i = text.find(sub, i + 1)
