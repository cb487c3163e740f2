"""Serving engines' fused KDA parameters: the layouts as tables (one per engine
version and model family), the machinery that places a rank's slices in them
(:class:`EngineLayout`, :class:`EngineParamPlan`), building a parameter from a rank's view
(:func:`build_param`), the copies an engine derives from its parameters (:data:`DERIVED`) and
the engine's model dtype rule (:func:`engine_model_dtype`).
"""

from . import build, derived, dtype, layout, registry, tables
from .registry import *  # noqa: F403
from .layout import *  # noqa: F403
from .build import *  # noqa: F403
from .derived import *  # noqa: F403
from .dtype import *  # noqa: F403
from .tables import *  # noqa: F403

__all__ = (registry.__all__
           + layout.__all__
           + build.__all__
           + derived.__all__
           + dtype.__all__
           + tables.__all__)
