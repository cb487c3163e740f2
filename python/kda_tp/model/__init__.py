"""kda_tp.model."""
