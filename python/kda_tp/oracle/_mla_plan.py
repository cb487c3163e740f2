"""The oracle's shard plan of one MLA layer (spec ``tests/data/spec/mla.md``, sections 1 and 4).

Restated from the spec with nothing but the standard library, in the KDA plan's vocabulary
(:class:`~kda_tp.oracle.OracleTensor`): with ``H`` MLA heads (``num_attention_heads``),
``T`` ranks, ``Hl = H / T``, rank ``r`` keeps rows ``[r * Hl * u, (r + 1) * Hl * u)`` of
``q_proj``/``q_b_proj`` (``u = P + Pr``), ``kv_b_proj`` (``u = P + V``) and K3's ``g_proj``
(``u = V``), columns ``[r * Hl * V, (r + 1) * Hl * V)`` of ``o_proj``, and the whole of
``q_a_proj``, ``q_a_layernorm``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm`` and GLM-5.3's
DSA ``indexer.*``. Block-FP8 projections (spec section 5) carry their scale grid's entry: the
whole grid when replicated, the grid rows (columns for ``o_proj``) of the rank's blocks when
sliced, a share per rank that is not a whole number of blocks refused at ``tp_size > 1``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kda_tp.errors import CheckpointError, PlanError

from ._shard_plan import (
    CHANNEL_COLS,
    CHANNEL_ROWS,
    ELEM_BYTES,
    FP8_ELEM_BYTES,
    MAX_BYTES,
    REPLICATED,
    OracleTensor,
)

#: The DSA indexer's tensors (GLM-5.3-Flash), by plan name, in plan order: the checkpoint name
#: after ``self_attn.`` without a trailing ``.weight``.
INDEXER_TENSOR_NAMES = (
    "indexer.wq_b",
    "indexer.wk",
    "indexer.weights_proj",
    "indexer.k_norm",
    "indexer.k_norm.bias",
    "indexer.index_kpool_compress_ape",
    "indexer.index_kpool_compress_gate",
)


@dataclass(frozen=True)
class OracleMlaPlan:
    """The shard plan of one MLA layer on rank ``tp_rank`` of ``tp_size``: the geometry as
    given, ``local_heads = heads / tp_size``, and one :class:`OracleTensor` per tensor in plan
    order (``q_proj``, or ``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``; then
    ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``g_proj`` with the output gate,
    ``o_proj`` and the indexer's :data:`INDEXER_TENSOR_NAMES`)."""

    tp_rank: int
    tp_size: int
    hidden: int
    heads: int
    local_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    output_gate: bool
    indexer: tuple[int, int, int] | None
    tensors: list[OracleTensor]

    @property
    def local_bytes(self) -> int:
        """Bytes this rank stores for the whole layer."""
        return sum(t.local_bytes for t in self.tensors)

    @property
    def full_bytes(self) -> int:
        """Bytes the whole layer occupies on disk."""
        return sum(t.full_bytes for t in self.tensors)

    def get(self, name: str) -> OracleTensor | None:
        """The entry for plan name ``name`` (e.g. ``"kv_b_proj"``, or ``"kv_b_proj.scale"``
        for a block-FP8 weight's scale grid), or ``None``."""
        entries = [*self.tensors, *(t.scale for t in self.tensors if t.scale is not None)]
        return next((t for t in entries if t.name == name), None)


def mla_plan(
    tp_rank: int,
    tp_size: int,
    hidden: int,
    heads: int,
    kv_lora_rank: int,
    qk_nope_head_dim: int,
    qk_rope_head_dim: int,
    v_head_dim: int,
    *,
    q_lora_rank: int | None = None,
    output_gate: bool = False,
    indexer: tuple[int, int, int] | None = None,
    dtypes: Mapping[str, str] | None = None,
    quant_block: tuple[int, int] | None = None,
    quantized: tuple[str, ...] | list[str] | None = None,
    scale_layout: str = "grid",
) -> OracleMlaPlan:
    """The shard plan of one MLA layer for rank ``tp_rank`` of ``tp_size`` (spec ``mla.md``).

    Args:
        tp_rank: this rank, ``0 <= tp_rank < tp_size``.
        tp_size: the (attention-)TP world size.
        hidden: ``hidden_size`` ``d``.
        heads: ``num_attention_heads`` ``H``.
        kv_lora_rank: ``L``.
        qk_nope_head_dim: ``P``.
        qk_rope_head_dim: ``Pr`` (0 for NoPE).
        v_head_dim: ``V``.
        q_lora_rank: ``Q``; None for Kimi-Linear's full-rank ``q_proj``.
        output_gate: K3's ``g_proj`` ``[H * V, d]``.
        indexer: ``(index_n_heads, index_head_dim, index_kpool)`` of GLM-5.3's DSA indexer.
        dtypes: plan name -> ``"BF16"``, ``"F16"``, ``"F32"`` or ``"F64"`` (``"F8_E4M3"`` /
            ``"F8_E5M2"`` for a quantized projection) over the defaults (BF16; F32 for
            ``indexer.index_kpool_compress_ape``; F8_E4M3 for a quantized projection).
        quant_block: ``(b0, b1)`` block edge of the block-FP8 projections (spec section 5).
        quantized: their plan names (default with ``quant_block``: every projection of the
            layer); each gets ``block`` and a ``scale`` entry (F32, counts and offsets in
            blocks).
        scale_layout: ``"grid"`` (``[ob, ib]``) or ``"modelopt"`` (``[ob, 1, ib, 1]``), the
            scale's canonical ``disk_shape``.

    Returns:
        An :class:`OracleMlaPlan`. Per tensor (full ``[rows, row_elems]``):

        ==================================  ============  ==============  ===================
        tensor                              kind          full            this rank keeps
        ==================================  ============  ==============  ===================
        q_proj (no q-LoRA)                  CHANNEL_ROWS  [H*(P+Pr), d]   rows of its heads
        q_a_proj                            REPLICATED    [Q, d]          everything
        q_a_layernorm                       REPLICATED    [Q, 1]          everything
        q_b_proj                            CHANNEL_ROWS  [H*(P+Pr), Q]   rows of its heads
        kv_a_proj_with_mqa                  REPLICATED    [L+Pr, d]       everything
        kv_a_layernorm                      REPLICATED    [L, 1]          everything
        kv_b_proj                           CHANNEL_ROWS  [H*(P+V), L]    rows of its heads
        g_proj (output gate)                CHANNEL_ROWS  [H*V, d]        rows of its heads
        o_proj                              CHANNEL_COLS  [d, H*V]        columns of its heads
        indexer.* (GLM-5.3)                 REPLICATED    see the spec    everything
        ==================================  ============  ==============  ===================

    Raises:
        PlanError: ``tp_size`` zero or ``tp_rank`` not in ``[0, tp_size)``; a size below 1
            (``qk_rope_head_dim`` below 0); ``heads`` not divisible by ``tp_size``; a dtype
            override naming a tensor this layer lacks or a dtype outside the four (FP8 for a
            quantized projection); a quantized name that is no projection of this layer; at
            ``tp_size > 1``, a quantized sliced weight whose share per rank is not a whole
            number of blocks; a tensor or the layer over :data:`~kda_tp.oracle.MAX_BYTES`
            bytes.
    """
    if tp_size <= 0 or not 0 <= tp_rank < tp_size:
        raise PlanError(f"tp_rank {tp_rank} is not in [0, tp_size {tp_size})")
    sizes = {
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "kv_lora_rank": kv_lora_rank,
        "qk_nope_head_dim": qk_nope_head_dim,
        "v_head_dim": v_head_dim,
    }
    if q_lora_rank is not None:
        sizes["q_lora_rank"] = q_lora_rank
    if indexer is not None:
        sizes.update(zip(("index_n_heads", "index_head_dim", "index_kpool"), indexer))
    for label, size in sizes.items():
        if size <= 0:
            raise PlanError(f"degenerate MLA geometry: {label} is {size}, must be at least 1")
    if qk_rope_head_dim < 0:
        raise PlanError(f"degenerate MLA geometry: qk_rope_head_dim is {qk_rope_head_dim}")
    if heads % tp_size:
        raise PlanError(
            f"MLA TP needs num_attention_heads ({heads}) divisible by tp_size ({tp_size})"
        )
    local_heads = heads // tp_size
    d, lora = hidden, kv_lora_rank
    qk, kv, v = qk_nope_head_dim + qk_rope_head_dim, qk_nope_head_dim + v_head_dim, v_head_dim
    # name, kind, full rows, full elements per row, on-disk shape, elements per head.
    rows: list[tuple[str, str, int, int, tuple[int, ...], int]]
    if q_lora_rank is None:
        rows = [("q_proj", CHANNEL_ROWS, heads * qk, d, (heads * qk, d), qk)]
    else:
        q = q_lora_rank
        rows = [
            ("q_a_proj", REPLICATED, q, d, (q, d), 0),
            ("q_a_layernorm", REPLICATED, q, 1, (q,), 0),
            ("q_b_proj", CHANNEL_ROWS, heads * qk, q, (heads * qk, q), qk),
        ]
    rows += [
        ("kv_a_proj_with_mqa", REPLICATED, lora + qk_rope_head_dim, d,
         (lora + qk_rope_head_dim, d), 0),
        ("kv_a_layernorm", REPLICATED, lora, 1, (lora,), 0),
        ("kv_b_proj", CHANNEL_ROWS, heads * kv, lora, (heads * kv, lora), kv),
    ]
    if output_gate:
        rows.append(("g_proj", CHANNEL_ROWS, heads * v, d, (heads * v, d), v))
    rows.append(("o_proj", CHANNEL_COLS, d, heads * v, (d, heads * v), v))
    if indexer is not None:
        n, h, kpool = indexer
        wq_in = d if q_lora_rank is None else q_lora_rank
        shapes = ((n * h, wq_in), (h, d), (n, d), (h,), (h,), (kpool, h), (h, d))
        for name, shape in zip(INDEXER_TENSOR_NAMES, shapes):
            rows.append((name, REPLICATED, shape[0], shape[1] if len(shape) == 2 else 1,
                         shape, 0))

    projections = [r[0] for r in rows if r[0].endswith("_proj") or r[0] == "kv_a_proj_with_mqa"]
    if quant_block is None:
        if quantized:
            raise PlanError("quantized needs quant_block, the block size")
        quantized = ()
    else:
        if not all(1 <= b <= 1 << 16 for b in quant_block):
            raise PlanError(f"block size {quant_block} must be in [1, 65536]")
        quantized = tuple(projections if quantized is None else quantized)
        for name in quantized:
            if name not in projections:
                raise PlanError(f"{name} is not a projection of this MLA layer "
                                f"({', '.join(projections)}): it is never block-quantized")
    chosen = {
        r[0]: "F32" if r[0] == "indexer.index_kpool_compress_ape"
        else "F8_E4M3" if r[0] in quantized else "BF16" for r in rows
    }
    for name, dtype in (dtypes or {}).items():
        if name not in chosen:
            raise PlanError(f"unknown MLA tensor {name!r}; this layer has {', '.join(chosen)}")
        allowed = {**ELEM_BYTES, **(FP8_ELEM_BYTES if name in quantized else {})}
        if dtype not in allowed:
            raise PlanError(f"{name}: dtype {dtype!r} is not one of {', '.join(allowed)}")
        chosen[name] = dtype
    tensors = []
    for name, kind, full_rows, row_elems, shape, per_head in rows:
        elem_bytes = {**ELEM_BYTES, **FP8_ELEM_BYTES}[chosen[name]]
        if full_rows * row_elems * elem_bytes > MAX_BYTES:
            raise PlanError(
                f"MLA geometry too large: {name} {list(shape)} exceeds {MAX_BYTES} bytes"
            )
        local = local_heads * per_head
        if kind == CHANNEL_ROWS:
            placement = (local, row_elems, tp_rank * local, 0)
        elif kind == CHANNEL_COLS:
            placement = (full_rows, local, 0, tp_rank * local)
        else:
            placement = (full_rows, row_elems, 0, 0)
        entry = OracleTensor(name, kind, chosen[name], elem_bytes, full_rows, row_elems,
                             *placement, shape)
        if name in quantized:
            assert quant_block is not None  # quantized is empty without it
            entry = _with_whole_block_scale(entry, quant_block, scale_layout, tp_size)
        tensors.append(entry)
    result = OracleMlaPlan(
        tp_rank, tp_size, hidden, heads, local_heads, q_lora_rank, kv_lora_rank,
        qk_nope_head_dim, qk_rope_head_dim, v_head_dim, output_gate, indexer, tensors,
    )
    if result.full_bytes > MAX_BYTES:
        raise PlanError(f"MLA geometry too large: the layer is {result.full_bytes} bytes")
    return result


def _with_whole_block_scale(
    weight: OracleTensor, block: tuple[int, int], layout: str, tp_size: int
) -> OracleTensor:
    """``weight`` with its scale grid's entry (spec section 5): the whole grid when replicated
    (or at ``tp_size == 1``), else the grid rows (columns for ``o_proj``) of this rank's blocks,
    refusing a share per rank that is not a whole number of blocks (vLLM's
    ``validate_fp8_block_shape``)."""
    b0, b1 = block
    grid_rows, grid_cols = -(-weight.full_rows // b0), -(-weight.full_row_elems // b1)
    rows, cols, row_off, col_off = grid_rows, grid_cols, 0, 0
    if weight.kind == CHANNEL_COLS:
        share, start, edge, axis = weight.local_row_elems, weight.src_col_offset, b1, "columns"
    elif weight.kind == CHANNEL_ROWS:
        share, start, edge, axis = weight.local_rows, weight.src_row_offset, b0, "rows"
    else:
        share = 0
    if share and tp_size > 1:
        if share % edge:
            raise PlanError(
                f"{weight.name}: rank's {axis} {start}..{start + share} do not start and end "
                f"on {edge}-{axis} block boundaries at tp_size {tp_size}"
            )
        if weight.kind == CHANNEL_COLS:
            cols, col_off = share // edge, start // edge
        else:
            rows, row_off = share // edge, start // edge
    shape = (grid_rows, 1, grid_cols, 1) if layout == "modelopt" else (grid_rows, grid_cols)
    scale = OracleTensor(f"{weight.name}.scale", weight.kind, "F32", 4, grid_rows, grid_cols,
                         rows, cols, row_off, col_off, shape)
    return dataclasses.replace(weight, block=block, scale=scale)


#: transformers' ``Glm5NextTextConfig`` defaults (spec ``mla.md`` section 1, Geometry).
_GLM_DEFAULTS: dict[str, Any] = {
    "hidden_size": 4096, "num_attention_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 256, "qk_rope_head_dim": 0, "v_head_dim": 256, "index_topk": 2048,
    "index_n_heads": 32, "index_head_dim": 128, "index_kpool": 16,
}


def read_mla_geometry(config: Mapping[str, Any]) -> dict[str, Any]:
    """The MLA geometry of a parsed ``config.json`` as :func:`mla_plan`'s arguments after
    ``tp_rank, tp_size`` (``hidden``, ``heads``, ``kv_lora_rank``, ``qk_nope_head_dim``,
    ``qk_rope_head_dim``, ``v_head_dim``, ``q_lora_rank``, ``output_gate``, ``indexer``).

    Spec ``mla.md`` sections 0 and 1: the language model's keys (``text_config`` of a wrapper
    whose top level has no ``hidden_size``; GLM-5.3-Flash's ``text_config``);
    ``num_attention_heads`` (default 32 for Kimi), ``q_lora_rank`` (null: Kimi-Linear's
    ``q_proj``), ``mla_use_output_gate`` (K3's ``g_proj``); GLM-5.3-Flash (``model_type``
    ``glm5_next``/``glm5_next_text``) defaults to transformers' ``Glm5NextTextConfig`` and has
    the DSA indexer ``(index_n_heads, index_head_dim, index_kpool)`` unless ``index_topk`` is
    null.

    Raises:
        CheckpointError: an MLA size is missing or not a non-negative integer.
    """
    text = config.get("text_config")
    types = {config.get("model_type")}
    if isinstance(text, Mapping):
        types.add(text.get("model_type"))
        if "hidden_size" not in config or types & {"glm5_next", "glm5_next_text"}:
            config = text
    glm = bool(types & {"glm5_next", "glm5_next_text"})
    defaults = _GLM_DEFAULTS if glm else {"num_attention_heads": 32, "q_lora_rank": None}

    def size(key: str, optional: bool = False) -> Any:
        found = config.get(key, defaults.get(key))
        if found is None and optional:
            return None
        if isinstance(found, bool) or not isinstance(found, int) or found < 0:
            raise CheckpointError(f"config.json: MLA key {key} is {found!r}, not a size")
        return found

    indexer = None
    if glm and config.get("index_topk", 2048) is not None:
        indexer = (size("index_n_heads"), size("index_head_dim"), size("index_kpool"))
    return {
        "hidden": size("hidden_size"), "heads": size("num_attention_heads"),
        "kv_lora_rank": size("kv_lora_rank"), "qk_nope_head_dim": size("qk_nope_head_dim"),
        "qk_rope_head_dim": size("qk_rope_head_dim"), "v_head_dim": size("v_head_dim"),
        "q_lora_rank": size("q_lora_rank", optional=True),
        "output_gate": config.get("mla_use_output_gate") is True, "indexer": indexer,
    }
