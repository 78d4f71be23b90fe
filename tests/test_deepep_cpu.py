"""What of the DeepEP dispatchers runs without DeepEP: the capacity decision, buffer sizing and
registration rules, refusals with reasons, payload conversion. A fake ``deep_ep`` module stands in
for the real one where the buffer owner is exercised."""

from __future__ import annotations

import sys
import types

import pytest
import torch

import epmoe.dispatch.deepep_dispatch.buffer as db
import epmoe.dispatch.deepep_dispatch.dispatchers as dd
from epmoe.dispatch.base import DispatchConfig
from epmoe.dispatch.deepep_dispatch import DeepEPBuffer, DeepEPBufferError
from epmoe.dispatch.deepep_dispatch.dispatchers import normal_payload, pad_empty_batch
from epmoe.dispatch.deepep_dispatch.sizing import (
    BufferNeeds,
    choose_mode,
    expected_rows_per_expert,
    low_latency_shape_problems,
    low_latency_tokens,
    plan_buffer,
)
from epmoe.quant.reference import dequantize_rows, quantize_rows

NVL = lambda hidden_bytes: 1000 * hidden_bytes  # noqa: E731 - fake size hints
LL = lambda t, h, r, e: t * h * r * e  # noqa: E731
BOTH = frozenset({"normal", "low_latency"})


def needs(h=7168, e=256, k=8, t=128, modes=BOTH):
    return BufferNeeds(h, e, k, t, frozenset(modes))


# ------------------------------------------------------------------------------ capacity rule
@pytest.mark.parametrize(
    "global_max, cap, mode",
    [(0, 128, "low_latency"), (128, 128, "low_latency"), (129, 128, "normal"), (4096, 128, "normal")],
)
def test_capacity_decision(global_max, cap, mode):
    assert choose_mode(global_max, cap) == mode


def test_low_latency_tokens_keep_tma_alignment():
    assert low_latency_tokens(128, 2) == 128
    assert low_latency_tokens(43, 2) == 44  # 2 * 43 is not a multiple of 4
    assert low_latency_tokens(5, 4) == 5
    assert low_latency_tokens(7, 1) == 8
    assert low_latency_tokens(0, 2) == 2


# ------------------------------------------------------------------------------ sizing
def test_plan_sizes_from_the_largest_registration():
    plan = plan_buffer(
        [needs(h=4096, modes={"normal"}), needs(h=7168, t=64), needs(h=7168, t=128, modes={"low_latency"})],
        2, NVL, LL,
    )  # fmt: skip
    assert plan.num_nvl_bytes == 1000 * 7168 * 2  # bf16 rows of the largest hidden size
    assert plan.num_rdma_bytes == 128 * 7168 * 2 * 256
    assert plan.low_latency_mode and plan.num_qps_per_rank == 128
    assert (plan.ll_max_tokens, plan.ll_hidden_size, plan.ll_num_experts) == (128, 7168, 256)


def test_plan_normal_only_has_no_rdma():
    plan = plan_buffer([needs(modes={"normal"})], 2, NVL, LL)
    assert plan.num_rdma_bytes == 0 and not plan.low_latency_mode and plan.num_qps_per_rank == 1


def test_plan_refuses_mixed_low_latency_shapes():
    with pytest.raises(DeepEPBufferError, match="same \\(hidden_size, num_experts\\)"):
        plan_buffer([needs(h=7168), needs(h=4096)], 2, NVL, LL)
    with pytest.raises(ValueError, match="no layer registered"):
        plan_buffer([], 2, NVL, LL)


def test_bad_modes_refused():
    with pytest.raises(ValueError, match="modes"):
        needs(modes={"fast"})


# ------------------------------------------------------------------------------ refusals
def test_low_latency_hidden_refused_with_reason():
    problems = low_latency_shape_problems(7000, 8, 256, 2, 128)
    assert len(problems) == 1 and "hidden_size=7000" in problems[0] and "7168" in problems[0]
    assert any("top_k=12" in p for p in low_latency_shape_problems(7168, 12, 256, 2, 128))
    assert low_latency_shape_problems(7168, 8, 256, 2, 128) == []
    buf = DeepEPBuffer()
    with pytest.raises(DeepEPBufferError, match="hidden_size=7000 is not one DeepEP low-latency"):
        buf.register(needs(h=7000), world_size=2)
    buf.register(needs(h=7040, modes={"normal"}), world_size=2)  # normal mode takes it
    with pytest.raises(DeepEPBufferError, match="support \\[2, 4, 8\\] ranks; the group has 3"):
        buf.register(needs(modes={"normal"}), world_size=3)


def test_dispatcher_availability_names_the_conditions():
    cfg = DispatchConfig(num_experts=256, hidden_size=7040, top_k=8, world_size=2)
    ok, reason = dd.DeepEPLowLatencyDispatcher.available(cfg)
    assert not ok
    assert "hidden_size=7040" in reason and "CUDA device" in reason
    ok, reason = dd.DeepEPNormalDispatcher.available(cfg)
    assert not ok and "hidden_size" not in reason and "CUDA device" in reason
    cfg = DispatchConfig(num_experts=256, hidden_size=7168, top_k=8, world_size=1)
    ok, reason = dd.DeepEPAutoDispatcher.available(cfg)
    assert not ok and "at least 2 ranks" in reason


