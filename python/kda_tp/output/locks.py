"""The locks of an output directory: one world size per output, one writer per rank.

Every writer into an output directory (``shard``, and ``dump`` alike) takes, before it looks
at the directory and until its output is in place:

* the world lock ``OUT/.tp{T}.lock``, shared (``flock(LOCK_SH)``) by every writer of world size
  ``T``: writers of one world size may write different ranks at once, and a writer of another
  world size waits (``wait``) or is refused, naming the holder. Joining is looked at under an
  exclusive ``flock`` on the directory itself, held only while looking, so two writers of
  different sizes never both pass;
* then each rank's lock ``OUT/.rank{r}.lock`` (exclusive), in rank order (so that waiting
  writers never deadlock).

A lock file is opened without following a symbolic link (``O_NOFOLLOW``, and ``O_CLOEXEC``),
refused unless a regular file with one link, and written only when empty or holding a kda-tp
holder line (``pid N on HOST, started TIME``): a file kda-tp did not write is never written
to, and never removed either (a lock file is unlinked only when it is empty or holds a holder
line, judged on the open file just before). The kernel releases a dead writer's locks, so a
partial directory of a rank whose lock is free is stale. A writer removes its lock files when
it is done (the world lock only when it is the last of its size).
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import resource
import socket
import stat
import time
from collections.abc import Iterable
from pathlib import Path

from ..errors import KdaTpError, OpenFilesLimitError, OutputError
from .marks import NOFOLLOW, read_regular, refuse
from .names import WORLD_LOCK

__all__ = ["OutputLocks", "is_lock_file", "lock_output", "output_error"]

#: Bytes of a lock file's holder line read back (for a refusal message, and to recognise it).
_HOLDER_BYTES = 512
#: The line a writer records in its lock files.
_HOLDER_LINE = re.compile(rb"pid [0-9]+ on [^\n]*, started [0-9TZ:-]+\n")


def output_error(path: Path, doing: str, e: OSError) -> KdaTpError:
    """The refusal of the OS error ``e`` met while ``doing`` (``"create the lock file of rank
    0"``) at ``path``: running out of file descriptors (``EMFILE``, ``ENFILE``) is named as
    the open-files limit it is, with the fix, never blamed on ``path``; anything else is an
    :class:`~kda_tp.errors.OutputError` naming ``path`` and the OS error."""
    if e.errno == errno.ENFILE:
        return OutputError(f"{path}: cannot {doing}: the system's table of open files is full "
                           "(ENFILE); close other programs' files, or raise fs.file-max, and "
                           "run again")
    if e.errno != errno.EMFILE:
        return OutputError(f"{path}: cannot {doing}: {e}")
    # Imported with the module: importing it now would need one more descriptor.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    shown_hard = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
    return OpenFilesLimitError(
        f"{path}: cannot {doing}: this process has all the {soft} files open its limit allows "
        f"(RLIMIT_NOFILE; hard limit {shown_hard}), so kda-tp cannot open one more; raise it in "
        f"the shell that runs kda-tp, e.g. ulimit -n {max(soft, 512) * 2}, and run again",
        1, soft, soft, hard,
    )


class OutputLocks:
    """The locks a writer holds on one output directory (:func:`lock_output`): its world
    size's, shared, and one per rank, exclusive; each a ``(path, descriptor)``."""

    def __init__(self, out: Path) -> None:
        self.out = out
        self.world: tuple[Path, int] | None = None
        self.held: dict[int, tuple[Path, int]] = {}

    def add(self, rank: int, wait: bool) -> None:
        """Lock rank ``rank`` too (a rank of another world size that ``--force`` removes). Out
        of rank order, but no deadlock: a writer holding it writes another world size, which
        the world lock keeps out of this directory while this writer holds its own.

        Raises:
            OutputError: as :func:`lock_output`.
        """
        if rank not in self.held:
            self.held[rank] = _lock_rank(self.out, rank, wait)

    def release(self) -> None:
        """Remove each rank's lock file (when it is still this writer's file) while still
        holding its lock, then unlock it (by closing); then leave the world lock, removing its
        file when no other writer of this size holds it. A process that opened a lock file
        before it was removed and then gets the lock sees that its file is no longer at that
        path, and locks the new one."""
        for path, fd in self.held.values():
            try:
                _unlink_ours(path, fd)
            except OSError:
                pass  # e.g. the directory became read-only: the lock is released all the same
            os.close(fd)
        self.held.clear()
        if self.world is not None:
            _leave_world(self.out, *self.world)
            self.world = None


def lock_output(out: Path, tp_size: int, ranks: Iterable[int], wait: bool) -> OutputLocks:
    """Join the world lock of ``tp_size`` on ``out``, then lock each of ``ranks`` in rank
    order; on any failure the locks taken so far are released.

    Args:
        out: the output directory (it exists).
        tp_size: the world size this writer writes.
        ranks: the ranks it writes.
        wait: wait for a writer of another world size, or of one of ``ranks``, to finish,
            instead of refusing.

    Raises:
        OutputError: without ``wait``, a live writer of another world size is writing into
            ``out``, or one of ``ranks`` is being written (the message names the holder: pid,
            host, start time); a lock path is a symbolic link, not a regular file, a file with
            other links or holding something else than a holder line; a lock file cannot be
            created or locked.
        OpenFilesLimitError: the process has no file descriptor left for a lock file.
    """
    locks = OutputLocks(out)
    try:
        locks.world = _join_world(out, tp_size, wait)
        for r in sorted(ranks):
            locks.held[r] = _lock_rank(out, r, wait)
        # Named in the world lock once admitted (a refused writer changes nothing), under the
        # directory's mutex (writers of one size share the file).
        with _Directory(out):
            _record_holder(*locks.world)
    except BaseException:
        locks.release()
        raise
    return locks


def is_lock_file(path: Path) -> bool:
    """Whether ``path`` is a lock file as kda-tp writes them: a regular file (not a link),
    empty or holding a holder line."""
    held = read_regular(path, _HOLDER_BYTES + 1)
    return held is not None and (not held or bool(_HOLDER_LINE.fullmatch(held)))


def _unlink_ours(path: Path, fd: int) -> None:
    """Remove the lock file ``path``, open as ``fd``, when it is still that file and holds what
    kda-tp writes there (nothing, or a holder line): a user's file that was refused as a lock
    stays, whoever opened it."""
    if not _same_file(path, fd):
        return
    size = os.fstat(fd).st_size
    held = os.pread(fd, _HOLDER_BYTES, 0) if size <= _HOLDER_BYTES else None
    if held is not None and (not held or _HOLDER_LINE.fullmatch(held)):
        path.unlink()


def _same_file(path: Path, fd: int) -> bool:
    """Whether ``path`` (not followed if a link) is the file open as ``fd``."""
    try:
        current = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (current.st_dev, current.st_ino) == (mine.st_dev, mine.st_ino)


def _open_lock(path: Path, whose: str) -> int:
    """Open (creating it) the lock file ``path`` of ``whose`` (``"rank 0"``), refusing a file
    kda-tp would not have written (see the module docstring).

    Raises:
        OutputError, OpenFilesLimitError: as :func:`lock_output`.
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NONBLOCK | NOFOLLOW,
                     0o644)
    except OSError as e:
        if e.errno == errno.ELOOP or path.is_symlink():
            raise refuse(path, f"a symbolic link where {whose}'s lock file goes (kda-tp's lock "
                               "files are regular files it creates)", "writes") from None
        raise output_error(path, f"create the lock file of {whose}", e) from e
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
            what = ("not a regular file" if not stat.S_ISREG(info.st_mode)
                    else f"a file with {info.st_nlink} hard links")
            raise refuse(path, f"{what} where {whose}'s lock file goes", "writes")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _record_holder(path: Path, fd: int) -> None:
    """Write this process (pid, host, start time, UTC) into its lock file ``fd``, for the
    message of a writer it refuses.

    Raises:
        OutputError: the file holds something else than a holder line.
    """
    held = os.pread(fd, _HOLDER_BYTES, 0)
    if held and not _HOLDER_LINE.fullmatch(held):
        raise refuse(path, "holds something else than a kda-tp lock's holder line", "writes")
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    line = f"pid {os.getpid()} on {socket.gethostname()}, started {started}\n".encode()
    os.pwrite(fd, line, 0)
    os.ftruncate(fd, len(line))  # a longer holder line of its own before


def _lock_rank(out: Path, rank: int, wait: bool) -> tuple[Path, int]:
    """Take the exclusive ``flock`` of rank ``rank``'s lock file, then record this process in
    it (:func:`_record_holder`).

    Raises:
        OutputError, OpenFilesLimitError: as :func:`lock_output`.
    """
    path = out / f".rank{rank}.lock"
    while True:
        fd = _open_lock(path, f"rank {rank}")
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                raise OutputError(
                    f"{out}: rank {rank} is being written by another kda-tp run "
                    f"({_holder(fd)}; lock file {path.name}); pass --wait (wait=True) to wait "
                    "for it, or choose another --out"
                ) from None
            except OSError as e:
                raise OutputError(f"{path}: cannot lock rank {rank}'s lock file: {e}") from e
            if _same_file(path, fd):
                _record_holder(path, fd)
                return path, fd
        except BaseException:
            os.close(fd)
            raise
        # The previous holder removed the file before unlocking it: lock the one now there.
        os.close(fd)


def _holder(fd: int) -> str:
    """The holder line of a lock file, as one printable line."""
    try:
        text = os.pread(fd, _HOLDER_BYTES, 0).decode("utf-8", "replace")
    except OSError:
        text = ""
    text = "".join(c if c.isprintable() else " " for c in text).strip()
    return f"held by {text}" if text else "held by a writer that is just starting"


class _Directory:
    """An exclusive ``flock`` on the output directory itself: the mutex under which writers
    join or leave a world lock (held only while looking, never while writing)."""

    def __init__(self, out: Path) -> None:
        try:
            self.fd = os.open(out, os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_DIRECTORY", 0))
        except OSError as e:
            raise output_error(out, "open the output directory to lock it", e) from e

    def __enter__(self) -> _Directory:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(self.fd)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)  # releases the flock


def _join_world(out: Path, tp_size: int, wait: bool) -> tuple[Path, int]:
    """Hold ``OUT/.tp{tp_size}.lock`` shared, once no writer of another world size holds its
    own (waiting for it with ``wait``, else refused naming it).

    Raises:
        OutputError, OpenFilesLimitError: as :func:`lock_output`.
    """
    path = out / f".tp{tp_size}.lock"
    while True:
        with _Directory(out):
            fd = _open_lock(path, f"tp_size {tp_size}")
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)
                other = _other_world(out, tp_size)
                if other is None and _same_file(path, fd):
                    return path, fd
            except BaseException:
                _drop_world_file(path, fd)
                raise
            _drop_world_file(path, fd)
        if other is None:
            continue  # the file was replaced meanwhile: join the one now there
        size, other_path, other_fd = other
        try:
            if not wait:
                raise OutputError(
                    f"{out}: another kda-tp run is writing tp_size {size} output into it "
                    f"({_holder(other_fd)}; lock file {other_path.name}); one output directory "
                    f"holds one world size, so this tp_size {tp_size} run may not start there "
                    "now: pass --wait (wait=True) to wait for it to finish, or choose another "
                    "--out"
                )
            fcntl.flock(other_fd, fcntl.LOCK_EX)  # until every writer of that size is done
        finally:
            os.close(other_fd)


def _other_world(out: Path, tp_size: int) -> tuple[int, Path, int] | None:
    """The world size, lock file and an open descriptor of a writer of another world size
    holding its world lock on ``out`` now, or None; stale world lock files (no holder) found on
    the way are removed. Called under the directory's mutex (:class:`_Directory`)."""
    for name in sorted(os.listdir(out)):
        m = WORLD_LOCK.match(name)
        if not m or int(m.group(1)) == tp_size:
            continue
        path = out / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | NOFOLLOW)
        except OSError:
            continue  # a link or something else: no kda-tp writer holds it
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return int(m.group(1)), path, fd
        except OSError:
            os.close(fd)
            continue
        try:
            if stat.S_ISREG(os.fstat(fd).st_mode):
                _unlink_ours(path, fd)
        except OSError:
            pass
        os.close(fd)
    return None


def _leave_world(out: Path, path: Path, fd: int) -> None:
    """Leave the world lock ``path`` held as ``fd`` (under the directory's mutex), removing the
    file when this writer was the last of its size."""
    try:
        with _Directory(out):
            _drop_world_file(path, fd)
    except KdaTpError:
        os.close(fd)  # e.g. the directory was removed: the lock goes all the same


def _drop_world_file(path: Path, fd: int) -> None:
    """Close the world lock ``fd``, first removing its file ``path`` when no other writer holds
    it (called under the directory's mutex, so that no writer joins meanwhile)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        _unlink_ours(path, fd)
    except OSError:
        pass  # another writer of this size holds it, or the directory became read-only
    finally:
        os.close(fd)
