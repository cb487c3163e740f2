"""Writing one checkpoint directory per tensor-parallel rank, and verifying them.

Layout written by ``kda-tp shard CHECKPOINT --tp-size T --out OUT``::

    OUT/rank0/ ... OUT/rank{T-1}/
        config.json and the input's other small files, unchanged;
        the input's safetensors file names, each holding the same tensors as in the input
        (KDA tensors as this rank's slice, with local shapes), ``__metadata__`` carrying
        ``tp_rank``, ``tp_size``, ``kda_tp_qk_multiple`` and ``kda_tp_layers``;
        model.safetensors.index.json.

A rank is written into a hidden ``OUT/.rank{r}.partial-<pid>`` directory and renamed to
``OUT/rank{r}`` only when every file in it is complete, so a run killed at any point leaves no
incomplete ``rank{r}``. Several processes may write different ranks into one ``OUT`` at once.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ._io import DTYPE_SIZES, FileRange, write_index, write_safetensors
from ._native import __version__
from .errors import CheckpointError, DtypeMismatchError, KdaTpError, OutputError, PlanError
from .plan import KdaShard, KdaTpPlan
from .source import KdaShardedSource, SafetensorsSource, Tensor

# Imported where verify_shards(numeric=True) needs it, so `kda-tp shard` starts faster.
if TYPE_CHECKING:
    from .equivalence import EquivalenceReport

__all__ = ["ShardResult", "VerifyReport", "rank_dir", "shard_checkpoint", "verify_shards"]

INDEX_NAME = "model.safetensors.index.json"
_RANK_DIR = re.compile(r"^rank(\d+)$")
_PARTIAL_DIR = re.compile(r"^\.rank(\d+)\.partial-")

#: ``progress(total_bytes)`` returns an ``advance(nbytes)`` callable.
ProgressFactory = Callable[[int], Callable[[int], None]]


def rank_dir(out_dir: str | os.PathLike[str], tp_rank: int) -> Path:
    """The directory holding rank ``tp_rank``'s checkpoint under ``out_dir``."""
    return Path(out_dir) / f"rank{tp_rank}"


