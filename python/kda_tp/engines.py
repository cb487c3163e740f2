"""Serving engines' fused KDA parameters, as data: one table per engine version and model family.

Engines do not hold the 14-15 KDA tensors of a checkpoint as they are stored: vLLM fuses
q/k/v/g/f_a/b into one ``in_proj_qkvgfab`` with zero rows after it, SGLang stacks ``f_b`` and
``g_b`` into ``fused_fg_b_proj``, the three short-conv weights become one ``conv1d``, ``A_log``
takes another shape and F32. Each :class:`EngineLayout` lists, for every parameter of one KDA
layer as the engine holds it (its name under ``...layers.{i}.self_attn.``), the plan tensors it
is made of, in order, how they are joined, the padding, the on-device shape and the dtype the
engine casts to. Adding an engine version is adding a table to :data:`LAYOUTS`; nothing else
branches on the engine.

For one rank's :class:`~kda_tp.KdaTpPlan`, :meth:`EngineLayout.param_plan` gives the parameter's
local shape and dtype and where each part lands (:class:`Region`); ``KdaShardedSource
.build_param`` fills such a parameter from a checkpoint in one call, and ``kda_tp.audit`` uses the
same regions to say what a dumped parameter holds.

Rules every table follows (from the engines' sources, see each layout's ``source``):

* A part is a plan tensor name (``"q_proj"``; ``"q_proj.scale"`` is its FP8 block-scale grid):
  this rank's slice of it, exactly as :class:`~kda_tp.KdaShardedSource` returns it
  (``f_a_proj``, ``g_a_proj``, ``o_norm`` whole on every rank; K3's zero-padded ``A_log`` only
  the rank's heads).
* Parts are concatenated on dim 0 in the order given (``stacked``: stacked on a new dim 0), then
  zero rows are appended up to a multiple of ``pad_to`` (``pad_to_fp8`` when the parts are
  block-FP8): vLLM K3 pads ``in_proj_qkvgfab`` to a multiple of 16 rows, of 128 under ModelOpt
  ``FP8_PB_WO``.
* A block-FP8 weight's scale grid (``scale_of``) is the parts' grids, each the rank's block rows
  (``KdaTensorPlan.scale``), concatenated on dim 0 as 2-D ``[rows, column blocks]`` (vLLM
  squeezes ModelOpt's ``[ob, 1, ib, 1]`` after loading; SGLang loads ``[:, 0, :, 0]`` into its
  ``weight_scale_inv``). It exists only when the parts are FP8; every part must start on a
  block boundary of the fused weight.
* ``dtype``: what the engine casts the parameter to (F32 for conv weights, ``A_log`` and
  ``dt_bias`` everywhere); None means the model dtype (the engine's ``--dtype``, by default the
  checkpoint's). FP8 weights and their F32 scales are never cast.
* ``view``: the on-device shape when it is not the parts' own (``A_log``: ``(-1,)`` = ``[h]``,
  ``(1, 1, -1, 1)`` = ``[1, 1, h, 1]``), ``-1`` standing for the remaining elements as in
  ``torch.Tensor.view``.

Not modelled: LoRA-enabled variants, ROCm-only merged buffers, and kernel-specific re-layouts
that change values after loading (e.g. DeepGEMM's UE8M0 scale requantization): these are
buffers or transforms outside the loaded parameters.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from .checkpoint import numpy_dtype
from .config import parse_config
from .errors import CheckpointError, EngineLayoutError
from . import families
from .plan import KdaTensorPlan, KdaTpPlan
from .quant import FP8_DTYPES

__all__ = [
    "FAMILIES",
    "LAYOUTS",
    "EngineLayout",
    "EngineParam",
    "EngineParamPlan",
    "Region",
    "get_layout",
    "kda_only_suffixes",
    "layouts_for",
    "layouts_markdown",
    "model_family",
    "param_location",
    "param_name",
    "recognise",
]

#: Model families a layout is written for (the names of :data:`kda_tp.families.FAMILIES`):
#: Kimi-Linear and GLM-5.3-Flash (low-rank gate; GLM's config is transformers' ``glm5_next``),
#: Kimi K3 (full-rank output gate).
FAMILIES = tuple(families.FAMILIES)


@dataclass(frozen=True)
class EngineParam:
    """One parameter of one KDA layer as an engine holds it.

    Attributes:
        suffix: its name after ``...layers.{i}.self_attn.`` (``"in_proj_qkvgfab.weight"``).
        parts: the plan tensors it is made of, in order (``("q_proj", "k_proj", ...)``); empty
            for a scale grid (``scale_of``), whose parts are the weight's ``"<part>.scale"``.
        stacked: the parts are stacked on a new dim 0 (``[n, *part]``) instead of concatenated
            on dim 0.
        pad_to: zero rows are appended on dim 0 up to a multiple of this many rows.
        pad_to_fp8: the multiple instead when the parts are block-FP8 (None: ``pad_to``).
        view: the on-device shape, with one ``-1`` for the remaining elements, when it is not
            the concatenated parts' shape (None).
        dtype: the safetensors dtype the engine casts to (``"F32"``), or None for the model
            dtype.
        scale_of: for a block-FP8 scale grid, the suffix of the weight it scales.
    """

    suffix: str
    parts: tuple[str, ...] = ()
    stacked: bool = False
    pad_to: int = 1
    pad_to_fp8: int | None = None
    view: tuple[int, ...] | None = None
    dtype: str | None = None
    scale_of: str | None = None


@dataclass(frozen=True)
class Region:
    """Where one part lies in a rank's engine parameter (row-major bytes of the whole buffer).

    Attributes:
        part: the plan tensor (``"q_proj"``, or ``"q_proj.scale"`` for its scale grid).
        index: the stack index for a ``stacked`` parameter, else None.
        rows: ``(start, stop)`` on dim 0 of the concatenation (within ``index`` when stacked),
            in rows of ``row_elems`` elements.
        row_elems: elements per row (the part's flat ``[rows, row_elems]`` view).
        byte_range: ``(start, stop)`` in bytes of the parameter's buffer, in the parameter's
            dtype.
        shape: the part's local shape with its rows on dim 0 (``A_log [1, 1, H/T, 1]`` as its
            flat ``[H/T, 1]``; a scale grid as ``[rows, column blocks]``).
        source_dtype: the part's dtype in the checkpoint (before the engine's cast).
    """

    part: str
    index: int | None
    rows: tuple[int, int]
    row_elems: int
    byte_range: tuple[int, int]
    shape: tuple[int, ...]
    source_dtype: str


@dataclass(frozen=True)
class EngineParamPlan:
    """One engine parameter for one rank: shape, dtype, and where every part and the padding lie.

    Attributes:
        layout: the layout's name (``"vllm-0.33-k3"``).
        suffix: the parameter's name after ``self_attn.``.
        shape: its local shape on the device.
        dtype: its safetensors dtype after the engine's cast (``"BF16"``, ``"F32"``,
            ``"F8_E4M3"``).
        regions: the parts, in buffer order; together with ``padding`` they tile the buffer.
        padding: ``(start, stop)`` bytes of zero padding rows (at the end), or None.
        nbytes: the buffer's size in bytes.
    """

    layout: str
    suffix: str
    shape: tuple[int, ...]
    dtype: str
    regions: tuple[Region, ...]
    padding: tuple[int, int] | None
    nbytes: int


@dataclass(frozen=True)
class EngineLayout:
    """How one engine version holds one model family's KDA layer: a table of parameters.

    Attributes:
        name: stable name, ``"<engine>-<version>-<family>[-variant]"`` (``"vllm-0.33-k3"``).
        engine, version, family: e.g. ``"vllm"``, ``"0.33"``, ``"kimi-k3"`` (see
            :data:`FAMILIES`).
        params: the parameters of one KDA layer (scale grids included).
        source: where the layout comes from (engine file and class), for people checking it.
        tensor_parallel: False when the engine keeps KDA replicated (transformers' TP plan has
            no KDA entries): the layout then holds only at ``tp_size == 1``.
        wrapped_prefix: the engine's name prefix of the decoder layers (up to the layer index)
            for a checkpoint that nests them in a multimodal wrapper (``language_model``); a
            flat checkpoint's are ``model.layers.`` everywhere (see :meth:`state_dict_prefix`).
    """

    name: str
    engine: str
    version: str
    family: str
    params: tuple[EngineParam, ...]
    source: str
    tensor_parallel: bool = True
    wrapped_prefix: str = "language_model.model.layers."

    def state_dict_prefix(self, checkpoint_prefix: str) -> str:
        """The prefix (up to the layer index) of this engine's names for the KDA layers of a
        checkpoint whose layers lie under ``checkpoint_prefix`` (``"model.layers."``,
        ``"language_model.layers."``, ``"model.language_model.layers."``).

        A flat checkpoint's layers are ``model.layers.`` in every engine; a wrapped one's
        (its prefix holds ``language_model``) are ``wrapped_prefix``, where the engine's
        weight-name mapper puts them: vLLM 0.33's ``KimiK3ForConditionalGeneration`` and
        ``Glm5NextForConditionalGeneration`` and SGLang 0.5.23's K3 model hold
        ``language_model.model.layers.``, SGLang's GLM-5.3 ``model.layers.``, transformers'
        GLM-5.3 ``model.language_model.layers.``. These are the names of the engine's
        ``state_dict()``, of its ``save_sharded_state`` files and of vLLM's weight checksums.
        """
        return self.wrapped_prefix if "language_model" in checkpoint_prefix else "model.layers."

    @property
    def suffixes(self) -> frozenset[str]:
        """Every parameter name after ``self_attn.``, scale grids included."""
        return frozenset(p.suffix for p in self.params)

    @property
    def required(self) -> frozenset[str]:
        """The parameter names present whatever the quantization (scale grids excluded)."""
        return frozenset(p.suffix for p in self.params if p.scale_of is None)

    @property
    def fp8(self) -> bool:
        """Whether the layout describes block-FP8 weights (it has scale grids)."""
        return any(p.scale_of is not None for p in self.params)

    def param(self, suffix: str) -> EngineParam:
        """The parameter named ``suffix`` (after ``self_attn.``).

        Raises:
            EngineLayoutError: the layout has no such parameter (the message lists its names).
        """
        for p in self.params:
            if p.suffix == suffix:
                return p
        raise EngineLayoutError(
            f"{self.name}: no parameter {suffix!r}; its parameters: {sorted(self.suffixes)}"
        )

    def params_for(self, plan: KdaTpPlan) -> tuple[EngineParam, ...]:
        """The parameters one KDA layer has for ``plan``: scale grids only when their weight's
        parts are block-FP8 in the plan.

        Raises:
            EngineLayoutError: the layout does not fit the plan (see :meth:`check_plan`).
        """
        self.check_plan(plan)
        return tuple(
            p for p in self.params
            if p.scale_of is None or _quantized(self.param(p.scale_of), plan)
        )

    def check_plan(self, plan: KdaTpPlan) -> None:
        """Refuse a plan this layout cannot hold.

        Raises:
            EngineLayoutError: a part the plan lacks (the other output-gate form: K3's
                ``g_proj`` vs ``g_a_proj``/``g_b_proj``), ``tp_size > 1`` for an engine that
                keeps KDA replicated, or block-FP8 parts in a parameter the layout gives no
                scale grid (or mixed FP8 and unquantized parts).
        """
        if not self.tensor_parallel and plan.tp_size != 1:
            raise EngineLayoutError(
                f"{self.name}: {self.engine} keeps KDA layers replicated (no tensor-parallel "
                f"plan for them); it holds only tp_size 1, not {plan.tp_size}"
            )
        scaled = {p.scale_of for p in self.params if p.scale_of is not None}
        for p in self.params:
            if p.scale_of is not None:
                continue
            missing = [part for part in p.parts if plan.get(part) is None]
            if missing:
                form = "full-rank g_proj" if plan.full_rank_gate else "low-rank g_a_proj/g_b_proj"
                raise EngineLayoutError(
                    f"{self.name}: {p.suffix} is made of {', '.join(missing)}, which the plan "
                    f"does not have (the plan's output gate is the {form}; this layout is for "
                    f"{self.family})"
                )
            if _quantized(p, plan) and p.suffix not in scaled:
                raise EngineLayoutError(
                    f"{self.name}: {p.suffix} is made of block-FP8 weights in this checkpoint, "
                    "but the layout has no scale grid for it; layouts with FP8 scale grids: "
                    f"{[n for n, lay in LAYOUTS.items() if lay.fp8] or 'none'}"
                )

    def param_plan(
        self, suffix: str, plan: KdaTpPlan, model_dtype: str | None = None
    ) -> EngineParamPlan:
        """Parameter ``suffix`` for ``plan``'s rank: local shape, dtype, part regions, padding.

        Args:
            suffix: the parameter's name after ``self_attn.``.
            plan: one rank's plan (its dtypes are the checkpoint's, as ``from_config`` reads).
            model_dtype: the engine's model dtype (``"BF16"``...) for parameters without a
                fixed dtype; None keeps the checkpoint's (the parts must then share one dtype).

        Returns:
            An :class:`EngineParamPlan`; its regions and padding tile ``nbytes`` exactly.

        Raises:
            EngineLayoutError: no such parameter; the layout does not fit the plan
                (:meth:`check_plan`); a scale grid whose weight is not block-FP8 here; parts
                whose trailing shapes, or (with no cast) dtypes, differ; a block-FP8 part that
                does not start on a block boundary of the fused weight.
        """
        param = self.param(suffix)
        self.check_plan(plan)
        if param.scale_of is not None:
            return self._scale_plan(param, plan)
        entries = [plan[part] for part in param.parts]
        fp8 = _quantized(param, plan)
        dtype = _out_dtype(self.name, param, entries, fp8, model_dtype)
        itemsize = _itemsize(dtype)
        part_shapes = [_part_shape(t) for t in entries]
        regions = []
        if param.stacked:
            if len(set(part_shapes)) != 1:
                raise EngineLayoutError(
                    f"{self.name}: {suffix} stacks parts of different local shapes "
                    f"{dict(zip(param.parts, part_shapes))}"
                )
            size = math.prod(part_shapes[0]) * itemsize
            for i, (part, t) in enumerate(zip(param.parts, entries)):
                regions.append(Region(part, i, (0, t.local_rows), t.local_row_elems,
                                      (i * size, (i + 1) * size), part_shapes[0], t.dtype))
            shape = (len(entries), *part_shapes[0])
            rows_total = padded = 0
            nbytes = len(entries) * size
        else:
            trailing = {shp[1:] for shp in part_shapes}
            elems = {t.local_row_elems for t in entries}
            if len(trailing) != 1 or len(elems) != 1:
                raise EngineLayoutError(
                    f"{self.name}: {suffix} concatenates parts whose rows differ "
                    f"{dict(zip(param.parts, part_shapes))}"
                )
            row_elems = elems.pop()
            row = 0
            for part, t, shp in zip(param.parts, entries, part_shapes):
                regions.append(Region(part, None, (row, row + t.local_rows), row_elems,
                                      (row * row_elems * itemsize,
                                       (row + t.local_rows) * row_elems * itemsize),
                                      shp, t.dtype))
                row += t.local_rows
            rows_total = row
            multiple = param.pad_to_fp8 if fp8 and param.pad_to_fp8 else param.pad_to
            padded = -(-rows_total // multiple) * multiple
            shape = (padded, *trailing.pop())
            nbytes = padded * row_elems * itemsize
        if param.view is not None:
            known = math.prod(d for d in param.view if d != -1)
            shape = tuple(math.prod(shape) // known if d == -1 else d for d in param.view)
        padding = None
        if padded > rows_total:
            padding = (regions[-1].byte_range[1], nbytes)
        return EngineParamPlan(self.name, suffix, shape, dtype, tuple(regions), padding, nbytes)

    def _scale_plan(self, param: EngineParam, plan: KdaTpPlan) -> EngineParamPlan:
        assert param.scale_of is not None
        weight = self.param(param.scale_of)
        if not _quantized(weight, plan):
            raise EngineLayoutError(
                f"{self.name}: {param.suffix} exists only when {weight.suffix} is block-FP8, "
                "and its parts are not quantized in this plan"
            )
        regions = []
        row = 0  # scale rows so far
        weight_row = 0  # weight rows so far
        dtypes = set()
        for part in weight.parts:
            t = plan[part]
            s = t.scale
            assert s is not None and t.block is not None
            if weight_row % t.block[0]:
                raise EngineLayoutError(
                    f"{self.name}: {weight.suffix}: {part} starts at row {weight_row} of the fused "
                    f"weight, not on a {t.block[0]}-row block boundary, so its block scales cannot "
                    f"be fused into {param.suffix}"
                )
            itemsize = _itemsize(s.dtype)
            regions.append(Region(f"{part}.scale", None, (row, row + s.local_rows),
                                  s.local_row_elems,
                                  (row * s.local_row_elems * itemsize,
                                   (row + s.local_rows) * s.local_row_elems * itemsize),
                                  (s.local_rows, s.local_row_elems), s.dtype))
            row += s.local_rows
            weight_row += t.local_rows
            dtypes.add(s.dtype)
        elems = {r.row_elems for r in regions}
        if len(elems) != 1 or len(dtypes) != 1:
            raise EngineLayoutError(
                f"{self.name}: {param.suffix}: the parts' scale grids differ in width or dtype "
                f"{[(r.part, r.shape, r.source_dtype) for r in regions]}"
            )
        (row_elems,), (dtype,) = elems, dtypes
        return EngineParamPlan(self.name, param.suffix, (row, row_elems), dtype,
                               tuple(regions), None, regions[-1].byte_range[1])


def _part_shape(t: KdaTensorPlan) -> tuple[int, ...]:
    """A part's local shape with its rows on dim 0: the local shape on the plan's canonical
    on-disk shape (conv ``[C/T, 1, K]``), or the flat ``[rows, row_elems]`` view where the rows
    lie on another axis (``A_log [1, 1, H/T, 1]``, which every table reshapes with ``view``)."""
    shape = t.local_shape(list(t.disk_shape))
    return shape if shape and shape[0] == t.local_rows else (t.local_rows, t.local_row_elems)


def _quantized(param: EngineParam, plan: KdaTpPlan) -> bool:
    """Whether a weight's parts are block-FP8 in ``plan``.

    Raises:
        EngineLayoutError: some parts are and some are not.
    """
    flags = {part: plan[part].scale is not None for part in param.parts if part in plan}
    if len(set(flags.values())) > 1:
        raise EngineLayoutError(
            f"{param.suffix}: mixes block-FP8 and unquantized parts {flags}; an engine "
            "quantizes a fused parameter as a whole"
        )
    return any(flags.values())


def _out_dtype(
    layout: str,
    param: EngineParam,
    entries: list[KdaTensorPlan],
    fp8: bool,
    model_dtype: str | None,
) -> str:
    sources = {t.dtype for t in entries}
    if fp8:
        if len(sources) != 1 or not sources <= set(FP8_DTYPES):
            raise EngineLayoutError(f"{layout}: {param.suffix}: FP8 parts of dtypes {sources}")
        return sources.pop()
    if param.dtype is not None:
        return param.dtype
    if model_dtype is not None:
        return model_dtype
    if len(sources) != 1:
        raise EngineLayoutError(
            f"{layout}: {param.suffix}: its parts have dtypes {sorted(sources)}; pass the engine's "
            "model dtype (model_dtype=) to say what the engine casts them to"
        )
    return sources.pop()


def _itemsize(dtype: str) -> int:
    return numpy_dtype(dtype).itemsize


# ------------------------------------------------------------------------------------------------
# The tables. Sources are the engines' released wheels (vllm 0.33.0, sglang 0.5.23) and
# transformers 5.24. The six main vLLM and SGLang tables, unquantized, are checked against
# parameters the engines' own code loaded (tests/data/engine_ranks), transformers' against what
# transformers loads; the FP8 scale grids and SGLang's unfused Kimi-Linear path are read from
# the sources.

_CONV_QKV = ("q_conv1d", "k_conv1d", "v_conv1d")
_F32 = "F32"


def _common(a_log_view: tuple[int, ...], *, scales: str | None = None) -> tuple[EngineParam, ...]:
    """``A_log``, ``dt_bias``, ``o_norm``, ``o_proj`` (+ its scale grid), held alike everywhere."""
    params = [
        EngineParam("A_log", ("A_log",), view=a_log_view, dtype=_F32),
        EngineParam("dt_bias", ("dt_bias",), dtype=_F32),
        EngineParam("o_norm.weight", ("o_norm",)),
        EngineParam("o_proj.weight", ("o_proj",)),
    ]
    if scales:
        params.append(EngineParam(f"o_proj.{scales}", scale_of="o_proj.weight"))
    return tuple(params)


def _single(name: str, scales: str | None = None) -> tuple[EngineParam, ...]:
    """An unfused projection ``<name>.weight`` (+ its scale grid ``<name>.<scales>``)."""
    weight = EngineParam(f"{name}.weight", (name,))
    if scales is None:
        return (weight,)
    return weight, EngineParam(f"{name}.{scales}", scale_of=weight.suffix)


# SGLang 0.5.23 fuses Kimi-Linear's and GLM-5.3-Flash's low-rank-gate KDA layers alike.
_SGLANG_FUSED_LOW_RANK_GATE = (
    EngineParam("fused_qkvbfg_a_proj.weight",
                ("q_proj", "k_proj", "v_proj", "b_proj", "f_a_proj", "g_a_proj")),
    EngineParam("fused_fg_b_proj.weight", ("f_b_proj", "g_b_proj"), stacked=True),
    EngineParam("qkv_conv1d.weight", _CONV_QKV, dtype=_F32),
    *_common((1, 1, -1, 1)),
)

_VLLM = "vllm/models/kimi_k3/nvidia/kda.py"
_TABLES = (
    EngineLayout(
        "vllm-0.33-k3", "vllm", "0.33", "kimi-k3",
        (
            EngineParam("in_proj_qkvgfab.weight",
                        ("q_proj", "k_proj", "v_proj", "g_proj", "f_a_proj", "b_proj"),
                        pad_to=16, pad_to_fp8=128),
            EngineParam("in_proj_qkvgfab.weight_scale", scale_of="in_proj_qkvgfab.weight"),
            EngineParam("conv1d.weight", _CONV_QKV, dtype=_F32),
            *_single("f_b_proj", "weight_scale"),
            *_common((-1,), scales="weight_scale"),
        ),
        f"vllm 0.33.0 {_VLLM}: KimiK3DeltaAttention (in_proj_qkvgfab: f_a forced to tp_rank 0, "
        "zero rows to a multiple of 16, of 128 under ModelOpt FP8_PB_WO; ModelOpt scales "
        "[ob,1,ib,1] squeezed to [ob,ib] after loading, b_proj's single scale row on every rank)",
    ),
    EngineLayout(
        "vllm-0.33-kimi-linear", "vllm", "0.33", "kimi-linear",
        (
            EngineParam("in_proj_qkvgfab.weight",
                        ("q_proj", "k_proj", "v_proj", "b_proj", "f_a_proj")),
            EngineParam("conv1d.weight", _CONV_QKV, dtype=_F32),
            *_single("f_b_proj"), *_single("g_a_proj"), *_single("g_b_proj"),
            *_common((-1,)),
        ),
        "vllm 0.33.0 vllm/model_executor/layers/mamba/gdn/kimi_gdn_linear_attn.py: "
        "KimiGatedDeltaNetAttention (low-rank gate: no padding)",
    ),
    EngineLayout(
        "vllm-0.33-glm-5.3", "vllm", "0.33", "glm-5.3",
        (
            EngineParam("in_proj_qkvbfg_a.weight",
                        ("q_proj", "k_proj", "v_proj", "b_proj", "f_a_proj", "g_a_proj")),
            *(EngineParam(f"{c}.weight", (c,), dtype=_F32) for c in _CONV_QKV),
            *_single("f_b_proj"), *_single("g_b_proj"),
            *_common((1, 1, -1, 1)),
        ),
        "vllm 0.33.0 vllm/models/glm5next/common/kda.py: Glm5NextLinearAttention "
        "(f_a and g_a replicated shards 4 and 5; separate F32 convs)",
    ),
    EngineLayout(
        "sglang-0.5.23-k3", "sglang", "0.5.23", "kimi-k3",
        (
            EngineParam("fused_qkvg_proj.weight", ("q_proj", "k_proj", "v_proj", "g_proj")),
            EngineParam("fused_qkvg_proj.weight_scale_inv", scale_of="fused_qkvg_proj.weight"),
            *_single("b_proj", "weight_scale_inv"),
            *_single("f_a_proj", "weight_scale_inv"),
            *_single("f_b_proj", "weight_scale_inv"),
            EngineParam("qkv_conv1d.weight", _CONV_QKV, dtype=_F32),
            *_common((1, 1, -1, 1), scales="weight_scale_inv"),
        ),
        "sglang 0.5.23 python/sglang/srt/models/kimi_k3.py: KimiK3DeltaAttention (full-rank "
        "gate: only [q,k,v,g] fused; ModelOpt weight_scale loaded [:,0,:,0] into "
        "weight_scale_inv; b_proj's scale grid copied whole to every rank)",
    ),
    EngineLayout(
        "sglang-0.5.23-kimi-linear", "sglang", "0.5.23", "kimi-linear",
        _SGLANG_FUSED_LOW_RANK_GATE,
        "sglang 0.5.23 python/sglang/srt/models/kimi_linear.py: KimiDeltaAttention, fused path "
        "(no quantization_config)",
    ),
    EngineLayout(
        "sglang-0.5.23-kimi-linear-unfused", "sglang", "0.5.23", "kimi-linear",
        (
            EngineParam("qkv_proj.weight", ("q_proj", "k_proj", "v_proj")),
            *_single("f_a_proj"), *_single("f_b_proj"), *_single("b_proj"),
            *_single("g_a_proj"), *_single("g_b_proj"),
            EngineParam("qkv_conv1d.weight", _CONV_QKV, dtype=_F32),
            *_common((1, 1, -1, 1)),
        ),
        "sglang 0.5.23 python/sglang/srt/models/kimi_linear.py: KimiDeltaAttention, unfused path "
        "(taken whenever the config has a quantization_config)",
    ),
    EngineLayout(
        "sglang-0.5.23-glm-5.3", "sglang", "0.5.23", "glm-5.3",
        _SGLANG_FUSED_LOW_RANK_GATE,
        "sglang 0.5.23 python/sglang/srt/models/glm5_next.py: Glm5NextLinearAttention, fused "
        "path (KDA projections unquantized, as in GLM-5.3-Flash's FP8 release)",
        wrapped_prefix="model.layers.",  # its mapper: model.language_model. -> model.
    ),
    EngineLayout(
        "transformers-5-kimi-linear", "transformers", "5", "kimi-linear",
        (
            *_single("q_proj"), *_single("k_proj"), *_single("v_proj"),
            EngineParam("conv1d.weight", _CONV_QKV),
            EngineParam("forget_gate.f_a_proj.weight", ("f_a_proj",)),
            EngineParam("forget_gate.f_b_proj.weight", ("f_b_proj",)),
            EngineParam("forget_gate.A_log", ("A_log",), view=(1, 1, -1, 1)),
            EngineParam("forget_gate.dt_bias", ("dt_bias",), dtype=_F32),
            *_single("b_proj"), *_single("g_a_proj"), *_single("g_b_proj"),
            *_single("o_norm"), *_single("o_proj"),
        ),
        "transformers 5.24 models/kimi_linear/modeling_kimi_linear.py: KimiLinearDeltaAttention "
        "(conversion_mapping: q/k/v_conv1d concatenated into conv1d, f_a/f_b/dt_bias/A_log under "
        "forget_gate.; dt_bias kept F32)",
        tensor_parallel=False,
    ),
    EngineLayout(
        "transformers-5-glm-5.3", "transformers", "5", "glm-5.3",
        (
            *_single("q_proj"), *_single("k_proj"), *_single("v_proj"),
            EngineParam("conv1d.weight", _CONV_QKV, dtype=_F32),
            EngineParam("forget_gate.f_a_proj.weight", ("f_a_proj",)),
            EngineParam("forget_gate.f_b_proj.weight", ("f_b_proj",)),
            EngineParam("forget_gate.A_log", ("A_log",), view=(-1,), dtype=_F32),
            EngineParam("forget_gate.dt_bias", ("dt_bias",), dtype=_F32),
            *_single("b_proj"), *_single("g_a_proj"), *_single("g_b_proj"),
            *_single("o_norm"), *_single("o_proj"),
        ),
        "transformers 5.24 models/glm5_next/modeling_glm5_next.py: Glm5NextTextLinearAttention "
        "(F32 conv1d and forget-gate A_log/dt_bias)",
        tensor_parallel=False,
        wrapped_prefix="model.language_model.layers.",
    ),
)

#: Every layout by its stable name (read-only).
LAYOUTS: Mapping[str, EngineLayout] = MappingProxyType({t.name: t for t in _TABLES})


# Plan tensors other attention layers also hold under the same names after ``self_attn.``
# (every attention's q/k/v/o projections; Kimi K3's MLA layers' g_proj).
_SHARED_PARTS = frozenset({"q_proj", "k_proj", "v_proj", "g_proj", "o_proj"})


def kda_only_suffixes() -> frozenset[str]:
    """Name endings (after ``self_attn.``) that only a KDA layer's parameters have, in any
    layout of :data:`LAYOUTS`: every parameter made of at least one plan tensor no other
    attention layer holds (``A_log``, ``dt_bias``, the convs, the gate projections, ``b_proj``,
    ``o_norm``) ends with one of them after a dot. The shortest such endings only: scale grids
    come with their weights, and ``forget_gate.A_log`` ends with ``A_log``.
    ``fused_qkvg_proj.weight`` (q, k, v, g) is not one of them."""
    found = {param.suffix for layout in LAYOUTS.values() for param in layout.params
             if param.scale_of is None and set(param.parts) - _SHARED_PARTS}
    return frozenset(s for s in found if not any(s.endswith(f".{t}") for t in found))


def get_layout(name: str | EngineLayout) -> EngineLayout:
    """The layout named ``name`` (a layout passes through).

    Raises:
        EngineLayoutError: no such layout (the message lists the names).
    """
    if isinstance(name, EngineLayout):
        return name
    try:
        return LAYOUTS[name]
    except KeyError:
        raise EngineLayoutError(
            f"no engine layout {name!r}; known: {', '.join(LAYOUTS)}"
        ) from None


def model_family(config: Mapping[str, Any] | None) -> str:
    """The model family of a config, one of :data:`FAMILIES`.

    ``"kimi-k3"`` for a full-rank output gate (``use_full_rank_gate``), ``"glm-5.3"`` for a
    config read with GLM-5.3-Flash's rules (``model_type`` ``glm5_next`` or ``glm5_next_text``,
    top level or ``text_config``), else ``"kimi-linear"``.

    Args:
        config: a parsed ``config.json`` (e.g. ``SafetensorsSource.config``).

    Raises:
        CheckpointError: no config (None: the checkpoint has no ``config.json``), or one
            without KDA geometry (from ``kda_tp.config.parse_config``).
    """
    if config is None:
        raise CheckpointError(
            "no config.json: the model family (and which layers are KDA) comes from the config"
        )
    kda = parse_config(config)
    return families.family_for(kda.rules, kda.full_rank_gate).name


def layouts_for(family: str | None = None, plan: KdaTpPlan | None = None) -> list[EngineLayout]:
    """The layouts that can hold a model: of ``family`` (see :func:`model_family`), and, with
    ``plan``, those that fit it (:meth:`EngineLayout.check_plan`: output-gate form, block-FP8
    scale grids, tensor parallelism).

    Raises:
        EngineLayoutError: ``family`` is not one of :data:`FAMILIES`.
    """
    if family is not None and family not in FAMILIES:
        raise EngineLayoutError(f"unknown model family {family!r}; known: {', '.join(FAMILIES)}")
    found = []
    for layout in LAYOUTS.values():
        if family is not None and layout.family != family:
            continue
        if plan is not None:
            try:
                layout.check_plan(plan)
            except EngineLayoutError:
                continue
        found.append(layout)
    return found


# ASCII digits (\d matches other scripts' digits), at most 10: a layer index is below 2**31.
_PARAM_NAME = re.compile(r"^((?:.*\.)?layers\.)([0-9]{1,10})\.self_attn\.(.+)$")


def param_name(prefix: str, layer: int, suffix: str) -> str:
    """A KDA layer's parameter name, the inverse of :func:`param_location`:
    ``param_name("model.layers.", 3, "A_log")`` -> ``"model.layers.3.self_attn.A_log"``."""
    return f"{prefix}{layer}.self_attn.{suffix}"


def param_location(name: str) -> tuple[str, int, str] | None:
    """Split a parameter name of a decoder layer's attention into ``(prefix, layer, suffix)``.

    ``"language_model.model.layers.3.self_attn.in_proj_qkvgfab.weight"`` ->
    ``("language_model.model.layers.", 3, "in_proj_qkvgfab.weight")``; any model prefix works
    (``model.``, ``language_model.model.``, none). None for a name outside ``self_attn``.
    Whether layer 3 is a KDA layer is the config's business, never the name's.
    """
    match = _PARAM_NAME.match(name)
    if match is None:
        return None
    return match.group(1), int(match.group(2)), match.group(3)


def recognise(suffixes: Iterable[str], family: str | None = None) -> list[EngineLayout]:
    """The layouts a set of parameter names fits best; several mean the names cannot tell.

    A layout fits when it knows every name (``suffixes``: names after
    ``...layers.{i}.self_attn.`` of a KDA layer, scale grids included); of those, the ones
    lacking the fewest of their always-present parameters are returned (so a dump missing a
    parameter is still recognised, and the caller reports what it lacks). Empty when no layout
    knows all the names.

    Args:
        suffixes: parameter names of one KDA layer (or the union over layers).
        family: keep only layouts of this family (e.g. :func:`model_family` of the config):
            SGLang holds Kimi-Linear and GLM-5.3 under the same names.

    Raises:
        EngineLayoutError: ``family`` is not one of :data:`FAMILIES`.
    """
    names = set(suffixes)
    fitting = [lay for lay in layouts_for(family) if names <= lay.suffixes]
    if not fitting:
        return []
    fewest = min(len(lay.required - names) for lay in fitting)
    return [lay for lay in fitting if len(lay.required - names) == fewest]


# Each plan tensor's local shape in symbols, for the documentation tables only.
_SYMBOLS = {
    "q_proj": ("Cl", "d"), "k_proj": ("Cl", "d"), "v_proj": ("Cl", "d"), "g_proj": ("Cl", "d"),
    "q_conv1d": ("Cl", "1", "K"), "k_conv1d": ("Cl", "1", "K"), "v_conv1d": ("Cl", "1", "K"),
    "f_a_proj": ("r", "d"), "g_a_proj": ("r", "d"), "f_b_proj": ("Cl", "r"),
    "g_b_proj": ("Cl", "r"), "b_proj": ("Hl", "d"), "A_log": ("Hl",), "dt_bias": ("Cl",),
    "o_norm": ("D",), "o_proj": ("d", "Cl"),
}


def _symbolic_shape(param: EngineParam) -> str:
    if param.scale_of is not None:
        return "[Σ parts' block rows, column blocks]"
    if param.view is not None:
        return "[" + ", ".join("Hl" if d == -1 else str(d) for d in param.view) + "]"
    shapes = [_SYMBOLS[p] for p in param.parts]
    if param.stacked:
        return f"[{len(shapes)}, {', '.join(shapes[0])}]"
    terms: list[list[Any]] = []
    for shape in shapes:  # equal neighbours merged: q, k, v -> 3·Cl
        if terms and terms[-1][1] == shape[0]:
            terms[-1][0] += 1
        else:
            terms.append([1, shape[0]])
    rows = " + ".join(f"{n}·{sym}" if n > 1 else sym for n, sym in terms)
    if param.pad_to > 1:
        rows = f"pad{param.pad_to}({rows})"
        if param.pad_to_fp8:
            rows += f" (FP8: pad{param.pad_to_fp8})"
    return f"[{', '.join((rows, *shapes[0][1:]))}]"


def _join(param: EngineParam) -> str:
    if param.scale_of is not None:
        return f"the scale grids of `{param.scale_of}`'s parts, concatenated"
    parts = ", ".join(param.parts)
    if param.stacked:
        return f"stack({parts})"
    return f"concat({parts})" if len(param.parts) > 1 else parts


def layouts_markdown() -> str:
    """Every layout as Markdown tables (the tables of ``docs/engine-layouts.md``).

    Shapes use ``Cl`` (this rank's channels, ``Hl * D``), ``Hl`` (its heads), ``D`` (head_dim),
    ``d`` (hidden), ``r`` (gate rank, ``f_a_proj`` rows), ``K`` (conv kernel); ``padN(x)`` is
    ``x`` rounded up to a multiple of ``N`` with zero rows.
    """
    out = []
    for layout in LAYOUTS.values():
        tp = "" if layout.tensor_parallel else " KDA is replicated: tp_size 1 only."
        out.append(f"### `{layout.name}`\n\n{layout.source}.{tp}\n")
        out.append("| parameter | made of | local shape | dtype |")
        out.append("| --- | --- | --- | --- |")
        for p in layout.params:
            dtype = p.dtype or ("F32 (scales)" if p.scale_of else "model")
            out.append(f"| `{p.suffix}` | {_join(p)} | {_symbolic_shape(p)} | {dtype} |")
        out.append("")
    return "\n".join(out)
