"""Studies of the EP layer over DeepEP on 2 GPUs (the measurements behind its design choices).

    python benchmarks/layer_studies.py [--schemes bf16,int8_channel_int32] [--sustained 60] [--json out.json]

The same layers and batches as ``epmoe bench layer`` (DeepSeek-V3 shapes: 256 experts, top-8,
H = 7168, I = 2048, 2 ranks; prefill 4096 tokens per rank on DeepEP normal, decode 128 on
low-latency), and per scheme:

* DeepEP's own dispatch / combine (``deep_ep.Buffer`` called directly) against the layer
  dispatcher's for the same payload, timed two ways: each call alone after a barrier (host time
  before the first launch counts in full), and pipelined as DeepEP's own tests time them (pairs
  back to back, an event around each call); the host time of each call;
* decode dispatch + combine captured in CUDA graphs (DeepEP directly and through the layer);
* prefill with and without the host sync on DeepEP's receive counts
  (``normal_max_tokens_per_rank``), in alternating rounds;
* the BF16 prefill experts through ``torch._grouped_mm`` against the layer's backend, same batch;
* with ``--sustained W``: W windows of ``--iters`` prefill forwards per scheme without a pause
  (the clocks under the power cap), SM clock and temperature after;
* low-latency INT8 payloads: BF16 dispatch then INT8 quantization, against FP8 dispatch then INT8
  requantization (time, and error against the exact activations in float64).

Timed with :mod:`epmoe.timing` (CUDA events over a fixed count on every rank), launched with
:func:`epmoe.launch.run_ranks`.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from epmoe import timing
from epmoe.bench.experts import bf16_grouped_mm_pass
from epmoe.bench.layer import (
    E, H, I, K, add_arguments, bench_phases, build_layers, check_args, device_name, interleaved, launch, rank_setup,
    ranks_device, write_json,
)  # fmt: skip

DC_ROUNDS = 4
"""Rounds of each dispatch / combine comparison, alternating which side runs first."""


def time_pair(first, second, iters, warmup, device, names=("dispatch", "combine"), between=None):
    """Median ms of ``first()`` and of ``second(...)`` on its result, each timed alone on an
    idle GPU (all ranks meet before every iteration; :func:`epmoe.timing.marked_ms`), plus the
    median host time of each call (``<name>_host_us``: from the call to its return, what an idle
    GPU waits for before the first kernel at most). ``between`` (untimed) turns the first result
    into the second's argument. Returns the times and the last results of both calls."""
    last = {}

    def step(mark):
        r1 = first()
        mark(names[0])
        arg = r1 if between is None else between(r1)
        mark(None)
        last["r"] = (r1, second(arg))
        mark(names[1])

    s = timing.marked_ms(step, iters, warmup, device)
    med = statistics.median
    times = {f"{n}_ms": med(s[n]) for n in names}
    times.update({f"{n}_host_us": med(s[f"{n}_host_us"]) for n in names})
    return times, *last["r"]


def time_pipelined(first, second, iters, warmup, device, names=("dispatch", "combine"), between=None):
    """Median ms of ``first()`` and ``second(...)`` called in pairs back to back, with no barrier
    or host sync between iterations and an event between the calls: how DeepEP's own tests time
    theirs. The host runs ahead wherever it can, so this is each call's GPU time plus only the
    host time the GPU cannot hide (normal-mode dispatch still waits on the host for its receive
    counts); :func:`time_pair` is the opposite case, an idle GPU waiting for the call."""
    arg = (lambda r: r) if between is None else between

    def step(mark):
        r = first()
        mark(names[0])
        second(arg(r))
        mark(names[1])

    s = timing.marked_ms(step, iters, warmup, device, barrier_each=False)
    return {f"{n}_pipelined_ms": statistics.median(s[n]) for n in names}


def time_both(first, second, iters, warmup, device, between=None):
    """Both timings of a dispatch / combine pair: isolated (:func:`time_pair`) and pipelined."""
    times, _, _ = time_pair(first, second, iters, warmup, device, between=between)
    times.update(time_pipelined(first, second, iters, warmup, device, between=between))
    return times


def _combine_input(cache, shape, device):
    """A zero BF16 combine input of ``shape``, allocated once per shape."""
    if cache.get("shape") != shape:
        cache["shape"], cache["y"] = shape, torch.zeros(*shape, dtype=torch.bfloat16, device=device)
    return cache["y"]