@dataclass(frozen=True)
class ShardResult:
    """What :func:`shard_checkpoint` wrote: ``ranks`` of ``tp_size`` under ``out_dir``,
    ``bytes_written`` tensor bytes (headers excluded, summed over ranks) in ``seconds``."""

    out_dir: Path
    tp_size: int
    ranks: tuple[int, ...]
    bytes_written: int
    seconds: float


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
        progress: called once with the total bytes to write; returns ``advance(nbytes)``.

    Raises:
        CheckpointError, PlanError, DtypeMismatchError, ShapeMismatchError: bad input; nothing
            is written.
        OutputError: the output directory is refused, or a write fails (e.g. a full disk);
            nothing of this run is left behind: the ranks it completed are removed again and
            rank directories it replaced under ``force`` are put back (a run killed outright may
            leave complete ``rank{r}`` directories, never incomplete ones, and ``verify``
            rejects the set until every rank is there).
    """
    start = time.perf_counter()
    source = SafetensorsSource(checkpoint, backend)
    out = Path(out_dir)
    if isinstance(tp_size, bool) or not isinstance(tp_size, (int, np.integer)) or tp_size < 1:
        raise PlanError(f"tp_size must be a positive integer, got {tp_size!r}")
    tp_size = int(tp_size)
    ranks = tuple(range(tp_size)) if ranks is None else tuple(sorted({int(r) for r in ranks}))
    if not ranks:
        raise PlanError("no ranks to write: --ranks is empty")
    shards = [
        KdaShardedSource(
            source, KdaTpPlan.from_config(
                source, r, tp_size, qk_multiple=qk_multiple, layers=layers
            ), layers
        )
        for r in ranks
    ]
    for name in source.names():
        dtype = source.info(name)[0]
        if dtype not in DTYPE_SIZES:
            raise DtypeMismatchError(
                f"{source.file_of(name)}: {name}: dtype {dtype} cannot be copied to the shards "
                f"(whole-byte dtypes only: {', '.join(DTYPE_SIZES)})"
            )
    _prepare_out_dir(source.root, out, tp_size, ranks, force)
    files = _names_by_file(source)
    total = sum(_nbytes(*s.info(name)) for s in shards for name in source.names())
    advance = progress(total) if progress else None
    # Ranks are independent; the copies and writes release the GIL, so threads overlap them.
    with ThreadPoolExecutor(max_workers=min(len(shards), os.cpu_count() or 1)) as pool:
        futures = [pool.submit(_write_rank, source, s, files, out, advance) for s in shards]
    failed = [f.exception() for f in futures if f.exception() is not None]
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
        if f.result()[3] is not None:
            shutil.rmtree(f.result()[3], ignore_errors=True)
    written = sum(f.result()[0] for f in futures)
    return ShardResult(out, tp_size, ranks, written, time.perf_counter() - start)


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return int(np.prod(shape, dtype=np.int64)) * DTYPE_SIZES[dtype]


def _names_by_file(source: SafetensorsSource) -> dict[str, list[str]]:
    """Input file name -> its tensor names in data order."""
    files: dict[str, list[str]] = {}
    for name in source.names():
        files.setdefault(source.file_of(name).name, []).append(name)
    return files


def _prepare_out_dir(
    root: Path, out: Path, tp_size: int, ranks: tuple[int, ...], force: bool
) -> None:
    """Create ``out`` or check what it holds; remove stale partial directories of ``ranks``."""
    resolved, input_root = out.resolve(), root.resolve()
    if resolved == input_root or input_root in resolved.parents:
        raise OutputError(f"{out}: the output directory lies inside the input checkpoint {root}")
    for r in ranks:
        # e.g. re-sharding OUT/rank0 into OUT: --force would delete the input.
        final = rank_dir(out, r).resolve()
        if final == input_root or final in input_root.parents:
            raise OutputError(
                f"{rank_dir(out, r)}: this rank's output directory is (or holds) the input "
                f"checkpoint {root}; choose another --out"
            )
    try:
        out.mkdir(parents=True, exist_ok=True)
        entries = sorted(out.iterdir())
    except OSError as e:
        raise OutputError(f"{out}: cannot create or list the output directory: {e}") from e
    for entry in entries:
        partial, final = _PARTIAL_DIR.match(entry.name), _RANK_DIR.match(entry.name)
        if (partial or final) and (entry.resolve() == input_root or _holds(entry, input_root)):
            # Never remove or replace the input, whatever its name.
            raise OutputError(
                f"{entry} is (or holds) the input checkpoint {root}; choose another --out"
            )
        if partial and int(partial.group(1)) in ranks:
            shutil.rmtree(entry, ignore_errors=True)  # left by a killed run
        elif final and int(final.group(1)) in ranks and not force:
            raise OutputError(f"{entry} already exists; pass --force to overwrite it")
        elif final and int(final.group(1)) not in ranks:
            # Another run's rank: it must belong to the same world size.
            found = _rank_tp_size(entry)
            if found != tp_size:
                if not force:
                    raise OutputError(
                        f"{entry} holds output for tp_size {found or 'unknown'}, not {tp_size}; "
                        "pass --force to replace it"
                    )
                _remove_dir(entry, out)
        elif not (partial or final) and not force:
            raise OutputError(
                f"{out} is not empty (it holds {entry.name}); pass --force to write into it"
            )


def _holds(directory: Path, path: Path) -> bool:
    """Whether resolved ``path`` lies inside ``directory``."""
    return directory.resolve() in path.parents


def _rank_tp_size(path: Path) -> int | None:
    """The ``tp_size`` recorded in a rank directory's first file, or None if unreadable."""
    try:
        files = SafetensorsSource(path).files()
        return int((files[0][1] or {})["tp_size"]) if files else None
    except (KdaTpError, KeyError, ValueError, OSError):
        return None


def _remove_dir(path: Path, out: Path) -> None:
    """Remove a directory after moving it aside in one rename, so it never lingers half-deleted
    under its own name (the aside name is a partial name, cleaned by a later run)."""
    aside = out / f".{path.name}.partial-removed-{os.getpid()}"
    os.replace(path, aside)
    shutil.rmtree(aside, ignore_errors=True)


