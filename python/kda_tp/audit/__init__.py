"""kda_tp.audit."""
