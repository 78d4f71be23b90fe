"""The decode step's glue on a GPU (issue 26): the fused routing kernel compiled (against the
float64 reference of tests/test_routing.py, ties included, and as the layer's router on CUDA),
and padding rows left unwritten by the scatter, poisoned with NaN, through the CUTLASS FP8 and
the Triton backends: the combined output must not change by a bit."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

E, H, I = 4, 256, 128


@pytest.mark.parametrize("t", [1, 7, 300])
@pytest.mark.parametrize("e", [8, 64, 96, 256])  # 96: 128 lanes
@pytest.mark.parametrize("mode", ["softmax_renormalized", "softmax_grouped", "sigmoid_bias_grouped", "sigmoid_bias"])
def test_fused_routing_compiled_matches_float64_reference(mode, e, t):
    from test_routing import SIZES, _fused_against_reference, _tied_inputs

    k, groups, topk_group = SIZES[e]
    logits, bias = _tied_inputs(t, e, seed=t * 1000 + e)
    sure = _fused_against_reference(logits.cuda(), bias.cuda(), k, mode, groups, topk_group)
    assert sure.float().mean() >= 0.9


# 64 only: a token of more experts is ranked by the prep's warps only, and 8 experts are ranked at
# every batch size on a GPU (1024-lane tiles), so no rounds exist to compare with there; the
# float64 reference test above covers that path.
@pytest.mark.parametrize("e", [64])
@pytest.mark.parametrize("mode", ["softmax_renormalized", "softmax_grouped", "sigmoid_bias_grouped", "sigmoid_bias"])
def test_fused_routing_by_rank_selects_as_by_rounds(mode, e):
    from test_routing import rank_against_rounds

    rank_against_rounds(mode, e, "cuda")


def test_fused_routing_agrees_with_the_torch_path_on_untied_logits():
    from epmoe.routing import select_experts

    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(300, 256, device="cuda", generator=g)
    bias = torch.randn(256, device="cuda", generator=g) * 0.1
    kw = dict(scoring_func="sigmoid", num_expert_group=8, topk_group=4, correction_bias=bias, routed_scaling_factor=2.5)
    ids, w = select_experts(logits, 8, kernel=True, **kw)
    want_ids, want_w = select_experts(logits, 8, kernel=False, **kw)
    order, want_order = ids.argsort(1), want_ids.argsort(1)  # torch.topk's order is not specified
    assert torch.equal(ids.gather(1, order), want_ids.gather(1, want_order))
    torch.testing.assert_close(w.gather(1, order), want_w.gather(1, want_order), rtol=1e-5, atol=1e-6)


def test_layer_routes_through_the_fused_kernel_on_cuda(monkeypatch):
    from epmoe import DeepEPMoELayer, ops

    calls = []
    fused = ops.fused_topk
    monkeypatch.setattr(ops, "fused_topk", lambda *a, **kw: calls.append(1) or fused(*a, **kw))
    layer = DeepEPMoELayer(16, 4, H, I, backend="triton", dispatch="local", device="cuda", validate=False)
    ids, w = layer.route(torch.randn(3, 16, device="cuda"))
    assert calls == [1] and ids.shape == (3, 4) and ids.dtype == torch.int64


def _poisoned_outputs(backend, weights, batch, nan_fill, w):
    """The gathered output of ``batch`` with its padding rows (m_indices -1, inside the segments
    and spare) zero and poisoned: ``(clean, poisoned, backend rows of the poisoned padding)``."""
    from epmoe.layouts import gather_weighted

    pad = batch.m_indices < 0
    outs = []
    for poison in (False, True):
        x, xs = batch.x.clone(), None if batch.x_scale is None else batch.x_scale.clone()
        if poison:
            nan_fill(x, pad)
            if xs is not None:
                xs[pad] = float("nan")
        else:
            x.view(torch.uint8)[pad] = 0  # the bytes of each row, whatever the dtype
            if xs is not None:
                xs[pad] = 1.0
        outs.append(backend.run_contiguous(dataclasses.replace(batch, x=x, x_scale=xs), weights, torch.bfloat16))
    used = int(batch.expert_offsets[-1])
    inside = pad[:used]
    clean, poisoned = (gather_weighted(o, batch.slot_pos, w, torch.float32) for o in outs)
    return clean, poisoned, outs[1][:used][inside]


def _routing(t, k, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(t)])
    return ids.cuda(), torch.rand(t, k, generator=g).cuda()


@pytest.mark.parametrize("t", [1, 5])
def test_cutlass_fp8_padding_rows_never_reach_the_output(t):
    from epmoe.experts.cutlass_backend import CutlassBackend
    from epmoe.layouts import to_contiguous
    from epmoe.quant import get_scheme
    from epmoe.quant.reference import quantize_rows, quantize_weight

    scheme = get_scheme("fp8_block")
    ok, reason = CutlassBackend.supports(scheme, "contiguous", torch.device("cuda"), H, I)
    if not ok or not CutlassBackend.available(torch.device("cuda"))[0]:
        pytest.skip(f"cutlass fp8_block: {reason}")
    from epmoe.experts.base import ExpertWeights

    g = torch.Generator().manual_seed(1)
    q13, s13 = quantize_weight(torch.randn(E, 2 * I, H, generator=g) / H**0.5, scheme)
    q2, s2 = quantize_weight(torch.randn(E, H, I, generator=g) / I**0.5, scheme)
    backend = CutlassBackend(scheme)
    weights = backend.prepare_weights(ExpertWeights(scheme, q13.cuda(), q2.cuda(), s13.cuda(), s2.cuda()))
    ids, w = _routing(t, 2, seed=t)
    x, xs = quantize_rows(torch.randn(t, H, generator=g), torch.float8_e4m3fn, 448.0, 128)
    for hint in (None, 1):  # host-sized, and sized on the device (spare rows)
        batch = to_contiguous(x.cuda(), xs.cuda(), ids, E, backend.alignment, expected_m=hint,
                              scale_mn_major=backend.mn_major_scales)  # as the layer builds it

        def nan_fill(rows, pad):
            rows.view(torch.uint8)[pad] = 0x7F  # e4m3fn NaN

        # GEMM1 runs the poisoned rows (128-row tiles); the activation skips them (row_expert),
        # GEMM2 runs them again on whatever the activation's buffer held: none may reach a token.
        clean, poisoned, _ = _poisoned_outputs(backend, weights, batch, nan_fill, w)
        assert torch.isfinite(poisoned).all() and torch.equal(poisoned, clean)


@pytest.mark.parametrize("scheme", ["bf16", "int8_channel", "int8_block"])
def test_triton_padding_rows_never_reach_the_output(scheme):
    from epmoe.experts.base import ExpertWeights
    from epmoe.experts.triton_backend import TritonBackend
    from epmoe.layouts import to_contiguous
    from epmoe.quant import get_scheme
    from epmoe.quant.reference import quantize_weight

    sch = get_scheme(scheme)
    g = torch.Generator().manual_seed(2)
    w13, w2 = torch.randn(E, 2 * I, H, generator=g) / H**0.5, torch.randn(E, H, I, generator=g) / I**0.5
    if sch.quantized:
        (q13, s13), (q2, s2) = quantize_weight(w13, sch), quantize_weight(w2, sch)
        stored = ExpertWeights(sch, q13.cuda(), q2.cuda(), s13.cuda(), s2.cuda())
    else:
        stored = ExpertWeights(sch, w13.bfloat16().cuda(), w2.bfloat16().cuda())
    backend = TritonBackend(sch)
    weights = backend.prepare_weights(stored)
    ids, w = _routing(3, 2, seed=4)
    x = torch.randn(3, H, generator=g).bfloat16().cuda()
    batch = to_contiguous(x, None, ids, E, 16, expected_m=1)

    def nan_fill(rows, pad):
        rows[pad] = float("nan")

    clean, poisoned, pad_out = _poisoned_outputs(backend, weights, batch, nan_fill, w)
    assert torch.isfinite(poisoned).all() and torch.equal(poisoned, clean)
    assert not torch.isfinite(pad_out.float()).all()


@pytest.mark.parametrize("kind", ["fp8_block", "int8_block"])
def test_cutlass_takes_scales_in_its_own_layouts_as_given(kind):
    """FP8: the kernel's own repeat of the weight scales (per call) and prepare_weights' (once)
    give the same bits (INT8 block's 256-wide tiles read them as stored, the only grid its ops
    take); both: row-major activation scales (transposed per call) and MN-major ones too."""
    from epmoe.experts import cutlass_backend as cb
    from epmoe.quant import get_scheme

    ok, reason = cb.CutlassBackend.supports(get_scheme(kind), "contiguous", torch.device("cuda"), 256, 256)
    if not ok or not cb.CutlassBackend.available(torch.device("cuda"))[0]:
        pytest.skip(f"cutlass {kind}: {reason}")
    from test_compile_gpu import cutlass_operands

    a, a_scale, b, b_scale = cutlass_operands(kind, n=384)
    gemm = cb.grouped_gemm if kind == "fp8_block" else cb.int8_block_grouped_gemm
    offsets = torch.tensor([0, 128, 256], dtype=torch.int32, device="cuda")
    if kind == "fp8_block" and cb._use_sgl():
        pytest.skip("sgl-kernel's op takes the 128-column grid only")
    want = gemm(a, a_scale, b, b_scale, offsets)
    w_scale = cb.kernel_weight_scale(b_scale) if kind == "fp8_block" else b_scale
    if kind == "fp8_block":
        assert torch.equal(gemm(a, a_scale, b, w_scale, offsets), want)
    # Activation scales given MN-major (what the layout and the activation write for the kernel).
    from epmoe.kernels.common import mn_major_scales

    mn = mn_major_scales(*a_scale.shape, a_scale.device)
    mn.copy_(a_scale)
    assert cb.is_mn_major(mn) and torch.equal(gemm(a, mn, b, w_scale, offsets), want)
