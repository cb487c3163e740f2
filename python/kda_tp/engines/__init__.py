"""kda_tp.engines."""
