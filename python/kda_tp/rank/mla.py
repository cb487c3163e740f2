"""The shard plan of an MLA layer: which part of each tensor of a hybrid's MLA (multi-head
latent attention) layers a tensor-parallel rank keeps.

The arithmetic is in the Rust core (``kda_tp._native.MlaTpPlan``); this module adds the plan of
a described checkpoint or config (the MLA layers and geometry read by
``kda_tp.model.mla.parse_mla_config``, from the config only) and the checkpoint names of the
plan's tensors.
"""

from __future__ import annotations

from typing import Any

from .. import _native
from ..checkpoint.description import CheckpointDescription, check_declared
from ..checkpoint.names import location, param_name
from ..checkpoint.reader import missing_tensor
from ..errors import CheckpointError, DtypeMismatchError, KdaTpError, PlanError
from ..model.dtypes import FP8_DTYPES
from ..model.mla import MlaConfig, mla_layers, parse_mla_config
from ..model.quant import SCALE_SUFFIXES, BlockFormat
from .plan import quant_options

__all__ = ["MlaTpPlan", "mla_tensor_name", "planned_mla_tensors", "rank_mla_plan"]

# Indexer parameters stored without a ".weight" suffix (vLLM keeps the checkpoint names).
_BARE = ("indexer.index_kpool_compress_ape", "indexer.index_kpool_compress_gate")


