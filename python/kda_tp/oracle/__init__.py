"""An independent, standard-library-only oracle for the KDA tensor-parallel shard plan.

This module restates the shard plan of one KDA (Kimi Delta Attention) block from the written
spec (``spec/tp.rs`` for the plan, ``spec/tp_bind.rs`` for applying it), without calling the
Rust core, so the two can be compared. It also carries a verifier that checks a sharded
checkpoint directory against its source checkpoint, usable in a user's own CI with nothing but
a Python interpreter:

```sh
python -m kda_tp.oracle verify CHECKPOINT OUT
```

The plan, in short: rank ``r`` of ``tp_size`` owns the contiguous head range
``[r * H/T, (r+1) * H/T)``. Channel ``c = h * head_dim + d``, so that head range is the
contiguous channel range ``[r * C/T, (r+1) * C/T)`` with ``C = heads * head_dim``.

* column-parallel by output channel (rows of the on-disk ``[out, in]`` tensor):
  ``q/k/v_proj``, ``q/k/v_conv1d``, ``f_b_proj``, ``g_b_proj``, ``dt_bias``;
* by head: ``b_proj``, ``A_log``;
* replicated: ``f_a_proj``, ``g_a_proj`` (low-rank down-projections) and ``o_norm``
  (``[head_dim]``, shared by every head);
* row-parallel: ``o_proj`` ``[hidden, C]``, sliced on its input (last) axis; every rank's output
  is a partial sum, and one all-reduce follows it when ``tp_size > 1``.

Kimi K3 (``shared/notes/kimi_k3.md``) changes two things. Its output gate is one full-rank
``g_proj`` ``[C, hidden]``, column-parallel like ``q_proj``, in place of ``g_a_proj`` and
``g_b_proj`` (14 tensors). Its ``A_log`` is stored 1-D with more entries than heads (128 for 96),
the first ``H`` the heads and the rest zero: rank ``r`` keeps entries ``[r * H/T, (r+1) * H/T)``
of it, never an even split of the stored length, and the padding must be zero.

Block-quantized FP8 projections (``shared/notes/kda_quant_and_gate.md``) carry a scale grid of
``ceil(out/bo) x ceil(in/bi)`` (ModelOpt stores it ``[ob, 1, ib, 1]``). A rank whose weight range
on the sharded axis is ``[a, e)`` keeps grid rows (columns for ``o_proj``) ``[a // b, ceil(e / b))``
and a replicated weight keeps the whole grid. That only dequantizes if every rank's range starts
on a block boundary or stays inside one block; otherwise the plan is refused.

Sizes are in elements unless a name says bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import struct
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kda_tp.errors import CheckpointError, PlanError, ShapeMismatchError

__all__ = [
    "TENSOR_NAMES",
    "FULL_RANK_GATE_TENSOR_NAMES",
    "ELEM_BYTES",
    "MAX_BYTES",
    "OracleTensor",
    "OraclePlan",
    "KdaConfig",
    "plan",
    "shard_bytes",
    "local_shape",
    "plan_name",
    "read_kda_config",
    "verify",
    "main",
]

#: The tensors of one KDA block, by plan name, in plan order (spec ``tp.rs``, ``tensors``).
TENSOR_NAMES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "q_conv1d",
    "k_conv1d",
    "v_conv1d",
    "f_a_proj",
    "f_b_proj",
    "g_a_proj",
    "g_b_proj",
    "b_proj",
    "A_log",
    "dt_bias",
    "o_norm",
    "o_proj",
)

#: The tensors of one Kimi K3 KDA block (full-rank output gate), in plan order.
FULL_RANK_GATE_TENSOR_NAMES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "q_conv1d",
    "k_conv1d",
    "v_conv1d",
    "f_a_proj",
    "f_b_proj",
    "g_proj",
    "b_proj",
    "A_log",
    "dt_bias",
    "o_norm",
    "o_proj",
)

#: Bytes per element of the safetensors dtypes a KDA tensor may have.
ELEM_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8}

#: Bytes per element of the FP8 dtypes a block-quantized projection may have.
FP8_ELEM_BYTES = {"F8_E4M3": 1, "F8_E5M2": 1}

#: Largest byte size a tensor, or a whole block, may have (``isize::MAX`` on 64-bit targets, the
#: bound of a Rust slice and of a signed 64-bit file offset). Larger geometry is refused.
MAX_BYTES = 2**63 - 1

#: Default dtypes: BF16 everywhere, except the two float32 gate parameters (Kimi-Linear's
#: ``A_log`` and ``dt_bias`` are created float32; spec ``tp.rs`` uses ``F32`` for both).
_DEFAULT_DTYPE = "BF16"
_F32_TENSORS = ("A_log", "dt_bias")

_REPLICATED = "REPLICATED"
_HEAD_ROWS = "HEAD_ROWS"
_CHANNEL_ROWS = "CHANNEL_ROWS"
_CHANNEL_COLS = "CHANNEL_COLS"


@dataclass(frozen=True)
class OracleTensor:
    """One tensor's placement on one rank, in a flat ``[rows, row_elems]`` view of it.

    ``kind`` is ``"REPLICATED"``, ``"HEAD_ROWS"``, ``"CHANNEL_ROWS"`` or ``"CHANNEL_COLS"``. For
    the row kinds the sharded axis is ``rows``; for ``CHANNEL_COLS`` it is ``row_elems``. All
    counts and offsets are elements; ``src_row_offset`` counts rows, ``src_col_offset`` elements
    within a row. ``disk_shape`` is the full tensor's canonical Kimi-Linear on-disk shape.
    """

    name: str
    kind: str
    dtype: str
    elem_bytes: int
    full_rows: int
    full_row_elems: int
    local_rows: int
    local_row_elems: int
    src_row_offset: int
    src_col_offset: int
    disk_shape: tuple[int, ...]
    block: tuple[int, int] | None = None
    scale: OracleTensor | None = None

    @property
    def local_bytes(self) -> int:
        """Bytes this rank stores for this tensor."""
        return self.local_rows * self.local_row_elems * self.elem_bytes

    @property
    def full_bytes(self) -> int:
        """Bytes the full tensor occupies on disk."""
        return self.full_rows * self.full_row_elems * self.elem_bytes


@dataclass(frozen=True)
class OraclePlan:
    """The shard plan of one KDA block on rank ``tp_rank`` of ``tp_size``.

    ``full_heads`` counts heads over all ranks, ``local_heads = full_heads / tp_size`` those of
    this rank. ``tensors`` holds one :class:`OracleTensor` per name of :data:`TENSOR_NAMES` (or
    :data:`FULL_RANK_GATE_TENSOR_NAMES` when ``full_rank_gate``), in that order. ``a_log_len`` is
    the stored length of ``A_log`` (``full_heads`` unless zero-padded).
    """

    tp_rank: int
    tp_size: int
    hidden: int
    head_dim: int
    full_heads: int
    local_heads: int
    conv_kernel: int
    gate_rank: int
    qk_multiple: int
    full_rank_gate: bool
    a_log_len: int
    tensors: list[OracleTensor]

    @property
    def local_bytes(self) -> int:
        """Bytes this rank stores for the whole block."""
        return sum(t.local_bytes for t in self.tensors)

    @property
    def full_bytes(self) -> int:
        """Bytes the whole block occupies on disk."""
        return sum(t.full_bytes for t in self.tensors)

    @property
    def needs_output_all_reduce(self) -> bool:
        """Whether the block's output must be all-reduced (summed) after the row-parallel
        ``o_proj``: false only at ``tp_size == 1``, where each rank holds the whole of it."""
        return self.tp_size > 1

    def get(self, name: str) -> OracleTensor | None:
        """The entry for plan name ``name`` (e.g. ``"q_proj"``, ``"A_log"``), or ``None``."""
        return next((t for t in self.tensors if t.name == name), None)


def plan(
    tp_rank: int,
    tp_size: int,
    hidden: int,
    head_dim: int,
    full_heads: int,
    conv_kernel: int,
    gate_rank: int,
    *,
    qk_multiple: int = 256,
    dtypes: Mapping[str, str] | None = None,
    full_rank_gate: bool = False,
    a_log_len: int | None = None,
    quant_block: tuple[int, int] | None = None,
    quantized: Sequence[str] | None = None,
    scale_layout: str = "grid",
) -> OraclePlan:
    """The shard plan of one KDA block for rank ``tp_rank`` of ``tp_size`` (spec ``tp.rs``,
    ``KdaTpPlan::new``).

    Args:
        tp_rank: this rank, ``0 <= tp_rank < tp_size``.
        tp_size: the tensor-parallel world size.
        hidden: hidden size of the model (elements).
        head_dim: elements per head; ``C = full_heads * head_dim`` is the channel count.
        full_heads: KDA heads over all ranks.
        conv_kernel: short-convolution kernel width ``K``.
        gate_rank: rows of the low-rank ``f_a_proj``/``g_a_proj`` down-projections.
        qk_multiple: the local q|k width ``2 * local_heads * head_dim`` must be a multiple of
            this (spec: 256, the fused conv + L2-norm kernel's two heads per 256-thread block);
            1 switches the rule off.
        dtypes: plan name -> ``"BF16"``, ``"F16"``, ``"F32"`` or ``"F64"``, overriding the
            defaults (BF16, F32 for ``A_log`` and ``dt_bias``).
        full_rank_gate: Kimi K3's output gate: ``g_proj`` ``[C, hidden]`` (CHANNEL_ROWS) instead
            of ``g_a_proj``/``g_b_proj``.
        a_log_len: entries of the stored ``A_log`` when zero-padded past the heads (K3: 128 for
            96 heads); ``None`` for one entry per head.
        quant_block: ``(bo, bi)`` FP8 block edge; with it, the projections in ``quantized``
            (default: all of this layout's projections) default to dtype ``F8_E4M3`` and get a
            ``scale`` entry (F32, counts and offsets in blocks).
        quantized: plan names of the block-quantized weights.
        scale_layout: ``"grid"`` (``[ob, ib]``) or ``"modelopt"`` (``[ob, 1, ib, 1]``), the
            scale's canonical ``disk_shape``.

    Returns:
        An :class:`OraclePlan`. Per tensor (full shape as ``[rows, row_elems]``, with
        ``Hl = full_heads / tp_size`` and ``Cl = Hl * head_dim``):

        ==========================  ============  ===================  ===========================
        tensor                      kind          full [rows, elems]   this rank keeps
        ==========================  ============  ===================  ===========================
        q/k/v_proj                  CHANNEL_ROWS  [C, hidden]          rows ``[r*Cl, (r+1)*Cl)``
        q/k/v_conv1d                CHANNEL_ROWS  [C, K]               rows ``[r*Cl, (r+1)*Cl)``
        f_a_proj, g_a_proj          REPLICATED    [gate_rank, hidden]  everything
        f_b_proj, g_b_proj          CHANNEL_ROWS  [C, gate_rank]       rows ``[r*Cl, (r+1)*Cl)``
        g_proj (full_rank_gate)     CHANNEL_ROWS  [C, hidden]          rows ``[r*Cl, (r+1)*Cl)``
        b_proj                      HEAD_ROWS     [H, hidden]          rows ``[r*Hl, (r+1)*Hl)``
        A_log                       HEAD_ROWS     [P, 1] (P >= H)      rows ``[r*Hl, (r+1)*Hl)``
        dt_bias                     CHANNEL_ROWS  [C, 1]               rows ``[r*Cl, (r+1)*Cl)``
        o_norm                      REPLICATED    [head_dim, 1]        everything
        o_proj                      CHANNEL_COLS  [hidden, C]          columns ``[r*Cl, (r+1)*Cl)``
        ==========================  ============  ===================  ===========================

    Raises:
        PlanError: ``tp_size == 0`` or ``tp_rank >= tp_size``; a zero (or negative) ``hidden``,
            ``head_dim``, ``full_heads``, ``conv_kernel``, ``gate_rank`` or ``qk_multiple``;
            ``full_heads`` not divisible by ``tp_size``; a local q|k width that is not a
            multiple of ``qk_multiple``; ``a_log_len`` below ``full_heads``; an unknown tensor
            name (for this gate form) or dtype in ``dtypes``; a tensor or the whole block over
            :data:`MAX_BYTES` bytes.
    """
    if tp_size <= 0 or not 0 <= tp_rank < tp_size:
        raise PlanError(f"tp_rank {tp_rank} is not in [0, tp_size {tp_size})")
    for label, value in (
        ("hidden", hidden),
        ("head_dim", head_dim),
        ("full_heads", full_heads),
        ("conv_kernel", conv_kernel),
        ("gate_rank", gate_rank),
        ("qk_multiple", qk_multiple),
    ):
        if value <= 0:
            raise PlanError(f"degenerate KDA TP geometry: {label} is {value}, must be at least 1")
    if full_heads % tp_size:
        raise PlanError(f"KDA TP needs heads ({full_heads}) divisible by tp_size ({tp_size})")
    local_heads = full_heads // tp_size
    qk_width = 2 * local_heads * head_dim
    if qk_width % qk_multiple:
        raise PlanError(
            f"KDA TP: local q|k width 2 * {local_heads} heads * {head_dim} = {qk_width} "
            f"is not a multiple of {qk_multiple}"
        )
    names = FULL_RANK_GATE_TENSOR_NAMES if full_rank_gate else TENSOR_NAMES
    projections = [n for n in names if n.endswith("_proj")]
    if quant_block is None:
        if quantized:
            raise PlanError("quantized needs quant_block, the block size")
        quantized = ()
    else:
        if not all(1 <= b <= 1 << 16 for b in quant_block):
            raise PlanError(f"block size {quant_block} must be in [1, 65536]")
        quantized = projections if quantized is None else tuple(quantized)
        for name in quantized:
            if name not in names:
                raise PlanError(f"unknown KDA tensor {name!r}; the plan has {', '.join(names)}")
            if name not in projections:
                raise PlanError(f"{name} is never block-quantized")
    chosen = _resolve_dtypes(dtypes, names, quantized)
    stored = full_heads if a_log_len is None else a_log_len
    if stored < full_heads:
        raise PlanError(f"A_log holds {stored} entries but there are {full_heads} heads")
    a_log_shape = (1, 1, full_heads, 1) if stored == full_heads else (stored,)

    channels = full_heads * head_dim
    local_channels = local_heads * head_dim
    # name, kind, full rows, full elements per row, canonical on-disk shape.
    layout = (
        ("q_proj", _CHANNEL_ROWS, channels, hidden, (channels, hidden)),
        ("k_proj", _CHANNEL_ROWS, channels, hidden, (channels, hidden)),
        ("v_proj", _CHANNEL_ROWS, channels, hidden, (channels, hidden)),
        ("q_conv1d", _CHANNEL_ROWS, channels, conv_kernel, (channels, 1, conv_kernel)),
        ("k_conv1d", _CHANNEL_ROWS, channels, conv_kernel, (channels, 1, conv_kernel)),
        ("v_conv1d", _CHANNEL_ROWS, channels, conv_kernel, (channels, 1, conv_kernel)),
        ("f_a_proj", _REPLICATED, gate_rank, hidden, (gate_rank, hidden)),
        ("f_b_proj", _CHANNEL_ROWS, channels, gate_rank, (channels, gate_rank)),
        ("g_a_proj", _REPLICATED, gate_rank, hidden, (gate_rank, hidden)),
        ("g_b_proj", _CHANNEL_ROWS, channels, gate_rank, (channels, gate_rank)),
        ("b_proj", _HEAD_ROWS, full_heads, hidden, (full_heads, hidden)),
        ("g_proj", _CHANNEL_ROWS, channels, hidden, (channels, hidden)),
        ("A_log", _HEAD_ROWS, stored, 1, a_log_shape),
        ("dt_bias", _CHANNEL_ROWS, channels, 1, (channels,)),
        ("o_norm", _REPLICATED, head_dim, 1, (head_dim,)),
        ("o_proj", _CHANNEL_COLS, hidden, channels, (hidden, channels)),
    )
    order = {n: i for i, n in enumerate(names)}
    rows_in_order = sorted((row for row in layout if row[0] in order), key=lambda r: order[r[0]])
    tensors = []
    for name, kind, rows, row_elems, disk_shape in rows_in_order:
        elem_bytes = {**ELEM_BYTES, **FP8_ELEM_BYTES}[chosen[name]]
        if rows * row_elems * elem_bytes > MAX_BYTES:
            raise PlanError(
                f"KDA TP geometry too large: {name} {list(disk_shape)} x {elem_bytes} bytes "
                f"exceeds {MAX_BYTES} bytes"
            )
        if kind == _REPLICATED:
            local = (rows, row_elems, 0, 0)
        elif kind == _HEAD_ROWS:
            local = (local_heads, row_elems, tp_rank * local_heads, 0)
        elif kind == _CHANNEL_ROWS:
            local = (local_channels, row_elems, tp_rank * local_channels, 0)
        else:
            local = (rows, local_channels, 0, tp_rank * local_channels)
        entry = OracleTensor(name, kind, chosen[name], elem_bytes, rows, row_elems, *local, disk_shape)
        if quant_block is not None and name in quantized:
            entry = _with_scale(entry, quant_block, scale_layout, tp_size)
        tensors.append(entry)
    result = OraclePlan(
        tp_rank,
        tp_size,
        hidden,
        head_dim,
        full_heads,
        local_heads,
        conv_kernel,
        gate_rank,
        qk_multiple,
        full_rank_gate,
        stored,
        tensors,
    )
    if result.full_bytes > MAX_BYTES:
        raise PlanError(
            f"KDA TP geometry too large: the block is {result.full_bytes} bytes, "
            f"over {MAX_BYTES} bytes"
        )
    return result


def _resolve_dtypes(
    dtypes: Mapping[str, str] | None, names: Sequence[str], quantized: Sequence[str] = ()
) -> dict[str, str]:
    """Plan name -> dtype for the plan names ``names``, the defaults overridden by ``dtypes``;
    PlanError on keys outside ``names`` or unknown dtypes (FP8 only for ``quantized``)."""
    chosen = {
        n: "F8_E4M3" if n in quantized else "F32" if n in _F32_TENSORS else _DEFAULT_DTYPE
        for n in names
    }
    for name, dtype in (dtypes or {}).items():
        if name not in chosen:
            raise PlanError(f"unknown KDA tensor {name!r}; the plan has {', '.join(names)}")
        allowed = ELEM_BYTES if name not in quantized else {**ELEM_BYTES, **FP8_ELEM_BYTES}
        if dtype not in allowed:
            raise PlanError(f"{name}: dtype {dtype!r} is not one of {', '.join(allowed)}")
        chosen[name] = dtype
    return chosen


def _with_scale(
    weight: OracleTensor, block: tuple[int, int], layout: str, tp_size: int
) -> OracleTensor:
    """``weight`` with its scale grid's entry: blocks covering each rank's range, refusing a
    split in which some rank's range starts inside a block and reaches into the next."""
    bo, bi = block
    grid_rows, grid_cols = -(-weight.full_rows // bo), -(-weight.full_row_elems // bi)
    rows, cols, row_off, col_off = grid_rows, grid_cols, 0, 0
    if weight.kind != _REPLICATED:
        by_cols = weight.kind == _CHANNEL_COLS
        size = weight.local_row_elems if by_cols else weight.local_rows
        edge = bi if by_cols else bo
        for rank in range(tp_size):
            start, end = rank * size, (rank + 1) * size
            if start % edge and start // edge != (end - 1) // edge:
                axis = "columns" if by_cols else "rows"
                raise PlanError(
                    f"{weight.name}: rank {rank}'s {axis} {start}..{end} start inside block "
                    f"{start // edge} of {edge} {axis}; its scales cannot be sliced"
                )
        start = weight.src_col_offset if by_cols else weight.src_row_offset
        first, last = start // edge, -(-(start + size) // edge)
        if by_cols:
            cols, col_off = last - first, first
        else:
            rows, row_off = last - first, first
    shape = (grid_rows, 1, grid_cols, 1) if layout == "modelopt" else (grid_rows, grid_cols)
    scale = OracleTensor(
        f"{weight.name}.scale", weight.kind, "F32", 4, grid_rows, grid_cols, rows, cols, row_off,
        col_off, shape
    )
    return dataclasses.replace(weight, block=(bo, bi), scale=scale)


def shard_bytes(entry: OracleTensor, data: bytes | bytearray | memoryview) -> bytes:
    """This rank's bytes of one tensor (spec ``tp_bind.rs``, ``shard_bytes``).

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
    if entry.kind == _CHANNEL_COLS:
        first = entry.src_col_offset * entry.elem_bytes
        width = entry.local_row_elems * entry.elem_bytes
        return b"".join(
            view[r * row_bytes + first : r * row_bytes + first + width]
            for r in range(entry.local_rows)
        )
    start = entry.src_row_offset * row_bytes
    return bytes(view[start : start + entry.local_rows * row_bytes])


def local_shape(entry: OracleTensor, disk_shape: Sequence[int]) -> tuple[int, ...]:
    """This rank's shape of a tensor stored with shape ``disk_shape`` (spec ``tp_bind.rs``,
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
    if entry.kind == _REPLICATED:
        return shape
    if entry.kind == _CHANNEL_COLS:
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
    """The plan name of a ``self_attn`` tensor name (spec ``tp_bind.rs``, ``plan_name``).

    Strips a leading ``self_attn.`` and a trailing ``.weight`` where present:
    ``self_attn.q_proj.weight -> q_proj``, ``self_attn.A_log -> A_log`` (``A_log`` and
    ``dt_bias`` carry no ``.weight``). The result is a KDA tensor only if it is in
    :data:`TENSOR_NAMES`.
    """
    name = checkpoint_name.removeprefix("self_attn.")
    return name.removesuffix(".weight")


# ---------------------------------------------------------------------------------------------
# Verifier: a sharded checkpoint against its source, standard library only.
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KdaConfig:
    """KDA geometry read from a ``config.json``. ``kda_layers`` are 0-based layer indices;
    ``full_rank_gate`` is Kimi K3's ``use_full_rank_gate``."""

    hidden: int
    head_dim: int
    heads: int
    conv_kernel: int
    kda_layers: frozenset[int]
    full_rank_gate: bool = False


def read_kda_config(config: Mapping[str, Any], layers: Iterable[int] | None = None) -> KdaConfig:
    """The KDA geometry of a parsed ``config.json``.

    GLM-5.3-Flash (``model_type`` ``glm5_next`` or ``glm5_next_text``, at the top level or in
    ``text_config``) is read as transformers reads it: its ``text_config`` (or, flat, the top
    level), ``linear_head_dim`` / ``linear_num_heads`` / ``linear_conv_kernel_dim`` (a
    ``linear_attn_config`` ``head_dim`` / ``num_heads`` / ``short_conv_kernel_size`` wins;
    defaults 128, 64, 4, hidden 4096) and the ``"linear_attention"`` entries of ``layer_types``
    (default: 0-based index not 3 mod 4 of ``num_hidden_layers``, 45); never ``kda_layers``.

    Any other wrapper config (Kimi K3's ``model_type: kimi_k3``) keeps the language model's keys
    under ``text_config``; they are read from there when the top level has none. Two layouts are
    understood:

    * Kimi-Linear / Kimi K3: ``hidden_size`` and ``linear_attn_config`` with ``head_dim``,
      ``num_heads``, ``short_conv_kernel_size``, ``kda_layers`` (1-based layer numbers) and
      optionally ``use_full_rank_gate``.
    * transformers' ``kimi_linear`` / Qwen3-Next style: ``hidden_size``,
      ``linear_key_head_dim`` and ``linear_num_key_heads`` (older spelling: ``linear_head_dim``
      and ``linear_num_heads``), ``linear_conv_kernel_dim`` and ``layer_types``, where
      ``"linear_attention"`` or ``"kda_attention"`` at index ``i`` marks 0-based layer ``i``
      as KDA.

    ``layers`` (0-based) stands in for a Kimi-style config without ``kda_layers`` (``kda-tp
    shard --layers`` records them in each rank's header as ``kda_tp_layers``).

    Raises:
        CheckpointError: neither layout is present ("no KDA layers"), no layer is KDA, or a
            value has the wrong type.
    """
    text = config.get("text_config")
    model_types = {config.get("model_type")}
    if isinstance(text, Mapping):
        model_types.add(text.get("model_type"))
    if model_types & {"glm5_next", "glm5_next_text"}:
        return _read_glm_config(text if isinstance(text, Mapping) else config)
    layout_keys = ("linear_attn_config", "linear_key_head_dim", "linear_head_dim")
    if not any(k in config for k in layout_keys) and isinstance(text, Mapping):
        config = text
    try:
        if isinstance(config.get("linear_attn_config"), Mapping):
            lac = config["linear_attn_config"]
            result = KdaConfig(
                hidden=config["hidden_size"],
                head_dim=lac["head_dim"],
                heads=lac["num_heads"],
                conv_kernel=lac["short_conv_kernel_size"],
                kda_layers=(
                    _kimi_kda_layers(lac["kda_layers"], config.get("num_hidden_layers"))
                    if "kda_layers" in lac or layers is None
                    else frozenset(layers)
                ),
                full_rank_gate=lac.get("use_full_rank_gate", False) is True,
            )
        elif "layer_types" in config and (
            "linear_key_head_dim" in config or "linear_head_dim" in config
        ):
            key = "linear_key_head_dim" if "linear_key_head_dim" in config else "linear_head_dim"
            heads = "linear_num_key_heads" if key == "linear_key_head_dim" else "linear_num_heads"
            result = KdaConfig(
                hidden=config["hidden_size"],
                head_dim=config[key],
                heads=config[heads],
                conv_kernel=config["linear_conv_kernel_dim"],
                kda_layers=frozenset(
                    i
                    for i, t in enumerate(config["layer_types"])
                    if t in ("linear_attention", "kda_attention")
                ),
            )
        else:
            raise CheckpointError(
                "config.json: no KDA layers: neither linear_attn_config (Kimi-Linear, K3) nor "
                "layer_types + linear_key_head_dim (kimi_linear, Qwen3-Next style)"
            )
    except (KeyError, TypeError) as exc:
        raise CheckpointError(f"config.json: missing or malformed KDA key: {exc}") from exc
    sizes = (result.hidden, result.head_dim, result.heads, result.conv_kernel)
    if not all(isinstance(v, int) and v > 0 for v in sizes) or not all(
        isinstance(i, int) and i >= 0 for i in result.kda_layers
    ):
        raise CheckpointError(f"config.json: KDA geometry is not positive integers: {result}")
    if not result.kda_layers:
        raise CheckpointError("config.json: no KDA layers: the config marks no layer as KDA")
    return result


def _kimi_kda_layers(numbers: Any, count: Any) -> frozenset[int]:
    """0-based layers from Kimi-Linear's 1-based ``kda_layers``: each listed once, none beyond
    ``num_hidden_layers`` (transformers' ``KimiLinearConfig`` sets ``layer_types[n - 1]``)."""
    numbers = list(numbers)
    if len(set(numbers)) != len(numbers):
        raise CheckpointError(
            f"config.json: linear_attn_config.kda_layers {numbers} repeats a layer"
        )
    if isinstance(count, int) and any(isinstance(n, int) and n > count for n in numbers):
        raise CheckpointError(
            f"config.json: linear_attn_config.kda_layers {numbers} goes beyond "
            f"num_hidden_layers {count}"
        )
    return frozenset(n - 1 for n in numbers)


# transformers configuration_utils.py: ALLOWED_ATTN_LAYER_TYPES and _LEGACY_LAYER_TYPE_REMAP.
_ATTN_LAYER_TYPES = (
    "full_attention", "sliding_attention", "chunked_attention", "window_attention",
    "indexed_attention", "compressed_sparse_attention", "heavily_compressed_attention",
    "minimax_m3_sparse", "conv", "moe", "hybrid", "hybrid_sliding",
    "reference_sliding_attention", "linear_attention",
)
_LEGACY_LAYER_TYPES = {
    "mamba": "linear_attention",
    "attention": "full_attention",
    "deepseek_sparse_attention": "indexed_attention",
    "qwen_sparse_attention": "indexed_attention",
}


def _read_glm_config(text: Mapping[str, Any]) -> KdaConfig:
    """GLM-5.3-Flash's text config as transformers' ``Glm5NextTextConfig`` reads it: a
    ``linear_attn_config`` key wins over the flat one, then the class default; KDA layers are the
    ``"linear_attention"`` entries of ``layer_types`` (default: every layer whose 0-based index
    is not 3 mod 4); ``kda_layers`` is not read."""
    lac = text.get("linear_attn_config") or {}
    if not isinstance(lac, Mapping):
        raise CheckpointError("config.json: linear_attn_config is not an object")

    def get(flat: str, nested: str, default: int) -> Any:
        return lac[nested] if nested in lac else text.get(flat, default)

    types = text.get("layer_types")
    count = text.get("num_hidden_layers", 45)
    if types is None:
        kda = frozenset(i for i in range(count) if i % 4 != 3)
    else:
        # transformers: legacy names remapped, then PreTrainedConfig.validate_layer_type.
        types = [_LEGACY_LAYER_TYPES.get(t, t) for t in types]
        unknown = [t for t in types if t not in _ATTN_LAYER_TYPES]
        if unknown:
            raise CheckpointError(
                f"config.json: layer_types has {unknown}: transformers allows only "
                f"{_ATTN_LAYER_TYPES} for GLM-5.3-Flash"
            )
        if len(types) != count:
            raise CheckpointError(
                f"config.json: layer_types has {len(types)} entries, num_hidden_layers is {count}"
            )
        kda = frozenset(i for i, t in enumerate(types) if t == "linear_attention")
    result = KdaConfig(
        hidden=text.get("hidden_size", 4096),
        head_dim=get("linear_head_dim", "head_dim", 128),
        heads=get("linear_num_heads", "num_heads", 64),
        conv_kernel=get("linear_conv_kernel_dim", "short_conv_kernel_size", 4),
        kda_layers=kda,
    )
    sizes = (result.hidden, result.head_dim, result.heads, result.conv_kernel)
    if not all(isinstance(v, int) and v > 0 for v in sizes) or not result.kda_layers:
        raise CheckpointError(f"config.json: GLM-5.3-Flash KDA geometry is not valid: {result}")
    return result


@dataclass(frozen=True)
class _TensorInfo:
    """Where one tensor lives: file, dtype, shape and absolute byte range in the file."""

    path: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


def _read_safetensors_header(path: Path) -> tuple[dict[str, str], dict[str, _TensorInfo]]:
    """Parse one safetensors file's header: (``__metadata__``, tensor name -> info).

    Format: an 8-byte little-endian header length ``n``, ``n`` bytes of JSON, then the data
    region; each tensor's ``data_offsets`` are relative to the data region.

    Raises:
        CheckpointError: unreadable file, bad header, or offsets outside the file.
    """
    try:
        with path.open("rb") as f:
            size = path.stat().st_size
            prefix = f.read(8)
            if len(prefix) != 8:
                raise CheckpointError(f"{path}: shorter than the 8-byte safetensors prefix")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > size - 8:
                raise CheckpointError(f"{path}: header length {header_len} exceeds the file")
            header = json.loads(f.read(header_len))
    except OSError as exc:
        raise CheckpointError(f"{path}: {exc}") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: header is not JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{path}: __metadata__ is not a JSON object")
    data_start = 8 + header_len
    tensors = {}
    for name, entry in header.items():
        try:
            begin, end = entry["data_offsets"]
            info = _TensorInfo(
                path, entry["dtype"], tuple(entry["shape"]), data_start + begin, data_start + end
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{path}: {name}: malformed header entry") from exc
        if not data_start <= info.start <= info.end <= size:
            raise CheckpointError(f"{path}: {name}: data_offsets [{begin}, {end}) outside the file")
        tensors[name] = info
    return metadata, tensors


class _Checkpoint:
    """A Hugging Face checkpoint directory, read lazily: ``config.json`` plus either
    ``model.safetensors.index.json`` with its shards or a single ``*.safetensors`` file."""

    def __init__(
        self, directory: Path, *, require_index: bool, require_config: bool = True
    ) -> None:
        """Read the config (optional when not ``require_config``: a ``--kda-only`` rank has
        none) and every safetensors header.

        Raises:
            CheckpointError: missing (when required) or invalid ``config.json``; missing index when
                ``require_index``; no or several safetensors files without an index; an index
                whose ``weight_map`` disagrees with the files' headers; a tensor in two files.
        """
        self.directory = directory
        config_path = directory / "config.json"
        try:
            if require_config or config_path.exists():
                self.config = json.loads(config_path.read_text())
            else:
                self.config = {}
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{config_path}: {exc}") from exc
        if not isinstance(self.config, dict):
            raise CheckpointError(f"{config_path}: not a JSON object")

        index_path = directory / "model.safetensors.index.json"
        weight_map = None
        if index_path.is_file():
            try:
                weight_map = json.loads(index_path.read_text())["weight_map"]
                files = sorted({directory / f for f in weight_map.values()})
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
                raise CheckpointError(f"{index_path}: no readable weight_map: {exc}") from exc
        elif require_index:
            raise CheckpointError(f"{index_path}: missing")
        else:
            files = sorted(directory.glob("*.safetensors"))
            if len(files) != 1:
                raise CheckpointError(
                    f"{directory}: expected model.safetensors.index.json or exactly one "
                    f"*.safetensors file, found {len(files)} safetensors files"
                )

        self.metadata: dict[Path, dict[str, str]] = {}
        self.tensors: dict[str, _TensorInfo] = {}
        for path in files:
            self.metadata[path], tensors = _read_safetensors_header(path)
            for name, info in tensors.items():
                if name in self.tensors:
                    raise CheckpointError(f"{directory}: {name} is in two files")
                self.tensors[name] = info
        if weight_map is not None:
            for name in sorted(set(weight_map) | set(self.tensors)):
                listed = weight_map.get(name)
                actual = self.tensors[name].path.name if name in self.tensors else None
                if listed != actual:
                    raise CheckpointError(
                        f"{index_path}: {name} is mapped to {listed}, found in {actual}"
                    )

    def read(self, name: str) -> bytes:
        """The raw bytes of tensor ``name``."""
        info = self.tensors[name]
        with info.path.open("rb") as f:
            f.seek(info.start)
            return f.read(info.end - info.start)

    def chunks(self, name: str, chunk: int = 64 << 20) -> Iterator[bytes]:
        """The raw bytes of tensor ``name``, in pieces of at most ``chunk`` bytes."""
        info = self.tensors[name]
        with info.path.open("rb") as f:
            f.seek(info.start)
            left = info.end - info.start
            while left:
                piece = f.read(min(chunk, left))
                if not piece:
                    raise CheckpointError(f"{info.path}: {name}: file ends inside the tensor")
                left -= len(piece)
                yield piece


_LAYER_ATTN = re.compile(r"(\d+)\.(self_attn\..+)")
_A_LOG = re.compile(r"((?:.*\.)?layers\.)\d+\.self_attn\.A_log")


def _decoder_prefix(names: Iterable[str]) -> str:
    """The prefix, up to the layer index, of the layers holding ``A_log`` (a KDA-only tensor):
    ``model.layers.`` for Kimi-Linear; other stacks (a vision tower) are never KDA layers."""
    prefixes = {m[1] for n in names if (m := _A_LOG.fullmatch(n))}
    return prefixes.pop() if len(prefixes) == 1 else "model.layers."


def _kda_plan_name(
    name: str, kda_layers: frozenset[int], prefix: str, names: Iterable[str]
) -> str | None:
    """The plan name (one of ``names``) of checkpoint tensor ``name`` if it belongs to a KDA
    layer, else ``None``. A block scale ``<p>.weight_scale`` / ``<p>.weight_scale_inv`` is
    named ``<p>.scale``.

    Layer type comes from the config, never from a tensor's shape: full-attention (MLA) layers
    also have ``self_attn.q_proj`` and an ``o_proj`` of the same shape.
    """
    match = _LAYER_ATTN.fullmatch(name[len(prefix) :]) if name.startswith(prefix) else None
    if match is None or int(match[1]) not in kda_layers:
        return None
    candidate = plan_name(match[2])
    for suffix in (".weight_scale", ".weight_scale_inv"):
        if candidate.endswith(suffix):
            candidate = candidate.removesuffix(suffix) + ".scale"
    return candidate if candidate in names else None


def verify(checkpoint_dir: str | Path, out_dir: str | Path) -> list[str]:
    """Check a tensor-parallel sharded checkpoint against its source, byte for byte.

    Args:
        checkpoint_dir: the full checkpoint: ``config.json`` (see :func:`read_kda_config`) and
            ``model.safetensors.index.json`` with its shards, or a single ``*.safetensors``.
        out_dir: the sharded output: directories ``rank0`` .. ``rank{T-1}``, each a checkpoint
            directory with ``config.json``, ``model.safetensors.index.json`` and the
            ``*.safetensors`` files it lists, every file's ``__metadata__`` carrying
            ``"tp_rank": "r"`` and ``"tp_size": "T"``.

    What is checked, per rank ``r``: the same tensor names as the source, none missing or extra;
    every KDA-layer tensor ``model.layers.{i}.self_attn.<name>[.weight]`` (``i`` in the config's
    KDA layers, ``<name>`` a plan name) has the source's dtype, the shape :func:`local_shape`
    gives and exactly the bytes :func:`shard_bytes` gives for rank ``r``; every other tensor is
    identical to the source in dtype, shape and bytes. The plan uses the config's geometry,
    ``gate_rank`` = rows of the first KDA layer's ``f_a_proj`` and the dtypes of that layer's
    tensors; it is built with ``qk_multiple=1``, since the 256-channel kernel rule does not
    change which bytes a rank holds.

    A ``--kda-only`` output (``kda_tp_kda_only`` in its headers) must hold exactly the KDA
    tensors, and needs no ``config.json``. When the source config lists no KDA layers, the
    ``kda_tp_layers`` the rank headers record are used.

    Returns:
        One line per problem found, each naming the rank and the file or tensor; empty when the
        output is a correct sharding of the source.
    """
    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    meta = _rank_metadata(out_dir / "rank0")
    try:
        recorded = json.loads(meta.get("kda_tp_layers", "null"))
    except ValueError:
        recorded = None
    kda_only = meta.get("kda_tp_kda_only") == "1"
    try:
        source = _Checkpoint(checkpoint_dir, require_index=False)
        geometry = read_kda_config(source.config, recorded)
    except CheckpointError as exc:
        return [f"input: {exc}"]
    if not geometry.kda_layers:
        return [f"input: {checkpoint_dir}/config.json lists no KDA layer"]
    first = min(geometry.kda_layers)
    decoder = _decoder_prefix(source.tensors)
    prefix = f"{decoder}{first}.self_attn."
    f_a = source.tensors.get(prefix + "f_a_proj.weight")
    if f_a is None or not f_a.shape:
        return [f"input: {prefix}f_a_proj.weight is missing, so gate_rank is unknown"]
    names: Sequence[str] = (
        FULL_RANK_GATE_TENSOR_NAMES if geometry.full_rank_gate else TENSOR_NAMES
    )
    dtypes = {
        name: source.tensors[full].dtype
        for name in names
        for full in (prefix + name, prefix + name + ".weight")
        if full in source.tensors
    }
    a_log = source.tensors.get(prefix + "A_log")
    a_log_len = math.prod(a_log.shape) if a_log is not None else None
    fp8 = [n for n, d in dtypes.items() if d in FP8_ELEM_BYTES]
    block = _config_block(source.config, checkpoint_dir) if fp8 else None
    if fp8 and block is None:
        return [f"input: {prefix}{fp8[0]}.weight is FP8 but the config declares no block size"]
    problems = _padding_problems(source, geometry, decoder)

    if not out_dir.is_dir():
        return [f"output: {out_dir} is not a directory"]
    rank_dirs = sorted(
        (int(m[1]), p)
        for p in out_dir.iterdir()
        if p.is_dir() and (m := re.fullmatch(r"rank(\d+)", p.name))
    )
    if not rank_dirs:
        return [f"output: {out_dir} holds no rank<N> directory"]
    tp_size = _declared_tp_size(rank_dirs[0][1]) or len(rank_dirs)
    if [r for r, _ in rank_dirs] != list(range(tp_size)):
        names = [p.name for _, p in rank_dirs][:8]
        return [
            f"output: rank directories {names} are not rank0 .. rank{tp_size - 1} "
            f"(tp_size {tp_size}; incomplete run?)"
        ]

    for rank, rank_dir in rank_dirs:
        try:
            rank_plan = plan(
                rank,
                tp_size,
                geometry.hidden,
                geometry.head_dim,
                geometry.heads,
                geometry.conv_kernel,
                f_a.shape[0],
                qk_multiple=1,
                dtypes=dtypes,
                full_rank_gate=geometry.full_rank_gate,
                a_log_len=a_log_len,
                quant_block=block,
                quantized=fp8 if block else None,
            )
        except PlanError as exc:
            problems.append(f"rank{rank}: no shard plan for this geometry: {exc}")
            continue
        try:
            sharded = _Checkpoint(rank_dir, require_index=True, require_config=not kda_only)
        except CheckpointError as exc:
            problems.append(f"rank{rank}: {exc}")
            continue
        problems += _check_rank(
            source, sharded, rank_plan, geometry.kda_layers, decoder, kda_only
        )
        if not kda_only:
            problems += _companion_problems(checkpoint_dir, rank, rank_dir)
    return problems


def _companion_problems(checkpoint: Path, rank: int, rank_dir: Path) -> list[str]:
    """Each of the input's other files (``config.json``, tokenizer files: not ``*.safetensors``,
    not the index, not hidden; for a single-file input, its ``config.json``) must be in the
    rank directory, byte for byte."""
    if checkpoint.is_dir():
        files = [
            p for p in sorted(checkpoint.iterdir())
            if p.is_file() and not p.name.startswith(".")
            and not p.name.endswith(".safetensors") and p.name != "model.safetensors.index.json"
        ]
    else:
        files = [p for p in [checkpoint.parent / "config.json"] if p.is_file()]
    problems = []
    for original in files:
        copy = rank_dir / original.name
        if not copy.is_file():
            problems.append(f"rank{rank}: {original.name} is missing")
        elif copy.read_bytes() != original.read_bytes():
            problems.append(f"rank{rank}: {original.name} differs from the input's")
    return problems


def _config_block(config: Mapping[str, Any], directory: Path) -> tuple[int, int] | None:
    """The FP8 block edge a config declares: 128 x 128 for NVIDIA ModelOpt (``modelopt``,
    ``modelopt_mixed`` or an ``hf_quant_config.json``), ``weight_block_size`` for DeepSeek-style
    ``fp8``, a block ``block_structure`` for compressed-tensors; None otherwise."""
    quant = config.get("quantization_config")
    if not isinstance(quant, Mapping):
        quant = (config.get("text_config") or {}).get("quantization_config")
    if not isinstance(quant, Mapping):
        if (directory / "hf_quant_config.json").is_file():
            return (128, 128)
        return None
    method = quant.get("quant_method")
    if method in ("modelopt", "modelopt_mixed"):
        return (128, 128)
    if method == "fp8" and quant.get("weight_block_size"):
        return tuple(quant["weight_block_size"])
    if method == "compressed-tensors":
        for group in (quant.get("config_groups") or {}).values():
            weights = group.get("weights") or {}
            if weights.get("strategy") == "block":
                return tuple(weights["block_structure"])
    return None


def _padding_problems(source: _Checkpoint, geometry: KdaConfig, decoder: str) -> list[str]:
    """One line per KDA layer whose ``A_log`` holds a non-zero entry past the heads (K3 pads
    ``A_log`` with zeros; a non-zero pad means the checkpoint is not what the plan assumes)."""
    problems = []
    for layer in sorted(geometry.kda_layers):
        name = f"{decoder}{layer}.self_attn.A_log"
        info = source.tensors.get(name)
        if info is None or info.dtype != "F32" or math.prod(info.shape) <= geometry.heads:
            continue
        values = struct.unpack(f"<{math.prod(info.shape)}f", source.read(name))
        for index in range(geometry.heads, len(values)):
            if values[index] != 0:
                problems.append(
                    f"input: {name}: padding entry {index} is {values[index]!r}, expected 0"
                )
                break
    return problems


def _rank_metadata(rank_dir: Path) -> dict[str, str]:
    """The ``__metadata__`` of the first safetensors file in ``rank_dir`` ({} if unreadable)."""
    for path in sorted(rank_dir.glob("*.safetensors")):
        try:
            return _read_safetensors_header(path)[0]
        except (CheckpointError, OSError):
            return {}
    return {}


def _declared_tp_size(rank_dir: Path) -> int | None:
    """``tp_size`` from the ``__metadata__`` of the first safetensors file in ``rank_dir``."""
    for path in sorted(rank_dir.glob("*.safetensors")):
        try:
            metadata, _ = _read_safetensors_header(path)
            return int(metadata["tp_size"])
        except (CheckpointError, KeyError, ValueError, OSError):
            return None
    return None


def _check_rank(
    source: _Checkpoint,
    sharded: _Checkpoint,
    rank_plan: OraclePlan,
    kda_layers: frozenset[int],
    decoder: str,
    kda_only: bool = False,
) -> list[str]:
    """The problems of one rank's directory; see :func:`verify`. A ``--kda-only`` rank
    (``kda_tp_kda_only`` in its headers) holds the KDA tensors and nothing else."""
    tag = f"rank{rank_plan.tp_rank}"
    entries = {t.name: t for t in rank_plan.tensors}
    entries.update({t.scale.name: t.scale for t in rank_plan.tensors if t.scale})
    problems = []
    for path, metadata in sharded.metadata.items():
        for key, want in (("tp_rank", rank_plan.tp_rank), ("tp_size", rank_plan.tp_size)):
            if metadata.get(key) != str(want):
                problems.append(
                    f"{tag}: {path.name}: __metadata__ {key} is {metadata.get(key)!r}, "
                    f"expected {str(want)!r}"
                )
    expected = {
        n for n in source.tensors
        if not kda_only or _kda_plan_name(n, kda_layers, decoder, entries) is not None
    }
    problems += [f"{tag}: {n}: missing" for n in sorted(expected - sharded.tensors.keys())]
    problems += [
        f"{tag}: {n}: not in the input" for n in sorted(sharded.tensors.keys() - source.tensors)
    ]

    for name in sorted(source.tensors.keys() & sharded.tensors.keys()):
        src, out = source.tensors[name], sharded.tensors[name]
        if out.dtype != src.dtype:
            problems.append(f"{tag}: {name}: dtype {out.dtype}, input has {src.dtype}")
            continue
        kda_name = _kda_plan_name(name, kda_layers, decoder, entries)
        if kda_name is None:
            want_shape = src.shape
        else:
            entry = entries[kda_name]
            if src.dtype != entry.dtype:
                problems.append(
                    f"{tag}: {name}: input dtype {src.dtype} differs from the first KDA "
                    f"layer's {entry.dtype}"
                )
                continue
            try:
                want_shape = local_shape(entry, src.shape)
            except ShapeMismatchError as exc:
                problems.append(f"{tag}: {name}: input {exc}")
                continue
        if out.shape != want_shape:
            problems.append(f"{tag}: {name}: shape {list(out.shape)}, expected {list(want_shape)}")
            continue
        try:
            if kda_name is None:
                same = out.end - out.start == src.end - src.start and all(
                    a == b for a, b in zip(source.chunks(name), sharded.chunks(name), strict=True)
                )
            else:
                same = sharded.read(name) == shard_bytes(entry, source.read(name))
        except (CheckpointError, ShapeMismatchError) as exc:
            problems.append(f"{tag}: {name}: {exc}")
            continue
        if not same:
            what = "this rank's slice of the input" if kda_name else "the input"
            problems.append(f"{tag}: {name}: bytes differ from {what}")
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``python -m kda_tp.oracle verify CHECKPOINT OUT``.

    Prints each problem to stderr and a one-line summary to stdout. Returns the exit status:
    0 when the output is a correct sharding of the checkpoint, 1 otherwise (2 for bad usage,
    from argparse).
    """
    parser = argparse.ArgumentParser(
        prog="python -m kda_tp.oracle",
        description="Check a KDA tensor-parallel sharded checkpoint against its source.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("verify", help="compare OUT/rank*/ with CHECKPOINT byte for byte")
    check.add_argument("checkpoint", type=Path, help="the full (unsharded) checkpoint directory")
    check.add_argument("out", type=Path, help="the directory holding rank0 .. rank{T-1}")
    args = parser.parse_args(argv)

    problems = verify(args.checkpoint, args.out)
    for line in problems:
        print(line, file=sys.stderr)
    if problems:
        print(f"FAIL: {len(problems)} problem(s) in {args.out} against {args.checkpoint}")
        return 1
    print(f"OK: {args.out} is a correct tensor-parallel sharding of {args.checkpoint}")
    return 0

