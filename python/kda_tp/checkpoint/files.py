"""File plumbing of everything kda_tp writes or reads: atomic writes (a hidden temporary file,
:data:`TEMP_FILE`, fsync'd and renamed into place), JSON files written that way
(:func:`write_json`), an output path resolved or refused (:func:`resolve_out`), and the
open-files limit a read must fit (:func:`open_files_error`).

Each file is first written to a hidden temporary file in the destination directory
(``.<name>.<random>.partial``), flushed and fsync'd, then renamed over the final name with
``os.replace``; the directory is fsync'd after the rename. A reader therefore sees either the
old file or the complete new one, never a half-written file under the final name. The
safetensors reader and writer (``reader``, ``writer``), kda-tp's marks and moves
(``kda_tp.output``) and the engine dumps (``kda_tp.audit``) build on it.
"""

from __future__ import annotations

import errno
import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import OpenFilesLimitError, OutputError

__all__ = ["MISSING", "TEMP_FILE", "atomic_write", "checked_write", "missing_path",
           "open_files_error", "resolve_out", "write_json"]

#: The one wording of a missing path in every refusal (the Rust core's too): ``PATH: no such
#: file or directory``, never the OS's ``[Errno 2] ...`` or ``(os error 2)``.
MISSING = "no such file or directory"

#: The name of a temporary file the writers write before renaming it into place (a killed
#: writer leaves it): ``.<name>.<12 hex digits>.partial``.
TEMP_FILE = re.compile(r"^\..+\.[0-9a-f]{12}\.partial$")


def missing_path(path: str | os.PathLike[str], e: OSError) -> str | None:
    """``PATH: no such file or directory`` (:data:`MISSING`) when ``e`` says a path is
    missing (``ENOENT``), else None: the caller words the other errors."""
    return f"{os.fspath(path)}: {MISSING}" if e.errno == errno.ENOENT else None


def checked_write(f: BinaryIO, path: Path, data: bytes | memoryview) -> None:
    """Write all of ``data``, turning an OS error into :class:`OutputError`."""
    try:
        f.write(data)
    except OSError as exc:
        raise OutputError(f"{path}: write failed: {exc}") from exc


def atomic_write(
    path: Path,
    write_body: Callable[[BinaryIO], None],
    *,
    sync: bool = True,
    mode: int | None = None,
) -> None:
    """Run ``write_body`` on a temporary file beside ``path``, then rename it to ``path``.

    The temporary file is created with ``O_EXCL`` and mode 0o666 filtered by the umask (the
    permissions an ordinary ``open`` would give), or, with ``mode``, created 0o600 and set to
    ``mode`` before anything is written (never more open than ``mode`` meanwhile). On success
    it is flushed, fsync'd, closed and renamed, and the directory is fsync'd. On any exception it is removed and the exception
    propagates; OS errors of the file operations themselves become :class:`OutputError`, while
    exceptions raised inside ``write_body`` pass through as they are.
    """
    temp = path.with_name(f".{path.name}.{os.urandom(6).hex()}.partial")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(temp, flags, 0o666 if mode is None else 0o600)
        if mode is not None:
            try:
                os.chmod(fd, mode)
            except BaseException:
                os.close(fd)
                os.unlink(temp)
                raise
    except OSError as exc:
        raise OutputError(f"{path}: cannot create temporary file {temp.name}: {exc}") from exc
    try:
        # Not a with-block: a close() error must not mask the exception from write_body.
        f = open(fd, "wb")  # noqa: SIM115
        try:
            write_body(f)
            _flush_and_sync(f, path, sync)
        except BaseException:
            _close_quietly(f)
            raise
        try:
            f.close()
            os.replace(temp, path)
        except OSError as exc:
            raise OutputError(f"{path}: cannot close and rename {temp.name}: {exc}") from exc
    except BaseException:
        try:
            os.unlink(temp)
        except FileNotFoundError:
            pass
        raise
    if sync:
        _fsync_directory(path)