class MlaTpPlan(_native.MlaTpPlan):
    """The per-rank shard plan for one MLA layer of a KDA hybrid (the spec:
    ``tests/data/spec/mla.md``, from vLLM 0.33.0's and SGLang 0.5.23's loaders).

    ``MlaTpPlan(tp_rank, tp_size, hidden, heads, kv_lora_rank, qk_nope_head_dim,
    qk_rope_head_dim, v_head_dim, *, q_lora_rank=None, output_gate=False, indexer=None,
    dtypes=None, quant_block=None, quantized=None, scale_layout="grid")``

    Rank ``r`` of ``T`` owns MLA heads ``[r*H/T, (r+1)*H/T)`` of ``H = num_attention_heads``
    (not the KDA head count). In the KDA plan's vocabulary (``KdaShard``, ``KdaTensorPlan``),
    with ``Hl = H/T``, ``L`` = kv_lora_rank, ``Q`` = q_lora_rank, ``P`` = qk_nope_head_dim,
    ``Pr`` = qk_rope_head_dim, ``V`` = v_head_dim, ``d`` = hidden:

    | tensor                          | on-disk shape    | kind         | local shape         |
    | ------------------------------- | ---------------- | ------------ | ------------------- |
    | q_proj (no q-LoRA: Kimi-Linear) | [H*(P+Pr), d]    | CHANNEL_ROWS | [Hl*(P+Pr), d]      |
    | q_a_proj                        | [Q, d]           | REPLICATED   | unchanged           |
    | q_a_layernorm                   | [Q]              | REPLICATED   | unchanged           |
    | q_b_proj                        | [H*(P+Pr), Q]    | CHANNEL_ROWS | [Hl*(P+Pr), Q]      |
    | kv_a_proj_with_mqa              | [L+Pr, d]        | REPLICATED   | unchanged           |
    | kv_a_layernorm                  | [L]              | REPLICATED   | unchanged           |
    | kv_b_proj                       | [H*(P+V), L]     | CHANNEL_ROWS | [Hl*(P+V), L]       |
    | g_proj (K3's output gate)       | [H*V, d]         | CHANNEL_ROWS | [Hl*V, d]           |
    | o_proj                          | [d, H*V]         | CHANNEL_COLS | [d, Hl*V]           |
    | indexer.* (GLM-5.3's DSA)       | see below        | REPLICATED   | unchanged           |

    Row blocks are head-major (each head's ``P`` nope then ``Pr`` rope rows of ``q_b_proj``,
    ``P`` k-nope then ``V`` value rows of ``kv_b_proj``), so a rank's rows are one contiguous
    range at ``src_row_offset = r*Hl*(rows per head)``; ``o_proj`` is row-parallel (columns
    ``[r*Hl*V, (r+1)*Hl*V)``, all-reduced after). The indexer (``indexer=(n, h, kpool)``):
    ``indexer.wq_b`` ``[n*h, Q]``, ``indexer.wk`` ``[h, d]``, ``indexer.weights_proj``
    ``[n, d]``, ``indexer.k_norm`` and ``indexer.k_norm.bias`` ``[h]``,
    ``indexer.index_kpool_compress_ape`` ``[kpool, h]`` (F32), ``indexer.index_kpool_compress_gate``
    ``[h, d]``. K3's MLA ``g_proj``/``o_proj`` have exactly the KDA layer's names and shapes:
    the layer type comes from the config (:meth:`from_description`), never from them.

    Args:
        tp_rank: this rank, ``0 <= tp_rank < tp_size``.
        tp_size: the (attention-)TP world size.
        hidden: ``hidden_size`` (elements).
        heads: ``num_attention_heads``; must be divisible by ``tp_size``.
        kv_lora_rank: ``kv_lora_rank``.
        qk_nope_head_dim: ``qk_nope_head_dim``.
        qk_rope_head_dim: ``qk_rope_head_dim`` (0: NoPE, GLM-5.3-Flash).
        v_head_dim: ``v_head_dim``.
        q_lora_rank: ``q_lora_rank`` (K3, GLM-5.3-Flash); None for Kimi-Linear's ``q_proj``.
        output_gate: K3's MLA output gate ``g_proj`` (``mla_use_output_gate``).
        indexer: ``(index_n_heads, index_head_dim, index_kpool)`` of GLM-5.3-Flash's DSA
            indexer; None for none.
        dtypes: safetensors dtype per plan name (``"BF16"``, ``"F16"``, ``"F32"``, ``"F64"``;
            ``"F8_E4M3"``/``"F8_E5M2"`` for a quantized projection) over the defaults (BF16;
            F32 for ``indexer.index_kpool_compress_ape``; F8_E4M3 for a quantized projection).
        quant_block: ``(rows, cols)`` block edge of block-FP8 projections (``(128, 128)``, see
            ``kda_tp.model.quant``); None for none.
        quantized: plan names of the FP8 projections (default with ``quant_block``: every
            projection of the layer: ``q_proj`` or ``q_a_proj``/``q_b_proj``,
            ``kv_a_proj_with_mqa``, ``kv_b_proj``, ``g_proj``, ``o_proj``). Each entry's
            ``.scale`` is the plan of its F32 scale grid ``[ceil(rows/b0), ceil(cols/b1)]``:
            the whole grid for a replicated weight (a trailing partial block included), the
            grid rows of its row blocks for a row slice, the grid columns of its column
            blocks for ``o_proj``. The norms and the indexer cannot be quantized.
        scale_layout: ``"grid"`` (2-D ``[ob, ib]``: DeepSeek, compressed-tensors) or
            ``"modelopt"`` (4-D ``[ob, 1, ib, 1]``); only the scale's ``disk_shape`` depends
            on it.

    Attributes:
        tp_rank: this rank.
        tp_size: the world size.
        local_heads: MLA heads this rank keeps, ``heads // tp_size``.
        hidden: ``hidden_size``, as given; likewise ``heads``, ``q_lora_rank``,
            ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``,
            ``output_gate`` and ``indexer``.
        tensors: list of ``KdaTensorPlan``, one per tensor, in the table's order.
        local_bytes: bytes of one MLA layer on this rank.
        full_bytes: bytes of one MLA layer on disk.

    ``plan.names()`` lists the plan names, ``plan.get(name)`` returns an entry or None,
    ``plan[name]`` raises KeyError.

    Raises:
        PlanError: ``tp_rank >= tp_size``; a zero ``tp_size`` or size (``field`` names the
            config key; ``qk_rope_head_dim`` may be 0); ``heads`` not divisible by
            ``tp_size`` (``heads``, ``tp_size`` and ``allowed_tp_sizes``, the divisors, as
            attributes; the message lists them); an unknown plan name or a non-float dtype in
            ``dtypes`` (FP8 only for a quantized projection); a quantized norm or indexer
            tensor; a split of a quantized projection whose share per rank is not a whole
            number of blocks at ``tp_size > 1`` (``q_b_proj`` of 1 head of 192 rows, 128-row
            blocks: its rows 192..384 would start inside a block), the rule of vLLM 0.33's
            block-FP8 loader (``validate_fp8_block_shape``; ``tensor``, ``tp_rank``,
            ``tp_size`` and ``allowed_tp_sizes`` as attributes, the offsets and the fix in
            the message); a byte size that overflows.
    """

    @classmethod
    def from_description(
        cls, description: CheckpointDescription, tp_rank: int, tp_size: int,
        mla: MlaConfig | None = None,
    ) -> MlaTpPlan | None:
        """The plan of the MLA layers of a described checkpoint or config, or None when the
        config has no MLA layer (:func:`~kda_tp.model.mla.parse_mla_config`: every layer KDA,
        or the KDA layers not listed). With a checkpoint, each tensor's dtype is read from the
        first MLA layer's header (a tensor it lacks keeps the default), and its FP8
        projections are block-quantized in the config's block-FP8 format (block edge and
        scale layout, ``kda_tp.model.quant``); a bare config plans every tensor unquantized.
        ``mla``: the config's MLA reading when the caller has it (else it is read here).

        Raises:
            CheckpointError: as ``parse_mla_config``; an FP8 MLA weight whose config declares
                no block-FP8 format.
            PlanError: as the class.
        """
        if mla is None:
            mla = parse_mla_config(description.config, description.kda)
        if mla is None:
            return None
        dtypes = _dtypes(description, mla)
        return cls.from_mla_config(mla, tp_rank, tp_size, dtypes,
                                   quant=_quant(description, mla, dtypes))

    @classmethod
    def from_mla_config(
        cls, mla: MlaConfig, tp_rank: int, tp_size: int, dtypes: dict[str, str] | None = None,
        *, quant: dict[str, Any] | None = None,
    ) -> MlaTpPlan:
        """The plan of one MLA layer of ``mla`` (``kda_tp.model.mla.MlaConfig``) for rank
        ``tp_rank`` of ``tp_size``, with ``dtypes`` as the class takes them and ``quant`` its
        ``quant_block``, ``quantized`` and ``scale_layout`` keywords (None: unquantized).

        Raises:
            PlanError: as the class.
        """
        args, options = mla.plan_args()
        options.update(quant or {})
        return cls(tp_rank, tp_size, *args, dtypes=dtypes, **options)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle (and copy) by the constructor's arguments."""
        args = (self.tp_rank, self.tp_size, self.hidden, self.heads, self.kv_lora_rank,
                self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim)
        options: dict[str, Any] = {
            "q_lora_rank": self.q_lora_rank, "output_gate": self.output_gate,
            "indexer": self.indexer, "dtypes": {t.name: t.dtype for t in self.tensors}}
        options.update(quant_options(self.tensors))
        return (_rebuild, (type(self), args, options))


