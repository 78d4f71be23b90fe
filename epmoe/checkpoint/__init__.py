"""Checkpoints: the one parser of expert tensor names (:mod:`.names`), per-rank loading into the
layer (:mod:`.loading`), reading checkpoint directories (:mod:`.reading`), converting FP8
checkpoints to INT8 (:mod:`.convert`) and a synthetic checkpoint to try them on (:mod:`.synthetic`).

The names below are imported on first use, so ``import epmoe.checkpoint`` (and the CLI's ``--help``)
does not import torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "iter_expert_weights": "reading",
    "layer_kwargs_from_config": "reading",
    "checkpoint_scheme": "reading",
    "expert_ids": "reading",
    "convert_checkpoint": "convert",
    "ConversionResult": "convert",
    "plan_conversion": "plan",
    "convert_tensor": "requantize",
    "dequantize_fp8_block": "requantize",
    "write_synthetic_checkpoint": "synthetic",
    "write_safetensors": "files",
    "parse_expert_name": "names",
    "TARGETS": "formats",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'epmoe.checkpoint' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
