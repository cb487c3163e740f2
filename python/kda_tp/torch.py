"""PyTorch integration: one rank's tensors as ``torch.Tensor``, and as DTensors.

Everything here needs the optional ``torch`` extra (``pip install 'kda_tp[torch]'``,
``torch >= 2.5``); ``import kda_tp`` does not import torch, and importing this module without
torch (or with an older one) raises :class:`~kda_tp.errors.MissingDependencyError`.

* :func:`load_rank`: one tensor-parallel rank's tensors as ``torch.Tensor``; rank and world size
  default to a torch.distributed process group.
* :func:`placement` and :func:`load_dtensors`: the plan as DTensor placements on a 1-D TP mesh
  (``Shard(axis)`` / ``Replicate()``), and a rank's KDA tensors as DTensors built without any
  collective.

``kda-tp shard`` and ``verify --numeric`` as torchrun jobs are :mod:`kda_tp.shard`'s.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import numpy as np

from .checkpoint.description import describe
from .checkpoint.reader import SafetensorsSource, Tensor, checked_info
from .errors import MissingDependencyError, PlanError
from .model.dtypes import TORCH_MISSING, torch_dtype
from .rank.mla import rank_mla_plan
from .rank.plan import KdaShard, KdaTpPlan
from .rank.view import KdaShardedSource

try:
    import torch
    import torch.distributed as dist
except ImportError as e:  # pragma: no cover - exercised in CI's venvs without torch
    raise MissingDependencyError(TORCH_MISSING) from e
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
]

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
    """The rank's adapter over ``checkpoint`` (opened with ``backend`` unless already open),
    a hybrid's MLA layers sliced where planned, as ``kda-tp shard`` slices them
    (``kda_tp.rank.mla.rank_mla_plan``; else whole)."""
    source = (
        checkpoint
        if isinstance(checkpoint, SafetensorsSource)
        else SafetensorsSource(checkpoint, backend)
    )
    layers = None if layers is None else list(layers)
    description = describe(source)
    plan = KdaTpPlan.from_description(description, tp_rank, tp_size,
                                      qk_multiple=qk_multiple, layers=layers)
    mla = rank_mla_plan(description, tp_rank, tp_size)[0]
    return KdaShardedSource(source, plan, layers, mla=mla)


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

    KDA tensors, and a hybrid's MLA tensors where their plan can be made (as ``kda-tp shard``
    slices them), are this rank's slices in their local shapes (see
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
        include_non_kda: also return the tensors that are not sliced (embeddings, MoE
            weights, norms); False returns the sliced KDA (and MLA) tensors alone.
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
        return {name: to_torch(shard[name]) for name in names}
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
            data = shard[name].data
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
    """This process's KDA tensors (and a hybrid's MLA tensors, where :func:`load_rank` slices
    them) as DTensors on a 1-D tensor-parallel ``device_mesh``.

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
        local = {name: to_torch(shard[name]) for name in names}
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
