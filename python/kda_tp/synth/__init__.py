"""kda_tp.synth."""
