"""One tensor-parallel rank: its shard plan (:class:`KdaTpPlan`, arithmetic on a
checkpoint's description; :class:`MlaTpPlan` for the hybrids' MLA layers) and its view of a checkpoint (:func:`open_rank`,
:class:`KdaShardedSource`).
"""

from .mla import MlaTpPlan
from .plan import KdaShard, KdaTensorPlan, KdaTpPlan
from .view import KdaShardedSource, open_rank

__all__ = [
    "KdaTpPlan",
    "MlaTpPlan",
    "KdaTensorPlan",
    "KdaShard",
    "KdaShardedSource",
    "open_rank",
]
