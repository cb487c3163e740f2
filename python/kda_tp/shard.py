"""Writing one checkpoint directory per tensor-parallel rank, and verifying them.

Layout written by ``kda-tp shard CHECKPOINT --tp-size T --out OUT``:

```text
OUT/rank0/ ... OUT/rank{T-1}/
    config.json and the input's other small files, unchanged;
    the input's safetensors file names, each holding the same tensors as in the input
    (KDA tensors as this rank's slice, with local shapes), __metadata__ carrying
    tp_rank, tp_size, kda_tp_qk_multiple and kda_tp_layers;
    model.safetensors.index.json.
```

A rank is written into a hidden ``OUT/.rank{r}.partial-<pid>`` directory and renamed to
``OUT/rank{r}`` only when every file in it is complete, so a run killed at any point leaves no
incomplete ``rank{r}``. A writer holds an exclusive lock (``flock``) on ``OUT/.rank{r}.lock``
for each rank it writes, from before it looks at ``OUT`` until it is done, so a second writer of
a rank is refused (or waits) instead of removing the first's partial directory; the kernel
releases the lock when the process dies, so a partial directory of a rank whose lock is free is
stale. Several processes may write different ranks into one ``OUT`` at once.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shlex
import shutil
import socket
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ._io import (
    DTYPE_BITS,
    FileRange,
    resolve_out,
    tensor_nbytes,
    write_index,
    write_safetensors,
)
from ._native import __version__
from .errors import (
    CheckpointError,
    DtypeMismatchError,
    KdaTpError,
    OutputError,
    PlanError,
    ShardInterrupted,
)
from .config import parse_json, parse_metadata_int
from .layers import check_layers, layer_count
from .checkpoint import INDEX_NAME, SafetensorsSource, Tensor
from .layout import kda_layer_indices
from .plan import KdaShard, KdaTpPlan
from .source import KdaShardedSource, checked_get, checked_info, missing_tensor

# Imported where verify_shards(numeric=True) needs it, so `kda-tp shard` starts faster.
if TYPE_CHECKING:
    from .equivalence import EquivalenceReport

__all__ = [
    "ShardInterrupted",
    "ShardResult",
    "ShardSizes",
    "VerifyReport",
    "check_shard_input",
    "finish_command",
    "prepare_out_dir",
    "rank_dir",
    "shard_checkpoint",
    "shard_sizes",
    "unindexed_files",
    "verify_shards",
]

_RANK_DIR = re.compile(r"^rank([0-9]{1,10})$")
_PARTIAL_DIR = re.compile(r"^\.rank([0-9]{1,10})\.partial-")
_LOCK_FILE = re.compile(r"^\.rank([0-9]{1,10})\.lock$")
#: Bytes of a lock file's holder line read back for a refusal message.
_HOLDER_BYTES = 512

#: ``progress(total_bytes)`` returns an ``advance(nbytes)`` callable.
ProgressFactory = Callable[[int], Callable[[int], None]]


def rank_dir(out_dir: str | os.PathLike[str], tp_rank: int) -> Path:
    """The directory holding rank ``tp_rank``'s checkpoint under ``out_dir``."""
    return Path(out_dir) / f"rank{tp_rank}"


class _Stopped(Exception):
    """Raised inside a writer thread at its next tensor once the run is interrupted."""


@dataclass(frozen=True)
class ShardResult:
    """What :func:`shard_checkpoint` wrote: ``ranks`` of ``tp_size`` under ``out_dir``,
    ``bytes_written`` tensor bytes (headers excluded, summed over ranks) in ``seconds``."""

    out_dir: Path
    tp_size: int
    ranks: tuple[int, ...]
    bytes_written: int
    seconds: float


