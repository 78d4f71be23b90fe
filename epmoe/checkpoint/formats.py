"""Facts about checkpoint directories and the formats the converter writes (no torch needed)."""

from __future__ import annotations

INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE_NAME = "model.safetensors"  # what save_pretrained writes when one shard suffices
CONFIG_NAME = "config.json"

TARGETS = ("int8_channel", "int8_block")
"""The schemes a checkpoint converts to."""

TARGET_SCALE_SUFFIX = {"int8_channel": "weight_scale", "int8_block": "weight_scale_inv"}
"""The name each target gives the scale of ``W.weight`` (``W.weight_scale`` / ``W.weight_scale_inv``)."""

TARGET_QUANT_CONFIG = {
    "int8_channel": {"quant_method": "w8a8_int8", "activation_scheme": "dynamic"},
    "int8_block": {
        "quant_method": "blockwise_int8",
        "weight_block_size": [128, 128],
        "activation_scheme": "dynamic",
    },
}
"""The ``quantization_config`` of a converted checkpoint, as the public INT8 DeepSeek-R1 ones have it."""

QUANT_METHOD_SCHEME = {"fp8": "fp8_block", "w8a8_int8": "int8_channel", "blockwise_int8": "int8_block"}
"""``quantization_config.quant_method`` -> the epmoe scheme of the expert weights."""

SCALE_SUFFIX = {"fp8_block": "weight_scale_inv", **TARGET_SCALE_SUFFIX}
"""The scale name each quantized checkpoint scheme stores with every weight."""
