"""The shard plan: which part of each KDA tensor a tensor-parallel rank keeps.

The arithmetic is in the Rust core (``kda_tp._native``); this module adds reading the geometry
from a model config or checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path
from collections.abc import Iterable, Mapping
from typing import Any

from . import _native
from .config import CONFIG_NAME, load_config, parse_config
from .errors import CheckpointError, DtypeMismatchError, ShapeMismatchError

__all__ = ["KdaShard", "KdaTensorPlan", "KdaTpPlan"]

KdaShard = _native.KdaShard
KdaTensorPlan = _native.KdaTensorPlan

_SUFFIX = {"A_log": "A_log", "dt_bias": "dt_bias"}


class KdaTpPlan(_native.KdaTpPlan):
    """The per-rank shard plan for one KDA block (head-parallel, one all-reduce after ``o_proj``).

    ``KdaTpPlan(tp_rank, tp_size, hidden, head_dim, full_heads, conv_kernel, gate_rank, *,
    qk_multiple=256, dtypes=None)``

    Rank ``r`` of ``T`` owns heads ``[r*H/T, (r+1)*H/T)`` and channels ``c = h*head_dim + d`` of
    those heads. Per tensor (plan name; on-disk shape as Kimi-Linear stores it; C = H*head_dim):

    ============================  ====================  ==============  ================
    tensor                        on-disk shape         kind            local shape
    ============================  ====================  ==============  ================
    q_proj, k_proj, v_proj        [C, hidden]           CHANNEL_ROWS    [C/T, hidden]
    q/k/v_conv1d                  [C, 1, K]             CHANNEL_ROWS    [C/T, 1, K]
    f_a_proj, g_a_proj            [gate_rank, hidden]   REPLICATED      unchanged
    f_b_proj, g_b_proj            [C, gate_rank]        CHANNEL_ROWS    [C/T, gate_rank]
    b_proj                        [H, hidden]           HEAD_ROWS       [H/T, hidden]
    A_log (F32)                   [1, 1, H, 1]          HEAD_ROWS       [1, 1, H/T, 1]
    dt_bias (F32)                 [C]                   CHANNEL_ROWS    [C/T]
    o_norm                        [head_dim]            REPLICATED      unchanged
    o_proj                        [hidden, C]           CHANNEL_COLS    [hidden, C/T]
    ============================  ====================  ==============  ================

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

    Attributes:
        tp_rank, tp_size, hidden, head_dim, full_heads, local_heads, conv_kernel, gate_rank,
        qk_multiple: the geometry.
        tensors: list of :class:`KdaTensorPlan`, one per tensor, in the table's order.
        local_bytes: bytes this rank stores for one KDA block.
        full_bytes: bytes one KDA block occupies on disk.
        needs_output_all_reduce: whether ``o_proj``'s output must be all-reduced
            (``tp_size > 1``).

    ``plan.get(name)`` returns the entry or None; ``plan[name]`` raises KeyError.

    Raises:
        PlanError: ``tp_rank >= tp_size``; a zero or negative size; heads not divisible by
            ``tp_size``; the q|k width rule; an unknown tensor or dtype in ``dtypes``; a
            geometry whose byte sizes overflow.
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
                :class:`~kda_tp.SafetensorsSource`. Kimi-Linear keys (``hidden_size``,
                ``linear_attn_config.head_dim/num_heads/short_conv_kernel_size``) and
                Qwen3-Next-style keys (``linear_key_head_dim``, ``linear_num_key_heads``,
                ``linear_conv_kernel_dim``) are understood.
            tp_rank, tp_size: this rank and the world size.
            gate_rank: the gate bottleneck width. With a checkpoint it defaults to the first
                KDA layer's ``f_a_proj`` row count; with a bare config, to ``head_dim``
                (Kimi-Linear's choice).
            qk_multiple: see the class.
            layers: 0-based KDA layer indices, for a checkpoint whose config does not list them;
                the first one is read for dtypes and the gate rank.

        With a checkpoint, each tensor's dtype (and so its element size) is read from the first
        KDA layer's header.

        Raises:
            CheckpointError: a missing or invalid config, or a checkpoint whose first KDA
                layer lacks a tensor.
            DtypeMismatchError: a first-KDA-layer tensor whose dtype is not floating-point.
            ShapeMismatchError: a first-KDA-layer ``f_a_proj`` that is not 2-D (when the gate
                rank is read from it).
            PlanError: a refused geometry (see the class).
        """
        from .source import SafetensorsSource, decoder_prefix, kda_layer_indices, kda_tensor_name

        source = None
        where = "config"  # names the config in error messages
        if isinstance(config, SafetensorsSource):
            source = config
            config = source.config
            if config is None:
                raise CheckpointError(f"{source.root}: no {CONFIG_NAME} beside the weights")
            where = str(source.root / CONFIG_NAME)
        elif isinstance(config, (str, os.PathLike)):
            path = Path(config)
            if path.suffix == ".safetensors" and path.is_file():
                source = SafetensorsSource(path)
                path = path.parent
            elif path.is_dir() and any(path.glob("*.safetensors")):
                source = SafetensorsSource(path)
            config = load_config(path)
            where = str(path / CONFIG_NAME if path.is_dir() else path)
        kda = parse_config(config, where)

        dtypes = None
        if source is not None:
            indices = kda_layer_indices(source, layers)
            if not indices:
                raise CheckpointError(f"{where}: no KDA layer to read the dtypes from")
            layer = indices[0]
            prefix = decoder_prefix(source)
            headers = {}
            for name in _TENSOR_NAMES:
                full_name = kda_tensor_name(prefix, layer, name)
                info = source.info(full_name)
                if info is None:
                    raise CheckpointError(f"{source.root}: KDA layer {layer} lacks {full_name}")
                if info[0] not in _FLOAT_DTYPES:
                    raise DtypeMismatchError(
                        f"{source.file_of(full_name)}: {full_name}: dtype {info[0]} is not a "
                        f"floating-point dtype ({', '.join(_FLOAT_DTYPES)})"
                    )
                headers[name] = info
            dtypes = {name: dtype for name, (dtype, _) in headers.items()}
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
        )

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle (and copy) by the constructor's arguments."""
        args = (self.tp_rank, self.tp_size, self.hidden, self.head_dim, self.full_heads,
                self.conv_kernel, self.gate_rank)
        options = {"qk_multiple": self.qk_multiple,
                   "dtypes": {t.name: t.dtype for t in self.tensors}}
        return (_rebuild, (type(self), args, options))


def _rebuild(cls: type[KdaTpPlan], args: tuple[int, ...], options: dict[str, Any]) -> KdaTpPlan:
    return cls(*args, **options)


# The dtypes the plan accepts for a KDA tensor (the Rust core's rule).
_FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")
_TENSOR_NAMES = [t.name for t in _native.KdaTpPlan(0, 1, 1, 128, 1, 1, 1).tensors]

