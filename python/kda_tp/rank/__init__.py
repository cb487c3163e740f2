"""kda_tp.rank."""
