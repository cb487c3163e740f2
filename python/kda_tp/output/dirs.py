"""Output-directory safety: what kda-tp may create, lock, replace and remove where it writes.

The rules, for ``shard``, ``dump`` and ``demo --keep`` alike:

* **Never touch what kda-tp did not write, judged at the moment it is touched.** A directory
  is kda-tp's when it carries the mark :data:`~kda_tp.output.MARK_NAME` (written into every
  directory kda-tp makes, naming what it put there) and holds nothing else, each file judged
  by its own mark (a safetensors file by :data:`~kda_tp.output.FILE_MARK` in its header, any
  other file by the SHA-256 the directory's mark recorded), or when it is empty. Anything else
  in the way (another tool's ``rank{N}/`` optimizer states, an engine's own dump, a symbolic
  link, a plain file, a user's file put under a name kda-tp used) is refused by name,
  ``--force`` or not. Each path is checked again just before it is moved aside, removed or
  renamed over, a free name is taken without replacing what appeared under it meanwhile, and
  what appeared in a directory kda-tp moved aside is put back (:mod:`kda_tp.output.moves`).
* **Build first, then replace.** A run writes its output under hidden names and moves it into
  place only once all of it is complete; what it replaces is removed only then, so a refused
  or failed run leaves the previous output as it was.
* **One world size per output, one writer per rank**, each lock a kda-tp file
  (:mod:`kda_tp.output.locks`).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path

from ..checkpoint.reader import SafetensorsSource
from ..checkpoint.files import resolve_out
from ..errors import KdaTpError, OutputError
from ..model.json_reader import parse_metadata_int
from .locks import OutputLocks, lock_output, output_error
from .marks import foreign_dir, foreign_file, refuse
from .moves import discard_ours, keep_foreign, put_aside, take_name
from .names import ASIDE_DIR, LOCK_FILE, PARTIAL_DIR, RANK_DIR, WORLD_LOCK, rank_dir

__all__ = [
    "check_out_dir",
    "check_out_location",
    "discard",
    "input_mode",
    "make_dirs",
    "prepare_out_dir",
    "remove_created",
    "refuse_other_world_size",
    "remove_dir",
    "replace_files",
    "staged_name",
]


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
    directory) onto its final path, and remove the ``stale`` files, all or nothing.

    Every file in the way is judged again at that moment: one under a final name or in
    ``stale`` is moved aside (:func:`~kda_tp.output.moves.put_aside`, checked by its own mark,
    :func:`~kda_tp.output.marks.foreign_file`) only when ``stale`` names it (``--force``); a file
    that appeared under a final name since the caller looked is refused. Each new file then
    takes its free name without replacing anything (:func:`~kda_tp.output.moves.take_name`),
    and the files moved aside are removed last. On a refusal or failure the new files are
    taken back to their staged names and the files moved aside are put back.

    Raises:
        OutputError: a file in the way is not kda-tp's (or is not in ``stale``), or a move
            fails (the message names the file).
    """
    allowed = set(stale)
    asides: dict[Path, Path] = {}
    placed: list[Path] = []
    try:
        for final in dict.fromkeys([*staged, *allowed]):
            if not os.path.lexists(final):
                continue
            if final not in allowed:
                raise _appeared(final)
            aside = final.with_name(f".{final.name}.kda-tp-old-{os.getpid()}")
            put_aside(final, aside, foreign_file, "replaces")
            asides[final] = aside
        for final, path in staged.items():
            try:
                take_name(path, final)
            except FileExistsError:
                raise _appeared(final) from None
            except OSError as e:
                raise output_error(final, "move the new file into place", e) from e
            placed.append(final)
    except BaseException:
        for final in placed:
            try:
                take_name(final, staged[final])
            except OSError:
                continue
        for final, aside in asides.items():
            try:
                take_name(aside, final)
            except OSError:
                continue
        raise
    for aside in asides.values():
        aside.unlink(missing_ok=True)


