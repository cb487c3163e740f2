"""Serving engines' fused KDA parameters: the layouts as tables (one per engine
version and model family, :data:`LAYOUTS`), the machinery that places a rank's slices in them
(:class:`EngineLayout`, :class:`EngineParamPlan`), building a parameter from a rank's view
(:func:`build_param`) and a rank's plans once (:class:`RankPlan`), the copies an engine derives
from its parameters (:data:`DERIVED`) and the engine's model dtype rule
(:func:`engine_model_dtype`).

The face lists what a user may touch; the modules' other names are plumbing of the rooms above
(``derived.derived_copies``, the guard's), and the tables themselves are in-room data
(``_tables``).
"""

from .build import RankPlan, build_param, engine_params, param_plan
from .derived import DERIVED
from .dtype import config_model_dtype, engine_model_dtype, model_dtype_name
from .layout import EngineLayout, EngineParam, EngineParamPlan, Region
from .registry import FAMILIES, LAYOUTS, get_layout, kda_only_suffixes, layouts_for, recognise

__all__ = [
    "LAYOUTS",
    "FAMILIES",
    "get_layout",
    "layouts_for",
    "recognise",
    "kda_only_suffixes",
    "EngineLayout",
    "EngineParam",
    "EngineParamPlan",
    "Region",
    "build_param",
    "engine_params",
    "param_plan",
    "RankPlan",
    "DERIVED",
    "engine_model_dtype",
    "config_model_dtype",
    "model_dtype_name",
]
