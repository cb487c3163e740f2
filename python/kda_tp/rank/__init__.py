"""One tensor-parallel rank: its shard plan (:class:`KdaTpPlan`, arithmetic on a
checkpoint's description) and its view of a checkpoint (:func:`open_rank`,
:class:`KdaShardedSource`).
"""

from . import plan, view
from .plan import *  # noqa: F403
from .view import *  # noqa: F403

__all__ = plan.__all__ + view.__all__
