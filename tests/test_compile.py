"""torch.compile of models that hold the layer (CPU): the registered custom ops (opcheck), the
example DeepSeek block compiled with ``fullgraph=True`` against its eager result (torch backend,
and the Triton backend under the interpreter), graph breaks per dispatcher, and the traceable
torch paths (device-sized scatter, masked reference) against their eager forms.

The CPU tests compile with ``backend="aot_eager"``: dynamo and AOT autograd run in full (what
``fullgraph`` and the fake implementations are about) without Inductor's C++ code generation,
which costs about a minute per model on two cores. The GPU tests (tests/gpu/test_compile_gpu.py)
compile with Inductor.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch
import torch.distributed as dist

from epmoe import DeepEPMoELayer, ops
from epmoe.experts.base import ExpertWeights
from epmoe.experts.torch_backend import TorchBackend
from epmoe.layouts import MaskedBatch, _to_contiguous_torch, _to_contiguous_torch_device, gather_weighted
from epmoe.quant.schemes import get_scheme
from test_deepep_cpu import fake_deep_ep, loopback_layer, rank0_of_2  # noqa: F401 - stand-in deep_ep fixtures

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMPILER = "aot_eager"


def _example():
    spec = importlib.util.spec_from_file_location("deepseek_moe_block", os.path.join(ROOT, "examples", "deepseek_moe_block.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses resolve their annotations through it
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# ----------------------------------------------------------------------------------- custom ops
def _ids(r, k, e, g):
    return torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(r)])


def _op_cases():
    """``{qualified op name: (args, kwargs)}`` at tiny shapes where every output element is
    written (opcheck compares runs; rows a kernel leaves unwritten would differ)."""
    g = torch.Generator().manual_seed(0)
    e, cap, k_dim, n = 2, 4, 128, 32  # K and N the GPU kernels tile without edge cases
    x = torch.randn(6, k_dim, generator=g)
    q8 = torch.randint(-127, 128, (6, k_dim), generator=g, dtype=torch.int8)
    q8_scale = torch.rand(6, 1, generator=g) + 0.1
    full = torch.full((e,), cap, dtype=torch.int32)
    gate_up = torch.randn(e, cap, 2 * k_dim, generator=g)
    a = torch.randn(6, k_dim, generator=g)
    b = torch.randn(e, n, k_dim, generator=g)
    offsets = torch.tensor([0, 2, 6], dtype=torch.int32)
    ids = _ids(3, 2, 4, g)
    slot_pos = torch.tensor([[0, 3], [1, -1], [2, 4]], dtype=torch.int64)
    return {
        "epmoe::per_token_quant_int8": ((x, None, None, None, None), {}),
        "epmoe::per_group_quant": ((q8.float(), 16, torch.int8, None, None, None, None, False), {}),
        "epmoe::per_group_quant[mn_major]": ((q8.float()[:5], 16, torch.int8, None, None, None, None, True), {}),
        "epmoe::silu_and_mul": ((gate_up, torch.float32, full, 2), {}),
        "epmoe::silu_and_mul_quant": ((gate_up.reshape(-1, 2 * k_dim), "group", 16, torch.int8, None, None, None, False),
                                      {}),
        "epmoe::silu_and_mul_quant[mn_major]": (
            (gate_up[:1], "group", 16, torch.float8_e4m3fn, None, None, None, True), {}),  # fmt: skip
        "epmoe::grouped_gemm": ((a, b, offsets, False, "bf16", None, None, "fp32", torch.float32, None), {}),
        "epmoe::grouped_gemm[masked]": (
            (q8[:4].reshape(e, 2, k_dim), torch.randint(-127, 128, (e, n, k_dim), generator=g, dtype=torch.int8),
             torch.full((e,), 2, dtype=torch.int32), True, "int8_channel", q8_scale[:4].reshape(e, 2, 1),
             torch.rand(e, n, 1, generator=g) + 0.1, "int32", torch.float32, 1), {}),  # fmt: skip
        "epmoe::slot_layout_scatter": ((ids, 4, 1, q8[:3], q8_scale[:3], False), {}),  # every row written
        "epmoe::slot_layout_scatter[mn_major]": ((ids, 4, 1, q8[:3], torch.rand(3, 3, generator=g), True), {}),
        "epmoe::slot_layout_scatter[no_scale]": ((_ids(3, 2, 3, g), 3, 1, x[:3], None, False), {}),
        "epmoe::slot_positions": ((ids, torch.tensor([0, 2, 4, 5, 6], dtype=torch.int32), 6), {}),
        "epmoe::scatter_rows": ((q8[:3], slot_pos, 6, q8_scale[:3], True, False), {}),
        "epmoe::scatter_rows[mn_major]": ((q8[:3], slot_pos, 6, torch.rand(3, 2, generator=g), True, True), {}),
        "epmoe::gather_weighted": ((x, slot_pos, torch.rand(3, 2, generator=g), torch.float32), {}),
        # Alignment 1 and every slot local: every row of the layout is written.
        "epmoe::decode_prep": ((torch.randn(3, 16, generator=g), 2, True, "softmax", None, None, None, 1.0, x[:3], 1,
                                "int8_token", False), {}),  # fmt: skip
        "epmoe::decode_prep[grouped_mn_major]": (
            (torch.randn(3, 16, generator=g), 2, True, "sigmoid", 4, 2, torch.randn(16, generator=g) * 0.1, 2.5, x[:3],
             1, "int8_group", True), {}),  # fmt: skip
        "epmoe::decode_prep[float]": ((torch.randn(3, 16, generator=g), 2, False, "softmax", None, None, None, 1.0,
                                       x[:3], 1, "float", False), {}),  # fmt: skip
        "epmoe::fused_topk": ((torch.randn(5, 16, generator=g), 4, True, "softmax", None, None, None, 1.0), {}),
        "epmoe::fused_topk[grouped]": (
            (torch.randn(5, 16, generator=g), 4, True, "sigmoid", 4, 2, torch.randn(16, generator=g) * 0.1, 2.5),
            {}),  # fmt: skip
    }


GPU_ONLY = {"epmoe::cutlass_grouped_gemm", "epmoe::cutlass_masked_gemm", "epmoe::cutlass_silu_gemm",
            "epmoe::cutlass_silu_masked_gemm", "epmoe::deepgemm_contiguous",
            "epmoe::deepgemm_masked"}
"""CUTLASS and DeepGEMM run on a GPU only: opchecked in tests/gpu/test_compile_gpu.py."""


def _deepep_op_cases(buffer_id: int, channels: int):
    """The DeepEP ops' cases on an allocated loopback buffer (2 ranks, 16 experts, N = 4): three
    tokens with rank 0's experts, rank 1's and -1 slots; each combine gets its dispatch's handle."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(3, 2048, generator=g)
    ids = torch.tensor([[0, 9], [3, -1], [12, 5]])
    w = torch.rand(3, 2, generator=g)
    ll = ops.deepep_low_latency_dispatch(buffer_id, x.bfloat16(), ids, num_max_tokens=4, num_experts=16, num_ranks=2,
                                         use_fp8=False)  # fmt: skip
    q8 = torch.randint(-127, 128, (3, 2048), generator=g, dtype=torch.int8)
    q8_scale = torch.rand(3, 16, generator=g) + 0.1
    normal = ops.deepep_normal_dispatch(buffer_id, q8, q8_scale, ids, w, num_experts=16, alignment=1,
                                        num_worst_tokens=8, num_ranks=2, num_channels=channels)  # fmt: skip
    return {
        "epmoe::deepep_low_latency_dispatch": ((buffer_id, x.bfloat16(), ids, 4, 16, 2, False), {}),
        "epmoe::deepep_low_latency_dispatch[fp8]": ((buffer_id, x.bfloat16(), ids, 4, 16, 2, True), {}),
        "epmoe::deepep_low_latency_combine": (
            (buffer_id, torch.randn(8, 8, 2048, generator=g).bfloat16(), ids, w, ll[2], ll[3], 4, 16), {}),
        "epmoe::deepep_normal_dispatch": ((buffer_id, q8, q8_scale, ids, w, 16, 1, 8, 2, channels), {}),
        "epmoe::deepep_normal_dispatch[bf16]": ((buffer_id, x, None, ids, w, 16, 4, 8, 2, channels), {}),
        "epmoe::deepep_normal_combine": ((buffer_id, torch.randn(8, 2048, generator=g).bfloat16(), normal[4:]), {}),
    }


