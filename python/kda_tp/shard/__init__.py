"""Rank checkpoints: the writer (:func:`shard_checkpoint`), what a rank directory
holds and their verification (:func:`verify_shards`); the same as torchrun jobs are
``kda_tp.shard.torchrun`` and, needing torch, ``kda_tp.shard.distributed``.
"""

from . import rankdir, verify, writer
from .writer import *  # noqa: F403
from .verify import *  # noqa: F403
from .rankdir import *  # noqa: F403

# Imported from here too, where they always were: a rank directory's name, the output check and
# the writer's interruption.
from ..errors import ShardInterrupted
from ..output.dirs import prepare_out_dir
from ..output.names import rank_dir

__all__ = (writer.__all__
           + verify.__all__
           + rankdir.__all__
           + ["ShardInterrupted", "prepare_out_dir", "rank_dir"])
