"""Verifying a ``kda-tp shard`` output against its input, byte for byte (and numerically).

:func:`verify_shards` rejoins every rank's slices and compares them with the input; it also
checks that each rank directory holds exactly what ``shard`` writes (:mod:`kda_tp.shard.rankdir`).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..checkpoint.description import describe
from ..checkpoint.layers import check_layers
from ..checkpoint.files import missing_path
from ..checkpoint.reader import INDEX_NAME, SafetensorsSource, Tensor, checked_get, checked_info
from ..checkpoint.values import bytes_equal
from ..errors import CheckpointError
from ..model.json_reader import parse_json, parse_metadata_int
from ..output.names import (
    ASIDE_DIR,
    LOCK_FILE,
    MARK_NAME,
    PARTIAL_DIR,
    RANK_DIR,
    WORLD_LOCK,
    rank_dir,
)
from ..rank.mla import rank_mla_plan
from ..rank.plan import KdaShard, KdaTpPlan
from ..rank.view import KdaShardedSource
from .rankdir import (
    companion_files,
    finish_command,
    heavy_files,
    input_fingerprint,
    kda_only_files,
    names_by_file,
)

# Imported where verify_shards(numeric=True) needs it, so `kda-tp verify` starts faster.
if TYPE_CHECKING:
    from ..reference.equivalence import EquivalenceReport

__all__ = ["ProgressFactory", "VerifyReport", "verify_shards"]

#: ``progress(total)`` returns an ``advance(n)`` callable (bytes for the writer, tensors or
#: layers for the verifier).
ProgressFactory = Callable[[int], Callable[[int], None]]


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
        mla_note: the one line saying a hybrid's MLA layers are passed through whole and
            why (``kda_tp.rank.mla.rank_mla_plan``); None when they are sliced, or there are
            none.
    """

    tp_size: int = 0
    tensors: int = 0
    bytes_checked: int = 0
    problems: list[str] = field(default_factory=list)
    numeric: EquivalenceReport | None = None
    byte_seconds: float = 0.0
    numeric_seconds: float = 0.0
    mla_note: str | None = None

    @property
    def ok(self) -> bool:
        """True when every tensor matched (and the numerical check passed, if run)."""
        return not self.problems and (self.numeric is None or self.numeric.passed)

    def to_dict(self, unindexed: Iterable[Path] = ()) -> dict[str, Any]:
        """The report as a JSON-ready dict (what ``kda-tp verify --json`` prints).

        Args:
            unindexed: input files the index does not name (left unchecked; the CLI lists
                them, :func:`verify_shards` does not see them).

        Returns:
            Keys ``ok`` (the verdict), ``tp_size``, ``tensors`` and ``bytes_checked`` (input
            tensor bytes), ``problems`` (one string each), ``numeric`` (None when not run, else
            ``passed``, ``seq_len``, ``seed``, ``atol``, ``rtol`` and ``layers``: per layer
            ``layer``, ``max_abs_error``, ``max_rel_error`` (None when infinite),
            ``y_abs_max``, ``tolerance``, ``passed``, ``non_finite``: ``"full"`` when the full
            weights' reference output holds NaN or inf, ``"ranks"`` when only the ranks'
            summed output does, else None), ``unindexed`` (``unindexed`` as strings),
            ``byte_seconds`` and ``numeric_seconds`` (each phase's wall time, in seconds; 0
            when not run), ``mla_note`` (see the attribute).
        """
        numeric = None
        if self.numeric is not None:
            n = self.numeric
            numeric = {
                "passed": n.passed, "seq_len": n.seq_len, "seed": n.seed, "atol": n.atol,
                "rtol": n.rtol,
                "layers": [
                    {"layer": e.layer, "max_abs_error": _finite(e.max_abs_error),
                     "max_rel_error": _finite(e.max_rel_error),
                     "y_abs_max": _finite(e.y_abs_max), "tolerance": _finite(e.tolerance),
                     "passed": e.passed, "non_finite": e.non_finite}
                    for e in n.layers
                ],
            }
        return {
            "ok": self.ok, "tp_size": self.tp_size, "tensors": self.tensors,
            "bytes_checked": self.bytes_checked, "problems": list(self.problems),
            "numeric": numeric, "unindexed": [str(p) for p in unindexed],
            "byte_seconds": self.byte_seconds, "numeric_seconds": self.numeric_seconds,
            "mla_note": self.mla_note,
        }

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


