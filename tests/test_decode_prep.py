"""The decode prep (epmoe.kernels.prep, epmoe::decode_prep): one launch of routing, layout, scatter
and activation quantization, under Triton's interpreter.

Against an independent float64 / float32 reference of all four (routing from test_routing's
transcription of DeepSeek's gate, the layout from its definition, codes re-derived from the
rounding rule), against the separate kernels it replaces (bit for bit), and inside the layer
(with and without it, eager and compiled in one graph).
"""

from __future__ import annotations

import pytest
import torch

from epmoe import DeepEPMoELayer, ops
from epmoe.kernels import permute, prep, quantize, topk
from epmoe.kernels.common import COPY_MAX_SLOTS, max_rows, prep_refusal
from helpers import make_weights
from reference import round_e4m3, round_half_even
from test_routing import _tied_inputs, reference_route

ROUTES = {
    # name: (E, top_k, scoring, num_expert_group, topk_group, bias, renormalize, routed_scaling_factor)
    "E256_grouped": (256, 8, "sigmoid", 8, 4, True, True, 2.5),  # DeepSeek-V3's gate
    "E128_flat": (128, 8, "softmax", None, None, False, False, 1.0),
    # Tied scores (test_routing's grid of logits and bias levels), grouped, k no power of two.
    "E64_grouped_tied": (64, 6, "sigmoid", 8, 3, True, True, 2.5),
}
PAYLOADS = {
    # payload: (alignment, scale_mn_major): the layouts the backends ask for
    "float": (1, False),
    "int8_token": (1, False),
    "int8_group": (4, False),
    "fp8_group": (128, True),  # CUTLASS FP8: 128-row segments, MN-major scales
}
HIDDEN = 256


def _inputs(t: int, route: str, seed: int, dtype=torch.bfloat16, hidden: int = HIDDEN):
    e = ROUTES[route][0]
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, e, generator=g) * 2
    bias = torch.randn(e, generator=g) * 0.1 if ROUTES[route][5] else None
    if route.endswith("_tied"):
        logits, bias = _tied_inputs(t, e, seed)
    x = (torch.randn(t, hidden, generator=g) * torch.rand(t, 1, generator=g) * 4).to(dtype)
    x[0, :128] = 0  # an all-zero group (the amax floor) in the first token
    return logits, bias, x


def _run(logits, bias, x, route, payload, device="cpu"):
    """The prep on ``device``."""
    e, k, scoring, ng, tg, _, renorm, scale = ROUTES[route]
    alignment, mn_major = PAYLOADS[payload]
    bias = None if bias is None else bias.to(device)
    return prep.decode_prep(logits.to(device), k, renorm, scoring, ng, tg, bias, scale, x.to(device), alignment,
                            payload, mn_major)  # fmt: skip


def _cpu(tensors):
    return [None if t is None else t.cpu() for t in tensors]


def _codes_reference(x: torch.Tensor, payload: str):
    """``(codes as float64, scales fp32 [T, S])``: scale = fp32(max(amax, 1e-10) / qmax), the
    quotient x / scale correctly rounded to fp32, then rounded half to even (int8, clamped) or to
    the nearest e4m3 value."""
    xf = x.float()
    group = xf.shape[1] if payload == "int8_token" else 128
    xg = xf.reshape(xf.shape[0], -1, group)
    qmax = 448.0 if payload == "fp8_group" else 127.0
    scale = xg.abs().amax(-1, keepdim=True).clamp(min=1e-10) / qmax  # fp32 IEEE division
    y = (xg / scale).double()
    q = round_e4m3(y) if payload == "fp8_group" else round_half_even(y).clamp(-qmax, qmax)
    return q.reshape(xf.shape), scale.squeeze(-1)


@pytest.mark.parametrize("payload", list(PAYLOADS))
@pytest.mark.parametrize("route", list(ROUTES))
@pytest.mark.parametrize("t", [1, 7, 16])
def test_prep_matches_an_independent_reference(t, route, payload):
    check_against_reference(t, route, payload, "cpu", HIDDEN)


