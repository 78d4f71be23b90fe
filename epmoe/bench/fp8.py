"""FP8 block backends on one GPU: the deepgemm backend vs calling DeepGEMM directly vs cutlass.

    python -m epmoe.bench.fp8 [--experts 128 --hidden 7168 --inter 2048 --m 8,32,128,512,2048]
                              [--impls deepgemm,direct,cutlass] [--json fp8_bench.json]

For every m (rows per expert, uniform routing) it times, with CUDA events around a fixed number of
calls (median of repeats):

* ``gemm1`` ``[E*m, H] x [H, 2I]`` and ``gemm2`` ``[E*m, I] x [I, H]``:
  ``direct`` = the raw ``deep_gemm`` call (contiguous layout, segments padded to 128),
  ``deepgemm`` = the backend's wrapper of that call, ``cutlass`` = the CUTLASS grouped GEMM
  (unpadded segments); for m <= 128 also the masked GEMMs (``direct-masked``, ``deepgemm-masked``).
* ``experts``: the whole experts pass from bf16 activations (quantize, GEMM1, SiLU*up + requant,
  GEMM2): ``DeepGemmBackend.run_contiguous`` / ``run_masked``, the same four launches with raw
  DeepGEMM calls (``direct``), and ``CutlassBackend.run_contiguous``.

TFLOP/s count only valid rows (``2 * E*m * N * K`` per GEMM). Targets (issue 5): ``deepgemm`` within
5% of ``direct``; ``cutlass`` within 10% of ``direct`` for m >= 512. DeepGEMM compiles each shape
on first use and the CUTLASS extension builds on first use; both are done (untimed) before timing.

    python -m epmoe.bench.fp8 --sweep [--m 128,512,2048] [--configs all] [--json cutlass_sweep.json]

``--sweep`` instead times GEMM1 and GEMM2 with every CUTLASS kernel configuration
(``cutlass_backend.CONFIGS``) beside the direct DeepGEMM call (when ``deep_gemm`` imports), checks
each output against a float32 reference on a few experts (``1 - 2*sum(x*y)/sum(x*x+y*y) < 1e-3``),
tries the tile scheduler's raster order and swizzle on the fastest configuration of each point,
and prints a recommended ``cutlass_backend.SELECTION`` table. About a minute on an H200.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

BLOCK = 128


def _time(fn, iters: int, repeats: int) -> float:
    """Median milliseconds per call."""
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / iters)
    return statistics.median(samples)


def _weights(e: int, n: int, k: int, dev, seed: int):
    """Random e4m3 weights [E, N, K] and fp32 block scales, built per expert to bound memory."""
    g = torch.Generator(device=dev).manual_seed(seed)
    w = torch.empty((e, n, k), dtype=torch.float8_e4m3fn, device=dev)
    for i in range(e):
        w[i] = (torch.randn((n, k), generator=g, device=dev, dtype=torch.bfloat16) * 64).to(torch.float8_e4m3fn)
    s = torch.rand((e, n // BLOCK, k // BLOCK), generator=g, device=dev) * 1e-3 + 1e-4
    return w, s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m epmoe.bench.fp8", description=__doc__.split("\n")[0])
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--inter", type=int, default=2048)
    p.add_argument("--m", default=None, help="rows per expert, comma-separated "
                   "(default 8,32,128,512,2048; with --sweep 128,512,2048)")
    p.add_argument("--impls", default="deepgemm,direct,cutlass")
    p.add_argument("--masked-max-m", type=int, default=128, help="also time masked GEMMs up to this m")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--repeats", type=int, default=None, help="timed repeats, median taken (default 5; --sweep 3)")
    p.add_argument("--json", default=None, help="output file (default fp8_bench.json; with --sweep cutlass_sweep.json)")
    p.add_argument("--sweep", action="store_true", help="time every CUTLASS configuration (see above)")
    p.add_argument("--configs", default="all", help="--sweep: CUTLASS configuration names, comma-separated, or 'all'")
    p.add_argument("--check-experts", type=int, default=4, help="--sweep: experts checked against float32")
    p.add_argument("--no-sched", action="store_true", help="--sweep: skip the raster/swizzle variants")
    p.add_argument("--target-ms", type=float, default=40.0, help="--sweep: milliseconds per timed repeat")
    args = p.parse_args(argv)
    if args.sweep:
        args.repeats = args.repeats or 3
        args.m = args.m or "128,512,2048"
        args.json = args.json or "cutlass_sweep.json"
        return sweep(args)
    args.repeats = args.repeats or 5
    args.m = args.m or "8,32,128,512,2048"
    args.json = args.json or "fp8_bench.json"

    from ..experts.base import ExpertWeights
    from ..kernels import activation, quantize
    from ..layouts import ContiguousBatch, MaskedBatch
    from ..quant.schemes import get_scheme

    if not torch.cuda.is_available():
        print("no CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda", torch.cuda.current_device())
    e, h, inter = args.experts, args.hidden, args.inter
    ms = [int(v) for v in args.m.split(",") if v]
    impls = [v for v in args.impls.split(",") if v]
    scheme = get_scheme("fp8_block")
    t_start = time.perf_counter()

    dg = cut = None
    if "deepgemm" in impls or "direct" in impls:
        from ..experts import deepgemm_backend as dgb

        api = dgb.deep_gemm_api()
        if api is None:
            print("deep_gemm not importable; skipping deepgemm/direct", file=sys.stderr)
            impls = [i for i in impls if i not in ("deepgemm", "direct")]
        else:
            dg = dgb
    if "cutlass" in impls:
        os.environ.setdefault("SGLANG_CUTLASS_MOE", "1")
        from ..experts import cutlass_backend as cb

        t0 = time.perf_counter()
        try:
            if not cb._use_sgl():
                cb.load_extension()
            cut = cb
            print(f"cutlass ready in {time.perf_counter() - t0:.1f} s (sgl-kernel: {cb._use_sgl()})")
        except Exception as exc:
            print(f"cutlass unavailable: {exc}", file=sys.stderr)
            impls.remove("cutlass")

    w13, s13 = _weights(e, 2 * inter, h, dev, 0)
    w2, s2 = _weights(e, h, inter, dev, 1)
    weights = ExpertWeights(scheme, w13, w2, s13, s2)
    dg_backend = dg.DeepGemmBackend(scheme) if dg else None
    cut_backend = cut.CutlassBackend(scheme) if cut else None
    rows = []

    def record(m, gemm, impl, ms_, n, k):
        flops = 2.0 * e * m * n * k
        row = dict(m=m, gemm=gemm, impl=impl, ms=round(ms_, 4), tflops=round(flops / ms_ / 1e9, 1))
        rows.append(row)
        print(f"m={m:5d} {gemm:8s} {impl:16s} {ms_:9.3f} ms {row['tflops']:8.1f} TFLOP/s", flush=True)

    for m in ms:
        g = torch.Generator(device=dev).manual_seed(m)
        # ---- contiguous, padded to DeepGEMM's alignment ----
        align = dg.deep_gemm_api().alignment if dg else BLOCK
        per = -(-m // align) * align
        m_indices = torch.full((e, per), -1, dtype=torch.int32, device=dev)
        m_indices[:, :m] = torch.arange(e, dtype=torch.int32, device=dev)[:, None]
        m_indices = m_indices.reshape(-1)
        x_pad = torch.zeros((e, per, h), dtype=torch.bfloat16, device=dev)
        x_pad[:, :m] = torch.randn((e, m, h), generator=g, device=dev, dtype=torch.bfloat16)
        x_pad = x_pad.reshape(-1, h)
        offsets_pad = torch.arange(0, e * per + 1, per, dtype=torch.int32, device=dev)
        batch_pad = ContiguousBatch(x_pad, None, offsets_pad, m_indices, torch.empty(0, 1, device=dev), [m] * e)
        a, sa = quantize.per_group_quant(x_pad, BLOCK, torch.float8_e4m3fn)
        hq = torch.randn((e * per, inter), generator=g, device=dev, dtype=torch.bfloat16)
        hq, sh = quantize.per_group_quant(hq, BLOCK, torch.float8_e4m3fn)
        if dg:
            api = dg.deep_gemm_api()
            d1 = torch.empty((e * per, 2 * inter), dtype=torch.bfloat16, device=dev)
            d2 = torch.empty((e * per, h), dtype=torch.bfloat16, device=dev)

            def direct1():
                api.contiguous((a, sa), (w13, s13), d1, m_indices)

            def direct2():
                api.contiguous((hq, sh), (w2, s2), d2, m_indices)

            def direct_pass():
                q, s = quantize.per_group_quant(x_pad, BLOCK, torch.float8_e4m3fn)
                api.contiguous((q, s), (w13, s13), d1, m_indices)
                h_, hs = activation.silu_and_mul_quant(d1, "group", BLOCK, torch.float8_e4m3fn)
                api.contiguous((h_, hs), (w2, s2), d2, m_indices)

            cases = []
            if "direct" in impls:
                cases += [("gemm1", "direct", direct1, 2 * inter, h), ("gemm2", "direct", direct2, h, inter),
                          ("experts", "direct", direct_pass, None, None)]  # fmt: skip
            if "deepgemm" in impls:
                cases += [
                    ("gemm1", "deepgemm", lambda: dg.gemm_contiguous(a, sa, w13, s13, m_indices, d1), 2 * inter, h),
                    ("gemm2", "deepgemm", lambda: dg.gemm_contiguous(hq, sh, w2, s2, m_indices, d2), h, inter),
                    ("experts", "deepgemm",
                     lambda: dg_backend.run_contiguous(batch_pad, weights, torch.bfloat16), None, None),
                ]  # fmt: skip
            for gemm, impl, fn, n, k in cases:
                t = _time(fn, args.iters, args.repeats)
                if gemm == "experts":
                    record(m, gemm, impl, t, 3 * inter, h)  # 2I*H + H*I = 3*I*H per row
                else:
                    record(m, gemm, impl, t, n, k)
            del d1, d2
        # ---- contiguous without padding (cutlass) ----
        if cut:
            x = x_pad.reshape(e, per, h)[:, :m].reshape(-1, h).contiguous()
            offsets = torch.arange(0, e * m + 1, m, dtype=torch.int32, device=dev)
            mi = torch.arange(e, dtype=torch.int32, device=dev).repeat_interleave(m)
            batch = ContiguousBatch(x, None, offsets, mi, torch.empty(0, 1, device=dev), [m] * e)
            ca = a.reshape(e, per, h)[:, :m].reshape(-1, h).contiguous()
            csa = sa.reshape(e, per, -1)[:, :m].reshape(e * m, -1).contiguous()
            ch = hq.reshape(e, per, inter)[:, :m].reshape(-1, inter).contiguous()
            csh = sh.reshape(e, per, -1)[:, :m].reshape(e * m, -1).contiguous()
            o1 = torch.empty((e * m, 2 * inter), dtype=torch.bfloat16, device=dev)
            o2 = torch.empty((e * m, h), dtype=torch.bfloat16, device=dev)
            for gemm, fn, n, k in (
                ("gemm1", lambda: cut.grouped_gemm(ca, csa, w13, s13, offsets, o1), 2 * inter, h),
                ("gemm2", lambda: cut.grouped_gemm(ch, csh, w2, s2, offsets, o2), h, inter),
                ("experts", lambda: cut_backend.run_contiguous(batch, weights, torch.bfloat16), 3 * inter, h),
            ):
                record(m, gemm, "cutlass", _time(fn, args.iters, args.repeats), n, k)
            if not cut._use_sgl():  # both tile configurations, to tune cutlass_backend.PINGPONG_MAX_ROWS
                for cfg, label in ((cut.CONFIG_COOP, "cutlass-coop"), (cut.CONFIG_PINGPONG, "cutlass-pingpong")):
                    for gemm, fn, n, k in (
                        ("gemm1", lambda c=cfg: cut.grouped_gemm(ca, csa, w13, s13, offsets, o1, c), 2 * inter, h),
                        ("gemm2", lambda c=cfg: cut.grouped_gemm(ch, csh, w2, s2, offsets, o2, c), h, inter),
                    ):
                        record(m, gemm, label, _time(fn, args.iters, args.repeats), n, k)
            del x, o1, o2, ca, ch
        del x_pad, a, hq
        # ---- masked (decode sizes) ----
        if dg and m <= args.masked_max_m:
            api = dg.deep_gemm_api()
            xm = torch.randn((e, m, h), generator=g, device=dev, dtype=torch.bfloat16)
            mm = torch.full((e,), m, dtype=torch.int32, device=dev)
            am, sam = quantize.per_group_quant(xm, BLOCK, torch.float8_e4m3fn)
            hm, shm = quantize.per_group_quant(
                torch.randn((e, m, inter), generator=g, device=dev, dtype=torch.bfloat16), BLOCK, torch.float8_e4m3fn
            )
            dm1 = torch.empty((e, m, 2 * inter), dtype=torch.bfloat16, device=dev)
            dm2 = torch.empty((e, m, h), dtype=torch.bfloat16, device=dev)
            mb = MaskedBatch(xm, None, mm, m)
            cases = []
            if "direct" in impls:
                cases += [
                    ("gemm1", "direct-masked", lambda: api.masked((am, sam), (w13, s13), dm1, mm, m), 2 * inter, h),
                    ("gemm2", "direct-masked", lambda: api.masked((hm, shm), (w2, s2), dm2, mm, m), h, inter),
                ]
            if "deepgemm" in impls:
                cases += [
                    ("gemm1", "deepgemm-masked", lambda: dg.gemm_masked(am, sam, w13, s13, mm, m, dm1), 2 * inter, h),
                    ("gemm2", "deepgemm-masked", lambda: dg.gemm_masked(hm, shm, w2, s2, mm, m, dm2), h, inter),
                    ("experts", "deepgemm-masked",
                     lambda: dg_backend.run_masked(mb, weights, torch.bfloat16), 3 * inter, h),
                ]  # fmt: skip
            for gemm, impl, fn, n, k in cases:
                record(m, gemm, impl, _time(fn, args.iters, args.repeats), n, k)
            del xm, am, hm, dm1, dm2
        torch.cuda.empty_cache()

    # ---- summary: ratios against direct DeepGEMM ----
    by = {(r["m"], r["gemm"], r["impl"]): r["ms"] for r in rows}
    print("\nratios (time / direct DeepGEMM contiguous; targets: deepgemm <= 1.05, cutlass <= 1.10 for m >= 512)")
    for m in ms:
        for gemm in ("gemm1", "gemm2", "experts"):
            base = by.get((m, gemm, "direct"))
            if not base:
                continue
            impls_ = ("deepgemm", "cutlass", "cutlass-coop", "cutlass-pingpong")
            parts = [f"{impl}={by[(m, gemm, impl)] / base:.3f}" for impl in impls_ if (m, gemm, impl) in by]
            print(f"m={m:5d} {gemm:8s} " + " ".join(parts))
    meta = dict(device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev),
                torch=torch.__version__, cuda=torch.version.cuda,
                experts=e, hidden=h, inter=inter, iters=args.iters, repeats=args.repeats,
                wall_s=round(time.perf_counter() - t_start, 1))  # fmt: skip
    with open(args.json, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(f"wrote {args.json} ({meta['wall_s']} s)")
    return 0


# ------------------------------------------------------------------------------------ --sweep
def _similarity_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepGEMM's metric: ``1 - 2*sum(x*y) / sum(x*x + y*y)`` (0 for identical tensors)."""
    x, y = x.double(), y.double()
    denom = (x * x + y * y).sum()
    return float(1 - 2 * (x * y).sum() / denom) if denom > 0 else 0.0