@dataclass(frozen=True)
class ShardSizes:
    """The tensor bytes (headers excluded) a :func:`shard_checkpoint` run writes, per rank.

    Attributes:
        input_bytes: tensor bytes of the input checkpoint (every tensor its index names).
        ranks: the ranks written, sorted.
        kda_bytes: per rank of ``ranks``, its slices of the KDA tensors.
        other_bytes: per rank of ``ranks``, the other tensors, copied whole into every rank
            (0 with ``kda_only``).
        kda_only: whether the run writes only the KDA tensors.
    """

    input_bytes: int
    ranks: tuple[int, ...]
    kda_bytes: tuple[int, ...]
    other_bytes: tuple[int, ...]
    kda_only: bool = False

    @property
    def rank_bytes(self) -> tuple[int, ...]:
        """Per rank of ``ranks``: all its tensor bytes."""
        return tuple(k + o for k, o in zip(self.kda_bytes, self.other_bytes))

    @property
    def total_bytes(self) -> int:
        """Tensor bytes written over all of ``ranks``."""
        return sum(self.rank_bytes)

    @property
    def suggest_kda_only(self) -> bool:
        """True when the tensors copied whole into every rank outweigh the KDA slices (then
        ``kda_only`` would write far less: an overlay on the input)."""
        return not self.kda_only and sum(self.other_bytes) > sum(self.kda_bytes)

    def to_dict(self) -> dict[str, object]:
        """The sizes as JSON-ready values (what ``kda-tp shard --json`` prints under
        ``sizes``): the attributes, ``rank_bytes``, ``total_bytes`` and ``suggest_kda_only``."""
        return {
            "input_bytes": self.input_bytes,
            "ranks": list(self.ranks),
            "kda_bytes": list(self.kda_bytes),
            "other_bytes": list(self.other_bytes),
            "rank_bytes": list(self.rank_bytes),
            "total_bytes": self.total_bytes,
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
            ``force`` (which also replaces existing directories of the ranks being written).
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
            does not name (see :func:`unindexed_files`), leaving them out of every rank;
            refused by default.
        progress: called once with the total bytes to write; returns ``advance(nbytes)``.
        kda_only: write only the sliced KDA tensors (an overlay on the input checkpoint, see
            :func:`kda_only_files`): no other tensor and no companion file; each header's
            ``__metadata__`` adds ``kda_tp_kda_only`` and ``kda_tp_source`` (the input path).
        wait: when another process holds the lock of one of ``ranks`` (it is writing them
            into ``out_dir``), wait until it is done instead of refusing (``--wait``). Each
            rank's lock is ``out_dir/.rank{r}.lock``, taken with ``flock`` before ``out_dir``
            is looked at and released (the file removed) when this run is done; the kernel
            releases it when a process dies, so a partial directory of a rank whose lock is
            free is stale and removed.
        report_sizes: called once, after every check and before the first byte is written,
            with the :class:`ShardSizes` this run will write.

    Raises:
        CheckpointError, PlanError, DtypeMismatchError, ShapeMismatchError: bad input (also:
            an input that is already a shard, unindexed files); nothing is written.
        OutputError: the output directory is refused, another live process is writing one
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
    check_shard_input(source, allow_resharding=allow_resharding, skip_unindexed=skip_unindexed)
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
    files = _names_by_file(source)
    if kda_only:
        files = kda_only_files(files, shards[0])
    sizes = _sizes(source, shards, files, kda_only)
    for companion in [] if kda_only else _companion_files(source):
        try:
            with open(companion, "rb"):
                pass
        except OSError as e:
            raise CheckpointError(
                f"{companion}: cannot be read ({e}); shard copies it into every rank"
            ) from e
    _check_out_location(source.root, out, ranks)
    created = _make_dirs(out)
    try:
        # Held from before OUT is looked at until this run's ranks are in place (or removed).
        locks = _lock_ranks(out, ranks, wait)
        try:
            _check_out_dir(source.root, out, tp_size, ranks, force, locks)
            if report_sizes:
                report_sizes(sizes)
            return _write_ranks(source, shards, files, out, tp_size, ranks, sizes, kda_only,
                                progress, start)
        finally:
            locks.release()
    except BaseException:
        # A refused or failed run removes the directories it created, where nothing else is
        # left in them (an interrupted run's completed ranks stay, and so does OUT then).
        _remove_created(created)
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
    start: float,
) -> ShardResult:
    """:func:`shard_checkpoint`'s writing, with ``out`` checked and ``ranks`` locked."""
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
    futures: list[Future[tuple[int, Path, int, Path | None]]] = []
    try:
        for s in shards:
            futures.append(pool.submit(_write_rank, source, s, files, out, advance, kda_only))
        wait(futures)
        pool.shutdown()
    except KeyboardInterrupt:
        stop.set()
        _shutdown(pool)
        completed: list[int] = []
        for r, f in zip(ranks, futures):
            if not f.cancelled() and f.exception() is None:
                completed.append(r)
                replaced = f.result()[3]
                if replaced is not None:
                    _discard(replaced)
        present = {int(m.group(1)) for p in out.iterdir() if (m := _RANK_DIR.match(p.name))}
        remaining = tuple(r for r in range(tp_size) if r not in present)
        raise ShardInterrupted(out, tp_size, tuple(completed), remaining) from None
    failed = [error for f in futures if (error := f.exception()) is not None]
    if failed:
        # All or nothing: a failed run (e.g. a full disk) also removes the ranks it completed,
        # moving each aside in one rename first, so no incomplete rank{r} is ever visible.
        # Only directories this run created (same inode) are removed, never another
        # process's.
        # A rank directory this run replaced is put back.
        for f in futures:
            if f.exception() is None:
                _, final, inode, old = f.result()
                try:
                    if final.stat().st_ino == inode:
                        _remove_dir(final, out)
                        if old is not None:
                            os.replace(old, final)
                except OSError:
                    continue
        raise failed[0]
    for f in futures:
        replaced = f.result()[3]
        if replaced is not None:
            _discard(replaced)
    written = sum(f.result()[0] for f in futures)
    return ShardResult(out, tp_size, ranks, written, time.perf_counter() - start)


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
    files = _names_by_file(source)
    return _sizes(source, shards, kda_only_files(files, shards[0]) if kda_only else files,
                  kda_only)