def _appeared(path: Path) -> OutputError:
    """The refusal of a file that took one of a run's names while the run was writing."""
    return OutputError(
        f"{path}: appeared while kda-tp was writing (it was not there, or not to be replaced, "
        "when the output directory was checked); kda-tp takes only free names and replaces "
        "only its own files: move it away, or choose another --out"
    )


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

    The output's locks (its world size's and the ranks', :func:`~kda_tp.output.lock_output`)
    are held while ``out`` is checked and cleaned, and released on return; a partial directory
    is removed only while its rank's lock is held, so only a dead writer's.

    Args:
        root: the input checkpoint's directory.
        out: the output directory.
        tp_size: the world size.
        ranks: the ranks to be written.
        force: allow replacing finished rank directories and other files in ``out``.
        wait: wait for another writer of one of ``ranks``, or of another world size, instead
            of refusing.

    Returns:
        The directories this call created (``out`` and missing parents), deepest first; empty
        when ``out`` existed. On an error they are removed again.

    Raises:
        OutputError: ``out`` lies inside the input, holds another world size's or unfinished
            output that ``force`` does not allow replacing, holds something in a rank's way
            that kda-tp did not write (``foreign_dir``), cannot be created or listed, a
            lock file is not kda-tp's (a symbolic link, not a regular file), or another live
            process writes one of ``ranks`` or another world size there (without ``wait``).
    """
    check_out_location(root, out, ranks)
    created = make_dirs(out)
    try:
        locks = lock_output(out, tp_size, ranks, wait)
        try:
            for entry in check_out_dir(root, out, tp_size, ranks, force, locks, wait):
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
            raise output_error(out, "create the output directory", e) from e
        created.append(path)
    return created[::-1]


def remove_created(created: list[Path]) -> None:
    """Remove the directories a run created (deepest first) where they are empty again; one
    that is not (another process wrote into it) stays, and so do its parents."""
    for path in created:
        try:
            os.rmdir(path)
        except OSError:
            return


def check_out_dir(
    root: Path,
    out: Path,
    tp_size: int,
    ranks: tuple[int, ...],
    force: bool,
    locks: OutputLocks,
    wait: bool = False,
) -> list[Path]:
    """:func:`prepare_out_dir`'s check and clean-up of ``out``, with ``ranks`` locked in
    ``locks`` (and any other rank whose directory ``force`` removes added to them, waiting for
    it with ``wait``). Partial directories of ``ranks`` left by a dead writer are removed. A
    rank directory a killed run moved aside is put back where its rank is missing (the run was
    killed before its new rank took the name), and removed only beside the rank that replaced
    it (judged by its own marks): never an output's only copy of a rank.

    Returns:
        The rank directories of another world size that ``force`` replaces (checked to be
        kda-tp's, their ranks locked): the caller removes them (``remove_dir``) once its
        own output is complete.

    Raises:
        OutputError: as :func:`prepare_out_dir`.
    """
    input_root = root.resolve()
    entries = _listed(out)
    if _put_back_asides(out, entries, ranks):
        entries = _listed(out)
    existing: list[Path] = []
    stale: list[Path] = []
    for entry in entries:
        if LOCK_FILE.match(entry.name) or WORLD_LOCK.match(entry.name):
            continue  # a writer's lock (ours, or another rank's writer)
        aside = ASIDE_DIR.match(entry.name)
        if aside:
            # Left by a killed run beside the rank directory that replaced it (an aside
            # without its rank was put back above), judged as a rank.
            rank = int(aside.group(1))
            if rank in ranks and os.path.lexists(rank_dir(out, rank)):
                remove_dir(entry, out)
            elif rank in ranks:
                # Not put back: refused when it is not kda-tp's (a link), else left as it is.
                why = foreign_dir(entry, "rank")
                if why is not None:
                    raise refuse(entry, why, "removes")
            continue
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
                # Another rank: removed only while no live writer holds it.
                locks.add(int(final.group(1)), wait)
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


def _listed(out: Path) -> list[Path]:
    """The entries of the output directory ``out``, sorted.

    Raises:
        OutputError: it cannot be listed.
    """
    try:
        return sorted(out.iterdir())
    except OSError as e:
        raise output_error(out, "list the output directory", e) from e


def _put_back_asides(out: Path, entries: list[Path], ranks: tuple[int, ...]) -> bool:
    """Put back under ``rank{r}`` a rank directory a killed ``--force`` run moved aside
    (``.rank{r}.replaced-*``) before its new rank took the name, for each of ``ranks`` (locked)
    whose ``rank{r}`` is missing: the output is as it was before that run, and what is judged
    next is the rank directory itself. One rename that never replaces anything; an aside that
    cannot be put back is left where it is, never removed. Returns whether one was put back."""
    moved = False
    for entry in entries:
        aside = ASIDE_DIR.match(entry.name)
        if aside is None or int(aside.group(1)) not in ranks:
            continue
        home = rank_dir(out, int(aside.group(1)))
        if os.path.lexists(home) or entry.is_symlink() or not entry.is_dir():
            continue
        try:
            take_name(entry, home)
        except OSError:
            continue
        moved = True
    return moved


def refuse_other_world_size(out: Path, tp_size: int, writer: str) -> None:
    """Refuse to write ``tp_size`` output of ``writer`` (``"dump"``) into ``out`` when it holds
    a ``shard`` output of another world size (a ``rank{r}`` directory whose files record
    another ``tp_size``): one output directory holds one world size, whatever wrote it (the
    rule the locks keep for writers running at once, :mod:`kda_tp.output.locks`, and
    :func:`check_out_dir` for ``shard``). A writer that is not ``shard`` never removes a rank
    directory, so ``--force`` does not lift it.

    Raises:
        OutputError: naming the rank directory and its world size.
    """
    for entry in _listed(out):
        if not RANK_DIR.match(entry.name) or entry.is_symlink() or not entry.is_dir():
            continue
        found = _rank_tp_size(entry)
        if found is not None and found != tp_size:
            raise OutputError(
                f"{entry} holds shard output for tp_size {found}; one output directory holds "
                f"one world size, so this tp_size {tp_size} {writer} may not write beside it "
                f"({writer} never removes a rank directory, --force or not): choose another "
                "--out"
            )


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


def remove_dir(path: Path, out: Path) -> Path | None:
    """Remove the rank directory ``path`` (of another world size, or one a killed run moved
    aside), judged again first and moved aside in one rename so that it never lingers
    half-deleted under its own name; then only what is kda-tp's is removed
    (:func:`~kda_tp.output.moves.discard_ours`).

    Returns:
        None when it is gone; else where what was put into it meanwhile, which kda-tp did not
        write, now is (back under ``path``'s name where it is free:
        :func:`~kda_tp.output.moves.keep_foreign`).

    Raises:
        OutputError: ``path`` is not kda-tp's (it is left where it was).
    """
    match = RANK_DIR.match(path.name) or ASIDE_DIR.match(path.name)
    rank = match.group(1) if match else path.name
    aside = out / f".rank{rank}.replaced-{os.getpid()}-removed"
    if aside == path:
        aside = out / f".rank{rank}.replaced-{os.getpid()}-again"
    put_aside(path, aside, lambda p: foreign_dir(p, "rank"), "removes")
    if not discard_ours(aside):
        return None
    return keep_foreign(aside, path)


def discard(path: Path) -> None:
    """Remove a partial directory a dead writer left (judged first by
    ``foreign_dir`` with ``complete=False``: hidden, named by its writer,
    written by it alone), or, when it is a symbolic link or a plain file, the link or file
    alone: what a link points to is never touched."""
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)
