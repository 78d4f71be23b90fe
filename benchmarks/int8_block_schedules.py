"""The CUTLASS INT8 block kernel's variants against INT8 channel and BF16 on one GPU.

One run of ``epmoe bench experts`` (DeepSeek-V3 experts: E_loc = 128, H = 7168, I = 2048 by
default; ``--turns`` rounds of the whole passes taking turns) with these rows:

* ``torch_bf16`` (BF16 ``torch._grouped_mm``, the baseline);
* ``cutlass_int8_channel_int32_cutlass`` and ``cutlass_int8_block_<variant>_cutlass`` for every
  variant of the INT8 block kernel the package builds
  (``epmoe.experts.cutlass_backend.INT8_BLOCK_SCHEDULES``), the CUTLASS kernels at every size
  (``int8_kernel=cutlass``: no switch to Triton below the crossover);
* with ``--triton``, the Triton backend's ``triton_int8_channel_int32`` and ``triton_int8_block``;
* with ``--masked``, the same CUTLASS INT8 rows on the masked layout (``_masked``: every expert's
  rows in a slab of ``m`` rounded up to 128, as low-latency dispatch delivers them).

Needs ``SGLANG_CUTLASS_MOE=1`` and the CUTLASS headers (the first run compiles the kernels, in
this process, before anything is timed). Each variant is first run in a child process of its own
(all at once) with a time limit (``--smoke-s``) on a small problem and checked against the
package's float64 reference (:func:`worst_error`); a
variant that fails or hangs there is left out of the timing and named in the JSON (``smoke``),
so one broken variant cannot stall the run.
Prints the bench's table, then a summary: per ``m`` the in-turns whole-pass ms of each row, the
block rows' speed-up over BF16 and time over CUTLASS INT8 channel, the issue's targets (at 512 and
2048 rows per expert: >= 1.6x BF16 and within 15 % of channel), the fastest variant per ``m``
and the one the runtime should run (least total time from 128 rows per expert). Writes the
bench's JSON with ``summary``, ``commit``, ``gpu`` and the versions added to ``--out``, and with
``--schedule-out`` the entry of ``epmoe/configs/int8_block_schedule.json`` for this GPU.

``--tiny`` is a CPU dry run of the plumbing (tiny shapes; the CUTLASS rows then fail, which the
summary reports).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks.provenance, epmoe of this checkout
from benchmarks.provenance import git_commit  # noqa: E402
import torch

from epmoe.bench import experts as bench
from epmoe.experts.cutlass_backend import INT8_BLOCK_SCHEDULES

CUTLASS = "epmoe.experts.cutlass_backend:CutlassBackend"
TARGET_M = (512, 2048)
TARGET_VS_BF16 = 1.6
TARGET_VS_CHANNEL = 1.15


def parse_args(argv):
    p = argparse.ArgumentParser(prog="benchmarks/int8_block_schedules.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="write the JSON here")
    p.add_argument("--m", default="128,512,2048", help="rows per expert, comma separated")
    p.add_argument("--turns", type=int, default=2, help="rounds of the whole passes taking turns (>= 1)")
    p.add_argument("--rep-ms", type=float, default=60.0, help="do_bench repetition time per measurement")
    p.add_argument("--masked", action="store_true", help="also time the CUTLASS INT8 rows on the masked layout")
    p.add_argument("--triton", action="store_true", help="also time the Triton backend's INT8 rows")
    p.add_argument("--commit", default=None, help="the commit measured (default: git rev-parse HEAD)")
    p.add_argument("--tiny", action="store_true", help="CPU dry run at tiny sizes (the CUTLASS rows fail)")
    p.add_argument("--smoke-s", type=float, default=90.0, help="time limit of the variants' child-process checks")
    p.add_argument("--schedule-out", default=None,
                   help="also write the winner in the format of epmoe/configs/int8_block_schedule.json here")
    args = p.parse_args(argv)
    if args.turns < 1:
        p.error(f"--turns must be >= 1 (the summary reads the in-turns times); got {args.turns}")
    return args


def extras(schedules) -> list[str]:
    rows = [f"{CUTLASS}@int8_channel_int32?int8_kernel=cutlass"]
    return rows + [f"{CUTLASS}@int8_block?schedule={s}&int8_kernel=cutlass" for s in schedules]


SMOKE_BOUND = 2.0**-7
"""Largest relative error of a variant's smoke check (generous: a wrong tile or row block is off by
far more)."""
SMOKE = f"""
import sys
sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})
from benchmarks.int8_block_schedules import SMOKE_BOUND, worst_error
worst = worst_error(sys.argv[1])
print(f"{{sys.argv[1]}}: worst relative error {{worst:.2e}}")
sys.exit(0 if worst < SMOKE_BOUND else 1)
"""


def worst_error(schedule: str, device: str = "cuda") -> float:
    """The largest relative error of the INT8 block kernel's variant ``schedule`` on a small
    problem (two of three experts' segments, contiguous and masked, a masked expert with one row),
    against the package's dequantization (:mod:`epmoe.quant.reference`) in float64, where each
    code times its scale is exact."""
    from epmoe.experts import cutlass_backend as cb
    from epmoe.quant.reference import dequantize_rows, dequantize_weight

    g = torch.Generator(device=device).manual_seed(0)
    e, m, n, k = 3, 256, 384, 1024
    a = torch.randint(-127, 128, (e * m, k), dtype=torch.int8, device=device, generator=g)
    b = torch.randint(-127, 128, (e, n, k), dtype=torch.int8, device=device, generator=g)
    sa = torch.rand(e * m, k // 128, device=device, generator=g) + 0.5
    sb = (torch.rand(e, n // 128, k // 128, device=device, generator=g) + 0.5) / (127.0 * 127.0 * k**0.5)
    offsets = torch.tensor([0, m, m, 2 * m], dtype=torch.int32, device=device)
    out = cb.int8_block_grouped_gemm(a, sa, b, sb, offsets, schedule=schedule)
    masked_m = torch.tensor([200, 0, 1], dtype=torch.int32, device=device)
    masked = cb.int8_block_masked_gemm(a.view(e, m, k), sa.view(e, m, -1), b, sb, masked_m, schedule=schedule)
    x64, w64 = dequantize_rows(a, sa, torch.float64), dequantize_weight(b, sb, torch.float64)
    worst = 0.0
    for got, rows, x in ((out[0:m], slice(0, m), 0), (out[m : 2 * m], slice(m, 2 * m), 2),
                         (masked[0, :200], slice(0, 200), 0), (masked[2, :1], slice(2 * m, 2 * m + 1), 2)):  # fmt: skip
        ref = x64[rows] @ w64[x].t()
        worst = max(worst, float(((got.double() - ref).abs() / (ref.abs() + 1e-30)).max()))
    return worst


def smoke(schedules, limit_s: float) -> dict:
    """``{variant: "ok" | why not}``: each variant run once in a child process of its own, all
    at once (a hang there is killed, not inherited): :func:`worst_error` within :data:`SMOKE_BOUND`."""
    children = {s: subprocess.Popen([sys.executable, "-c", SMOKE, s], stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True) for s in schedules}  # fmt: skip
    result = {}
    for s, child in children.items():
        try:
            output, _ = child.communicate(timeout=limit_s)
            tail = output.strip().splitlines()[-1:] or [""]
            result[s] = "ok" if child.returncode == 0 else f"failed (exit {child.returncode}): {tail[0]}"
        except subprocess.TimeoutExpired:
            child.kill()
            child.communicate()
            result[s] = f"did not finish within {limit_s:.0f} s (hang?)"
        print(f"smoke check {s}: {result[s]}", flush=True)
    return result


def bench_argv(args, json_path: str, schedules) -> list[str]:
    backends = "torch_bf16,triton_int8_channel_int32,triton_int8_block" if args.triton else "torch_bf16"
    argv = ["--m", args.m, "--turns", str(args.turns), "--rep-ms", str(args.rep_ms), "--json", json_path,
            "--backends", backends]  # fmt: skip
    for spec in extras(schedules):
        argv += ["--extra", spec]
    if args.masked:
        argv.append("--masked")
    if args.tiny:
        argv += ["--experts", "2", "--hidden", "256", "--intermediate", "128", "--m", "4", "--rep-ms", "1",
                 "--ceiling-size", "64"]  # fmt: skip
    return argv


def turns_ms(rows: dict, label: str):
    r = rows.get(label)
    return None if r is None or r["error"] else r["ms"].get("total_turns")


def summarize(results: list[dict]) -> dict:
    """Per m: in-turns ms of every row; each block row's ratios to BF16 and to CUTLASS channel
    (same layout), whether the targets hold, and the fastest schedule per layout."""
    out = {}
    for m in sorted({r["m"] for r in results}):
        rows = {r["backend"]: r for r in results if r["m"] == m}
        bf16 = turns_ms(rows, "torch_bf16")
        entry = {"ms": {label: turns_ms(rows, label) for label in rows}, "block": {}, "fastest": {}}
        for layout, suffix in (("contiguous", ""), ("masked", "_masked")):
            channel = turns_ms(rows, f"cutlass_int8_channel_int32_cutlass{suffix}")
            timed = {}
            for s in INT8_BLOCK_SCHEDULES:
                ms = turns_ms(rows, f"cutlass_int8_block_{s}_cutlass{suffix}")
                if ms is None:
                    continue
                timed[s] = ms
                vs_bf16 = bf16 / ms if bf16 else None
                vs_channel = ms / channel if channel else None
                entry["block"][f"{s}{suffix}"] = {
                    "ms": ms, "speedup_vs_bf16": vs_bf16, "time_vs_channel": vs_channel,
                    "meets_targets": None if m not in TARGET_M or vs_bf16 is None or vs_channel is None
                    else vs_bf16 >= TARGET_VS_BF16 and vs_channel <= TARGET_VS_CHANNEL,
                }  # fmt: skip
            if timed:
                entry["fastest"][layout] = min(timed, key=timed.get)
        out[str(m)] = entry
    return out


WINNER_FROM_M = 128
"""Rows per expert from which the winner is judged: below the INT8 crossover the Triton pass runs,
not the CUTLASS kernels."""


def winner(summary: dict) -> tuple[str | None, dict]:
    """``(schedule, {m: {schedule: ms}})``: the schedule with the least contiguous whole-pass time
    summed over the sizes from :data:`WINNER_FROM_M` rows per expert, among those timed at all of
    them (``None`` when none was)."""
    sizes = [m for m in summary if int(m) >= WINNER_FROM_M]
    table = {m: {s: summary[m]["block"][s]["ms"] for s in INT8_BLOCK_SCHEDULES if s in summary[m]["block"]}
             for m in sizes}  # fmt: skip
    complete = [s for s in INT8_BLOCK_SCHEDULES if sizes and all(s in table[m] for m in sizes)]
    if not complete:
        return None, table
    return min(complete, key=lambda s: sum(table[m][s] for m in sizes)), table


def schedule_entry(report: dict) -> dict | None:
    """The ``epmoe/configs/int8_block_schedule.json`` entry of this run, ``{gpu: {...}}``."""
    best, table = winner(report["summary"])
    if best is None or not report.get("gpu"):
        return None
    source = (f"benchmarks/int8_block_schedules.py, {report['date'][:10]}, commit {report.get('commit')}, "
              f"{report['gpu']}, E={report['shapes']['experts']} H={report['shapes']['hidden']} "
              f"I={report['shapes']['intermediate']}, whole passes in turns, contiguous, least total time "
              f"from {WINNER_FROM_M} rows per expert; torch {report['torch']}")  # fmt: skip
    return {report["gpu"]: {"schedule": best, "measured_ms": table, "source": source}}


def fmt(v, spec=".2f") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def table(summary: dict) -> str:
    """In-turns whole-pass ms, one line per row and one column per ``m``; the fastest variant per
    ``m``; then each block variant's ratios and whether it meets the targets."""
    sizes = list(summary)
    labels = ["torch_bf16", "cutlass_int8_channel_int32_cutlass", "triton_int8_channel_int32", "triton_int8_block"]
    labels += [f"cutlass_int8_block_{s}_cutlass" for s in INT8_BLOCK_SCHEDULES]
    labels = [label for label in labels if any(summary[m]["ms"].get(label) is not None for m in sizes)]
    lines = [f"{'ms, whole pass (m = rows per expert)':<40}" + "".join(f"{m:>10}" for m in sizes)]
    for label in labels:
        lines.append(f"{label:<40}" + "".join(f"{fmt(summary[m]['ms'].get(label), '.3f'):>10}" for m in sizes))
    lines.append(f"{'fastest block variant':<40}" + "".join(f"{summary[m]['fastest'].get('contiguous', '-'):>10}"
                                                           for m in sizes))  # fmt: skip
    lines.append("block variants (contiguous, masked): ms, x BF16, / channel, targets at 512 and 2048")
    for m, e in summary.items():
        for name, b in e["block"].items():
            met = {None: "", True: " MET", False: " not met"}[b["meets_targets"]]
            lines.append(f"{m:>5} {name:<20} {fmt(b['ms'], '.3f'):>8} {fmt(b['speedup_vs_bf16']):>6}x "
                         f"{fmt(b['time_vs_channel']):>6}{met}")  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    checks = {}
    schedules = list(INT8_BLOCK_SCHEDULES)
    started = time.perf_counter()
    build_s = None
    if torch.cuda.is_available():
        from epmoe.experts.cutlass_backend import load_extension

        load_extension()  # the build, here: the children and the bench find it in the cache
        build_s = time.perf_counter() - started
        print(f"extension ready after {build_s:.0f} s", flush=True)
        checks = smoke(schedules, args.smoke_s)
        schedules = [s for s in schedules if checks[s] == "ok"]
    with tempfile.TemporaryDirectory() as tmp:
        path = str(Path(tmp) / "experts.json")
        code = bench.main(bench_argv(args, path, schedules))
        if not Path(path).is_file():
            print("the experts bench wrote no JSON", file=sys.stderr)
            return code or 1
        report = json.loads(Path(path).read_text())
    report["summary"] = summarize(report["results"])
    report["smoke"] = checks
    report["build_s"] = build_s
    report["run_s"] = time.perf_counter() - started - (build_s or 0.0)
    report["commit"] = git_commit(args.commit, fallback=None)
    report["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    report["script"] = "benchmarks/int8_block_schedules.py " + " ".join(argv if argv is not None else sys.argv[1:])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print()
    print(table(report["summary"]))
    for s, why in checks.items():
        if why != "ok":
            print(f"variant {s} left out: {why}")
    best, _ = winner(report["summary"])
    print(f"fastest variant from {WINNER_FROM_M} rows per expert (contiguous, summed): {best}; "
          f"build {fmt(build_s, '.0f')} s, run {report['run_s']:.0f} s")
    if args.schedule_out:
        entry = schedule_entry(report)
        if entry is None:
            print(f"no winner to write to {args.schedule_out}", file=sys.stderr)
        else:
            Path(args.schedule_out).write_text(json.dumps(entry, indent=1) + "\n")
            print(f"wrote {args.schedule_out} (ship it as epmoe/configs/int8_block_schedule.json)")
    print(f"wrote {args.out}")
    return code or int(any(why != "ok" for why in checks.values()))


if __name__ == "__main__":
    raise SystemExit(main())
