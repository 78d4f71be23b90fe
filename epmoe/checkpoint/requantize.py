"""One FP8-block weight to INT8: dequantize to BF16, quantize again (per channel or per 128x128
block), as the public channel-wise and block-wise INT8 DeepSeek-R1 checkpoints were made, with the
project's one rounding rule (:mod:`epmoe.quant.reference`)."""

from __future__ import annotations

import torch

from ..quant.reference import dequantize_weight, quantize_weight
from ..quant.schemes import BLOCK, SCHEMES
from .formats import TARGET_SCALE_SUFFIX, TARGETS



# Rows converted at once: a multiple of BLOCK (so blocks never straddle two chunks) that keeps the
# fp32 temporaries of an 18432 x 7168 dense weight at ~30 MB instead of ~2 GB.
_CHUNK_ROWS = 8 * BLOCK


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_target(target: str) -> None:
    if target not in TARGETS:
        raise ValueError(f"target={target!r} is not a conversion target; allowed: {list(TARGETS)}")


def _check_fp8_pair(name: str, weight: torch.Tensor, scale_inv: torch.Tensor) -> None:
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(
            f"{name}: dtype {weight.dtype} (shape {tuple(weight.shape)}); expected torch.float8_e4m3fn"
        )
    if weight.dim() != 2:
        raise ValueError(f"{name}: shape {tuple(weight.shape)}; expected a 2-D [N, K] weight")
    n, k = weight.shape
    want = (cdiv(n, BLOCK), cdiv(k, BLOCK))
    if tuple(scale_inv.shape) != want:
        raise ValueError(
            f"{name}_scale_inv: shape {tuple(scale_inv.shape)}; expected {list(want)} = "
            f"[ceil({n}/{BLOCK}), ceil({k}/{BLOCK})] for a [{n}, {k}] weight"
        )
    if scale_inv.dtype != torch.float32:
        raise ValueError(f"{name}_scale_inv: dtype {scale_inv.dtype}; expected torch.float32")
    if not bool(torch.isfinite(scale_inv).all()):
        bad = (~torch.isfinite(scale_inv)).nonzero()[0].tolist()
        raise ValueError(
            f"{name}_scale_inv: non-finite value {scale_inv[tuple(bad)].item()} at block {bad}; "
            "every block scale must be finite"
        )


def dequantize_fp8_block(weight_fp8: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """``weight_fp8 * scale_inv`` (each scale covering a 128x128 block) in fp32, cast to bf16.

    The cast to bf16 is deliberate: it is what DeepSeek's own FP8->BF16 script and the public INT8
    conversions did, so converted weights match theirs bit for bit under the same rounding rule.
    """
    _check_fp8_pair("weight", weight_fp8, scale_inv)
    return dequantize_weight(weight_fp8.unsqueeze(0), scale_inv.unsqueeze(0))[0].to(torch.bfloat16)


def convert_tensor(
    weight_fp8: torch.Tensor, scale_inv: torch.Tensor, target: str, *, name: str = "weight"
) -> dict[str, torch.Tensor]:
    """Convert one FP8-block weight to ``target``: dequantize to BF16, quantize to INT8.

    Args:
        weight_fp8: ``[N, K]`` ``torch.float8_e4m3fn``.
        scale_inv: ``[ceil(N/128), ceil(K/128)]`` fp32 block multipliers (``w = q * scale_inv``).
        target: ``"int8_channel"`` or ``"int8_block"``.
        name: the tensor's name, used in error messages.

    Returns:
        ``{"weight": int8 [N, K], "weight_scale": fp32 [N, 1]}`` for ``int8_channel`` or
        ``{"weight": int8 [N, K], "weight_scale_inv": fp32 [ceil(N/128), ceil(K/128)]}`` for
        ``int8_block``; the keys are the suffixes that replace ``weight`` in the tensor name.

    Raises:
        ValueError: wrong dtype, rank or scale shape, non-finite scales, or a NaN weight.
    """
    check_target(target)
    _check_fp8_pair(name, weight_fp8, scale_inv)
    scheme = SCHEMES[target]
    n, k = weight_fp8.shape
    q = torch.empty((n, k), dtype=torch.int8)
    if target == "int8_channel":
        scale = torch.empty((n, 1), dtype=torch.float32)
    else:
        scale = torch.empty((cdiv(n, BLOCK), cdiv(k, BLOCK)), dtype=torch.float32)
    for r0 in range(0, n, _CHUNK_ROWS):
        r1 = min(n, r0 + _CHUNK_ROWS)
        b0, b1 = r0 // BLOCK, cdiv(r1, BLOCK)
        w = dequantize_weight(weight_fp8[r0:r1].unsqueeze(0), scale_inv[b0:b1].unsqueeze(0))
        w = w.to(torch.bfloat16)
        if not bool(torch.isfinite(w).all()):
            # e4m3fn has NaN encodings; one would silently poison a whole channel or block scale.
            bad = (~torch.isfinite(w[0])).nonzero()[0].tolist()
            raise ValueError(f"{name}: non-finite weight at [{r0 + bad[0]}, {bad[1]}]")
        qc, sc = quantize_weight(w, scheme)
        q[r0:r1] = qc[0]
        if target == "int8_channel":
            scale[r0:r1] = sc[0]
        else:
            scale[b0:b1] = sc[0]
    return {"weight": q, TARGET_SCALE_SUFFIX[target]: scale}