def _finite(x: float) -> float | None:
    """``x``, or None for NaN and infinities (which JSON cannot hold)."""
    return x if math.isfinite(x) else None


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
    tensor is identical on every rank. A hybrid's MLA layers are checked by the same rules with
    this rank's ``MlaTpPlan`` where it can be made (``kda_tp.rank.mla.rank_mla_plan``; the ranks'
    ``kda_tp_mla_layers`` metadata must name the layers sliced), else whole (``mla_note`` says
    why). Every rank ``0..tp_size-1`` must be present and complete,
    with matching ``tp_rank``/``tp_size`` metadata, and no rank may hold extra tensors, nor
    any file ``shard`` does not write (an extra ``.safetensors`` no index names, a stray file:
    a problem naming the file). A problem names the tensor and the rank(s) whose bytes differ.
    Each rank must hold the input's companion files (``config.json``, tokenizer files: every
    file ``shard`` copies) byte for byte; one missing or different is a problem naming the rank
    and the file.
    ``--kda-only`` output (``kda_tp_kda_only`` in its metadata) is checked on the KDA tensors
    alone (it holds no companion file), and a rank holding any other tensor fails.

    With ``numeric``, also runs :func:`~kda_tp.reference.check_tp_equivalence` on the rank
    directories: each KDA layer's full output against the sum of the ranks' partial outputs.

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
    at a time (see :func:`~kda_tp.reference.check_tp_equivalence`): on the Kimi K3 demo (1.4 GB
    input, one 0.89 GB BF16 KDA layer, 1.78 GB as float32) ``verify --numeric`` peaks at 2.0 GB RSS
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
        UsageError: with ``numeric``, a ``seq_len`` whose activations do not fit in the memory
            free here (``check_numeric_memory``), refused
            before the byte check.
    """
    source = SafetensorsSource(checkpoint)
    out = Path(out_dir)
    report = VerifyReport()
    entries = _listdir(out)
    present = {int(m.group(1)) for p in entries if (m := RANK_DIR.match(p.name))}
    if not present:
        if all(PARTIAL_DIR.match(p.name) or ASIDE_DIR.match(p.name) or LOCK_FILE.match(p.name)
               or WORLD_LOCK.match(p.name) for p in entries):
            # Empty, or only what a killed run leaves: an output not yet complete.
            report.problems.append(f"{out}: no rank directory yet (incomplete run?)")
            return report
        hint = (f"; it is one rank of an output: pass its parent directory {out.parent}"
                if RANK_DIR.match(out.name) else "")
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
    if recorded is not None and recorded != input_fingerprint(source):
        raise CheckpointError(
            f"{out} was sharded from another checkpoint, not {checkpoint} (or this one has "
            "changed since): the tensor names, dtypes, shapes and data samples its headers "
            "record differ from this checkpoint's; verify it against the checkpoint it was made "
            "from"
        )
    report.tp_size = tp_size
    if numeric and layers is not None:
        described = describe(source)
        known = kda_layers if kda_layers is not None else described.kda_layers()
        layers = check_layers(layers, known, described.layer_count)
    # The plan refuses a tp_size the heads cannot split (so it stays small) before any listing.
    plans = [KdaTpPlan.from_config(source, 0, tp_size, qk_multiple=qk_multiple, layers=kda_layers)]
    if numeric:
        # A --seq-len whose activations do not fit is refused now, not after the byte check.
        from ..reference.equivalence import check_numeric_memory  # noqa: PLC0415 - start-up

        check_numeric_memory(plans[0].hidden, plans[0].full_heads, plans[0].head_dim, seq_len)
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
    # A hybrid's MLA layers are sliced where their plan can be made (as shard slices them).
    mla_plans = [rank_mla_plan(describe(source), r, tp_size) for r in range(tp_size)]
    report.mla_note = mla_plans[0][1]
    shards = [KdaShardedSource(source, plan, kda_layers, mla=mla[0])
              for plan, mla in zip(plans, mla_plans)]
    sliced = list(shards[0].mla_layers)
    try:
        recorded_mla = parse_json(meta.get("kda_tp_mla_layers", "[]"),
                                  f"{first}: metadata kda_tp_mla_layers")
    except CheckpointError:
        recorded_mla = None
    if recorded_mla != sliced:
        report.problems.append(
            f"{first}: metadata kda_tp_mla_layers {meta.get('kda_tp_mla_layers')!r}: the ranks "
            f"were written with MLA layers {recorded_mla} sliced, this kda-tp slices {sliced}; "
            "shard again with this kda-tp"
        )
        return report
    # A --kda-only output holds the KDA tensors and nothing else.
    kda_only = meta.get("kda_tp_kda_only") == "1"
    names = [n for n in source.names() if not kda_only or shards[0].is_sharded(n)]
    # The files shard writes into every rank; anything else in a rank directory (an extra
    # .safetensors no index names, a stray file) is not the output shard made.
    files = names_by_file(source)
    written = {INDEX_NAME, MARK_NAME, *(kda_only_files(files, shards[0]) if kda_only else files)}
    if not kda_only:
        written.update(p.name for p in companion_files(source))
        # Never copied now, but an older kda-tp did, and a user may copy one in: not wrong.
        written.update(p.name for p, _, _ in heavy_files(source))
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
        from ..reference.equivalence import check_tp_equivalence  # noqa: PLC0415 - start-up time

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
        for original in companion_files(source):
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
    """The entries of the shard output ``path`` (or one of its rank directories).

    Raises:
        CheckpointError: it is missing (:data:`~kda_tp.checkpoint.files.MISSING`), or cannot
            be listed.
    """
    try:
        return list(path.iterdir())
    except OSError as e:
        raise CheckpointError(missing_path(path, e)
                              or f"{path}: cannot list the shard directory: {e}") from e


def _check_tensor(
    name: str,
    full: Tensor,
    records: list[Tensor | None],
    shards: list[KdaShardedSource],
    release: Callable[[int], None],
) -> str | None:
    """One line describing how ``records`` (one per rank, None where the rank lacks ``name``)
    fail to rejoin to ``full``, naming the ranks whose bytes differ (byte for byte,
    ``kda_tp.checkpoint.values.bytes_equal``: a rank checkpoint is a copy, so a NaN of another
    bit pattern differs). A whole copy on every rank
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
            if not bytes_equal(p.data, full_bytes):
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
            if not bytes_equal(part.data, want.ravel()):
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
    if bytes_equal(rejoined, full_bytes):
        return None
    differ = [r for r, (got, want) in enumerate(zip(pieces, slices))
              if not bytes_equal(got.ravel(), want.ravel())]
    return (
        f"{name}: the ranks' {entry.kind.name} slices do not rejoin to the input "
        f"(the slice on {_ranks(differ)} differs)"
    )


def _ranks(ranks: list[int]) -> str:
    """``rank 1`` or ``ranks 0, 2``, for messages."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"

