"""The numeric proof: a numpy reference forward of one KDA layer (``forward``) and
the check that a tensor-parallel split still computes it (:func:`check_tp_equivalence`).
"""

from .equivalence import (
    DEFAULT_ATOL,
    DEFAULT_RTOL,
    EquivalenceReport,
    LayerEquivalence,
    check_tp_equivalence,
    compare_outputs,
    layers_to_check,
)
from .forward import (
    L2NORM_EPS,
    WEIGHT_NAMES,
    checkpoint_layer_forward,
    kda_layer_forward,
    layer_weights,
    source_layer_forward,
)

__all__ = [
    "check_tp_equivalence",
    "EquivalenceReport",
    "LayerEquivalence",
    "compare_outputs",
    "layers_to_check",
    "DEFAULT_ATOL",
    "DEFAULT_RTOL",
    "kda_layer_forward",
    "checkpoint_layer_forward",
    "source_layer_forward",
    "layer_weights",
    "WEIGHT_NAMES",
    "L2NORM_EPS",
]