DEEPEP_OPS = {
    "epmoe::deepep_low_latency_dispatch[fp8]", "epmoe::deepep_low_latency_dispatch",
    "epmoe::deepep_low_latency_combine", "epmoe::deepep_normal_dispatch", "epmoe::deepep_normal_dispatch[bf16]",
    "epmoe::deepep_normal_combine",
}  # fmt: skip
"""The cases of :func:`_deepep_op_cases` (they need the stand-in deep_ep fixture)."""


@pytest.fixture
def loopback_buffer(rank0_of_2, single_rank_group):
    """An allocated DeepEP buffer owner on the loopback stand-in, both modes (a low-latency call
    after a normal one cleans the buffer, then waits at a barrier: over a one-rank gloo group)."""
    from epmoe.dispatch.deepep_dispatch import DeepEPBuffer
    from epmoe.dispatch.deepep_dispatch.sizing import BufferNeeds

    # opcheck compares runs with assert_close, to which NaN never equals NaN: finite garbage here.
    rank0_of_2.Buffer = type("_FiniteGarbage", (rank0_of_2.Buffer,), {"garbage": -3.0})
    buf = DeepEPBuffer()
    buf.register(BufferNeeds(2048, 16, 2, 4, frozenset({"normal", "low_latency"})), 2)
    buf.get()
    yield buf
    buf.close()


