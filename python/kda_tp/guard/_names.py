"""Which parameter names are a KDA layer's: the guard's cheap tests, one pass over the names
and no I/O, run before anything is read.

This module imports no engine.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from ..checkpoint.names import param_location
from ..engines.derived import DERIVED
from ..engines.registry import kda_only_suffixes

__all__ = ["holds_kda", "looks_kda", "names_mla", "stage_layers"]

# Parameter names only a KDA layer has (every engine layout holds A_log and dt_bias; other
# linear-attention layers such as Qwen3-Next's hold theirs under `linear_attn.`).
_MARKERS = (".A_log", ".dt_bias")

# Names only a KDA layer has (any engine layout, and the derived copies): a model holding
# some under `.self_attn.` without the markers is a KDA model whose markers are missing.
_KDA_LOOKING = tuple(f".{end}" for end in sorted(kda_only_suffixes()) if f".{end}" not in _MARKERS
                     ) + tuple(f".{copy}" for copies in DERIVED.values() for copy in copies)

# Checkpoint modules only a hybrid's MLA layer has (``kda_tp.rank.mla.MlaTpPlan``'s tensors
# but q_proj, g_proj and o_proj, which a KDA layer has too).
_MLA_ONLY = frozenset({"q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa",
                       "kv_a_layernorm", "kv_b_proj", "indexer"})


def names_mla(name: str) -> bool:
    """Whether a parameter name is of a hybrid's MLA layer (``...self_attn.kv_b_proj.weight``
    and the other modules only an MLA layer has, any prefix)."""
    location = param_location(name)
    return location is not None and location[2].split(".", 1)[0] in _MLA_ONLY


def holds_kda(names: Iterable[str]) -> bool:
    """Whether parameter names include a KDA layer's (``...self_attn.A_log`` or
    ``...self_attn.dt_bias``, any prefix): the cheap test :func:`kda_tp.guard.check` skips on,
    for plugins that must decide before they know the checkpoint. One pass over the names, no
    I/O; a name that is not a ``str`` is no KDA name."""
    return _any_ending(names, _MARKERS)


def looks_kda(names: Iterable[Any]) -> bool:
    """Whether names include a KDA layer's: ``holds_kda``'s markers or other names only a
    KDA layer has (its gate projections, ``o_norm``, its fused projections or convs, under
    ``.self_attn.``). True with ``holds_kda`` false is a KDA model whose ``A_log`` and
    ``dt_bias`` are missing, which :func:`kda_tp.guard.check` skips with a warning. One pass
    over the names, no I/O."""
    return _any_ending(names, _MARKERS + _KDA_LOOKING)


def _any_ending(names: Iterable[Any], ends: tuple[str, ...]) -> bool:
    names = list(names) if not isinstance(names, Mapping | list | tuple) else names
    try:  # the fast path: every name a str
        return any(n.endswith(ends) and ".self_attn." in n for n in names)
    except (AttributeError, TypeError):
        return any(isinstance(n, str) and n.endswith(ends) and ".self_attn." in n
                   for n in names)


def stage_layers(names: Iterable[Any]) -> list[int]:
    """The decoder layers whose KDA parameters ``names`` hold: every layer with a KDA name
    (:func:`looks_kda`'s, not only ``A_log`` / ``dt_bias``), so that a layer whose markers are
    missing is checked, and reported missing, instead of dropped."""
    return sorted({loc[1] for n in names
                   if isinstance(n, str) and looks_kda([n]) and (loc := param_location(n))})
