"""PyTorch and torch.distributed integration: per-rank loading, DTensor, torchrun jobs.

Everything here needs the optional ``torch`` extra (``pip install 'kda_tp[torch]'``,
``torch >= 2.5``); ``import kda_tp`` does not import torch, and importing this module without
torch (or with an older one) raises :class:`~kda_tp.errors.MissingDependencyError`.

* :func:`load_rank`: one tensor-parallel rank's tensors as ``torch.Tensor``; rank and world size
  default to a torch.distributed process group.
* :func:`placement` and :func:`load_dtensors`: the plan as DTensor placements on a 1-D TP mesh
  (``Shard(axis)`` / ``Replicate()``), and a rank's KDA tensors as DTensors built without any
  collective.
* :func:`check_tp_equivalence_distributed`: the numerical TP check with one process per rank (or
  several ranks per process) and a real ``all_reduce``.
* :func:`shard_checkpoint_distributed` and :func:`torchrun_group`: ``kda-tp shard`` / ``verify``
  spread over the processes of a torchrun job.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from . import errors
from .model.config import parse_config, parse_json, parse_metadata_int
from .reference.equivalence import (
    DEFAULT_ATOL,
    DEFAULT_RTOL,
    EquivalenceReport,
    compare_outputs,
)
from .errors import (
    CheckpointError,
    KdaTpError,
    MissingDependencyError,
    PlanError,
)
from .checkpoint.reader import torch_dtype
from .rank.plan import KdaShard, KdaTpPlan
from .reference.forward import source_layer_forward
from .shard.writer import ShardResult, check_shard_input, rank_dir, shard_checkpoint, shard_sizes
from .rank.view import (
    KdaShardedSource,
    SafetensorsSource,
    Tensor,
    checked_get,
    checked_info,
    decoder_prefix,
    kda_layer_indices,
)

try:
    import torch
    import torch.distributed as dist
except ImportError as e:  # pragma: no cover - exercised in CI's venvs without torch
    raise MissingDependencyError(
        "kda_tp.torch needs PyTorch (torch >= 2.5), which is not installed: "
        "pip install 'kda_tp[torch]' (from a source checkout: pip install '.[torch]')"
    ) from e
if tuple(int(part) for part in torch.__version__.split(".")[:2]) < (2, 5):
    raise MissingDependencyError(
        f"kda_tp.torch needs torch >= 2.5 (torch.distributed.tensor), found {torch.__version__}: "
        "pip install 'kda_tp[torch]' (from a source checkout: pip install '.[torch]')"
    )

__all__ = [
    "torch_dtype",
    "to_torch",
    "load_rank",
    "placement",
    "load_dtensors",
    "check_tp_equivalence_distributed",
    "shard_checkpoint_distributed",
    "torchrun_group",
    "rank_dir_metadata",
]

#: How long a collective of a torchrun job waits for the slowest process (a sharding process
#: writing a large checkpoint can take hours; torchrun ends the job when a process dies).
TORCHRUN_TIMEOUT = datetime.timedelta(hours=24)


def to_torch(tensor: Tensor) -> torch.Tensor:
    """A :class:`~kda_tp.Tensor` as a CPU ``torch.Tensor`` sharing its memory (no copy); the
    same as :meth:`kda_tp.Tensor.to_torch`, which documents the dtypes and the read-only memory.

    Raises:
        DtypeMismatchError: ``tensor.dtype`` has no torch equivalent (see :func:`torch_dtype`).
    """
    result: torch.Tensor = tensor.to_torch()
    return result


def _rank_and_size(
    tp_rank: int | None, tp_size: int | None, group: Any
) -> tuple[int, int]:
    """``(tp_rank, tp_size)``: the given values, the missing ones from the process group."""
    if tp_rank is None or tp_size is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise PlanError(
                "tp_rank and tp_size were not both given and no torch.distributed process group "
                "is initialized to take them from (call torch.distributed.init_process_group, or "
                "pass them)"
            )
        if tp_size is None:
            tp_size = dist.get_world_size(group)
        if tp_rank is None:
            tp_rank = dist.get_rank(group)
            if tp_rank < 0:
                raise PlanError("this process is not a member of the given process group")
    return tp_rank, tp_size


def _open(
    checkpoint: str | os.PathLike[str] | SafetensorsSource,
    tp_rank: int,
    tp_size: int,
    layers: Iterable[int] | None,
    qk_multiple: int,
    backend: str | None,
) -> KdaShardedSource:
    """The rank's adapter over ``checkpoint`` (opened with ``backend`` unless already open)."""
    source = (
        checkpoint
        if isinstance(checkpoint, SafetensorsSource)
        else SafetensorsSource(checkpoint, backend)
    )
    layers = None if layers is None else list(layers)
    plan = KdaTpPlan.from_config(source, tp_rank, tp_size, qk_multiple=qk_multiple, layers=layers)
    return KdaShardedSource(source, plan, layers)