def check_against_reference(t: int, route: str, payload: str, device, hidden: int) -> None:
    """The prep on ``device`` against the float64 / float32 reference (tests/gpu reuse it)."""
    logits, bias, x = _inputs(t, route, seed=t * 31 + len(route) + len(payload), hidden=hidden)
    e, k, scoring, ng, tg, _, renorm, rscale = ROUTES[route]
    alignment, mn_major = PAYLOADS[payload]
    got = _run(logits, bias, x, route, payload, device)
    rows = max_rows(t, k, e, alignment)
    if mn_major:
        assert got[7].stride() == (1, -(-rows // 4) * 4)
    ids, w, offsets, slot_pos, m_indices, counts, out, out_scale = _cpu(got)

    near = []
    ref_ids, ref_w = reference_route(logits, k, scoring, ng, tg, None if bias is None else bias.tolist(), renorm,
                                     rscale, near)  # fmt: skip
    assert not any(near)  # untied random logits: every decision is clear in fp32
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w.double(), ref_w, rtol=1e-5, atol=1e-7)

    # The layout from its definition: experts in order, each segment its slots in token order,
    # padded to the alignment; rows past the last segment and padding rows belong to no expert.
    assert m_indices.shape == (rows,) and out.shape == (rows, hidden)
    want_counts = torch.bincount(ref_ids.reshape(-1), minlength=e)
    assert torch.equal(counts, want_counts.to(torch.int32))
    room = (want_counts + alignment - 1) // alignment * alignment
    want_offsets = torch.cat([torch.zeros(1, dtype=torch.int64), room.cumsum(0)])
    assert torch.equal(offsets, want_offsets.to(torch.int32))
    want_pos = torch.full((t, k), -1, dtype=torch.int64)
    want_midx = torch.full((rows,), -1, dtype=torch.int32)
    for expert in range(e):
        row = int(want_offsets[expert])
        for s in range(t * k):
            if int(ref_ids.reshape(-1)[s]) == expert:
                want_pos.reshape(-1)[s] = row
                want_midx[row] = expert
                row += 1
    assert torch.equal(slot_pos, want_pos)
    assert torch.equal(m_indices, want_midx)

    src = torch.arange(t).repeat_interleave(k)
    dst = slot_pos.reshape(-1)
    if payload == "float":
        assert out_scale is None and out.dtype == x.dtype
        assert torch.equal(out[dst], x[src])
        return
    codes, scales = _codes_reference(x, payload)
    assert out.dtype == (torch.float8_e4m3fn if payload == "fp8_group" else torch.int8)
    assert torch.equal(out[dst].double(), codes[src])
    assert torch.equal(out_scale[dst], scales[src])


@pytest.mark.parametrize("payload", list(PAYLOADS))
@pytest.mark.parametrize("t, route", [(1, "E256_grouped"), (9, "E128_flat")])
def test_prep_writes_what_the_separate_kernels_write(t, route, payload):
    check_against_separate_kernels(t, route, payload, "cpu", HIDDEN)


def check_against_separate_kernels(t: int, route: str, payload: str, device, hidden: int) -> None:
    """Bit for bit the fused routing's ids, the payload's quantizer and the one-launch layout and
    scatter (fp32 activations: every bit of the input reaches the quantizers), all on ``device``;
    the routing weights to a few ulps."""
    logits, bias, x = _inputs(t, route, seed=5 + t, dtype=torch.float32, hidden=hidden)
    e, k, scoring, ng, tg, _, renorm, rscale = ROUTES[route]
    alignment, mn_major = PAYLOADS[payload]
    got = _cpu(_run(logits, bias, x, route, payload, device))
    logits, x = logits.to(device), x.to(device)
    bias = None if bias is None else bias.to(device)
    ids, w = topk.fused_topk(logits, k, renorm, scoring, ng, tg, bias, rscale)
    if payload == "float":
        xq, xs = x, None
    elif payload == "int8_token":
        xq, xs = quantize.per_token_quant_int8(x)
    else:
        xq, xs = quantize.per_group_quant(x, 128, torch.float8_e4m3fn if payload == "fp8_group" else torch.int8)
    want = _cpu(permute.slot_layout_scatter(ids, e, alignment, xq, xs, scale_mn_major=mn_major))
    ids, w = ids.cpu(), w.cpu()
    assert torch.equal(got[0], ids)
    # On a GPU the softmax and renormalizing sums reduce in an order that follows each kernel's
    # tile and warps: the weights may differ in their last bits (the interpreter: equal).
    torch.testing.assert_close(got[1], w, rtol=1e-6, atol=1e-9)
    for a, b in zip(got[2:6], want[:4]):
        assert torch.equal(a, b)
    dst = got[3].reshape(-1)
    bits = (lambda q: q.view(torch.uint8)) if payload == "fp8_group" else (lambda q: q)  # noqa: E731
    assert torch.equal(bits(got[6][dst]), bits(want[4][dst]))
    if xs is not None:
        assert torch.equal(got[7][dst], want[5][dst])


@pytest.mark.parametrize("payload", list(PAYLOADS))
def test_prep_routes_as_the_routing_kernel_over_a_large_batch(payload):
    check_rank_against_rounds(payload, "cpu", HIDDEN)


def check_rank_against_rounds(payload: str, device, hidden: int) -> None:
    """The prep of one token or three (routing by rank) against the routing kernel over 300 tokens
    (arg-max rounds) on tied scores: the same ids, the weights to the last bits (bit for bit in the
    interpreter); the token's rows hold its values."""
    route = "E64_grouped_tied"
    e, k, scoring, ng, tg, _, renorm, rscale = ROUTES[route]
    logits, bias = _tied_inputs(300, e, seed=41)
    x = torch.randn(300, hidden, generator=torch.Generator().manual_seed(42))
    block_t, warps = topk.launch_shape(300, e, torch.device(device))
    assert not topk.by_rank(block_t, e, warps) and topk.by_rank(4, e, prep.PREP_WARPS)
    want_ids, want_w = _cpu(topk.fused_topk(logits.to(device), k, renorm, scoring, ng, tg, bias.to(device), rscale))
    for r0, n in [(0, 1), (7, 1), (12, 3)]:
        rows = slice(r0, r0 + n)
        got = _cpu(_run(logits[rows], bias, x[rows], route, payload, device))
        assert torch.equal(got[0], want_ids[rows])
        tol = dict(rtol=0, atol=0) if device == "cpu" else dict(rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(got[1], want_w[rows], **tol)
        if payload == "float":
            assert torch.equal(got[6][got[3].reshape(-1)], x[rows].repeat_interleave(k, 0))


@pytest.mark.parametrize("alignment", [128, 1])
def test_prep_int8_group_scales_mn_major(alignment):
    """int8_group scales asked MN-major, laid out for the CUTLASS kernel (128-row segments) or for
    the Triton pass (no padding): the same layout, codes and scales as row-major, stored MN-major."""
    logits, bias, x = _inputs(7, "E128_flat", seed=3)
    e, k, scoring, ng, tg, _, renorm, rscale = ROUTES["E128_flat"]
    row, mn = (prep.decode_prep(logits, k, renorm, scoring, ng, tg, bias, rscale, x, alignment, "int8_group", m)
               for m in (False, True))  # fmt: skip
    rows = max_rows(7, k, e, alignment)
    assert mn[7].stride() == (1, -(-rows // 4) * 4) and row[7].stride() == (HIDDEN // 128, 1)
    for a, b in zip(row[:6], mn[:6]):
        assert torch.equal(a, b)
    dst = row[3].reshape(-1)
    assert torch.equal(mn[6][dst], row[6][dst]) and torch.equal(mn[7][dst], row[7][dst])


@pytest.mark.parametrize("warps", [1, 8])
def test_prep_on_other_warp_counts_writes_the_same(warps, monkeypatch):
    """The routing and layout compares split over other warp counts; one warp reads a long row in chunks."""
    monkeypatch.setattr(prep, "PREP_WARPS", warps)
    check_against_separate_kernels(2, "E256_grouped", "int8_token", "cpu", 2560 if warps == 1 else HIDDEN)


def test_prep_with_a_top_k_that_is_no_power_of_two_and_nan_logits():
    """Slots t * k + j with k = 6 reach the layout in order; a NaN row routes to k distinct
    experts (as the routing kernel) and its weights are NaN while the other tokens are untouched."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 32, generator=g)
    logits[2, 7] = float("nan")
    x = torch.randn(5, 128, generator=g)
    got = prep.decode_prep(logits, 6, True, "softmax", None, None, None, 1.0, x, 1, "int8_token")
    ids, w = topk.fused_topk(logits, 6, True, "softmax", None, None, None, 1.0)
    assert torch.equal(got[0], ids) and torch.equal(got[1][[0, 1, 3, 4]], w[[0, 1, 3, 4]])
    assert torch.isnan(got[1][2]).all() and len(set(got[0][2].tolist())) == 6
    want = permute.slot_layout(ids, 32, 1)
    for a, b in zip(got[2:6], want):
        assert torch.equal(a, b)


def test_prep_refuses_what_it_does_not_take():
    logits, x = torch.randn(17, 16), torch.randn(17, 128)
    with pytest.raises(ValueError, match=f"over the prep's {COPY_MAX_SLOTS}"):
        prep.decode_prep(logits, 8, True, "softmax", None, None, None, 1.0, x, 1, "float")
    with pytest.raises(ValueError, match="payload='int4'"):
        prep.decode_prep(logits[:2], 2, True, "softmax", None, None, None, 1.0, x[:2], 1, "int4")
    with pytest.raises(ValueError, match="multiple of 128"):
        prep.decode_prep(logits[:2], 2, True, "softmax", None, None, None, 1.0, x[:2, :96], 1, "fp8_group")
    with pytest.raises(ValueError, match="T of router_logits"):
        prep.decode_prep(logits[:2], 2, True, "softmax", None, None, None, 1.0, x[:3], 1, "float")
    assert prep_refusal(0, 8, 256) and prep_refusal(16, 8, 1024) and prep_refusal(16, 8, 256) is None
    # The routing tile bounds tokens x experts, each padded to a power of two, at PREP_ROUTE_TILE.
    assert prep_refusal(32, 4, 256) is None and prep_refusal(16, 8, 512) is None  # exactly the tile
    assert "routing tile" in prep_refusal(33, 2, 256) and "routing tile" in prep_refusal(3, 2, 3000)
    assert "over the prep's 128" in prep_refusal(43, 3, 2)
    with pytest.raises(ValueError, match="alignment=0 must be >= 1"):
        prep.decode_prep(logits[:2], 2, True, "softmax", None, None, None, 1.0, x[:2], 0, "float")


# ------------------------------------------------------------------------------------ the layer
def _layer(quant: str, backend: str, decode_prep, e: int = 16, hidden: int = 128, inter: int = 128):
    layer = DeepEPMoELayer(e, 4, hidden, inter, quant=quant, backend=backend, dispatch="local", device="cpu",
                           scoring_func="sigmoid", num_expert_group=4, topk_group=2, routed_scaling_factor=2.5,
                           use_correction_bias=True, decode_prep=decode_prep)  # fmt: skip
    stored, _ = make_weights(e, hidden, inter, quant, seed=4)
    layer.load_experts(*stored)
    with torch.no_grad():
        layer.e_score_correction_bias.copy_(torch.randn(e, generator=torch.Generator().manual_seed(5)) * 0.1)
    return layer


@pytest.mark.parametrize("quant", ["int8_channel", "bf16"])
def test_layer_output_is_the_same_with_and_without_the_prep(quant, monkeypatch):
    fused, separate = _layer(quant, "triton", True), _layer(quant, "triton", False)
    calls = []
    real = ops._decode_prep.fn
    monkeypatch.setattr(ops._decode_prep, "fn", lambda *a: calls.append(1) or real(*a))
    g = torch.Generator().manual_seed(6)
    x, logits = torch.randn(3, 128, generator=g), torch.randn(3, 16, generator=g)
    with torch.no_grad():
        got, want = fused(x, logits), separate(x, logits)
    assert calls == [1]  # the fused layer took the prep, the other one did not
    assert torch.isfinite(want).all() and want.abs().max() > 0
    # Routing weights from the kernel's exp and the torch path's differ by an ulp; ids and codes agree.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_layer_takes_the_separate_kernels_where_the_prep_does_not_apply(monkeypatch):
    layer = _layer("int8_channel", "triton", True)
    monkeypatch.setattr(ops._decode_prep, "fn", lambda *a: pytest.fail("the prep ran"))
    g = torch.Generator().manual_seed(7)
    x = torch.randn(COPY_MAX_SLOTS // 4 + 1, 128, generator=g)  # one slot over the limit
    logits = torch.randn(x.shape[0], 16, generator=g)
    with torch.no_grad():
        layer(x, logits)
        ids, w = layer.route(logits[:2])
        layer(x[:2], topk_ids=ids, topk_weights=w)  # no logits: nothing to route
    assert not _layer("int8_channel", "triton", None)._uses_prep(x[:2], logits[:2])  # on CPU: off by default
    assert _layer("int8_channel", "triton", True)._uses_prep(x[:2], logits[:2])
    # The torch backend takes host-sized segments (device-sized ones only while torch.compile traces).
    assert not _layer("int8_channel", "torch", True)._uses_prep(x[:2], logits[:2])


def test_layer_with_the_prep_refuses_a_bias_never_loaded():
    layer = DeepEPMoELayer(16, 4, 128, 128, quant="bf16", backend="triton", dispatch="local", device="cpu",
                           scoring_func="sigmoid", use_correction_bias=True, decode_prep=True)  # fmt: skip
    x, logits = torch.randn(2, 128), torch.randn(2, 16)
    assert layer._uses_prep(x, logits)
    with pytest.raises(ValueError, match="e_score_correction_bias holds NaN"):
        layer(x, logits)


def test_layer_refuses_a_bad_decode_prep_value():
    with pytest.raises(ValueError, match="decode_prep='yes'"):
        DeepEPMoELayer(8, 2, 128, 128, device="cpu", decode_prep="yes")


def test_layer_with_the_prep_compiles_in_one_graph_and_matches_eager():
    layer = _layer("int8_channel", "triton", True)
    g = torch.Generator().manual_seed(8)
    x, logits = torch.randn(2, 128, generator=g), torch.randn(2, 16, generator=g)
    torch._dynamo.reset()
    try:
        explained = torch._dynamo.explain(layer)(x, logits)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
        ops_seen = {str(n.target) for gm in explained.graphs for n in gm.graph.nodes if n.op == "call_function"}
        assert "epmoe.decode_prep.default" in ops_seen, ops_seen
        with torch.no_grad():
            want = layer(x, logits)
            got = torch.compile(layer, fullgraph=True, backend="aot_eager")(x, logits)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    finally:
        torch._dynamo.reset()
