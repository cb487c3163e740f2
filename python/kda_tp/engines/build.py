"""Building a serving engine's fused KDA parameters from one rank's view of a checkpoint.

The view (:class:`~kda_tp.rank.view.KdaShardedSource`, what :func:`kda_tp.open_rank` returns)
gives this rank's slice of every checkpoint tensor; an engine layout (:mod:`kda_tp.engines`)
says how an engine fuses them into its parameters. This module joins the two:
:func:`engine_params` lists the parameters a rank holds, :func:`param_plan` says what one holds
(its shape, dtype and the part regions), :func:`build_param` fills it with the parts' bytes
(:meth:`EngineParamPlan.fill <kda_tp.engines.EngineParamPlan.fill>`). A :class:`RankPlan` is
one rank's plan with every engine parameter plan of a layout, built once per rank and handed
to whoever needs them (the audit, the guard's update target, the dump, the digests).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..checkpoint.names import kda_tensor_name, param_name
from ..errors import CheckpointError, EngineLayoutError
from ..model.quant import SCALE_SUFFIXES
from ..rank.mla import mla_tensor_name
from ..rank.plan import KdaTpPlan
from ..rank.view import KdaShardedSource
from .dtype import config_dtype
from .layout import CONFIG_DTYPE, EngineLayout, EngineParam, EngineParamPlan
from .registry import get_layout

__all__ = ["RankPlan", "build_mla_param", "build_param", "engine_params", "param_plan"]


@dataclass(frozen=True)
class RankPlan:
    """One rank's plan and the plans of every engine parameter it holds in one layout, for one
    model dtype: built once per rank (:meth:`of`) and handed down, never looked up again.

    Attributes:
        plan: the rank's :class:`~kda_tp.KdaTpPlan`.
        layout: the engine layout.
        model_dtype: the engine's model dtype the parameter plans are for (None: the
            checkpoint's).
        prefix: the checkpoint's decoder prefix (``"model.layers."``).
        layers: the KDA layers the rank holds (a pipeline stage's, or every one).
        params: each parameter's plan by its name after ``self_attn.``
            (:meth:`EngineLayout.param_plan <kda_tp.engines.EngineLayout.param_plan>`).
        config_dtype: the dtype the checkpoint's config names, as the layout's engine reads
            it (None: none), for the parameters the engine builds in it.
    """

    plan: KdaTpPlan
    layout: EngineLayout
    model_dtype: str | None
    prefix: str
    layers: tuple[int, ...]
    params: Mapping[str, EngineParamPlan] = field(repr=False)
    config_dtype: str | None = None

    @classmethod
    def of(cls, plan: KdaTpPlan, layout: EngineLayout, model_dtype: str | None, prefix: str,
           layers: tuple[int, ...], config_dtype: str | None = None) -> RankPlan:
        """Every parameter plan of ``layout`` for ``plan``'s rank, each computed once
        (``config_dtype``: the dtype the checkpoint's config names as the layout's engine reads
        it, for a parameter the engine builds in it: ``CONFIG_DTYPE``).

        Raises:
            EngineLayoutError: the layout does not fit the plan.
        """
        return cls(plan, layout, model_dtype, prefix, tuple(layers),
                   {p.suffix: layout.param_plan(p.suffix, plan, model_dtype, config_dtype)
                    for p in layout.params_for(plan)}, config_dtype)

    def param_plan(self, suffix: str, model_dtype: str | None = None) -> EngineParamPlan:
        """Parameter ``suffix``'s plan: the one built for ``model_dtype``, unless
        ``model_dtype`` (a parameter held in another dtype) gives it another dtype, then
        computed for that one.

        Raises:
            EngineLayoutError: no such parameter in the layout.
        """
        found = self.params.get(suffix)
        if found is not None and (model_dtype is None or model_dtype == self.model_dtype
                                  or not self.layout.follows_model(suffix, self.plan)):
            return found
        return self.layout.param_plan(suffix, self.plan, model_dtype, self.config_dtype)


def build_param(
    view: KdaShardedSource,
    layout: str | EngineLayout,
    suffix: str,
    layer: int,
    out: Any = None,
    *,
    model_dtype: str | None = None,
    plan: EngineParamPlan | None = None,
) -> Any:
    """Fill one fused engine parameter of KDA layer ``layer`` for the view's rank, in one call.

    The parameter is described by ``layout`` (:mod:`kda_tp.engines`, e.g.
    ``"vllm-0.33-k3"``, ``"in_proj_qkvgfab.weight"``): each part (this rank's slice of a
    plan tensor, or of its FP8 block-scale grid) is copied with the view's ``read_into``
    straight into its region of the buffer, cast first where the engine casts (e.g. BF16 conv
    weights to F32), and the padding rows are zeroed. The bytes equal what the engine's
    own loader leaves in the parameter.

    Args:
        view: the rank's view of the checkpoint (:func:`kda_tp.open_rank`).
        layout: an :class:`~kda_tp.engines.EngineLayout` or its name.
        suffix: the parameter's name after ``self_attn.``.
        layer: a 0-based KDA layer index (one of ``view.layers``).
        out: None to allocate a new numpy array of the parameter's local shape and dtype;
            or a writable C-contiguous buffer of exactly ``param_plan(...).nbytes`` bytes
            (a numpy array of any shape with item size 1 or the parameter dtype's, a
            ``bytearray``; for a CPU torch parameter ``p.view(-1).view(torch.uint8)
            .numpy()``), every byte of which is overwritten.
        model_dtype: the engine's model dtype for parameters it casts to it (None: the
            checkpoint's dtype; see :meth:`~kda_tp.engines.EngineLayout.param_plan`).
        plan: the parameter's plan when the caller holds it already (a :class:`RankPlan`'s,
            for ``model_dtype``); None: computed here (:func:`param_plan`).

    Returns:
        ``out``, or the new array.

    Raises:
        EngineLayoutError: unknown layout or parameter, a layout that does not fit this
            plan, or ``layer`` is not a KDA layer.
        ShapeMismatchError: ``out`` is not the parameter's size in bytes, or its item size
            is neither 1 nor the parameter dtype's.
        BufferLayoutError: ``out`` is read-only, not C-contiguous, or not a buffer.
    """
    if plan is None:
        plan = param_plan(view, layout, suffix, model_dtype=model_dtype)
    if layer not in view.layers:
        raise EngineLayoutError(
            f"{plan.layout}: {suffix}: layer {layer} is not a KDA layer of this checkpoint "
            f"(KDA layers: {list(view.layers)})"
        )

    def part_nbytes(part: str) -> int:
        entry = view.plan_entry(_part_name(view, layer, part))
        assert entry is not None  # the view plans every part of a KDA layer
        return entry.local_bytes

    return plan.fill(out, lambda part, dst: view.read_into(_part_name(view, layer, part), dst),
                     part_nbytes)


def build_mla_param(
    view: KdaShardedSource,
    layout: str | EngineLayout,
    suffix: str,
    layer: int,
    out: Any = None,
    *,
    model_dtype: str | None = None,
    plan: EngineParamPlan | None = None,
) -> Any:
    """Fill one engine parameter of MLA layer ``layer`` for the view's rank, as
    :func:`build_param` fills a KDA one: each part (this rank's slice of an MLA plan tensor,
    ``view.mla``) copied into its region (``EngineLayout.mla``: vLLM's fused
    ``fused_qkv_a_g_proj`` = ``q_a_proj`` ‖ ``kv_a_proj_with_mqa`` whole ‖ this rank's
    ``g_proj`` rows, SGLang's ``fused_qkv_a_proj_with_mqa``, ...), cast to ``model_dtype``
    (None: the checkpoint's).

    Args:
        view: the rank's view with its MLA layers sliced (``kda_tp.open_rank(..., mla=True)``).
        layout: an :class:`~kda_tp.engines.EngineLayout` or its name.
        suffix: the MLA parameter's name after ``self_attn.``.
        layer: a 0-based MLA layer (one of ``view.mla_layers``).
        out: as :func:`build_param`'s.
        model_dtype: the engine's model dtype (None: the checkpoint's).
        plan: the parameter's plan when the caller holds it (for ``model_dtype``).

    Returns:
        ``out``, or the new array.

    Raises:
        EngineLayoutError: unknown layout or MLA parameter, a view without MLA slicing, a
            layout whose MLA table does not fit the plan, or ``layer`` is not an MLA layer.
        ShapeMismatchError, BufferLayoutError: ``out`` as :func:`build_param`'s.
    """
    if view.mla is None:
        raise EngineLayoutError(
            f"{suffix}: the view does not slice MLA layers; open it with "
            "kda_tp.open_rank(..., mla=True)"
        )
    if plan is None:
        plan = get_layout(layout).mla_param_plan(suffix, view.mla, model_dtype)
    if layer not in view.mla_layers:
        raise EngineLayoutError(
            f"{plan.layout}: {suffix}: layer {layer} is not an MLA layer of this checkpoint "
            f"(MLA layers: {list(view.mla_layers)})"
        )

    def name(part: str) -> str:
        return mla_tensor_name(view.prefix, layer, part)

    def part_nbytes(part: str) -> int:
        entry = view.plan_entry(name(part))
        assert entry is not None  # the view plans every tensor of an MLA layer
        return entry.local_bytes

    return plan.fill(out, lambda part, dst: view.read_into(name(part), dst), part_nbytes)


def engine_params(view: KdaShardedSource,
                  layout: str | EngineLayout) -> list[tuple[int, EngineParam]]:
    """Every engine parameter the view's rank holds for the KDA layers: ``(layer,
    parameter)`` for each KDA layer (``view.layers``, in order) and each parameter of
    ``layout`` for its plan (:meth:`EngineLayout.params_for
    <kda_tp.engines.EngineLayout.params_for>`: scale grids only where the weights are
    block-FP8), in the layout's order.

    This is the list ``kda_tp.audit.audit`` checks, ``kda_tp.audit.write_engine_dump`` writes
    and ``kda_tp.audit.engine_digests`` hashes; the parameter's name in the engine is
    ``kda_tp.engines.param_name(layout.state_dict_prefix(view.prefix), layer,
    param.suffix)``, its bytes :func:`build_param`.

    Raises:
        EngineLayoutError: an unknown layout, or one that does not fit this plan.
    """
    params = get_layout(layout).params_for(view.plan)
    return [(layer, param) for layer in view.layers for param in params]


def param_plan(view: KdaShardedSource, layout: str | EngineLayout, suffix: str, *,
               model_dtype: str | None = None) -> EngineParamPlan:
    """:meth:`EngineLayout.param_plan <kda_tp.engines.EngineLayout.param_plan>` for the view's
    plan: the parameter's local shape, dtype and part regions (each call computes it: hold a
    :class:`RankPlan` to compute every parameter's once per rank).

    Raises:
        EngineLayoutError: as there.
    """
    chosen = get_layout(layout)
    named = None
    if chosen.param(suffix).dtype == CONFIG_DTYPE:  # the config read only for such a parameter
        try:
            named = config_dtype(view.description.config, chosen.engine)
        except CheckpointError:  # a trainer's tensors without a config: the model dtype
            named = None
    return chosen.param_plan(suffix, view.plan, model_dtype, named)


def _part_name(view: KdaShardedSource, layer: int, part: str) -> str:
    """The checkpoint name of a part (``"q_proj"``, or ``"q_proj.scale"``: its block scale
    grid under whichever spelling the checkpoint uses) in KDA layer ``layer``."""
    if not part.endswith(".scale"):
        return kda_tensor_name(view.prefix, layer, part)
    weight = part.removesuffix(".scale")
    # The view checked that every quantized weight has exactly one of the spellings.
    spellings = (param_name(view.prefix, layer, f"{weight}.{s}") for s in SCALE_SUFFIXES)
    return next(name for name in spellings if view.is_sharded(name))
