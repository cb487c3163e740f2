"""The shard plan: which part of each KDA tensor a tensor-parallel rank keeps.

The arithmetic is in the Rust core (``kda_tp._native``); this module adds the plan of a
described checkpoint (``kda_tp.checkpoint.description``: the geometry, dtypes and quantization read
once).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .. import _native
from .._native import KdaShard, KdaTensorPlan
from ..checkpoint.description import CheckpointDescription, describe
from ..checkpoint.reader import SafetensorsSource
from ..errors import PlanError

__all__ = ["KdaShard", "KdaTensorPlan", "KdaTpPlan", "distinct_ranks", "quant_options"]


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
            (``(128, 128)`` in every published checkpoint; see ``kda_tp.model.quant``); None for
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
        *,
        gate_rank: int | None = None,
        qk_multiple: int = 256,
        layers: Iterable[int] | None = None,
    ) -> KdaTpPlan:
        """The plan for one rank, with the geometry read from a model config.

        A thin path to :meth:`from_description`: the config or checkpoint is described with
        ``kda_tp.describe``, which an opened :class:`~kda_tp.SafetensorsSource`
        keeps, so the plans of its other ranks read nothing again.

        Args:
            config: a config dict, a ``config.json`` path, a checkpoint directory, or a
                :class:`~kda_tp.SafetensorsSource`, read as its model family's reference code
                reads it (``kda_tp.model.config``): GLM-5.3-Flash's ``linear_head_dim`` /
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
                (``kda_tp.checkpoint.check_layers``: each a KDA layer of the config, or of
                the checkpoint's tensors when the config lists none, within
                ``num_hidden_layers``; a 1-based list is refused with the 0-based one to use).
                With a checkpoint, the first is read for dtypes and the gate rank and each is
                checked against a ModelOpt config; the plan is the same for every KDA layer,
                so a bare config only checks them.

        With a bare config, the dtypes are what the family's checkpoints store
        (``kda_tp.checkpoint.description.assumed_layout``: F32 convs for GLM-5.3-Flash). With a
        checkpoint, each tensor's dtype (and so its element size) and the stored length of ``A_log``
        (``a_log_len``, for K3's zero-padded one) are read from the first KDA layer's header;
        ``full_rank_gate`` always comes from the config.

        Raises:
            CheckpointError: one file of an indexed checkpoint (pass the directory), a missing
                or invalid config, a config with no KDA layers, or a
                checkpoint whose first KDA layer lacks a tensor or holds the other output-gate
                form than the config says; a KDA projection (any KDA layer) that contradicts a
                ModelOpt config's per-module declaration (``kda_tp.model.quant.ModelOptModules``:
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

        if isinstance(config, (SafetensorsSource, str, os.PathLike)):
            description = describe(config)
        else:
            description = CheckpointDescription(None, config)  # refused if not a config
        return cls.from_description(
            description, tp_rank, tp_size, gate_rank=gate_rank, qk_multiple=qk_multiple,
            layers=layers,
        )

    @classmethod
    def from_description(
        cls,
        description: CheckpointDescription,
        tp_rank: int,
        tp_size: int,
        *,
        gate_rank: int | None = None,
        qk_multiple: int = 256,
        layers: Iterable[int] | None = None,
    ) -> KdaTpPlan:
        """The plan for one rank of a described checkpoint (``kda_tp.describe``):
        arithmetic on what the description read once (:meth:`~kda_tp.checkpoint.description
        .CheckpointDescription.layer_facts` of ``layers``), so every rank's plan after the
        first costs no header read. Arguments and errors as :meth:`from_config`."""
        facts = description.layer_facts(layers)
        if gate_rank is None:
            gate_rank = (description.kda.head_dim if description.source is None
                         else description.require_gate_rank(facts))
        kda = description.kda
        return cls(
            tp_rank, tp_size, kda.hidden, kda.head_dim, kda.heads, kda.conv_kernel, gate_rank,
            qk_multiple=qk_multiple, **description.plan_options(facts),
        )

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle (and copy) by the constructor's arguments."""
        args = (self.tp_rank, self.tp_size, self.hidden, self.head_dim, self.full_heads,
                self.conv_kernel, self.gate_rank)
        options = {"qk_multiple": self.qk_multiple,
                   "dtypes": {t.name: t.dtype for t in self.tensors},
                   "full_rank_gate": self.full_rank_gate,
                   "a_log_len": self.a_log_len}
        options.update(quant_options(self.tensors))
        return (_rebuild, (type(self), args, options))


def _rebuild(cls: type[KdaTpPlan], args: tuple[int, ...], options: dict[str, Any]) -> KdaTpPlan:
    return cls(*args, **options)


def distinct_ranks(ranks: Sequence[int]) -> None:
    """Refuse a list of ranks that names a rank twice (``--ranks 0,0,1``): ``shard``,
    ``dump`` and ``digests`` write or hash each rank once, and a repeat is a typo.

    Raises:
        PlanError: naming the list.
    """
    if len(set(ranks)) != len(ranks):
        raise PlanError(f"ranks {sorted(ranks)} name a rank twice; pass each rank once")


def quant_options(tensors: Iterable[KdaTensorPlan]) -> dict[str, Any]:
    """The block-quantization keywords a plan (KDA's or an MLA layer's) was built with, read
    back from its tensors for pickling: ``quant_block`` (the weights' block edge, elements),
    ``quantized`` (the names of the tensors with a scale grid) and ``scale_layout``
    (``"modelopt"`` for 4-D ``(ob, 1, ib, 1)`` grids, else ``"grid"``); empty when no tensor
    is block-quantized."""
    scales = [(t, t.scale) for t in tensors if t.scale is not None]
    if not scales:
        return {}
    weight, scale = scales[0]
    return {"quant_block": weight.block, "quantized": [t.name for t, _ in scales],
            "scale_layout": "modelopt" if len(scale.disk_shape) == 4 else "grid"}
