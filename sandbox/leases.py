"""Node-wide leases on names (an address, a uid), held with ``flock`` on ``<lease_dir>/<name>``.

Unique across processes and users on one node: the directory is shared (mode 1777, like ``/tmp``: everyone
can create lease files, nobody can delete another's) and a lease is an exclusive ``flock`` on its file.
``flock`` locks belong to the open file description, so a lease ends by itself when every holder of the fd is
gone: the runtimes hand the fd to the sandbox's launcher (``pass_fds``), hence a lease lives exactly as long
as the server or the sandbox holding it, and is free again after a crash with no record to clean up.
Files are unlinked on release; the inode check after locking makes that race-free (a process that locked an
unlinked file sees the mismatch and moves on).
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
from typing import Optional


class Lease:
    """A held name. ``fd`` is the locked file (inheritable by a launcher). ``release()`` is idempotent."""

    def __init__(self, name: str, fd: int, path: str) -> None:
        self.name = name
        self.fd = fd
        self.path = path

    @property
    def held(self) -> bool:
        return self.fd >= 0

    def release(self) -> None:
        if self.fd < 0:
            return
        try:
            if os.fstat(self.fd).st_ino == os.stat(self.path).st_ino:
                os.unlink(self.path)
        except OSError:
            pass  # another user's file in a sticky dir, or already gone: the unlock below is what matters
        os.close(self.fd)
        self.fd = -1


def ensure_lease_dir(path: str) -> None:
    """Create the shared lease directory (mode 1777) if it does not exist."""
    try:
        os.mkdir(path, 0o1777)
        os.chmod(path, 0o1777)  # mkdir's mode is filtered by the umask
    except FileExistsError:
        pass


def try_lease(lease_dir: str, name: str, owner: str = "") -> Optional[Lease]:
    """Lease ``name`` if nobody holds it, else ``None``. The owner (pid, uid, ``owner``) is written into the
    file when it is ours to write, for people looking at the directory."""
    path = os.path.join(lease_dir, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        writable = True
    except PermissionError:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)  # another user's lease file: lock it read-only
        except OSError:
            return None
        writable = False
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EISDIR):
            return None
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    try:
        if os.fstat(fd).st_ino != os.stat(path).st_ino:
            raise FileNotFoundError
    except FileNotFoundError:
        os.close(fd)  # the previous holder unlinked this inode while we opened it: not a lease
        return None
    if writable:
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "uid": os.getuid(), "owner": owner}).encode())
    return Lease(name, fd, path)
