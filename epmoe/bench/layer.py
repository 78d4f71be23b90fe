"""``epmoe bench layer``: the EP layer over DeepEP on 2 GPUs at DeepSeek-V3 shapes.

Two ranks (torch.multiprocessing, NCCL), 256 experts, top-8, H = 7168, I = 2048 (128 experts per
rank), one shared :class:`~epmoe.dispatch.DeepEPBuffer`:

* prefill: 4096 tokens per rank, ``deepep_normal``; decode: 128 tokens per rank,
  ``deepep_low_latency``; schemes bf16, int8_channel, int8_block (backend ``auto``);
* whole-layer time and per-phase times (quantize, dispatch, scatter, GEMM1, activation, GEMM2,
  gather, combine), calling the pieces the layer composes; GEMM1 / activation / GEMM2 are split
  through the Triton backend's own stage methods (other backends: one ``experts`` phase);
* bytes sent per rank, remote and local; DeepEP's own dispatch / combine time for the same payload
  (``deep_ep.Buffer`` called directly) next to the layer's, timed two ways: each call alone after
  a barrier (host time before the first launch counts in full), and pipelined as DeepEP's own
  tests time them (pairs back to back, an event around each call);
* low-latency INT8 payload study: BF16 dispatch then INT8 quantization, against FP8 dispatch then
  INT8 requantization (time, and error against the exact activations in float64).

Every rank runs a fixed number of iterations timed with CUDA events (never a per-process
repetition count: ranks that disagree make DeepEP stop with "CPU recv timeout").
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
import traceback

import torch

from .turns import in_turns

E, K, H, I = 256, 8, 7168, 2048
WORLD = 2
SCHEMES = ("bf16", "int8_channel", "int8_channel_int32", "int8_block")
"""``int8_channel_int32`` is ``int8_channel`` with the layer's ``accumulator="int32"``."""
DC_ROUNDS = 4
"""Rounds of each dispatch / combine comparison, alternating which side runs first."""
PHASES = ("quantize", "dispatch", "scatter", "quantize_post", "gemm1", "activation", "gemm2",
          "experts", "gather", "combine")  # fmt: skip


def _parse(argv):
    from epmoe.dispatch.deepep.sizing import check_num_sms

    p = argparse.ArgumentParser(prog="epmoe bench layer", description=__doc__.split("\n\n")[0])
    p.add_argument("--prefill-tokens", type=int, default=4096)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--schemes", default=",".join(SCHEMES))
    p.add_argument("--backend", default="auto")
    p.add_argument("--iters", type=int, default=10, help="timed iterations (the same on every rank)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5,
                   help="rounds of the interleaved throughput comparison (0: skip it)")
    p.add_argument("--sustained", type=int, default=0,
                   help="windows of --iters forwards each for the sustained prefill throughput, per scheme "
                        "(0: skip it)")
    p.add_argument("--json", default=None, help="write results here")
    p.add_argument("--plot", default=None, help="write a PNG plot here")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--num-sms", type=int, default=None,
                   help="SMs of DeepEP's normal-mode kernels (DeepEPBuffer(num_sms=...)); default: DeepEP's")
    args = p.parse_args(argv)
    try:
        check_num_sms(args.num_sms)
    except ValueError as exc:
        p.error(f"--num-sms: {exc}")
    bad = [s for s in args.schemes.split(",") if s not in SCHEMES]
    if bad:
        p.error(f"--schemes {bad} unknown; allowed: {list(SCHEMES)}")
    for name, least in (("iters", 1), ("warmup", 0), ("rounds", 0), ("sustained", 0), ("prefill_tokens", 1), ("decode_tokens", 1)):
        if getattr(args, name) < least:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)}; must be >= {least}")
    return args


# ---------------------------------------------------------------------------------- helpers
class _Timer:
    """CUDA events recorded between phases over a fixed number of iterations."""

    def __init__(self):
        self.marks: list[list[tuple[str, torch.cuda.Event]]] = []

    def start(self):
        self.marks.append([])
        self.mark("start")

    def mark(self, name):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        self.marks[-1].append((name, ev))

    def result_ms(self, reduce=statistics.mean) -> dict[str, float]:
        """Per phase, ``reduce`` (mean: phases add up to the forward; median: robust to a peer's
        occasional late arrival) over the iterations."""
        torch.cuda.synchronize()
        samples: dict[str, list[float]] = {}
        for marks in self.marks:
            for (_, a), (name, b) in zip(marks, marks[1:]):
                samples.setdefault(name, []).append(a.elapsed_time(b))
        return {k: reduce(v) for k, v in samples.items()}


def _barrier(device):
    import torch.distributed as dist

    t = torch.ones(1, device=device)
    dist.all_reduce(t)
    torch.cuda.synchronize()


def _time_loop(fn, iters, warmup, device, collective=True) -> float:
    """Mean ms of ``fn`` over ``iters`` back-to-back calls (same count on every rank). With
    ``collective=False`` (work local to this rank) no barrier: a rank whose ``fn`` fails must not
    leave its peer waiting in one."""
    for _ in range(warmup):
        fn()
    if collective:
        _barrier(device)
    else:
        torch.cuda.synchronize(device)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / iters


def _routing(t, seed, rank, device):
    from epmoe.routing import select_experts

    g = torch.Generator(device=device).manual_seed(seed * 1000 + rank)
    x = torch.randn(t, H, generator=g, device=device).to(torch.bfloat16)
    logits = torch.randn(t, E, generator=g, device=device)
    ids, w = select_experts(logits, K, renormalize=True)
    return x, ids.long().contiguous(), w.float().contiguous()