def _checked_ranks(tp_size: int, ranks: Iterable[int] | None) -> tuple[int, tuple[int, ...] | None]:
    """``tp_size`` as an int and ``ranks`` sorted (None: all, expanded by :func:`_rank_views`
    once the checkpoint has bounded ``tp_size``).

    Raises:
        PlanError: ``tp_size`` not a positive integer, or no ranks.
    """
    if isinstance(tp_size, bool) or not isinstance(tp_size, (int, np.integer)) or tp_size < 1:
        raise PlanError(f"tp_size must be a positive integer, got {tp_size!r}")
    tp_size = int(tp_size)
    if ranks is None:
        return tp_size, None
    wanted = tuple(sorted({int(r) for r in ranks}))
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
    """One view per rank of ``ranks`` (None: all). Rank 0's plan and view come first: the plan
    refuses a tp_size the heads cannot split and the view checks the heads against the tensors
    on disk, so tp_size is bounded by the checkpoint before anything is made per rank."""

    def view(r: int) -> KdaShardedSource:
        plan = KdaTpPlan.from_config(source, r, tp_size, qk_multiple=qk_multiple, layers=layers)
        return KdaShardedSource(source, plan, layers)

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
    kda, other = [], []
    for s in shards:
        sliced = [_nbytes(*checked_info(s, n)) for n in names if s.is_sharded(n)]
        whole = [_nbytes(*checked_info(s, n)) for n in names if not s.is_sharded(n)]
        kda.append(sum(sliced))
        other.append(sum(whole))
    return ShardSizes(
        input_bytes=sum(_nbytes(*checked_info(source, n)) for n in source.names()),
        ranks=tuple(s.plan.tp_rank for s in shards),
        kda_bytes=tuple(kda),
        other_bytes=tuple(other),
        kda_only=kda_only,
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
    source: SafetensorsSource, *, allow_resharding: bool = False, skip_unindexed: bool = False
) -> None:
    """Refuse an input :func:`shard_checkpoint` refuses before it looks at the geometry: a rank
    directory kda-tp wrote (``tp_rank``/``tp_size`` in its headers) unless
    ``allow_resharding``, and ``.safetensors`` files the index does not name
    (:func:`unindexed_files`) unless ``skip_unindexed``.

    Args:
        source: the input checkpoint.
        allow_resharding: accept a rank directory (``--allow-resharding``).
        skip_unindexed: accept files the index does not name (``--skip-unindexed``).

    Raises:
        CheckpointError: either, naming the file(s) and the flag that accepts them.
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


def unindexed_files(source: SafetensorsSource) -> list[Path]:
    """The ``.safetensors`` files in an indexed checkpoint directory that its index does not
    name (e.g. a multi-token-prediction head shipped beside the index), sorted; empty for a
    single-file checkpoint. Loaders that follow the index never read them, and neither does
    the shard writer."""
    if not source.path.is_dir() or not (source.root / INDEX_NAME).is_file():
        return []
    indexed = {path.name for path, _ in source.files()}
    return sorted(p for p in source.root.glob("*.safetensors") if p.name not in indexed)


def finish_command(
    checkpoint: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    tp_size: int,
    ranks: Iterable[int],
    qk_multiple: int = 256,
) -> str:
    """The ``kda-tp shard`` command line that writes ``ranks`` (shell-quoted paths)."""
    command = (
        f"kda-tp shard {shlex.quote(str(checkpoint))} --tp-size {tp_size} "
        f"--out {shlex.quote(str(out_dir))} --ranks {','.join(map(str, ranks))}"
    )
    return command + (f" --qk-multiple {qk_multiple}" if qk_multiple != 256 else "")


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return tensor_nbytes(dtype, shape)


def _names_by_file(source: SafetensorsSource) -> dict[str, list[str]]:
    """Input file name -> its tensor names in data order."""
    files: dict[str, list[str]] = {}
    for name in source.names():
        path = source.file_of(name)
        if path is None:
            raise missing_tensor(source, name)
        files.setdefault(path.name, []).append(name)
    return files


def kda_only_files(
    files: dict[str, list[str]], shard: KdaShardedSource
) -> dict[str, list[str]]:
    """``files`` (input file name -> tensor names) cut down to the KDA tensors ``shard`` slices;
    files left without one are dropped, so a KDA-only rank mirrors the input's file names."""
    kept = {f: [n for n in names if shard.is_sharded(n)] for f, names in files.items()}
    return {f: names for f, names in kept.items() if names}


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
    ``ranks``. ``force`` allows replacing finished rank directories.

    The ranks' locks (``OUT/.rank{r}.lock``, see :func:`shard_checkpoint`) are held while
    ``out`` is checked and cleaned, and released on return; a partial directory is removed only
    while its rank's lock is held, so only a dead writer's.

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
            output that ``force`` does not allow replacing, cannot be created or listed, or
            another live process holds the lock of one of ``ranks`` (without ``wait``).
    """
    _check_out_location(root, out, ranks)
    created = _make_dirs(out)
    try:
        locks = _lock_ranks(out, ranks, wait)
        try:
            _check_out_dir(root, out, tp_size, ranks, force, locks)
        finally:
            locks.release()
    except BaseException:
        _remove_created(created)
        raise
    return created


def _check_out_location(root: Path, out: Path, ranks: tuple[int, ...]) -> None:
    """Refuse an ``out`` inside the input, or one whose rank directories hold the input."""
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


def _make_dirs(out: Path) -> list[Path]:
    """``out.mkdir(parents=True)``, returning the directories created, deepest first (a
    directory another process creates meanwhile is not counted)."""
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
            _remove_created(created[::-1])
            raise OutputError(
                f"{out}: cannot create the output directory: {path} exists and is not a directory"
            ) from None
        except OSError as e:
            _remove_created(created[::-1])
            raise OutputError(f"{out}: cannot create the output directory: {e}") from e
        created.append(path)
    return created[::-1]


def _remove_created(created: list[Path]) -> None:
    """Remove the directories a run created (deepest first) where they are empty again; one
    that is not (another process wrote into it) stays, and so do its parents."""
    for path in created:
        try:
            path.rmdir()
        except OSError:
            return


class _RankLocks:
    """The lock files (path, descriptor) a writer holds, one per rank, each under ``flock``."""

    def __init__(self) -> None:
        self.held: dict[int, tuple[Path, int]] = {}

    def release(self) -> None:
        """Remove each lock file while still holding its lock, then unlock it (by closing). A
        process that opened the file before it was removed and then gets the lock sees that its
        file is no longer at that path, and locks the new one (:func:`_lock_rank`)."""
        for path, fd in self.held.values():
            try:
                path.unlink(missing_ok=True)
            except OSError:
                pass  # e.g. the directory became read-only: the lock is released all the same
            os.close(fd)
        self.held.clear()


def _lock_ranks(out: Path, ranks: Iterable[int], wait: bool) -> _RankLocks:
    """Lock ``OUT/.rank{r}.lock`` for each rank, in rank order (so that waiting writers never
    deadlock); on any failure the locks taken so far are released."""
    locks = _RankLocks()
    try:
        for r in sorted(ranks):
            locks.held[r] = _lock_rank(out, r, wait)
    except BaseException:
        locks.release()
        raise
    return locks


def _lock_rank(out: Path, rank: int, wait: bool) -> tuple[Path, int]:
    """Take the exclusive ``flock`` of rank ``rank``'s lock file, then record this process
    (pid, host, start time, UTC) in it for the message of a writer it refuses.

    Raises:
        OutputError: another process holds the lock (without ``wait``), or the lock file
            cannot be created or locked.
    """
    path = out / f".rank{rank}.lock"
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise OutputError(f"{path}: cannot create the lock file of rank {rank}: {e}") from e
        try:
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
            try:
                current = os.stat(path)
            except FileNotFoundError:
                current = None
            mine = os.fstat(fd)
            if current is not None and (current.st_dev, current.st_ino) == (
                mine.st_dev, mine.st_ino
            ):
                started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
                line = f"pid {os.getpid()} on {socket.gethostname()}, started {started}\n"
                os.ftruncate(fd, 0)
                os.pwrite(fd, line.encode(), 0)
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


def _check_out_dir(
    root: Path,
    out: Path,
    tp_size: int,
    ranks: tuple[int, ...],
    force: bool,
    locks: _RankLocks,
) -> None:
    """:func:`prepare_out_dir`'s check and clean-up of ``out``, with ``ranks`` locked in
    ``locks`` (and any other rank whose directory ``force`` removes added to them)."""
    input_root = root.resolve()
    try:
        entries = sorted(out.iterdir())
    except OSError as e:
        raise OutputError(f"{out}: cannot list the output directory: {e}") from e
    existing: list[Path] = []
    for entry in entries:
        if _LOCK_FILE.match(entry.name):
            continue  # a writer's lock (ours, or another rank's writer)
        partial, final = _PARTIAL_DIR.match(entry.name), _RANK_DIR.match(entry.name)
        if (partial or final) and (resolve_out(entry) == input_root or _holds(entry, input_root)):
            # Never remove or replace the input, whatever its name.
            raise OutputError(
                f"{entry} is (or holds) the input checkpoint {root}; choose another --out"
            )
        if partial and int(partial.group(1)) in ranks:
            _discard(entry)  # left by a killed run
        elif final and int(final.group(1)) in ranks and not force:
            found = _rank_tp_size(entry)
            if found is not None and found != tp_size:
                raise OutputError(
                    f"{entry} holds output for tp_size {found}, not {tp_size}; "
                    "pass --force to replace it (or choose another --out)"
                )
            existing.append(entry)
        elif final and int(final.group(1)) not in ranks:
            # Another run's rank: it must belong to the same world size.
            found = _rank_tp_size(entry)
            if found != tp_size:
                if not force:
                    raise OutputError(
                        f"{entry} holds output for tp_size {found or 'unknown'}, not {tp_size}; "
                        "pass --force to replace it"
                    )
                # Another rank: removed only while no live writer holds it (never waiting
                # here: the ranks' locks are taken in order, and this one is out of order).
                r = int(final.group(1))
                if r not in locks.held:
                    locks.held[r] = _lock_rank(out, r, wait=False)
                _remove_dir(entry, out)
        elif not (partial or final) and not force:
            raise OutputError(
                f"{out} is not empty (it holds {entry.name}); pass --force to write into it"
            )
    if existing:
        present = {int(m.group(1)) for p in entries if (m := _RANK_DIR.match(p.name))}
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


def _remove_dir(path: Path, out: Path) -> None:
    """Remove a directory after moving it aside in one rename, so it never lingers half-deleted
    under its own name (the aside name is a partial name, cleaned by a later run)."""
    aside = out / f".{path.name}.partial-removed-{os.getpid()}"
    os.replace(path, aside)
    _discard(aside)


def _discard(path: Path) -> None:
    """Remove a directory of this output, or, when it is a symbolic link (``rank0`` pointing
    elsewhere) or a plain file, the link or file alone: what a link points to is never
    touched."""
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)  # a link, or a plain file named rank{r} that --force replaced
    else:
        shutil.rmtree(path, ignore_errors=True)


def _write_rank(
    source: SafetensorsSource,
    shard: KdaShardedSource,
    files: dict[str, list[str]],
    out: Path,
    advance: Callable[[int], None] | None,
    kda_only: bool = False,
) -> tuple[int, Path, int, Path | None]:
    """Write ``shard``'s rank into a partial directory, then rename it into place (with
    ``kda_only``, the KDA-only metadata and no companion files).

    Returns the tensor bytes written, the rank directory, its inode (to recognise it), and where
    the directory it replaced was moved (None if there was none).
    """
    plan = shard.plan
    partial = out / f".rank{plan.tp_rank}.partial-{os.getpid()}"

    previous: list[str] = []

    def release_previous() -> None:
        # The writer is done with a tensor once it asks for the next one: drop its pages from
        # this process (the page cache keeps them), so the resident set stays near one tensor.
        if previous:
            source.release(previous.pop())

    def fetch(name: str, count: bool = True) -> np.ndarray:
        release_previous()
        data = checked_get(shard, name).data
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
        partial.mkdir()
        input_meta = {path.name: meta or {} for path, meta in source.files()}
        fingerprint = _input_fingerprint(source)
        weight_map: dict[str, str] = {}
        total = 0
        for file_name, names in files.items():
            metadata = {
                **input_meta.get(file_name, {}),
                "tp_rank": str(plan.tp_rank),
                "tp_size": str(plan.tp_size),
                "kda_tp_qk_multiple": str(plan.qk_multiple),
                "kda_tp_layers": json.dumps(list(shard.layers)),
                "kda_tp_version": __version__,
                "kda_tp_input": fingerprint,
            }
            if kda_only:
                metadata.update(kda_tp_kda_only="1", kda_tp_source=str(source.path.resolve()))
            specs = []
            for name in names:
                dtype, shape = checked_info(shard, name)
                specs.append(
                    (name, dtype, shape, _nbytes(dtype, shape), lambda n=name: get_bytes(n))
                )
            total += write_safetensors(partial / file_name, specs, metadata, sync=False)
            release_previous()
            weight_map.update(dict.fromkeys(names, file_name))
        write_index(partial / INDEX_NAME, weight_map, total, sync=False)
        for extra in [] if kda_only else _companion_files(source):
            shutil.copy2(extra, partial / extra.name)
        inode = partial.stat().st_ino
        if final.exists() or final.is_symlink():
            # Keep the old directory (or link) aside (one rename) until the whole run has succeeded, so a
            # failed --force rerun can put it back; its name is a partial name, so a run killed
            # before then leaves it for the next run to clean.
            old = out / f".rank{plan.tp_rank}.partial-old-{os.getpid()}"
            os.replace(final, old)
        os.replace(partial, final)
    except BaseException as e:
        shutil.rmtree(partial, ignore_errors=True)
        if old is not None and not final.exists():
            os.replace(old, final)
        if isinstance(e, OSError):
            raise OutputError(f"{partial}: writing rank {plan.tp_rank} failed: {e}") from e
        raise
    return total, final, inode, old


#: Bytes read from the start and the end of each file's data for :func:`_input_fingerprint`.
_FINGERPRINT_SAMPLE = 4096


def _input_fingerprint(source: SafetensorsSource) -> str:
    """A hex digest of the checkpoint's tensor names, dtypes and full shapes, and of the first
    and last 4 KiB of each file's data (a fine-tune has the base model's names and shapes).

    ``shard`` records it in every rank's header (``kda_tp_input``) so that ``verify`` can tell
    output made from another checkpoint from a damaged output.

    Raises:
        CheckpointError: a file cannot be read.
    """
    entries = sorted((name, *checked_info(source, name)) for name in source.names())
    digest = hashlib.sha256(json.dumps(entries).encode())
    for path, _ in source.files():
        try:
            with open(path, "rb") as f:
                data_start = 8 + int.from_bytes(f.read(8), "little")
                f.seek(data_start)
                digest.update(f.read(_FINGERPRINT_SAMPLE))
                end = os.fstat(f.fileno()).st_size
                f.seek(max(data_start, end - _FINGERPRINT_SAMPLE))
                digest.update(f.read(_FINGERPRINT_SAMPLE))
        except OSError as e:
            raise CheckpointError(f"{path}: cannot be read: {e}") from e
    return digest.hexdigest()[:32]


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


def _companion_files(source: SafetensorsSource) -> list[Path]:
    """The input's small non-weight files (config, tokenizer) to copy into each rank."""
    if not source.path.is_dir():
        config = source.root / "config.json"
        return [config] if config.is_file() else []
    return [
        p
        for p in sorted(source.root.iterdir())
        if p.is_file()
        and not p.name.startswith(".")
        and not p.name.endswith(".safetensors")
        and p.name != INDEX_NAME
    ]


