"""Node-wide leases on names (an address, a uid), held with ``flock`` on ``<lease_dir>/<name>``.

Unique across processes on one node: a lease is an exclusive ``flock`` on its file. ``flock`` locks belong to
the open file description, so a lease ends by itself when every holder of the fd is gone: the runtimes hand
the fd to the sandbox's launcher (``pass_fds``), hence a lease lives exactly as long as the server or the
sandbox holding it, and is free again after a crash with no record to clean up. Files are unlinked on
release; the inode check after locking makes that race-free (a process that locked an unlinked file sees the
mismatch and moves on).

The directory is shared node state, and other local users are adversaries (docs/reward-integrity.md):

- A *private* lease directory (:func:`ensure_lease_dir` ``private=True``; the sandbox uids of a root server)
  is owned by this user and writable by no one else, so no other user can put a name in it.
- A *shared* one (mode 1777, like ``/tmp``: the loopback addresses of every user's sandboxes) lets anyone
  create files, so every name is opened ``O_NOFOLLOW | O_NONBLOCK`` (a link is refused, a FIFO never blocks
  the open) and used only if ``fstat`` shows a regular file owned by this user with one link; any other name (a FIFO, a
  link, a directory, another user's file, one that cannot be opened) is skipped as held, never an error:
  a co-tenant can take names, never stall or fail a start.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import stat
from typing import Optional

from .errors import SandboxStartError

log = logging.getLogger(__name__)

# Every open in a lease directory: a symbolic link is refused (ELOOP), a FIFO or device never blocks the open.
_OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)


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
            if os.fstat(self.fd).st_ino == os.lstat(self.path).st_ino:
                os.unlink(self.path)
        except OSError:
            pass  # already gone: the unlock below is what matters
        os.close(self.fd)
        self.fd = -1


def ensure_lease_dir(path: str, *, private: bool = False) -> None:
    """Create the lease directory ``path`` if it does not exist and check the one that does.

    ``private=False`` (shared by every user of the node): created mode 1777; an existing one must be a
    directory, not a link. Its owner can unlink anyone's lease files in it, so one owned by another user
    (neither root nor this user) is logged as a warning: that user can break this user's leases.
    ``private=True`` (only this user may create names, e.g. a root server's sandbox uids): created mode 0755;
    an existing one must be a directory owned by this user (one writable by others is made 0755 again).

    Raises:
        SandboxStartError: ``path`` is a link or not a directory, or (``private``) owned by another user.
        OSError: it cannot be created (a missing parent, no permission).
    """
    mode = 0o755 if private else 0o1777
    try:
        os.mkdir(path, mode)
        os.chmod(path, mode)  # mkdir's mode is filtered by the umask
        return
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise SandboxStartError(f"lease directory {path} is not a directory (a link or a file): refused")
    me = os.geteuid()
    if private:
        if st.st_uid != me:
            raise SandboxStartError(f"lease directory {path} belongs to uid {st.st_uid}, not to this server's "
                                    f"uid {me}: another user could forge or block its leases; refused")
        if st.st_mode & 0o022:
            log.warning("lease directory %s was writable by others (mode %o); made 0755", path, st.st_mode & 0o7777)
            os.chmod(path, 0o755)
    elif st.st_uid not in (0, me):
        log.warning("shared lease directory %s belongs to uid %d, which can unlink every lease file in it",
                    path, st.st_uid)


def try_lease(lease_dir: str, name: str, owner: str = "") -> Optional[Lease]:
    """Lease ``name`` if nobody holds it, else ``None``. ``None`` also for a name that is not a usable lease
    file: a link, a FIFO, a directory, another user's file, one that cannot be opened (see the module
    docstring); such a name is never an error. The owner (pid, uid, ``owner``) is written into the file, for
    people looking at the directory. Never blocks."""
    path = os.path.join(lease_dir, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | _OPEN_FLAGS, 0o644)
    except OSError:
        return None  # a link (ELOOP), a directory (EISDIR), another user's file (EACCES), ...
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
            # Planted by someone else (a root server may open any file), or a hard link to a file of ours
            # elsewhere (where fs.protected_hardlinks is off): not ours to lock or truncate.
            os.close(fd)
            return None
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.lstat(path).st_ino != st.st_ino:
            raise FileNotFoundError  # the previous holder unlinked this inode while we opened it: not a lease
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "uid": os.getuid(), "owner": owner}).encode())
    except OSError:  # held (BlockingIOError), replaced, or not writable: skip the name
        os.close(fd)
        return None
    return Lease(name, fd, path)