def _fill_weights(layer, scheme):
    """Random weights generated on the GPU (dequantized std ~ 1/sqrt(K) per GEMM), seeded per
    rank, so that outputs (``output_abs_sum``) compare between runs and settings."""
    g = torch.Generator(device=layer.w13_weight.device).manual_seed(7 + layer.rank)
    with torch.no_grad():
        for w, s, k in ((layer.w13_weight, layer.w13_weight_scale, H), (layer.w2_weight, layer.w2_weight_scale, I)):
            std = k**-0.5
            if scheme == "bf16":
                w.normal_(0.0, std, generator=g)
            else:
                w.copy_(torch.randint(-127, 128, w.shape, dtype=torch.int8, device=w.device, generator=g))
                s.uniform_(0.5 * std / 73.0, 1.5 * std / 73.0, generator=g)  # uniform int8 has std ~73


def _share_weights(dst, src):
    for name in ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale"):
        if getattr(src, name) is not None:
            setattr(dst, name, getattr(src, name))


def _bytes(ids, rank, payload_row_bytes, mode):
    """Bytes this rank sends: dispatch (payload rows + metadata) and, for the combine, the BF16
    rows that come back; split into remote (other ranks) and local (this rank)."""
    e_loc = E // WORLD
    dest = ids // e_loc  # [T, K]
    if mode == "normal":  # one row per (token, destination rank), top-k ids + weights with it
        on = torch.zeros(ids.shape[0], WORLD, dtype=torch.bool, device=ids.device)
        on.scatter_(1, dest, True)
        per_rank = on.sum(0).tolist()
        meta = K * (8 + 4)
    else:  # low-latency: one message per (token, selected expert), 16-byte header
        per_rank = torch.bincount(dest.reshape(-1), minlength=WORLD).tolist()
        meta = 16
    row = payload_row_bytes + meta
    remote = sum(c for r, c in enumerate(per_rank) if r != rank)
    local = per_rank[rank]
    return dict(
        dispatch_remote=remote * row, dispatch_local=local * row,
        combine_remote=remote * H * 2, combine_local=local * H * 2,
        rows_remote=remote, rows_local=local,
    )  # fmt: skip


