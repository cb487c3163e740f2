"""kda_tp.output."""