def _rebuild(cls: type[MlaTpPlan], args: tuple[int, ...], options: dict[str, Any]) -> MlaTpPlan:
    return cls(*args, **options)


def mla_tensor_name(prefix: str, layer: int, plan_name: str) -> str:
    """The checkpoint name of an MLA plan tensor: ``model.layers.3.self_attn.kv_b_proj.weight``;
    ``indexer.k_norm.bias`` and the indexer's ``index_kpool_compress_*`` parameters without
    ``.weight``."""
    return param_name(prefix, layer, _suffix(plan_name))


def _suffix(plan_name: str) -> str:
    """The name after ``self_attn.`` of an MLA plan tensor."""
    bare = plan_name in _BARE or plan_name.endswith(".bias")
    return plan_name if bare else f"{plan_name}.weight"


def _dtypes(description: CheckpointDescription, mla: MlaConfig) -> dict[str, str] | None:
    """The stored dtype of each tensor of the first MLA layer, from the headers; None for a
    bare config (the plan's defaults)."""
    if description.source is None:
        return None
    prefix, layer = description.prefix, mla.layers[0]
    names = _plan_names(mla)
    found = {}
    for name in names:
        header = description.header(mla_tensor_name(prefix, layer, name))
        if header is not None:
            found[name] = header[0]
    return found


def _quant(
    description: CheckpointDescription, mla: MlaConfig, dtypes: dict[str, str] | None
) -> dict[str, Any] | None:
    """The block-FP8 keywords of the plan (``quant_block``, ``quantized``, ``scale_layout``)
    when the first MLA layer stores FP8 projections, in the config's block format; None when
    it stores none (or for a bare config).

    Every MLA layer's projections are checked against what the config declares, as the KDA
    layers' are (``kda_tp.checkpoint.description.check_declared``).

    Raises:
        CheckpointError: an FP8 MLA weight, but the config declares no block-FP8 format (the
            format comes from the config, never from shapes); a projection that contradicts a
            ModelOpt config's per-module declaration (``NVFP4``, FP8 but excluded or not
            listed, declared ``FP8_PB_WO`` but not FP8).
        DtypeMismatchError: an FP8 dtype the format does not use (``F8_E5M2`` under ModelOpt).
    """
    fmt, modules = description.quantization
    if description.source is not None and (isinstance(fmt, BlockFormat) or modules is not None):
        projections = [name for name in _plan_names(mla) if _is_projection(name)]
        for layer in mla.layers:
            for name in projections:
                full = mla_tensor_name(description.prefix, layer, name)
                header = description.header(full)
                if header is not None:
                    check_declared(description.source, full, header[0], fmt, modules)
    quantized = [name for name, dtype in (dtypes or {}).items() if dtype in FP8_DTYPES]
    if not quantized:
        return None
    if not isinstance(fmt, BlockFormat):
        name = mla_tensor_name(description.prefix, mla.layers[0], quantized[0])
        declared = fmt or "no quantization_config"
        raise CheckpointError(
            f"{location(description.source, name)}: {name}: an FP8 MLA weight, but the config "
            f"declares {declared}; supported block-FP8 formats: ModelOpt FP8_PB_WO, "
            "DeepSeek-style fp8 with weight_block_size, compressed-tensors FP8 block"
        )
    return {"quant_block": fmt.block, "quantized": quantized, "scale_layout": fmt.scale_layout}