def _payload_row_bytes(payload):
    return {"float": H * 2, "int8_token": H + 4, "int8_group": H + H // 128 * 4,
            "fp8_group": H + H // 128 * 4}[payload]  # fmt: skip


def _experts_in_stages(layer, x, x_scale, out_dtype, tm, **segments):
    """The Triton backend's forward through its own stage methods, with a mark after each."""
    be, wts = layer.backend, layer._weights()
    rows = (segments.get("masked_m"), segments.get("expected_m"))
    a, a_s = be.gemm1_input(x, x_scale, wts, *rows)
    tm.mark("quantize_post")
    gu = be.gemm(a, a_s, wts, 1, be.mid_dtype(wts, out_dtype), **segments)
    tm.mark("gemm1")
    h, hs = be.activation(gu, wts, *rows)
    tm.mark("activation")
    out = be.gemm(h, hs, wts, 2, out_dtype, **segments)
    tm.mark("gemm2")
    return out


def _phases_once(layer, staged, x_in, ids, w, tm):
    """One forward, piece by piece, with a timer mark after each phase; returns the output.
    ``staged``: split the experts into their stages (Triton backend), else one phase."""
    from epmoe.layouts import MaskedBatch, gather_weighted, to_contiguous
    from epmoe.quant.payload import quantize_payload

    x, xs = quantize_payload(x_in, layer.dispatcher.cfg.payload)
    tm.mark("quantize")
    d = layer.dispatcher.send(x, xs, ids, w)
    tm.mark("dispatch")
    if d.layout == "masked":
        if staged:
            out = _experts_in_stages(layer, d.x, d.x_scale, x_in.dtype, tm, masked_m=d.masked_m,
                                     expected_m=d.expected_m)  # fmt: skip
        else:
            out = layer.backend.run_masked(MaskedBatch(d.x, d.x_scale, d.masked_m, d.expected_m), layer._weights(), x_in.dtype)
            tm.mark("experts")
        y = layer.dispatcher.combine(out, d)
        tm.mark("combine")
        return y.to(x_in.dtype)
    batch = to_contiguous(
        d.x, d.x_scale, d.topk_ids, layer.num_local_experts, layer.backend.alignment, d.padded_rows
    )
    tm.mark("scatter")
    if staged:
        out = _experts_in_stages(layer, batch.x, batch.x_scale, x_in.dtype, tm, expert_offsets=batch.expert_offsets)
    else:
        out = layer.backend.run_contiguous(batch, layer._weights(), x_in.dtype)
        tm.mark("experts")
    g = gather_weighted(out, batch.slot_pos, d.topk_weights, x_in.dtype)
    tm.mark("gather")
    y = layer.dispatcher.combine(g, d)
    tm.mark("combine")
    return y.to(x_in.dtype)


def _time_pair(first, second, iters, warmup, device, names=("dispatch", "combine"), between=None):
    """Median ms of ``first()`` and of ``second(...)`` on its result, each timed alone after a
    barrier, a fixed count of iterations on every rank: the one loop every dispatch / combine
    comparison here uses. ``between`` (untimed) turns the first result into the second's
    argument. Also the median host time of each call (``<name>_host_us``: from the call to its
    return, what an idle GPU waits for before the first kernel at most). Returns the times and
    the last results of both calls."""
    t1, t2 = _Timer(), _Timer()
    host = {names[0]: [], names[1]: []}
    r1 = r2 = None
    for i in range(warmup + iters):
        _barrier(device)
        tm = t1 if i >= warmup else _Timer()
        tm.start()
        h0 = time.perf_counter()
        r1 = first()
        h1 = time.perf_counter()
        tm.mark(names[0])
        arg = r1 if between is None else between(r1)
        tm2 = t2 if i >= warmup else _Timer()
        tm2.start()
        h2 = time.perf_counter()
        r2 = second(arg)
        h3 = time.perf_counter()
        tm2.mark(names[1])
        if i >= warmup:
            host[names[0]].append((h1 - h0) * 1e6)
            host[names[1]].append((h3 - h2) * 1e6)
    med = statistics.median
    times = {f"{names[0]}_ms": t1.result_ms(med)[names[0]], f"{names[1]}_ms": t2.result_ms(med)[names[1]]}
    times.update({f"{n}_host_us": med(v) for n, v in host.items()})
    return times, r1, r2


def _time_pipelined(first, second, iters, warmup, device, names=("dispatch", "combine"), between=None):
    """Median ms of ``first()`` and ``second(...)`` called in pairs back to back, with no barrier
    or host sync between iterations and a CUDA event before and after each call: how DeepEP's own
    tests time their calls. The host runs ahead wherever it can, so this is each call's GPU time
    plus only the host time the GPU cannot hide (normal-mode dispatch still waits on the host for
    its receive counts); :func:`_time_pair` is the opposite case, an idle GPU waiting for the call."""
    arg = (lambda r: r) if between is None else between
    for _ in range(warmup):
        second(arg(first()))
    _barrier(device)
    events = [[torch.cuda.Event(enable_timing=True) for _ in range(3)] for _ in range(iters)]
    for e0, e1, e2 in events:
        e0.record()
        r = first()
        e1.record()
        second(arg(r))
        e2.record()
    torch.cuda.synchronize()
    med = statistics.median
    return {
        f"{names[0]}_pipelined_ms": med(a.elapsed_time(b) for a, b, _ in events),
        f"{names[1]}_pipelined_ms": med(b.elapsed_time(c) for _, b, c in events),
    }


def _time_both(first, second, iters, warmup, device, between=None):
    """Both timings of a dispatch / combine pair: isolated (:func:`_time_pair`) and pipelined."""
    times, _, _ = _time_pair(first, second, iters, warmup, device, between=between)
    times.update(_time_pipelined(first, second, iters, warmup, device, between=between))
    return times


def _combine_input(cache, shape, device):
    """A zero BF16 combine input of ``shape``, allocated once per shape."""
    if cache.get("shape") != shape:
        cache["shape"], cache["y"] = shape, torch.zeros(*shape, dtype=torch.bfloat16, device=device)
    return cache["y"]


def _deepep_raw(owner, layer, x_in, ids, w, mode, iters, warmup, device):
    """DeepEP's own dispatch and combine time for the same payload (deep_ep.Buffer directly)."""
    from epmoe.dispatch.deepep.dispatchers import normal_payload
    from epmoe.quant.payload import quantize_payload

    buf = owner.get()
    x, xs = quantize_payload(x_in, layer.dispatcher.cfg.payload)
    cache = {}
    if mode == "normal":
        payload = normal_payload(x, xs)

        def dispatch():
            a, b, c, dd_, _ = buf.get_dispatch_layout(ids, E)
            recv, _, _, _, handle, _ = buf.dispatch(
                payload, topk_idx=ids, topk_weights=w, num_tokens_per_rank=a, num_tokens_per_rdma_rank=b,
                is_token_in_rank=dd_, num_tokens_per_expert=c, expert_alignment=max(1, layer.backend.alignment),
                config=owner.dispatch_config,
            )  # fmt: skip
            rx = recv[0] if isinstance(recv, tuple) else recv
            return rx.shape[0], handle

        times = _time_both(
            dispatch, lambda a: buf.combine(a[0], a[1], config=owner.combine_config), iters, warmup, device,
            between=lambda r: (_combine_input(cache, (r[0], H), device), r[1]),
        )  # fmt: skip
        owner.mark_normal_used()
        return times
    if owner.clean_low_latency():
        _barrier(device)
    xb = x_in.to(torch.bfloat16).contiguous()
    use_fp8 = layer.dispatcher.cfg.low_latency_payload == "fp8_group"
    plan = owner.plan
    y = _combine_input(cache, (E // WORLD, plan.ll_max_tokens * WORLD, H), device)
    times = _time_both(
        lambda: buf.low_latency_dispatch(xb, ids, plan.ll_max_tokens, E, use_fp8=use_fp8)[2],
        lambda handle: buf.low_latency_combine(y, ids, w, handle), iters, warmup, device,
    )  # fmt: skip
    return times


def _layer_dc(layer, x_in, ids, w, iters, warmup, device):
    """The layer dispatcher's own dispatch (``send``) and ``combine``, timed in exactly the loop
    of :func:`_deepep_raw` (barrier, then the call alone), so the two are comparable: inside a
    whole forward a phase also absorbs waiting for the slower peer."""
    from epmoe.quant.payload import quantize_payload

    x, xs = quantize_payload(x_in, layer.dispatcher.cfg.payload)
    cache = {}
    times = _time_both(
        lambda: layer.dispatcher.send(x, xs, ids, w), lambda a: layer.dispatcher.combine(*a), iters, warmup, device,
        between=lambda d: (_combine_input(cache, (*d.x.shape[:-1], H), device), d),
    )  # fmt: skip
    return times


def _overheads(raw: dict, ours: dict) -> dict:
    """``<phase>_overhead_pct`` = layer / DeepEP - 1, in percent, for dispatch and combine timed
    isolated and pipelined."""
    phases = ("dispatch", "combine", "dispatch_pipelined", "combine_pipelined")
    return {f"{p}_overhead_pct": 100.0 * (ours[f"{p}_ms"] - raw[f"{p}_ms"]) / raw[f"{p}_ms"] for p in phases}


def _interleaved(forwards, iters, warmup, rounds, device):
    """Per scheme, the median over ``rounds`` of the mean forward time of ``iters`` back-to-back
    forwards (:func:`_time_loop`), the schemes taking turns (:func:`~epmoe.bench.turns.in_turns`):
    loops of 10 / 30 / 100 prefill forwards ran 6.78 / 7.08 / 7.54 ms per BF16 forward."""
    samples = in_turns(forwards, rounds, lambda fn: _time_loop(fn, iters, warmup, device))
    return {n: {"layer_ms": statistics.median(v), "rounds_ms": v} for n, v in samples.items()}


def _sustained(forwards, per_window, windows, device):
    """Per scheme, ``windows`` windows of ``per_window`` back-to-back forwards, one scheme after
    the other with no pause: what a layer serving one scheme under constant load runs at once
    the GPU's clocks have settled. CUDA events at the window boundaries only (the host never
    waits inside); returns each window's mean ms and the median of the second half's, plus the
    SM clock (MHz) and temperature (C) after the last window when NVML is readable."""
    out = {}
    for name, fn in forwards.items():
        _barrier(device)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(windows + 1)]
        events[0].record()
        for w in range(windows):
            for _ in range(per_window):
                fn()
            events[w + 1].record()
        torch.cuda.synchronize()
        ms = [a.elapsed_time(b) / per_window for a, b in zip(events, events[1:])]
        out[name] = {"window_ms": ms, "layer_ms": statistics.median(ms[len(ms) // 2:])}
        for key, reader in (("sm_clock_mhz", "clock_rate"), ("temperature_c", "temperature")):
            try:
                out[name][key] = getattr(torch.cuda, reader)(device)
            except Exception:  # noqa: BLE001 - NVML (and these torch helpers) are optional
                pass
    return out


def _no_host_sync(layer, bounded, x, ids, w, ref, iters, warmup, device):
    """Whole prefill layer with the host waiting for DeepEP's receive counts (``layer``) and
    without (``bounded``: ``normal_max_tokens_per_rank`` set), in alternating rounds (medians of
    the per-round means), plus the relative difference of their outputs."""
    out = bounded(x, topk_ids=ids, topk_weights=w)
    turns = {name: (lambda lay=lay: lay(x, topk_ids=ids, topk_weights=w))
             for name, lay in (("sync_ms", layer), ("layer_ms", bounded))}  # fmt: skip
    res = {k: v["layer_ms"] for k, v in _interleaved(turns, iters, warmup, DC_ROUNDS, device).items()}
    res["rel_diff_vs_sync"] = _rel_diff(out, ref)
    return res


def _rel_diff(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``|out - ref| / |ref|`` (Frobenius norms, fp32)."""
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30))


def _bf16_grouped_mm(layer, x_in, ids, w, iters, warmup, device):
    """The BF16 layer's experts pass on one received prefill batch, through the layer's backend
    and through ``torch._grouped_mm`` (GEMMs) with torch ``silu * mul``, each a mean over
    ``iters`` back-to-back calls: how much faster (or slower) the layer would be with the other
    BF16 GEMMs, measured on the same batch in the same run."""
    from epmoe.bench.experts import bf16_grouped_mm_pass
    from epmoe.layouts import to_contiguous

    d = layer.dispatcher.send(x_in, None, ids, w)
    batch = to_contiguous(d.x, None, d.topk_ids, layer.num_local_experts, layer.backend.alignment, d.padded_rows)
    # Combine before anything here can fail: the peer must not wait in a collective for it.
    layer.dispatcher.combine(torch.zeros(d.x.shape[0], H, dtype=torch.bfloat16, device=device), d)
    wts = layer._weights()
    offs = batch.expert_offsets[1:].to(torch.int32).contiguous()

    def grouped_mm():
        return bf16_grouped_mm_pass(batch.x, wts.w13, wts.w2, offs, I)

    ours = layer.backend.run_contiguous(batch, wts, x_in.dtype)
    ref = grouped_mm()
    rows = batch.x.shape[0]
    err = _rel_diff(ours, ref)
    out = {
        "rows": rows,
        "backend_experts_ms": _time_loop(
            lambda: layer.backend.run_contiguous(batch, wts, x_in.dtype), iters, warmup, device, collective=False
        ),
        "grouped_mm_experts_ms": _time_loop(grouped_mm, iters, warmup, device, collective=False),
        "rel_diff": err,
    }
    return out


def _graph_dc(owner, layer, x_in, ids, w, iters, device):
    """Low-latency dispatch + combine captured in one CUDA graph, DeepEP called directly and
    through the layer's dispatcher: median ms of a replay over ``DC_ROUNDS * iters`` replays of
    each, the two graphs replayed alternately (barrier before each). Decode runs graph-captured,
    where the host time of either wrapper is gone; what is left is GPU work."""
    try:
        buf, plan = owner.get(), owner.plan
        use_fp8 = layer.dispatcher.cfg.low_latency_payload == "fp8_group"
        xb = x_in.to(torch.bfloat16).contiguous()
        y = torch.zeros(E // WORLD, plan.ll_max_tokens * WORLD, H, dtype=torch.bfloat16, device=device)

        def raw():
            _, _, handle, _, _ = buf.low_latency_dispatch(xb, ids, plan.ll_max_tokens, E, use_fp8=use_fp8)
            buf.low_latency_combine(y, ids, w, handle)

        def ours():
            d = layer.dispatcher.send(xb, None, ids, w)
            layer.dispatcher.combine(y, d)

        graphs = {}
        for name, fn in (("deepep", raw), ("layer", ours)):
            fn()
            _barrier(device)
            graphs[name] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[name]):
                fn()
        samples: dict[str, list[float]] = {name: [] for name in graphs}
        for i in range(DC_ROUNDS * iters):
            for name in (("deepep", "layer") if i % 2 == 0 else ("layer", "deepep")):
                _barrier(device)
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                graphs[name].replay()
                b.record()
                b.synchronize()
                samples[name].append(a.elapsed_time(b))
        out = {f"{name}_ms": statistics.median(v) for name, v in samples.items()}
        del graphs
        out["overhead_pct"] = 100.0 * (out["layer_ms"] - out["deepep_ms"]) / out["deepep_ms"]
        return out
    except Exception as exc:  # noqa: BLE001 - an optional measurement: report, do not abort
        return {"error": repr(exc)}


def _ll_int8_study(owner, x, ids, device, iters, warmup):
    """Low-latency INT8 payloads: BF16 dispatch + INT8 quantize vs FP8 dispatch + requantize."""
    from epmoe.dispatch.deepep.sizing import expected_rows_per_expert
    from epmoe.kernels import quantize as qz

    if owner.clean_low_latency():
        _barrier(device)
    buf, plan = owner.get(), owner.plan
    hint = expected_rows_per_expert(x.shape[0], WORLD, K, E)  # what the layer's backend is given
    out = {}
    recv = {}
    for wire in ("bf16", "fp8"):
        use_fp8 = wire == "fp8"
        for gran in ("token", "group"):

            def dispatch():
                r, count, handle, _, _ = buf.low_latency_dispatch(x, ids, plan.ll_max_tokens, E, use_fp8=use_fp8)
                rx, rs = r if use_fp8 else (r, None)
                return rx, rs, count, handle

            def quant(d, gran=gran):
                rx, rs, count, _ = d
                rows = dict(masked_m=count, expected_m=hint)
                if gran == "token":
                    return qz.per_token_quant_int8(rx, rs, **rows)
                return qz.per_group_quant(rx, 128, torch.int8, rs, **rows)

            times, d, (q, s) = _time_pair(dispatch, quant, iters, warmup, device, names=("dispatch", "quant"))
            recv[(wire, gran)] = (*d, q, s)
            out[f"{wire}_{gran}"] = times
    # Accuracy: match rows of both dispatches by (source rank, source token) on a few experts;
    # the BF16 dispatch is byte-exact, so its rows are the exact activations.
    for gran in ("token", "group"):
        errs = {"bf16": [0.0, 0.0], "fp8": [0.0, 0.0], "fp8_stage": [0.0, 0.0]}
        for e in range(8):
            rows = {}
            for wire in ("bf16", "fp8"):
                rx, rs, count, handle, q, s = recv[(wire, gran)]
                c = int(count[e])
                src = handle[0][e, :c].long()
                rng = handle[1][e]
                src_rank = torch.empty(c, dtype=torch.long, device=device)
                for j in range(WORLD):
                    begin, n = int(rng[j]) >> 32, int(rng[j]) & 0xFFFFFFFF
                    src_rank[begin : begin + n] = j
                order = torch.argsort(src_rank * 1_000_000 + src)
                qd = q[e, :c].double() * (s[e, :c].double() if gran == "token" else s[e, :c].double().repeat_interleave(128, dim=-1))
                x_in = rx[e, :c].double() if rs is None else rx[e, :c].double() * rs[e, :c].double().repeat_interleave(128, dim=-1)
                rows[wire] = (qd[order], x_in[order])
            ref = rows["bf16"][1]
            for key, val in (("bf16", rows["bf16"][0]), ("fp8", rows["fp8"][0]), ("fp8_stage", rows["fp8"][1])):
                errs[key][0] += float((val - ref).pow(2).sum())
                errs[key][1] += float(ref.pow(2).sum())
        for key, (num, den) in errs.items():
            out.setdefault("rel_err_vs_exact", {})[f"{key}_{gran}"] = (num / max(den, 1e-30)) ** 0.5
    return out


# ---------------------------------------------------------------------------------- the rank
def _rank_main(rank, args, port, out_path):
    import logging

    import torch.distributed as dist

    logging.basicConfig(level=logging.WARNING)
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD,
        timeout=datetime.timedelta(seconds=300), device_id=device,
    )  # fmt: skip
    from epmoe.dispatch.deepep import DeepEPBuffer
    from epmoe.dispatch.deepep.sizing import BufferNeeds
    from epmoe.kernels.configs import mode_and_accumulator
    from epmoe.layer import DeepEPMoELayer

    t0 = time.time()
    res: dict = dict(rank=rank, schemes={}, errors=[])
    owner = DeepEPBuffer(num_sms=args.num_sms)
    owner.register(BufferNeeds(H, E, K, args.decode_tokens, frozenset({"normal", "low_latency"})), WORLD)
    xp, idp, wp = _routing(args.prefill_tokens, 1, rank, device)
    xd, idd, wd = _routing(args.decode_tokens, 2, rank, device)
    turns: dict[str, dict] = {"prefill": {}, "decode": {}}  # per phase, scheme -> one forward
    try:
        for scheme in args.schemes.split(","):
            quant, acc = mode_and_accumulator(scheme)
            common = dict(quant=quant, accumulator=acc, backend=args.backend, device=device, params_dtype=torch.bfloat16,
                          deepep_buffer=owner, validate=False, max_tokens_per_rank=args.decode_tokens)  # fmt: skip
            ln = DeepEPMoELayer(E, K, H, I, dispatch="deepep_normal", **common)
            _fill_weights(ln, scheme)
            ll = DeepEPMoELayer(E, K, H, I, dispatch="deepep_low_latency", **common)
            _share_weights(ll, ln)
            # The same prefill with every batch bounded: the host does not wait for DeepEP's counts.
            lb = DeepEPMoELayer(E, K, H, I, dispatch="deepep_normal", normal_max_tokens_per_rank=args.prefill_tokens,
                                **common)  # fmt: skip
            _share_weights(lb, ln)
            torch.cuda.empty_cache()
            entry = {}
            for phase, layer, (x, ids, w) in (("prefill", ln, (xp, idp, wp)), ("decode", ll, (xd, idd, wd))):
                mode = "normal" if phase == "prefill" else "low_latency"
                row = dict(backend=layer.backend.name, dispatcher=layer.dispatcher.name, payload=layer.payload,
                           tokens=x.shape[0])  # fmt: skip
                staged = layer.backend.name == "triton"
                ref = layer(x, topk_ids=ids, topk_weights=w)
                row["layer_ms"] = _time_loop(lambda: layer(x, topk_ids=ids, topk_weights=w), args.iters, args.warmup, device)
                row["tokens_per_s"] = x.shape[0] / row["layer_ms"] * 1e3
                tm = _Timer()
                for i in range(args.warmup + args.iters):
                    _barrier(device)
                    cur = tm if i >= args.warmup else _Timer()
                    cur.start()
                    out = _phases_once(layer, staged, x, ids, w, cur)
                row["phases_ms"] = tm.result_ms()
                row["phases_sum_ms"] = sum(row["phases_ms"].values())
                row["output_abs_sum"] = float(ref.float().abs().sum())  # compares runs and configs
                row["split_vs_layer_rel_err"] = _rel_diff(out, ref)
                row["bytes"] = _bytes(ids, rank, _payload_row_bytes(layer.payload), mode)
                # Alternating rounds, medians: neither side always runs first on a warmer GPU.
                rounds = []
                for i in range(DC_ROUNDS):
                    sides = [lambda: _deepep_raw(owner, layer, x, ids, w, mode, args.iters, args.warmup, device),
                             lambda: _layer_dc(layer, x, ids, w, args.iters, args.warmup, device)]  # fmt: skip
                    order = (0, 1) if i % 2 == 0 else (1, 0)
                    got = {side: sides[side]() for side in order}
                    rounds.append((got[0], got[1]))
                keys = ("dispatch_ms", "combine_ms", "dispatch_host_us", "combine_host_us",
                        "dispatch_pipelined_ms", "combine_pipelined_ms")  # fmt: skip
                raw, ours = ({k: statistics.median(r[side][k] for r in rounds) for k in keys} for side in (0, 1))
                row["deepep_ms"], row["layer_dc_ms"] = raw, ours
                row.update(_overheads(raw, ours))
                if mode == "normal":
                    row["no_host_sync"] = _no_host_sync(layer, lb, x, ids, w, ref, args.iters, args.warmup, device)
                if mode == "low_latency":
                    row["graph_dc_ms"] = _graph_dc(owner, layer, x, ids, w, args.iters, device)
                elif scheme == "bf16" and hasattr(torch, "_grouped_mm"):
                    try:
                        row["bf16_grouped_mm"] = _bf16_grouped_mm(layer, x, ids, w, args.iters, args.warmup, device)
                    except Exception as exc:  # noqa: BLE001 - an optional comparison: report it
                        row["bf16_grouped_mm"] = {"error": repr(exc)}
                entry[phase] = row
            res["schemes"][scheme] = entry
            if args.rounds or args.sustained:
                # Kept for the comparisons under the same load below: every scheme's weights stay
                # on the GPU until then (~11 GB BF16 + ~5.6 GB per INT8 scheme per rank here).
                turns["prefill"][scheme] = lambda lay=lb: lay(xp, topk_ids=idp, topk_weights=wp)
                turns["decode"][scheme] = lambda lay=ll: lay(xd, topk_ids=idd, topk_weights=wd)
            del ln, ll, lb
            torch.cuda.empty_cache()
        if args.rounds:
            res["interleaved"] = {phase: _interleaved(fns, args.iters, args.warmup, args.rounds, device)
                                  for phase, fns in turns.items()}  # fmt: skip
        if args.sustained:
            res["sustained"] = {"prefill": _sustained(turns["prefill"], args.iters, args.sustained, device)}
        turns.clear()
        torch.cuda.empty_cache()
        res["ll_int8_payload"] = _ll_int8_study(owner, xd, idd, device, args.iters, args.warmup)
    except Exception:  # noqa: BLE001 - reported in the JSON; the peer is killed by the parent
        res["errors"].append(traceback.format_exc())
        with open(f"{out_path}.{rank}", "w") as f:
            json.dump(res, f)
        os._exit(1)
    res["rank_seconds"] = time.time() - t0
    with open(f"{out_path}.{rank}", "w") as f:
        json.dump(res, f)
    _barrier(device)
    owner.close()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------- report
def _summary(ranks, args):
    r0 = ranks[0]
    out = dict(
        config=dict(num_experts=E, top_k=K, hidden=H, intermediate=I, world_size=WORLD,
                    prefill_tokens=args.prefill_tokens, decode_tokens=args.decode_tokens,
                    iters=args.iters, warmup=args.warmup, rounds=args.rounds, sustained_windows=args.sustained,
                    backend_requested=args.backend,
                    deepep_normal_num_sms=args.num_sms,
                    device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                    torch=torch.__version__),
        ranks=ranks,
        ratios={},
    )  # fmt: skip
    base = r0["schemes"].get("bf16", {})
    for scheme, entry in r0["schemes"].items():
        for phase, row in entry.items():
            if phase in base:
                # Throughput of the slower rank, against BF16's.
                slow = max(r["schemes"][scheme][phase]["layer_ms"] for r in ranks)
                slow_b = max(r["schemes"]["bf16"][phase]["layer_ms"] for r in ranks)
                out["ratios"][f"{scheme}/{phase}"] = slow_b / slow
    nosync = {s_: [r["schemes"][s_].get("prefill", {}).get("no_host_sync") for r in ranks] for s_ in r0["schemes"]}
    if all(nosync.get("bf16") or [None]):
        slow_b = max(n["layer_ms"] for n in nosync["bf16"])
        for scheme, rows in nosync.items():
            if all(rows):
                out["ratios"][f"{scheme}/prefill_no_host_sync"] = slow_b / max(n["layer_ms"] for n in rows)
    for kind in ("interleaved", "sustained"):
        got = [r.get(kind) for r in ranks]
        if all(got):
            for phase, per in got[0].items():
                if "bf16" in per:
                    slow_b = max(g[phase]["bf16"]["layer_ms"] for g in got)
                    for scheme in per:
                        slow = max(g[phase][scheme]["layer_ms"] for g in got)
                        out["ratios"][f"{scheme}/{phase}_{kind}"] = slow_b / slow
    # The BF16 prefill layer with torch._grouped_mm experts instead of the backend's: its time
    # minus the backend's experts pass plus grouped_mm's, both measured on the same batch.
    alt = [r["schemes"].get("bf16", {}).get("prefill", {}).get("bf16_grouped_mm") for r in ranks]
    if all(a and "error" not in a for a in alt):
        est = max(r["schemes"]["bf16"]["prefill"]["layer_ms"] - a["backend_experts_ms"] + a["grouped_mm_experts_ms"]
                  for r, a in zip(ranks, alt))  # fmt: skip
        out["bf16_grouped_mm_prefill_layer_ms"] = est
        for scheme in r0["schemes"]:
            if "prefill" in r0["schemes"][scheme]:
                slow = max(r["schemes"][scheme]["prefill"]["layer_ms"] for r in ranks)
                out["ratios"][f"{scheme}/prefill_vs_bf16_grouped_mm"] = est / slow
    return out


def _table(summary) -> str:
    lines = []
    hdr = f"{'scheme':<19}{'phase':<8}{'backend':<8}{'layer ms':>9}{'x bf16':>7}  " + " ".join(
        f"{p[:8]:>8}" for p in PHASES
    ) + f"{'DeepEP d/c ms':>15}{'layer d/c ms':>15}{'ovh d/c %':>12}"
    lines.append(hdr)
    for r in summary["ranks"]:
        for scheme, entry in r["schemes"].items():
            for phase, row in entry.items():
                ph = row["phases_ms"]
                dp = row["deepep_ms"]
                ld = row.get("layer_dc_ms") or {"dispatch_ms": float("nan"), "combine_ms": float("nan")}
                ov = (row.get("dispatch_overhead_pct"), row.get("combine_overhead_pct"))
                ratio = summary["ratios"].get(f"{scheme}/{phase}", float("nan"))
                lines.append(
                    f"{scheme:<19}{phase:<8}{row['backend']:<8}{row['layer_ms']:>9.3f}{ratio:>7.2f}  "
                    + " ".join(f"{ph[p]:>8.3f}" if p in ph else f"{'-':>8}" for p in PHASES)
                    + f"{dp['dispatch_ms']:>8.3f}/{dp['combine_ms']:<6.3f}"
                    + f"{ld['dispatch_ms']:>8.3f}/{ld['combine_ms']:<6.3f}"
                    + f"{ov[0] or 0:>6.1f}/{ov[1] or 0:<5.1f}  rank {r['rank']}"
                )
    for r in summary["ranks"]:
        for scheme, entry in r["schemes"].items():
            g = entry.get("decode", {}).get("graph_dc_ms")
            if g and "error" not in g:
                lines.append(f"decode dispatch+combine in a CUDA graph, {scheme}, rank {r['rank']}: DeepEP "
                             f"{g['deepep_ms']:.4f} ms, layer {g['layer_ms']:.4f} ms ({g['overhead_pct']:+.1f}%)")
            elif g:
                lines.append(f"decode graph timing, {scheme}, rank {r['rank']}: {g['error']}")
    for r in summary["ranks"]:
        for scheme, entry in r["schemes"].items():
            for phase, row in entry.items():
                dp, ld = row["deepep_ms"], row.get("layer_dc_ms") or {}
                if "dispatch_host_us" in dp and "dispatch_host_us" in ld:
                    lines.append(
                        f"host time per call, {scheme} {phase}, rank {r['rank']}: dispatch DeepEP "
                        f"{dp['dispatch_host_us']:.1f} us, layer {ld['dispatch_host_us']:.1f} us; combine DeepEP "
                        f"{dp['combine_host_us']:.1f} us, layer {ld['combine_host_us']:.1f} us"
                    )
                if "dispatch_pipelined_ms" in dp and "dispatch_pipelined_ms" in ld:
                    lines.append(
                        f"pipelined (DeepEP's own method), {scheme} {phase}, rank {r['rank']}: dispatch DeepEP "
                        f"{dp['dispatch_pipelined_ms']:.4f} ms, layer {ld['dispatch_pipelined_ms']:.4f} ms "
                        f"({row['dispatch_pipelined_overhead_pct']:+.1f}%); combine DeepEP "
                        f"{dp['combine_pipelined_ms']:.4f} ms, layer {ld['combine_pipelined_ms']:.4f} ms "
                        f"({row['combine_pipelined_overhead_pct']:+.1f}%)"
                    )
    for r in summary["ranks"]:
        for scheme, entry in r["schemes"].items():
            n = entry.get("prefill", {}).get("no_host_sync")
            if n:
                ratio = summary["ratios"].get(f"{scheme}/prefill_no_host_sync", float("nan"))
                lines.append(f"prefill without host sync (normal_max_tokens_per_rank), {scheme}, rank {r['rank']}: "
                             f"{n['layer_ms']:.3f} ms ({ratio:.2f}x bf16) vs {n['sync_ms']:.3f} ms with it "
                             f"(rel. diff {n['rel_diff_vs_sync']:.1e})")  # fmt: skip
    for kind, how in (("interleaved", f"{summary['config'].get('rounds')} rounds of turns"),
                      ("sustained", f"{summary['config'].get('sustained_windows')} windows back to back, second half")):
        for phase, per in (summary["ranks"][0].get(kind) or {}).items():
            what = "bounded prefill (normal_max_tokens_per_rank)" if phase == "prefill" else "low-latency decode"
            lines.append(
                f"{kind} throughput, {what}, {how}, slower rank: "
                + ", ".join(f"{s} {max(r[kind][phase][s]['layer_ms'] for r in summary['ranks']):.3f} ms "
                            f"({summary['ratios'].get(f'{s}/{phase}_{kind}', float('nan')):.2f}x bf16)" for s in per)
            )  # fmt: skip
    for r in summary["ranks"]:
        a = r["schemes"].get("bf16", {}).get("prefill", {}).get("bf16_grouped_mm")
        if a and "error" in a:
            lines.append(f"bf16 prefill experts through torch._grouped_mm, rank {r['rank']}: {a['error']}")
        elif a:
            lines.append(f"bf16 prefill experts on the same batch ({a['rows']} rows), rank {r['rank']}: backend "
                         f"{a['backend_experts_ms']:.3f} ms, torch._grouped_mm {a['grouped_mm_experts_ms']:.3f} ms "
                         f"(rel. diff {a['rel_diff']:.1e})")  # fmt: skip
    if "bf16_grouped_mm_prefill_layer_ms" in summary:
        ratios = ", ".join(f"{k.split('/')[0]} {v:.2f}x" for k, v in summary["ratios"].items() if k.endswith("_grouped_mm"))
        lines.append(f"bf16 prefill layer with torch._grouped_mm experts (estimated): "
                     f"{summary['bf16_grouped_mm_prefill_layer_ms']:.3f} ms; prefill against it: {ratios}")
    ll = summary["ranks"][0].get("ll_int8_payload")
    if ll:
        lines.append("low-latency INT8 payloads (rank 0): dispatch + quantize ms, rel. error vs exact")
        for key in ("bf16_token", "fp8_token", "bf16_group", "fp8_group"):
            v = ll[key]
            err = ll["rel_err_vs_exact"][key]
            lines.append(f"  {key:<11} {v['dispatch_ms']:.4f} + {v['quant_ms']:.4f} ms  err {err:.4%}")
    return "\n".join(lines)


def _stacked_phases(rank_summary: dict, phase: str) -> tuple[list[str], list[tuple[str, list, list, str]]]:
    """Schemes of one panel and its bar segments ``(layer phase, heights, bottoms, color)``.

    A layer phase keeps its color in every panel (decode has no scatter or gather: colors taken
    in turn from the cycle would shift there and contradict the legend)."""
    names = [s for s in rank_summary["schemes"] if phase in rank_summary["schemes"][s]]
    bottom = [0.0] * len(names)
    segments = []
    for i, p in enumerate(PHASES):
        vals = [rank_summary["schemes"][s][phase]["phases_ms"].get(p, 0.0) for s in names]
        if any(vals):
            segments.append((p, vals, bottom, f"C{i}"))
            bottom = [b + v for b, v in zip(bottom, vals)]
    return names, segments


def _plot(summary, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    r0 = summary["ranks"][0]
    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    for ax, phase in zip(axes, ("prefill", "decode")):
        names, segments = _stacked_phases(r0, phase)
        for p, vals, bottom, color in segments:
            ax.bar(names, vals, bottom=bottom, label=p, color=color)
        ax.plot(names, [r0["schemes"][s][phase]["layer_ms"] for s in names], "k_", markersize=40,
                label="whole layer")  # fmt: skip
        ax.set_title(f"{phase} ({r0['schemes'][names[0]][phase]['tokens']} tokens/rank), rank 0")
        ax.set_ylabel("ms")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    args = _parse(list(sys.argv[1:] if argv is None else argv))
    if not torch.cuda.is_available() or torch.cuda.device_count() < WORLD:
        print(f"epmoe bench layer needs {WORLD} CUDA GPUs", file=sys.stderr)
        return 2
    import socket

    import torch.multiprocessing as mp

    port = args.port
    if not port:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    tmp = tempfile.mkdtemp(prefix="epmoe_bench_layer_")
    out_path = os.path.join(tmp, "rank")
    failed = None
    try:
        mp.start_processes(_rank_main, args=(args, port, out_path), nprocs=WORLD, start_method="spawn")
    except Exception as exc:  # noqa: BLE001 - report what the ranks wrote
        failed = repr(exc)
    ranks = []
    for r in range(WORLD):
        if os.path.exists(f"{out_path}.{r}"):
            with open(f"{out_path}.{r}") as f:
                ranks.append(json.load(f))
    errors = [e for r in ranks for e in r.get("errors", [])]
    if failed or errors or len(ranks) < WORLD:
        print("bench failed:", failed, *errors, sep="\n", file=sys.stderr)
        if args.json and ranks:
            with open(args.json, "w") as f:
                json.dump(dict(failed=failed, ranks=ranks), f, indent=1)
        return 1
    summary = _summary(ranks, args)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    if args.plot:
        os.makedirs(os.path.dirname(os.path.abspath(args.plot)), exist_ok=True)
        try:
            _plot(summary, args.plot)
        except Exception as exc:  # noqa: BLE001 - the numbers matter more than the picture
            print(f"plot failed: {exc!r}", file=sys.stderr)
    print(_table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
