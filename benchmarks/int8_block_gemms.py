"""The CUTLASS INT8 block kernel's variants GEMM by GEMM, beside the CUTLASS INT8 channel kernel.

The two GEMMs of the DeepSeek-V3 experts pass on the contiguous layout (E = 128 experts by
default, GEMM1 N = 4096 K = 7168, GEMM2 N = 7168 K = 2048), every expert with ``m`` rows, random
int8 operands and scales (activation scales MN-major, as the pass hands them over), the shipped
tile order. Each GEMM is the median of ``triton.testing.do_bench`` (``epmoe.timing.kernel_ms``);
the variants and the channel kernel take turns for ``--rounds`` rounds (``epmoe.timing.in_turns``)
and the median of the rounds is reported, with TOP/s and
the fraction of the datasheet INT8 peak. GEMM1 also times the variants built with the activation in
the epilogue (``<variant>+silu``: ``silu(gate) * up`` requantized to 1x128 int8 instead of the bf16
output) and, for the others, the Triton kernel that does that after them (``activation``): the
fused GEMM1 against GEMM1 plus ``activation``. Where `int8_block_schedules.py` times whole passes, this
separates the GEMMs from the quantizers and the activation between them. Needs a GPU with
``SGLANG_CUTLASS_MOE=1`` and the CUTLASS headers (the first run compiles the kernels).

    SGLANG_CUTLASS_MOE=1 python benchmarks/int8_block_gemms.py --out gemms.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks.provenance, epmoe of this checkout
from benchmarks.provenance import run_record  # noqa: E402

import torch  # noqa: E402

from epmoe.bench.experts import DATASHEET  # noqa: E402
from epmoe.experts.cutlass_backend import (  # noqa: E402
    INT8_BLOCK_SCHEDULES, SILU_FUSED_SCHEDULES, TILE_ORDER,
)  # fmt: skip
from epmoe.timing import in_turns, kernel_ms  # noqa: E402

GEMMS = {"gemm1": (4096, 7168), "gemm2": (7168, 2048)}
CHANNEL = "channel"
ACTIVATION = "activation"
SILU = "+silu"
"""``<variant>+silu``: the variant's GEMM1 with the activation fused."""


