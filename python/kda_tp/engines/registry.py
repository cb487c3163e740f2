"""Serving engines' fused KDA parameters, as data: one table per engine version and model family.

Engines do not hold the 14-15 KDA tensors of a checkpoint as they are stored: vLLM fuses
q/k/v/g/f_a/b into one ``in_proj_qkvgfab`` with zero rows after it, SGLang stacks ``f_b`` and
``g_b`` into ``fused_fg_b_proj``, the three short-conv weights become one ``conv1d``, ``A_log``
takes another shape and F32. Each :class:`EngineLayout` lists, for every parameter of one KDA
layer as the engine holds it (its name under ``...layers.{i}.self_attn.``), the plan tensors it
is made of, in order, how they are joined, the padding, the on-device shape and the dtype the
engine casts to. Adding an engine version is adding a table to
``kda_tp.engines._tables.TABLES`` (all of them by name here: :data:`LAYOUTS`); nothing else
branches on the engine. The machinery (``EngineLayout``, ``EngineParam``, ``EngineParamPlan``,
``Region``) is :mod:`kda_tp.engines.layout`'s.

For one rank's :class:`~kda_tp.KdaTpPlan`, ``EngineLayout.param_plan`` gives the parameter's
local shape and dtype and where each part lands (``Region``); :func:`kda_tp.engines.build_param`
fills such a parameter from a rank's view of a checkpoint in one call, and ``kda_tp.audit`` uses
the same regions to say what a dumped parameter holds.

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

from collections.abc import Iterable, Mapping
from types import MappingProxyType

from ..errors import EngineLayoutError
from ..model import families
from ..rank.plan import KdaTpPlan
from ._tables import TABLES
from .layout import EngineLayout

__all__ = ["FAMILIES", "LAYOUTS", "get_layout", "kda_only_suffixes", "layouts_for", "recognise"]

#: Model families a layout is written for (the names of :data:`kda_tp.model.FAMILIES`):
#: Kimi-Linear and GLM-5.3-Flash (low-rank gate; GLM's config is transformers' ``glm5_next``),
#: Kimi K3 (full-rank output gate).
FAMILIES = tuple(families.FAMILIES)


#: Every layout by its stable name (read-only).
LAYOUTS: Mapping[str, EngineLayout] = MappingProxyType({t.name: t for t in TABLES})


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


def layouts_for(family: str | None = None, plan: KdaTpPlan | None = None) -> list[EngineLayout]:
    """The layouts that can hold a model: of ``family`` (one of :data:`FAMILIES`, e.g. a
    checkpoint's ``CheckpointDescription.family.name``), and, with ``plan``, those that fit it
    (:meth:`EngineLayout.check_plan`: output-gate form, block-FP8 scale grids, tensor
    parallelism).

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


def recognise(suffixes: Iterable[str], family: str | None = None) -> list[EngineLayout]:
    """The layouts a set of parameter names fits best; several mean the names cannot tell.

    A layout fits when it knows every name (``suffixes``: names after
    ``...layers.{i}.self_attn.`` of a KDA layer, scale grids included); of those, the ones
    lacking the fewest of their always-present parameters are returned (so a dump missing a
    parameter is still recognised, and the caller reports what it lacks). Empty when no layout
    knows all the names.

    Args:
        suffixes: parameter names of one KDA layer (or the union over layers).
        family: keep only layouts of this family (e.g. the checkpoint's
            ``CheckpointDescription.family.name``): SGLang holds Kimi-Linear and GLM-5.3 under
            the same names.

    Raises:
        EngineLayoutError: ``family`` is not one of :data:`FAMILIES`.
    """
    names = set(suffixes)
    fitting = [lay for lay in layouts_for(family) if names <= lay.suffixes]
    if not fitting:
        return []
    fewest = min(len(lay.required - names) for lay in fitting)
    return [lay for lay in fitting if len(lay.required - names) == fewest]