@pytest.mark.skipif(dd.import_deep_ep()[0] is not None, reason="deep_ep is installed here")
def test_missing_deep_ep_is_a_reason_and_the_layer_refuses():
    from epmoe.dispatch.select import DispatcherUnavailableError
    from epmoe.layer import DeepEPMoELayer

    cfg = DispatchConfig(num_experts=16, hidden_size=2048, top_k=4, world_size=2)
    for cls in (dd.DeepEPNormalDispatcher, dd.DeepEPLowLatencyDispatcher, dd.DeepEPAutoDispatcher):
        ok, reason = cls.available(cfg)
        assert not ok and "deep_ep is not importable" in reason
    for dispatch in ("deepep_normal", "deepep_low_latency", "deepep_auto"):
        with pytest.raises(DispatcherUnavailableError, match="deep_ep is not importable") as info:
            DeepEPMoELayer(16, 4, 2048, 256, dispatch=dispatch, backend="torch", device="cpu")
        assert dispatch in str(info.value) and "CUDA device" in str(info.value)
    # dispatch="auto" on one process still picks the local dispatcher.
    layer = DeepEPMoELayer(16, 4, 2048, 256, backend="torch", device="cpu", params_dtype=torch.float32)
    assert layer.dispatcher.name == "local"


# ------------------------------------------------------------------------------ buffer owner
class _FakeConfig:
    def get_nvl_buffer_size_hint(self, hidden_bytes, num_ranks):
        return NVL(hidden_bytes)


class _FakeBuffer:
    made: list = []
    num_sms = 20  # deep_ep.Buffer's class attribute: the SMs of its recommended normal-mode configs

    def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, **kwargs):
        self.args = dict(nvl=num_nvl_bytes, rdma=num_rdma_bytes, **kwargs)
        self.cleaned, self.destroyed = [], False
        _FakeBuffer.made.append(self)

    get_dispatch_config = staticmethod(lambda n: _FakeConfig())
    get_combine_config = staticmethod(lambda n: _FakeConfig())
    get_low_latency_rdma_size_hint = staticmethod(LL)

    def clean_low_latency_buffer(self, *args):
        self.cleaned.append(args)

    def destroy(self):
        self.destroyed = True


class _FakeChunkConfig(_FakeConfig):
    def __init__(self, *args):
        self.args = args

    def get_nvl_buffer_size_hint(self, hidden_bytes, num_ranks):
        return self.args[0] * NVL(hidden_bytes)


@pytest.fixture
def fake_deep_ep(monkeypatch):
    mod = types.ModuleType("deep_ep")
    mod.Buffer = _FakeBuffer
    mod.Config = _FakeChunkConfig
    _FakeBuffer.made = []
    monkeypatch.setitem(sys.modules, "deep_ep", mod)
    monkeypatch.setattr(DeepEPBuffer, "world_size", property(lambda self: 2))
    monkeypatch.setattr(db, "_LIVE_LOW_LATENCY", [0])
    return mod


def test_buffer_lazy_shared_and_sized_from_largest(fake_deep_ep):
    buf = DeepEPBuffer()
    buf.register(needs(t=64))
    buf.register(needs(t=128, modes={"low_latency"}))
    buf.register(needs(h=4096, modes={"normal"}))
    assert not buf.allocated and not _FakeBuffer.made  # nothing allocated at registration
    b = buf.get()
    assert buf.get() is b and len(_FakeBuffer.made) == 1  # one deep_ep.Buffer, shared
    assert b.args["nvl"] == NVL(7168 * 2) and b.args["rdma"] == LL(128, 7168, 2, 256)
    assert b.args["low_latency_mode"] and b.args["num_qps_per_rank"] == 128
    assert b.args["explicitly_destroy"]
    # A registration that fits is accepted after allocation; one that needs more is refused.
    buf.register(needs(t=100))
    with pytest.raises(DeepEPBufferError, match="already allocated and max_tokens_per_rank=256 exceeds"):
        buf.register(needs(t=256))
    with pytest.raises(DeepEPBufferError, match="already allocated and hidden_size=8192 exceeds"):
        buf.register(needs(h=8192, modes={"normal"}))
    buf.close()
    assert b.destroyed and not buf.allocated
    with pytest.raises(DeepEPBufferError, match="closed"):
        buf.get()
    buf.close()  # idempotent


def test_normal_only_buffer_refuses_low_latency_later(fake_deep_ep):
    buf = DeepEPBuffer()
    buf.register(needs(modes={"normal"}))
    b = buf.get()
    assert not b.args["low_latency_mode"] and b.args["rdma"] == 0
    with pytest.raises(DeepEPBufferError, match="allocated without low-latency mode"):
        buf.register(needs(modes={"low_latency"}))


def test_clean_only_after_normal_use(fake_deep_ep):
    buf = DeepEPBuffer()
    buf.register(needs(t=43))
    b = buf.get()
    assert not buf.clean_low_latency() and b.cleaned == []
    buf.mark_normal_used()
    assert buf.low_latency_dirty
    assert buf.clean_low_latency()
    assert b.cleaned == [(44, 7168, 256)]  # DeepEP's capacity, rounded for 2 ranks
    assert not buf.clean_low_latency() and len(b.cleaned) == 1