def _deepep_raw(owner, layer, x_in, ids, w, mode, iters, warmup, device):
    """DeepEP's own dispatch and combine time for the same payload (deep_ep.Buffer directly)."""
    from epmoe.dispatch.deepep_dispatch.dispatchers import normal_payload
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

        times = time_both(
            dispatch, lambda a: buf.combine(a[0], a[1], config=owner.combine_config), iters, warmup, device,
            between=lambda r: (_combine_input(cache, (r[0], H), device), r[1]),
        )  # fmt: skip
        owner.mark_normal_used()
        return times
    if owner.clean_low_latency():
        timing.barrier(device)
    xb = x_in.to(torch.bfloat16).contiguous()
    use_fp8 = layer.dispatcher.cfg.low_latency_payload == "fp8_group"
    plan = owner.plan
    y = _combine_input(cache, (layer.num_local_experts, plan.ll_max_tokens * layer.world_size, H), device)
    times = time_both(
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
    times = time_both(
        lambda: layer.dispatcher.send(x, xs, ids, w), lambda a: layer.dispatcher.combine(*a), iters, warmup, device,
        between=lambda d: (_combine_input(cache, (*d.x.shape[:-1], H), device), d),
    )  # fmt: skip
    return times


def dc_comparison(owner, layer, x, ids, w, mode, iters, warmup, device) -> dict:
    """DeepEP's own dispatch + combine (:func:`_deepep_raw`) against the layer dispatcher's
    (:func:`_layer_dc`) on the same batch, ``DC_ROUNDS`` rounds alternating which side runs
    first (neither always meets a warmer GPU), medians: ``{"deepep_ms": {...}, "layer_dc_ms":
    {...}, "<phase>_overhead_pct": ...}`` (every rank must call it: both sides are collectives)."""
    rounds = []
    for i in range(DC_ROUNDS):
        sides = [lambda: _deepep_raw(owner, layer, x, ids, w, mode, iters, warmup, device),
                 lambda: _layer_dc(layer, x, ids, w, iters, warmup, device)]  # fmt: skip
        order = (0, 1) if i % 2 == 0 else (1, 0)
        got = {side: sides[side]() for side in order}
        rounds.append((got[0], got[1]))
    keys = ("dispatch_ms", "combine_ms", "dispatch_host_us", "combine_host_us",
            "dispatch_pipelined_ms", "combine_pipelined_ms")  # fmt: skip
    raw, ours = ({k: statistics.median(r[side][k] for r in rounds) for k in keys} for side in (0, 1))
    return dict(deepep_ms=raw, layer_dc_ms=ours, **_overheads(raw, ours))


def _overheads(raw: dict, ours: dict) -> dict:
    """``<phase>_overhead_pct`` = layer / DeepEP - 1, in percent, for dispatch and combine timed
    isolated and pipelined."""
    phases = ("dispatch", "combine", "dispatch_pipelined", "combine_pipelined")
    return {f"{p}_overhead_pct": 100.0 * (ours[f"{p}_ms"] - raw[f"{p}_ms"]) / raw[f"{p}_ms"] for p in phases}


def _sustained(forwards, per_window, windows, device):
    """Per scheme, ``windows`` windows of ``per_window`` back-to-back forwards, one scheme after
    the other with no pause: what a layer serving one scheme under constant load runs at once
    the GPU's clocks have settled. CUDA events at the window boundaries only (the host never
    waits inside); returns each window's mean ms and the median of the second half's, plus the
    SM clock (MHz) and temperature (C) after the last window when NVML is readable."""
    out = {}
    for name, fn in forwards.items():

        def window(mark, fn=fn):
            for _ in range(per_window):
                fn()
            mark("window")

        ms = [t / per_window for t in timing.marked_ms(window, windows, 0, device, barrier_each=False)["window"]]
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
    res = {k: v["layer_ms"] for k, v in interleaved(turns, iters, warmup, DC_ROUNDS, device).items()}
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
        "backend_experts_ms": timing.collective_ms(
            lambda: layer.backend.run_contiguous(batch, wts, x_in.dtype), iters, warmup, device, collective=False
        ),
        "grouped_mm_experts_ms": timing.collective_ms(grouped_mm, iters, warmup, device, collective=False),
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
        y = torch.zeros(layer.num_local_experts, plan.ll_max_tokens * layer.world_size, H, dtype=torch.bfloat16,
                        device=device)  # fmt: skip

        def raw():
            _, _, handle, _, _ = buf.low_latency_dispatch(xb, ids, plan.ll_max_tokens, E, use_fp8=use_fp8)
            buf.low_latency_combine(y, ids, w, handle)

        def ours():
            d = layer.dispatcher.send(xb, None, ids, w)
            layer.dispatcher.combine(y, d)

        graphs = {}
        for name, fn in (("deepep", raw), ("layer", ours)):
            fn()
            timing.barrier(device)
            graphs[name] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[name]):
                fn()
        samples: dict[str, list[float]] = {name: [] for name in graphs}
        for i in range(DC_ROUNDS * iters):
            for name in (("deepep", "layer") if i % 2 == 0 else ("layer", "deepep")):
                replay = lambda mark, g=graphs[name], name=name: (g.replay(), mark(name))  # noqa: E731
                samples[name] += timing.marked_ms(replay, 1, 0, device)[name]
        out = {f"{name}_ms": statistics.median(v) for name, v in samples.items()}
        del graphs
        out["overhead_pct"] = 100.0 * (out["layer_ms"] - out["deepep_ms"]) / out["deepep_ms"]
        return out
    except Exception as exc:  # noqa: BLE001 - an optional measurement: report, do not abort
        return {"error": repr(exc)}


