"""``kda-tp shard`` and ``verify --numeric`` spread over the processes of a torch.distributed
group (a torchrun job; ``kda_tp.shard.torchrun`` decides who does what).

Everything here needs the optional ``torch`` extra, as :mod:`kda_tp.torch` does (importing this
module without torch, or with one older than 2.5, raises
:class:`~kda_tp.errors.MissingDependencyError`).

* :func:`shard_checkpoint_distributed` and :func:`torchrun_group`: ``kda-tp shard`` over the
  processes of a torchrun job, the files byte for byte those of a one-process run.
* :func:`check_tp_equivalence_distributed`: the numerical TP check with one process per rank (or
  several ranks per process) and a real ``all_reduce``.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

# kda_tp.torch refuses a missing or too old torch (MissingDependencyError) when imported: first.
from .. import torch as _checked_torch  # noqa: F401
from .. import errors
from ..checkpoint.description import describe
from ..checkpoint.reader import SafetensorsSource
from ..errors import KdaTpError, PlanError
from ..output.dirs import prepare_out_dir
from ..output.names import rank_dir
from ..rank.mla import rank_mla_plan
from ..rank.plan import KdaTpPlan, distinct_ranks
from ..rank.view import KdaShardedSource
from ..reference.equivalence import (
    DEFAULT_ATOL,
    DEFAULT_RTOL,
    EquivalenceReport,
    compare_outputs,
    layers_to_check,
)
from ..reference.forward import source_layer_forward
from .writer import ShardResult, check_shard_input, shard_checkpoint, shard_sizes

import torch  # noqa: E402 - after kda_tp.torch's check of the installed torch
import torch.distributed as dist  # noqa: E402

__all__ = ["TORCHRUN_TIMEOUT", "check_tp_equivalence_distributed", "shard_checkpoint_distributed",
           "torchrun_group"]

#: How long a collective of a torchrun job waits for the slowest process (a sharding process
#: writing a large checkpoint can take hours; torchrun ends the job when a process dies).
TORCHRUN_TIMEOUT = datetime.timedelta(hours=24)


def check_tp_equivalence_distributed(
    checkpoint: str | os.PathLike[str],
    tp_size: int,
    *,
    shard_dir: str | os.PathLike[str] | None = None,
    group: Any = None,
    layers: Iterable[int] | None = None,
    seq_len: int = 16,
    seed: int = 0,
    atol: float = DEFAULT_ATOL,
    rtol: float = DEFAULT_RTOL,
    qk_multiple: int = 256,
) -> EquivalenceReport:
    """:func:`~kda_tp.reference.check_tp_equivalence` with the ranks spread over a process group and
    a real ``torch.distributed.all_reduce`` (sum) of their partial outputs.

    Process ``p`` of ``P`` computes the reference forward
    (:func:`kda_tp.reference.source_layer_forward`, as
    :func:`~kda_tp.reference.checkpoint_layer_forward`) of TP ranks ``p, p + P, ...`` on their local
    weights (sliced from ``checkpoint`` as :func:`~kda_tp.torch.load_rank` does, or read from
    ``shard_dir/rank{r}`` when given) and adds them; the all-reduce sums over the processes, and
    every process compares the sum with the full layer's output and returns the same report.

    Args:
        checkpoint: the full checkpoint (directory or file, with ``config.json``).
        tp_size: TP world size (any value the plan accepts; ``P`` may be smaller or larger).
        shard_dir: a ``kda-tp shard`` output to check instead of slicing ``checkpoint``.
        group: the process group (default: the default group).
        layers: 0-based KDA layers to check (default: the config's).
        seq_len: as :func:`~kda_tp.reference.check_tp_equivalence`.
        seed: as :func:`~kda_tp.reference.check_tp_equivalence`.
        atol: as :func:`~kda_tp.reference.check_tp_equivalence`.
        rtol: as :func:`~kda_tp.reference.check_tp_equivalence`.
        qk_multiple: as :func:`~kda_tp.reference.check_tp_equivalence`.

    Raises:
        PlanError: no initialized process group, or a refused geometry.
        CheckpointError: a missing tensor or config, or no KDA layer to check.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise PlanError("check_tp_equivalence_distributed needs an initialized process group")
    source = SafetensorsSource(checkpoint)
    description, checked, all_kda = layers_to_check(source, layers, checkpoint)
    process, processes = dist.get_rank(group), dist.get_world_size(group)
    def plan_of(rank: int) -> KdaTpPlan:
        return KdaTpPlan.from_description(description, rank, tp_size, qk_multiple=qk_multiple,
                                          layers=checked)

    plan = plan_of(0)
    config = description.kda
    x = np.random.default_rng(seed).standard_normal((1, seq_len, plan.hidden)).astype(np.float32)
    prefix = description.prefix

    partial = np.zeros((len(checked), 1, seq_len, plan.hidden), dtype=np.float32)
    for r in range(process, tp_size, processes):
        if shard_dir is not None:
            rank_source: Any = SafetensorsSource(rank_dir(shard_dir, r))
        else:
            rank_source = _view(source, r, tp_size, all_kda, qk_multiple)
        for i, layer in enumerate(checked):
            partial[i] += source_layer_forward(
                rank_source, layer, x, plan=plan_of(r), config=config, prefix=prefix
            )
    total = torch.from_numpy(partial)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    results = [
        compare_outputs(
            layer,
            source_layer_forward(source, layer, x, plan=plan, config=config, prefix=prefix),
            total[i].numpy(),
            atol,
            rtol,
        )
        for i, layer in enumerate(checked)
    ]
    return EquivalenceReport(tp_size, int(seq_len), seed, atol, rtol, tuple(results))


@contextmanager
def torchrun_group() -> Iterator[tuple[int, int]]:
    """A gloo process group for the torchrun job this process belongs to (``env://``), yielding
    ``(process, processes)``; destroyed on exit. An already initialized group is used as it is
    and left alone. Collectives wait up to :data:`TORCHRUN_TIMEOUT` for the slowest process.
    """
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", timeout=TORCHRUN_TIMEOUT)
    try:
        yield dist.get_rank(), dist.get_world_size()
    finally:
        if owned:
            dist.destroy_process_group()


def shard_checkpoint_distributed(
    checkpoint: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    tp_size: int,
    *,
    ranks: Iterable[int] | None = None,
    group: Any = None,
    **options: Any,
) -> ShardResult:
    """:func:`~kda_tp.shard.shard_checkpoint` spread over the processes of a process group.

    First process 0 alone checks the input geometry and the output directory for every rank
    (a refusal is raised on every process before anything is written). Then process ``p`` of
    ``P`` writes TP ranks ``ranks[p::P]`` (each atomically, as ``shard_checkpoint`` does), and
    the processes exchange their outcomes, so every process returns the same combined result or
    raises. The files are those a one-process run writes, byte for byte.

    Args:
        checkpoint: as :func:`~kda_tp.shard.shard_checkpoint`.
        out_dir: as :func:`~kda_tp.shard.shard_checkpoint`.
        tp_size: as :func:`~kda_tp.shard.shard_checkpoint`.
        ranks: the TP ranks to write (default: all).
        group: the process group (default: the default group).
        options: the other keyword arguments of ``shard_checkpoint`` (``layers``,
            ``qk_multiple``, ``force``, ``backend``, ``progress``, ``allow_resharding``,
            ``skip_unindexed``, ``kda_only``, ``wait``, ``report_sizes``: called on process
            0 alone, with the sizes of all ``ranks``; ``skip_heavy_files``); an input refused
            for want of ``allow_resharding``, ``skip_unindexed`` or ``skip_heavy_files`` is
            refused on every process before any writes.

    Returns:
        A :class:`~kda_tp.shard.ShardResult` for all the ranks: ``bytes_written`` summed,
        ``seconds`` the slowest process's.

    Raises:
        KdaTpError: a process failed (the failing process's class): its own error on that
            process; on the others the first failing process's error, its message prefixed
            with the process number. A process's completed ranks stay when another process
            fails (``verify`` rejects the incomplete set).
        PlanError: no initialized process group, or a bad ``tp_size``/``ranks``.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise PlanError("shard_checkpoint_distributed needs an initialized process group")
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise PlanError(f"tp_size must be a positive integer, got {tp_size!r}")
    given = list(range(tp_size) if ranks is None else (int(r) for r in ranks))
    distinct_ranks(given)
    wanted = sorted(given)
    if not wanted:
        raise PlanError("no ranks to write: --ranks is empty")
    process, processes = dist.get_rank(group), dist.get_world_size(group)
    # Phase 1, process 0 alone: the geometry, and the output directory for every rank (refused,
    # or cleaned of stale partial and other-world-size ranks), before any process writes; so a
    # refused output leaves nothing behind and the processes never race to clean it.
    report_sizes = options.pop("report_sizes", None)
    sizes: list[Any] = []

    def check() -> None:
        _check_before_writing(checkpoint, out_dir, tp_size, wanted, options)
        if report_sizes is not None:
            sizes.append(shard_sizes(
                checkpoint, tp_size, ranks=wanted, layers=options.get("layers"),
                qk_multiple=options.get("qk_multiple", 256),
                kda_only=bool(options.get("kda_only"))))

    _agree(group, processes, process == 0, check)
    if sizes:  # process 0, all ranks' sizes, before any process writes
        report_sizes(sizes[0])
    # Phase 2: every process writes its share.
    mine = wanted[process::processes]
    totals: list[Any] = []

    def write() -> None:
        result = shard_checkpoint(checkpoint, out_dir, tp_size, ranks=mine, **options)
        totals.extend((result.bytes_written, result.seconds, [str(p) for p in result.kept]))

    outcomes = _agree(group, processes, bool(mine), write, lambda: totals or [0, 0.0, []])
    return ShardResult(
        Path(out_dir),
        tp_size,
        tuple(wanted),
        sum(o[0] for o in outcomes),
        max(o[1] for o in outcomes),
        tuple(Path(p) for o in outcomes for p in o[2]),
    )


def _check_before_writing(
    checkpoint: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    tp_size: int,
    ranks: list[int],
    options: dict[str, Any],
) -> None:
    """Check the input geometry, then the output directory for all ``ranks`` (refused, or
    cleaned as ``shard_checkpoint`` does)."""
    source = SafetensorsSource(checkpoint, options.get("backend"))
    check_shard_input(source, allow_resharding=bool(options.get("allow_resharding")),
                      skip_unindexed=bool(options.get("skip_unindexed")),
                      skip_heavy_files=bool(options.get("skip_heavy_files")
                                            or options.get("kda_only")))
    layers = options.get("layers")
    _view(source, 0, tp_size, layers, options.get("qk_multiple", 256))
    prepare_out_dir(source.root, Path(out_dir), tp_size, tuple(ranks),
                    bool(options.get("force")), wait=bool(options.get("wait")))


def _agree(
    group: Any,
    processes: int,
    active: bool,
    step: Callable[[], None],
    value: Callable[[], Any] = lambda: None,
) -> list[Any]:
    """Run ``step()`` where ``active``, then share every process's outcome: returns each
    process's ``value()`` when all succeeded, else raises on every process (its own exception
    where it failed, else the first failing process's error class with its message prefixed by
    the process number)."""
    error: Exception | None = None
    try:
        if active:
            step()
        outcome: tuple[str, Any] = ("ok", value())
    except Exception as e:  # shared with every process below, then raised
        error = e
        outcome = (type(e).__name__, str(e))
    outcomes: list[Any] = [None] * processes
    dist.all_gather_object(outcomes, outcome, group=group)
    if error is not None:
        raise error
    for p, (kind, message) in enumerate(outcomes):
        if kind != "ok":
            cls = getattr(errors, kind, None)
            if not (isinstance(cls, type) and issubclass(cls, KdaTpError)):
                cls = KdaTpError
            raise cls(f"process {p} of {processes}: {kind}: {message}")
    return [message for _, message in outcomes]


def _view(source: SafetensorsSource, tp_rank: int, tp_size: int, layers: Iterable[int] | None,
          qk_multiple: int) -> KdaShardedSource:
    """Rank ``tp_rank``'s view of an open ``source`` (its KDA tensors checked; a hybrid's MLA
    layers sliced where planned, as the writer slices them: ``rank_mla_plan``)."""
    layers = None if layers is None else list(layers)
    plan = KdaTpPlan.from_config(source, tp_rank, tp_size, qk_multiple=qk_multiple, layers=layers)
    mla = rank_mla_plan(describe(source), tp_rank, tp_size)[0]
    return KdaShardedSource(source, plan, layers, mla=mla)