def test_every_registered_op_has_an_opcheck_case():
    cased = {name.split("[")[0] for name in [*_op_cases(), *DEEPEP_OPS]}
    assert set(ops.OPS) == cased | GPU_ONLY
    for name in ops.OPS:
        assert name.startswith(f"{ops.NAMESPACE}::")


@pytest.mark.parametrize("name", sorted(_op_cases()))
def test_opcheck(name):
    args, kwargs = _op_cases()[name]
    op = getattr(torch.ops.epmoe, name.split("::")[1].split("[")[0]).default
    torch.library.opcheck(op, args, kwargs)


@pytest.mark.parametrize("name", sorted(DEEPEP_OPS))
def test_opcheck_deepep(loopback_buffer, name):
    cases = _deepep_op_cases(loopback_buffer.id, loopback_buffer.normal_channels)
    assert set(cases) == DEEPEP_OPS
    args, kwargs = cases[name]
    op = getattr(torch.ops.epmoe, name.split("::")[1].split("[")[0]).default
    torch.library.opcheck(op, args, kwargs)


def test_gpu_only_ops_have_fake_shapes_without_a_gpu():
    """The CUTLASS / DeepGEMM ops trace (meta tensors reach only their fake implementations)."""
    meta = dict(device="meta")
    a = torch.empty(256, 256, dtype=torch.float8_e4m3fn, **meta)
    a_scale = torch.empty(256, 2, **meta)
    b = torch.empty(3, 384, 256, dtype=torch.float8_e4m3fn, **meta)
    b_scale = torch.empty(3, 3, 2, **meta)
    offsets = torch.empty(4, dtype=torch.int32, **meta)
    out = torch.ops.epmoe.cutlass_grouped_gemm("fp8_block", a, a_scale, b, b_scale, offsets, "n256_quarters_run4")
    assert (out.shape, out.dtype) == ((256, 384), torch.bfloat16)
    qa, qb = a.view(torch.int8).reshape(2, 128, 256), b.view(torch.int8)[:2]
    out = torch.ops.epmoe.cutlass_masked_gemm("int8_block", qa, a_scale.reshape(2, 128, 2), qb, b_scale[:2],
                                              torch.empty(2, dtype=torch.int32, **meta), "n256_quarters_run2")  # fmt: skip
    assert (out.shape, out.dtype) == ((2, 128, 384), torch.bfloat16)
    out = torch.ops.epmoe.deepgemm_contiguous(a, a_scale, b, b_scale, torch.empty(256, dtype=torch.int32, **meta))
    assert (out.shape, out.dtype) == ((256, 384), torch.bfloat16)
    a3, s3 = a.reshape(2, 128, 256), a_scale.reshape(2, 128, 2)
    out = torch.ops.epmoe.deepgemm_masked(a3, s3, b[:2], b_scale[:2], torch.empty(2, dtype=torch.int32, **meta), 8)
    assert (out.shape, out.dtype) == ((2, 128, 384), torch.bfloat16)