def _ll_int8_study(owner, x, ids, device, iters, warmup):
    """Low-latency INT8 payloads: BF16 dispatch + INT8 quantize vs FP8 dispatch + requantize."""
    from epmoe.dispatch.deepep_dispatch.sizing import expected_rows_per_expert
    from epmoe.kernels import quantize as qz

    if owner.clean_low_latency():
        timing.barrier(device)
    buf, plan, world = owner.get(), owner.plan, owner.world_size
    hint = expected_rows_per_expert(x.shape[0], world, K, E)  # what the layer's backend is given
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

            times, d, (q, s) = time_pair(dispatch, quant, iters, warmup, device, names=("dispatch", "quant"))
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
                for j in range(world):
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
def _rank_main(rank, world, port, args):
    import torch.distributed as dist

    device, owner, batches = rank_setup(rank, world, port, args)
    (xp, idp, wp), (xd, idd, wd) = batches["prefill"], batches["decode"]
    res: dict = dict(rank=rank, device=device_name(device), schemes={})
    sustained: dict = {}
    for scheme in args.schemes.split(","):
        layers = build_layers(scheme, args, owner, device)
        entry = {}
        for phase, mode, layer, (x, ids, w) in bench_phases(layers, batches):
            row = dict(backend=layer.backend.name, dispatcher=layer.dispatcher.name, payload=layer.payload)
            ref = layer(x, topk_ids=ids, topk_weights=w)
            row.update(dc_comparison(owner, layer, x, ids, w, mode, args.iters, args.warmup, device))
            if mode == "normal":
                row["no_host_sync"] = _no_host_sync(layer, layers["bounded"], x, ids, w, ref, args.iters,
                                                    args.warmup, device)  # fmt: skip
            if mode == "low_latency":
                row["graph_dc_ms"] = _graph_dc(owner, layer, x, ids, w, args.iters, device)
            elif scheme == "bf16" and hasattr(torch, "_grouped_mm"):
                try:
                    row["bf16_grouped_mm"] = _bf16_grouped_mm(layer, x, ids, w, args.iters, args.warmup, device)
                except Exception as exc:  # noqa: BLE001 - an optional comparison: report it
                    row["bf16_grouped_mm"] = {"error": repr(exc)}
            entry[phase] = row
        res["schemes"][scheme] = entry
        if args.sustained:
            lb = layers["bounded"]
            sustained[scheme] = lambda lay=lb: lay(xp, topk_ids=idp, topk_weights=wp)
        del layers
        torch.cuda.empty_cache()
    if args.sustained:
        res["sustained"] = {"prefill": _sustained(sustained, args.iters, args.sustained, device)}
    sustained.clear()
    torch.cuda.empty_cache()
    res["ll_int8_payload"] = _ll_int8_study(owner, xd, idd, device, args.iters, args.warmup)
    timing.barrier(device)
    owner.close()
    dist.destroy_process_group()
    return res


# ---------------------------------------------------------------------------------- report
def _summary(ranks, args):
    out = dict(config=dict(vars(args), device=ranks_device(ranks), torch=torch.__version__), ranks=ranks, ratios={})
    r0 = ranks[0]
    nosync = {s_: [r["schemes"][s_].get("prefill", {}).get("no_host_sync") for r in ranks] for s_ in r0["schemes"]}
    if all(nosync.get("bf16") or [None]):
        slow_b = max(n["layer_ms"] for n in nosync["bf16"])
        for scheme, rows in nosync.items():
            if all(rows):
                out["ratios"][f"{scheme}/prefill_no_host_sync"] = slow_b / max(n["layer_ms"] for n in rows)
    got = [r.get("sustained") for r in ranks]
    if all(got):
        for phase, per in got[0].items():
            if "bf16" in per:
                slow_b = max(g[phase]["bf16"]["layer_ms"] for g in got)
                for scheme in per:
                    out["ratios"][f"{scheme}/{phase}_sustained"] = slow_b / max(g[phase][scheme]["layer_ms"] for g in got)
    # The BF16 prefill layer with torch._grouped_mm experts instead of the backend's: the no-host-
    # sync layer time minus the backend's experts pass plus grouped_mm's, on the same batch.
    alt = [r["schemes"].get("bf16", {}).get("prefill", {}).get("bf16_grouped_mm") for r in ranks]
    if all(a and "error" not in a for a in alt) and all(nosync.get("bf16") or [None]):
        est = max(n["sync_ms"] - a["backend_experts_ms"] + a["grouped_mm_experts_ms"]
                  for n, a in zip(nosync["bf16"], alt))  # fmt: skip
        out["bf16_grouped_mm_prefill_layer_ms"] = est
        for scheme, rows in nosync.items():
            if all(rows):
                out["ratios"][f"{scheme}/prefill_vs_bf16_grouped_mm"] = est / max(n["sync_ms"] for n in rows)
    return out


