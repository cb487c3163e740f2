"""kda_tp.shard."""
