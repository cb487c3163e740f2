"""kda-tp's marks, and what they let it touch: the check behind every refusal to remove or
replace what kda-tp did not write (:mod:`kda_tp.output.dirs` applies it).

A directory is kda-tp's when it carries the mark :data:`~kda_tp.output.MARK_NAME` (naming
what kda-tp put there) and holds nothing else, or when it is empty; a safetensors file is
kda-tp's when its header's ``__metadata__`` carries :data:`~kda_tp.output.FILE_MARK`. Anything
else (another tool's files, a symbolic link, a plain file) is refused by name, ``--force`` or
not (:func:`refuse`).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import NamedTuple

from .._native import __version__
from ..checkpoint.reader import SafetensorsSource
from ..checkpoint.files import TEMP_FILE, write_json
from ..errors import KdaTpError, OutputError
from .names import (
    ASIDE_DIR,
    FILE_MARK,
    LOCK_FILE,
    MARK_NAME,
    PARTIAL_DIR,
    RANK_DIR,
    WORLD_LOCK,
)

__all__ = [
    "DEMO_STAGING_PREFIX",
    "Mark",
    "NOFOLLOW",
    "file_marked",
    "foreign_dir",
    "foreign_entry",
    "foreign_file",
    "foreign_output",
    "read_mark",
    "read_regular",
    "refuse",
    "refuse_foreign_files",
    "write_mark",
]

#: ``O_NOFOLLOW`` where the platform has it.
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)

#: The staging directory ``demo --keep DIR`` builds in, inside ``DIR``
#: (:func:`kda_tp.output.claim_demo_dir`).
DEMO_STAGING_PREFIX = ".kda-tp-demo-"


class Mark(NamedTuple):
    """A directory's kda-tp mark (:data:`~kda_tp.output.MARK_NAME`), as :func:`read_mark` reads
    it: what kind of directory kda-tp made (``"rank"``, ``"checkpoint"``, ``"demo"``), the
    names of the entries it wrote there, and the SHA-256 (hex) of each entry file that carries
    no mark of its own (a safetensors file kda-tp wrote carries
    :data:`~kda_tp.output.FILE_MARK` in its header instead)."""

    kind: str
    entries: frozenset[str]
    digests: Mapping[str, str]


def write_mark(directory: Path, kind: str, entries: Iterable[str], mode: int | None = None) -> None:
    """Write kda-tp's mark (:data:`~kda_tp.output.MARK_NAME`) into ``directory``: a JSON
    object ``{"written_by": "kda-tp", "version", "kind", "entries", "digests"}``, ``entries``
    sorted, ``digests`` the SHA-256 of each entry that is a regular file now and carries no
    mark of its own (:func:`file_marked`): the mark by which ``--force`` later judges that
    file (``foreign_entry``). Entries not written yet (a partial directory's) get none.

    Args:
        directory: a directory kda-tp made.
        kind: what it is: ``"rank"`` (a shard rank directory), ``"checkpoint"`` (the demo's
            checkpoint) or ``"demo"`` (``demo --keep``).
        entries: the names kda-tp wrote (or is writing) into it (the mark itself not included).
        mode: the file's mode bits (default: ``0o666`` less the umask).

    Raises:
        OutputError: the file cannot be written, or an entry cannot be read for its digest.
    """
    names = sorted(entries)
    digests = {n: d for n in names if (d := _entry_digest(directory / n)) is not None}
    document = {"written_by": "kda-tp", "version": __version__, "kind": kind,
                "entries": names, "digests": digests}
    write_json(directory / MARK_NAME, document, sync=False, mode=mode)


def _entry_digest(path: Path) -> str | None:
    """The SHA-256 a mark records for ``path``: None for a directory, a missing file, or a
    safetensors file carrying kda-tp's own header mark.

    Raises:
        OutputError: the file cannot be read.
    """
    if path.is_symlink() or not path.is_file():
        return None
    if path.name.endswith(".safetensors") and file_marked(path):
        return None
    try:
        return _sha256(path)
    except OSError as e:
        raise OutputError(f"{path}: cannot read it for kda-tp's mark: {e}") from e


def _sha256(path: Path) -> str:
    """The SHA-256 (hex) of a regular file's bytes, read without following a link."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | NOFOLLOW)
    with open(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        digest = hashlib.sha256()
        while block := f.read(1 << 20):
            digest.update(block)
        return digest.hexdigest()


def read_regular(path: Path, limit: int) -> bytes | None:
    """The first ``limit`` bytes of ``path`` when it is a regular file, opened without
    following a link and without blocking (a FIFO or a device is never waited on); None when it
    is anything else or cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | NOFOLLOW)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with open(fd, "rb", closefd=False) as f:
            return f.read(limit)
    except OSError:
        return None
    finally:
        os.close(fd)


def read_mark(directory: Path) -> Mark | None:
    """``directory``'s :class:`Mark`, or None when it has none (or one kda-tp did not write:
    unreadable, not a regular file, not kda-tp's JSON, or naming a path elsewhere)."""
    raw = read_regular(directory / MARK_NAME, 1 << 20)
    if raw is None:
        return None
    try:
        document = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: json's, deep nesting
        return None
    if not isinstance(document, dict) or document.get("written_by") != "kda-tp":
        return None
    kind, entries = document.get("kind"), document.get("entries")
    digests = document.get("digests", {})
    if not isinstance(kind, str) or not isinstance(entries, list) or not isinstance(
            digests, dict):
        return None
    # Names in the directory itself: a mark naming a path elsewhere is not kda-tp's.
    if not all(isinstance(e, str) and e not in ("", ".", "..") and "/" not in e
               and os.sep not in e for e in entries):
        return None
    if not all(isinstance(d, str) for d in digests.values()):
        return None
    return Mark(kind, frozenset(entries), {n: d for n, d in digests.items() if n in entries})


def foreign_dir(path: Path, kind: str, *, complete: bool = True) -> str | None:
    """Why kda-tp must not remove or replace ``path``, or None when it may (it is kda-tp's).

    kda-tp's: an empty directory, or one carrying the mark of ``kind`` and, with
    ``complete``, holding only the entries the mark names, each file judged by its own mark
    (``foreign_entry``: a safetensors file by the kda-tp mark in its header, any other
    file by the SHA-256 the directory's mark recorded when kda-tp wrote it). A partial
    directory (``complete`` False) is its writer's alone (hidden, named by the writer's pid): it
    holds files still being written, or only kda-tp's temporary files when its writer was
    killed while writing the mark.
    """
    if path.is_symlink():
        return "a symbolic link (kda-tp writes directories, never links)"
    if not path.is_dir():
        return "not a directory" if path.exists() else None
    try:
        names = set(os.listdir(path))
    except OSError as e:
        return f"cannot be listed ({e})"
    if not names:
        return None
    mark = read_mark(path)
    if mark is None and not complete and all(TEMP_FILE.match(n) for n in names):
        return None
    if mark is None and MARK_NAME in names:
        return (f"its {MARK_NAME} is not a mark kda-tp wrote (unreadable, or another tool's), "
                "so kda-tp did not write it")
    if mark is None:
        shown = sorted(names)[0]
        return f"it holds {shown} and no {MARK_NAME} (kda-tp's mark), so kda-tp did not write it"
    if mark.kind != kind:
        return f"its {MARK_NAME} marks a kda-tp {mark.kind} directory, not a {kind} directory"
    if not complete:
        return None
    extra = sorted(names - {MARK_NAME} - mark.entries)
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        return f"it holds {extra[0]}{more}, which kda-tp did not write"
    for name in sorted(names - {MARK_NAME}):
        why = foreign_entry(path / name, mark)
        if why is not None:
            return f"its {name}: {why}"
    return None


def foreign_entry(path: Path, mark: Mark) -> str | None:
    """Why ``path``, an entry its directory's ``mark`` names, is not what kda-tp wrote there,
    or None when it is: a directory kda-tp wrote (:func:`foreign_output`), a safetensors file
    carrying :data:`~kda_tp.output.FILE_MARK`, or a file whose SHA-256 is the one ``mark``
    recorded. A file put under the name kda-tp used is judged by itself, never by its name."""
    if path.is_symlink():
        return "a symbolic link (kda-tp writes files and directories, never links)"
    if path.is_dir():
        return foreign_output(path)
    recorded = mark.digests.get(path.name)
    if recorded is None:
        if path.name.endswith(".safetensors"):
            return foreign_file(path)
        return ("kda-tp's mark records no SHA-256 for it, so it cannot tell it from a file "
                "put there since" if path.exists() else None)
    try:
        same = _sha256(path) == recorded
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"cannot be read ({e})"
    return None if same else ("it is not the file kda-tp wrote there (its SHA-256 is not the "
                              "one kda-tp's mark recorded)")


def file_marked(path: Path) -> bool:
    """Whether the safetensors file ``path`` carries :data:`~kda_tp.output.FILE_MARK` in its
    header's ``__metadata__`` (kda-tp wrote it); False for a link or an unreadable file."""
    if path.is_symlink():
        return False
    try:
        files = SafetensorsSource(path).files()
    except (KdaTpError, OSError):
        return False
    return bool(files) and FILE_MARK in (files[0][1] or {})


def foreign_file(path: Path) -> str | None:
    """Why kda-tp must not remove or replace the safetensors file ``path``, or None when its
    header's ``__metadata__`` carries :data:`~kda_tp.output.FILE_MARK` (kda-tp wrote it)."""
    if path.is_symlink():
        return "a symbolic link (kda-tp writes files, never links)"
    if file_marked(path):
        return None
    return (f"its header carries no {FILE_MARK}, so kda-tp did not write it (an engine's own "
            "dump?)")


def refuse_foreign_files(paths: Iterable[Path]) -> None:
    """Refuse to go on when one of ``paths`` (safetensors files a ``--force`` run would
    replace or remove) was not written by kda-tp (:func:`foreign_file`).

    Raises:
        OutputError: naming the first such file and why; nothing is changed.
    """
    for path in paths:
        why = foreign_file(path)
        if why is not None:
            raise refuse(path, why, "replaces")

#: What to do about a refused entry, by what kda-tp would have done with it.
_FIXES = {
    "replaces": "kda-tp replaces only what it wrote, even with --force: move it away, or "
                "choose another output directory",
    "removes": "kda-tp removes only what it wrote, even with --force: move it away, or choose "
               "another output directory",
    "writes": "kda-tp never writes to a file it did not create: remove it, or choose another "
              "--out",
    "demo": "demo --keep takes a new or empty directory, or one an earlier demo made, and "
            "replaces only what kda-tp wrote: move it away, or choose another --keep DIR",
}


def refuse(path: Path, why: str, what: str) -> OutputError:
    """The refusal to touch ``path``, saying why and what to do (``_FIXES``)."""
    return OutputError(f"{path}: {why}; {_FIXES[what]}")


def foreign_output(path: Path) -> str | None:
    """Why ``path`` (an entry of a ``demo --keep`` directory that the demo does not replace)
    is not an output kda-tp wrote, or None when it is: a ``shard`` output (rank directories
    carrying kda-tp's rank mark, their locks and partial directories), a rank directory, a
    ``dump`` (safetensors files carrying :data:`~kda_tp.output.FILE_MARK`, and the JSON files
    beside them), a demo staging directory, or an empty directory."""
    if path.is_symlink():
        return "a symbolic link (kda-tp writes directories, never links)"
    if path.name.startswith(DEMO_STAGING_PREFIX) and path.is_dir():
        return None
    if path.is_file():
        return foreign_file(path) if path.name.endswith(".safetensors") else (
            "a file kda-tp did not write")
    if not path.is_dir():
        return "not a directory"
    mark = read_mark(path)
    if mark is not None:
        return foreign_dir(path, mark.kind)
    try:
        names = sorted(os.listdir(path))
    except OSError as e:
        return f"cannot be listed ({e})"
    for name in names:
        entry = path / name
        if (RANK_DIR.match(name) or ASIDE_DIR.match(name)) and not entry.is_symlink() \
                and entry.is_dir():
            why = foreign_dir(entry, "rank")
        elif PARTIAL_DIR.match(name):
            why = foreign_dir(entry, "rank", complete=False)
        elif (LOCK_FILE.match(name) or WORLD_LOCK.match(name)) and not entry.is_symlink() \
                and entry.is_file():
            why = None
        elif name.endswith(".safetensors"):
            why = foreign_file(entry)
        elif name.endswith(".json") and not entry.is_symlink() and entry.is_file() and any(
                n.endswith(".safetensors") for n in names):
            why = None  # a dump's manifest or config beside its marked files
        else:
            why = "it was not written by kda-tp"
        if why is not None:
            return f"{name}: {why}"
    return None
