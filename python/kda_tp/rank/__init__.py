"""One tensor-parallel rank: its shard plan (:class:`KdaTpPlan`, arithmetic on a
checkpoint's description) and its view of a checkpoint (:func:`open_rank`,
:class:`KdaShardedSource`).
"""

from .plan import KdaShard, KdaTensorPlan, KdaTpPlan
from .view import KdaShardedSource, open_rank

__all__ = [
    "KdaTpPlan",
    "KdaTensorPlan",
    "KdaShard",
    "KdaShardedSource",
    "open_rank",
]