def _is_projection(plan_name: str) -> bool:
    """Whether an MLA plan tensor is a projection a checkpoint may block-quantize (not a norm,
    not the DSA indexer's)."""
    return plan_name.endswith(("_proj", "_proj_with_mqa")) and not plan_name.startswith("indexer.")


def _plan_names(mla: MlaConfig) -> list[str]:
    """The plan names of ``mla``'s layers, in plan order (a rank-0, TP 1 plan's)."""
    return MlaTpPlan.from_mla_config(mla, 0, 1).names()


def planned_mla_tensors(
    description: CheckpointDescription, plan: MlaTpPlan
) -> tuple[tuple[int, ...], dict[str, tuple[Any, tuple[int, ...]]]]:
    """The MLA layers of a described checkpoint (from its config) and, for each tensor they
    hold, ``checkpoint name -> (plan entry, local shape)``: what a rank's view slices
    (``KdaShardedSource(..., mla=plan)``), a block-FP8 weight's scale grid sliced by the
    weight's ``.scale`` entry. Each tensor is checked once, from the headers.
    The DSA indexer's tensors (replicated) may be absent; every other tensor of the plan must
    be there.

    Raises:
        CheckpointError: the config names no MLA layer; an MLA layer lacks a tensor of the
            plan (an FP8 weight's block scale included, ``<p>.weight_scale`` or
            ``<p>.weight_scale_inv``, exactly one of them), or holds a ``self_attn`` tensor the
            plan does not know (a block scale of an unquantized weight, a tensor of another
            layout: it could not be sliced safely).
        DtypeMismatchError: a tensor's dtype differs from the plan's (the first MLA layer's).
        ShapeMismatchError: a tensor's on-disk shape does not hold the plan's tensor (the
            message names the tensor, both shapes and the config keys to check).
    """
    mla = parse_mla_config(description.config, description.kda)
    if mla is None:
        raise CheckpointError(
            f"{description.where}: the config names no MLA layer (every layer is KDA, or the "
            "KDA layers are not listed); open the view without mla"
        )
    source, prefix = description.source, description.prefix
    by_suffix = {_suffix(t.name): t for t in plan.tensors}
    for t in plan.tensors:
        if t.scale is not None:
            # A block scale has two spellings; a layer holds exactly one of them.
            by_suffix.update({f"{t.name}.{s}": t.scale for s in SCALE_SUFFIXES})
    planned: dict[str, tuple[Any, tuple[int, ...]]] = {}
    for layer in mla.layers:
        held = dict(description.attention(layer))
        for suffix, name in held.items():
            entry = by_suffix.get(suffix)
            weight, _, last = suffix.rpartition(".")
            if entry is None and last in SCALE_SUFFIXES and weight in by_suffix:
                raise CheckpointError(
                    f"{location(source, name)}: {name}: MLA layer {layer} holds a self_attn "
                    f"tensor the MLA plan does not know: a block scale, but {weight} is not "
                    f"block-quantized (MLA layer {mla.layers[0]}, whose dtypes the plan "
                    "follows, stores it unquantized); it cannot be sliced safely"
                )
            if entry is None:
                raise CheckpointError(
                    f"{location(source, name)}: {name}: MLA layer {layer} holds a self_attn "
                    f"tensor the MLA plan does not know; it cannot be sliced safely (known: "
                    f"{', '.join(sorted(by_suffix))})"
                )
            header = description.header(name)
            if header is None:
                raise missing_tensor(source, name)
            dtype, shape = header
            if dtype != entry.dtype:
                raise DtypeMismatchError(
                    f"{location(source, name)}: {name}: dtype {dtype}, expected {entry.dtype} "
                    f"as in the first MLA layer ({mla.layers[0]}); every MLA layer must store "
                    "a tensor in one dtype: convert the odd layers' tensors"
                )
            try:
                planned[name] = (entry, tuple(entry.local_shape(list(shape))))
            except KdaTpError as e:
                raise type(e)(
                    f"{location(source, name)}: {name}: {e}; the MLA plan follows the config's "
                    "num_attention_heads, q_lora_rank, kv_lora_rank, qk_nope_head_dim, "
                    "qk_rope_head_dim and v_head_dim: fix the config or the tensor"
                ) from None
        for entry in plan.tensors:
            suffix = _suffix(entry.name)
            if suffix not in held and not entry.name.startswith("indexer."):
                raise CheckpointError(
                    f"{location(source)}: MLA layer {layer} lacks "
                    f"{param_name(prefix, layer, suffix)}, which the config's MLA geometry "
                    "has: the checkpoint and its config.json disagree"
                )
            if entry.scale is not None:
                _one_scale(description, layer, entry.name, held)
    return mla.layers, planned


