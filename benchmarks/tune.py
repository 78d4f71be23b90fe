"""``python benchmarks/tune.py``: sweep grouped-GEMM tile configs on this GPU and write the config file.

For each mode (``int8_channel``, ``int8_block``, ``bf16``; ``int8_channel_int32`` tunes the
int32-accumulator variant into its own entries), each expert GEMM shape (GEMM1: N = 2I, K = H;
GEMM2: N = H, K = I) and each rows-per-expert bucket, a compact candidate list (8-14 pointer-kernel
configs chosen per bucket: weight-streaming tiles for small m, large MMA tiles for big m; from
m > 64 on also 6 TMA configs, plain / persistent / persistent with a flattened tile loop, on
sm_90+ unless ``--no-tma``) is timed on the contiguous layout with uniform routing; the fastest
is written to ``epmoe/configs/<device>.json`` (merged with what is there) or ``--out``. Before
timing, each candidate's output is checked on sampled rows against the first (pointer-kernel)
candidate's.

The candidates do not depend on N and K, and the kernel is specialised only on divisibility, so
each candidate compiles once per mode: compile time, not timing, bounds the sweep.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from epmoe.kernels.configs import (
    INT32_ACC_MODE,
    PACKAGE_DIR,
    GemmConfig,
    config_filename,
    device_name,
    heuristic_config,
    mode_and_accumulator,
    read_config_file,
    shape_key,
    write_config_file,
)

MODES = ("int8_channel", "int8_block", "bf16")
EXTRA_MODES = (INT32_ACC_MODE,)
"""Modes ``--modes`` accepts beyond the default ones: tuned only when named."""
SMEM_BYTES = 227 * 1024


kernel_mode = mode_and_accumulator
"""(kernel mode, accumulator) of a tune mode key."""


def tma_candidates(mode: str, m: int) -> list[GemmConfig]:
    """TMA-fed configs for MMA-bound buckets (m > 64): plain, persistent (P) and flattened (F).
    Two [BM, BN] register tiles (int8_block, the fp32 accumulator) spill at 128x256, so those
    modes get 128x128 / 64x256 tiles."""
    if m <= 64:
        return []

    def t(bm, bn, bk, nw, st, flags=""):
        return GemmConfig(bm, bn, bk, 8, False, nw, st, tma=True, persistent="P" in flags, flatten="F" in flags)

    two_tiles = mode in ("int8_block", "int8_channel")  # int8_channel here is the fp32 accumulator
    if two_tiles:
        return [t(128, 128, 128, 8, 4), t(128, 128, 128, 8, 4, "P"), t(128, 128, 256, 8, 3),
                t(128, 128, 256, 8, 3, "P"), t(64, 256, 128, 8, 4), t(128, 128, 128, 8, 4, "PF")]
    return [t(128, 256, 128, 8, 4), t(128, 256, 128, 8, 4, "P"), t(128, 256, 128, 8, 3, "P"),
            t(256, 128, 128, 8, 4, "P"), t(128, 128, 256, 8, 3, "P"), t(128, 256, 128, 8, 4, "PF")]


def candidates(mode: str, m: int, tma: bool = True) -> list[GemmConfig]:
    """The sweep space of one (mode, rows-per-expert) point, heuristic first, TMA configs last."""
    c = GemmConfig
    if m <= 16:
        raw = [
            c(16, 128, 256, 1, False, 4, 4), c(16, 64, 256, 1, False, 4, 4), c(16, 128, 128, 1, False, 4, 6),
            c(16, 64, 512, 1, False, 4, 3), c(16, 128, 256, 1, False, 4, 3), c(16, 256, 128, 1, False, 8, 4),
            c(16, 128, 256, 1, True, 4, 4), c(16, 64, 256, 1, True, 4, 4), c(16, 128, 128, 1, True, 4, 6),
            c(16, 64, 512, 1, True, 4, 3), c(16, 128, 256, 1, False, 8, 4),
        ]
    elif m <= 32:
        raw = [
            c(32, 128, 256, 1, False, 4, 4), c(32, 64, 256, 1, False, 4, 4), c(32, 128, 128, 1, False, 4, 5),
            c(32, 64, 512, 1, False, 4, 3), c(32, 128, 256, 1, False, 8, 3), c(16, 128, 256, 1, False, 4, 4),
            c(32, 128, 256, 1, True, 4, 4), c(32, 64, 256, 1, True, 4, 4), c(32, 128, 128, 1, True, 4, 5),
            c(32, 256, 128, 1, True, 8, 4),
        ]
    elif m <= 256:
        raw = [
            c(64, 128, 128, 8, False, 4, 4), c(64, 128, 256, 8, False, 4, 3), c(64, 256, 128, 8, False, 8, 4),
            c(128, 128, 128, 8, False, 8, 4), c(128, 128, 128, 8, False, 4, 4), c(128, 256, 128, 8, False, 8, 3),
            c(64, 128, 128, 8, False, 4, 5), c(128, 128, 256, 8, False, 8, 3), c(64, 64, 256, 8, False, 4, 4),
            c(128, 64, 128, 8, False, 4, 4),
        ]
    else:
        raw = [
            c(128, 256, 128, 8, False, 8, 3), c(128, 256, 128, 16, False, 8, 3), c(128, 128, 128, 8, False, 8, 4),
            c(128, 128, 128, 8, False, 4, 4), c(256, 128, 128, 8, False, 8, 3), c(128, 256, 64, 8, False, 8, 4),
            c(128, 128, 256, 8, False, 8, 3), c(64, 256, 128, 8, False, 8, 4), c(128, 256, 128, 4, False, 8, 4),
            c(256, 128, 64, 8, False, 8, 4),
        ]
    kmode = kernel_mode(mode)[0]
    out: list[GemmConfig] = [heuristic_config(kmode, m)]
    if tma:
        raw = raw + tma_candidates(mode, m)
    for cfg in raw:
        cfg = _adapt(cfg, kmode)
        if cfg not in out and cfg.smem_bytes(2 if mode == "bf16" else 1) <= SMEM_BYTES:
            out.append(cfg)
    return out


def _adapt(cfg: GemmConfig, mode: str) -> GemmConfig:
    """bf16 tiles have twice the bytes per element (halve BLOCK_K); block mode needs BLOCK_K <= 128."""
    d = cfg.to_dict()
    if mode == "bf16":
        d["BLOCK_K"] = max(32, cfg.block_k // 2)
    if mode == "int8_block" and cfg.block_k > 128:
        d["BLOCK_K"] = 128
        d["num_stages"] = min(cfg.num_stages * cfg.block_k // 128, 8)
    return GemmConfig.from_dict(d)


def make_operands(mode: str, e: int, n: int, k: int, rows: int, device) -> dict:
    """Random operands of one GEMM: A [rows, K], B [E, N, K] and the scales of ``mode``."""
    if mode == "bf16":
        a = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
        b = torch.randn(e, n, k, device=device, dtype=torch.bfloat16)
        return {"a": a, "b": b, "a_scale": None, "b_scale": None}
    a = torch.randint(-127, 128, (rows, k), device=device, dtype=torch.int8)
    b = torch.randint(-127, 128, (e, n, k), device=device, dtype=torch.int8)
    if mode == "int8_channel":
        return {"a": a, "b": b, "a_scale": torch.rand(rows, 1, device=device), "b_scale": torch.rand(e, n, 1, device=device)}
    return {
        "a": a, "b": b, "a_scale": torch.rand(rows, k // 128, device=device),
        "b_scale": torch.rand(e, -(-n // 128), k // 128, device=device),
    }


def sample_rows(out: torch.Tensor) -> torch.Tensor:
    """A few hundred rows of an output, copied, to compare candidates without a second full copy."""
    step = max(1, out.shape[0] // 256)
    return out[::step].float().clone()


def outputs_agree(got: torch.Tensor, ref: torch.Tensor) -> bool:
    return bool(torch.allclose(got, ref, rtol=2e-2, atol=2e-3 * float(ref.abs().max().clamp(min=1e-30))))


def time_config(
    mode: str, ops: dict, offsets: torch.Tensor, cfg: GemmConfig, m: int, rep_ms: float, ref: list | None = None,
) -> float:
    """Median ms of one config. With ``ref``: the first call's sampled rows are stored in an empty
    list, or compared with the stored ones (ValueError when they disagree)."""
    import triton.testing as tt

    from epmoe.kernels.grouped_gemm import grouped_gemm_contiguous

    kmode, accumulator = kernel_mode(mode)
    out = torch.empty(ops["a"].shape[0], ops["b"].shape[1], device=ops["a"].device, dtype=torch.bfloat16)

    def fn():
        grouped_gemm_contiguous(
            ops["a"], ops["b"], offsets, mode=kmode, a_scale=ops["a_scale"], b_scale=ops["b_scale"],
            accumulator=accumulator, out_dtype=torch.bfloat16, config=cfg, out=out,
        )

    fn()
    torch.cuda.synchronize()
    if ref is not None:
        rows = sample_rows(out)
        if not ref:
            ref.append(rows)
        elif not outputs_agree(rows, ref[0]):
            raise ValueError("output differs from the first candidate's")
    if m <= 32:
        # do_bench_cudagraph replays its graph ten times: a third of the budget is plenty.
        return float(tt.do_bench_cudagraph(fn, rep=max(5.0, rep_ms / 3), return_mode="median"))
    return float(tt.do_bench(fn, warmup=5, rep=rep_ms, return_mode="median"))


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python benchmarks/tune.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--m", default="8,32,128,512,2048", help="rows-per-expert buckets")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--rep-ms", type=float, default=30.0)
    p.add_argument("--out", default=None, help="config file or directory to write (default: the package's file for this GPU)")
    p.add_argument("--max-candidates", type=int, default=24)
    p.add_argument("--no-tma", action="store_true", help="leave out the TMA-fed kernel's configs")
    args = p.parse_args(argv)
    args.m = [int(v) for v in args.m.split(",") if v]
    args.modes = [v for v in args.modes.split(",") if v]
    bad = set(args.modes) - set(MODES) - set(EXTRA_MODES)
    if bad:
        p.error(f"unknown --modes {sorted(bad)}; allowed: {list(MODES + EXTRA_MODES)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/tune.py needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    name = device_name(device)
    path = PACKAGE_DIR / config_filename(name)
    if args.out:
        # A directory (existing, or written with a trailing slash) gets the device's file name,
        # so EPMOE_CONFIG_DIR=<that directory> finds it.
        out = Path(args.out)
        path = out / config_filename(name) if out.is_dir() or args.out.endswith("/") else out
    table = read_config_file(path) if path.is_file() else {}
    shapes = [(2 * args.intermediate, args.hidden), (args.hidden, args.intermediate)]
    e = args.experts
    use_tma = not args.no_tma and torch.cuda.get_device_capability(device)[0] >= 9
    t0 = time.time()
    log = []
    for mode in args.modes:
        for n, k in shapes:
            for m in args.m:
                rows = m * e
                ops = make_operands(kernel_mode(mode)[0], e, n, k, rows, device)
                offsets = (torch.arange(e + 1, device=device) * m).to(torch.int32)
                best = None
                ref: list = []
                for cfg in candidates(mode, m, use_tma)[: args.max_candidates]:
                    try:
                        ms = time_config(mode, ops, offsets, cfg, m, args.rep_ms, ref)
                    except Exception as exc:  # out of resources, compile failures: skip
                        print(f"  skip {cfg.to_dict()}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}")
                        continue
                    if best is None or ms < best[0]:
                        best = (ms, cfg)
                if best is None:
                    print(f"{mode} N={n} K={k} m={m}: no candidate ran", file=sys.stderr)
                    continue
                ms, cfg = best
                flops = 2.0 * rows * n * k
                wbytes = e * n * k * (2 if mode == "bf16" else 1)
                print(
                    f"[{time.time() - t0:6.1f}s] {mode:<12} N={n:<5} K={k:<5} m={m:<5} best {ms:8.3f} ms "
                    f"{flops / ms / 1e9:7.0f} TOPS {wbytes / ms / 1e6:6.0f} GB/s  {cfg.to_dict()}",
                    flush=True,
                )
                table.setdefault(mode, {}).setdefault(shape_key(n, k), {})[str(m)] = cfg.to_dict()
                log.append({"mode": mode, "N": n, "K": k, "m": m, "ms": ms, "config": cfg.to_dict()})
                del ops
            torch.cuda.empty_cache()
    import triton

    write_config_file(
        path, table, device=name, triton=triton.__version__, torch=torch.__version__,
        source=f"benchmarks/tune.py, {time.strftime('%Y-%m-%d')}, E={e} H={args.hidden} I={args.intermediate}",
        measurements=log,
    )  # fmt: skip
    print(f"wrote {path} in {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