@dataclass
class VerifyReport:
    """The outcome of :func:`verify_shards`.

    Attributes:
        tp_size: world size found in the output (0 when none was found).
        tensors: tensors checked (each across every rank).
        bytes_checked: input tensor bytes compared.
        problems: one line per mismatch, missing or unreadable piece; empty when everything
            matches.
        numeric: the numerical equivalence report, when requested.
        byte_seconds: wall time of the byte check (seconds).
        numeric_seconds: wall time of the numerical check (seconds; 0 when not run).
    """

    tp_size: int = 0
    tensors: int = 0
    bytes_checked: int = 0
    problems: list[str] = field(default_factory=list)
    numeric: EquivalenceReport | None = None
    byte_seconds: float = 0.0
    numeric_seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """True when every tensor matched (and the numerical check passed, if run)."""
        return not self.problems and (self.numeric is None or self.numeric.passed)

    def summary(self) -> str:
        """One line: what was checked and the verdict. A single problem is given in full;
        several are counted (they are in ``problems``)."""
        if len(self.problems) == 1:
            return f"FAIL: {self.problems[0]}"
        if self.problems:
            return f"FAIL: {len(self.problems)} problems"
        # The bytes match; the verdict is the numeric check's when it ran and failed.
        line = (
            f"{'OK' if self.ok else 'FAIL'}: {self.tensors} tensors x {self.tp_size} ranks "
            "rejoin to the input byte for "
            f"byte ({self.bytes_checked / 1e9:.3f} GB checked in {self.byte_seconds:.1f} s)"
        )
        if self.numeric is not None:
            verdict = "passes" if self.numeric.passed else "FAILS"
            n = len(self.numeric.layers)
            line += (f"; numerical TP equivalence {verdict} ({n} KDA layer{'s' * (n != 1)} in "
                     f"{self.numeric_seconds:.1f} s)")
        return line


