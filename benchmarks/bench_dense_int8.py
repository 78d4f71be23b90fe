"""W8A8 INT8 dense linears on DeepSeek-V3 shapes: BF16 cuBLAS vs torch._int_mm vs epmoe.Int8Linear.

One command, one GPU, about two minutes:

    python benchmarks/bench_dense_int8.py --out dense.json [--plot dense.png] [--sweep]
    SGLANG_CUTLASS_MOE=1 python benchmarks/bench_dense_int8.py ...   # adds the cutlass rows

For each shape (N x K weight) and batch M, side by side in one process:

* ``bf16``: ``torch.matmul`` of bf16 activations and weights (cuBLAS);
* ``int_mm``: what a user has with no extra library: a plain-torch per-token INT8 quantization,
  ``torch._int_mm`` (batches of 16 rows or fewer padded to 32, its minimum), then both scales;
* ``epmoe <backend> <scheme>``: ``Int8Linear.forward`` (activation quantization included) for each
  backend that can run here: triton channel int32 / fp32 and block; cutlass channel int32 with
  ``SGLANG_CUTLASS_MOE=1``.

Times are medians of ``triton.testing.do_bench`` (bounded warmup / rep). Each row carries its ratio
to bf16, the fraction of the INT8 weight-read floor (weight bytes / 4.3 TB/s) and of INT8 peak
(1979 dense TOPS, the H200 figure), and the relative Frobenius error of 8 output rows against a
float64 product of the bf16 activations and bf16 weights (INT8 rows expect ~1-2 %). ``--sweep``
also times a few Triton tile configs per (shape, M) and reports the best next to the default.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

SHAPES = [  # (name, N, K)
    ("q_a", 1536, 7168),
    ("q_b", 24576, 1536),
    ("kv_a", 576, 7168),
    ("o_proj", 7168, 16384),
    ("shared_gate_up", 4096, 7168),
    ("shared_down", 7168, 2048),
    ("dense_gate_up", 36864, 7168),
    ("dense_down", 7168, 18432),
]
MS = [1, 16, 64, 256, 1024, 4096, 16384]
BANDWIDTH = 4.3e12
INT8_PEAK = 1979e12
VARIANTS = [("triton", "int8_channel", "int32"), ("triton", "int8_channel", "fp32"),
            ("triton", "int8_block", "fp32"), ("cutlass", "int8_channel", "int32")]  # fmt: skip
TARGETS = "ratio to bf16 >= 1.7 for M >= 1024, >= 1.6 for M <= 64, never below int_mm"


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip()  # fmt: skip
    except Exception:
        return "unknown"


def _bench(fn, warmup: int, rep: int) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")) * 1e3  # us


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm().clamp(min=1e-30))


def _int_mm_path(wq_t: torch.Tensor, ws_row: torch.Tensor):
    """Plain torch: per-token quantization, torch._int_mm (>= 17 rows), both scales."""

    def run(x):
        m = x.shape[0]
        if m <= 16:
            x = torch.nn.functional.pad(x, (0, 0, 0, 32 - m))
        xf = x.float()
        s = xf.abs().amax(-1, keepdim=True).clamp(min=1e-10) / 127.0
        q = torch.round(xf / s).clamp(-127, 127).to(torch.int8)
        out = (torch._int_mm(q, wq_t).float() * s * ws_row).to(torch.bfloat16)
        return out[:m]

    return run


def _sweep_configs(scheme: str):
    from epmoe.kernels.configs import GemmConfig

    cands = []
    for bm, bn, bk, w, st in [(16, 64, 256, 4, 4), (16, 32, 256, 4, 4), (16, 128, 256, 4, 4),
                              (32, 64, 256, 4, 4), (64, 64, 128, 4, 4), (64, 128, 128, 4, 4),
                              (128, 128, 128, 8, 4), (128, 256, 128, 8, 3)]:  # fmt: skip
        if scheme == "int8_block":
            bk = min(bk, 128)
        cands.append(GemmConfig(bm, bn, bk, 8, False, w, st))
    return cands


def run(args) -> dict:
    import epmoe
    from epmoe.experts.select import BackendUnavailableError
    from epmoe.linear import Int8Linear, dense_backend_decisions, dense_gemm_config
    from epmoe.quant.reference import quantize_weight
    from epmoe.quant.schemes import SCHEMES

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    shapes = [s for s in SHAPES if not args.shapes or s[0] in args.shapes]
    ms = args.m or MS
    rows, refusals = [], {}
    t_start = time.perf_counter()
    for name, n, k in shapes:
        w = (torch.randn(n, k, device=dev, generator=gen) / k**0.5).to(torch.bfloat16)
        mods = {}
        for backend, scheme, acc in VARIANTS:
            key = f"{backend} {scheme} {acc}"
            try:
                mod = Int8Linear(k, n, scheme=scheme, accumulator=acc, backend=backend, device=dev)
            except BackendUnavailableError as exc:
                refusals[key] = str(exc)
                continue
            q, s = quantize_weight(w.float().unsqueeze(0), SCHEMES[scheme])
            with torch.no_grad():
                mod.weight.copy_(q[0])
                mod.weight_scale.copy_(s[0])
            mods[key] = mod
        ch = mods.get("triton int8_channel int32") or next(iter(mods.values()))
        if ch.scheme != "int8_channel":
            qc, sc = quantize_weight(w.float().unsqueeze(0), SCHEMES["int8_channel"])
            wq_t, ws_row = qc[0].t(), sc[0].view(1, -1)
        else:
            wq_t, ws_row = ch.weight.t(), ch.weight_scale.view(1, -1)
        int_mm = _int_mm_path(wq_t, ws_row)
        w64 = w.double()
        floor_us = n * k / BANDWIDTH * 1e6
        for m in ms:
            x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
            ref = x[:8].double() @ w64.t()
            fns = {"bf16": lambda: torch.matmul(x, w.t()), "int_mm": lambda: int_mm(x)}
            for key, mod in mods.items():
                fns[f"epmoe {key}"] = (lambda mod=mod: mod(x))
            base = None
            with torch.no_grad():
                for label, fn in fns.items():
                    out = fn()
                    us = _bench(fn, args.warmup, args.rep)
                    base = us if label == "bf16" else base
                    row = dict(shape=name, N=n, K=k, M=m, variant=label, us=round(us, 2),
                               ratio_to_bf16=round(base / us, 3),
                               weight_floor_fraction=round(floor_us / us, 3) if label != "bf16" else round(2 * floor_us / us, 3),
                               int8_peak_fraction=round(2 * m * n * k / (us * 1e-6) / INT8_PEAK, 3),
                               rel_err_vs_fp64=round(_rel(out[:8], ref), 5))  # fmt: skip
                    if label.startswith("epmoe triton"):
                        mod = mods[label[len("epmoe "):]]
                        row["config"] = dense_gemm_config(mod.scheme, mod.accumulator, n, k, m, dev).to_dict()
                        if args.sweep:
                            row["sweep"] = _sweep(mod, x, args)
                    rows.append(row)
            by = {r["variant"]: r["us"] for r in rows if r["shape"] == name and r["M"] == m}
            print(f"{name:15s} M={m:6d} " + " ".join(f"{v.replace('epmoe ', '')}={t:.1f}" for v, t in by.items()), flush=True)
            del x
        del mods, w, w64
        torch.cuda.empty_cache()
    env_ok = {f"{s} {a}": dense_backend_decisions(s, a, dev, 7168, 1536) for s, a in (("int8_channel", "int32"), ("int8_block", "fp32"))}
    return dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        commit=_commit(), gpu=torch.cuda.get_device_name(dev), torch=torch.__version__,
        epmoe=epmoe.__version__, command=" ".join([os.path.basename(sys.executable), *sys.argv]),
        sglang_cutlass_moe=os.environ.get("SGLANG_CUTLASS_MOE"), warmup_ms=args.warmup, rep_ms=args.rep,
        bandwidth_Bps=BANDWIDTH, int8_peak_ops=INT8_PEAK, targets=TARGETS, refusals=refusals,
        decisions={k: [list(d) for d in v] for k, v in env_ok.items()},
        seconds=round(time.perf_counter() - t_start, 1), rows=rows, summary=_summary(rows),
    )  # fmt: skip


def _sweep(mod, x, args) -> dict:
    """Best of a few Triton tile configs for this call (quantization included in each time)."""
    impl = mod._impl
    x2 = x.reshape(-1, x.shape[-1])
    best = None
    for cfg in _sweep_configs(mod.scheme):
        def fn(cfg=cfg):
            q, s = impl.quantize(x2, mod.scheme)
            return impl.gemm(mod, q, s, x.dtype, config=cfg)

        try:
            us = _bench(fn, args.warmup, args.rep)
        except Exception as exc:  # a config the compiler or the SM cannot take: reported, not fatal
            print(f"  config {cfg.to_dict()} failed: {exc}", file=sys.stderr)
            continue
        if best is None or us < best[0]:
            best = (us, cfg.to_dict())
    return {} if best is None else dict(best_us=round(best[0], 2), best_config=best[1])


def _summary(rows: list[dict]) -> dict:
    """Per variant: median ratio to bf16 for M <= 64 and M >= 1024, the worst ratio, and how many
    (shape, M) cells are slower than int_mm."""
    out = {}
    int_mm = {(r["shape"], r["M"]): r["us"] for r in rows if r["variant"] == "int_mm"}
    for v in sorted({r["variant"] for r in rows} - {"bf16"}):
        rs = [r for r in rows if r["variant"] == v]
        small = [r["ratio_to_bf16"] for r in rs if r["M"] <= 64]
        large = [r["ratio_to_bf16"] for r in rs if r["M"] >= 1024]
        out[v] = dict(
            median_ratio_m_le_64=round(statistics.median(small), 3) if small else None,
            median_ratio_m_ge_1024=round(statistics.median(large), 3) if large else None,
            min_ratio=round(min(r["ratio_to_bf16"] for r in rs), 3),
            slower_than_int_mm=sum(r["us"] > int_mm[(r["shape"], r["M"])] for r in rs),
            cells=len(rs),
        )
    return out


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(r["shape"] for r in result["rows"]))
    fig, axes = plt.subplots(2, (len(shapes) + 1) // 2, figsize=(4 * ((len(shapes) + 1) // 2), 7), squeeze=False)
    for ax, shape in zip(axes.flat, shapes):
        rs = [r for r in result["rows"] if r["shape"] == shape]
        for v in dict.fromkeys(r["variant"] for r in rs):
            pts = [(r["M"], r["ratio_to_bf16"]) for r in rs if r["variant"] == v]
            ax.plot(*zip(*pts), marker="o", label=v.replace("epmoe ", ""))
        ax.set_xscale("log", base=2)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_title(f"{shape} ({rs[0]['K']}->{rs[0]['N']})")
        ax.set_xlabel("M")
        ax.set_ylabel("speed-up over BF16")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(f"W8A8 INT8 dense linears, {result['gpu']}, {result['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench_dense_int8.json", help="JSON result path")
    p.add_argument("--plot", default=None, help="also write a PNG of the ratios to this path")
    p.add_argument("--sweep", action="store_true", help="also time a few Triton tile configs per call")
    p.add_argument("--shapes", nargs="*", default=None, help=f"subset of {[s[0] for s in SHAPES]}")
    p.add_argument("--m", type=int, nargs="*", default=None, help=f"batch sizes (default {MS})")
    p.add_argument("--warmup", type=int, default=3, help="do_bench warmup, ms (default 3)")
    p.add_argument("--rep", type=int, default=12, help="do_bench repetition window, ms (default 12)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    bad = set(args.shapes or ()) - {s[0] for s in SHAPES}
    if bad:
        p.error(f"--shapes {sorted(bad)}: allowed: {[s[0] for s in SHAPES]}")
    result = run(args)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result["summary"], indent=1))
    print(f"wrote {args.out} ({result['seconds']} s)")
    if args.plot:
        plot(result, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
