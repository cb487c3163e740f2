"""Output-directory safety: what kda-tp may create, lock, replace and remove where it writes.

The rules, for ``shard``, ``dump`` and ``demo --keep`` alike:

* **Never touch what kda-tp did not write.** A directory is kda-tp's when it carries the mark
  :data:`~kda_tp.output.MARK_NAME` (written into every directory kda-tp makes, naming what it
  put there) and holds nothing else, or when it is empty; a safetensors file is kda-tp's when
  its header's ``__metadata__`` carries :data:`~kda_tp.output.FILE_MARK`. Anything else in
  the way (another tool's ``rank{N}/`` optimizer states, an engine's own dump, a symbolic
  link, a plain file) is refused by name, ``--force`` or not.
* **Build first, then replace.** A run writes its output under hidden names and moves it into
  place only once all of it is complete; what it replaces is removed only then, so a refused
  or failed run leaves the previous output as it was.
* **Locks are kda-tp's own files.** ``OUT/.rank{r}.lock`` is opened without following a
  symbolic link (``O_NOFOLLOW``, and ``O_CLOEXEC``), refused unless a regular file with one
  link, and written only when empty or holding a kda-tp holder line; the lock is the ``flock``
  on it (see :func:`kda_tp.shard.shard_checkpoint`).
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
import socket
import stat
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

from ..checkpoint.reader import SafetensorsSource
from ..checkpoint.writer import resolve_out
from ..errors import KdaTpError, OutputError
from ..model.json_reader import parse_metadata_int
from .marks import (
    DEMO_STAGING_PREFIX,
    NOFOLLOW,
    foreign_dir,
    foreign_output,
    read_mark,
    refuse,
    write_mark,
)
from .names import LOCK_FILE, MARK_NAME, PARTIAL_DIR, RANK_DIR, rank_dir

# What kda-tp wrote (its marks) and the refusals of anything else: kda_tp.output.marks.

__all__ = [
    "RankLocks",
    "check_out_dir",
    "check_out_location",
    "DEMO_MAX_LAYERS",
    "claim_demo_dir",
    "discard",
    "input_mode",
    "lock_ranks",
    "make_dirs",
    "prepare_out_dir",
    "remove_created",
    "remove_dir",
    "replace_demo_dir",
    "replace_files",
    "staged_name",
]

#: Bytes of a lock file's holder line read back (for a refusal message, and to recognise it).
_HOLDER_BYTES = 512
#: The line a writer records in its lock file (see ``_lock_rank``).
_HOLDER_LINE = re.compile(rb"pid [0-9]+ on [^\n]*, started [0-9TZ:-]+\n")


def staged_name(final: Path) -> Path:
    """The hidden name beside ``final`` under which a run writes the file before
    :func:`replace_files` moves it into place (``.<name>.kda-tp-new-<pid>``)."""
    return final.with_name(f".{final.name}.kda-tp-new-{os.getpid()}")


def input_mode(checkpoint: Path) -> int:
    """The mode bits an output made from ``checkpoint`` keeps: a ``.safetensors`` file's own,
    or, for a directory, those all its ``.safetensors`` files share (``0o644`` and ``0o600``
    give ``0o600``: an output never more open than any input file).

    Raises:
        OutputError: the checkpoint cannot be looked at.
    """
    try:
        files = [checkpoint] if not checkpoint.is_dir() else [
            p for p in checkpoint.glob("*.safetensors") if not p.name.startswith(".")]
        mode = 0o777
        for path in files:
            mode &= path.stat().st_mode
    except OSError as e:
        raise OutputError(f"{checkpoint}: cannot read the input's mode bits: {e}") from e
    return mode & 0o777 if files else 0o644


def replace_files(staged: Mapping[Path, Path], stale: Iterable[Path]) -> None:
    """Move each complete file of ``staged`` (final path -> hidden staged path, all in one
    directory) onto its final path, then remove the ``stale`` files not replaced so.

    Each file is renamed in one step (a reader sees the old file or the new one); the caller
    has checked ``stale`` with :func:`kda_tp.output.foreign_file`.

    Raises:
        OutputError: a rename or removal fails (the message names the file).
    """
    for final, path in staged.items():
        try:
            os.replace(path, final)
        except OSError as e:
            raise OutputError(f"{final}: cannot move the new file into place: {e}") from e
    for path in stale:
        if path in staged:
            continue
        try:
            path.unlink(missing_ok=True)
        except OSError as e:
            raise OutputError(f"{path}: cannot remove it (--force): {e}") from e


#: The most decoder layers ``demo --num-layers`` generates: the demo stays small (a Kimi-Linear
#: layer is about 80 MB, a GLM-5.3-Flash layer about 280 MB, a Kimi K3 layer up to 0.9 GB).
DEMO_MAX_LAYERS = 64


def claim_demo_dir(path: Path, entries: Iterable[str]) -> None:
    """Check that ``demo --keep`` may write ``entries`` (``checkpoint``, ``tp{N}``) into
    ``path``, and create ``path`` if missing. Nothing already in ``path`` is changed: the demo
    builds in a staging directory inside it (named :data:`DEMO_STAGING_PREFIX`...) and
    :func:`replace_demo_dir` moves the entries into place once built, so a refused or failed
    demo leaves the earlier one as it was.

    ``path`` may be missing, empty, or an earlier demo's (carrying its mark); the entries an
    earlier demo wrote and the new ``entries`` must be kda-tp's (``checkpoint/`` with its
    ``checkpoint`` mark, ``tp{N}/`` a ``shard`` output of marked rank directories), and
    anything else in it must be an output kda-tp wrote (``shard`` outputs, dumps: left in
    place).

    Raises:
        OutputError: ``path`` or something in it is not kda-tp's (the user's files, another
            tool's, a link, a file), naming what is in the way; nothing is changed.
    """
    _check_demo_dir(path, set(entries))
    make_dirs(path)


def _check_demo_dir(path: Path, entries: set[str]) -> None:
    """Refuse (OutputError) a ``demo --keep`` directory holding what kda-tp did not write
    (:func:`claim_demo_dir`)."""
    if path.is_symlink() or not path.is_dir():
        why = foreign_dir(path, "demo")
        if why is not None:
            raise refuse(path, why, "demo")
        return
    try:
        # A demo's staging directory (this one's, or a killed one's) is its own.
        names = sorted(n for n in os.listdir(path) if not n.startswith(DEMO_STAGING_PREFIX))
    except OSError as e:
        raise refuse(path, f"cannot be listed ({e})", "demo") from e
    if not names:
        return
    mark = read_mark(path)
    if mark is None or mark[0] != "demo":
        raise refuse(path, foreign_dir(path, "demo") or "no demo mark", "demo")
    replaced = mark[1] | entries
    for name in names:
        entry = path / name
        if name == MARK_NAME:
            continue
        if name not in replaced:
            why = foreign_output(entry)
        elif name == "checkpoint":
            why = foreign_dir(entry, "checkpoint")
        else:
            why = foreign_output(entry)
        if why is not None:
            raise refuse(entry, why, "demo")


def replace_demo_dir(path: Path, staging: Path, entries: Iterable[str]) -> None:
    """Move the ``entries`` built in ``staging`` (:func:`claim_demo_dir`) into ``path``,
    replacing an earlier demo's, and mark ``checkpoint/`` and ``path`` as kda-tp's. ``path`` is checked again first, so files put there meanwhile are kept.

    Raises:
        OutputError: something in ``path`` is not kda-tp's, or a move fails.
    """
    names = list(entries)
    _check_demo_dir(path, set(names))
    checkpoint = staging / "checkpoint"
    write_mark(checkpoint, "checkpoint", os.listdir(checkpoint))
    mark = read_mark(path)
    for name in set() if mark is None else mark[1]:
        discard(path / name)
    for name in names:
        discard(path / name)
        try:
            os.replace(staging / name, path / name)
        except OSError as e:
            raise OutputError(f"{path / name}: cannot move the new output into place: {e}") from e
    write_mark(path, "demo", names)


def prepare_out_dir(
    root: Path,
    out: Path,
    tp_size: int,
    ranks: tuple[int, ...],
    force: bool,
    *,
    wait: bool = False,
) -> list[Path]:
    """Create the output directory ``out`` for ``ranks`` of ``tp_size`` (sharding the
    checkpoint at ``root``), or check what it already holds; remove stale partial directories of
    ``ranks``. ``force`` allows replacing finished rank directories kda-tp wrote.

    The ranks' locks (``OUT/.rank{r}.lock``, see :func:`kda_tp.shard.shard_checkpoint`) are
    held while ``out`` is checked and cleaned, and released on return; a partial directory is
    removed only while its rank's lock is held, so only a dead writer's.

    Args:
        root: the input checkpoint's directory.
        out: the output directory.
        tp_size: the world size.
        ranks: the ranks to be written.
        force: allow replacing finished rank directories and other files in ``out``.
        wait: wait for another writer's lock on one of ``ranks`` instead of refusing.

    Returns:
        The directories this call created (``out`` and missing parents), deepest first; empty
        when ``out`` existed. On an error they are removed again.

    Raises:
        OutputError: ``out`` lies inside the input, holds another world size's or unfinished
            output that ``force`` does not allow replacing, holds something in a rank's way
            that kda-tp did not write (:func:`foreign_dir`), cannot be created or listed, a
            lock file is not kda-tp's (a symbolic link, not a regular file), or another live
            process holds the lock of one of ``ranks`` (without ``wait``).
    """
    check_out_location(root, out, ranks)
    created = make_dirs(out)
    try:
        locks = lock_ranks(out, ranks, wait)
        try:
            for entry in check_out_dir(root, out, tp_size, ranks, force, locks):
                remove_dir(entry, out)
        finally:
            locks.release()
    except BaseException:
        remove_created(created)
        raise
    return created


def check_out_location(root: Path, out: Path, ranks: tuple[int, ...]) -> None:
    """Refuse an ``out`` inside the input, or one whose rank directories hold the input.

    Raises:
        OutputError: either, naming the path.
    """
    resolved, input_root = resolve_out(out), root.resolve()
    if resolved == input_root or input_root in resolved.parents:
        raise OutputError(f"{out}: the output directory lies inside the input checkpoint {root}")
    for r in ranks:
        # e.g. re-sharding OUT/rank0 into OUT: --force would delete the input.
        final_dir = resolve_out(rank_dir(out, r))
        if final_dir == input_root or final_dir in input_root.parents:
            raise OutputError(
                f"{rank_dir(out, r)}: this rank's output directory is (or holds) the input "
                f"checkpoint {root}; choose another --out"
            )


def make_dirs(out: Path) -> list[Path]:
    """``out.mkdir(parents=True)``, returning the directories created, deepest first (a
    directory another process creates meanwhile is not counted).

    Raises:
        OutputError: a path on the way is not a directory, or cannot be created.
    """
    missing = []
    for path in (out, *out.parents):
        if path.is_dir():
            break
        missing.append(path)
    created: list[Path] = []
    for path in reversed(missing):
        try:
            path.mkdir()
        except FileExistsError:
            if path.is_dir():
                continue
            remove_created(created[::-1])
            raise OutputError(
                f"{out}: cannot create the output directory: {path} exists and is not a directory"
            ) from None
        except OSError as e:
            remove_created(created[::-1])
            raise OutputError(f"{out}: cannot create the output directory: {e}") from e
        created.append(path)
    return created[::-1]


def remove_created(created: list[Path]) -> None:
    """Remove the directories a run created (deepest first) where they are empty again; one
    that is not (another process wrote into it) stays, and so do its parents."""
    for path in created:
        try:
            path.rmdir()
        except OSError:
            return


class RankLocks:
    """The lock files (path, descriptor) a writer holds, one per rank, each under ``flock``."""

    def __init__(self) -> None:
        self.held: dict[int, tuple[Path, int]] = {}

    def add(self, out: Path, rank: int) -> None:
        """Lock rank ``rank`` too, without waiting (see :func:`lock_ranks`)."""
        if rank not in self.held:
            self.held[rank] = _lock_rank(out, rank, wait=False)

    def release(self) -> None:
        """Remove each lock file (when it is still this writer's file) while still holding its
        lock, then unlock it (by closing). A process that opened the file before it was removed
        and then gets the lock sees that its file is no longer at that path, and locks the new
        one (``_lock_rank``)."""
        for path, fd in self.held.values():
            try:
                if _same_file(path, fd):
                    path.unlink()
            except OSError:
                pass  # e.g. the directory became read-only: the lock is released all the same
            os.close(fd)
        self.held.clear()


def lock_ranks(out: Path, ranks: Iterable[int], wait: bool) -> RankLocks:
    """Lock ``OUT/.rank{r}.lock`` for each rank, in rank order (so that waiting writers never
    deadlock); on any failure the locks taken so far are released.

    Raises:
        OutputError: as ``_lock_rank``.
    """
    locks = RankLocks()
    try:
        for r in sorted(ranks):
            locks.held[r] = _lock_rank(out, r, wait)
    except BaseException:
        locks.release()
        raise
    return locks


def _same_file(path: Path, fd: int) -> bool:
    """Whether ``path`` (not followed if a link) is the file open as ``fd``."""
    try:
        current = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (current.st_dev, current.st_ino) == (mine.st_dev, mine.st_ino)


def _lock_rank(out: Path, rank: int, wait: bool) -> tuple[Path, int]:
    """Take the exclusive ``flock`` of rank ``rank``'s lock file, then record this process
    (pid, host, start time, UTC) in it for the message of a writer it refuses.

    The file is opened without following a link (``O_NOFOLLOW``) and used only when it is a
    regular file with one link that is empty or holds a holder line: a file kda-tp did not
    write is never written to.

    Raises:
        OutputError: another process holds the lock (without ``wait``); the lock path is a
            symbolic link, not a regular file, a file with other links, or a file holding
            something else than a holder line; the lock file cannot be created or locked.
    """
    path = out / f".rank{rank}.lock"
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NONBLOCK | NOFOLLOW,
                         0o644)
        except OSError as e:
            if e.errno == errno.ELOOP or path.is_symlink():
                raise refuse(path, f"a symbolic link where rank {rank}'s lock file goes "
                              "(kda-tp's lock files are regular files it creates)",
                              "writes") from None
            raise OutputError(f"{path}: cannot create the lock file of rank {rank}: {e}") from e
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
                what = ("not a regular file" if not stat.S_ISREG(info.st_mode)
                        else f"a file with {info.st_nlink} hard links")
                raise refuse(path, f"{what} where rank {rank}'s lock file goes", "writes")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                raise OutputError(
                    f"{out}: rank {rank} is being written by another kda-tp shard "
                    f"({_holder(fd)}; lock file {path.name}); pass --wait (wait=True) to wait "
                    "for it, or choose another --out"
                ) from None
            except OSError as e:
                raise OutputError(f"{path}: cannot lock rank {rank}'s lock file: {e}") from e
            if _same_file(path, fd):
                held = os.pread(fd, _HOLDER_BYTES, 0)
                if held and not _HOLDER_LINE.fullmatch(held):
                    raise refuse(path, "holds something else than a kda-tp lock's holder line",
                                  "writes")
                started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
                line = f"pid {os.getpid()} on {socket.gethostname()}, started {started}\n"
                os.pwrite(fd, line.encode(), 0)
                os.ftruncate(fd, len(line.encode()))  # a longer holder line of its own before
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


def check_out_dir(
    root: Path,
    out: Path,
    tp_size: int,
    ranks: tuple[int, ...],
    force: bool,
    locks: RankLocks,
) -> list[Path]:
    """:func:`prepare_out_dir`'s check and clean-up of ``out``, with ``ranks`` locked in
    ``locks`` (and any other rank whose directory ``force`` removes added to them).

    Returns:
        The rank directories of another world size that ``force`` replaces (checked to be
        kda-tp's, their ranks locked): the caller removes them (:func:`remove_dir`) once its
        own output is complete.

    Raises:
        OutputError: as :func:`prepare_out_dir`.
    """
    input_root = root.resolve()
    try:
        entries = sorted(out.iterdir())
    except OSError as e:
        raise OutputError(f"{out}: cannot list the output directory: {e}") from e
    existing: list[Path] = []
    stale: list[Path] = []
    for entry in entries:
        if LOCK_FILE.match(entry.name):
            continue  # a writer's lock (ours, or another rank's writer)
        partial, final = PARTIAL_DIR.match(entry.name), RANK_DIR.match(entry.name)
        if (partial or final) and (resolve_out(entry) == input_root or _holds(entry, input_root)):
            # Never remove or replace the input, whatever its name.
            raise OutputError(
                f"{entry} is (or holds) the input checkpoint {root}; choose another --out"
            )
        if partial and int(partial.group(1)) in ranks:
            why = foreign_dir(entry, "rank", complete=False)
            if why is not None:
                raise refuse(entry, why, "removes")
            discard(entry)  # left by a killed run
        elif final and int(final.group(1)) in ranks:
            why = foreign_dir(entry, "rank")
            if why is not None:
                raise refuse(entry, why, "replaces")
            if force:
                continue  # replaced once this run's rank is complete
            found = _rank_tp_size(entry)
            if found is not None and found != tp_size:
                raise OutputError(
                    f"{entry} holds output for tp_size {found}, not {tp_size}; "
                    "pass --force to replace it (or choose another --out)"
                )
            existing.append(entry)
        elif final:
            # Another run's rank: it must belong to the same world size.
            found = _rank_tp_size(entry)
            if found != tp_size:
                if not force:
                    raise OutputError(
                        f"{entry} holds output for tp_size {found or 'unknown'}, not {tp_size}; "
                        "pass --force to replace it"
                    )
                why = foreign_dir(entry, "rank")
                if why is not None:
                    raise refuse(entry, why, "removes")
                # Another rank: removed only while no live writer holds it (never waiting
                # here: the ranks' locks are taken in order, and this one is out of order).
                locks.add(out, int(final.group(1)))
                stale.append(entry)
        elif not partial and not force:
            raise OutputError(
                f"{out} is not empty (it holds {entry.name}); pass --force to write into it"
            )
    if existing:
        present = {int(m.group(1)) for p in entries if (m := RANK_DIR.match(p.name))}
        missing = [r for r in range(tp_size) if r not in present]
        finish = (
            f", or --ranks {','.join(map(str, missing))} to write only the missing ranks"
            if missing
            else ""
        )
        others = "".join(f" and {e}" for e in existing[1:])
        raise OutputError(
            f"{existing[0]} already exists; pass --force to overwrite it{others}{finish}"
        )
    return stale


def _holds(directory: Path, path: Path) -> bool:
    """Whether resolved ``path`` lies inside ``directory``."""
    return resolve_out(directory) in path.parents


def _rank_tp_size(path: Path) -> int | None:
    """The ``tp_size`` recorded in a rank directory's first file, or None if unreadable."""
    try:
        files = SafetensorsSource(path).files()
        return (parse_metadata_int((files[0][1] or {})["tp_size"], "tp_size", str(path))
                if files else None)
    except (KdaTpError, KeyError, ValueError, OSError):
        return None


def remove_dir(path: Path, out: Path) -> None:
    """Remove a directory after moving it aside in one rename, so it never lingers half-deleted
    under its own name (the aside name is a partial name, cleaned by a later run)."""
    aside = out / f".{path.name}.partial-removed-{os.getpid()}"
    os.replace(path, aside)
    discard(aside)


def discard(path: Path) -> None:
    """Remove a directory kda-tp wrote, or, when it is a symbolic link or a plain file, the
    link or file alone: what a link points to is never touched."""
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)