def load_rank(
    checkpoint: str | os.PathLike[str] | SafetensorsSource,
    tp_rank: int | None = None,
    tp_size: int | None = None,
    *,
    group: Any = None,
    device: str | torch.device = "cpu",
    layers: Iterable[int] | None = None,
    include_non_kda: bool = True,
    qk_multiple: int = 256,
    backend: str | None = None,
) -> dict[str, torch.Tensor]:
    """One tensor-parallel rank's tensors, by checkpoint name, as ``torch.Tensor``.

    KDA tensors are this rank's slices in their local shapes (see
    :class:`~kda_tp.KdaShardedSource`); every other tensor is whole.

    Args:
        checkpoint: a checkpoint directory or ``.safetensors`` file (with ``config.json``), or
            an open :class:`~kda_tp.SafetensorsSource`.
        tp_rank: this rank; taken from ``group`` (``torch.distributed.get_rank``) when not
            given.
        tp_size: the TP world size; taken from ``group``
            (``torch.distributed.get_world_size``) when not given.
        group: the TP process group (default: the default group).
        device: ``"cpu"`` (default): row-sliced and replicated tensors, and non-KDA tensors,
            are zero-copy, read-only views of the file mapping (``backend="mmap"``); ``o_proj``
            is gathered into new memory. Any other device (``"cuda"``, ``"cuda:1"``): each
            tensor is copied into one of two reused host buffers of at most
            :data:`PINNED_CHUNK_BYTES` (pinned for CUDA, so the host copy into one overlaps the
            other's asynchronous transfer; larger tensors go in chunks) and from there to the
            device.
        layers: 0-based KDA layer indices (default: the config's).
        include_non_kda: also return the tensors outside the KDA layers (embeddings, MLA and
            MoE weights, norms); False returns the sliced KDA tensors alone.
        qk_multiple: the plan's local q|k width rule (see :class:`~kda_tp.KdaTpPlan`).
        backend: ``"mmap"`` or ``"pread"`` (see :class:`~kda_tp.SafetensorsSource`); ignored
            for an open source.

    Returns:
        ``{name: tensor}`` in checkpoint order. CPU tensors are read-only memory (see
        :func:`to_torch`).

    Raises:
        PlanError: rank or size missing with no process group, or a refused geometry.
        CheckpointError, DtypeMismatchError, ShapeMismatchError: bad input (see
            :class:`~kda_tp.KdaShardedSource`); a dtype torch lacks.
    """
    tp_rank, tp_size = _rank_and_size(tp_rank, tp_size, group)
    shard = _open(checkpoint, tp_rank, tp_size, layers, qk_multiple, backend)
    names = [n for n in shard.names() if include_non_kda or shard.is_sharded(n)]
    device = torch.device(device)
    if device.type == "cpu":
        return {name: to_torch(checked_get(shard, name)) for name in names}
    return _load_to_device(shard, names, device)


#: Size of each of the two pinned host buffers a device load copies through (bytes).
PINNED_CHUNK_BYTES = 64 << 20


