"""Rank checkpoints: the writer (:func:`shard_checkpoint`), what a rank directory
holds (:func:`rank_dir`, :func:`rank_dir_metadata`) and their verification
(:func:`verify_shards`); the same as torchrun jobs are ``kda_tp.shard.torchrun`` and, needing
torch, ``kda_tp.shard.distributed``.
"""

from ..output.names import rank_dir
from .rankdir import finish_command, rank_dir_metadata
from .verify import ProgressFactory, VerifyReport, verify_shards
from .writer import ShardResult, ShardSizes, check_shard_input, shard_checkpoint, shard_sizes

__all__ = [
    "shard_checkpoint",
    "shard_sizes",
    "check_shard_input",
    "ShardResult",
    "ShardSizes",
    "verify_shards",
    "VerifyReport",
    "ProgressFactory",
    "rank_dir_metadata",
    "finish_command",
    "rank_dir",
]

