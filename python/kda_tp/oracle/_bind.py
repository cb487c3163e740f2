"""Applying the oracle's plan to bytes and names (spec ``tp_bind.rs.txt``).

A rank's bytes of one tensor (:func:`shard_bytes`), its shape on that rank
(:func:`local_shape`) and the plan name of a ``self_attn`` tensor name (:func:`plan_name`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from kda_tp.errors import ShapeMismatchError

from ._shard_plan import CHANNEL_COLS, REPLICATED, OracleTensor

def shard_bytes(entry: OracleTensor, data: bytes | bytearray | memoryview) -> bytes:
    """This rank's bytes of one tensor (spec ``tp_bind.rs.txt``, ``shard_bytes``).

    Args:
        entry: the tensor's plan entry.
        data: the whole tensor's raw bytes as stored on disk (row-major), exactly
            ``entry.full_bytes`` long.

    Returns:
        ``entry.local_bytes`` bytes: the whole tensor when replicated; for the row kinds the
        contiguous rows ``[src_row_offset, src_row_offset + local_rows)``; for ``CHANNEL_COLS``
        (``o_proj``) the elements ``[src_col_offset, src_col_offset + local_row_elems)`` of every
        row, rows kept in order (a strided gather, not a row slice).

    Raises:
        ShapeMismatchError: ``len(data) != entry.full_bytes``; the message names the tensor and
            both sizes.
    """
    view = memoryview(data).cast("B")
    if view.nbytes != entry.full_bytes:
        raise ShapeMismatchError(
            f"{entry.name}: {view.nbytes} bytes on disk, the plan's full shape "
            f"[{entry.full_rows}, {entry.full_row_elems}] x {entry.elem_bytes} bytes implies "
            f"{entry.full_bytes} bytes"
        )
    row_bytes = entry.full_row_elems * entry.elem_bytes
    if entry.kind == CHANNEL_COLS:
        first = entry.src_col_offset * entry.elem_bytes
        width = entry.local_row_elems * entry.elem_bytes
        return b"".join(
            view[r * row_bytes + first : r * row_bytes + first + width]
            for r in range(entry.local_rows)
        )
    start = entry.src_row_offset * row_bytes
    return bytes(view[start : start + entry.local_rows * row_bytes])


def local_shape(entry: OracleTensor, disk_shape: Sequence[int]) -> tuple[int, ...]:
    """This rank's shape of a tensor stored with shape ``disk_shape`` (spec ``tp_bind.rs.txt``,
    ``local_shape``): same rank as on disk, sharded axis reduced to the local extent.

    The sharded axis: for the row kinds, the first axis whose extent is not 1 (leading unit
    axes are padding, as in ``A_log``'s ``(1, 1, H, 1)``), or axis 0 when the tensor has a
    single row; for ``CHANNEL_COLS``, the last axis that is not a trailing unit axis. So
    ``(ob, 1, ib, 1) -> (ob, 1, ib_local, 1)``, ``(1, 1, H, 1) -> (1, 1, H/T, 1)``,
    ``(H,) -> (H/T,)``, ``(C, 1, K) -> (C/T, 1, K)``, ``(C, K) -> (C/T, K)``,
    ``(hidden, C) -> (hidden, C/T)``. Replicated tensors keep ``disk_shape``.

    Raises:
        ShapeMismatchError: ``disk_shape`` does not hold ``full_rows * full_row_elems``
            elements, or its sharded axis is not ``full_rows`` long (row kinds) or its last
            axis is not ``full_row_elems`` long (``CHANNEL_COLS``).
    """
    shape = tuple(int(d) for d in disk_shape)
    expected = entry.full_rows * entry.full_row_elems

    def mismatch(why: str) -> ShapeMismatchError:
        return ShapeMismatchError(
            f"{entry.name}: on-disk shape {list(shape)} does not match the plan's "
            f"[{entry.full_rows}, {entry.full_row_elems}] (e.g. {list(entry.disk_shape)}): {why}"
        )

    if math.prod(shape) != expected:
        raise mismatch(f"{math.prod(shape)} elements, expected {expected}")
    if entry.kind == REPLICATED:
        return shape
    if entry.kind == CHANNEL_COLS:
        # The last axis, skipping trailing unit axes (ModelOpt scale grids are [ob, 1, ib, 1]).
        if entry.full_row_elems == 1:
            axis = len(shape) - 1
        else:
            axis = max((i for i, d in enumerate(shape) if d != 1), default=-1)
        if axis < 0 or shape[axis] != entry.full_row_elems:
            raise mismatch(f"the last non-unit axis must be {entry.full_row_elems} long")
        return shape[:axis] + (entry.local_row_elems,) + shape[axis + 1 :]
    if entry.full_rows == 1:
        axis = 0
    else:
        axis = next((i for i, d in enumerate(shape) if d != 1), len(shape))
    if axis >= len(shape) or shape[axis] != entry.full_rows:
        raise mismatch(f"the first non-unit axis must be {entry.full_rows} long")
    return shape[:axis] + (entry.local_rows,) + shape[axis + 1 :]


def plan_name(checkpoint_name: str) -> str:
    """The plan name of a ``self_attn`` tensor name (spec ``tp_bind.rs.txt``, ``plan_name``).

    Strips a leading ``self_attn.`` and a trailing ``.weight`` where present:
    ``self_attn.q_proj.weight -> q_proj``, ``self_attn.A_log -> A_log`` (``A_log`` and
    ``dt_bias`` carry no ``.weight``). The result is a KDA tensor only if it is in
    :data:`TENSOR_NAMES`.
    """
    name = checkpoint_name.removeprefix("self_attn.")
    return name.removesuffix(".weight")