def _load_to_device(
    shard: KdaShardedSource, names: list[str], device: torch.device
) -> dict[str, torch.Tensor]:
    """Copy each tensor to ``device`` through two alternating pinned host buffers of at most
    :data:`PINNED_CHUNK_BYTES`: a tensor that fits is read into one buffer, a larger one (an
    embedding, an expert weight) is copied from its mapping one buffer-full at a time. With CUDA
    the transfers are asynchronous, so filling one buffer overlaps the other's transfer."""
    infos = {name: checked_info(shard, name) for name in names}
    sizes = {
        name: int(np.prod(shape, dtype=np.int64)) * torch_dtype(dtype).itemsize
        for name, (dtype, shape) in infos.items()
    }
    chunk = min(max(sizes.values(), default=0), PINNED_CHUNK_BYTES)
    cuda = device.type == "cuda"
    # Pinned (page-locked) for CUDA; for other devices plain host memory and synchronous copies.
    staging = [torch.empty(chunk, dtype=torch.uint8, pin_memory=cuda) for _ in range(2)]
    done: list[Any] = [None, None]  # the event after the last transfer out of each buffer
    turn = 0

    def next_buffer(nbytes: int) -> tuple[int, torch.Tensor]:
        nonlocal turn
        slot, turn = turn, 1 - turn
        if done[slot] is not None:
            done[slot].synchronize()  # its previous transfer has finished
        return slot, staging[slot][:nbytes]

    def send(slot: int, host: torch.Tensor, dst: torch.Tensor) -> None:
        dst.copy_(host, non_blocking=cuda)
        if cuda:
            # torch.cuda.Event's constructor is unannotated (a third-party gap); without torch
            # installed, torch is Any and the ignore is unused, hence unused-ignore.
            done[slot] = torch.cuda.Event()  # type: ignore[no-untyped-call,unused-ignore]
            done[slot].record()

    out: dict[str, torch.Tensor] = {}
    for name in names:
        dtype, shape = infos[name]
        nbytes = sizes[name]
        flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
        if 0 < nbytes <= chunk:
            slot, host = next_buffer(nbytes)
            shard.read_into(name, host.numpy())  # one copy, the GIL released
            send(slot, host, flat)
        elif nbytes:
            data = checked_get(shard, name).data
            for start in range(0, nbytes, chunk):
                stop = min(start + chunk, nbytes)
                slot, host = next_buffer(stop - start)
                host.numpy()[:] = data[start:stop]
                send(slot, host, flat[start:stop])
        out[name] = flat.view(torch_dtype(dtype)).reshape(shape) if nbytes else torch.empty(
            shape, dtype=torch_dtype(dtype), device=device
        )
    for event in done:
        if event is not None:
            event.synchronize()
    return out


def placement(tensor_plan: Any, disk_shape: Iterable[int] | None = None) -> Any:
    """The DTensor placement of one plan tensor on a 1-D TP mesh.

    ``Shard(axis)`` on the on-disk axis the plan shards (``A_log`` ``[1, 1, H, 1]`` -> 2,
    conv ``[C, 1, K]`` -> 0, ``o_proj`` ``[hidden, C]`` -> 1, the last axis; a ModelOpt scale
    grid ``[ob, 1, ib, 1]`` of ``o_proj`` -> 2), or ``Replicate()`` for ``f_a_proj``,
    ``g_a_proj``, ``o_norm`` and a block-scale grid every rank keeps whole (``plan["b_proj"]
    .scale`` at Kimi K3's geometry).

    Args:
        tensor_plan: a :class:`~kda_tp.KdaTensorPlan` (``plan["o_proj"]``).
        disk_shape: the tensor's shape in the checkpoint (default: ``tensor_plan.disk_shape``,
            Kimi-Linear's layout).

    Raises:
        ShapeMismatchError: ``disk_shape`` does not hold the plan's tensor.
    """
    from torch.distributed.tensor import Replicate, Shard

    shape = list(tensor_plan.disk_shape if disk_shape is None else disk_shape)
    axis = tensor_plan.sharded_axis(shape)
    if axis is None:
        return Replicate()
    by_cols = tensor_plan.kind == KdaShard.CHANNEL_COLS
    local = tensor_plan.local_row_elems if by_cols else tensor_plan.local_rows
    full = tensor_plan.full_row_elems if by_cols else tensor_plan.full_rows
    if tensor_plan.name.endswith(".scale") and local == full:
        # A block-scale grid every rank keeps whole (Kimi K3's b_proj: every rank's rows lie in
        # block row 0, the grid's only row).
        return Replicate()
    return Shard(axis)


