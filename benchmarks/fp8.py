"""FP8 block backends on one GPU: the deepgemm backend vs calling DeepGEMM directly vs cutlass.

    python benchmarks/fp8.py [--experts 128 --hidden 7168 --inter 2048 --m 8,32,128,512,2048]
                              [--impls deepgemm,direct,cutlass] [--json fp8_bench.json]

For every m (rows per expert, uniform routing) it times (median of ``triton.testing.do_bench``,
:func:`epmoe.timing.kernel_ms`):

* ``gemm1`` ``[E*m, H] x [H, 2I]`` and ``gemm2`` ``[E*m, I] x [I, H]``:
  ``direct`` = the raw ``deep_gemm`` call (contiguous layout, segments padded to 128),
  ``deepgemm`` = the backend's wrapper of that call, ``cutlass`` = the CUTLASS GEMM on the same
  padded layout; for m <= 128 also the masked GEMMs (``direct-masked``, ``deepgemm-masked``).
* ``experts``: the whole experts pass from bf16 activations (quantize, GEMM1, SiLU*up + requant,
  GEMM2): ``DeepGemmBackend.run_contiguous`` / ``run_masked``, the same four launches with raw
  DeepGEMM calls (``direct``), and ``CutlassBackend.run_contiguous``.

With ``--rounds R`` the same calls are also timed in turns: per round each is timed once,
in an order rotated every round, medians over rounds (rows ``<impl>@turns``). Under
sustained load the H200 runs at its power cap, where a kernel's clock depends on what ran before;
turns give every implementation the same state on average.

TFLOP/s count only valid rows (``2 * E*m * N * K`` per GEMM). Targets (issue 5): ``deepgemm`` within
5% of ``direct``; ``cutlass`` within 10% of ``direct`` for m >= 512. DeepGEMM compiles each shape
on first use and the CUTLASS extension builds on first use; both are done (untimed) before timing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

from epmoe import timing

BLOCK = 128


def _time(fn, rep_ms: float) -> float:
    """Median ms per call (:func:`epmoe.timing.kernel_ms`)."""
    return timing.kernel_ms(fn, rep_ms=rep_ms, device="cuda")


def _turns(fns: dict, rep_ms: float, rounds: int) -> dict:
    """Median ms per call of each ``fns`` value over ``rounds`` rounds of turns
    (:func:`epmoe.timing.in_turns`), one :func:`_time` a turn."""
    samples = timing.in_turns(fns, rounds, lambda fn: _time(fn, rep_ms))
    return {n: statistics.median(v) for n, v in samples.items()}


def _weights(e: int, n: int, k: int, dev, seed: int):
    """Random e4m3 weights [E, N, K] and fp32 block scales, built per expert to bound memory."""
    g = torch.Generator(device=dev).manual_seed(seed)
    w = torch.empty((e, n, k), dtype=torch.float8_e4m3fn, device=dev)
    for i in range(e):
        w[i] = (torch.randn((n, k), generator=g, device=dev, dtype=torch.bfloat16) * 64).to(torch.float8_e4m3fn)
    s = torch.rand((e, n // BLOCK, k // BLOCK), generator=g, device=dev) * 1e-3 + 1e-4
    return w, s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/fp8.py", description=__doc__.split("\n")[0])
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--inter", type=int, default=2048)
    p.add_argument("--m", default="8,32,128,512,2048", help="rows per expert, comma-separated")
    p.add_argument("--impls", default="deepgemm,direct,cutlass")
    p.add_argument("--masked-max-m", type=int, default=128, help="also time masked GEMMs up to this m")
    p.add_argument("--rep-ms", type=float, default=100.0, help="do_bench repetition time per measurement")
    p.add_argument("--rounds", type=int, default=0, help="also time the contiguous calls in R rounds of turns")
    p.add_argument("--json", default="fp8_bench.json")
    args = p.parse_args(argv)
    if args.rep_ms <= 0:
        p.error(f"--rep-ms={args.rep_ms} must be > 0")
    if args.rounds < 0:
        p.error(f"--rounds={args.rounds} must be >= 0 (0: no turns)")

    from epmoe.experts.base import ExpertWeights
    from epmoe.kernels import activation, quantize
    from epmoe.layouts import ContiguousBatch, MaskedBatch
    from epmoe.quant.schemes import get_scheme

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
        from epmoe.experts import deepgemm_backend as dgb

        api = dgb.deep_gemm_api()
        if api is None:
            print("deep_gemm not importable; skipping deepgemm/direct", file=sys.stderr)
            impls = [i for i in impls if i not in ("deepgemm", "direct")]
        else:
            dg = dgb
    if "cutlass" in impls:
        os.environ.setdefault("SGLANG_CUTLASS_MOE", "1")
        from epmoe.experts import cutlass_backend as cb

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

    dims = {"gemm1": (2 * inter, h), "gemm2": (h, inter), "experts": (3 * inter, h)}
    for m in ms:
        turn_fns = {}  # (gemm, impl) -> the contiguous call, for --rounds
        g = torch.Generator(device=dev).manual_seed(m)
        # ---- contiguous, padded to DeepGEMM's alignment ----
        align = dg.deep_gemm_api().alignment if dg else BLOCK
        align = math.lcm(align, BLOCK) if cut else align  # the cutlass kernel's 128-row blocks
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
                t = _time(fn, args.rep_ms)
                turn_fns[(gemm, impl)] = fn
                record(m, gemm, impl, t, *dims[gemm])  # experts: 2I*H + H*I = 3*I*H per row
        # ---- the same padded layout (cutlass: segments aligned to 128 rows, as DeepGEMM's) ----
        if cut:
            o1 = torch.empty((e * per, 2 * inter), dtype=torch.bfloat16, device=dev)
            o2 = torch.empty((e * per, h), dtype=torch.bfloat16, device=dev)
            for gemm, fn, n, k in (
                ("gemm1", lambda: cut.grouped_gemm(a, sa, w13, s13, offsets_pad, o1), 2 * inter, h),
                ("gemm2", lambda: cut.grouped_gemm(hq, sh, w2, s2, offsets_pad, o2), h, inter),
                ("experts", lambda: cut_backend.run_contiguous(batch_pad, weights, torch.bfloat16), 3 * inter, h),
            ):
                turn_fns[(gemm, "cutlass")] = fn
                record(m, gemm, "cutlass", _time(fn, args.rep_ms), n, k)
        if args.rounds and turn_fns:
            for (gemm, impl), t in _turns(turn_fns, args.rep_ms, args.rounds).items():
                record(m, gemm, f"{impl}@turns", t, *dims[gemm])
        turn_fns.clear()
        if dg:
            del d1, d2
        if cut:
            del o1, o2
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
                record(m, gemm, impl, _time(fn, args.rep_ms), n, k)
            del xm, am, hm, dm1, dm2
        torch.cuda.empty_cache()

    # ---- summary: ratios against direct DeepGEMM ----
    by = {(r["m"], r["gemm"], r["impl"]): r["ms"] for r in rows}
    print("\nratios (time / direct DeepGEMM contiguous; targets: deepgemm <= 1.05, cutlass <= 1.10 for m >= 512)")
    for m in ms:
        for gemm in ("gemm1", "gemm2", "experts"):
            for sfx in ("", "@turns"):
                base = by.get((m, gemm, "direct" + sfx))
                if not base:
                    continue
                impls_ = [i + sfx for i in ("deepgemm", "cutlass")]
                parts = [f"{impl}={by[(m, gemm, impl)] / base:.3f}" for impl in impls_ if (m, gemm, impl) in by]
                print(f"m={m:5d} {gemm:8s} " + " ".join(parts))
    meta = dict(device=torch.cuda.get_device_name(dev), torch=torch.__version__, cuda=torch.version.cuda,
                experts=e, hidden=h, inter=inter, rep_ms=args.rep_ms, rounds=args.rounds,
                wall_s=round(time.perf_counter() - t_start, 1))  # fmt: skip
    with open(args.json, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    print(f"wrote {args.json} ({meta['wall_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
