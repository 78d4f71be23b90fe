"""Session 12: epmoe's CUTLASS INT8 (channel, int32) contiguous GEMM against the Triton INT8 int32
GEMM and the Triton BF16 GEMM. One GPU.

1. Correctness on fresh random inputs against a float64 reference: empty experts, several
   blocks per expert, N not a multiple of the tile, spare rows past the last segment (must stay
   unwritten).
2. The bounded prefill layer's GEMM shapes (E=128, 33035 rows, ~258 per expert): CUTLASS on the
   layout padded to 128 rows with zero rows (what the scatter writes with alignment 128), Triton
   INT8 int32 and BF16 on the unpadded layout (their shipped configs for the layer's hint of 256),
   sustained back-to-back launches in rotated turns (.dev/pad_power.py's method).
Usage: python .dev/int8_cutlass.py OUT.json"""
import json
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
from epmoe.experts import cutlass_backend as cb  # noqa: E402
from epmoe.kernels import grouped_gemm as gg  # noqa: E402
from epmoe.kernels import quantize as qz  # noqa: E402

dev = torch.device("cuda")
res = {"correctness": [], "turns": {}}


def ref_out(a, sa, b, sb, offsets):
    out = torch.full((a.shape[0], b.shape[1]), float("nan"), dtype=torch.float64, device=a.device)
    for e in range(b.shape[0]):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        if hi > lo:
            out[lo:hi] = (a[lo:hi].double() @ b[e].double().t()) * sa[lo:hi].double() * sb[e].double().t()
    return out


g = torch.Generator(device=dev).manual_seed(12)
for counts, n, k, spare in (([128, 0, 384, 256], 200, 256, 64), ([256] * 6 + [0, 128], 4096, 512, 0),
                            ([0, 0, 128], 72, 128, 128), ([640, 128, 0, 1024], 7168, 2048, 256)):
    offs = torch.tensor([0] + list(torch.tensor(counts).cumsum(0)), dtype=torch.int32, device=dev)
    m = int(offs[-1]) + spare
    e = len(counts)
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8, device=dev, generator=g)
    b = torch.randint(-127, 128, (e, n, k), dtype=torch.int8, device=dev, generator=g)
    sa = torch.rand(m, 1, device=dev, generator=g) + 0.5
    sb = (torch.rand(e, n, 1, device=dev, generator=g) + 0.5) / (127.0 * 127.0 * k**0.5)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=dev)
    cb.int8_grouped_gemm(a, sa, b, sb, offs, out=out)
    ref = ref_out(a, sa, b, sb, offs)
    real = int(offs[-1])
    err = ((out[:real].double() - ref[:real]).abs() / ref[:real].abs().clamp_min(1e-30))
    row = dict(counts=counts, n=n, k=k, spare=spare, max_rel_err=float(err.max()) if real else 0.0,
               spare_untouched=bool(torch.isnan(out[real:]).all()), finite=bool(torch.isfinite(out[:real]).all()))
    # bf16 keeps 8 significant bits: the exact int32 sum times two fp32 products, rounded once,
    # is within 2^-8 relative (plus fp32 products' 2^-23).
    row["ok"] = row["finite"] and row["spare_untouched"] and row["max_rel_err"] <= 2.0**-8 + 1e-6
    res["correctness"].append(row)
    print("correctness", row, flush=True)


def sustained(fn, seconds):
    t_end = time.perf_counter() + seconds / 2
    while time.perf_counter() < t_end:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    n, s, e = 0, torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    t_end = time.perf_counter() + seconds / 2
    while time.perf_counter() < t_end:
        for _ in range(10):
            fn()
        n += 10
        torch.cuda.synchronize()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / n


E, ROWS, HINT = 128, 33035, 256
counts = torch.bincount(torch.randint(0, E, (ROWS,), device=dev, generator=g), minlength=E)
padded = (counts + 127) // 128 * 128
offs = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).int()
offs_p = torch.cat([counts.new_zeros(1), padded.cumsum(0)]).int()
mp = int(offs_p[-1])
src = torch.arange(ROWS, device=dev)
e_of = torch.repeat_interleave(torch.arange(E, device=dev), counts)
dst = offs_p[:-1].long()[e_of] + (src - offs[:-1].long()[e_of])
res["counts"] = {"rows": ROWS, "padded_rows": mp, "min": int(counts.min()), "max": int(counts.max())}
for name, (n, k) in {"gemm1": (4096, 7168), "gemm2": (7168, 2048)}.items():
    a = torch.randn(ROWS, k, device=dev, generator=g).to(torch.bfloat16)
    wb = (torch.randn(E, n, k, device=dev, generator=g) * k**-0.5).to(torch.bfloat16)
    aq, as_ = qz.per_token_quant_int8(a)
    wq = torch.randint(-127, 128, (E, n, k), dtype=torch.int8, device=dev, generator=g)
    sq = torch.full((E, n, 1), k**-0.5 / 73.0, device=dev)
    ap = torch.zeros(mp, k, dtype=torch.int8, device=dev)
    asp = torch.zeros(mp, 1, device=dev)
    ap[dst], asp[dst] = aq, as_
    out_p = torch.empty(mp, n, dtype=torch.bfloat16, device=dev)
    fns = {
        "bf16_triton": lambda a=a, wb=wb, n=n, k=k: gg.grouped_gemm_contiguous(a, wb, offs, mode="bf16", expected_m=HINT),
        "int8_triton": lambda aq=aq, as_=as_, wq=wq, sq=sq: gg.grouped_gemm_contiguous(
            aq, wq, offs, mode="int8_channel", a_scale=as_, b_scale=sq, accumulator="int32", expected_m=HINT),
        "int8_cutlass": lambda ap=ap, asp=asp, wq=wq, sq=sq, out_p=out_p: cb.int8_grouped_gemm(ap, asp, wq, sq, offs_p, out=out_p),
    }
    y_t = fns["int8_triton"]()
    y_c = fns["int8_cutlass"]()[dst]
    diff = ((y_c.float() - y_t.float()).abs() / y_t.float().abs().clamp_min(1e-6)).max().item()
    res[f"{name}_cutlass_vs_triton_max_rel"] = diff
    print(f"{name}: cutlass vs triton int8 max rel diff {diff:.2e} (bf16 ulp 3.9e-03)", flush=True)
    names = list(fns)
    got = {v: [] for v in names}
    for r in range(3):
        for v in names[r % len(names):] + names[: r % len(names)]:
            got[v].append(sustained(fns[v], 2.5))
    med = {v: statistics.median(t) for v, t in got.items()}
    res["turns"][name] = got
    for v in names:
        print(f"{name} {v:<13} {med[v]:.3f} ms (turns {', '.join(f'{t:.3f}' for t in got[v])}) "
              f"triton_int8/this {med['int8_triton'] / med[v]:.3f} bf16/this {med['bf16_triton'] / med[v]:.3f}", flush=True)
json.dump(res, open(sys.argv[1], "w"), indent=1)