# ------------------------------------------------------------------------ the example block
def _block(backend: str, quant: str):
    ex = _example()
    cfg = ex.MoEConfig(hidden_size=128, moe_intermediate_size=128, n_routed_experts=8, n_shared_experts=1,
                       num_experts_per_tok=2, n_group=4, topk_group=2)  # fmt: skip
    block = ex.DeepseekV3MoE(cfg, quant=quant, device="cpu")
    block.experts = DeepEPMoELayer(
        cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size, quant=quant,
        backend=backend, device="cpu", scoring_func="sigmoid", num_expert_group=cfg.n_group,
        topk_group=cfg.topk_group, routed_scaling_factor=cfg.routed_scaling_factor, use_correction_bias=True,
    )  # fmt: skip
    tensors = list(ex.random_checkpoint(cfg, quant))
    block.experts.load_weights((nt for nt in tensors if ".shared_experts." not in nt[0]), strict=True)
    block.load_shared_experts(nt for nt in tensors if ".shared_experts." in nt[0])
    return block, cfg


@pytest.mark.parametrize("backend,quant", [("torch", "int8_channel"), ("triton", "int8_channel")])
def test_example_block_compiles_in_one_graph_and_matches_eager(backend, quant):
    block, cfg = _block(backend, quant)
    assert block.experts.backend.name == backend
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, cfg.hidden_size, generator=g).bfloat16()
    with torch.no_grad():
        ref = block(x)
        compiled = torch.compile(block, fullgraph=True, backend=COMPILER)
        out = compiled(x)
    assert torch.isfinite(ref).all() and ref.abs().max() > 0
    # The same kernels and torch ops in the same order: equal up to one bf16 rounding.
    torch.testing.assert_close(out.float(), ref.float(), rtol=8e-3, atol=8e-3 * float(ref.abs().max()))


# ---------------------------------------------------------------------- graph breaks per dispatcher
def _layer(dispatch: str) -> DeepEPMoELayer:
    g = torch.Generator().manual_seed(2)
    layer = DeepEPMoELayer(8, 2, 64, 32, quant="int8_channel", backend="torch", dispatch=dispatch, device="cpu",
                           params_dtype=torch.float32)  # fmt: skip
    from epmoe.quant import quantize_weight

    w13, s13 = quantize_weight(torch.randn(8, 64, 64, generator=g) / 8, layer.scheme)
    w2, s2 = quantize_weight(torch.randn(8, 64, 32, generator=g) / 6, layer.scheme)
    layer.load_experts(w13, w2, s13, s2)
    return layer


def test_local_dispatch_has_no_graph_break():
    layer = _layer("local")
    x, logits = torch.randn(5, 64), torch.randn(5, 8)
    e = torch._dynamo.explain(layer)(x, logits)
    assert (e.graph_count, e.graph_break_count) == (1, 0), e.break_reasons