def load_dtensors(
    checkpoint: str | os.PathLike[str] | SafetensorsSource,
    device_mesh: Any,
    *,
    layers: Iterable[int] | None = None,
    include_non_kda: bool = False,
    qk_multiple: int = 256,
    backend: str | None = None,
) -> dict[str, Any]:
    """This process's KDA tensors as DTensors on a 1-D tensor-parallel ``device_mesh``.

    The mesh position is the TP rank and the mesh size the TP world size. Each DTensor is built
    with ``DTensor.from_local`` from :func:`load_rank`'s local tensor, with its placement
    (:func:`placement`), global shape and contiguous global stride given, so loading runs no
    collective. The global shape is the local shape with the sharded axis times the mesh size:
    the checkpoint tensor's shape, or for a padded tensor (Kimi K3's ``A_log`` ``[128]`` of 96
    heads) its real heads, so ``full_tensor()`` rejoins exactly what the ranks hold.

    Args:
        checkpoint: as :func:`load_rank`.
        device_mesh: a 1-D ``torch.distributed.device_mesh.DeviceMesh``; tensors go to its
            device type (``"cpu"`` or ``"cuda"``, the current CUDA device).
        layers: as :func:`load_rank`.
        qk_multiple: as :func:`load_rank`.
        backend: as :func:`load_rank`.
        include_non_kda: also return every other tensor, as ``Replicate()`` DTensors.

    Returns:
        ``{name: DTensor}`` in checkpoint order.

    Raises:
        PlanError: a mesh that is not 1-D, or a refused geometry.
        CheckpointError, DtypeMismatchError, ShapeMismatchError: as :func:`load_rank`.
    """
    from torch.distributed.tensor import DTensor, Replicate

    if device_mesh.ndim != 1:
        raise PlanError(f"load_dtensors needs a 1-D tensor-parallel mesh, got {device_mesh.ndim}-D")
    tp_rank, tp_size = device_mesh.get_local_rank(), device_mesh.size()
    shard = _open(checkpoint, tp_rank, tp_size, layers, qk_multiple, backend)
    names = [n for n in shard.names() if include_non_kda or shard.is_sharded(n)]
    device = torch.device(device_mesh.device_type)
    if device.type == "cpu":
        local = {name: to_torch(checked_get(shard, name)) for name in names}
    else:
        local = _load_to_device(shard, names, device)
    source = shard.source
    assert isinstance(source, SafetensorsSource)  # _open builds the adapter over one
    out = {}
    for name, tensor in local.items():
        shape = list(tensor.shape)
        where = Replicate()
        entry = shard.plan_entry(name)
        if entry is not None:
            info = source.info(name)
            assert info is not None  # the adapter planned it from this header
            disk_shape = list(info[1])
            where = placement(entry, disk_shape)
            if where.is_shard():
                shape[where.dim] *= tp_size
                if entry.name.endswith(".scale") and shape != list(disk_shape):
                    raise PlanError(
                        f"{name}: ranks share scale blocks (each rank's rows lie inside one "
                        "block, several ranks per block): no 1-D DTensor placement describes "
                        "that; use load_rank"
                    )
        out[name] = DTensor.from_local(
            tensor,
            device_mesh,
            [where],
            run_check=False,
            shape=torch.Size(shape),
            stride=_contiguous_stride(shape),
        )
    return out


