"""Removing a directory tree that code in a sandbox shaped (its workspace, its run directory).

``shutil.rmtree`` recurses once per level (Python 3.11's ``_rmtree_safe_fd``): a sandbox that made a directory
1,200 levels deep (``os.mkdir('d'); os.chdir('d')`` in a loop) left its workspace behind with a
``RecursionError``, which ``ignore_errors`` does not catch, and the next server's ``reap_orphans`` died on it
at start. Paths that deep are also longer than ``PATH_MAX``. :func:`remove_tree` keeps the depth it works at
to one: each directory's subdirectories are renamed up into the top directory (under names the sandbox cannot
guess), its files unlinked, then it is removed; everything goes through directory descriptors, never follows a
symbolic link, and takes O(entries) time and O(1) open descriptors.
"""
from __future__ import annotations

import logging
import os
import secrets
import stat

log = logging.getLogger(__name__)

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)


def _open_dir(name: str, dir_fd: int) -> int:
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except PermissionError:  # a mode-000 directory of the sandbox's (a server not running as root)
        os.chmod(name, 0o700, dir_fd=dir_fd)
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)


def remove_tree(path: str) -> bool:
    """Remove ``path`` and everything under it, whatever its depth or shape. A symbolic link is removed, never
    followed; a missing ``path`` is fine. Best effort: an entry that cannot be removed is left and logged.

    Returns:
        True when nothing is left of ``path``.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return True
    except OSError as e:
        log.warning("cannot remove %s: %s", path, e)
        return False
    try:
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(path)
            return True
        top = os.open(path, _DIR_FLAGS)
    except OSError as e:
        log.warning("cannot remove %s: %s", path, e)
        return False
    prefix = f".prorl-rm-{secrets.token_hex(8)}-"
    moved, failures = 0, 0
    try:
        pending: list[str] = []
        moved = _empty(top, top, pending, prefix, moved)
        while pending:
            name = pending.pop()
            try:
                fd = _open_dir(name, top)
            except FileNotFoundError:
                continue
            except OSError:
                failures += 1
                continue
            try:
                moved = _empty(fd, top, pending, prefix, moved)
            except OSError:
                failures += 1
            finally:
                os.close(fd)
            try:
                os.rmdir(name, dir_fd=top)
            except OSError:
                failures += 1
    finally:
        os.close(top)
    try:
        os.rmdir(path)
    except OSError as e:
        log.warning("cannot remove %s: %s (%d entries failed)", path, e, failures)
        return False
    return True


def _empty(fd: int, top: int, pending: list[str], prefix: str, moved: int) -> int:
    """Unlink the files of the directory ``fd``; move its subdirectories into ``top`` (or, when ``fd`` is
    ``top``, leave them there) and queue them in ``pending``. Returns the updated count of moved directories."""
    with os.scandir(fd) as it:
        entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
    for name, is_dir in entries:
        try:
            if not is_dir:
                os.unlink(name, dir_fd=fd)
            elif fd == top:
                pending.append(name)
            else:
                new = f"{prefix}{moved}"
                moved += 1
                os.rename(name, new, src_dir_fd=fd, dst_dir_fd=top)
                pending.append(new)
        except FileNotFoundError:
            continue
    return moved