def parse_args(argv):
    p = argparse.ArgumentParser(prog="benchmarks/int8_block_gemms.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="write the JSON here")
    p.add_argument("--variants", default=",".join(INT8_BLOCK_SCHEDULES),
                   help="comma-separated INT8 block variants (default: all)")
    p.add_argument("--m", default="512,2048", help="rows per expert, comma-separated multiples of 128")
    p.add_argument("--experts", type=int, default=128, help="experts (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=3, help="rounds in which the kernels take turns (>= 1)")
    p.add_argument("--rep-ms", type=float, default=60.0, help="do_bench repetition time per measurement (ms)")
    p.add_argument("--commit", default=None, help="the commit measured (default: git rev-parse HEAD)")
    args = p.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in INT8_BLOCK_SCHEDULES]
    if unknown or not variants:
        p.error(f"--variants={args.variants!r}: allowed are names of {list(INT8_BLOCK_SCHEDULES)}")
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1; got {args.rounds}")
    try:
        ms = [int(v) for v in args.m.split(",")]
    except ValueError:
        p.error(f"--m={args.m!r}: comma-separated positive integers")
    if not ms or min(ms) < 1 or any(m % 128 for m in ms):
        p.error(f"--m={args.m!r}: comma-separated multiples of 128 (the kernels' row block: every "
                "expert's segment starts and ends on one)")
    if args.experts < 1:
        p.error(f"--experts must be >= 1; got {args.experts}")
    args.variants, args.ms = variants, ms
    return args


def gemm_kernels(ext, variants: list[str], experts: int, m: int, gemm: str, g: torch.Generator) -> dict:
    """``{name: launch}`` of one GEMM of the pass at ``m`` rows per expert on fresh random operands
    (activation scales MN-major, as the pass hands them over; the shipped tile order): each of
    ``variants``, the channel kernel (``channel``) and, for GEMM1, ``<variant>+silu`` for the fused
    builds and the Triton activation kernel (``activation``). Each launch writes into buffers of
    its own kind shared by all (the outputs are not read)."""
    from epmoe.kernels.activation import silu_and_mul_quant
    from epmoe.kernels.common import mn_major_scales

    dev, e, (n, k) = g.device, experts, GEMMS[gemm]
    raster, swizzle = TILE_ORDER
    total = e * m
    a = torch.randint(-127, 128, (total, k), dtype=torch.int8, device=dev, generator=g)
    a_block = mn_major_scales(total, k // 128, dev)  # the layout the pass hands over
    a_block.copy_(torch.rand(total, k // 128, device=dev, generator=g) + 0.5)
    a_token = torch.rand(total, 1, device=dev, generator=g) + 0.5
    b = torch.randint(-127, 128, (e, n, k), dtype=torch.int8, device=dev, generator=g)
    b_block = torch.rand(e, n // 128, k // 128, device=dev, generator=g) + 0.5
    b_channel = torch.rand(e, n, device=dev, generator=g) + 0.5
    offsets = torch.arange(e + 1, device=dev, dtype=torch.int32) * m
    out = torch.empty(total, n, dtype=torch.bfloat16, device=dev)
    fns = {
        v: (lambda i=INT8_BLOCK_SCHEDULES.index(v): ext.int8_block_contiguous_gemm(
            out, a, a_block, b, b_block, offsets, raster, swizzle, i, True))
        for v in variants
    }  # fmt: skip
    fns[CHANNEL] = lambda: ext.int8_contiguous_gemm(out, a, a_token, b, b_channel, offsets, raster, swizzle, True)
    if gemm == "gemm1":
        q, q_scale = torch.empty(total, n // 2, dtype=torch.int8, device=dev), mn_major_scales(total, n // 256, dev)
        for v in variants:
            if v in SILU_FUSED_SCHEDULES:
                fns[v + SILU] = lambda i=INT8_BLOCK_SCHEDULES.index(v): ext.int8_block_silu_gemm(
                    q, q_scale, a, a_block, b, b_block, offsets, raster, swizzle, i, True)  # fmt: skip
        gate_up = torch.randn(total, n, device=dev, generator=g).to(torch.bfloat16)
        fns[ACTIVATION] = lambda: silu_and_mul_quant(gate_up, "group", 128, torch.int8, scale_mn_major=True)
    return fns


def time_gemm(ext, args, m: int, gemm: str, g: torch.Generator) -> list[dict]:
    """One GEMM at ``m`` rows per expert: every kernel of :func:`gemm_kernels` in turns, a row
    each (its operands are freed on return, before the next GEMM's are made)."""
    dev, (n, k), total = g.device, GEMMS[gemm], args.experts * m
    fns = gemm_kernels(ext, args.variants, args.experts, m, gemm, g)
    times = in_turns(fns, args.rounds, lambda fn: kernel_ms(fn, rep_ms=args.rep_ms, device=dev))
    ops = 2 * total * n * k
    rows = []
    for name, t in times.items():
        ms = statistics.median(t)
        rate = None if name == ACTIVATION else ops / ms / 1e9  # the activation does no GEMM
        rows.append({"m": m, "gemm": gemm, "n": n, "k": k, "kernel": name, "ms": ms, "rounds_ms": t, "TOPS": rate,
                     "frac_peak_datasheet": None if rate is None else rate / DATASHEET["int8"]})  # fmt: skip
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/int8_block_gemms.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from epmoe.experts.cutlass_backend import load_extension

    ext = load_extension()
    g = torch.Generator(device=torch.device("cuda")).manual_seed(0)
    rows = []
    for m in args.ms:
        for gemm in GEMMS:
            rows += time_gemm(ext, args, m, gemm, g)
            torch.cuda.empty_cache()
    print("    m gemm   kernel: ms (fraction of the INT8 datasheet peak; the activation: ms)")
    for m in args.ms:
        for gemm in GEMMS:
            cells = [r for r in rows if r["m"] == m and r["gemm"] == gemm]
            print(f"{m:5d} {gemm:6} " + "  ".join(f"{r['kernel']}: {r['ms']:.3f}"
                  + ("" if r["kernel"] == ACTIVATION else f" ({r['frac_peak_datasheet']:.1%})") for r in cells))  # fmt: skip
    report = {**run_record("benchmarks/int8_block_gemms.py", argv, args.commit),
              "experts": args.experts, "tile_order": list(TILE_ORDER), "rounds": args.rounds, "rows": rows}  # fmt: skip
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