@pytest.fixture
def single_rank_group():
    """A one-rank gloo group: all_to_all runs its collectives (with itself)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_all_to_all_breaks_only_at_its_send_and_combine(single_rank_group):
    layer = _layer("all_to_all")
    assert layer.dispatcher.name == "all_to_all"
    x, logits = torch.randn(5, 64), torch.randn(5, 8)
    e = torch._dynamo.explain(layer)(x, logits)
    # The two documented breaks and no other: the dispatcher's host-synced send and its collective
    # combine (dynamo reports the send once per frame it unwinds: forward, then dispatch).
    reasons = {str(b.reason).split("Skip inlining function <function ")[-1].split(" ")[0] for b in e.break_reasons}
    assert reasons == {"AllToAllDispatcher.send", "AllToAllDispatcher.combine"}, e.break_reasons
    assert e.graph_break_count == 2


# ------------------------------------------------------------------- validation while compiling
def test_value_checks_run_eagerly_and_are_skipped_while_compiling():
    layer = _layer("local")
    x, logits = torch.randn(4, 64), torch.randn(4, 8)
    compiled = torch.compile(layer, fullgraph=True, backend=COMPILER)
    compiled(x, logits)
    bad = logits.clone()
    bad[1, 3] = float("nan")
    with pytest.raises(ValueError, match="router_logits contain NaN"):
        layer(x, bad)
    # The compiled graph holds no host read: the NaN row is routed like any other, and the
    # tokens whose logits are finite keep their results.
    out = compiled(x, bad)
    torch.testing.assert_close(out[[0, 2, 3]], layer(x[[0, 2, 3]], logits[[0, 2, 3]]), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------- traceable torch paths
@pytest.mark.parametrize("alignment", [1, 4])
def test_device_sized_scatter_matches_the_host_sized_one(alignment):
    g = torch.Generator().manual_seed(3)
    r, k, e = 7, 3, 5
    ids = torch.randint(0, e, (r, k), generator=g)
    ids[2] = -1  # a token with no local slot
    ids[4, 1] = ids[4, 0]  # an expert named twice by one token
    ids[5, 2] = e + 2  # another rank's expert
    x = torch.randn(r, 16, generator=g)
    xs = torch.rand(r, 2, generator=g)
    host = _to_contiguous_torch(x, xs, ids, e, alignment)
    dev = _to_contiguous_torch_device(x, xs, ids, e, alignment, expected_m=2)
    # 21 slots in at most 5 experts: 21 + 5 * 3 = 36 rows with 4-row segments (max_rows).
    assert dev.x.shape[0] == (21 if alignment == 1 else 36) and dev.expected_m == 2
    assert dev.num_rows.tolist() == host.num_rows
    m = host.expert_offsets[-1].item()
    torch.testing.assert_close(dev.expert_offsets, host.expert_offsets, rtol=0, atol=0)
    torch.testing.assert_close(dev.slot_pos, host.slot_pos, rtol=0, atol=0)
    torch.testing.assert_close(dev.m_indices[:m], host.m_indices, rtol=0, atol=0)
    assert (dev.m_indices[m:] == -1).all()
    torch.testing.assert_close(dev.x[:m], host.x, rtol=0, atol=0)
    torch.testing.assert_close(dev.x_scale[:m], host.x_scale, rtol=0, atol=0)
    assert (dev.x[m:] == 0).all()
    w = torch.rand(r, k, generator=g)
    torch.testing.assert_close(gather_weighted(dev.x, dev.slot_pos, w), gather_weighted(host.x, host.slot_pos, w))


@pytest.mark.parametrize("grouped", [False, True])
def test_fused_routing_traces_as_one_op(grouped):
    """select_experts on the fused kernel compiles in one graph (one custom op, no break) and
    gives the eager ids and weights."""
    from epmoe.routing import select_experts

    kw = dict(scoring_func="sigmoid", num_expert_group=4, topk_group=2, correction_bias=torch.randn(16) * 0.1,
              routed_scaling_factor=2.5) if grouped else {}  # fmt: skip

    def route(logits):
        return select_experts(logits, 4, kernel=True, **kw)

    logits = torch.randn(6, 16, generator=torch.Generator().manual_seed(2))
    explained = torch._dynamo.explain(route)(logits)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    ids, w = torch.compile(route, fullgraph=True, backend=COMPILER)(logits)
    want_ids, want_w = route(logits)
    assert torch.equal(ids, want_ids) and torch.equal(w, want_w)


def test_gather_ignores_nan_on_unused_rows():
    out = torch.tensor([[1.0, 2.0], [float("nan"), float("nan")], [3.0, 4.0]])
    slot_pos = torch.tensor([[0, -1], [2, 0]])
    w = torch.tensor([[0.5, 7.0], [1.0, 2.0]])
    got = gather_weighted(out, slot_pos, w)
    torch.testing.assert_close(got, torch.tensor([[0.5, 1.0], [5.0, 8.0]]))


@pytest.mark.parametrize("quant", ["fp8_block"])
def test_torch_masked_path_traced_matches_eager(quant):
    scheme = get_scheme(quant)
    g = torch.Generator().manual_seed(4)
    e, cap, h, i = 3, 4, 128, 128
    from epmoe.quant import quantize_weight

    w13, s13 = quantize_weight(torch.randn(e, 2 * i, h, generator=g) / 11, scheme)
    w2, s2 = quantize_weight(torch.randn(e, h, i, generator=g) / 11, scheme)
    weights = ExpertWeights(scheme, w13, w2, s13, s2)
    x = torch.randn(e, cap, h, generator=g)
    x[1, 3] = float("nan")  # garbage past masked_m must not leak
    batch = MaskedBatch(x, None, torch.tensor([2, 3, 0], dtype=torch.int32), 2)
    backend = TorchBackend(scheme)
    ref = backend.run_masked(batch, weights, torch.float32)
    fn = torch.compile(lambda xx, mm: backend.run_masked(MaskedBatch(xx, None, mm, 2), weights, torch.float32),
                       fullgraph=True, backend=COMPILER)  # fmt: skip
    got = fn(x, batch.masked_m)
    for ex, n in enumerate(batch.masked_m.tolist()):
        torch.testing.assert_close(got[ex, :n], ref[ex, :n], rtol=1e-5, atol=1e-5)
        assert (got[ex, n:] == 0).all()


# ---------------------------------------------------------------------------------- DeepEP
# A loopback stand-in for DeepEP (tests/test_deepep_cpu.py): the layer runs as rank 0 of 2 and
# DeepEP's calls return what v1.2.1 returns, so the dispatchers run end to end, eager and traced.
LOOPBACK = {
    "deepep_low_latency": dict(max_tokens_per_rank=8),
    "deepep_low_latency[fp8]": dict(max_tokens_per_rank=8, quant="int8_channel", low_latency_int8_payload="fp8_group"),
    "deepep_normal[bounded]": dict(normal_max_tokens_per_rank=8, quant="int8_channel"),
}
"""Layer arguments per case: BF16 low-latency, FP8 low-latency (INT8 experts requantizing), bounded
normal mode with an INT8 payload."""


def _loopback_inputs(t: int = 5):
    g = torch.Generator().manual_seed(7)
    logits = torch.randn(t, 16, generator=g)
    logits[:, 8:] -= 2  # most slots on rank 0's experts, some on rank 1's
    return torch.randn(t, 2048, generator=g), logits


@pytest.mark.parametrize("case", sorted(LOOPBACK))
def test_deepep_without_host_sync_has_no_graph_break(rank0_of_2, case):
    layer = loopback_layer(case.split("[")[0], **LOOPBACK[case])
    x, logits = _loopback_inputs()
    ref = layer(x, logits)  # the first batch allocates the DeepEP buffer (a collective), eagerly
    e = torch._dynamo.explain(layer)(x, logits)
    assert (e.graph_count, e.graph_break_count) == (1, 0), e.break_reasons
    out = torch.compile(layer, fullgraph=True, backend=COMPILER)(x, logits)
    # Traced, the torch backend runs every expert over every row (docs/compile.md); DeepEP's combine
    # rounds to bf16: equal up to one bf16 rounding.
    torch.testing.assert_close(out, ref, rtol=8e-3, atol=8e-3 * float(ref.abs().max()))
    layer.dispatcher.buffer.close()


def test_unbounded_deepep_normal_breaks_only_where_the_host_waits(rank0_of_2):
    """Without normal_max_tokens_per_rank the host waits for DeepEP's receive counts: one
    documented break there (dynamo reports it once per frame it unwinds), none at combine."""
    layer = loopback_layer("deepep_normal", quant="int8_channel")
    x, logits = _loopback_inputs()
    ref = layer(x, logits)
    e = torch._dynamo.explain(layer)(x, logits)
    reasons = {str(b.reason).split("Skip inlining function <function ")[-1].split(" ")[0] for b in e.break_reasons}
    assert reasons == {"DeepEPNormalDispatcher._send_host_synced"}, e.break_reasons
    compiled = torch.compile(layer, backend=COMPILER)
    out = compiled(x, logits)
    torch.testing.assert_close(out, ref, rtol=8e-3, atol=8e-3 * float(ref.abs().max()))
    # Other receive counts, same graphs: the send's host list is not baked into what follows it.
    x2, logits2 = x.flip(0), logits.roll(3, dims=1)
    with torch._dynamo.config.patch(error_on_recompile=True):
        out2 = compiled(x2, logits2)
    ref2 = layer(x2, logits2)
    torch.testing.assert_close(out2, ref2, rtol=8e-3, atol=8e-3 * float(ref2.abs().max()))
    layer.dispatcher.buffer.close()


def test_deepep_auto_breaks_only_at_its_routing_and_combine(rank0_of_2, single_rank_group):
    """deepep_auto agrees on the mode over the ranks (an all-reduce read on the host, here over a
    one-rank gloo group) and combines in the mode it chose: its documented breaks, both modes."""
    layer = loopback_layer("deepep_auto", max_tokens_per_rank=8, quant="int8_channel")
    for t, mode in ((5, "low_latency"), (11, "normal")):
        x, logits = _loopback_inputs(t)
        ref = layer(x, logits)
        before = dict(layer.dispatcher.stats)
        e = torch._dynamo.explain(layer)(x, logits)
        assert layer.dispatcher.stats[mode] > before[mode]
        reasons = {str(b.reason).split("Skip inlining function <function ")[-1].split(" ")[0] for b in e.break_reasons}
        assert reasons == {"DeepEPAutoDispatcher._route", "DeepEPAutoDispatcher.combine"}, (mode, e.break_reasons)
        out = torch.compile(layer, backend=COMPILER)(x, logits)
        torch.testing.assert_close(out, ref, rtol=8e-3, atol=8e-3 * float(ref.abs().max()))
    layer.dispatcher.buffer.close()


def test_compiling_deepep_before_its_buffer_is_allocated_says_what_to_do(rank0_of_2):
    layer = loopback_layer("deepep_low_latency", max_tokens_per_rank=8)
    with pytest.raises(Exception, match="run one batch eagerly before compiling"):
        torch.compile(layer, fullgraph=True, backend=COMPILER)(*_loopback_inputs())
    layer.dispatcher.buffer.close()


@pytest.mark.parametrize("case", ["deepep_low_latency", "deepep_normal[bounded]"])
def test_example_block_on_deepep_compiles_in_one_graph_and_matches_eager(rank0_of_2, case):
    """The example DeepSeek block (gate, shared experts, routed experts) with a DeepEP dispatcher
    that needs no host sync: fullgraph=True, the compiled block's result equal to its eager one."""
    ex = _example()
    cfg = ex.MoEConfig(hidden_size=2048, moe_intermediate_size=128, n_routed_experts=16, n_shared_experts=1,
                       num_experts_per_tok=2, n_group=4, topk_group=2)  # fmt: skip
    kwargs = {"quant": "bf16", **LOOPBACK[case]}
    block = ex.DeepseekV3MoE(cfg, quant=kwargs["quant"], device="cpu")
    block.experts.dispatcher.buffer.close()  # the example's own layer (dispatch="auto"), replaced:
    block.experts = DeepEPMoELayer(
        cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size, backend="torch",
        dispatch=case.split("[")[0], device="cpu", scoring_func="sigmoid", num_expert_group=cfg.n_group,
        topk_group=cfg.topk_group, routed_scaling_factor=cfg.routed_scaling_factor, use_correction_bias=True, **kwargs,
    )  # fmt: skip
    tensors = list(ex.random_checkpoint(cfg, kwargs["quant"]))
    block.experts.load_weights((nt for nt in tensors if ".shared_experts." not in nt[0]), strict=True)
    block.load_shared_experts(nt for nt in tensors if ".shared_experts." in nt[0])
    x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(8)).bfloat16()
    with torch.no_grad():
        ref = block(x)
        out = torch.compile(block, fullgraph=True, backend=COMPILER)(x)
    assert torch.isfinite(ref).all() and ref.abs().max() > 0
    torch.testing.assert_close(out.float(), ref.float(), rtol=8e-3, atol=8e-3 * float(ref.abs().max()))
    block.experts.dispatcher.buffer.close()


