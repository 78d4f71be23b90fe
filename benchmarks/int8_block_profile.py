"""Where the INT8 block GEMMs lose to the channel kernel: launches for Nsight Compute, clocks and
power under sustained load, and a summary of the profiles.

Three subcommands:

* ``launch``: each of ``--kernels`` (names of ``int8_block_gemms.gemm_kernels``: a variant,
  ``<variant>+silu``, ``channel``) ``--iters`` times on one GEMM of the experts pass, for ncu to
  pick one launch::

      ncu --clock-control none --kernel-name regex:device_kernel --launch-skip 1 --launch-count 1 \\
          --set full -o run4_silu python benchmarks/int8_block_profile.py launch \\
          --kernels n256_quarters_run4+silu --experts 32
      ncu --import run4_silu.ncu-rep --page details --csv > details_run4_silu.csv
      ncu --import run4_silu.ncu-rep --page source --csv --print-source sass > sass_run4_silu.csv

* ``sustain``: each kernel back to back for ``--seconds``, with ``nvidia-smi`` sampling the SM
  clock and the board power every 250 ms: ms per launch where the GPU sits at its power cap.
* ``summarize``: the ncu CSV pages of several kernels as one JSON (``--details NAME=CSV``,
  ``--sass NAME=CSV``): the throughput, issue and scheduler figures, the warp stall reasons and the
  instruction mix.

Needs a GPU with ``SGLANG_CUTLASS_MOE=1`` and the CUTLASS headers for ``launch`` and
``sustain``; ``summarize`` runs anywhere.
"""

from __future__ import annotations

import argparse
import collections
import csv
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks.*, epmoe of this checkout
from benchmarks.int8_block_gemms import CHANNEL, GEMMS, SILU, gemm_kernels  # noqa: E402
from benchmarks.provenance import run_record  # noqa: E402
from benchmarks.sass_yield_hints import sass_mnemonic  # noqa: E402

import torch  # noqa: E402

from epmoe.experts.cutlass_backend import INT8_BLOCK_SCHEDULES, ROW_BLOCK, SILU_FUSED_SCHEDULES  # noqa: E402

DETAIL_METRICS = (
    "SM Frequency", "Duration", "Elapsed Cycles", "Compute (SM) Throughput", "Memory Throughput",
    "DRAM Throughput", "L2 Hit Rate", "Issue Slots Busy", "Executed Ipc Active", "No Eligible",
    "Eligible Warps Per Scheduler", "Active Warps Per Scheduler", "Warp Cycles Per Issued Instruction",
    "Executed Instructions", "Registers Per Thread", "Dynamic Shared Memory Per Block",
)  # fmt: skip
"""The ncu ``details`` rows a summary keeps (by metric name)."""
DETAIL_RULES = ("HighPipeUtilization",)
"""The ncu ``details`` rules whose text a summary keeps (the busiest pipe, by name)."""


def kernel_names() -> list[str]:
    """What ``--kernels`` may name: every variant, the fused builds (``+silu``) and ``channel``."""
    return [*INT8_BLOCK_SCHEDULES, *(v + SILU for v in SILU_FUSED_SCHEDULES), CHANNEL]


