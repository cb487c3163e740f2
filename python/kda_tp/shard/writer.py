"""Writing one checkpoint directory per tensor-parallel rank.

Layout written by ``kda-tp shard CHECKPOINT --tp-size T --out OUT``:

```text
OUT/rank0/ ... OUT/rank{T-1}/
    config.json and the input's other small files, unchanged (never its heavy files: weights
    in other formats, training state, files of 100 MB or more; see shard.rankdir.heavy_files);
    the input's safetensors file names, each holding the same tensors as in the input
    (KDA tensors, and a hybrid's MLA tensors where their plan can be made, as this rank's
    slice, with local shapes), __metadata__ carrying tp_rank, tp_size, kda_tp_qk_multiple,
    kda_tp_layers, kda_tp_mla_layers (the MLA layers sliced), kda_tp_version, kda_tp_input;
    model.safetensors.index.json;
    .kda-tp.json, kda-tp's mark: the entries it wrote (see kda_tp.output.marks).
```

Files keep the mode bits of the input file they come from (the index and the mark those of
the input's index, else of its first file); a rank directory keeps the input directory's, its
owner's read, write and search bits added (a 0600 checkpoint in a 0700 directory gives 0600
files in 0700 rank directories).

A rank is written into a hidden ``OUT/.rank{r}.partial-<run>`` directory (``<run>``: this
run's own id, :func:`~kda_tp.output.names.run_id`, never the pid alone) and renamed to
``OUT/rank{r}`` only when every file in it is complete, so a run killed at any point leaves no
incomplete ``rank{r}``; a rank directory it replaces (``force``) is removed only once the whole
run has succeeded, and only when kda-tp wrote it (:mod:`kda_tp.output`). A writer holds an
exclusive lock (``flock``) on ``OUT/.rank{r}.lock`` for each rank it writes, from before it
looks at ``OUT`` until it is done, so a second writer of a rank is refused (or waits) instead of
removing the first's partial directory; the kernel releases the lock when the process dies, so a
partial directory of a rank whose lock is free is stale. Several processes may write different
ranks into one ``OUT`` at once.

The verifier (:func:`~kda_tp.shard.verify.verify_shards`), the output-directory check
(:func:`~kda_tp.output.dirs.prepare_out_dir`), a rank directory's names
(:func:`~kda_tp.output.names.rank_dir`) and contents (:mod:`kda_tp.shard.rankdir`): elsewhere.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from .._native import __version__
from ..checkpoint.description import describe
from ..checkpoint.reader import INDEX_NAME, SafetensorsSource, checked_info
from ..checkpoint.writer import FileRange, write_index, write_safetensors
from ..errors import CheckpointError, DtypeMismatchError, OutputError, PlanError, ShardInterrupted
from ..model.dtypes import DTYPE_BITS, tensor_nbytes
from ..output.dirs import check_out_dir, check_out_location, make_dirs, remove_created
from ..output.locks import lock_output, output_error
from ..output.marks import foreign_dir, write_mark
from ..output.moves import put_aside, take_name
from ..output.names import FILE_MARK, RANK_DIR, rank_dir, run_id
from ..rank.mla import rank_mla_plan
from ..rank.plan import KdaTpPlan, distinct_ranks
from ..rank.view import KdaShardedSource
from ._place import Placed, appeared, commit, drop_replaced, partial_dir, undo
from .rankdir import (
    companion_files,
    heavy_files,
    input_fingerprint,
    kda_only_files,
    names_by_file,
    unindexed_files,
)
from .verify import ProgressFactory

__all__ = ["ShardResult", "ShardSizes", "check_shard_input", "shard_checkpoint", "shard_sizes"]


class _Stopped(Exception):
    """Raised inside a writer thread at its next tensor once the run is interrupted."""


@dataclass(frozen=True)
class ShardResult:
    """What :func:`shard_checkpoint` wrote: ``ranks`` of ``tp_size`` under ``out_dir``,
    ``bytes_written`` tensor bytes (headers excluded, summed over ranks) in ``seconds``;
    ``kept``: directories holding files another process put into a rank directory while this
    run replaced or removed it, which kda-tp did not write and so kept (see
    :func:`shard_checkpoint`'s ``force``); usually empty."""

    out_dir: Path
    tp_size: int
    ranks: tuple[int, ...]
    bytes_written: int
    seconds: float
    kept: tuple[Path, ...] = ()

    def to_dict(self) -> dict[str, object]:
        """The result as a JSON-ready dict, the first keys ``kda-tp shard --json`` prints:
        ``ok`` (True), ``out_dir``, ``tp_size``, ``ranks``, ``rank_dirs`` (each rank's
        directory, :func:`rank_dir`), ``bytes_written`` and ``seconds`` (wall time), and
        ``kept`` (paths) when not empty."""
        doc: dict[str, object] = {
            "ok": True, "out_dir": str(self.out_dir), "tp_size": self.tp_size,
            "ranks": list(self.ranks),
            "rank_dirs": [str(rank_dir(self.out_dir, r)) for r in self.ranks],
            "bytes_written": self.bytes_written, "seconds": self.seconds}
        if self.kept:
            doc["kept"] = [str(p) for p in self.kept]
        return doc


@dataclass(frozen=True)
class ShardSizes:
    """The tensor bytes (headers excluded) a :func:`shard_checkpoint` run writes, per rank, and
    the companion files it copies into every rank.

    Attributes:
        input_bytes: tensor bytes of the input checkpoint (every tensor its index names).
        ranks: the ranks written, sorted.
        kda_bytes: per rank of ``ranks``, its slices of the KDA (and planned MLA) tensors.
        other_bytes: per rank of ``ranks``, the other tensors, copied whole into every rank
            (0 with ``kda_only``).
        kda_only: whether the run writes only the KDA tensors.
        companions: the input's companion files copied into every rank (config, tokenizer:
            ``companion_files``), by name; none with ``kda_only``.
        companion_bytes: their bytes, what each rank gets.
    """

    input_bytes: int
    ranks: tuple[int, ...]
    kda_bytes: tuple[int, ...]
    other_bytes: tuple[int, ...]
    kda_only: bool = False
    companions: tuple[str, ...] = ()
    companion_bytes: int = 0

    @property
    def rank_bytes(self) -> tuple[int, ...]:
        """Per rank of ``ranks``: all its tensor bytes."""
        return tuple(k + o for k, o in zip(self.kda_bytes, self.other_bytes))

    @property
    def total_bytes(self) -> int:
        """Tensor bytes written over all of ``ranks``."""
        return sum(self.rank_bytes)

    @property
    def written_bytes(self) -> int:
        """Every byte of data written over all of ``ranks``: the tensors and the companion
        files (headers, indexes and marks excluded)."""
        return self.total_bytes + self.companion_bytes * len(self.ranks)

    @property
    def suggest_kda_only(self) -> bool:
        """True when the tensors copied whole into every rank outweigh the KDA slices (then
        ``kda_only`` would write far less: an overlay on the input)."""
        return not self.kda_only and sum(self.other_bytes) > sum(self.kda_bytes)

    def to_dict(self) -> dict[str, object]:
        """The sizes as JSON-ready values (what ``kda-tp shard --json`` prints under
        ``sizes``): the attributes, ``rank_bytes``, ``total_bytes``, ``written_bytes`` and
        ``suggest_kda_only``."""
        return {
            "input_bytes": self.input_bytes,
            "ranks": list(self.ranks),
            "kda_bytes": list(self.kda_bytes),
            "other_bytes": list(self.other_bytes),
            "rank_bytes": list(self.rank_bytes),
            "total_bytes": self.total_bytes,
            "companions": list(self.companions),
            "companion_bytes": self.companion_bytes,
            "written_bytes": self.written_bytes,
            "kda_only": self.kda_only,
            "suggest_kda_only": self.suggest_kda_only,
        }


def shard_checkpoint(
    checkpoint: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    tp_size: int,
    *,
    ranks: Iterable[int] | None = None,
    layers: Iterable[int] | None = None,
    qk_multiple: int = 256,
    force: bool = False,
    backend: str | None = None,
    progress: ProgressFactory | None = None,
    allow_resharding: bool = False,
    skip_unindexed: bool = False,
    kda_only: bool = False,
    wait: bool = False,
    report_sizes: Callable[[ShardSizes], None] | None = None,
    skip_heavy_files: bool = False,
) -> ShardResult:
    """Write one checkpoint directory per rank (layout in the module docstring).

    Every rank's plan and adapter is built, so every KDA tensor's dtype and shape is checked,
    before anything is written. Tensors are streamed one at a time: row-sliced and replicated
    tensors go straight from the mapped input to the output file, and only one ``o_proj``
    column gather is held in memory at a time.

    Args:
        checkpoint: input checkpoint directory (or ``.safetensors`` file) with ``config.json``.
        out_dir: output directory, created if missing. It must not lie inside the input
            directory, and must be empty or hold only other ranks' ``kda-tp`` output, unless
            ``force``: it then replaces the existing directories of the ranks being written
            and removes another world size's, once this run's ranks are all complete, and
            only those kda-tp wrote (:mod:`kda_tp.output`: its mark ``.kda-tp.json``, nothing
            else in them); anything else in their way is refused, ``force`` or not.
        tp_size: tensor-parallel world size.
        ranks: the ranks to write (default: all), so several processes can split the work.
        layers: 0-based KDA layer indices (default: from the config).
        qk_multiple: the plan's local q|k width rule (see :class:`KdaTpPlan`).
        force: see ``out_dir``.
        backend: ``"mmap"`` or ``"pread"`` reads of the input (see :class:`SafetensorsSource`).
        progress: called once with the total bytes to write; returns ``advance(nbytes)``,
            which the writer threads call (from several threads) after each tensor.
        allow_resharding: accept an input whose headers carry ``tp_rank``/``tp_size`` (a rank
            directory kda-tp wrote); refused by default.
        skip_unindexed: shard a directory whose ``.safetensors`` files include some its index
            does not name (see ``unindexed_files``), leaving them out of every rank;
            refused by default.
        kda_only: write only the sliced KDA tensors (an overlay on the input checkpoint, see
            ``kda_only_files``): no other tensor and no companion file; each header's
            ``__metadata__`` adds ``kda_tp_kda_only`` and ``kda_tp_source`` (the input path).
        wait: when another process holds the lock of one of ``ranks`` (it is writing them
            into ``out_dir``), wait until it is done instead of refusing (``--wait``). Each
            rank's lock is ``out_dir/.rank{r}.lock``, taken with ``flock`` before ``out_dir``
            is looked at and released (the file removed) when this run is done; the kernel
            releases it when a process dies, so a partial directory of a rank whose lock is
            free is stale and removed.
        report_sizes: called once, after every check and before the first byte is written,
            with the :class:`ShardSizes` this run will write.
        skip_heavy_files: shard a directory holding heavy files beside its safetensors files
            (weights or training state in other formats, files of 100 MB or more:
            ``heavy_files``), leaving them out of every rank;
            refused by default. They are never copied into a rank.

    Raises:
        CheckpointError, PlanError, DtypeMismatchError, ShapeMismatchError: bad input (also:
            an input that is already a shard, unindexed files, heavy files); nothing is
            written.
        OutputError: the output directory is refused (e.g. a ``rank{r}`` there that kda-tp
            did not write, or a lock path that is a symbolic link), another live process is
            writing one
            of ``ranks`` into it (the message names its pid, host and start time; see
            ``wait``), or a write fails (e.g. a full disk);
            nothing of this run is left behind: the ranks it completed are removed again,
            rank directories it replaced under ``force`` are put back, and ``out_dir`` and
            the parents it created are removed where empty (a run killed outright may
            leave complete ``rank{r}`` directories, never incomplete ones, and ``verify``
            rejects the set until every rank is there).
        ShardInterrupted: Ctrl-C; the writers stop at their next tensor, this run's partial
            directories are removed, and the ranks completed before it stay.
    """
    start = time.perf_counter()
    source = SafetensorsSource(checkpoint, backend)
    out = Path(out_dir)
    tp_size, chosen = _checked_ranks(tp_size, ranks)
    check_shard_input(source, allow_resharding=allow_resharding, skip_unindexed=skip_unindexed,
                      skip_heavy_files=skip_heavy_files or kda_only)
    shards = _rank_views(source, tp_size, chosen, qk_multiple, layers)
    ranks = tuple(s.plan.tp_rank for s in shards)
    # Tensors outside the KDA layers are copied through whatever their dtype, packed sub-byte
    # floats (F4, F6) included; a dtype the writer cannot size is refused before anything is
    # written (the header reader and the writer know the same dtypes, so this guards upgrades).
    for name in source.names():
        dtype = checked_info(source, name)[0]
        if dtype not in DTYPE_BITS:
            raise DtypeMismatchError(
                f"{source.file_of(name)}: {name}: dtype {dtype} cannot be copied to the shards "
                f"(the writer knows {', '.join(DTYPE_BITS)})"
            )
    files = names_by_file(source)
    if kda_only:
        files = kda_only_files(files, shards[0])
    sizes = _sizes(source, shards, files, kda_only)
    for companion in [] if kda_only else companion_files(source):
        try:
            with open(companion, "rb"):
                pass
        except OSError as e:
            raise CheckpointError(
                f"{companion}: cannot be read ({e}); shard copies it into every rank"
            ) from e
    check_out_location(source.root, out, ranks)
    run = run_id()
    made: list[Path] = []  # the partial directories this run created: the only ones it removes
    created = make_dirs(out)
    try:
        # Held from before OUT is looked at until this run's ranks are in place (or removed).
        locks = lock_output(out, tp_size, ranks, wait)
        try:
            stale = check_out_dir(source.root, out, tp_size, ranks, force, locks, wait)
            if report_sizes:
                report_sizes(sizes)
            placed = _write_ranks(source, shards, files, out, tp_size, ranks, sizes, kda_only,
                                  progress, force, (run, made))
            kept = commit(out, placed, stale)
            return ShardResult(out, tp_size, ranks, sum(p.nbytes for p in placed),
                               time.perf_counter() - start, tuple(kept))
        finally:
            locks.release()
    except BaseException:
        # A refused or failed run removes the partial directories it created (again: a writer
        # out of file descriptors could not remove its own), never another run's, whatever its
        # pid, and the directories it created, where nothing else is left in them (an
        # interrupted run's completed ranks stay, and so does OUT then).
        for partial in made:
            shutil.rmtree(partial, ignore_errors=True)
        remove_created(created)
        raise


def _write_ranks(
    source: SafetensorsSource,
    shards: list[KdaShardedSource],
    files: dict[str, list[str]],
    out: Path,
    tp_size: int,
    ranks: tuple[int, ...],
    sizes: ShardSizes,
    kda_only: bool,
    progress: ProgressFactory | None,
    force: bool,
    run: tuple[str, list[Path]],
) -> list[Placed]:
    """:func:`shard_checkpoint`'s writing, with ``out`` checked and ``ranks`` locked: every
    rank in place, or none (a failed run undoes the ranks it placed, :func:`_undo`). ``run``:
    this run's id and the list of partial directories it created (:func:`_write_rank`)."""
    report = progress(sizes.total_bytes) if progress else None
    stop = threading.Event()

    def advance(nbytes: int) -> None:
        # Called by the writers after each tensor: where they notice an interrupt.
        if stop.is_set():
            raise _Stopped
        if report:
            report(nbytes)

    # Ranks are independent; the copies and writes release the GIL, so threads overlap them.
    pool = ThreadPoolExecutor(max_workers=min(len(shards), os.cpu_count() or 1))
    futures: list[Future[Placed]] = []
    try:
        for s in shards:
            futures.append(pool.submit(_write_rank, source, s, files, out, advance, kda_only,
                                       force, run))
        wait(futures)
        pool.shutdown()
    except KeyboardInterrupt:
        stop.set()
        _shutdown(pool)
        completed: list[int] = []
        for r, f in zip(ranks, futures):
            if not f.cancelled() and f.exception() is None:
                completed.append(r)
                drop_replaced(f.result())
        present = {int(m.group(1)) for p in out.iterdir() if (m := RANK_DIR.match(p.name))}
        remaining = tuple(r for r in range(tp_size) if r not in present)
        raise ShardInterrupted(out, tp_size, tuple(completed), remaining) from None
    failed = [error for f in futures if (error := f.exception()) is not None]
    if failed:
        # All or nothing: a failed run (e.g. a full disk) also removes the ranks it completed
        # and puts back the rank directories it replaced.
        undo(out, [f.result() for f in futures if f.exception() is None])
        raise failed[0]
    return [f.result() for f in futures]


def shard_sizes(
    checkpoint: str | os.PathLike[str],
    tp_size: int,
    *,
    ranks: Iterable[int] | None = None,
    layers: Iterable[int] | None = None,
    qk_multiple: int = 256,
    kda_only: bool = False,
    backend: str | None = None,
) -> ShardSizes:
    """The bytes :func:`shard_checkpoint` with these arguments writes, from the headers alone
    (nothing is read or written). The arguments are :func:`shard_checkpoint`'s.

    Raises:
        CheckpointError, PlanError, DtypeMismatchError, ShapeMismatchError: as
            :func:`shard_checkpoint` for bad input.
    """
    source = SafetensorsSource(checkpoint, backend)
    tp_size, chosen = _checked_ranks(tp_size, ranks)
    shards = _rank_views(source, tp_size, chosen, qk_multiple, layers)
    files = names_by_file(source)
    return _sizes(source, shards, kda_only_files(files, shards[0]) if kda_only else files,
                  kda_only)


def _checked_ranks(tp_size: int, ranks: Iterable[int] | None) -> tuple[int, tuple[int, ...] | None]:
    """``tp_size`` as an int and ``ranks`` sorted (None: all, expanded by :func:`_rank_views`
    once the checkpoint has bounded ``tp_size``).

    Raises:
        PlanError: ``tp_size`` not a positive integer, no ranks, or a rank named twice.
    """
    if isinstance(tp_size, bool) or not isinstance(tp_size, (int, np.integer)) or tp_size < 1:
        raise PlanError(f"tp_size must be a positive integer, got {tp_size!r}")
    tp_size = int(tp_size)
    if ranks is None:
        return tp_size, None
    given = [int(r) for r in ranks]
    distinct_ranks(given)
    wanted = tuple(sorted(given))
    if not wanted:
        raise PlanError("no ranks to write: --ranks is empty")
    return tp_size, wanted


def _rank_views(
    source: SafetensorsSource,
    tp_size: int,
    ranks: tuple[int, ...] | None,
    qk_multiple: int,
    layers: Iterable[int] | None,
) -> list[KdaShardedSource]:
    """One view per rank of ``ranks`` (None: all), a hybrid's MLA layers sliced too where they
    can be planned (``rank_mla_plan``). Rank 0's plan and view come first: the plan
    refuses a tp_size the heads cannot split and the view checks the heads against the tensors
    on disk, so tp_size is bounded by the checkpoint before anything is made per rank."""

    def view(r: int) -> KdaShardedSource:
        plan = KdaTpPlan.from_config(source, r, tp_size, qk_multiple=qk_multiple, layers=layers)
        mla = rank_mla_plan(describe(source), r, tp_size)[0]
        return KdaShardedSource(source, plan, layers, mla=mla)

    first = view(0)
    return [first if r == 0 else view(r) for r in (range(tp_size) if ranks is None else ranks)]


def _sizes(
    source: SafetensorsSource,
    shards: list[KdaShardedSource],
    files: dict[str, list[str]],
    kda_only: bool,
) -> ShardSizes:
    """The tensor bytes writing ``files`` for ``shards`` takes, KDA slices and the rest apart."""
    names = [name for names in files.values() for name in names]
    companions = [] if kda_only else companion_files(source)
    companion_bytes = 0
    for path in companions:
        try:
            companion_bytes += path.stat().st_size
        except OSError:
            continue  # the copy says why it cannot read it
    kda, other = [], []
    for s in shards:
        sliced = [tensor_nbytes(*checked_info(s, n)) for n in names if s.is_sharded(n)]
        whole = [tensor_nbytes(*checked_info(s, n)) for n in names if not s.is_sharded(n)]
        kda.append(sum(sliced))
        other.append(sum(whole))
    return ShardSizes(
        input_bytes=sum(tensor_nbytes(*checked_info(source, n)) for n in source.names()),
        ranks=tuple(s.plan.tp_rank for s in shards),
        kda_bytes=tuple(kda),
        other_bytes=tuple(other),
        kda_only=kda_only,
        companions=tuple(p.name for p in companions),
        companion_bytes=companion_bytes,
    )


def _shutdown(pool: ThreadPoolExecutor) -> None:
    """Cancel the ranks not started and wait for the running writers to stop (at their next
    tensor), whatever further Ctrl-Cs arrive meanwhile: each removes its partial directory."""
    while True:
        try:
            pool.shutdown(wait=True, cancel_futures=True)
            return
        except KeyboardInterrupt:
            continue


def check_shard_input(
    source: SafetensorsSource,
    *,
    allow_resharding: bool = False,
    skip_unindexed: bool = False,
    skip_heavy_files: bool = False,
) -> None:
    """Refuse an input :func:`shard_checkpoint` refuses before it looks at the geometry: a rank
    directory kda-tp wrote (``tp_rank``/``tp_size`` in its headers) unless
    ``allow_resharding``, ``.safetensors`` files the index does not name
    (``unindexed_files``) unless ``skip_unindexed``, and heavy files beside the
    checkpoint (``heavy_files``) unless ``skip_heavy_files``.

    Args:
        source: the input checkpoint.
        allow_resharding: accept a rank directory (``--allow-resharding``).
        skip_unindexed: accept files the index does not name (``--skip-unindexed``).
        skip_heavy_files: accept heavy files, left out of every rank (``--skip-heavy-files``).

    Raises:
        CheckpointError: any of them, naming the file(s) and the flag that accepts them.
    """
    for path, meta in [] if allow_resharding else source.files():
        if meta and "tp_rank" in meta and "tp_size" in meta:
            raise CheckpointError(
                f"{path}: already a tensor-parallel shard (rank {meta['tp_rank']} of "
                f"{meta['tp_size']}, its header says); shard the original checkpoint, or pass "
                "--allow-resharding (allow_resharding=True) to split this one further"
            )
    unindexed = unindexed_files(source)
    if unindexed and not skip_unindexed:
        one = len(unindexed) == 1
        raise CheckpointError(
            f"{source.root}: {', '.join(p.name for p in unindexed)} "
            f"{'is' if one else 'are'} not named by {INDEX_NAME}, so no rank would hold "
            f"{'it' if one else 'them'}; pass --skip-unindexed (skip_unindexed=True) to shard "
            f"without {'it' if one else 'them'}"
        )
    heavy = [] if skip_heavy_files else heavy_files(source)
    if heavy:
        listed = ", ".join(f"{p.name} ({size / 1e6:.1f} MB: {why})" for p, size, why in heavy[:3])
        more = f" and {len(heavy) - 3} more" if len(heavy) > 3 else ""
        raise CheckpointError(
            f"{source.root}: {listed}{more} would be copied whole into every rank (shard "
            "copies the files beside a checkpoint, its config and tokenizer, into each rank, "
            "and slices only safetensors files); a rank directory holds no such file: pass "
            "--skip-heavy-files (skip_heavy_files=True) to leave "
            f"{'it' if len(heavy) == 1 else 'them'} out of every rank, or move "
            f"{'it' if len(heavy) == 1 else 'them'} out of the checkpoint directory"
        )


def _write_rank(
    source: SafetensorsSource,
    shard: KdaShardedSource,
    files: dict[str, list[str]],
    out: Path,
    advance: Callable[[int], None] | None,
    kda_only: bool,
    force: bool,
    run: tuple[str, list[Path]],
) -> Placed:
    """Write ``shard``'s rank into a partial directory, then rename it into place (with
    ``kda_only``, the KDA-only metadata and no companion files): its name is taken only while
    free, or, with ``force``, once the rank directory there, judged again now, is moved aside.
    ``run``: this run's id, which names the partial directory, and the list it is added to
    once created (the run removes only those).

    Raises:
        OutputError: a write fails; ``rank{r}`` appeared during the run (without ``force``),
            or is not kda-tp's now (with it).
    """
    plan = shard.plan
    run_name, made = run
    partial = partial_dir(out, plan.tp_rank, run_name)
    mine = False

    previous: list[str] = []

    def release_previous() -> None:
        # The writer is done with a tensor once it asks for the next one: drop its pages from
        # this process (the page cache keeps them), so the resident set stays near one tensor.
        if previous:
            source.release(previous.pop())

    def fetch(name: str, count: bool = True) -> np.ndarray:
        release_previous()
        data = shard[name].data
        previous.append(name)
        if advance and count:
            advance(data.nbytes)
        return data

    def get_bytes(name: str) -> np.ndarray | FileRange:
        # Row-sliced, replicated and passed-through tensors are one byte range of the input:
        # the kernel copies it file to file. o_proj is gathered.
        piece = _file_piece(source, shard, name, lambda: fetch(name, count=False))
        if piece is None:
            return fetch(name)
        release_previous()
        if advance:
            advance(piece.nbytes)
        return piece

    final = rank_dir(out, plan.tp_rank)
    old: Path | None = None
    try:
        # Inside the try: a listing that meets the open-files limit is named as that limit.
        dir_mode, file_modes, index_mode = _modes(source)
        companions = [] if kda_only else companion_files(source)
        entries = [*files, INDEX_NAME, *(p.name for p in companions)]
        partial.mkdir()
        mine = True
        made.append(partial)
        os.chmod(partial, dir_mode)
        write_mark(partial, "rank", entries, index_mode)  # a partial directory is kda-tp's too
        input_meta = {path.name: meta or {} for path, meta in source.files()}
        fingerprint = input_fingerprint(source)
        weight_map: dict[str, str] = {}
        total = 0
        for file_name, names in files.items():
            metadata = {
                **input_meta.get(file_name, {}),
                "tp_rank": str(plan.tp_rank),
                "tp_size": str(plan.tp_size),
                "kda_tp_qk_multiple": str(plan.qk_multiple),
                "kda_tp_layers": json.dumps(list(shard.layers)),
                "kda_tp_mla_layers": json.dumps(list(shard.mla_layers)),  # sliced MLA layers
                FILE_MARK: __version__,
                "kda_tp_input": fingerprint,
            }
            if kda_only:
                metadata.update(kda_tp_kda_only="1", kda_tp_source=str(source.path.resolve()))
            specs = []
            for name in names:
                dtype, shape = checked_info(shard, name)
                specs.append(
                    (name, dtype, shape, tensor_nbytes(dtype, shape), lambda n=name: get_bytes(n))
                )
            total += write_safetensors(partial / file_name, specs, metadata, sync=False,
                                       mode=file_modes.get(file_name, index_mode))
            release_previous()
            weight_map.update(dict.fromkeys(names, file_name))
        write_index(partial / INDEX_NAME, weight_map, total, sync=False, mode=index_mode)
        for extra in companions:
            shutil.copy2(extra, partial / extra.name)  # with its mode bits
        write_mark(partial, "rank", entries, index_mode)  # now with each file's digest
        inode = partial.stat().st_ino
        if os.path.lexists(final):
            if not force:
                raise appeared(final, plan.tp_rank)
            # The old directory, judged again now, is kept aside (one rename) until the whole
            # run has succeeded, so a failed --force rerun can put it back; a run killed before
            # then leaves it for the next run to judge and remove.
            old = out / f".rank{plan.tp_rank}.replaced-{run_name}"
            put_aside(final, old, lambda p: foreign_dir(p, "rank"), "replaces")
        try:
            take_name(partial, final)
        except FileExistsError:
            raise appeared(final, plan.tp_rank) from None
    except BaseException as e:
        if mine:
            shutil.rmtree(partial, ignore_errors=True)
        if old is not None and not os.path.lexists(final):
            take_name(old, final)
        cause = e if isinstance(e, OSError) else e.__cause__
        if isinstance(cause, OSError) and cause.errno in (errno.EMFILE, errno.ENFILE):
            raise output_error(partial, f"write rank {plan.tp_rank}", cause) from e
        if isinstance(e, OSError):
            raise OutputError(f"{partial}: writing rank {plan.tp_rank} failed: {e}") from e
        raise
    return Placed(plan.tp_rank, final, inode, old, total)


def _modes(source: SafetensorsSource) -> tuple[int, dict[str, int], int]:
    """The mode bits of a rank's output: its directory's (the input directory's, with the
    owner's ``rwx``, so the writer can fill and later replace it), each safetensors file's
    (its input file's, by name), and the index's and the mark's (the input index's, else its
    first file's).

    Raises:
        CheckpointError: an input file cannot be looked at.
    """
    try:
        files = {path.name: path.stat().st_mode & 0o777 for path, _ in source.files()}
        index = source.root / INDEX_NAME
        index_mode = (index.stat().st_mode & 0o777 if source.path.is_dir()
                      and index.is_file() else next(iter(files.values()), 0o644))
        dir_mode = source.root.stat().st_mode & 0o777 | stat.S_IRWXU
    except OSError as e:
        raise CheckpointError(f"{source.root}: cannot read the input's mode bits: {e}") from e
    return dir_mode, files, index_mode


def _file_piece(
    source: SafetensorsSource,
    shard: KdaShardedSource,
    name: str,
    fallback: Callable[[], np.ndarray],
) -> FileRange | None:
    """This rank's bytes of ``name`` as one range of the input file, or None for a column
    slice (``o_proj``), which is not one range."""
    start, stop = 0, None
    entry = shard.plan_entry(name)  # None: passed through whole
    if entry is not None:
        byte_range = entry.byte_range
        if byte_range is None:
            return None
        start, stop = byte_range
    found = source.file_range(name, start, stop)
    if found is None:
        return None
    fd, begin, end = found
    return FileRange(fd, begin, end - begin, fallback)


