"""Single-process layer tests: every scheme against float64 references, both layouts, bad input."""

import logging

import pytest
import torch

from cases import CASE_NAMES, make_case
from epmoe.experts.torch_backend import TorchBackend
from epmoe.layer import DeepEPMoELayer
from epmoe.layouts import gather_weighted, to_contiguous, to_masked
from epmoe.quant import get_scheme
from helpers import SCHEME_NAMES, make_weights
from reference import moe_reference, rel_err

E, K, H, I = 8, 3, 256, 128


def build(scheme, **kw):
    layer = DeepEPMoELayer(E, K, H, I, quant=scheme, params_dtype=torch.float32, device="cpu", **kw)
    stored, deq = make_weights(E, H, I, scheme)
    layer.load_experts(*stored)
    return layer, deq


@pytest.mark.parametrize("scheme", SCHEME_NAMES)
@pytest.mark.parametrize("case", CASE_NAMES)
def test_layer_matches_float64(scheme, case):
    layer, (w13, w2) = build(scheme, dispatch="local", backend="torch")
    x, ids, w = make_case(case, 0, E, K, H)
    out = layer(x, topk_ids=ids, topk_weights=w)
    assert out.shape == x.shape and out.dtype == x.dtype
    if x.shape[0] == 0:
        return
    # Tight: float64 math that emulates the scheme's activation quantization by itself.
    assert rel_err(out, moe_reference(x, ids, w, w13, w2, scheme)) < 1e-3
    # Loose: exact float64 math on the unquantized weights, within the scheme's documented bound.
    _, (f13, f2) = make_weights(E, H, I, "bf16")
    assert rel_err(out, moe_reference(x, ids, w, f13, f2)) < get_scheme(scheme).rel_error_bound