def test_cutlass_fp8_alignment_traces_without_a_package_lookup(monkeypatch):
    """The FP8 implementation (sgl-kernel's op or the package's kernel) is decided when the backend
    is built: the forward reads ``alignment``, and dynamo (torch 2.11) cannot trace importlib's
    ``find_spec`` behind the decision (fp8_block failed to compile on the GPU that way)."""
    from epmoe.experts import cutlass_backend as cb

    backend = cb.CutlassBackend(get_scheme("fp8_block"))

    def looked_up():
        raise AssertionError("the sgl-kernel lookup ran in the forward")

    monkeypatch.setattr(cb, "_use_sgl", looked_up)
    fn = torch.compile(lambda x: x + backend.alignment, fullgraph=True, backend="eager")
    assert fn(torch.zeros(1)).item() == backend.alignment == cb.ROW_BLOCK


def test_cutlass_int8_block_schedule_traces(monkeypatch):
    """The INT8 block kernel's schedule is looked up in the forward for the weights' device (the
    schedule file and the GPU name, which dynamo cannot trace): traced, it is the lookup's answer,
    taken once as a constant."""
    from epmoe.experts import cutlass_backend as cb

    monkeypatch.delenv(cb.INT8_BLOCK_SCHEDULE_ENV, raising=False)
    monkeypatch.setattr(cb, "gpu_name", lambda device: "NVIDIA H200")  # the host stands for a GPU with a measured entry
    cb.measured_schedule.cache_clear()
    backend = cb.CutlassBackend(get_scheme("int8_block"))
    want = cb.int8_block_schedule(torch.device("cpu"))
    fn = torch.compile(lambda x: x + cb.INT8_BLOCK_SCHEDULES.index(backend.schedule_for(x.device)), fullgraph=True,
                       backend="eager")  # fmt: skip
    assert fn(torch.zeros(1)).item() == cb.INT8_BLOCK_SCHEDULES.index(want)


