"""kda_tp.cli."""