@pytest.mark.parametrize("scheme", SCHEME_NAMES)
def test_masked_layout_matches_contiguous(scheme):
    stored, (w13, w2) = make_weights(E, H, I, scheme)
    s = get_scheme(scheme)
    from epmoe.experts.base import ExpertWeights

    weights = ExpertWeights(s, *stored)
    backend = TorchBackend(s)
    x, ids, w = make_case("empty_experts", 0, E, K, H)
    masked, slot_pos = to_masked(x, None, ids, E, capacity=x.shape[0])
    y = backend.run_masked(masked, weights, torch.float32)
    out_masked = gather_weighted(y.reshape(-1, H), slot_pos, w)
    assert (masked.masked_m[E // 2 :] == 0).all()
    assert rel_err(out_masked, moe_reference(x, ids, w, w13, w2, scheme)) < 1e-3
    batch = to_contiguous(x, None, ids, E, alignment=16)
    assert (torch.tensor(batch.num_rows) == masked.masked_m).all()
    out_contig = gather_weighted(backend.run_contiguous(batch, weights, torch.float32), batch.slot_pos, w)
    torch.testing.assert_close(out_contig, out_masked, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.int16, torch.int32])
def test_layouts_take_any_integer_ids(dtype):
    """Narrow ids give the same layouts as int64 ones (uint8 ids used as an index would be a
    boolean mask)."""
    x, ids, _ = make_case("random", 0, E, K, H)
    ids[0, 1] = E + 2  # a slot owned by another rank, representable in every dtype here
    narrow = ids.to(dtype)
    assert torch.equal(narrow.long(), ids)
    want, got = to_contiguous(x, None, ids, E, alignment=8), to_contiguous(x, None, narrow, E, alignment=8)
    for name in ("x", "expert_offsets", "m_indices", "slot_pos"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    (mw, pw), (mg, pg) = to_masked(x, None, ids, E, capacity=x.shape[0]), to_masked(x, None, narrow, E, capacity=x.shape[0])
    assert torch.equal(mg.x, mw.x) and torch.equal(mg.masked_m, mw.masked_m) and torch.equal(pg, pw)


def test_contiguous_layout_invariants():
    x, ids, _ = make_case("random", 0, E, K, H)
    ids[0, 1] = -1  # a slot owned by another rank
    b = to_contiguous(x, None, ids, E, alignment=8)
    offsets = b.expert_offsets.tolist()
    assert offsets[0] == 0 and all((offsets[e + 1] - offsets[e]) % 8 == 0 for e in range(E))
    assert b.slot_pos[0, 1] == -1
    for e in range(E):
        seg = b.m_indices[offsets[e] : offsets[e + 1]]
        assert (seg[: b.num_rows[e]] == e).all() and (seg[b.num_rows[e] :] == -1).all()
    valid = b.slot_pos >= 0
    rows = b.slot_pos[valid]
    assert torch.equal(b.m_indices[rows].long(), ids[valid])
    assert torch.equal(b.x[rows], x.unsqueeze(1).expand(-1, K, -1)[valid])


def test_bf16_inputs_and_weights():
    layer = DeepEPMoELayer(E, K, H, I, quant="bf16", device="cpu", dispatch="local", backend="torch")
    stored, _ = make_weights(E, H, I, "bf16")
    layer.load_experts(stored[0].bfloat16(), stored[1].bfloat16())
    x, ids, w = make_case("random", 0, E, K, H)
    out = layer(x.bfloat16(), topk_ids=ids, topk_weights=w)
    assert out.dtype == torch.bfloat16
    ref = moe_reference(x.bfloat16().float(), ids, w, stored[0].bfloat16().float(), stored[1].bfloat16().float())
    assert rel_err(out, ref) < 1e-2  # bf16 output rounding (2^-9 relative) and bf16 transfers


def test_router_logits_path_and_grouped_routing():
    layer, (w13, w2) = build(
        "int8_channel", dispatch="local", backend="torch", scoring_func="sigmoid",
        num_expert_group=4, topk_group=2, use_correction_bias=True, routed_scaling_factor=2.5,
    )  # fmt: skip
    bias = torch.randn(E) * 0.1
    layer.load_weights([("model.layers.3.mlp.gate.e_score_correction_bias", bias)], strict=False)
    x = torch.randn(21, H)
    logits = torch.randn(21, E)
    out = layer(x, logits)
    ids, w = layer.route(logits)
    assert torch.allclose(w.sum(-1), torch.full((21,), 2.5))
    assert rel_err(out, moe_reference(x, ids, w, w13, w2, "int8_channel")) < 1e-3


def test_nan_in_one_token_stays_in_that_token():
    layer, _ = build("int8_block", dispatch="local", backend="torch")
    x, ids, w = make_case("random", 0, E, K, H)
    clean = layer(x, topk_ids=ids, topk_weights=w)
    x[5, 17] = float("nan")
    x[9, 3] = float("inf")
    out = layer(x, topk_ids=ids, topk_weights=w)
    assert not torch.isfinite(out[5]).all() and not torch.isfinite(out[9]).all()
    others = [t for t in range(x.shape[0]) if t not in (5, 9)]
    torch.testing.assert_close(out[others], clean[others])


def test_group_that_is_not_a_process_group_is_refused():
    with pytest.raises(TypeError, match=r"^group=\[0, 1\]; allowed: None or a torch.distributed ProcessGroup$"):
        DeepEPMoELayer(E, K, H, I, device="cpu", group=[0, 1])


@pytest.mark.parametrize("dispatch,backend,said", [
    ("local", "triton", None),
    ("local", "torch", "dispatch=local and backend=torch outside torch.compile (it needs"),
    ("all_to_all", "torch", "dispatch=all_to_all and backend=torch (it needs"),
    ("all_to_all", "triton", "dispatch=all_to_all and backend=triton (it needs"),
])  # fmt: skip
def test_decode_prep_without_effect_is_logged(caplog, dispatch, backend, said):
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with caplog.at_level(logging.WARNING, logger="epmoe"):
            DeepEPMoELayer(E, K, H, I, device="cpu", dispatch=dispatch, backend=backend, decode_prep=True)
    finally:
        dist.destroy_process_group()
    if said is None:
        assert "decode_prep=True has no effect" not in caplog.text
    else:
        assert f"decode_prep=True has no effect with {said}" in caplog.text


def test_logs_choice_and_refusals(caplog):
    with caplog.at_level(logging.INFO, logger="epmoe"):
        DeepEPMoELayer(E, K, H, I, quant="fp8_block", device="cpu")
    text = caplog.text
    assert "dispatcher 'local' chosen" in text
    assert "experts backend 'deepgemm' refused" in text
    assert "experts backend 'torch' chosen" in text


def test_load_weights_by_checkpoint_names():
    stored, (w13, w2) = make_weights(E, H, I, "int8_block")
    q13, q2, s13, s2 = stored
    named = []
    for e in range(E):
        p = f"model.layers.7.mlp.experts.{e}."
        named += [
            (p + "gate_proj.weight", q13[e, :I]), (p + "up_proj.weight", q13[e, I:]),
            (p + "down_proj.weight", q2[e]),
            (p + "gate_proj.weight_scale_inv", s13[e, : I // 128]),
            (p + "up_proj.weight_scale_inv", s13[e, I // 128 :]),
            (p + "down_proj.weight_scale_inv", s2[e]),
        ]  # fmt: skip
    ref_layer, _ = build("int8_block", dispatch="local", backend="torch")
    x, ids, w = make_case("random", 0, E, K, H)
    # Pairs, and a mapping as safetensors.load_file returns it.
    for given in (named, dict(named)):
        layer = DeepEPMoELayer(E, K, H, I, quant="int8_block", device="cpu", params_dtype=torch.float32)
        loaded = layer.load_weights(given)
        assert len(loaded) == len(named)
        torch.testing.assert_close(layer(x, topk_ids=ids, topk_weights=w), ref_layer(x, topk_ids=ids, topk_weights=w))


@pytest.mark.parametrize("given, shown", [
    ([("experts.0.gate_proj.weight", torch.zeros(1), "extra")], r"\('experts.0.gate_proj.weight', Tensor, 'extra'\)"),
    (["ab"], "'ab'"),
    ([torch.zeros(2)], "Tensor"),
    ("experts.0.gate_proj.weight", None),
    (None, None),
    ([["experts.0.gate_proj.weight", torch.zeros(1)]], r"\['experts.0.gate_proj.weight', Tensor\]"),
])  # fmt: skip
def test_load_weights_refuses_what_is_not_name_tensor_pairs(given, shown):
    layer, _ = build("bf16", dispatch="local", backend="torch")
    match = rf"^named_tensors item {shown}; allowed: \(name: str, tensor\) pairs" if shown else (
        rf"^named_tensors: got {type(given).__name__}; allowed: \(name, tensor\) pairs, or a mapping name -> tensor$")
    with pytest.raises(TypeError, match=match):
        layer.load_weights(given)


def test_load_weights_channel_scales():
    stored, _ = make_weights(E, H, I, "int8_channel")
    q13, q2, s13, s2 = stored
    layer = DeepEPMoELayer(E, K, H, I, quant="int8_channel", device="cpu", params_dtype=torch.float32)
    layer.load_weights([("experts.2.up_proj.weight_scale", s13[2, I:, 0]), ("experts.2.down_proj.weight_scale", s2[2])], strict=False)
    assert torch.equal(layer.w13_weight_scale[2, I:], s13[2, I:])
    assert torch.equal(layer.w2_weight_scale[2], s2[2])


BAD_CONSTRUCT = [
    (dict(quant="int4"), ValueError, "quant='int4' is not a known scheme"),
    (dict(quant="int8_block", hidden_size=200), ValueError, "hidden_size=200 must be a multiple of 128"),
    (dict(quant="fp8_block", intermediate_size=96), ValueError, "intermediate_size=96 must be a multiple of 128"),
    (dict(backend="cuda_magic"), ValueError, "backend='cuda_magic' is not known"),
    (dict(dispatch="mpi"), ValueError, "dispatch='mpi' is not known"),
    (dict(backend="triton", quant="fp8_block"), RuntimeError, "backend='triton' cannot run quant='fp8_block'"),
    (dict(backend="deepgemm", quant="fp8_block"), RuntimeError, "backend='deepgemm' cannot run"),
    (dict(dispatch="all_to_all"), RuntimeError, "dispatch=.all_to_all. cannot run with 1 rank.*not initialized"),
    (dict(accumulator="int32", quant="int8_block"), ValueError, "accumulator='int32' applies to quant='int8_channel' only"),
    (dict(accumulator="fp16"), ValueError, r"accumulator='fp16'; allowed: \['fp32', 'int32'\]"),
    (dict(top_k=9), ValueError, r"top_k=9 must be an integer in \[1, num_experts=8\]"),
    (dict(low_latency_int8_payload="int4"), ValueError, "low_latency_int8_payload='int4'"),
    (dict(params_dtype=torch.int8), ValueError, "params_dtype=torch.int8"),
    (dict(hidden_size=True), ValueError, "hidden_size=True must be a positive integer"),
    (dict(intermediate_size=0), ValueError, "intermediate_size=0 must be a positive integer"),
    (dict(max_tokens_per_rank=2.0), ValueError, "max_tokens_per_rank=2.0 must be a positive integer"),
    (dict(routed_scaling_factor=float("nan")), ValueError, "routed_scaling_factor=nan must be a finite number > 0"),
    (dict(routed_scaling_factor=-1.0), ValueError, "routed_scaling_factor=-1.0 must be a finite number > 0"),
    (dict(routed_scaling_factor="2"), ValueError, "routed_scaling_factor='2' must be a finite number > 0"),
]


@pytest.mark.parametrize("kwargs,exc,match", BAD_CONSTRUCT)
def test_bad_construction(kwargs, exc, match):
    args = dict(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I, device="cpu")
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        DeepEPMoELayer(**args)


def test_bad_forward_inputs():
    layer, _ = build("int8_channel", dispatch="local", backend="torch")
    x = torch.randn(5, H)
    ids = torch.zeros(5, K, dtype=torch.int64)
    w = torch.ones(5, K)
    cases = [
        (lambda: layer(torch.randn(5, H + 1), torch.randn(5, E)), ValueError, f"hidden size {H + 1}; the layer has hidden_size={H}"),
        (lambda: layer(torch.randn(5, 2, H), torch.randn(5, E)), ValueError, "must be a \\[T, hidden_size"),
        (lambda: layer(x.double(), torch.randn(5, E)), TypeError, "hidden_states has dtype torch.float64"),
        (lambda: layer(x, torch.randn(5, E + 1)), ValueError, rf"router_logits has shape \(5, {E + 1}\); expected \[5, {E}\]"),
        (lambda: layer(x), ValueError, "pass either router_logits or both topk_ids and topk_weights"),
        (lambda: layer(x, torch.randn(5, E), topk_ids=ids, topk_weights=w), ValueError, "pass either"),
        (lambda: layer(x, topk_ids=ids), ValueError, "must be given together"),
        (lambda: layer(x, topk_ids=ids[:, :2], topk_weights=w[:, :2]), ValueError, rf"topk_ids has shape \(5, 2\); expected \[5, {K}\]"),
        (lambda: layer(x, topk_ids=ids.float(), topk_weights=w), TypeError, "topk_ids has dtype torch.float32"),
        (lambda: layer(x, topk_ids=ids + E, topk_weights=w), ValueError, rf"expert id {E}, outside \[0, {E}\)"),
        (lambda: layer(x, topk_ids=ids - 2, topk_weights=w), ValueError, r"expert id -2, outside"),  # -1 is padding (issue 22.3)
        (lambda: layer(x, torch.full((5, E), float("nan"))), ValueError, "router_logits contain NaN or Inf"),
        (lambda: layer(x, topk_ids=ids, topk_weights=w * float("nan")), ValueError, "topk_weights contain NaN or Inf"),
        (lambda: layer(x, torch.randn(5, E).numpy()), TypeError, "router_logits must be a torch.Tensor or None; got ndarray"),
        (lambda: layer(x, [[0.0] * E] * 5), TypeError, "router_logits must be a torch.Tensor or None; got list"),
        (lambda: layer(x, topk_ids=ids.tolist(), topk_weights=w), TypeError, "topk_ids must be a torch.Tensor or None; got list"),
    ]
    for call, exc, match in cases:
        with pytest.raises(exc, match=match):
            call()


def test_bad_weights():
    layer = DeepEPMoELayer(E, K, H, I, quant="int8_channel", device="cpu")
    stored, _ = make_weights(E, H, I, "int8_channel")
    q13, q2, s13, s2 = stored
    with pytest.raises(ValueError, match=rf"w13 has shape \(4, {2 * I}, {H}\); expected \[{E}, {2 * I}, {H}\]"):
        layer.load_experts(q13[:4], q2, s13, s2)
    with pytest.raises(TypeError, match="w13 has dtype torch.float32; quant='int8_channel' stores torch.int8"):
        layer.load_experts(q13.float(), q2, s13, s2)
    with pytest.raises(ValueError, match="w13_scale is required"):
        layer.load_experts(q13, q2)
    with pytest.raises(ValueError, match="is not an expert weight"):
        layer.load_weights([("model.layers.0.mlp.experts.0.gate.weight", q13[0, :I])])
    assert layer.load_weights([("lm_head.weight", torch.zeros(3))], strict=False) == set()
    with pytest.raises(ValueError, match=rf"expert id {E} is out of range"):
        layer.load_weights([(f"experts.{E}.gate_proj.weight", q13[0, :I])])
    with pytest.raises(ValueError, match=rf"experts.1.down_proj.weight has shape \({I}, {H}\); expected \[{H}, {I}\]"):
        layer.load_weights([("experts.1.down_proj.weight", q2[1].t())])
    with pytest.raises(ValueError, match=r"experts.1.gate_proj.weight_scale has shape \(3, 1\)"):
        layer.load_weights([("experts.1.gate_proj.weight_scale", s13[1, :3])])
    with pytest.raises(TypeError, match="has dtype torch.float8_e4m3fn; quant='int8_channel' stores torch.int8"):
        layer.load_weights([("experts.1.gate_proj.weight", q13[1, :I].float().to(torch.float8_e4m3fn))])
    with pytest.raises(TypeError, match="w2 must be a torch.Tensor; got ndarray"):
        layer.load_experts(q13, q2.numpy(), s13, s2)
    with pytest.raises(TypeError, match="experts.1.down_proj.weight must be a torch.Tensor; got list"):
        layer.load_weights([("experts.1.down_proj.weight", q2[1].tolist())])
    # A scale of the wrong dtype gets no hint about quantized checkpoints (it is not a weight).
    with pytest.raises(TypeError, match=r"weight_scale has dtype torch.int32; quant='int8_channel' takes .*float64'\] here$"):
        layer.load_weights([("experts.1.gate_proj.weight_scale", s13[1, :I].int())])
    # Scales multiply everything: a NaN in one is refused before anything is copied.
    bad = s2.clone()
    bad[3, 5] = float("nan")
    with pytest.raises(ValueError, match="w2_scale holds NaN or Inf"):
        layer.load_experts(q13, q2, s13, bad)
    with pytest.raises(ValueError, match="experts.3.down_proj.weight_scale holds NaN or Inf"):
        layer.load_weights([("experts.3.down_proj.weight", q2[3]), ("experts.3.down_proj.weight_scale", bad[3])])
    assert layer.w2_weight_scale.isnan().all()  # nothing was copied


@pytest.mark.parametrize("scheme", ["bf16", "int8_channel", "fp8_block"])
def test_experts_never_loaded_give_nan_not_zeros(scheme):
    """An expert left out of a load turns its tokens' outputs into NaN; other tokens are exact."""
    layer = DeepEPMoELayer(E, K, H, I, quant=scheme, params_dtype=torch.float32, device="cpu",
                           dispatch="local", backend="torch")  # fmt: skip
    stored, (w13, w2) = make_weights(E, H, I, scheme)
    q13, q2, s13, s2 = stored
    g = I if s13 is None or s13.shape[1] == 2 * I else I // 128  # scale rows of gate_proj
    names = []
    for e in range(E // 2):  # experts 0-3 only, as a partial checkpoint would hold
        names += [(f"experts.{e}.gate_proj.weight", q13[e, :I]), (f"experts.{e}.up_proj.weight", q13[e, I:]),
                  (f"experts.{e}.down_proj.weight", q2[e])]  # fmt: skip
        if s13 is not None:
            names += [(f"experts.{e}.gate_proj.weight_scale_inv", s13[e, :g]),
                      (f"experts.{e}.up_proj.weight_scale_inv", s13[e, g:]),
                      (f"experts.{e}.down_proj.weight_scale_inv", s2[e])]  # fmt: skip
    layer.load_weights(names, strict=False)
    x = torch.randn(6, H)
    ids = torch.tensor([[0, 1, 2], [1, 2, 3], [0, 3, 5], [4, 5, 6], [2, 3, 1], [7, 0, 1]])
    w = torch.rand(6, K)
    out = layer(x, topk_ids=ids, topk_weights=w)
    uses_unloaded = (ids >= E // 2).any(dim=1)
    assert out[uses_unloaded].isnan().all(dim=1).all()
    ok = ~uses_unloaded
    assert rel_err(out[ok], moe_reference(x[ok], ids[ok], w[ok], w13, w2, scheme)) < 1e-3


@pytest.mark.parametrize("validate", [True, False])
def test_correction_bias_never_loaded_is_refused_at_the_first_routed_batch(validate):
    layer, _ = build("bf16", dispatch="local", backend="torch", scoring_func="sigmoid", use_correction_bias=True,
                     validate=validate)  # fmt: skip
    x = torch.randn(4, H)
    # Every rank raises at the same batch: one with no tokens too (its peers would wait otherwise).
    with pytest.raises(ValueError, match="e_score_correction_bias holds NaN or Inf: it was never loaded"):
        layer(x[:0], torch.randn(0, E))
    with pytest.raises(ValueError, match="e_score_correction_bias holds NaN or Inf: it was never loaded"):
        layer(x, torch.randn(4, E))
    layer(x, topk_ids=torch.zeros(4, K, dtype=torch.int64) + torch.arange(K), topk_weights=torch.ones(4, K))  # no routing
    with pytest.raises(ValueError, match="mlp.gate.e_score_correction_bias holds NaN or Inf"):
        layer.load_weights([("mlp.gate.e_score_correction_bias", torch.full((E,), float("inf")))])
    layer.load_weights([("mlp.gate.e_score_correction_bias", torch.zeros(E))], strict=False)
    assert layer(x, torch.randn(4, E)).isfinite().all()
    with torch.no_grad():
        layer.e_score_correction_bias[3] = float("nan")  # an in-place write is checked again
    with pytest.raises(ValueError, match="e_score_correction_bias holds NaN or Inf"):
        layer.route(torch.randn(4, E))


def test_load_weights_skips_unrelated_entries_of_any_type_when_not_strict():
    layer, _ = build("bf16", dispatch="local", backend="torch")
    assert layer.load_weights([("mlp.gate._extra_state", b"opaque"), ("lm_head.weight", [1, 2])], strict=False) == set()


def test_meta_layer_loads_meta_tensors():
    layer = DeepEPMoELayer(E, K, H, I, quant="int8_channel", device="meta", dispatch="local", backend="torch")
    stored, _ = make_weights(E, H, I, "int8_channel")
    layer.load_experts(*[t.to("meta") for t in stored])  # shapes only: no value checks


def test_sizes_take_numpy_integers():
    import numpy as np

    layer = DeepEPMoELayer(np.int64(E), np.int32(K), np.int64(H), np.int64(I), device="cpu", dispatch="local")
    assert (layer.num_experts, layer.top_k, layer.hidden_size) == (E, K, H) and type(layer.hidden_size) is int


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_device_without_cuda_is_refused():
    with pytest.raises(ValueError, match="device='cuda': CUDA is not available here"):
        DeepEPMoELayer(E, K, H, I, device="cuda")


def test_duplicate_experts_refused_for_fixed_capacity_dispatch():
    layer, _ = build("bf16", dispatch="local", backend="torch")
    x, ids, w = make_case("random", 0, E, K, H)
    ids[4] = torch.tensor([2, 5, 2])
    layer(x, topk_ids=ids, topk_weights=w)  # contiguous dispatch handles repeats
    layer.dispatcher.layouts = frozenset({"masked"})  # what a low-latency dispatcher declares
    with pytest.raises(ValueError, match=r"topk_ids row 4 names an expert more than once \(\[2, 5, 2\]\)"):
        layer(x, topk_ids=ids, topk_weights=w)


def test_load_weights_refuses_a_second_layer_in_one_call():
    stored, _ = make_weights(E, H, I, "bf16")
    layer = DeepEPMoELayer(E, K, H, I, quant="bf16", device="cpu", params_dtype=torch.float32)
    a = ("model.layers.3.mlp.experts.0.gate_proj.weight", stored[0][0, :I])
    b = ("model.layers.4.mlp.experts.0.gate_proj.weight", stored[0][0, :I] + 1)
    with pytest.raises(ValueError, match="layers.4.mlp.experts.0.gate_proj.weight fills the same slot as model.layers.3"):
        layer.load_weights([a, b])
    assert layer.w13_weight.isnan().all()  # nothing was copied: every tensor is checked first


def test_load_weights_refuses_fp8_codes_into_a_float_layer():
    layer = DeepEPMoELayer(E, K, H, I, quant="bf16", device="cpu")
    codes = torch.randn(I, H).to(torch.float8_e4m3fn)
    with pytest.raises(TypeError, match="has dtype torch.float8_e4m3fn; quant='bf16' takes"):
        layer.load_weights([("experts.0.gate_proj.weight", codes)])
    with pytest.raises(TypeError, match="w13 has dtype torch.float8_e4m3fn"):
        layer.load_experts(torch.zeros(E, 2 * I, H).to(torch.float8_e4m3fn), torch.zeros(E, H, I))


def test_correction_bias_on_a_layer_without_one():
    layer = DeepEPMoELayer(E, K, H, I, device="cpu")
    with pytest.raises(ValueError, match="built with use_correction_bias=False"):
        layer.load_weights([("model.layers.3.mlp.gate.e_score_correction_bias", torch.zeros(E))])
    assert layer.load_weights([("mlp.gate.e_score_correction_bias", torch.zeros(E))], strict=False) == set()


def test_replaced_parameters_are_used():
    layer, _ = build("int8_channel", dispatch="local", backend="torch")
    x, ids, w = make_case("random", 0, E, K, H)
    before = layer(x, topk_ids=ids, topk_weights=w)
    stored, _ = make_weights(E, H, I, "int8_channel", seed=5)
    state = {"w13_weight": stored[0], "w2_weight": stored[1], "w13_weight_scale": stored[2], "w2_weight_scale": stored[3]}
    layer.load_state_dict(state, assign=True)  # new tensors, as engines do after loading
    after = layer(x, topk_ids=ids, topk_weights=w)
    fresh, _ = build("int8_channel", dispatch="local", backend="torch")
    fresh.load_experts(*stored)
    assert not torch.allclose(before, after)
    torch.testing.assert_close(after, fresh(x, topk_ids=ids, topk_weights=w))
    with torch.no_grad():
        layer.w2_weight_scale.mul_(2)  # in-place writes count too
    torch.testing.assert_close(layer(x, topk_ids=ids, topk_weights=w), after * 2, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("value", [float("nan"), 0, -1.0, float("inf")])
def test_timeout_must_be_finite_and_positive(value):
    with pytest.raises(ValueError, match="timeout_s=.* must be a finite number of seconds > 0"):
        DeepEPMoELayer(E, K, H, I, device="cpu", timeout_s=value)


def test_inputs_on_another_device():
    layer, _ = build("bf16", dispatch="local", backend="torch")
    x = torch.randn(3, H)
    with pytest.raises(ValueError, match="hidden_states is on meta; the layer is on cpu"):
        layer(x.to("meta"), torch.randn(3, E))
    with pytest.raises(ValueError, match="router_logits is on meta; the layer is on cpu"):
        layer(x, torch.randn(3, E, device="meta"))


class _Stop(Exception):
    pass


@pytest.mark.parametrize("device_segments", [False, True])
def test_layer_keeps_segment_sizes_on_the_device_only_for_a_backend_that_takes_them(monkeypatch, device_segments):
    """A dispatcher that did not wait for the counts (padded_rows None, expected_m set): the layer
    asks the scatter for device-side sizes only when the backend declares device_segments."""
    import epmoe.layer as layer_mod
    from epmoe.dispatch.base import Dispatched

    layer = DeepEPMoELayer(8, 2, 256, 128, backend="torch", device="cpu", params_dtype=torch.float32)
    monkeypatch.setattr(type(layer.backend), "device_segments", device_segments)
    seen = {}

    def scatter(*args, **kwargs):
        seen.update(kwargs)
        raise _Stop

    monkeypatch.setattr(layer_mod, "to_contiguous", scatter)
    d = Dispatched(x=torch.zeros(4, 256), x_scale=None, handle=None, num_tokens=4,
                   topk_ids=torch.zeros(4, 2, dtype=torch.int64), topk_weights=torch.ones(4, 2), expected_m=7)  # fmt: skip
    with pytest.raises(_Stop):
        layer._run_experts(d, torch.float32)
    assert seen["expected_m"] == (7 if device_segments else None)


@pytest.mark.parametrize("scheme", ["int8_channel", "fp8_block"])
def test_module_dtype_casts_keep_quantized_weights_scales_and_bias(scheme):
    """model.to(dtype) / .half() on a module that holds the layer: quantized weights, fp32 scales
    and the correction bias keep their dtypes and values; outputs do not move; .to(device) moves."""
    layer, _ = build(scheme, dispatch="local", backend="torch", scoring_func="sigmoid", use_correction_bias=True)
    layer.load_weights([("mlp.gate.e_score_correction_bias", torch.randn(E) * 0.1)], strict=False)
    model = torch.nn.Sequential(torch.nn.Linear(H, H), layer)
    x, logits = torch.randn(17, H), torch.randn(17, E)
    before = layer(x.bfloat16(), logits)
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    model.to(torch.bfloat16)
    assert model[0].weight.dtype == torch.bfloat16  # the rest of the model is cast as asked
    model.half()
    for k, v in layer.state_dict().items():
        assert v.dtype == state[k].dtype and torch.equal(v, state[k]), k
    torch.testing.assert_close(layer(x.bfloat16(), logits), before, rtol=0, atol=0)
    model.to(torch.device("meta"), torch.bfloat16)  # a device move still moves them, dtypes kept
    assert all(v.device.type == "meta" and v.dtype == state[k].dtype for k, v in layer.state_dict().items())


def test_layer_lays_a_batch_out_for_the_backend_kernel_of_its_size(monkeypatch):
    """With the segment sizes kept on the device (local dispatch's rows-per-expert hint), the layer
    asks the backend for the alignment of a batch of that size (``alignment_for``: the cutlass
    backend's Triton pass wants none of the CUTLASS kernels' 128-row padding)."""
    import epmoe.layer as layer_module

    layer, _ = build("int8_channel", dispatch="local", backend="triton")
    asked, laid = [], []
    monkeypatch.setattr(layer.backend, "alignment_for", lambda rows, device: asked.append((rows, device)) or 16)
    real = layer_module.to_contiguous
    monkeypatch.setattr(layer_module, "to_contiguous", lambda *a, **k: laid.append(a[4]) or real(*a, **k))
    x, ids, w = make_case("random", 0, E, K, H)
    layer(x, topk_ids=ids, topk_weights=w)
    hint = -(-ids.numel() // E)
    assert asked == [(hint, layer.device)] and laid == [16]