@pytest.mark.parametrize("quant", ["int8_channel", "int8_block"])
def test_cutlass_int8_kernel_choice_traces_and_follows_the_rule(quant, monkeypatch):
    """The INT8 kernel choice (``alignment_for``, ``int8_kernel``) reads the crossover file and the
    GPU name, which dynamo cannot trace (``posix.stat``: the compiled block on CUTLASS INT8 failed
    that way on the GPU). Traced, the choice is the rule's, at sizes either side of the crossover,
    also when the batch size is dynamic."""
    from epmoe.experts import cutlass_backend as cb

    measured = [dict(rows_per_expert=r, triton_ms=t, cutlass_ms=c) for r, t, c in ((8, 1.0, 2.0), (16, 2.0, 1.0), (64, 3.0, 1.0))]
    monkeypatch.setattr(cb, "crossover_data", lambda: {"cpu": {quant: {"measured": measured, "source": "test"}}})
    cb._rule.cache_clear()
    try:
        backend = cb.CutlassBackend(get_scheme(quant), accumulator="int32" if quant == "int8_channel" else "fp32")
        rule = cb.int8_rule(torch.device("cpu"), quant)

        def step(x):
            rows = x.shape[0] // 2
            return x + backend.alignment_for(rows, x.device) + 1000 * (cb.int8_kernel_for(x.device, quant, rows) == "cutlass")

        fn = torch.compile(step, fullgraph=True, backend="eager")
        for n in (2, 30, 32, 34, 4, 8):
            want = backend.alignment_for(n // 2, torch.device("cpu")) + 1000 * (rule.kernel_for(n // 2) == "cutlass")
            assert fn(torch.zeros(n))[0].item() == want, n
        assert rule.kernel_for(1) == "triton" and rule.kernel_for(16) == "cutlass"
    finally:
        cb._rule.cache_clear()
