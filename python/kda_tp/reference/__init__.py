"""kda_tp.reference."""
