"""Putting a ``shard`` run's ranks in place, and taking them back: the commit of
:func:`~kda_tp.shard.shard_checkpoint` once every rank is written (another world size's ranks
and the directories it replaced removed, each judged again at that moment), and the undo of a
failed run (the ranks it placed taken back, the directories they replaced put back).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import OutputError
from ..output.marks import foreign_dir
from ..output.moves import discard_ours, keep_foreign, put_aside, take_name

__all__ = ["Placed", "appeared", "commit", "drop_replaced", "partial_dir", "undo"]


@dataclass(frozen=True)
class Placed:
    """One rank a ``shard`` run put in place: its directory, that directory's inode (to
    recognise it), where the directory it replaced was moved aside (None if there was none),
    and the tensor bytes written."""

    rank: int
    final: Path
    inode: int
    old: Path | None
    nbytes: int


def commit(out: Path, placed: list[Placed], stale: list[Path]) -> list[Path]:
    """Once every rank of this run is in place: remove the rank directories of another world
    size that ``force`` replaces (``stale``) and the rank directories this run replaced, each
    judged again now. A stale directory that is no longer kda-tp's (something was put into it
    during the run) undoes the whole run and is refused; what appears in a directory after it
    was moved aside is kept (:func:`~kda_tp.output.moves.keep_foreign`).

    Returns:
        Where such files were kept.

    Raises:
        OutputError: a stale directory is not kda-tp's now (nothing of this run is left, and
            the previous output is as it was).
    """
    asides: list[tuple[Path, Path]] = []
    try:
        for entry in stale:
            aside = entry.with_name(f".{entry.name}.replaced-{os.getpid()}")
            put_aside(entry, aside, lambda p: foreign_dir(p, "rank"), "removes")
            asides.append((entry, aside))
    except BaseException:
        for entry, aside in asides:
            keep_foreign(aside, entry)
        undo(out, placed)
        raise
    kept = [keep_foreign(aside, entry) for entry, aside in asides if discard_ours(aside)]
    for p in placed:
        kept += drop_replaced(p)
    return kept


def drop_replaced(placed: Placed) -> list[Path]:
    """Remove the rank directory ``placed`` replaced (moved aside), keeping what was put into
    it meanwhile; returns where that was kept."""
    if placed.old is None or not discard_ours(placed.old):
        return []
    return [keep_foreign(placed.old, placed.final)]


def undo(out: Path, placed: list[Placed]) -> None:
    """Take back the ranks this run put in place (only directories it created, same inode; each
    moved aside in one rename first, so no incomplete ``rank{r}`` is ever visible) and put back
    the rank directories they replaced. Best effort: a step that fails is skipped."""
    for p in placed:
        try:
            if p.final.stat().st_ino != p.inode:
                continue
            aside = out / f".rank{p.rank}.replaced-{os.getpid()}-new"
            take_name(p.final, aside)
            if p.old is not None:
                take_name(p.old, p.final)
            if discard_ours(aside):
                keep_foreign(aside, p.final)
        except OSError:
            continue


def partial_dir(out: Path, rank: int, run: str) -> Path:
    """The partial directory the run ``run`` (:func:`~kda_tp.output.names.run_id`) writes rank
    ``rank`` into: named per run, never by process id alone (two containers sharing a volume
    both run their writer as pid 1)."""
    return out / f".rank{rank}.partial-{run}"


def appeared(final: Path, rank: int) -> OutputError:
    """The refusal of a ``rank{r}`` another process made while this run wrote rank ``r``."""
    return OutputError(
        f"{final}: appeared while kda-tp wrote rank {rank} (it was not there, or not to be "
        "replaced, when the output directory was checked), so kda-tp did not write it and "
        "leaves it; move it away (or pass --force if it is kda-tp's own), and run again"
    )
