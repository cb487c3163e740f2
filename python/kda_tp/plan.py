"""The shard plan: which part of each KDA tensor a tensor-parallel rank keeps.

The arithmetic is in the Rust core (``kda_tp._native``); this module adds reading the geometry
from a model config or checkpoint.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from collections.abc import Iterable, Mapping
from typing import Any

from . import _native
from ._native import KdaShard, KdaTensorPlan
from .checkpoint import SafetensorsSource, refuse_index_member
from .config import (
    CONFIG_NAME, RULES_GLM, KdaConfig, load_config, no_config_message, parse_config,
)
from .errors import CheckpointError, DtypeMismatchError, ShapeMismatchError
from .layers import check_layers, config_layer_count, layer_count, layers_with_kda_tensors
from .layout import check_gate_form, decoder_prefix, kda_layer_indices, kda_tensor_name
from .quant import FP8_DTYPES, BlockFormat, ModelOptModules, block_format, modelopt_modules

__all__ = ["KdaShard", "KdaTensorPlan", "KdaTpPlan", "assumed_layout"]

_SUFFIX = {"A_log": "A_log", "dt_bias": "dt_bias"}


def assumed_layout(
    config: KdaConfig,
) -> tuple[dict[str, str] | None, dict[str, tuple[int, ...]], str]:
    """What a bare config's plan assumes of the checkpoint it does not see: the stored dtypes
    and on-disk shapes of its model family's checkpoints.

    GLM-5.3-Flash (:data:`~kda_tp.config.RULES_GLM`): transformers' ``modeling_glm5_next.py``
    creates the convs, ``A_log`` (1-D ``[H]``) and ``dt_bias`` in float32, so its checkpoints
    store them as F32. Kimi-Linear and any other family: the plan's defaults (BF16 except the
    F32 ``A_log [1, 1, H, 1]`` and ``dt_bias``, Kimi-Linear's checkpoints).

    Args:
        config: the parsed config.

    Returns:
        ``(dtypes, shapes, family)``: the dtypes by plan name for :class:`KdaTpPlan` (None:
        the plan's defaults), on-disk shapes by plan name that differ from the plan's
        (elements), and whose defaults they are, for people (``"GLM-5.3-Flash's"``).
    """
    if config.rules == RULES_GLM:
        f32 = ("q_conv1d", "k_conv1d", "v_conv1d", "A_log", "dt_bias")
        return dict.fromkeys(f32, "F32"), {"A_log": (config.heads,)}, "GLM-5.3-Flash's"
    return None, {}, "Kimi-Linear's"


class KdaTpPlan(_native.KdaTpPlan):
    """The per-rank shard plan for one KDA block (head-parallel, one all-reduce after ``o_proj``).

    ``KdaTpPlan(tp_rank, tp_size, hidden, head_dim, full_heads, conv_kernel, gate_rank, *,
    qk_multiple=256, dtypes=None, full_rank_gate=False, a_log_len=None, quant_block=None,
    quantized=None, scale_layout="grid")``

    Rank ``r`` of ``T`` owns heads ``[r*H/T, (r+1)*H/T)`` and channels ``c = h*head_dim + d`` of
    those heads. Per tensor (plan name; on-disk shape as Kimi-Linear stores it; C = H*head_dim):

    | tensor                 | on-disk shape         | kind           | local shape        |
    | ---------------------- | --------------------- | -------------- | ------------------ |
    | q_proj, k_proj, v_proj | [C, hidden]           | CHANNEL_ROWS   | [C/T, hidden]      |
    | q/k/v_conv1d           | [C, 1, K]             | CHANNEL_ROWS   | [C/T, 1, K]        |
    | f_a_proj, g_a_proj     | [gate_rank, hidden]   | REPLICATED     | unchanged          |
    | f_b_proj, g_b_proj     | [C, gate_rank]        | CHANNEL_ROWS   | [C/T, gate_rank]   |
    | b_proj                 | [H, hidden]           | HEAD_ROWS      | [H/T, hidden]      |
    | A_log (F32)            | [1, 1, H, 1]          | HEAD_ROWS      | [1, 1, H/T, 1]     |
    | dt_bias (F32)          | [C]                   | CHANNEL_ROWS   | [C/T]              |
    | o_norm                 | [head_dim]            | REPLICATED     | unchanged          |
    | o_proj                 | [hidden, C]           | CHANNEL_COLS   | [hidden, C/T]      |

    ``o_proj`` is row-parallel: each rank's output is a partial sum, all-reduced after it.

    Args:
        tp_rank: this rank, ``0 <= tp_rank < tp_size``.
        tp_size: tensor-parallel world size.
        hidden: hidden size (elements).
        head_dim: elements per head.
        full_heads: KDA heads before sharding; must be divisible by ``tp_size``.
        conv_kernel: short-convolution kernel width.
        gate_rank: low-rank width of the ``f``/``g`` gates (``f_a_proj`` rows; Kimi-Linear
            uses head_dim).
        qk_multiple: the local q|k width ``2 * local_heads * head_dim`` must be a multiple of
            this (256 by default, the rule of GLM-5.3's fused conv + L2-norm kernel, which
            handles 2 heads per 256-thread block); 1 switches the rule off.
        dtypes: safetensors dtype per plan name, overriding the default (BF16; F32 for
            ``A_log`` and ``dt_bias``). Element sizes (bytes) follow from them.
        full_rank_gate: Kimi K3's full-rank output gate (``g_proj``) instead of the low-rank
            ``g_a_proj``/``g_b_proj`` (``linear_attn_config.use_full_rank_gate``).
        a_log_len: entries of the stored ``A_log`` when it is zero-padded past the heads (K3:
            128 for 96 heads); None (the default) for one entry per head. At least
            ``full_heads``.
        quant_block: ``(rows, cols)`` block edge (elements) of block-quantized FP8 weights
            (``(128, 128)`` in every published checkpoint; see ``kda_tp.quant``); None for
            an unquantized block.
        quantized: plan names of the FP8 weights (default with ``quant_block``: every
            projection). Their dtype defaults to ``F8_E4M3`` and each entry's ``.scale`` is
            the plan of its F32 scale grid: rank ``r`` keeps the blocks covering its weight
            range, ``[floor(a/b), ceil(e/b))`` on the sharded axis (the whole grid when
            replicated). Conv weights, ``A_log``, ``dt_bias``, ``o_norm`` cannot be quantized.
        scale_layout: ``"grid"`` (2-D ``[ob, ib]``: DeepSeek, compressed-tensors) or
            ``"modelopt"`` (4-D ``[ob, 1, ib, 1]``); only the canonical ``disk_shape`` depends
            on it.

    Attributes:
        tp_rank: this rank.
        tp_size: tensor-parallel world size.
        hidden: hidden size (elements).
        head_dim: elements per head.
        full_heads: KDA heads before sharding.
        local_heads: heads this rank keeps, ``full_heads // tp_size``.
        conv_kernel: short-convolution kernel width.
        gate_rank: low-rank width of the gates.
        qk_multiple: the q|k width rule's multiple (1: off).
        full_rank_gate: whether the output gate is K3's full-rank ``g_proj``.
        a_log_len: stored ``A_log`` entries (``full_heads`` when it is not padded).
        tensors: list of :class:`KdaTensorPlan`, one per tensor, in the table's order.
        local_bytes: bytes this rank stores for one KDA block.
        full_bytes: bytes one KDA block occupies on disk.
        needs_output_all_reduce: whether ``o_proj``'s output must be all-reduced
            (``tp_size > 1``).

    ``plan.get(name)`` returns the entry or None; ``plan[name]`` raises KeyError.

    Raises:
        PlanError: ``tp_rank >= tp_size``; a zero or negative size; heads not divisible by
            ``tp_size``; the q|k width rule; ``a_log_len < full_heads``; an unknown tensor
            or dtype in ``dtypes`` (a name not in this layout, e.g. ``g_proj`` without
            ``full_rank_gate``; FP8 for an unquantized tensor); a quantized name that is not
            a projection; a split where some rank's range of a quantized weight starts inside
            a block and reaches into the next (e.g. 6 heads of 64 at TP=2, 128x128 blocks:
            rank 1's rows 192..384 start inside block 1), since its scales cannot be sliced
            to match; a geometry whose byte sizes overflow.
    """

    @classmethod
    def from_config(
        cls,
        config: Mapping[str, Any] | str | os.PathLike[str] | Any,
        tp_rank: int,
        tp_size: int,
        gate_rank: int | None = None,
        qk_multiple: int = 256,
        layers: Iterable[int] | None = None,
    ) -> KdaTpPlan:
        """The plan for one rank, with the geometry read from a model config.

        Args:
            config: a config dict, a ``config.json`` path, a checkpoint directory, or a
                :class:`~kda_tp.SafetensorsSource`, read as its model family's reference code
                reads it (``kda_tp.config``): GLM-5.3-Flash's ``linear_head_dim`` /
                ``linear_num_heads`` / ``linear_conv_kernel_dim``; Kimi-Linear keys
                (``hidden_size``, ``linear_attn_config.head_dim/num_heads/
                short_conv_kernel_size``, K3's ``use_full_rank_gate``) or transformers' flat
                ``kimi_linear`` keys; at the top level or under ``text_config``.
            tp_rank: this rank, ``0 <= tp_rank < tp_size``.
            tp_size: the tensor-parallel world size.
            gate_rank: the gate bottleneck width. With a checkpoint it defaults to the first
                KDA layer's ``f_a_proj`` row count; with a bare config, to ``head_dim``
                (Kimi-Linear's choice).
            qk_multiple: see the class.
            layers: 0-based KDA layer indices, checked as ``--layers`` is
                (``kda_tp.layers.check_layers``: each a KDA layer of the config, or of
                the checkpoint's tensors when the config lists none, within
                ``num_hidden_layers``; a 1-based list is refused with the 0-based one to use).
                With a checkpoint, the first is read for dtypes and the gate rank and each is
                checked against a ModelOpt config; the plan is the same for every KDA layer,
                so a bare config only checks them.

        With a bare config, the dtypes are what the family's checkpoints store
        (``kda_tp.plan.assumed_layout``: F32 convs for GLM-5.3-Flash). With a checkpoint, each
        tensor's dtype (and so its element size) and the stored length of ``A_log``
        (``a_log_len``, for K3's zero-padded one) are read from the first KDA layer's header;
        ``full_rank_gate`` always comes from the config.

        Raises:
            CheckpointError: one file of an indexed checkpoint (pass the directory), a missing
                or invalid config, a config with no KDA layers, or a
                checkpoint whose first KDA layer lacks a tensor or holds the other output-gate
                form than the config says; a KDA projection (any KDA layer) that contradicts a
                ModelOpt config's per-module declaration (``kda_tp.quant.ModelOptModules``:
                a ``quant_algo`` other than ``FP8_PB_WO``, e.g. ``NVFP4``, named in the message;
                ``FP8_PB_WO`` but not FP8; FP8 but not listed, or excluded).
            DtypeMismatchError: a first-KDA-layer tensor whose dtype is not BF16, F16, F32 or
                F64 (or FP8, for a projection of a block-quantized checkpoint); an ``F8_E5M2``
                projection under ModelOpt (whose FP8 is E4M3).
            ShapeMismatchError: a first-KDA-layer ``f_a_proj`` that is not 2-D (when the gate
                rank is read from it).
            PlanError: a refused geometry (see the class); ``layers`` refused (empty,
                negative, repeated, 1-based, out of range or not a KDA layer).
        """

        source, root = None, None
        where = "config"  # names the config in error messages
        if isinstance(config, SafetensorsSource):
            refuse_index_member(config.path)
            source, root = config, config.root
            config = source.config
            if config is None:
                raise CheckpointError(no_config_message(source.root))
            where = str(source.root / CONFIG_NAME)
        elif isinstance(config, (str, os.PathLike)):
            path = Path(config)
            refuse_index_member(path)
            if path.suffix == ".safetensors" and path.is_file():
                source = SafetensorsSource(path)
                path = path.parent
            elif path.is_dir() and any(path.glob("*.safetensors")):
                source = SafetensorsSource(path)
            config = load_config(path)
            root = path if path.is_dir() else path.parent
            where = str(path / CONFIG_NAME if path.is_dir() else path)
        kda = parse_config(config, where)
        if layers is not None:
            # The same checks as the command line's --layers (1-based, non-KDA, out of range).
            known = kda.kda_layers
            if known is None and source is not None:
                known = layers_with_kda_tensors(source) or None
            layers = check_layers(
                layers, known,
                layer_count(source) if source is not None else config_layer_count(config),
                option="layers",
            )
        fmt = block_format(config, root)
        quant: dict[str, Any] = {}
        if isinstance(fmt, BlockFormat):
            # A bare config: every projection (a checkpoint below says which are FP8).
            quant = {"quant_block": fmt.block, "scale_layout": fmt.scale_layout}

        # A bare config: what its family's checkpoints store (a checkpoint below says).
        dtypes, a_log_len = assumed_layout(kda)[0], None
        if source is not None:
            indices = kda_layer_indices(source, layers)
            if not indices:
                raise CheckpointError(f"{where}: no KDA layer to read the dtypes from")
            layer = indices[0]
            prefix = decoder_prefix(source)
            check_gate_form(source, prefix, layer, kda.full_rank_gate)
            attn = f"{prefix}{layer}.self_attn."
            packed = [n for n in source.names() if n.startswith(attn) and n.endswith("_packed")]
            if packed:
                raise CheckpointError(
                    f"{source.file_of(packed[0])}: {packed[0]}: packed 4-bit KDA weights "
                    f"({_format_name(fmt)}) are not supported; kda_tp slices "
                    "BF16/F16/F32 KDA weights and FP8 block-quantized projections"
                )
            # Every KDA layer's projections against what the config declares for them.
            modules = modelopt_modules(config, root)
            for index in indices:
                for name in _native.QUANTIZABLE:
                    full_name = kda_tensor_name(prefix, index, name)
                    info = source.info(full_name)
                    if info is not None:
                        _check_declared(source, full_name, info[0], fmt, modules)
            headers = {}
            for name in _tensor_names(kda.full_rank_gate):
                full_name = kda_tensor_name(prefix, layer, name)
                info = source.info(full_name)
                if info is None:
                    raise CheckpointError(f"{source.root}: KDA layer {layer} lacks {full_name}")
                if info[0] in FP8_DTYPES:
                    _check_quantizable(source, full_name, name, fmt)
                elif info[0] not in _FLOAT_DTYPES:
                    declared = f"; the config declares {fmt}" if isinstance(fmt, str) else ""
                    raise DtypeMismatchError(
                        f"{source.file_of(full_name)}: {full_name}: dtype {info[0]} is not "
                        f"allowed for a KDA tensor: {', '.join(_FLOAT_DTYPES)}, or "
                        f"{' / '.join(FP8_DTYPES)} with a block scale for a block-quantized "
                        f"projection{declared}"
                    )
                headers[name] = info
            dtypes = {name: dtype for name, (dtype, _) in headers.items()}
            quantized = [n for n, (dtype, _) in headers.items() if dtype in FP8_DTYPES]
            quant = {**quant, "quantized": quantized} if quantized else {}
            stored = math.prod(headers["A_log"][1])
            a_log_len = stored if stored > kda.heads else None
            if gate_rank is None:
                f_a_shape = headers["f_a_proj"][1]
                if len(f_a_shape) != 2:
                    f_a_name = kda_tensor_name(prefix, layer, "f_a_proj")
                    raise ShapeMismatchError(
                        f"{source.file_of(f_a_name)}: {f_a_name}: on-disk shape "
                        f"{list(f_a_shape)} is not 2-D [gate_rank, hidden], so the gate rank "
                        "cannot be read from it"
                    )
                gate_rank = f_a_shape[0]
        return cls(
            tp_rank,
            tp_size,
            kda.hidden,
            kda.head_dim,
            kda.heads,
            kda.conv_kernel,
            kda.head_dim if gate_rank is None else gate_rank,
            qk_multiple=qk_multiple,
            dtypes=dtypes,
            full_rank_gate=kda.full_rank_gate,
            a_log_len=a_log_len,
            **quant,
        )

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle (and copy) by the constructor's arguments."""
        args = (self.tp_rank, self.tp_size, self.hidden, self.head_dim, self.full_heads,
                self.conv_kernel, self.gate_rank)
        options = {"qk_multiple": self.qk_multiple,
                   "dtypes": {t.name: t.dtype for t in self.tensors},
                   "full_rank_gate": self.full_rank_gate,
                   "a_log_len": self.a_log_len}
        scales = [(t, t.scale) for t in self.tensors if t.scale is not None]
        if scales:
            weight, scale = scales[0]
            options.update(
                quant_block=weight.block,
                quantized=[t.name for t, _ in scales],
                scale_layout="modelopt" if len(scale.disk_shape) == 4 else "grid",
            )
        return (_rebuild, (type(self), args, options))


def _rebuild(cls: type[KdaTpPlan], args: tuple[int, ...], options: dict[str, Any]) -> KdaTpPlan:
    return cls(*args, **options)


# The dtypes the plan accepts for a KDA tensor (the Rust core's rule).
_FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")


def _check_quantizable(
    source: Any, full_name: str, name: str, fmt: BlockFormat | str | None
) -> None:
    """Refuse an FP8 KDA tensor that is not a projection, or whose checkpoint's config declares
    no block-FP8 format (the format comes from the config, never from shapes)."""
    where = f"{source.file_of(full_name)}: {full_name}"
    if name not in _native.QUANTIZABLE:
        raise CheckpointError(
            f"{where}: {name} is stored as FP8, but conv weights, A_log, dt_bias and o_norm are "
            "never quantized; this checkpoint is not supported"
        )
    if not isinstance(fmt, BlockFormat):
        raise CheckpointError(
            f"{where}: an FP8 weight, but the config declares "
            f"{_format_name(fmt)}; supported block-FP8 formats: ModelOpt FP8_PB_WO, "
            "DeepSeek-style fp8 with weight_block_size, compressed-tensors FP8 block"
        )


def _check_declared(
    source: Any,
    full_name: str,
    dtype: str,
    fmt: BlockFormat | str | None,
    declared: ModelOptModules | None,
) -> None:
    """Refuse a KDA projection whose dtype contradicts the config: an FP8 dtype the format
    does not use (``F8_E5M2`` under ModelOpt), or, under ModelOpt, a ``quant_algo`` kda_tp
    cannot slice (e.g. ``NVFP4``), an ``FP8_PB_WO`` module that is not FP8, or an FP8 module
    that ``quantized_layers`` does not list or ``exclude_modules`` excludes."""
    where = f"{source.file_of(full_name)}: {full_name}"
    fp8 = dtype in FP8_DTYPES
    if fp8 and isinstance(fmt, BlockFormat) and dtype not in fmt.weight_dtypes:
        raise DtypeMismatchError(
            f"{where}: dtype {dtype}, but {fmt.name} weights are "
            f"{' or '.join(fmt.weight_dtypes)} (ModelOpt's FP8 is E4M3 by definition); the "
            "config and the weights disagree"
        )
    if declared is None:
        return
    module = full_name.removesuffix(".weight")
    algo = declared.algo(module)
    if algo is not None and algo != "FP8_PB_WO":
        raise CheckpointError(
            f"{where}: the config's quantized_layers declares {module} as ModelOpt {algo} "
            f"(on disk: {dtype}); kda_tp slices BF16/F16/F32 KDA weights and ModelOpt "
            f"FP8_PB_WO (128x128 block FP8) projections, not {algo} ones"
        )
    if algo == "FP8_PB_WO" and not fp8:
        raise CheckpointError(
            f"{where}: dtype {dtype}, but the config's quantized_layers declares {module} as "
            "ModelOpt FP8_PB_WO (F8_E4M3 with a block scale); the config and the weights "
            "disagree"
        )
    if algo is None and fp8:
        pattern = declared.excluded_by(module)
        if pattern is not None:
            why = f"its exclude_modules pattern {pattern!r} leaves {module} unquantized"
        elif declared.quantized_layers is not None:
            why = f"its quantized_layers does not list {module} (so it is not quantized)"
        else:
            return
        raise CheckpointError(
            f"{where}: stored as {dtype}, but the config says otherwise: {why}; the config and "
            "the weights disagree"
        )


def _format_name(fmt: BlockFormat | str | None) -> str:
    """What a config declares, for messages: a format's name, or "no quantization_config"."""
    if isinstance(fmt, BlockFormat):
        return f"{fmt.name}, whose weights are F8 with a block scale"
    return fmt or "no quantization_config"


def _tensor_names(full_rank_gate: bool) -> list[str]:
    """Plan names of one KDA block with the given output-gate form, in plan order."""
    plan = _native.KdaTpPlan(0, 1, 1, 128, 1, 1, 1, full_rank_gate=full_rank_gate)
    return [t.name for t in plan.tensors]