def _contiguous_stride(shape: list[int]) -> tuple[int, ...]:
    stride, step = [], 1
    for extent in reversed(shape):
        stride.append(step)
        step *= max(extent, 1)
    return tuple(reversed(stride))


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
    """:func:`~kda_tp.check_tp_equivalence` with the ranks spread over a process group and a real
    ``torch.distributed.all_reduce`` (sum) of their partial outputs.

    Process ``p`` of ``P`` computes the reference forward
    (:func:`kda_tp.reference.source_layer_forward`, as
    :func:`~kda_tp.reference.checkpoint_layer_forward`) of TP ranks ``p, p + P, ...`` on their local
    weights (sliced from ``checkpoint`` as :func:`load_rank` does, or read from
    ``shard_dir/rank{r}`` when given) and adds them; the all-reduce sums over the processes, and
    every process compares the sum with the full layer's output and returns the same report.

    Args:
        checkpoint: the full checkpoint (directory or file, with ``config.json``).
        tp_size: TP world size (any value the plan accepts; ``P`` may be smaller or larger).
        shard_dir: a ``kda-tp shard`` output to check instead of slicing ``checkpoint``.
        group: the process group (default: the default group).
        layers: 0-based KDA layers to check (default: the config's).
        seq_len: as :func:`~kda_tp.check_tp_equivalence`.
        seed: as :func:`~kda_tp.check_tp_equivalence`.
        atol: as :func:`~kda_tp.check_tp_equivalence`.
        rtol: as :func:`~kda_tp.check_tp_equivalence`.
        qk_multiple: as :func:`~kda_tp.check_tp_equivalence`.

    Raises:
        PlanError: no initialized process group, or a refused geometry.
        CheckpointError: a missing tensor or config, or no KDA layer to check.
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise PlanError("check_tp_equivalence_distributed needs an initialized process group")
    source = SafetensorsSource(checkpoint)
    if source.config is None:
        raise CheckpointError(f"{checkpoint}: no config.json beside the checkpoint")
    checked = list(kda_layer_indices(source, layers))
    if not checked:
        raise CheckpointError(f"{checkpoint}: no KDA layer to check")
    try:  # the adapter shards every KDA layer, even when only some are checked
        all_kda = list(kda_layer_indices(source, None))
    except CheckpointError:
        all_kda = checked
    process, processes = dist.get_rank(group), dist.get_world_size(group)
    def plan_of(rank: int) -> KdaTpPlan:
        return KdaTpPlan.from_config(source, rank, tp_size, qk_multiple=qk_multiple, layers=checked)

    plan = plan_of(0)
    config = parse_config(source.config)
    x = np.random.default_rng(seed).standard_normal((1, seq_len, plan.hidden)).astype(np.float32)
    prefix = decoder_prefix(source)

    partial = np.zeros((len(checked), 1, seq_len, plan.hidden), dtype=np.float32)
    for r in range(process, tp_size, processes):
        if shard_dir is not None:
            rank_source: Any = SafetensorsSource(rank_dir(shard_dir, r))
        else:
            rank_source = _open(source, r, tp_size, all_kda, qk_multiple, None)
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
            0 alone, with the sizes of all ``ranks``); an input refused for want of
            ``allow_resharding`` or ``skip_unindexed`` is refused on every process before
            any writes.

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
    wanted = sorted(set(range(tp_size) if ranks is None else (int(r) for r in ranks)))
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
        totals.extend((result.bytes_written, result.seconds))

    outcomes = _agree(group, processes, bool(mine), write, lambda: totals or [0, 0.0])
    return ShardResult(
        Path(out_dir),
        tp_size,
        tuple(wanted),
        sum(o[0] for o in outcomes),
        max(o[1] for o in outcomes),
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
    from .shard.writer import prepare_out_dir  # the one-process writer's own check

    source = SafetensorsSource(checkpoint, options.get("backend"))
    check_shard_input(source, allow_resharding=bool(options.get("allow_resharding")),
                      skip_unindexed=bool(options.get("skip_unindexed")))
    layers = options.get("layers")
    _open(source, 0, tp_size, layers, options.get("qk_multiple", 256), None)
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


def rank_dir_metadata(out_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """``tp_size``, ``qk_multiple`` and ``layers`` recorded in ``out_dir/rank0``'s first file.

    Raises:
        CheckpointError: no readable rank0 file with kda-tp metadata.
    """
    first = rank_dir(out_dir, 0)
    files = SafetensorsSource(first).files()
    meta = (files[0][1] if files else None) or {}
    try:
        return {
            "tp_size": parse_metadata_int(meta["tp_size"], "tp_size", str(first)),
            "qk_multiple": parse_metadata_int(meta.get("kda_tp_qk_multiple", "256"),
                                              "kda_tp_qk_multiple", str(first)),
            "layers": (parse_json(meta["kda_tp_layers"], f"{first}: metadata kda_tp_layers")
                       if "kda_tp_layers" in meta else None),
        }
    except KeyError as e:
        raise CheckpointError(f"{first}: no valid kda-tp metadata ({e})") from None
