"""kda_tp.checkpoint."""