def _one_scale(
    description: CheckpointDescription, layer: int, weight: str, held: dict[str, str]
) -> None:
    """Refuse an MLA layer that holds no block scale for its FP8 ``weight``, or both
    spellings (``weight_scale`` and ``weight_scale_inv``).

    Raises:
        CheckpointError: naming the layer and the tensor.
    """
    found = [held[f"{weight}.{s}"] for s in SCALE_SUFFIXES if f"{weight}.{s}" in held]
    if not found:
        name = param_name(description.prefix, layer, f"{weight}.{SCALE_SUFFIXES[0]}")
        raise CheckpointError(
            f"{location(description.source)}: MLA layer {layer} lacks {name} (the block scale "
            f"of its FP8 {weight}, or its {SCALE_SUFFIXES[1]} spelling): an FP8 weight cannot "
            "be sliced or dequantized without it"
        )
    if len(found) > 1:
        raise CheckpointError(
            f"{location(description.source, found[1])}: {found[1]}: MLA layer {layer} holds "
            f"both {' and '.join(SCALE_SUFFIXES)} for {weight}; keep the one its format names"
        )


def rank_mla_plan(
    description: CheckpointDescription, tp_rank: int, tp_size: int
) -> tuple[MlaTpPlan | None, str | None]:
    """What ``kda-tp shard``, ``verify`` and the torch loader slice a hybrid's MLA layers by:
    ``(plan, None)`` when the config's MLA layers can be planned and every tensor they hold
    fits the plan (:func:`planned_mla_tensors`); ``(None, None)`` for a model without MLA
    layers; ``(None, line)`` when they cannot be planned (the config lacks an MLA size, as the
    K3 FP8 fixture's; a tensor that disagrees with the config's geometry; FP8 MLA weights
    under a config that declares no block-FP8 format): they then pass through whole, and
    ``line`` says so and why, for the caller to print (never silently). Block-FP8 MLA
    projections are planned with their scale grids (``MlaTpPlan``'s ``quant_block``).

    Raises:
        CheckpointError: the config cannot be read, or describes no KDA model (as
            ``description.kda``).
        PlanError: the MLA head count ``num_attention_heads`` is not divisible by ``tp_size``
            (an engine refuses that split too; ``allowed_tp_sizes`` lists the divisors), or a
            block-FP8 MLA projection's share per rank is not a whole number of blocks (vLLM
            refuses that split too; ``allowed_tp_sizes`` lists the sizes that are).
    """
    kda = description.kda  # a config that cannot be read is refused, not a note
    try:
        mla = parse_mla_config(description.config, kda)
    except CheckpointError as e:
        return None, passed_through_line(mla_layers(description.config, kda), e)
    if mla is None:
        return None, None
    try:
        dtypes = _dtypes(description, mla)
        plan = MlaTpPlan.from_mla_config(mla, tp_rank, tp_size, dtypes,
                                         quant=_quant(description, mla, dtypes))
        if description.source is not None:
            planned_mla_tensors(description, plan)
    except PlanError as e:
        if e.allowed_tp_sizes is not None:
            raise
        return None, passed_through_line(mla.layers, e)
    except KdaTpError as e:
        return None, passed_through_line(mla.layers, e)
    return plan, None


def passed_through_line(layers: tuple[int, ...], problem: KdaTpError) -> str:
    """The one line saying a hybrid's MLA ``layers`` are passed through whole (unsliced), and
    why: ``problem``, what kept them from being planned."""
    return (f"MLA layers {_few(layers)} passed through whole (not sliced per rank): "
            f"{type(problem).__name__}: {problem}")


def _few(layers: tuple[int, ...]) -> str:
    """``[3, 7, ...]``: the first 8 layers and how many more."""
    more = f", ... {len(layers) - 8} more" if len(layers) > 8 else ""
    return "[" + ", ".join(map(str, layers[:8])) + more + "]"
