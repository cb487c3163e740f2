"""Building a serving engine's fused KDA parameters from one rank's view of a checkpoint.

The view (:class:`~kda_tp.rank.view.KdaShardedSource`, what :func:`kda_tp.open_rank` returns)
gives this rank's slice of every checkpoint tensor; an engine layout (:mod:`kda_tp.engines`)
says how an engine fuses them into its parameters. This module joins the two:
:func:`engine_params` lists the parameters a rank holds, :func:`param_plan` says what one holds
(its shape, dtype and the part regions, computed once per view), :func:`build_param` fills it
with the parts' bytes (:meth:`EngineParamPlan.fill <kda_tp.engines.EngineParamPlan.fill>`).
"""

from __future__ import annotations

import weakref
from typing import Any

from ..checkpoint.names import kda_tensor_name, param_name
from ..errors import EngineLayoutError
from ..model.quant import SCALE_SUFFIXES
from ..rank.view import KdaShardedSource
from .layout import EngineLayout, EngineParam, EngineParamPlan
from .registry import get_layout

__all__ = ["build_param", "engine_params", "param_plan"]

# One view's parameter plans, by (layout, parameter, model dtype): the same arithmetic for
# every layer, done once per view (and dropped with it).
_PLANS: weakref.WeakKeyDictionary[
    KdaShardedSource, dict[tuple[EngineLayout, str, str | None], EngineParamPlan]
] = weakref.WeakKeyDictionary()


def build_param(
    view: KdaShardedSource,
    layout: str | EngineLayout,
    suffix: str,
    layer: int,
    out: Any = None,
    *,
    model_dtype: str | None = None,
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

    Returns:
        ``out``, or the new array.

    Raises:
        EngineLayoutError: unknown layout or parameter, a layout that does not fit this
            plan, or ``layer`` is not a KDA layer.
        ShapeMismatchError: ``out`` is not the parameter's size in bytes, or its item size
            is neither 1 nor the parameter dtype's.
        BufferLayoutError: ``out`` is read-only, not C-contiguous, or not a buffer.
    """
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
    plan: the parameter's local shape, dtype and part regions (computed once per view).

    Raises:
        EngineLayoutError: as there.
    """
    table = get_layout(layout)
    key = (table, suffix, model_dtype)
    plans = _PLANS.setdefault(view, {})
    found = plans.get(key)
    if found is None:  # the same arithmetic for every layer: once per view
        found = plans[key] = table.param_plan(suffix, view.plan, model_dtype)
    return found


def _part_name(view: KdaShardedSource, layer: int, part: str) -> str:
    """The checkpoint name of a part (``"q_proj"``, or ``"q_proj.scale"``: its block scale
    grid under whichever spelling the checkpoint uses) in KDA layer ``layer``."""
    if not part.endswith(".scale"):
        return kda_tensor_name(view.prefix, layer, part)
    weight = part.removesuffix(".scale")
    # The view checked that every quantized weight has exactly one of the spellings.
    spellings = (param_name(view.prefix, layer, f"{weight}.{s}") for s in SCALE_SUFFIXES)
    return next(name for name in spellings if view.is_sharded(name))
