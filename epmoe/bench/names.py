"""Names the benchmark commands offer, importable without torch (``--help`` and the parsers)."""

EXPERTS_BACKENDS = ("torch_bf16", "triton_int8_channel", "triton_int8_channel_int32", "triton_int8_block", "triton_bf16")
"""The built-in rows of ``epmoe bench experts``: the BF16 ``torch._grouped_mm`` baseline and the
Triton backend per scheme (``_int32``: the int32 accumulator)."""