def _write_rank(
    source: SafetensorsSource,
    shard: KdaShardedSource,
    files: dict[str, list[str]],
    out: Path,
    advance: Callable[[int], None] | None,
) -> tuple[int, Path, int, Path | None]:
    """Write ``shard``'s rank into a partial directory, then rename it into place.

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
        data = shard.get(name).data
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
            }
            specs = []
            for name in names:
                dtype, shape = shard.info(name)
                specs.append(
                    (name, dtype, shape, _nbytes(dtype, shape), lambda n=name: get_bytes(n))
                )
            total += write_safetensors(partial / file_name, specs, metadata, sync=False)
            release_previous()
            weight_map.update(dict.fromkeys(names, file_name))
        write_index(partial / INDEX_NAME, weight_map, total, sync=False)
        for extra in _companion_files(source):
            shutil.copy2(extra, partial / extra.name)
        inode = partial.stat().st_ino
        if final.exists():
            # Keep the old directory aside (one rename) until the whole run has succeeded, so a
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


def _file_piece(
    source: SafetensorsSource,
    shard: KdaShardedSource,
    name: str,
    fallback: Callable[[], np.ndarray],
) -> FileRange | None:
    """This rank's bytes of ``name`` as one range of the input file, or None for a column
    slice (``o_proj``), which is not one range."""
    start, stop = 0, None
    if shard.is_sharded(name):
        byte_range = shard.plan[_plan_name(name)].byte_range
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
        problems: one line per mismatch or missing piece; empty when everything matches.
        numeric: the numerical equivalence report, when requested.
    """

    tp_size: int = 0
    tensors: int = 0
    bytes_checked: int = 0
    problems: list[str] = field(default_factory=list)
    numeric: EquivalenceReport | None = None

    @property
    def ok(self) -> bool:
        """True when every tensor matched (and the numerical check passed, if run)."""
        return not self.problems and (self.numeric is None or self.numeric.passed)

    def summary(self) -> str:
        """One line: what was checked and the verdict."""
        if self.problems:
            return f"FAIL: {len(self.problems)} problem(s); first: {self.problems[0]}"
        line = (
            f"OK: {self.tensors} tensors x {self.tp_size} ranks rejoin to the input byte for "
            f"byte ({self.bytes_checked / 1e9:.3f} GB checked)"
        )
        if self.numeric is not None:
            verdict = "passes" if self.numeric.passed else "FAILS"
            line += f"; numerical TP equivalence {verdict}"
        return line