def verify_shards(
    checkpoint: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    numeric: bool = False,
    seq_len: int = 16,
    seed: int = 0,
    layers: Iterable[int] | None = None,
    progress: ProgressFactory | None = None,
    numeric_progress: ProgressFactory | None = None,
) -> VerifyReport:
    """Check a ``kda-tp shard`` output against its input, byte for byte.

    For every tensor of the input: each rank holds it with the dtype and the local shape the
    plan gives; KDA tensors rejoin to the input (row slices concatenated in rank order,
    ``o_proj`` column slices side by side, replicated tensors equal on every rank; a zero-padded
    ``A_log`` rejoins to its heads, its padding checked to be zero); every other
    tensor is identical on every rank. Every rank ``0..tp_size-1`` must be present and complete,
    with matching ``tp_rank``/``tp_size`` metadata, and no rank may hold extra tensors, nor
    any file ``shard`` does not write (an extra ``.safetensors`` no index names, a stray file:
    a problem naming the file). A problem names the tensor and the rank(s) whose bytes differ.
    Each rank must hold the input's companion files (``config.json``, tokenizer files: every
    file ``shard`` copies) byte for byte; one missing or different is a problem naming the rank
    and the file.
    ``--kda-only`` output (``kda_tp_kda_only`` in its metadata) is checked on the KDA tensors
    alone (it holds no companion file), and a rank holding any other tensor fails.

    With ``numeric``, also runs :func:`~kda_tp.check_tp_equivalence` on the rank directories:
    each KDA layer's full output against the sum of the ranks' partial outputs.

    Args:
        checkpoint: the input given to ``shard`` (directory or single file).
        out_dir: the ``--out`` directory holding ``rank{r}/``.
        numeric: also run the numerical check.
        seq_len: tokens of the numerical check's random input.
        seed: seed of that input's random generator.
        layers: 0-based KDA layers to check numerically (default: every KDA layer); the byte
            check always covers every tensor.
        progress: called once with the number of input tensors; returns ``advance(n)``, called
            after each tensor is checked.
        numeric_progress: the same for the numerical check, per KDA layer.

    Memory: each tensor's mapped pages (input and ranks) are dropped from the process once it
    is checked, and a copy held whole by every rank is compared one rank at a time, so the byte
    check's resident set stays near the largest tensor's size plus its rejoined copy (Kimi K3
    demo, TP 8: 0.77 GB peak RSS, 6.2 GB before). The numerical check holds one KDA layer's weights as float32
    at a time (see :func:`~kda_tp.check_tp_equivalence`): on the Kimi K3 demo (1.4 GB input,
    one 0.89 GB BF16 KDA layer, 1.78 GB as float32) ``verify --numeric`` peaks at 2.0 GB RSS
    (7.9 GB before pages were dropped and float32 copies shared).

    A rank directory that cannot be read (a truncated or damaged file, a broken index) is a
    problem of the output, so the report fails; it is not raised.

    Raises:
        CheckpointError: the input cannot be read; ``out_dir``
            holds other things but no ``rank{r}`` directory (not a kda-tp output), or was
            sharded from another checkpoint (its headers record a digest of the input's
            tensor names, dtypes, shapes and some data bytes, and it differs).
        PlanError: ``layers`` refused (negative, repeated, out of range or
            1-based).
    """
    source = SafetensorsSource(checkpoint)
    out = Path(out_dir)
    report = VerifyReport()
    entries = _listdir(out)
    present = {int(m.group(1)) for p in entries if (m := _RANK_DIR.match(p.name))}
    if not present:
        if all(_PARTIAL_DIR.match(p.name) or _LOCK_FILE.match(p.name) for p in entries):
            # Empty, or only what a killed run leaves: an output not yet complete.
            report.problems.append(f"{out}: no rank directory yet (incomplete run?)")
            return report
        hint = (f"; it is one rank of an output: pass its parent directory {out.parent}"
                if _RANK_DIR.match(out.name) else "")
        raise CheckpointError(
            f"{out}: not a kda-tp shard output (no rank{{r}} directory in it){hint}"
        )
    start = time.perf_counter()
    # A rank that cannot be read is damaged output: a failed verification, not refused input.
    opened: dict[int, SafetensorsSource] = {}
    for r in sorted(present):
        try:
            opened[r] = SafetensorsSource(rank_dir(out, r))
        except CheckpointError as e:
            report.problems.append(f"{rank_dir(out, r)}: rank {r} cannot be read: {e}")
            continue
        if not opened[r].files():
            del opened[r]
            report.problems.append(f"{rank_dir(out, r)}: holds no safetensors file")
    if not opened:
        return report
    first = rank_dir(out, min(opened))
    meta = opened[min(opened)].files()[0][1] or {}
    try:
        tp_size = parse_metadata_int(meta["tp_size"], "tp_size", str(first))
        qk_multiple = parse_metadata_int(meta.get("kda_tp_qk_multiple", "256"),
                                         "kda_tp_qk_multiple", str(first))
        kda_layers = (parse_json(meta["kda_tp_layers"], f"{first}: metadata kda_tp_layers")
                      if "kda_tp_layers" in meta else None)
        if tp_size < 1:
            raise ValueError(f"tp_size {tp_size} is not positive")
        if kda_layers is not None and not (
            isinstance(kda_layers, list)
            and all(isinstance(i, int) and not isinstance(i, bool) for i in kda_layers)
        ):
            raise ValueError(f"kda_tp_layers {meta['kda_tp_layers']!r} is not a list of ints")
    except (KeyError, ValueError) as e:
        raise CheckpointError(
            f"{first}: no valid kda-tp metadata ({e}); not a kda-tp shard output"
        ) from None
    recorded = meta.get("kda_tp_input")
    if recorded is not None and recorded != _input_fingerprint(source):
        raise CheckpointError(
            f"{out} was sharded from another checkpoint, not {checkpoint} (or this one has "
            "changed since): the tensor names, dtypes, shapes and data samples its headers "
            "record differ from this checkpoint's; verify it against the checkpoint it was made "
            "from"
        )
    report.tp_size = tp_size
    if numeric and layers is not None:
        known = kda_layers if kda_layers is not None else kda_layer_indices(source, None)
        layers = check_layers(layers, known, layer_count(source))
    # The plan refuses a tp_size the heads cannot split (so it stays small) before any listing.
    plans = [KdaTpPlan.from_config(source, 0, tp_size, qk_multiple=qk_multiple, layers=kda_layers)]
    extra = sorted(r for r in present if r >= tp_size)
    if extra:
        report.problems.append(f"{out}: rank directories {extra[:8]} beyond tp_size {tp_size}")
    missing = [r for r in range(tp_size) if r not in present]
    if missing:
        shown = ", ".join(map(str, missing[:8])) + (
            f", ... ({len(missing) - 8} more)" if len(missing) > 8 else ""
        )
        report.problems.append(
            f"{out}: {len(missing)} of {tp_size} ranks missing: [{shown}] (incomplete run?); "
            f"finish with: {finish_command(checkpoint, out, tp_size, missing, qk_multiple)}"
        )
    if report.problems:
        return report
    ranks = [opened[r] for r in range(tp_size)]
    plans += [
        KdaTpPlan.from_config(source, r, tp_size, qk_multiple=qk_multiple, layers=kda_layers)
        for r in range(1, tp_size)
    ]
    shards = [KdaShardedSource(source, plan, kda_layers) for plan in plans]
    # A --kda-only output holds the KDA tensors and nothing else.
    kda_only = meta.get("kda_tp_kda_only") == "1"
    names = [n for n in source.names() if not kda_only or shards[0].is_sharded(n)]
    # The files shard writes into every rank; anything else in a rank directory (an extra
    # .safetensors no index names, a stray file) is not the output shard made.
    files = _names_by_file(source)
    written = {INDEX_NAME, *(kda_only_files(files, shards[0]) if kda_only else files)}
    if not kda_only:
        written.update(p.name for p in _companion_files(source))
    for r, rank in enumerate(ranks):
        for entry in sorted(_listdir(rank_dir(out, r))):
            if entry.name not in written:
                report.problems.append(
                    f"{entry}: rank {r} holds {entry.name}, which shard does not write (the "
                    f"input has no such file); remove it, or shard again"
                )
        for path, file_meta in rank.files():
            got = (file_meta or {}).get("tp_rank"), (file_meta or {}).get("tp_size")
            if got != (str(r), str(tp_size)):
                report.problems.append(f"{path}: metadata tp_rank/tp_size {got}, expected {(r, tp_size)}")
        unexpected = sorted(set(rank.names()) - set(names))
        if unexpected:
            what = "KDA tensors of the input" if kda_only else "the input"
            report.problems.append(
                f"{rank.root}: {len(unexpected)} tensor(s) not in {what}, e.g. {unexpected[0]}"
            )

    if not kda_only:
        report.problems += _companion_problems(source, out, tp_size)

    advance = progress(len(names)) if progress else None
    for name in names:
        full = checked_get(source, name)
        parts = [rank.get(name) for rank in ranks]
        report.tensors += 1
        report.bytes_checked += full.nbytes
        problem = _check_tensor(name, full, parts, shards, lambda r: ranks[r].release(name))
        if problem:
            report.problems.append(problem)
        # Done with this tensor: drop its pages from this process (the page cache keeps them),
        # so the resident set stays near one tensor, not the input plus every rank.
        del full, parts
        source.release(name)
        for rank in ranks:
            rank.release(name)
        if advance:
            advance(1)
    report.byte_seconds = time.perf_counter() - start
    if numeric:
        from .equivalence import check_tp_equivalence  # noqa: PLC0415 - start-up time

        start = time.perf_counter()
        report.numeric = check_tp_equivalence(
            source,
            tp_size,
            kda_layers if layers is None else layers,
            seq_len=seq_len,
            seed=seed,
            qk_multiple=qk_multiple,
            shard_source_factory=lambda _source, plan, _layers: ranks[plan.tp_rank],
            progress=numeric_progress,
        )
        report.numeric_seconds = time.perf_counter() - start
    return report


