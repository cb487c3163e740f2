"""kda-tp's marks, and what they let it touch: the check behind every refusal to remove or
replace what kda-tp did not write (:mod:`kda_tp.output.dirs` applies it).

A directory is kda-tp's when it carries the mark :data:`~kda_tp.output.MARK_NAME` (naming
what kda-tp put there) and holds nothing else, or when it is empty; a safetensors file is
kda-tp's when its header's ``__metadata__`` carries :data:`~kda_tp.output.FILE_MARK`. Anything
else (another tool's files, a symbolic link, a plain file) is refused by name, ``--force`` or
not (:func:`refuse`).
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterable
from pathlib import Path

from .._native import __version__
from ..checkpoint.reader import SafetensorsSource
from ..checkpoint.writer import TEMP_FILE, write_json
from ..errors import KdaTpError, OutputError
from .names import FILE_MARK, LOCK_FILE, MARK_NAME, PARTIAL_DIR, RANK_DIR

__all__ = [
    "DEMO_STAGING_PREFIX",
    "NOFOLLOW",
    "foreign_dir",
    "foreign_file",
    "foreign_output",
    "read_mark",
    "refuse",
    "refuse_foreign_files",
    "write_mark",
]

#: ``O_NOFOLLOW`` where the platform has it.
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)

#: The staging directory ``demo --keep DIR`` builds in, inside ``DIR``
#: (:func:`kda_tp.output.claim_demo_dir`).
DEMO_STAGING_PREFIX = ".kda-tp-demo-"


def write_mark(directory: Path, kind: str, entries: Iterable[str], mode: int | None = None) -> None:
    """Write kda-tp's mark (:data:`~kda_tp.output.MARK_NAME`) into ``directory``: a JSON
    object ``{"written_by": "kda-tp", "version", "kind", "entries"}``, ``entries`` sorted.

    Args:
        directory: a directory kda-tp made.
        kind: what it is: ``"rank"`` (a shard rank directory) or ``"demo"`` (``demo --keep``).
        entries: the names kda-tp wrote into it (the mark itself not included).
        mode: the file's mode bits (default: ``0o666`` less the umask).

    Raises:
        OutputError: the file cannot be written.
    """
    document = {"written_by": "kda-tp", "version": __version__, "kind": kind,
                "entries": sorted(entries)}
    write_json(directory / MARK_NAME, document, sync=False, mode=mode)


def read_mark(directory: Path) -> tuple[str, set[str]] | None:
    """The kind and the entries of ``directory``'s mark, or None when it has none (or one
    kda-tp did not write)."""
    path = directory / MARK_NAME
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | NOFOLLOW)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with open(fd, "rb", closefd=False) as f:
            document = json.loads(f.read(1 << 20))
    except (OSError, ValueError, RecursionError):  # RecursionError: json's, deep nesting
        return None
    finally:
        os.close(fd)
    if not isinstance(document, dict) or document.get("written_by") != "kda-tp":
        return None
    kind, entries = document.get("kind"), document.get("entries")
    if not isinstance(kind, str) or not isinstance(entries, list):
        return None
    # Names in the directory itself: a mark naming a path elsewhere is not kda-tp's.
    if not all(isinstance(e, str) and e not in ("", ".", "..") and "/" not in e
               and os.sep not in e for e in entries):
        return None
    return kind, set(entries)


def foreign_dir(path: Path, kind: str, *, complete: bool = True) -> str | None:
    """Why kda-tp must not remove or replace ``path``, or None when it may (it is kda-tp's).

    kda-tp's: an empty directory, or one carrying the mark of ``kind`` and, with
    ``complete``, holding only the entries the mark names (a partial directory, ``complete``
    False, holds files still being written, or only kda-tp's temporary files when its writer
    was killed while writing the mark).
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
    if mark is None:
        shown = sorted(names)[0]
        return f"it holds {shown} and no {MARK_NAME} (kda-tp's mark), so kda-tp did not write it"
    if mark[0] != kind:
        return f"its {MARK_NAME} marks a kda-tp {mark[0]} directory, not a {kind} directory"
    extra = sorted(names - {MARK_NAME} - mark[1])
    if complete and extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        return f"it holds {extra[0]}{more}, which kda-tp did not write"
    return None


def foreign_file(path: Path) -> str | None:
    """Why kda-tp must not remove or replace the safetensors file ``path``, or None when its
    header's ``__metadata__`` carries :data:`~kda_tp.output.FILE_MARK` (kda-tp wrote it)."""
    if path.is_symlink():
        return "a symbolic link (kda-tp writes files, never links)"
    try:
        files = SafetensorsSource(path).files()
        meta = (files[0][1] or {}) if files else {}
    except (KdaTpError, OSError):
        meta = {}
    if FILE_MARK in meta:
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
        return foreign_dir(path, mark[0])
    try:
        names = sorted(os.listdir(path))
    except OSError as e:
        return f"cannot be listed ({e})"
    for name in names:
        entry = path / name
        if RANK_DIR.match(name) and not entry.is_symlink() and entry.is_dir():
            why = foreign_dir(entry, "rank")
        elif PARTIAL_DIR.match(name):
            why = foreign_dir(entry, "rank", complete=False)
        elif LOCK_FILE.match(name) and not entry.is_symlink() and entry.is_file():
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
