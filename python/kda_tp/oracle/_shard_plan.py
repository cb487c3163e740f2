"""The oracle's shard plan of one KDA block (spec ``tp.rs.txt``, ``KdaTpPlan::new``).

Which rows or columns of each KDA tensor rank ``r`` of ``tp_size`` owns, restated from the spec
with nothing but the standard library, and each block-quantized projection's scale grid (see
the package docstring for the rules). Sizes are in elements unless a name says bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kda_tp.errors import PlanError

#: The tensors of one KDA block, by plan name, in plan order (spec ``tp.rs.txt``, ``tensors``).
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

#: The tensors of one Kimi K3 KDA block, in plan order: :data:`TENSOR_NAMES` with the one
#: full-rank output gate ``g_proj`` in place of the low-rank ``g_a_proj`` and ``g_b_proj``.
FULL_RANK_GATE_TENSOR_NAMES = tuple(
    "g_proj" if name == "g_a_proj" else name for name in TENSOR_NAMES if name != "g_b_proj"
)

#: Bytes per element of the safetensors dtypes a KDA tensor may have.
ELEM_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8}

#: Bytes per element of the FP8 dtypes a block-quantized projection may have.
FP8_ELEM_BYTES = {"F8_E4M3": 1, "F8_E5M2": 1}

#: Largest byte size a tensor, or a whole block, may have (``isize::MAX`` on 64-bit targets, the
#: bound of a Rust slice and of a signed 64-bit file offset). Larger geometry is refused.
MAX_BYTES = 2**63 - 1

#: Default dtypes: BF16 everywhere, except the two float32 gate parameters (Kimi-Linear's
#: ``A_log`` and ``dt_bias`` are created float32; spec ``tp.rs.txt`` uses ``F32`` for both).
_DEFAULT_DTYPE = "BF16"
_F32_TENSORS = ("A_log", "dt_bias")

#: The four placements (``OracleTensor.kind``): whole on every rank, rows by head, rows by
#: channel, columns by channel (``o_proj``, row-parallel).
REPLICATED = "REPLICATED"
HEAD_ROWS = "HEAD_ROWS"
CHANNEL_ROWS = "CHANNEL_ROWS"
CHANNEL_COLS = "CHANNEL_COLS"


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
    """The shard plan of one KDA block for rank ``tp_rank`` of ``tp_size`` (spec ``tp.rs.txt``,
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
    # The sizes that must be positive, by parameter name: checked here, stored on the plan below.
    sizes = {
        "hidden": hidden,
        "head_dim": head_dim,
        "full_heads": full_heads,
        "conv_kernel": conv_kernel,
        "gate_rank": gate_rank,
        "qk_multiple": qk_multiple,
    }
    for label, value in sizes.items():
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
        ("q_proj", CHANNEL_ROWS, channels, hidden, (channels, hidden)),
        ("k_proj", CHANNEL_ROWS, channels, hidden, (channels, hidden)),
        ("v_proj", CHANNEL_ROWS, channels, hidden, (channels, hidden)),
        ("q_conv1d", CHANNEL_ROWS, channels, conv_kernel, (channels, 1, conv_kernel)),
        ("k_conv1d", CHANNEL_ROWS, channels, conv_kernel, (channels, 1, conv_kernel)),
        ("v_conv1d", CHANNEL_ROWS, channels, conv_kernel, (channels, 1, conv_kernel)),
        ("f_a_proj", REPLICATED, gate_rank, hidden, (gate_rank, hidden)),
        ("f_b_proj", CHANNEL_ROWS, channels, gate_rank, (channels, gate_rank)),
        ("g_a_proj", REPLICATED, gate_rank, hidden, (gate_rank, hidden)),
        ("g_b_proj", CHANNEL_ROWS, channels, gate_rank, (channels, gate_rank)),
        ("b_proj", HEAD_ROWS, full_heads, hidden, (full_heads, hidden)),
        ("g_proj", CHANNEL_ROWS, channels, hidden, (channels, hidden)),
        ("A_log", HEAD_ROWS, stored, 1, a_log_shape),
        ("dt_bias", CHANNEL_ROWS, channels, 1, (channels,)),
        ("o_norm", REPLICATED, head_dim, 1, (head_dim,)),
        ("o_proj", CHANNEL_COLS, hidden, channels, (hidden, channels)),
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
        if kind == REPLICATED:
            local = (rows, row_elems, 0, 0)
        elif kind == HEAD_ROWS:
            local = (local_heads, row_elems, tp_rank * local_heads, 0)
        elif kind == CHANNEL_ROWS:
            local = (local_channels, row_elems, tp_rank * local_channels, 0)
        else:
            local = (rows, local_channels, 0, tp_rank * local_channels)
        entry = OracleTensor(name, kind, chosen[name], elem_bytes, rows, row_elems, *local, disk_shape)
        if quant_block is not None and name in quantized:
            entry = _with_scale(entry, quant_block, scale_layout, tp_size)
        tensors.append(entry)
    result = OraclePlan(
        tp_rank, tp_size, local_heads=local_heads, full_rank_gate=full_rank_gate,
        a_log_len=stored, tensors=tensors, **sizes,
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
    if weight.kind != REPLICATED:
        by_cols = weight.kind == CHANNEL_COLS
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
