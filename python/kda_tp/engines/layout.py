"""The machinery of engine layouts: :class:`EngineLayout` (one engine version's table of one
model family's KDA parameters), its :class:`EngineParam` rows, and what a parameter is for one
rank's plan (:class:`EngineParamPlan`: shape, dtype, the :class:`Region` of every part, the
padding).

The tables themselves are data, in ``kda_tp.engines._tables``; :mod:`kda_tp.engines` holds
them by name (``LAYOUTS``) and re-exports these classes. The rules every table follows are
:mod:`kda_tp.engines`' docstring.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..checkpoint.destinations import check_out, writable_bytes
from ..errors import EngineLayoutError
from ..model.dtypes import FP8_DTYPES, cast_into, numpy_dtype
from ..rank.plan import KdaTensorPlan, KdaTpPlan

__all__ = ["CONFIG_DTYPE", "EngineLayout", "EngineParam", "EngineParamPlan", "Region",
           "mla_unjudged"]

#: ``EngineParam.dtype`` of a parameter an engine builds in the checkpoint config's dtype
#: whatever its model dtype (SGLang 0.5.23's Kimi-Linear ``fused_fg_b_proj``:
#: ``ColumnParallelBatchedLinear(..., dtype=config.dtype)``); the model dtype when the config
#: names none (``torch.empty(dtype=None)``: the default dtype, the model dtype).
CONFIG_DTYPE = "config"


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
        dtype: the safetensors dtype the engine casts to (``"F32"``), ``CONFIG_DTYPE``
            for the checkpoint config's dtype, or None for the model dtype.
        scale_of: for a block-FP8 scale grid, the suffix of the weight it scales.
        dump_suffix: the name a ``save_sharded_state`` dump gives it when that differs from
            ``suffix`` (vLLM 0.33's GLM-5.3 MLA ``q_a_layernorm``, ``q_b_proj``, ``o_proj``:
            ``mla_attn.<name>``, the wrapper's path to the same module, which vLLM's filter
            keeps as the smaller key); None: ``suffix``.
    """

    suffix: str
    parts: tuple[str, ...] = ()
    stacked: bool = False
    pad_to: int = 1
    pad_to_fp8: int | None = None
    view: tuple[int, ...] | None = None
    dtype: str | None = None
    scale_of: str | None = None
    dump_suffix: str | None = None


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

    def fill(self, out: Any, read_part: Callable[[str, np.ndarray], None],
             part_nbytes: Callable[[str], int]) -> Any:
        """Build the parameter in ``out`` as the engine's loader leaves it: every part copied
        into its region by ``read_part(part, destination)`` (a rank's slice of a plan tensor,
        or of its FP8 block-scale grid: ``KdaShardedSource.read_into``), cast first where the
        engine casts (e.g. BF16 conv weights to F32) as its torch ``copy_`` casts
        (``kda_tp.model.dtypes.cast_to``: an F64 value through F32), the padding rows zeroed.

        Args:
            out: None to allocate a numpy array of ``shape`` and ``dtype``; or a writable
                C-contiguous buffer of exactly ``nbytes`` bytes (a numpy array of any shape
                with item size 1 or the dtype's, a ``bytearray``), every byte overwritten.
            read_part: copies part ``part``'s bytes (in the source dtype) into the given
                ``uint8`` array of exactly its size.
            part_nbytes: the size in bytes of part ``part`` in its source dtype (for the
                parts the engine casts, which are read into a temporary first).

        Returns:
            ``out``, or the new array.

        Raises:
            ShapeMismatchError: ``out`` is not ``nbytes`` bytes, or its item size is neither 1
                nor the dtype's.
            BufferLayoutError: ``out`` is read-only, not C-contiguous, or not a buffer.
        """
        if out is None:
            out = np.empty(self.shape, numpy_dtype(self.dtype))
        target = writable_bytes(self.suffix, out)
        check_out(self.suffix, self.dtype, out, target, self.nbytes)
        for region in self.regions:
            dst = target[region.byte_range[0] : region.byte_range[1]]
            if region.source_dtype == self.dtype:
                read_part(region.part, dst)
            else:
                raw = np.empty(part_nbytes(region.part), np.uint8)
                read_part(region.part, raw)
                cast_into(dst.view(numpy_dtype(self.dtype)),
                          raw.view(numpy_dtype(region.source_dtype)))
        if self.padding is not None:
            target[self.padding[0] : self.padding[1]] = 0
        return out