def _companion_problems(source: SafetensorsSource, out: Path, tp_size: int) -> list[str]:
    """One line per rank whose copy of an input companion file (:func:`_companion_files`:
    ``config.json``, tokenizer files) is missing or differs from the input's, byte for byte."""
    problems = []
    for r in range(tp_size):
        for original in _companion_files(source):
            copy = rank_dir(out, r) / original.name
            if not copy.is_file():
                problems.append(
                    f"{copy}: rank {r} lacks {original.name} (shard copies the input's "
                    f"{original} into every rank)"
                )
                continue
            try:
                want = original.read_bytes()
            except OSError as e:
                raise CheckpointError(f"{original}: the input's file cannot be read: {e}") from e
            try:
                same = want == copy.read_bytes()
            except OSError as e:
                problems.append(f"{copy}: rank {r}'s {original.name} cannot be read: {e}")
                continue
            if not same:
                problems.append(
                    f"{copy}: rank {r}'s {original.name} differs from the input's {original}"
                )
    return problems


def _listdir(path: Path) -> list[Path]:
    try:
        return list(path.iterdir())
    except OSError as e:
        raise CheckpointError(f"{path}: cannot list the shard directory: {e}") from e


def _check_tensor(
    name: str,
    full: Tensor,
    records: list[Tensor | None],
    shards: list[KdaShardedSource],
    release: Callable[[int], None],
) -> str | None:
    """One line describing how ``records`` (one per rank, None where the rank lacks ``name``)
    fail to rejoin to ``full``, naming the ranks whose bytes differ. A whole copy on every rank
    (passed through or replicated) is compared rank by rank, calling ``release(r)`` after rank
    ``r``'s, so only one copy is resident at a time."""
    parts: list[Tensor] = []  # the records, each checked to be there with the planned shape
    for r, (part, shard) in enumerate(zip(records, shards)):
        if part is None:
            return f"{name}: missing from rank {r}"
        expected = checked_info(shard, name)
        if (part.dtype, tuple(part.shape)) != expected:
            return f"{name}: rank {r} has {part.dtype} {list(part.shape)}, expected {expected[0]} {list(expected[1])}"
        parts.append(part)
    full_bytes = full.data
    entry = shards[0].plan_entry(name)
    if entry is None or entry.kind == KdaShard.REPLICATED:
        differ = []
        for r, p in enumerate(parts):
            if not np.array_equal(p.data, full_bytes):
                differ.append(r)
            release(r)
        if entry is None:  # not sliced: the same bytes on every rank
            return f"{name}: the copy on {_ranks(differ)} differs from the input" if differ else None
        return (
            f"{name}: the replicated copy on {_ranks(differ)} differs from the input"
            if differ
            else None
        )
    if entry.name.endswith(".scale"):
        # Block scales: each rank holds the blocks covering its weight range; ranks whose range
        # lies inside one block share it, so check each rank's grid instead of rejoining.
        grid = full_bytes.reshape(entry.full_rows, -1)
        for r, (part, shard) in enumerate(zip(parts, shards)):
            e = shard.plan_entry(name)
            # Every rank's adapter plans the same tensors (one source, one layer list), and
            # rank 0's plans this one.
            assert e is not None
            cols = slice(e.src_col_offset * e.elem_bytes,
                         (e.src_col_offset + e.local_row_elems) * e.elem_bytes)
            want = grid[e.src_row_offset : e.src_row_offset + e.local_rows, cols]
            if not np.array_equal(part.data, want.ravel()):
                return f"{name}: rank {r}'s scale blocks differ from the input's covering blocks"
        return None
    if entry.kind == KdaShard.CHANNEL_COLS:
        rows = entry.full_rows
        pieces = [p.data.reshape(rows, -1) for p in parts]
        rejoined = np.concatenate(pieces, axis=1).ravel()
        bounds = np.cumsum([0] + [piece.shape[1] for piece in pieces])
        full_2d = full_bytes.reshape(rows, -1)
        slices = [full_2d[:, lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])]
    else:
        rejoined = np.concatenate([p.data for p in parts])
        # A zero-padded A_log (Kimi K3) rejoins to its heads; the adapter checked the padding.
        full_bytes = full_bytes[: rejoined.nbytes]
        pieces = [p.data for p in parts]
        bounds = np.cumsum([0] + [p.nbytes for p in parts])
        slices = [full_bytes[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])]
    if np.array_equal(rejoined, full_bytes):
        return None
    differ = [r for r, (got, want) in enumerate(zip(pieces, slices))
              if not np.array_equal(got, want)]
    return (
        f"{name}: the ranks' {entry.kind.name} slices do not rejoin to the input "
        f"(the slice on {_ranks(differ)} differs)"
    )


def _ranks(ranks: list[int]) -> str:
    """``rank 1`` or ``ranks 0, 2``, for messages."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"