def _flush_and_sync(f: BinaryIO, path: Path, sync: bool) -> None:
    """Push buffered bytes to the kernel and, with ``sync``, the kernel's to the disk (ENOSPC
    often shows here)."""
    try:
        f.flush()
        if sync:
            os.fsync(f.fileno())
    except OSError as exc:
        raise OutputError(f"{path}: flush/fsync failed: {exc}") from exc


def _close_quietly(f: BinaryIO) -> None:
    """Close ``f`` while another exception is already propagating; a second error is dropped."""
    try:
        f.close()
    except OSError:
        pass


def _fsync_directory(path: Path) -> None:
    """fsync the directory holding ``path`` so the rename itself is durable (POSIX only)."""
    if not hasattr(os, "O_DIRECTORY"):
        return
    try:
        dir_fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError as exc:
        raise OutputError(f"{path}: written, but syncing its directory failed: {exc}") from exc


def resolve_out(path: Path) -> Path:
    """``path.resolve()`` for an output path the user gave, or an :class:`OutputError` naming it
    when it cannot be resolved: a symlink loop (``Path.resolve`` raises ``RuntimeError`` for it
    on Python 3.10-3.12 and returns the path unresolved on 3.13, so ``os.stat``'s ``ELOOP`` is
    checked too), a path too long."""
    try:
        try:
            os.stat(path)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.ENAMETOOLONG):
                raise
        return path.resolve()
    except (OSError, RuntimeError) as e:
        raise OutputError(f"{path}: cannot resolve the output path ({e}); a symlink loop? "
                          "choose another --out") from e


def open_files_error(needed: int, what: str | os.PathLike[str]) -> OpenFilesLimitError | None:
    """The error to raise when holding ``needed`` more files open at once, on top of those
    this process has open now, exceeds its soft ``RLIMIT_NOFILE``; None when it fits (or the
    platform has no such limit).

    Args:
        needed: the files the read of ``what`` holds open at once.
        what: the checkpoint or dump being read, for the message.
    """
    try:
        import resource  # noqa: PLC0415 - POSIX only

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):
        return None
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        open_now = len(os.listdir("/proc/self/fd")) - 1  # less the listing's own descriptor
    except OSError:
        open_now = 0
    if open_now + needed <= soft:
        return None
    # Room for what is open, the files, and a margin for the writers, in a round number.
    want = 1 << max(open_now + needed + 64, 1).bit_length()
    raise_to = (f"e.g. ulimit -n {want}" if hard == resource.RLIM_INFINITY or want <= hard
                else f"up to its hard limit (ulimit -n {hard}), and have the hard limit raised "
                     f"past {open_now + needed}")
    shown_hard = "unlimited" if hard == resource.RLIM_INFINITY else str(hard)
    return OpenFilesLimitError(
        f"{what}: reading it holds {needed} files open at once, and {open_now} are open "
        f"already, over this process's limit of {soft} open files (RLIMIT_NOFILE; hard limit "
        f"{shown_hard}); raise it in the shell that runs kda-tp, {raise_to}, and run again",
        needed, open_now, soft, hard,
    )


def write_json(
    path: str | os.PathLike[str], document: Any, *, sync: bool = True, mode: int | None = None
) -> None:
    """Write ``document`` as UTF-8 JSON (two-space indent, trailing newline) atomically.

    Uses the same temporary-file, fsync (with ``sync``), mode bits (``mode``) and rename
    sequence as ``kda_tp.checkpoint.writer.write_safetensors``.

    Raises:
        TypeError: ``document`` is not JSON-serialisable (nothing is written).
        OutputError: an OS error while creating, writing, syncing or renaming the file.
    """
    path = Path(path)
    encoded = (json.dumps(document, indent=2) + "\n").encode("utf-8")
    atomic_write(path, lambda f: checked_write(f, path, encoded), sync=sync, mode=mode)