def recommend_table(best: dict, ms: list[int], current) -> list:
    """A selection table from the sweep's winners.

    Args:
        best: ``{(m, gemm): (config_name, raster_along_n, max_swizzle, ms)}`` with ``gemm`` in
            ``{"gemm1", "gemm2"}`` and each GEMM's ``(n, k)`` under ``best["shape", gemm]``.
        ms: the rows per expert measured.
        current: the table in use (``cutlass_backend.SELECTION``); its rows below the smallest m
            measured are kept.

    Returns:
        A list of ``SelectionRule``: for each measured m (rows up to that m; the last one catches
        the rest) the winner of each GEMM, with ``n``/``k`` set when GEMM1 and GEMM2 differ;
        consecutive equal rows merged.
    """
    from ..experts.cutlass_backend import SelectionRule

    ms = sorted(ms)
    rules = [r for r in current if r.max_rows is not None and r.max_rows < ms[0]]
    gemms = [g for g in ("gemm1", "gemm2") if any((m, g) in best for m in ms)]
    per_m = []
    for i, m in enumerate(ms):
        bound = None if i == len(ms) - 1 else m
        picks = {g: best[(m, g)][:3] for g in gemms if (m, g) in best}
        if not picks:
            continue
        if len(set(picks.values())) == 1:
            name, raster, swz = next(iter(picks.values()))
            per_m.append([SelectionRule(bound, name, raster_along_n=raster, max_swizzle=swz)])
        else:
            rows = []
            for g, (name, raster, swz) in picks.items():
                n, k = best[("shape", g)]
                rows.append(SelectionRule(bound, name, n=n, k=k, raster_along_n=raster, max_swizzle=swz))
            per_m.append(rows)
    # Merge m points whose picks are the same: keep the larger bound.
    merged: list[list] = []
    for rows in per_m:
        key = [(r.config, r.n, r.k, r.raster_along_n, r.max_swizzle) for r in rows]
        if merged and [(r.config, r.n, r.k, r.raster_along_n, r.max_swizzle) for r in merged[-1]] == key:
            merged[-1] = rows
        else:
            merged.append(rows)
    for rows in merged:
        rules += rows
    if rules and (rules[-1].max_rows is not None or rules[-1].n is not None):
        # Make the last m point a catch-all: rows with an (n, k) get a shape-free copy of gemm1's pick.
        last = rules[-1]
        rules.append(SelectionRule(None, last.config, raster_along_n=last.raster_along_n, max_swizzle=last.max_swizzle))
    return rules