def test_second_low_latency_buffer_in_a_process_refused(fake_deep_ep):
    first = DeepEPBuffer()
    first.register(needs())
    first.get()
    second = DeepEPBuffer()
    second.register(needs())
    with pytest.raises(DeepEPBufferError, match="share one DeepEPBuffer"):
        second.get()
    first.close()
    second.get()  # allowed once the first one is gone


def test_ops_reach_an_open_buffer_by_its_id_only():
    """The DeepEP custom ops find their buffer by id: every owner has its own, closing it or
    dropping the last reference to it (the registry is weak) takes it out, with a clear error."""
    import gc

    a, b = DeepEPBuffer(), DeepEPBuffer()
    assert a.id != b.id and db.buffer_by_id(a.id) is a and db.buffer_by_id(b.id) is b
    a.close()
    with pytest.raises(DeepEPBufferError, match=f"no open DeepEPBuffer has id={a.id} .it was closed"):
        db.buffer_by_id(a.id)
    gone = b.id
    del b
    gc.collect()
    with pytest.raises(DeepEPBufferError, match=f"id={gone}"):
        db.buffer_by_id(gone)


def test_allocation_needs_registrations(fake_deep_ep):
    with pytest.raises(ValueError, match="no layer registered"):
        DeepEPBuffer().get()


# ------------------------------------------------------------------------------ payloads
def test_normal_payload_packing():
    x = torch.randn(5, 256)
    xb = normal_payload(x, None)
    assert xb.dtype == torch.bfloat16 and xb.shape == (5, 256)
    q, s = quantize_rows(x, torch.int8, 127.0, None)
    packed = normal_payload(q, s)
    assert isinstance(packed, tuple) and packed[0].dtype == torch.int8 and packed[1].shape == (5, 1)
    q, s = quantize_rows(x, torch.float8_e4m3fn, 448.0, 128)
    packed = normal_payload(q, s)
    assert packed[0].dtype == torch.float8_e4m3fn and packed[1].shape == (5, 2)
    with pytest.raises(TypeError, match="needs its scales"):
        normal_payload(q, None)
    with pytest.raises(TypeError, match="1-byte"):
        normal_payload(x, s)
    with pytest.raises(ValueError, match="\\[T, S\\]"):
        normal_payload(q, s[:3])


def test_pad_empty_batch():
    x = torch.zeros(0, 256, dtype=torch.bfloat16)
    ids, w = torch.zeros(0, 4, dtype=torch.int64), torch.zeros(0, 4)
    px, pids, pw = pad_empty_batch(x, ids, w)
    assert px.shape == (1, 256) and px.dtype == torch.bfloat16
    assert (pids == -1).all() and pids.shape == (1, 4) and (pw == 0).all()
    x1 = torch.ones(3, 256)
    assert pad_empty_batch(x1, ids, w)[0] is x1


def test_expected_rows_hint():
    assert expected_rows_per_expert(128, 2, 8, 256) == 8
    assert expected_rows_per_expert(1, 2, 4, 256) == 1


# ------------------------------------------------------------------------------ normal dispatch bound
def _normal_handle(num_tokens: int, num_recv: int, channels: int = 10):
    """A DeepEP intranode handle's six tensors for 2 ranks (shapes as DeepEP allocates them)."""
    i32 = dict(dtype=torch.int32)
    return (
        torch.zeros(2, 2, **i32), torch.zeros(2, channels, **i32), torch.zeros(2, channels, **i32),
        torch.arange(num_recv, **i32), torch.ones(num_tokens, 2, dtype=torch.bool), torch.zeros(num_tokens, 2, **i32),
    )  # fmt: skip