def parse_args(argv):
    p = argparse.ArgumentParser(prog="benchmarks/int8_block_profile.py", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    for name, what in (("launch", "launch each kernel --iters times (for ncu)"),
                       ("sustain", "run each kernel for --seconds, sampling clocks and power")):  # fmt: skip
        s = sub.add_parser(name, help=what)
        s.add_argument("--kernels", default="channel,n256_quarters_run4+silu", help="comma-separated (default: %(default)s)")
        s.add_argument("--gemm", choices=sorted(GEMMS), default="gemm1", help="the GEMM of the pass (default: %(default)s)")
        s.add_argument("--experts", type=int, default=128, help="experts (default: %(default)s)")
        s.add_argument("--m", type=int, default=2048, help="rows per expert, a multiple of 128 (default: %(default)s)")
        if name == "launch":
            s.add_argument("--iters", type=int, default=2, help="launches of each kernel (default: %(default)s)")
        else:
            s.add_argument("--seconds", type=float, default=3.0, help="seconds per kernel (default: %(default)s)")
            s.add_argument("--out", default=None, help="write the JSON here")
            s.add_argument("--commit", default=None, help="the commit measured (default: git rev-parse HEAD)")
    s = sub.add_parser("summarize", help="ncu CSV pages -> JSON")
    s.add_argument("--details", action="append", default=[], metavar="NAME=CSV", help="an ncu --page details --csv file")
    s.add_argument("--sass", action="append", default=[], metavar="NAME=CSV", help="an ncu --page source --print-source sass --csv file")
    s.add_argument("--out", required=True, help="write the JSON here")
    args = p.parse_args(argv)
    if args.command == "summarize":
        for flag in ("details", "sass"):
            names = []
            for value in getattr(args, flag):
                name, eq, path = value.partition("=")
                if not eq or not name or not path:
                    p.error(f"--{flag}={value!r}: expected NAME=CSV")
                if not Path(path).is_file():
                    p.error(f"--{flag}={value!r}: no such file {path!r}")
                if name in names:
                    p.error(f"--{flag}={value!r}: {name!r} is given twice")
                names.append(name)
        if not args.details and not args.sass:
            p.error("summarize needs at least one --details or --sass")
        return args
    kernels = [k for k in args.kernels.split(",") if k]
    unknown = [k for k in kernels if k not in kernel_names()]
    if unknown or not kernels:
        p.error(f"--kernels={args.kernels!r}: allowed are names of {kernel_names()}")
    if args.gemm != "gemm1" and any(k.endswith(SILU) for k in kernels):
        p.error(f"--kernels={args.kernels!r}: the fused builds (+silu) are GEMM1 only; got --gemm={args.gemm}")
    if args.experts < 1:
        p.error(f"--experts must be >= 1; got {args.experts}")
    if args.m < ROW_BLOCK or args.m % ROW_BLOCK:
        p.error(f"--m must be a positive multiple of {ROW_BLOCK} (the kernels' row block); got {args.m}")
    if getattr(args, "iters", 1) < 1:
        p.error(f"--iters must be >= 1; got {args.iters}")
    if getattr(args, "seconds", 1.0) <= 0:
        p.error(f"--seconds must be > 0; got {args.seconds}")
    args.kernels = kernels
    return args


# ---------------------------------------------------------------------------------- summarize
def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def details_summary(path: str | Path) -> dict:
    """``{metric: {"value", "unit"}}`` of :data:`DETAIL_METRICS` and ``{"rules": {rule: text}}`` of
    :data:`DETAIL_RULES` from an ncu ``details`` CSV (the first kernel in it)."""
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows or "Metric Name" not in rows[0]:
        raise ValueError(f"{path}: not an ncu --page details --csv file (no 'Metric Name' column)")
    first = rows[0]["ID"]
    out: dict = {}
    rules = {}
    for r in rows:
        if r["ID"] != first:
            continue
        if r["Metric Name"] in DETAIL_METRICS and r["Metric Name"] not in out:
            out[r["Metric Name"]] = {"value": _number(r["Metric Value"]), "unit": r["Metric Unit"]}
        if r.get("Rule Name") in DETAIL_RULES:
            rules[r["Rule Name"]] = r["Rule Description"]
    if rules:
        out["rules"] = rules
    return out


SAMPLES = "Warp Stall Sampling (All Samples)"


def sass_summary(path: str | Path, top: int = 12) -> dict:
    """From an ncu ``source`` page (SASS, CSV, one kernel): the warp stall reasons as fractions of
    all samples (``named_stall_total``: how much of them the named reasons cover), the samples and
    the executed instructions by opcode (the ``top`` largest)."""
    with open(path, newline="") as f:
        lines = list(csv.reader(f))
    kernels = sum(1 for r in lines if r and r[0] == "Kernel Name")
    if kernels > 1:
        raise ValueError(f"{path}: {kernels} kernels in one source page; profile one launch (--launch-count 1)")
    needed = ("Source", "Instructions Executed", SAMPLES)
    header = next((i for i, r in enumerate(lines) if all(c in r for c in needed)), None)
    if header is None:
        raise ValueError(f"{path}: not an ncu --page source --print-source sass --csv file (no header with {list(needed)})")
    col = {h: i for i, h in enumerate(lines[header])}
    stalls = [h for h in lines[header] if h.startswith("stall_") and "Not Issued" not in h]
    by_stall, samples_by_op, executed_by_op = collections.Counter(), collections.Counter(), collections.Counter()
    total = 0.0
    for r in lines[header + 1:]:
        if len(r) < len(col):
            continue
        op = sass_mnemonic(r[col["Source"]]).split(".")[0]
        samples = _number(r[col[SAMPLES]]) or 0.0
        total += samples
        samples_by_op[op] += samples
        executed_by_op[op] += _number(r[col["Instructions Executed"]]) or 0.0
        for h in stalls:
            by_stall[h[len("stall_"):]] += _number(r[col[h]]) or 0.0
    executed = sum(executed_by_op.values())
    return {
        "samples": total,
        "stall_fraction": {k: v / total for k, v in by_stall.most_common() if v} if total else {},
        "named_stall_total": sum(by_stall.values()) / total if total else None,
        "samples_fraction_by_opcode": {k: v / total for k, v in samples_by_op.most_common(top)} if total else {},
        "executed_instructions": executed,
        "executed_fraction_by_opcode": {k: v / executed for k, v in executed_by_op.most_common(top)} if executed else {},
    }


def summarize(args) -> int:
    kernels: dict = collections.defaultdict(dict)
    for spec in args.details:
        name, path = spec.split("=", 1)
        kernels[name]["details"] = details_summary(path)
    for spec in args.sass:
        name, path = spec.split("=", 1)
        kernels[name]["sass"] = sass_summary(path)
    Path(args.out).write_text(json.dumps({"kernels": kernels}, indent=1) + "\n")
    for name, k in kernels.items():
        d = k.get("details", {})
        cells = [f"{m}: {d[m]['value']} {d[m]['unit']}" for m in ("SM Frequency", "Compute (SM) Throughput", "Issue Slots Busy")
                 if m in d]  # fmt: skip
        print(f"{name}: " + ", ".join(cells))
    print(f"wrote {args.out}")
    return 0


# ------------------------------------------------------------------------------- on the GPU
def smi_samples(lines: list[str]) -> tuple[list[float], list[float], str]:
    """SM clocks (MHz) and board power (W) of ``nvidia-smi --query-gpu=clocks.sm,power.draw,
    clocks_event_reasons.active --format=csv,noheader,nounits`` lines, and the last reasons mask;
    lines that are not numbers (a start-up line, [N/A]) are skipped."""
    clocks, power, reasons = [], [], ""
    for line in lines:
        cells = [c.strip() for c in line.split(",")]
        if len(cells) < 3 or _number(cells[0]) is None or _number(cells[1]) is None:
            continue
        clocks.append(_number(cells[0]))
        power.append(_number(cells[1]))
        reasons = cells[2]
    return clocks, power, reasons


def sustain(fn, seconds: float) -> dict:
    """``fn`` back to back for ``seconds`` (in tens, synchronised between them), its mean ms per
    launch from CUDA events, and the SM clock (median, least) and power (median) nvidia-smi saw
    on this GPU meanwhile (chosen by its UUID: nvidia-smi's indices need not be CUDA's)."""
    fn()
    torch.cuda.synchronize()
    gpu = f"GPU-{torch.cuda.get_device_properties(torch.cuda.current_device()).uuid}"
    smi = subprocess.Popen(["nvidia-smi", "-i", gpu, "--query-gpu=clocks.sm,power.draw,clocks_event_reasons.active",
                            "--format=csv,noheader,nounits", "-lms", "250"], stdout=subprocess.PIPE, text=True)  # fmt: skip
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    launches, t0 = 0, time.time()
    start.record()
    while time.time() - t0 < seconds:
        for _ in range(10):
            fn()
        launches += 10
        torch.cuda.synchronize()
    stop.record()
    torch.cuda.synchronize()
    smi.terminate()
    clocks, power, reasons = smi_samples(smi.stdout.read().splitlines())
    return {"ms_per_launch": start.elapsed_time(stop) / launches, "launches": launches,
            "sm_mhz_median": statistics.median(clocks) if clocks else None, "sm_mhz_min": min(clocks) if clocks else None,
            "power_w_median": statistics.median(power) if power else None, "event_reasons": reasons}  # fmt: skip


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.command == "summarize":
        return summarize(args)
    if not torch.cuda.is_available():
        print(f"benchmarks/int8_block_profile.py {args.command} needs a CUDA GPU", file=sys.stderr)
        return 2
    from epmoe.experts.cutlass_backend import load_extension

    g = torch.Generator(device=torch.device("cuda")).manual_seed(0)
    variants = sorted({k.removesuffix(SILU) for k in args.kernels if k != CHANNEL})
    fns = gemm_kernels(load_extension(), variants, args.experts, args.m, args.gemm, g)
    if args.command == "launch":
        for name in args.kernels:
            for _ in range(args.iters):
                fns[name]()
        torch.cuda.synchronize()
        return 0
    rows = []
    for name in args.kernels:
        row = {"kernel": name, **sustain(fns[name], args.seconds)}
        rows.append(row)
        print(f"{args.gemm} m={args.m} {name:28s} {row['ms_per_launch']:8.3f} ms per launch, SM clock median "
              f"{row['sm_mhz_median']} MHz, power median {row['power_w_median']} W, reasons {row['event_reasons']}")
        time.sleep(2)  # the next kernel meets the GPU after the same pause
    if args.out:
        report = {**run_record("benchmarks/int8_block_profile.py", argv, args.commit),
                  "gemm": args.gemm, "experts": args.experts, "m": args.m, "rows": rows}  # fmt: skip
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