def format_table(rules) -> str:
    lines = ["SELECTION: tuple[SelectionRule, ...] = ("]
    for r in rules:
        extra = ""
        if r.n is not None:
            extra += f", n={r.n}"
        if r.k is not None:
            extra += f", k={r.k}"
        if r.raster_along_n:
            extra += ", raster_along_n=True"
        if r.max_swizzle != 1:
            extra += f", max_swizzle={r.max_swizzle}"
        lines.append(f"    SelectionRule({r.max_rows!r}, {r.config!r}{extra}),")
    lines.append(")")
    return "\n".join(lines)


def _time_on(dev, fn, iters: int, repeats: int) -> float:
    """Median milliseconds per call: CUDA events on a GPU, the host clock elsewhere (CPU tests)."""
    if dev.type == "cuda":
        return _time(fn, iters, repeats)
    fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        samples.append((time.perf_counter() - t0) * 1e3 / iters)
    return statistics.median(samples)


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def sweep(args, device=None, ext=None, dg_api=None) -> int:
    """``--sweep``: every CUTLASS configuration at each m for GEMM1 and GEMM2 (see the module doc).

    ``device``, ``ext`` (the extension's op namespace) and ``dg_api`` (a resolved DeepGEMM API)
    default to the GPU, :func:`load_extension` and ``deep_gemm_api()``; tests pass stand-ins."""
    from ..kernels import quantize
    from ..quant.reference import dequantize_rows, dequantize_weight

    if device is None and not torch.cuda.is_available():
        print("no CUDA GPU", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    e, h, inter = args.experts, args.hidden, args.inter
    ms = [int(v) for v in args.m.split(",") if v]

    os.environ.setdefault("SGLANG_CUTLASS_MOE", "1")
    from ..experts import cutlass_backend as cb

    t0 = time.perf_counter()
    if ext is None:
        try:
            ext = cb.load_extension()
        except Exception as exc:
            print(f"cutlass unavailable: {exc}", file=sys.stderr)
            return 2
    print(f"cutlass extension ready in {time.perf_counter() - t0:.1f} s", flush=True)
    if args.configs == "all":
        configs = list(cb.CONFIGS)
    else:
        configs = [cb.CONFIG_BY_NAME[cb.CONFIG_ALIASES.get(n, n)] for n in args.configs.split(",") if n]
    api = dg_api
    if api is None and ("direct" in args.impls or "deepgemm" in args.impls):
        from ..experts import deepgemm_backend as dgb

        api = dgb.deep_gemm_api()
        if api is None:
            print("deep_gemm not importable: timing the CUTLASS configurations only", file=sys.stderr)

    w13, s13 = _weights(e, 2 * inter, h, dev, 0)
    w2, s2 = _weights(e, h, inter, dev, 1)
    shapes = {"gemm1": (w13, s13, 2 * inter, h), "gemm2": (w2, s2, h, inter)}
    nchk = max(1, min(args.check_experts, e))
    check_experts = sorted({round(i * (e - 1) / max(nchk - 1, 1)) for i in range(nchk)})
    rows, best, failures = [], {}, []
    best[("shape", "gemm1")], best[("shape", "gemm2")] = (2 * inter, h), (h, inter)

    def timed(fn) -> float:
        fn()
        _sync(dev)
        t = _time_on(dev, fn, 1, 1)
        iters = max(1, min(200, round(args.target_ms / max(t, 1e-3))))
        return _time_on(dev, fn, iters, args.repeats)

    def record(m, gemm, impl, ms_, n, k, diff=None, note=""):
        flops = 2.0 * e * m * n * k
        row = dict(m=m, gemm=gemm, impl=impl, ms=round(ms_, 4), tflops=round(flops / ms_ / 1e9, 1))
        if diff is not None:
            row["diff"] = diff
        rows.append(row)
        base = next((r["ms"] for r in rows if (r["m"], r["gemm"], r["impl"]) == (m, gemm, "direct")), None)
        ratio = f"{ms_ / base:6.3f}x" if base else "      -"
        dtxt = f"diff={diff:.1e}" if diff is not None else ""
        print(f"m={m:5d} {gemm:6s} {impl:34s} {ms_:9.3f} ms {row['tflops']:7.1f} TFLOP/s {ratio} {dtxt} {note}",
              flush=True)  # fmt: skip

    for m in ms:
        g = torch.Generator(device=dev).manual_seed(m)
        rows_total = e * m
        offsets = torch.arange(0, rows_total + 1, m, dtype=torch.int32, device=dev)
        acts = {}
        x = torch.randn((rows_total, h), generator=g, device=dev, dtype=torch.bfloat16)
        acts["gemm1"] = quantize.per_group_quant(x, BLOCK, torch.float8_e4m3fn)
        del x
        x = torch.randn((rows_total, inter), generator=g, device=dev, dtype=torch.bfloat16)
        acts["gemm2"] = quantize.per_group_quant(x, BLOCK, torch.float8_e4m3fn)
        del x
        for gemm, (w, ws, n, k) in shapes.items():
            a, sa = acts[gemm]
            sa = sa.float().contiguous()
            ref = {}
            for ex in check_experts:
                xr = dequantize_rows(a[ex * m : (ex + 1) * m], sa[ex * m : (ex + 1) * m])
                ref[ex] = xr @ dequantize_weight(w[ex : ex + 1], ws[ex : ex + 1])[0].t()

            def check(out, row_of=lambda ex: slice(ex * m, (ex + 1) * m)) -> float:
                got = torch.cat([out[row_of(ex)].float() for ex in check_experts])
                return _similarity_diff(got, torch.cat([ref[ex] for ex in check_experts]))

            out = torch.empty((rows_total, n), dtype=torch.bfloat16, device=dev)
            # ---- direct DeepGEMM (segments padded to its alignment when m is not a multiple) ----
            if api is not None:
                align = api.alignment
                per = -(-m // align) * align
                if per == m:
                    ap, sap, outp = a, sa, out
                else:
                    ap = torch.zeros((e, per, k), dtype=a.dtype, device=dev)
                    ap[:, :m] = a.view(e, m, k)
                    sap = torch.ones((e, per, k // BLOCK), dtype=sa.dtype, device=dev)
                    sap[:, :m] = sa.view(e, m, -1)
                    ap, sap = ap.view(-1, k), sap.view(-1, k // BLOCK)
                    outp = torch.empty((e * per, n), dtype=torch.bfloat16, device=dev)
                m_indices = torch.full((e, per), -1, dtype=torch.int32, device=dev)
                m_indices[:, :m] = torch.arange(e, dtype=torch.int32, device=dev)[:, None]
                m_indices = m_indices.view(-1)

                def direct(ap=ap, sap=sap, outp=outp, m_indices=m_indices, w=w, ws=ws):
                    api.contiguous((ap, sap), (w, ws), outp, m_indices)

                t_jit = time.perf_counter()
                direct()  # DeepGEMM compiles this shape on first use: untimed, reported
                _sync(dev)
                t_jit = time.perf_counter() - t_jit
                if t_jit > 1.0:
                    print(f"m={m:5d} {gemm:6s} (DeepGEMM JIT compile, first call: {t_jit:.1f} s)", flush=True)
                t = timed(direct)
                d = check(outp, lambda ex, per=per: slice(ex * per, ex * per + m))
                record(m, gemm, "direct", t, n, k, d)
                del ap, sap, outp, m_indices
            # ---- every CUTLASS configuration ----
            sa_mn = sa.t().contiguous().t()
            t_tr = timed(lambda: sa.t().contiguous())
            print(f"m={m:5d} {gemm:6s} {'(sfa transpose to MN-major)':34s} {t_tr:9.3f} ms", flush=True)
            results = []
            for cfg in configs:
                scales = sa_mn if cfg.sfa_mn else sa

                def run(cfg=cfg, scales=scales, raster=0, swz=1, a=a, w=w, ws=ws, out=out):
                    ext.fp8_grouped_gemm(out, a, scales, w, ws, offsets, cfg.id, raster, swz)

                out.zero_()
                try:
                    run()
                    _sync(dev)
                except Exception as exc:  # a configuration CUTLASS refuses at run time (can_implement)
                    print(f"m={m:5d} {gemm:6s} {cfg.name:34s} FAILED: {exc}", flush=True)
                    failures.append((m, gemm, cfg.name, str(exc)[:200]))
                    continue
                d = check(out)
                t = timed(run)
                ok = d < 1e-3
                if not ok:
                    failures.append((m, gemm, cfg.name, f"diff {d:.3e}"))
                note = "(kernel only; + the transpose above)" if cfg.sfa_mn else ""
                record(m, gemm, cfg.name, t, n, k, d, note + ("" if ok else " WRONG"))
                if ok:
                    results.append((t + (t_tr if cfg.sfa_mn else 0.0), cfg, run))
            if not results:
                continue
            results.sort(key=lambda r: r[0])
            t_best, cfg_best, run_best = results[0]
            pick = (cfg_best.name, False, 1, t_best)
            if not args.no_sched:  # tile-scheduler settings on the fastest configuration
                for raster in (0, 1):
                    for swz in (1, 2, 4, 8):
                        if (raster, swz) == (0, 1):
                            continue
                        fn = lambda r=raster, s_=swz: run_best(raster=r, swz=s_)  # noqa: E731
                        t = timed(fn) + (t_tr if cfg_best.sfa_mn else 0.0)
                        label = f"{cfg_best.name} r{'N' if raster else 'M'} s{swz}"
                        record(m, gemm, label, t, n, k)
                        if t < pick[3] * 0.99:  # keep the default settings unless 1% faster
                            pick = (cfg_best.name, bool(raster), swz, t)
            best[(m, gemm)] = pick
            del out
        del acts
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    by = {(r["m"], r["gemm"], r["impl"]): r["ms"] for r in rows}
    print("\nbest CUTLASS configuration per point (time incl. the scale transpose for *_sfamn)")
    for m in ms:
        for gemm in ("gemm1", "gemm2"):
            if (m, gemm) not in best:
                continue
            name, raster, swz, t = best[(m, gemm)]
            cur = cb.select_config(m, *best[("shape", gemm)])
            t_cur = by.get((m, gemm, cur.config))
            base = by.get((m, gemm, "direct"))
            vs = f" vs DeepGEMM {t / base:.3f}x" if base else ""
            cur_txt = f"; current table: {cur.config} {t_cur:.3f} ms" if t_cur else ""
            print(f"m={m:5d} {gemm:6s} {name} raster={'N' if raster else 'M'} swizzle={swz}: "
                  f"{t:.3f} ms{vs}{cur_txt}")  # fmt: skip
    table = recommend_table(best, ms, cb.SELECTION)
    print("\nrecommended epmoe/experts/cutlass_backend.py table:\n" + format_table(table))
    if failures:
        print("\nFAILURES:", *failures, sep="\n  ")
    meta = dict(device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev),
                torch=torch.__version__, cuda=torch.version.cuda,
                experts=e, hidden=h, inter=inter, repeats=args.repeats, target_ms=args.target_ms,
                check_experts=check_experts, configs=[c.name for c in configs],
                deep_gemm=api is not None, wall_s=round(time.perf_counter() - t_start, 1))  # fmt: skip
    out_best = [dict(m=m, gemm=gm, config=v[0], raster_along_n=v[1], max_swizzle=v[2], ms=round(v[3], 4))
                for (m, gm), v in best.items() if m != "shape"]  # fmt: skip
    with open(args.json, "w") as f:
        json.dump(dict(meta=meta, rows=rows, best=out_best, failures=failures,
                       table=format_table(table)), f, indent=1)  # fmt: skip
    print(f"wrote {args.json} ({meta['wall_s']} s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
