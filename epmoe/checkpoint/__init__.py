"""Checkpoints: the one parser of expert tensor names, per-rank loading into the layer, reading
checkpoint directories and converting FP8 checkpoints to INT8."""