def verify_shards(
    checkpoint: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    numeric: bool = False,
    seq_len: int = 16,
    seed: int = 0,
) -> VerifyReport:
    """Check a ``kda-tp shard`` output against its input, byte for byte.

    For every tensor of the input: each rank holds it with the dtype and the local shape the
    plan gives; KDA tensors rejoin to the input (row slices concatenated in rank order,
    ``o_proj`` column slices side by side, replicated tensors equal on every rank); every other
    tensor is identical on every rank. Every rank ``0..tp_size-1`` must be present and complete,
    with matching ``tp_rank``/``tp_size`` metadata, and no rank may hold extra tensors.

    With ``numeric``, also runs :func:`~kda_tp.check_tp_equivalence` on the rank directories:
    each KDA layer's full output against the sum of the ranks' partial outputs.

    Raises:
        CheckpointError: the input, or a rank directory's files, cannot be read.
    """
    source = SafetensorsSource(checkpoint)
    out = Path(out_dir)
    report = VerifyReport()
    present = {int(m.group(1)) for p in _listdir(out) if (m := _RANK_DIR.match(p.name))}
    if 0 not in present:
        report.problems.append(f"{out}: no rank0 directory (not a kda-tp output, or incomplete)")
        return report
    rank0 = SafetensorsSource(rank_dir(out, 0))
    if not rank0.files():
        report.problems.append(f"{rank_dir(out, 0)}: holds no safetensors file")
        return report
    meta = rank0.files()[0][1] or {}
    try:
        tp_size = int(meta["tp_size"])
        qk_multiple = int(meta.get("kda_tp_qk_multiple", 256))
        layers = json.loads(meta["kda_tp_layers"]) if "kda_tp_layers" in meta else None
        if tp_size < 1:
            raise ValueError(f"tp_size {tp_size} is not positive")
        if layers is not None and not (
            isinstance(layers, list)
            and all(isinstance(i, int) and not isinstance(i, bool) for i in layers)
        ):
            raise ValueError(f"kda_tp_layers {meta['kda_tp_layers']!r} is not a list of ints")
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"{rank_dir(out, 0)}: no valid kda-tp metadata ({e})") from None
    report.tp_size = tp_size
    # The plan refuses a tp_size the heads cannot split (so it stays small) before any listing.
    plans = [KdaTpPlan.from_config(source, 0, tp_size, qk_multiple=qk_multiple, layers=layers)]
    extra = sorted(r for r in present if r >= tp_size)
    if extra:
        report.problems.append(f"{out}: rank directories {extra[:8]} beyond tp_size {tp_size}")
    missing = [r for r in range(tp_size) if r not in present]
    if missing:
        report.problems.append(
            f"{out}: {len(missing)} of {tp_size} ranks missing, e.g. {missing[:8]} "
            "(incomplete run?)"
        )
        return report
    ranks = [rank0] + [SafetensorsSource(rank_dir(out, r)) for r in range(1, tp_size)]
    plans += [
        KdaTpPlan.from_config(source, r, tp_size, qk_multiple=qk_multiple, layers=layers)
        for r in range(1, tp_size)
    ]
    shards = [KdaShardedSource(source, plan, layers) for plan in plans]
    for r, rank in enumerate(ranks):
        for path, file_meta in rank.files():
            got = (file_meta or {}).get("tp_rank"), (file_meta or {}).get("tp_size")
            if got != (str(r), str(tp_size)):
                report.problems.append(f"{path}: metadata tp_rank/tp_size {got}, expected {(r, tp_size)}")
        extra = sorted(set(rank.names()) - set(source.names()))
        if extra:
            report.problems.append(f"{rank.root}: {len(extra)} tensor(s) not in the input, e.g. {extra[0]}")

    for name in source.names():
        full = source.get(name)
        parts = [rank.get(name) for rank in ranks]
        report.tensors += 1
        report.bytes_checked += full.nbytes
        problem = _check_tensor(name, full, parts, shards)
        if problem:
            report.problems.append(problem)
    if numeric:
        from .equivalence import check_tp_equivalence  # noqa: PLC0415 - start-up time

        report.numeric = check_tp_equivalence(
            source,
            tp_size,
            layers,
            seq_len=seq_len,
            seed=seed,
            qk_multiple=qk_multiple,
            shard_source_factory=lambda _source, plan, _layers: ranks[plan.tp_rank],
        )
    return report


def _listdir(path: Path) -> list[Path]:
    try:
        return list(path.iterdir())
    except OSError as e:
        raise CheckpointError(f"{path}: cannot list the shard directory: {e}") from e


def _check_tensor(
    name: str, full: Tensor, parts: list[Tensor | None], shards: list[KdaShardedSource]
) -> str | None:
    """One line describing how ``parts`` (one record per rank) fail to rejoin to ``full``."""
    for r, (part, shard) in enumerate(zip(parts, shards)):
        if part is None:
            return f"{name}: missing from rank {r}"
        expected = shard.info(name)
        if (part.dtype, tuple(part.shape)) != expected:
            return f"{name}: rank {r} has {part.dtype} {list(part.shape)}, expected {expected[0]} {list(expected[1])}"
    full_bytes = full.data
    if not shards[0].is_sharded(name):
        same = all(np.array_equal(p.data, full_bytes) for p in parts)
        return None if same else f"{name}: a rank's copy differs from the input"
    entry = shards[0].plan[_plan_name(name)]
    if entry.kind == KdaShard.REPLICATED:
        same = all(np.array_equal(p.data, full_bytes) for p in parts)
        return None if same else f"{name}: a replicated copy differs from the input"
    if entry.kind == KdaShard.CHANNEL_COLS:
        rows = entry.full_rows
        rejoined = np.concatenate([p.data.reshape(rows, -1) for p in parts], axis=1).ravel()
    else:
        rejoined = np.concatenate([p.data for p in parts])
    if np.array_equal(rejoined, full_bytes):
        return None
    return f"{name}: the ranks' {entry.kind.name} slices do not rejoin to the input"


def _plan_name(name: str) -> str:
    tail = name.rsplit("self_attn.", 1)[1]
    return tail.removesuffix(".weight")