def _table(summary) -> str:
    lines = []
    for r in summary["ranks"]:
        for scheme, entry in r["schemes"].items():
            for phase, row in entry.items():
                dp, ld = row["deepep_ms"], row["layer_dc_ms"]
                lines.append(
                    f"isolated, {scheme} {phase}, rank {r['rank']}: dispatch DeepEP {dp['dispatch_ms']:.4f} ms, layer "
                    f"{ld['dispatch_ms']:.4f} ms ({row['dispatch_overhead_pct']:+.1f}%); combine DeepEP "
                    f"{dp['combine_ms']:.4f} ms, layer {ld['combine_ms']:.4f} ms ({row['combine_overhead_pct']:+.1f}%)"
                )
                lines.append(
                    f"host time per call, {scheme} {phase}, rank {r['rank']}: dispatch DeepEP "
                    f"{dp['dispatch_host_us']:.1f} us, layer {ld['dispatch_host_us']:.1f} us; combine DeepEP "
                    f"{dp['combine_host_us']:.1f} us, layer {ld['combine_host_us']:.1f} us"
                )
                lines.append(
                    f"pipelined (DeepEP's own method), {scheme} {phase}, rank {r['rank']}: dispatch DeepEP "
                    f"{dp['dispatch_pipelined_ms']:.4f} ms, layer {ld['dispatch_pipelined_ms']:.4f} ms "
                    f"({row['dispatch_pipelined_overhead_pct']:+.1f}%); combine DeepEP "
                    f"{dp['combine_pipelined_ms']:.4f} ms, layer {ld['combine_pipelined_ms']:.4f} ms "
                    f"({row['combine_pipelined_overhead_pct']:+.1f}%)"
                )
                g = row.get("graph_dc_ms")
                if g and "error" not in g:
                    lines.append(f"decode dispatch+combine in a CUDA graph, {scheme}, rank {r['rank']}: DeepEP "
                                 f"{g['deepep_ms']:.4f} ms, layer {g['layer_ms']:.4f} ms ({g['overhead_pct']:+.1f}%)")
                elif g:
                    lines.append(f"decode graph timing, {scheme}, rank {r['rank']}: {g['error']}")
                n = row.get("no_host_sync")
                if n:
                    ratio = summary["ratios"].get(f"{scheme}/prefill_no_host_sync", float("nan"))
                    lines.append(f"prefill without host sync (normal_max_tokens_per_rank), {scheme}, rank {r['rank']}: "
                                 f"{n['layer_ms']:.3f} ms ({ratio:.2f}x bf16) vs {n['sync_ms']:.3f} ms with it "
                                 f"(rel. diff {n['rel_diff_vs_sync']:.1e})")  # fmt: skip
                a = row.get("bf16_grouped_mm")
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
    windows = summary["config"].get("sustained")
    for phase, per in (summary["ranks"][0].get("sustained") or {}).items():
        lines.append(
            f"sustained throughput, bounded prefill, {windows} windows back to back, second half, slower rank: "
            + ", ".join(f"{s} {max(r['sustained'][phase][s]['layer_ms'] for r in summary['ranks']):.3f} ms "
                        f"({summary['ratios'].get(f'{s}/{phase}_sustained', float('nan')):.2f}x bf16)" for s in per)
        )  # fmt: skip
    ll = summary["ranks"][0].get("ll_int8_payload")
    if ll:
        lines.append("low-latency INT8 payloads (rank 0): dispatch + quantize ms, rel. error vs exact")
        for key in ("bf16_token", "fp8_token", "bf16_group", "fp8_group"):
            v = ll[key]
            err = ll["rel_err_vs_exact"][key]
            lines.append(f"  {key:<11} {v['dispatch_ms']:.4f} + {v['quant_ms']:.4f} ms  err {err:.4%}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/layer_studies.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    add_arguments(p, standard=False)
    p.add_argument("--sustained", type=int, default=0,
                   help="windows of --iters forwards each for the sustained prefill throughput, per scheme (0: skip)")
    args = p.parse_args(argv)
    check_args(p, args)
    if args.sustained < 0:
        p.error(f"--sustained={args.sustained}; must be >= 0")
    ranks, code = launch(_rank_main, args, "benchmarks/layer_studies.py")
    if ranks is None:
        return code
    summary = _summary(ranks, args)
    write_json(summary, args.json)
    print(_table(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
