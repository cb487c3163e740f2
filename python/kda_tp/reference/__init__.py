"""The numeric proof: a numpy reference forward of one KDA layer (``forward``) and
the check that a tensor-parallel split still computes it (:func:`check_tp_equivalence`).
"""

from . import equivalence, forward
from .forward import *  # noqa: F403
from .equivalence import *  # noqa: F403

__all__ = forward.__all__ + equivalence.__all__