class _FakeDispatchBuffer(_FakeBuffer):
    """Records what normal-mode dispatch was asked for; receives every row unchanged."""

    def get_dispatch_layout(self, topk_ids, num_experts):
        return "per_rank", None, "per_expert", torch.ones(topk_ids.shape[0], 2, dtype=torch.bool), None

    def dispatch(self, x, **kw):
        self.dispatch_kw = kw
        worst = kw["num_worst_tokens"]
        ids, w = kw["topk_idx"], kw["topk_weights"]
        t = ids.shape[0]
        if worst:  # DeepEP's worst-case receive buffers: rows past the received ones carry -1 ids
            pad = lambda a, fill: torch.cat([a, a.new_full((worst - t, *a.shape[1:]), fill)])  # noqa: E731
            x = tuple(pad(a, 0) for a in x) if isinstance(x, tuple) else pad(x, 0)
            ids, w = pad(ids, -1), pad(w, 0)
        self.handle = _normal_handle(t, worst or t, self.num_sms // 2)
        return x, ids, w, ([] if worst else [3, 5]), self.handle, None

    def combine(self, y, handle, config=None):
        self.combined = dict(y=y, handle=handle)
        return y, None, None


@pytest.mark.parametrize("cap", [None, 64])
def test_normal_dispatch_waits_for_counts_only_without_a_bound(fake_deep_ep, cap):
    fake_deep_ep.Buffer = _FakeDispatchBuffer
    cfg = DispatchConfig(num_experts=4, hidden_size=256, top_k=2, world_size=2, normal_max_tokens_per_rank=cap)
    disp = dd.DeepEPNormalDispatcher(cfg)
    ids = torch.tensor([[0, 3], [1, 2], [2, 0]])
    d = disp.send(torch.randn(3, 256), None, ids, torch.rand(3, 2))
    kw = _FakeBuffer.made[-1].dispatch_kw
    if cap is None:
        assert kw["num_worst_tokens"] == 0 and d.padded_rows == [3, 5] and d.expected_m is None
    else:
        assert kw["num_worst_tokens"] == 2 * cap and d.padded_rows is None
        assert d.expected_m == expected_rows_per_expert(3, 2, 2, 4)
        with pytest.raises(ValueError, match="batch of 65 tokens exceeds normal_max_tokens_per_rank=64 on rank 0"):
            disp.send(torch.randn(65, 256), None, torch.zeros(65, 2, dtype=torch.int64), torch.rand(65, 2))
    disp.buffer.close()


@pytest.mark.parametrize("t", [3, 0])
def test_normal_combine_returns_the_batch_rows(fake_deep_ep, t):
    """Combine hands DeepEP the handle and BF16 rows and returns the batch's own rows: the combined
    tensor itself, or the dummy row of an empty batch dropped."""
    fake_deep_ep.Buffer = _FakeDispatchBuffer
    disp = dd.DeepEPNormalDispatcher(DispatchConfig(num_experts=4, hidden_size=256, top_k=2, world_size=2))
    d = disp.send(torch.randn(t, 256), None, torch.zeros(t, 2, dtype=torch.int64), torch.rand(t, 2))
    y = torch.randn(d.x.shape[0], 256, dtype=torch.float32)
    out = disp.combine(y, d)
    buf = _FakeBuffer.made[-1]
    assert buf.combined["handle"] == buf.handle and buf.combined["y"].dtype == torch.bfloat16
    assert out.shape == (t, 256) and (out is buf.combined["y"]) == (t > 0)
    # A payload that needs scales is refused (after the layout, which is local to the rank).
    with pytest.raises(TypeError, match="torch.int8 payload needs its scales"):
        disp.send(torch.zeros(2, 256, dtype=torch.int8), None, torch.zeros(2, 2, dtype=torch.int64), torch.rand(2, 2))
    disp.buffer.close()


@pytest.mark.parametrize("bad", [0, -3, 2.5, "64"])
def test_layer_refuses_a_bad_normal_bound(bad):
    from epmoe.layer import DeepEPMoELayer

    with pytest.raises(ValueError, match=f"normal_max_tokens_per_rank={bad!r} must be a positive integer or None"):
        DeepEPMoELayer(16, 4, 256, 128, backend="torch", device="cpu", normal_max_tokens_per_rank=bad)


def test_layer_says_a_normal_bound_has_no_effect_without_deepep(caplog):
    from epmoe.layer import DeepEPMoELayer

    with caplog.at_level("WARNING", logger="epmoe"):
        DeepEPMoELayer(16, 4, 256, 128, backend="torch", device="cpu", params_dtype=torch.float32,
                       normal_max_tokens_per_rank=64)  # fmt: skip
    assert "normal_max_tokens_per_rank=64 has no effect with dispatch=local" in caplog.text


def test_normal_mode_sm_count(fake_deep_ep, monkeypatch):
    monkeypatch.setattr(db, "sm_count", lambda: 132)
    buf = DeepEPBuffer(num_sms=64)
    buf.register(needs(modes={"normal"}))
    b = buf.get()
    # DeepEP's recommended chunk sizes for 2 ranks, with the chosen SM count; the buffer sized for it
    assert buf.dispatch_config.args == (64, 24, 256, 6, 128) and buf.combine_config.args == (64, 10, 256, 6, 128)
    assert b.args["nvl"] == 64 * NVL(7168 * 2)
    too_many = DeepEPBuffer(num_sms=134)
    too_many.register(needs(modes={"normal"}))
    with pytest.raises(DeepEPBufferError, match="num_sms=134 exceeds the GPU's 132 SMs"):
        too_many.get()


@pytest.mark.parametrize("bad", [0, 3, 2.0, True])
def test_bad_sm_count_refused(bad):
    with pytest.raises(ValueError, match="must be None .DeepEP's default. or an even integer >= 2"):
        DeepEPBuffer(num_sms=bad)


@pytest.mark.parametrize("global_max, bounded", [(12, True), (16, True), (40, False)])
def test_auto_decides_the_bound_from_the_largest_batch(fake_deep_ep, monkeypatch, caplog, global_max, bounded):
    """deepep_auto knows every rank's count: the bound holds for all ranks or for none, so a batch
    over it runs host-synced everywhere (logged once) instead of raising on one rank."""
    fake_deep_ep.Buffer = _FakeDispatchBuffer
    cfg = DispatchConfig(num_experts=16, hidden_size=2048, top_k=2, world_size=2,
                         max_tokens_per_rank=8, normal_max_tokens_per_rank=16)  # fmt: skip
    auto = dd.DeepEPAutoDispatcher(cfg)
    monkeypatch.setattr(auto, "_decide", lambda n, dev: ("normal", global_max))
    ids = torch.tensor([[0, 3], [1, 2], [2, 0]])
    with caplog.at_level("WARNING", logger="epmoe"):
        for _ in range(2):
            d = auto.send(torch.randn(3, 2048), None, ids, torch.rand(3, 2))
    kw = _FakeBuffer.made[-1].dispatch_kw
    if bounded:
        assert kw["num_worst_tokens"] == 32 and d.padded_rows is None
        assert d.expected_m == expected_rows_per_expert(global_max, 2, 2, 16)
        assert "exceeds normal_max_tokens_per_rank" not in caplog.text
    else:
        assert kw["num_worst_tokens"] == 0 and d.padded_rows == [3, 5] and d.expected_m is None
        assert caplog.text.count("exceeds normal_max_tokens_per_rank=16") == 1
    auto.buffer.close()


def test_num_sms_ignored_where_normal_mode_cannot_run_is_said(fake_deep_ep, monkeypatch, caplog):
    monkeypatch.setattr(DeepEPBuffer, "world_size", property(lambda self: 16))
    buf = DeepEPBuffer(num_sms=64)
    buf.register(needs(modes={"low_latency"}), 16)
    with caplog.at_level("WARNING", logger="epmoe"):
        buf.get()
    assert "num_sms=64) has no effect on 16 ranks" in caplog.text


# ------------------------------------------------------------------------------ low-latency wiring
class _FakeLowLatencyBuffer(_FakeBuffer):
    """Records what low-latency dispatch and combine were given; returns a masked batch of the
    right shape (every token's rows land nowhere: counts are zero) and a combine of ``t`` rows."""

    def low_latency_dispatch(self, x, topk_idx, num_max_tokens, num_experts, use_fp8=False, **kw):
        self.ll_dispatch = dict(x=x, ids=topk_idx, tokens=num_max_tokens, experts=num_experts, use_fp8=use_fp8, kw=kw)
        e_loc, rows = num_experts // 2, num_max_tokens * 2
        recv = torch.zeros(e_loc, rows, x.shape[1], dtype=torch.bfloat16)
        if use_fp8:
            recv = (recv.to(torch.float8_e4m3fn), torch.ones(e_loc, x.shape[1] // 128, rows).transpose(1, 2))
        self.handle = (torch.zeros(e_loc, rows, dtype=torch.int32), torch.zeros(e_loc, 2, dtype=torch.int64),
                       num_max_tokens, x.shape[1], num_experts)  # fmt: skip
        return recv, torch.zeros(e_loc, dtype=torch.int32), self.handle, None, None

    def low_latency_combine(self, y, topk_idx, topk_weights, handle, **kw):
        self.ll_combine = dict(y=y, ids=topk_idx, weights=topk_weights, handle=handle, kw=kw)
        return torch.zeros(topk_idx.shape[0], y.shape[-1], dtype=torch.bfloat16), None, None


@pytest.mark.parametrize("t", [5, 0])
@pytest.mark.parametrize("payload", ["float", "fp8_group"])
def test_low_latency_dispatch_and_combine_wiring(fake_deep_ep, t, payload):
    """What deepep_low_latency hands DeepEP: BF16 rows, int64 ids, the planned capacity, the
    payload's FP8 flag, no async or hook; an empty batch travels as one token that selects no
    expert. Combine gets the same ids and fp32 weights and returns the batch's own rows."""
    fake_deep_ep.Buffer = _FakeLowLatencyBuffer
    cfg = DispatchConfig(num_experts=16, hidden_size=2048, top_k=2, world_size=2, max_tokens_per_rank=6,
                         low_latency_payload=payload)  # fmt: skip
    disp = dd.DeepEPLowLatencyDispatcher(cfg)
    ids = torch.randint(0, 16, (t, 2), dtype=torch.int32)
    w = torch.rand(t, 2, dtype=torch.float64)
    d = disp.dispatch(torch.randn(t, 2048), ids, w)
    buf = _FakeBuffer.made[-1]
    sent = buf.ll_dispatch
    assert sent["x"].dtype == torch.bfloat16 and sent["x"].shape == (max(t, 1), 2048)
    assert sent["ids"].dtype == torch.int64 and sent["ids"].shape == (max(t, 1), 2)
    if t == 0:
        assert (sent["ids"] == -1).all()
    else:
        assert torch.equal(sent["ids"], ids.long())
    assert sent["tokens"] == disp.buffer.plan.ll_max_tokens == low_latency_tokens(6, 2)
    assert sent["experts"] == 16 and sent["use_fp8"] == (payload == "fp8_group")
    assert sent["kw"] == dict(async_finish=False, return_recv_hook=False)
    assert d.layout == "masked" and d.combine_applies_weights and d.num_tokens == t
    assert (d.x_scale is not None) == (payload == "fp8_group")
    assert d.expected_m == expected_rows_per_expert(max(t, 1), 2, 2, 16)
    y = torch.zeros(8, disp.buffer.plan.ll_max_tokens * 2, 2048, dtype=torch.bfloat16)
    out = disp.combine(y, d)
    got = buf.ll_combine
    assert got["ids"] is sent["ids"] and got["weights"].dtype == torch.float32
    assert all(a is b for a, b in zip(got["handle"][:2], buf.handle[:2])) and got["handle"][2:] == buf.handle[2:]
    assert got["weights"].shape == (max(t, 1), 2) and got["kw"] == dict(async_finish=False, return_recv_hook=False)
    assert out.shape == (t, 2048)
    disp.buffer.close()


# ------------------------------------------------------------------------------ frozen config, composition
def test_config_is_frozen_and_complete_before_the_dispatcher():
    import dataclasses

    from epmoe.layer import DeepEPMoELayer

    cfg = DispatchConfig(num_experts=16, hidden_size=2048, top_k=2, world_size=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.alignment = 128
    with pytest.raises(ValueError, match="payload='int4'; allowed"):
        DispatchConfig(num_experts=16, hidden_size=2048, top_k=2, payload="int4")
    layer = DeepEPMoELayer(16, 4, 256, 128, quant="int8_channel", backend="torch", device="cpu")
    assert layer.dispatcher.cfg.alignment == layer.backend.alignment
    assert layer.dispatcher.cfg.payload == "int8_token" and layer.payload == "int8_token"


def test_auto_composes_a_normal_and_a_low_latency_dispatcher(fake_deep_ep):
    """deepep_auto holds two ordinary dispatchers on one buffer; the caller's config is not written
    (a private buffer goes into a derived copy); each batch's handle says which mode sent it."""
    fake_deep_ep.Buffer = type("_Both", (_FakeDispatchBuffer, _FakeLowLatencyBuffer), {})
    cfg = DispatchConfig(num_experts=16, hidden_size=2048, top_k=2, world_size=2, max_tokens_per_rank=8,
                         payload="int8_token")  # fmt: skip
    auto = dd.DeepEPAutoDispatcher(cfg)
    assert cfg.deepep_buffer is None and auto.cfg.deepep_buffer is auto.buffer
    assert type(auto.normal) is dd.DeepEPNormalDispatcher and type(auto.low_latency) is dd.DeepEPLowLatencyDispatcher
    assert auto.normal.buffer is auto.buffer is auto.low_latency.buffer
    assert auto.normal.cfg.payload == "int8_token" and auto.low_latency.cfg.payload == "float"
    assert {n.modes for n in auto.buffer.needs} == {frozenset({"normal"}), frozenset({"low_latency"})}
    ids, w = torch.tensor([[0, 3], [1, 2], [2, 0]]), torch.rand(3, 2)
    for mode, handle_type in (("low_latency", dd.LowLatencyHandle), ("normal", dd.NormalHandle)):
        auto._decide = lambda n, dev, mode=mode: (mode, 3)
        d = auto.dispatch(torch.randn(3, 2048), ids, w)
        assert type(d.handle) is handle_type and d.handle.num_tokens == 3
        assert (d.x.dtype == torch.int8) == (mode == "normal")  # normal carries the config's payload
        y = torch.zeros(d.x.shape, dtype=torch.bfloat16) if mode == "low_latency" else torch.zeros(3, 2048)
        assert auto.combine(y, d).shape == (3, 2048)
    auto.buffer.close()


# ------------------------------------------------------------------------------ issue 22.2 / 22.3
class _FakeBothBuffer(_FakeDispatchBuffer, _FakeLowLatencyBuffer):
    def get_dispatch_layout(self, topk_ids, num_experts):
        self.layout_ids = topk_ids
        return super().get_dispatch_layout(topk_ids, num_experts)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_wire_formats_are_fixed_at_build_not_by_the_input_dtype(fake_deep_ep, dtype):
    """What DeepEP is handed depends on the config (fingerprinted across ranks), never on the
    batch's input dtype: float rows as BF16 (dispatch and combine), int8 payloads as int8 + fp32
    scales, low-latency rows as BF16. So ranks calling with fp16 and bf16 exchange the same bytes."""
    fake_deep_ep.Buffer = _FakeBothBuffer
    ids, w = torch.tensor([[0, 3], [1, 2], [2, 0]]), torch.rand(3, 2)
    x = torch.randn(3, 2048).to(dtype)
    for payload in ("float", "int8_token"):
        cfg = DispatchConfig(num_experts=16, hidden_size=2048, top_k=2, world_size=2, payload=payload)
        disp = dd.DeepEPNormalDispatcher(cfg)
        d = disp.dispatch(x, ids, w)
        buf = _FakeBuffer.made[-1]
        sent = d.x
        if payload == "float":
            assert sent.dtype == torch.bfloat16
        else:
            assert sent.dtype == torch.int8 and d.x_scale.dtype == torch.float32
        disp.combine(torch.zeros(3, 2048, dtype=dtype), d)
        assert buf.combined["y"].dtype == torch.bfloat16
        disp.buffer.close()
    ll = dd.DeepEPLowLatencyDispatcher(DispatchConfig(num_experts=16, hidden_size=2048, top_k=2, world_size=2))
    d = ll.dispatch(x, ids, w)
    assert _FakeBuffer.made[-1].ll_dispatch["x"].dtype == torch.bfloat16
    ll.combine(torch.zeros(d.x.shape, dtype=dtype), d)
    assert _FakeBuffer.made[-1].ll_combine["y"].dtype == torch.bfloat16
    ll.buffer.close()


def test_minus_one_ids_reach_deep_ep_unchanged(fake_deep_ep):
    """-1 selects no expert: every DeepEP dispatcher hands the ids to DeepEP as they are (its
    layout, dispatch and low-latency kernels skip -1 slots), neither refused nor rewritten."""
    fake_deep_ep.Buffer = _FakeBothBuffer
    ids = torch.tensor([[0, -1], [-1, -1], [2, 9]])
    w = torch.rand(3, 2)
    x = torch.randn(3, 2048)
    cfg = DispatchConfig(num_experts=16, hidden_size=2048, top_k=2, world_size=2, max_tokens_per_rank=8)
    normal = dd.DeepEPNormalDispatcher(cfg)
    normal.dispatch(x, ids, w)
    buf = _FakeBuffer.made[-1]
    assert torch.equal(buf.layout_ids, ids) and torch.equal(buf.dispatch_kw["topk_idx"], ids)
    normal.buffer.close()
    ll = dd.DeepEPLowLatencyDispatcher(cfg)
    d = ll.dispatch(x, ids, w)
    assert torch.equal(_FakeBuffer.made[-1].ll_dispatch["ids"], ids) and torch.equal(d.handle.topk_ids, ids)
    ll.buffer.close()
    auto = dd.DeepEPAutoDispatcher(cfg)
    for mode in ("low_latency", "normal"):
        auto._decide = lambda n, dev, mode=mode: (mode, 3)
        auto.dispatch(x, ids, w)
        buf = _FakeBuffer.made[-1]
        got = buf.ll_dispatch["ids"] if mode == "low_latency" else buf.dispatch_kw["topk_idx"]
        assert torch.equal(got, ids), mode
    auto.buffer.close()


# ------------------------------------------------------------------------------ a loopback DeepEP
class _LoopbackBuffer(_FakeBuffer):
    """DeepEP as rank 0 of 2 sees it when rank 1 sends nothing: rows for rank 0's experts (the
    first half) arrive from rank 0 itself, rows for rank 1's leave and their results never come
    back. Shapes, dtypes, handles, -1 ids and the garbage past the received rows (NaN where the
    dtype has one) as DeepEP v1.2.1 gives them (intranode normal mode, low-latency mode), so that
    the dispatchers run end to end on a CPU, eagerly and compiled."""

    garbage = float("nan")  # what float rows past the received ones hold

    def _channels(self, config) -> int:
        return (config.args[0] if isinstance(config, _FakeChunkConfig) else type(self).num_sms) // 2

    def get_dispatch_layout(self, topk_idx, num_experts):
        rank_of = torch.where(topk_idx >= 0, topk_idx // (num_experts // 2), -1)
        in_rank = torch.stack([(rank_of == r).any(1) for r in range(2)], 1)
        per_expert = torch.bincount(topk_idx[topk_idx >= 0], minlength=num_experts).int()
        return in_rank.sum(0).int(), None, per_expert, in_rank, None

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None, is_token_in_rank=None,
                 num_tokens_per_expert=None, topk_idx=None, topk_weights=None, expert_alignment=1, num_worst_tokens=0,
                 config=None, **kw):  # fmt: skip
        e_loc = num_tokens_per_expert.shape[0] // 2
        toks = is_token_in_rank[:, 0].nonzero()[:, 0]
        n, t = toks.numel(), topk_idx.shape[0]
        rows = num_worst_tokens or n

        def received(a, fill):
            out = a.new_full((rows, *a.shape[1:]), fill)
            out[:n] = a[toks] if a.shape[0] == t else a
            return out

        ids = topk_idx[toks]
        local = (ids >= 0) & (ids < e_loc)
        garbage = lambda a: self.garbage if a.is_floating_point() else 77  # noqa: E731
        recv_x = tuple(received(a, garbage(a)) for a in x) if isinstance(x, tuple) else received(x, garbage(x))
        recv_ids = received(torch.where(local, ids, -1), -1)
        recv_w = received(torch.where(local, topk_weights[toks], 0.0), self.garbage)
        counts = [] if num_worst_tokens else [
            -(-int((recv_ids == e).sum()) // expert_alignment) * expert_alignment for e in range(e_loc)
        ]  # fmt: skip
        i32 = dict(dtype=torch.int32)
        channels = self._channels(config)
        sent = is_token_in_rank.sum(0).int()
        send_head = torch.full((t, 2), -1, **i32)
        send_head[toks, 0] = torch.arange(n, **i32)
        handle = (
            torch.stack([sent, sent]), torch.zeros(2, channels, **i32), torch.zeros(2, channels, **i32),
            received(toks.int(), -1), is_token_in_rank, send_head,
        )  # fmt: skip
        return recv_x, recv_ids, recv_w, counts, handle, None

    def combine(self, x, handle, topk_weights=None, bias=None, config=None, **kw):
        rank_prefix, _, _, src_idx, _, send_head = handle
        n = int(rank_prefix[-1, 0])
        out = torch.zeros(send_head.shape[0], x.shape[1])
        out.index_add_(0, src_idx[:n].long(), x[:n].float())
        return out.to(x.dtype), None, None

    def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8=True, **kw):
        e_loc, rows, h = num_experts // 2, 2 * num_max_dispatch_tokens_per_rank, x.shape[1]
        recv = torch.full((e_loc, rows, h), self.garbage, dtype=torch.bfloat16)
        src_info = torch.full((e_loc, rows), -1, dtype=torch.int32)
        layout_range = torch.zeros(e_loc, 2, dtype=torch.int64)
        count = torch.zeros(e_loc, dtype=torch.int32)
        for e in range(e_loc):
            toks = (topk_idx == e).any(1).nonzero()[:, 0]
            c = toks.numel()
            recv[e, :c], src_info[e, :c], count[e], layout_range[e, 0] = x[toks], toks.int(), c, c  # begin 0, count c
        if use_fp8:  # DeepEP's cast: per 1x128 group, scale = amax / 448; scales column-major
            g = recv.float().unflatten(-1, (h // 128, 128))
            scale = g.abs().amax(-1).clamp_min(1e-4) / 448.0
            q = (g / scale[..., None]).to(torch.float8_e4m3fn).flatten(-2)
            recv = (q, scale.transpose(1, 2).contiguous().transpose(1, 2))
        handle = (src_info, layout_range, num_max_dispatch_tokens_per_rank, h, num_experts)
        return recv, count, handle, None, None

    def low_latency_combine(self, x, topk_idx, topk_weights, handle, **kw):
        src_info, layout_range = handle[:2]
        out = torch.zeros(topk_idx.shape[0], x.shape[-1])
        for e in range(x.shape[0]):
            toks = src_info[e, : int(layout_range[e, 0])].long()
            w = (topk_weights[toks] * (topk_idx[toks] == e)).sum(1)
            out.index_add_(0, toks, x[e, : toks.numel()].float() * w[:, None])
        return out.bfloat16(), None, None


@pytest.fixture
def rank0_of_2(fake_deep_ep, monkeypatch):
    """Layers built as rank 0 of 2 on the CPU, with the loopback stand-in for DeepEP: no group,
    no argument comparison over it, and DeepEP's CUDA requirement waived."""
    import epmoe.layer as layer_mod

    fake_deep_ep.Buffer = _LoopbackBuffer
    monkeypatch.setattr(layer_mod, "_resolve_group", lambda group: (group, 2, 0))
    monkeypatch.setattr(layer_mod, "check_agreement", lambda *a, **k: None)
    for cls in (dd.DeepEPNormalDispatcher, dd.DeepEPLowLatencyDispatcher, dd.DeepEPAutoDispatcher):
        monkeypatch.setattr(cls, "available", classmethod(lambda cls, cfg: (True, "the loopback stand-in")))
    return fake_deep_ep


def rank0_reference(layer, x, logits):
    """What rank 0 of 2 returns when rank 1 sends nothing: its own tokens through its own experts
    only (other ranks' slots as -1), computed by a single-rank layer on the local dispatcher."""
    from unittest import mock

    import epmoe.layer as layer_mod

    ids, w = layer.route(logits)
    ids = torch.where(ids < layer.num_local_experts, ids, -1)
    with mock.patch.object(layer_mod, "_resolve_group", lambda group: (None, 1, 0)):  # one process, undone
        ref = layer_mod.DeepEPMoELayer(layer.num_local_experts, layer.top_k, layer.hidden_size, layer.intermediate_size,
                                       quant=layer.scheme.name, backend="torch", dispatch="local", device="cpu",
                                       params_dtype=torch.float32)  # fmt: skip
    ew = layer.expert_weights()
    ref.load_experts(ew.w13, ew.w2, ew.w13_scale, ew.w2_scale)
    return ref(x, topk_ids=ids, topk_weights=w)


def loopback_layer(dispatch: str, *, quant: str = "bf16", hidden: int = 2048, **kwargs):
    """A layer with 16 experts (8 on rank 0), top-2, on the torch backend, random weights."""
    from epmoe.layer import DeepEPMoELayer
    from epmoe.quant import quantize_weight

    g = torch.Generator().manual_seed(5)
    layer = DeepEPMoELayer(16, 2, hidden, 128, quant=quant, backend="torch", dispatch=dispatch, device="cpu",
                           params_dtype=torch.float32, **kwargs)  # fmt: skip
    w13, s13 = quantize_weight(torch.randn(16, 256, hidden, generator=g) / hidden**0.5, layer.scheme)
    w2, s2 = quantize_weight(torch.randn(16, hidden, 128, generator=g) / 128**0.5, layer.scheme)
    layer.load_experts(w13, w2, s13, s2)
    return layer


@pytest.mark.parametrize("dispatch, kwargs", [
    ("deepep_low_latency", dict(max_tokens_per_rank=8)),
    ("deepep_low_latency", dict(max_tokens_per_rank=8, low_latency_int8_payload="fp8_group", quant="int8_channel")),
    ("deepep_normal", dict(normal_max_tokens_per_rank=8, quant="int8_channel")),
    ("deepep_normal", dict(quant="int8_channel")),
])  # fmt: skip
def test_loopback_dispatch_through_the_layer_matches_the_local_reference(rank0_of_2, dispatch, kwargs):
    """The dispatchers' wiring end to end (eager): what rank 0 gets back is its tokens' sum over
    its own experts, weighted once, whatever the mode and payload."""
    layer = loopback_layer(dispatch, **kwargs)
    assert layer.dispatcher.name == dispatch and layer.num_local_experts == 8
    g = torch.Generator().manual_seed(6)
    x, logits = torch.randn(6, 2048, generator=g), torch.randn(6, 16, generator=g)
    logits[:, 8:] -= 4  # most slots on rank 0's experts, some on rank 1's
    out = layer(x, logits)
    ref = rank0_reference(layer, x, logits)
    assert ref.abs().max() > 0 and torch.isfinite(out).all()
    # BF16 (and FP8 in low-latency mode) on the wire and BF16 combine, against fp32 payloads.
    tol = 0.08 if "fp8_group" in kwargs.values() else 0.02
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol * float(ref.abs().max()))
    layer.dispatcher.buffer.close()
