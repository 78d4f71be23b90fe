"""Independent float64 references for the tests.

Nothing here calls the package's quantizers: quantization is re-derived in float64 from its
definition (symmetric amax scaling, round half to even, clamp; e4m3 by explicit exponent/mantissa
rounding), so a bug in the package's rounding shows up as a mismatch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

QMAX = {"int8": 127.0, "fp8": 448.0}


def round_half_even(x: torch.Tensor) -> torch.Tensor:
    r = torch.floor(x + 0.5)
    tie = (r - x) == 0.5
    odd = torch.remainder(r, 2) == 1
    return torch.where(tie & odd, r - 1, r)


def round_e4m3(v: torch.Tensor) -> torch.Tensor:
    """Round float64 values to the nearest e4m3 (fn) value, ties to even, saturating at 448."""
    a = v.abs().clamp(max=448.0)
    exp = torch.floor(torch.log2(a.clamp(min=2.0**-9))).clamp(min=-6.0)  # subnormals below 2^-6
    step = torch.pow(2.0, exp - 3)
    q = round_half_even(a / step) * step
    return torch.sign(v) * q.clamp(max=448.0)


def fake_quant(x: torch.Tensor, kind: str, group: int | None) -> torch.Tensor:
    """Quantize-dequantize ``x [..., K]`` in float64 per row or per 1 x ``group``."""
    x = x.double()
    k = x.shape[-1]
    g = k if group is None else group
    xg = x.reshape(*x.shape[:-1], k // g, g)
    qmax = QMAX[kind]
    scale = xg.abs().amax(-1, keepdim=True).clamp(min=1e-10) / qmax
    y = xg / scale
    q = round_half_even(y).clamp(-qmax, qmax) if kind == "int8" else round_e4m3(y)
    return (q * scale).reshape(x.shape)


def fake_quant_weight(w: torch.Tensor, kind: str, granularity: str) -> torch.Tensor:
    """Quantize-dequantize ``[E, N, K]`` weights per output channel or per 128x128 block."""
    w = w.double()
    if granularity == "channel":
        return fake_quant(w, kind, None)
    e, n, k = w.shape
    assert n % 128 == 0 and k % 128 == 0
    blocks = w.reshape(e, n // 128, 128, k // 128, 128).permute(0, 1, 3, 2, 4).reshape(e, n // 128, k // 128, -1)
    fq = fake_quant(blocks, kind, None)
    return fq.reshape(e, n // 128, k // 128, 128, 128).permute(0, 1, 3, 2, 4).reshape(e, n, k)


SCHEME_FORMAT = {
    # scheme: (kind, weight granularity, activation group) ; None kind = unquantized
    "bf16": (None, None, None),
    "int8_channel": ("int8", "channel", None),
    "int8_block": ("int8", "block", 128),
    "fp8_block": ("fp8", "block", 128),
}


def moe_reference(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    scheme: str | None = None,
) -> torch.Tensor:
    """float64 MoE: ``sum_j w[t,j] * W2[e] . silu_and_mul(W13[e] . x[t])`` over global experts.

    ``w13 [E, 2I, H]`` and ``w2 [E, H, I]`` are float weights (already dequantized when the
    scheme quantizes weights). With ``scheme`` set, activations are fake-quantized as the scheme
    does (x before GEMM1, the SiLU*up output before GEMM2); with ``None`` the math is exact.
    """
    kind, _, group = SCHEME_FORMAT[scheme] if scheme else (None, None, None)
    xd = x.double()
    if kind:
        xd = fake_quant(xd, kind, group)
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for e in torch.unique(topk_ids).tolist():
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        h = xd[tok] @ w13[e].double().t()
        g, u = h.chunk(2, dim=-1)
        a = F.silu(g) * u
        if kind:
            a = fake_quant(a, kind, group)
        out.index_add_(0, tok, (a @ w2[e].double().t()) * topk_weights[tok, slot].double().unsqueeze(1))
    return out


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return float((out.double() - ref).norm() / ref.norm().clamp(min=1e-30))


def gather_reference(expert_out: torch.Tensor, slot_pos: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
    """Per token, the sum over its valid slots (``slot_pos >= 0``) of ``expert_out[pos] * weight``,
    in float64, one term at a time (rows of invalid slots are never read)."""
    r, k = slot_pos.shape
    out = torch.zeros(r, expert_out.shape[1], dtype=torch.float64)
    for t in range(r):
        for j in range(k):
            p = int(slot_pos[t, j])
            if p >= 0:
                out[t] += expert_out[p].double() * float(topk_weights[t, j])
    return out
