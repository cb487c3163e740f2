"""kda_tp.guard."""
