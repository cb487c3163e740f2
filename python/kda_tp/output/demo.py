"""``demo --keep DIR``: the directory the demo keeps its checkpoint and ranks in, claimed
before anything is generated and swapped in once they are built (:mod:`kda_tp.output.dirs`'s
rules: nothing kda-tp did not write is touched, each path judged at the moment it is moved).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

from ..checkpoint.files import MISSING
from ..errors import OutputError
from .dirs import make_dirs
from .locks import output_error
from .marks import (
    DEMO_STAGING_PREFIX,
    foreign_dir,
    foreign_output,
    read_mark,
    refuse,
    write_mark,
)
from .moves import discard_ours, keep_foreign, put_aside, take_name
from .names import MARK_NAME

__all__ = ["DEMO_MAX_LAYERS", "claim_demo_dir", "demo_staging", "replace_demo_dir"]

#: The most decoder layers ``demo --num-layers`` generates: the demo stays small (a Kimi-Linear
#: layer is about 80 MB, a GLM-5.3-Flash layer about 280 MB, a Kimi K3 layer up to 0.9 GB).
DEMO_MAX_LAYERS = 64


def claim_demo_dir(path: Path, entries: Iterable[str]) -> list[Path]:
    """Check that ``demo --keep`` may write ``entries`` (``checkpoint``, ``tp{N}``) into
    ``path``, and create ``path`` if missing (``path`` alone: its parent must exist). Nothing
    already in ``path`` is changed: the demo builds in a staging directory inside it (named
    ``DEMO_STAGING_PREFIX``...) and ``replace_demo_dir`` moves the entries into place
    once built, so a refused or failed demo leaves the earlier one as it was.

    ``path`` may be missing, empty, or an earlier demo's (carrying its mark). The demo replaces
    only what its mark names: the entries an earlier demo wrote (``checkpoint/`` with its
    ``checkpoint`` mark, ``tp{N}/`` a ``shard`` output of marked rank directories), each judged
    as kda-tp's; a new entry must be free (a ``tp{N}`` the user sharded into the directory is
    the user's, not the demo's, even when kda-tp wrote it); anything else in it must be an
    output kda-tp wrote (``shard`` outputs, dumps: left in place).

    Returns:
        The directories this call created (``[path]`` or none): a demo that fails later
        removes it where empty (``kda_tp.output.dirs.remove_created``).

    Raises:
        OutputError: ``path`` or something in it is not kda-tp's (the user's files, another
            tool's, a link, a file), or an entry of ``entries`` is there and the demo's mark
            does not name it, naming what is in the way; ``path``'s parent is missing, or
            ``path`` cannot be created; nothing is changed.
    """
    _check_demo_dir(path, set(entries))
    if not path.is_dir() and not path.parent.is_dir():
        raise OutputError(f"{path.parent}: {MISSING}; demo --keep creates only "
                          f"the last directory of {path}: create {path.parent} first, or choose "
                          "another --keep DIR")
    return make_dirs(path)


def demo_staging(keep: Path | None) -> tempfile.TemporaryDirectory[str]:
    """The directory the demo builds in, removed with what is in it when the demo is done:
    inside ``keep`` (``--keep DIR``, claimed first: :func:`claim_demo_dir`) as
    ``DEMO_STAGING_PREFIX``..., else a new temporary directory.

    Raises:
        OutputError: it cannot be created (a read-only file system, a directory this user may
            not write into), naming the directory and the OS error.
    """
    prefix = DEMO_STAGING_PREFIX if keep is not None else "kda-tp-demo-"
    try:
        return tempfile.TemporaryDirectory(prefix=prefix, dir=keep)
    except OSError as e:
        where = Path(keep) if keep is not None else Path(tempfile.gettempdir())
        raise output_error(where, "create the demo's working directory in it", e) from e


def _judge(entry: Path, replaced: bool) -> str | None:
    """Why an entry of a demo directory is not kda-tp's: the demo's ``checkpoint/`` by its
    mark, anything else as an output kda-tp wrote."""
    if replaced and entry.name == "checkpoint":
        return foreign_dir(entry, "checkpoint")
    return foreign_output(entry)


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
    if mark is None or mark.kind != "demo":
        raise refuse(path, foreign_dir(path, "demo") or "no demo mark", "demo")
    for name in names:
        if name == MARK_NAME:
            continue
        if name in entries and name not in mark.entries:
            # Not the demo's (its mark does not name it): the user's, kda-tp's output or not.
            raise refuse(path / name, f"the demo would write {name} here, and the demo's "
                                      f"{MARK_NAME} does not name it (an earlier demo did not "
                                      "write it), so it is not the demo's to replace", "demo")
        why = _judge(path / name, name in mark.entries)
        if why is not None:
            raise refuse(path / name, why, "demo")


def replace_demo_dir(path: Path, staging: Path, entries: Iterable[str]) -> list[Path]:
    """Move the ``entries`` built in ``staging`` (:func:`claim_demo_dir`) into ``path``,
    replacing an earlier demo's, and mark ``checkpoint/`` and ``path`` as kda-tp's. ``path``
    is checked again first, and each entry replaced is judged again as it is moved aside: what
    was put into one meanwhile is never removed.

    Returns:
        Where entries holding what kda-tp did not write were kept (put back, or beside their
        name: :func:`~kda_tp.output.moves.keep_foreign`); empty when there were none.

    Raises:
        OutputError: something in ``path`` is not kda-tp's, or a move fails.
    """
    names = list(entries)
    _check_demo_dir(path, set(names))
    checkpoint = staging / "checkpoint"
    write_mark(checkpoint, "checkpoint", os.listdir(checkpoint))
    mark = read_mark(path)
    old = [n for n in dict.fromkeys([*(() if mark is None else sorted(mark.entries)), *names])
           if os.path.lexists(path / n)]
    asides: dict[Path, Path] = {}
    placed: list[str] = []
    try:
        for name in old:
            aside = staging / f".{name}.replaced"
            put_aside(path / name, aside, lambda p: _judge(p, True), "demo")
            asides[path / name] = aside
        for name in names:
            try:
                take_name(staging / name, path / name)
            except OSError as e:
                raise output_error(path / name, "move the new output into place", e) from e
            placed.append(name)
    except BaseException:
        # The staging directory is removed on the way out: what was moved aside goes back.
        for name in placed:
            try:
                take_name(path / name, staging / name)
            except OSError:
                continue
        for home, aside in asides.items():
            keep_foreign(aside, home)
        raise
    write_mark(path, "demo", names)
    kept = []
    for home, aside in asides.items():
        if discard_ours(aside):
            kept.append(keep_foreign(aside, home))
    return kept