@dataclass(frozen=True)
class EngineLayout:
    """How one engine version holds one model family's KDA layer: a table of parameters.

    Attributes:
        name: stable name, ``"<engine>-<version>-<family>[-variant]"`` (``"vllm-0.33-k3"``).
        engine, version, family: e.g. ``"vllm"``, ``"0.33"``, ``"kimi-k3"`` (see
            :data:`kda_tp.engines.FAMILIES`).
        params: the parameters of one KDA layer (scale grids included).
        source: where the layout comes from (engine file and class), for people checking it.
        tensor_parallel: False when the engine keeps KDA replicated (transformers' TP plan has
            no KDA entries): the layout then holds only at ``tp_size == 1``.
        wrapped_prefix: the engine's name prefix of the decoder layers (up to the layer index)
            for a checkpoint that nests them in a multimodal wrapper (``language_model``); a
            flat checkpoint's are ``model.layers.`` everywhere (see :meth:`state_dict_prefix`).
        mla: the parameters of one of the hybrid's MLA layers as the engine holds them (names
            after ``...layers.{i}.self_attn.`` too), their parts the plan tensors of a
            :class:`~kda_tp.rank.MlaTpPlan`; empty where the layout says nothing of MLA.
        mla_source: where the MLA table comes from (engine file and class).
    """

    name: str
    engine: str
    version: str
    family: str
    params: tuple[EngineParam, ...]
    source: str
    tensor_parallel: bool = True
    wrapped_prefix: str = "language_model.model.layers."
    mla: tuple[EngineParam, ...] = ()
    mla_source: str = ""

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
                    "but the layout has no scale grid for it; pass a layout with FP8 scale "
                    "grids (kda_tp.engines.layouts_for(family, plan) lists those that fit)"
                )

    def follows_model(self, suffix: str, plan: KdaTpPlan) -> bool:
        """Whether the engine casts parameter ``suffix`` to its model dtype for ``plan``'s
        rank: it has no dtype of its own (``EngineParam.dtype`` is None: not the F32
        ``A_log``, ``dt_bias`` or convs, nor a ``CONFIG_DTYPE`` one), is no scale grid,
        and its parts are not block-FP8.

        Raises:
            EngineLayoutError: no such parameter; parts mixing block-FP8 and unquantized.
        """
        param = self.param(suffix)
        return param.dtype is None and param.scale_of is None and not _quantized(param, plan)

    def param_plan(
        self, suffix: str, plan: KdaTpPlan, model_dtype: str | None = None,
        config_dtype: str | None = None
    ) -> EngineParamPlan:
        """Parameter ``suffix`` for ``plan``'s rank: local shape, dtype, part regions, padding.

        Args:
            suffix: the parameter's name after ``self_attn.``.
            plan: one rank's plan (its dtypes are the checkpoint's, as ``from_config`` reads).
            model_dtype: the engine's model dtype (``"BF16"``...) for parameters without a
                fixed dtype; None keeps the checkpoint's (the parts must then share one dtype).
            config_dtype: the dtype the checkpoint's config names, as the engine reads it
                (``kda_tp.engines.dtype.config_dtype``), for a parameter of
                ``CONFIG_DTYPE``; None: the config names none (then ``model_dtype``).

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
        return self._plan_of(param, plan, model_dtype, config_dtype)

    def mla_param(self, suffix: str) -> EngineParam:
        """The MLA parameter named ``suffix`` (after ``self_attn.``; a dump's name, as
        ``EngineParam.dump_suffix``, finds it too).

        Raises:
            EngineLayoutError: the layout has no such MLA parameter (the message lists them).
        """
        for p in self.mla:
            if suffix in (p.suffix, p.dump_suffix):
                return p
        raise EngineLayoutError(
            f"{self.name}: no MLA parameter {suffix!r}; its MLA parameters: "
            f"{sorted(p.suffix for p in self.mla) or 'none (the layout has no MLA table)'}"
        )

    def mla_params_for(self, plan: Any) -> tuple[EngineParam, ...]:
        """The parameters one MLA layer has for ``plan`` (a :class:`~kda_tp.rank.MlaTpPlan`):
        the table's rows, each made of tensors of the plan.

        Raises:
            EngineLayoutError: the layout has no MLA table, or a row is made of a tensor the
                plan lacks (another family's MLA: K3's gate, Kimi-Linear's ``q_proj``).
        """
        if not self.mla:
            raise EngineLayoutError(f"{self.name}: the layout has no MLA table")
        for p in self.mla:
            missing = [part for part in p.parts if plan.get(part) is None]
            if missing:
                raise EngineLayoutError(
                    f"{self.name}: MLA {p.suffix} is made of {', '.join(missing)}, which the "
                    f"MLA plan does not have (plan tensors: {', '.join(plan.names())}; this "
                    f"layout is for {self.family})"
                )
        return self.mla

    def mla_param_plan(self, suffix: str, plan: Any,
                       model_dtype: str | None = None) -> EngineParamPlan:
        """MLA parameter ``suffix`` for ``plan``'s rank (a :class:`~kda_tp.rank.MlaTpPlan`):
        local shape, dtype (``model_dtype``, the engine's; None: the parts' own), part
        regions, as :meth:`param_plan` for a KDA parameter.

        Raises:
            EngineLayoutError: no such MLA parameter, a row the plan cannot make
                (:meth:`mla_params_for`), parts whose trailing shapes or dtypes differ.
        """
        param = self.mla_param(suffix)
        self.mla_params_for(plan)
        return self._plan_of(param, plan, model_dtype, None)

    def _plan_of(self, param: EngineParam, plan: Any, model_dtype: str | None,
                 config_dtype: str | None) -> EngineParamPlan:
        """A parameter's plan (not a scale grid) over ``plan``'s entries (a KDA or MLA plan)."""
        suffix = param.suffix
        entries = [plan[part] for part in param.parts]
        fp8 = _quantized(param, plan)
        dtype = _out_dtype(self.name, param, entries, fp8,
                           config_dtype or model_dtype if param.dtype == CONFIG_DTYPE
                           else model_dtype)
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
    if param.dtype is not None and param.dtype != CONFIG_DTYPE:
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


def mla_unjudged(plan: Any) -> str:
    """Why the engine layouts' MLA tables cannot judge a rank's MLA plan (a
    ``kda_tp.rank.MlaTpPlan``), or ``""``: the one rule the audit, the dumps' expected
    parameters and the guard's first load share. Block-FP8 MLA weights (a tensor of the plan
    with a ``scale`` grid, K3's FP8 release) are planned and sliced per rank, but the MLA tables
    describe no scale-grid parameter, and vLLM 0.33 builds ``W_UK_T`` / ``W_UV`` from the
    dequantized ``kv_b_proj``: judging the FP8 bytes as BF16 parameters would fail an honest
    engine, so such a plan is not judged (said, never passed as judged)."""
    quantized = [t.name for t in plan.tensors if t.scale is not None]
    if not quantized:
        return ""
    return (f"block-FP8 MLA weights ({', '.join(quantized)}) are not judged yet: the engine "
            "layouts' MLA tables describe no scale grids")

