"""Measure where the cutlass backend's INT8 passes should switch from Triton to CUTLASS.

For each INT8 scheme the cutlass backend serves (``int8_channel`` with the int32 accumulator,
``int8_block``) and each rows-per-expert ``m`` (uniform routing, fresh random data, the layout the
backend gets: every expert's segment padded to 128 rows), this times the two branches of
:meth:`epmoe.experts.cutlass_backend.CutlassBackend.run_kernel` — the Triton backend's whole pass
(on the batch packed to its rows) and the CUTLASS kernels' — taking turns for ``--turns`` rounds
(medians), and writes the result in the format of ``epmoe/configs/int8_crossover.json``::

    {"<GPU name>": {"<scheme>": {"measured": [{"rows_per_expert", "triton_ms", "cutlass_ms",
                                               "triton_unpadded_ms"}, ...],
                                 "cutlass_from_rows_per_expert": int | null, "source": str}}}

``cutlass_from_rows_per_expert`` is :func:`~epmoe.experts.fp8_selection.crossover_from_measurements`
of the measured rows (CUTLASS from the smallest size at which it is no slower there and at every
larger size). ``triton_unpadded_ms`` (Triton on a batch laid out with segments of exactly ``m``
rows, as on its own backend: the packing's cost is the difference to ``triton_ms``) is recorded
for reference; the rule does not use it. Small batches run inside CUDA graphs (launch overhead would
otherwise hide the kernels).

The CUTLASS INT8 block kernel runs ``--schedule`` (a variant of
``epmoe.experts.cutlass_backend.INT8_BLOCK_SCHEDULES``), else the one the backend is built with
(``EPMOE_INT8_BLOCK_SCHEDULE``, else the one measured for this GPU, else the default); ``source``
names it.

Run on one GPU with ``SGLANG_CUTLASS_MOE=1`` and the CUTLASS headers (the first run compiles the
kernels)::

    SGLANG_CUTLASS_MOE=1 python benchmarks/int8_crossover.py --out $OUT/int8_crossover.json

then review the file and ship it as ``epmoe/configs/int8_crossover.json``. ``--merge-into FILE``
writes FILE's entries with this run's (this GPU, the measured schemes) in their place, so that
re-measuring one scheme keeps the others. Re-measuring the block kernel's crossover alone, around
where it lies, without the unpadded reference branch, is a few tens of seconds after the build::

    SGLANG_CUTLASS_MOE=1 python benchmarks/int8_crossover.py --schemes int8_block \
        --m 16,32,48,64,96,128,256 --turns 3 --rep-ms 50 --no-unpadded \
        --merge-into epmoe/configs/int8_crossover.json --out $OUT/int8_crossover.json
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import statistics
import sys

import torch

from epmoe.bench.experts import GRAPH_MAX_M, build_problem, make_timer, uniform_batch, weights_for
from epmoe.timing import in_turns
from epmoe.experts.cutlass_backend import INT8_BLOCK_SCHEDULES, ROW_BLOCK, CutlassBackend
from epmoe.experts.fp8_selection import crossover_from_measurements
from epmoe.kernels.configs import mode_and_accumulator
from epmoe.quant.schemes import get_scheme

SCHEMES = ("int8_channel_int32", "int8_block")


def parse_args(argv):
    p = argparse.ArgumentParser(prog="benchmarks/int8_crossover.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="write the crossover JSON here")
    p.add_argument("--m", default="8,16,32,64,128,256,512,2048", help="rows per expert, comma separated")
    p.add_argument("--schemes", default=",".join(SCHEMES), help=f"subset of {','.join(SCHEMES)}")
    p.add_argument("--experts", type=int, default=128, help="local experts E_loc")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--turns", type=int, default=5, help="rounds of the branches taking turns (medians)")
    p.add_argument("--rep-ms", type=float, default=100.0, help="do_bench repetition time per measurement")
    p.add_argument("--schedule", default=None, choices=INT8_BLOCK_SCHEDULES,
                   help="the INT8 block kernel's variant (default: the one the backend picks)")
    p.add_argument("--no-unpadded", dest="unpadded", action="store_false",
                   help="leave out the Triton branch on unpadded segments (a reference the rule does not use)")
    p.add_argument("--merge-into", default=None,
                   help="a crossover file whose entries this run's replace (for this GPU and the measured schemes)")
    args = p.parse_args(argv)
    try:
        args.m = sorted({int(v) for v in args.m.split(",")})
    except ValueError:
        p.error(f"--m {args.m!r}: expected comma-separated integers")
    if not args.m or args.m[0] < 1:
        p.error(f"--m {args.m}: rows per expert must be >= 1")
    args.schemes = [s for s in args.schemes.split(",") if s]
    bad = [s for s in args.schemes if s not in SCHEMES]
    if bad or not args.schemes:
        p.error(f"--schemes {bad or args.schemes}: allowed {list(SCHEMES)}")
    if args.turns < 1:
        p.error(f"--turns {args.turns}: at least 1")
    return args


def measure_scheme(key: str, args, device, problem, timer) -> dict:
    quant, accumulator = mode_and_accumulator(key)
    scheme = get_scheme(quant)
    ok, reason = CutlassBackend.supports(scheme, "contiguous", device, args.hidden, args.intermediate,
                                         accumulator=accumulator)  # fmt: skip
    if not ok:
        raise SystemExit(f"cutlass cannot run {key} here: {reason}")
    backend = CutlassBackend(scheme, accumulator=accumulator, schedule=args.schedule if quant == "int8_block" else None)
    weights = backend.prepare_weights(weights_for(problem, quant))
    backend.warmup(weights)  # the first use compiles the kernels: not inside a timing
    rows = []
    for i, m in enumerate(args.m):
        padded = uniform_batch(problem, m, device, torch.bfloat16, seed=2000 + i, alignment=ROW_BLOCK)
        exact = uniform_batch(problem, m, device, torch.bfloat16, seed=2000 + i) if args.unpadded else None
        fns = {
            "triton": lambda: backend.run_kernel(padded, weights, torch.bfloat16, "triton"),
            "cutlass": lambda: backend.run_kernel(padded, weights, torch.bfloat16, "cutlass"),
        }
        if args.unpadded:
            fns["triton_unpadded"] = lambda: backend.run_kernel(exact, weights, torch.bfloat16, "triton")
        graph = m <= GRAPH_MAX_M
        try:
            samples = in_turns(fns, args.turns, lambda fn: timer(fn, graph))
        except RuntimeError as exc:  # a branch that cannot be captured: every branch without graphs
            if not graph:
                raise
            print(f"{key} m={m}: CUDA-graph timing failed ({exc}); timing all branches without graphs", flush=True)
            graph = False
            samples = in_turns(fns, args.turns, lambda fn: timer(fn, graph))
        ms = {name: statistics.median(v) for name, v in samples.items()}
        rows.append({"rows_per_expert": m, **{f"{name}_ms": round(v, 4) for name, v in ms.items()}, "cuda_graph": graph})
        print(f"{key} m={m}: " + ", ".join(f"{n} {v:.3f} ms" for n, v in ms.items()), flush=True)
        del padded, exact
        torch.cuda.empty_cache()
    return {
        "measured": rows,
        "cutlass_from_rows_per_expert": crossover_from_measurements(rows),
        "source": (
            f"benchmarks/int8_crossover.py, {_dt.date.today().isoformat()}, E={args.experts} H={args.hidden} "
            f"I={args.intermediate}, whole passes in turns ({args.turns} rounds, medians), segments padded "
            f"to {ROW_BLOCK} rows; torch {torch.__version__}"
            + (f"; INT8 block kernel schedule {backend.schedule_for(device)}" if quant == "int8_block" else "")
        ),
    }


def merged(path: str | None, gpu: str, entries: dict) -> dict:
    """``{gpu: entries}``, or the crossover file at ``path`` with ``gpu``'s entries for these
    schemes replaced (every other GPU, scheme and ``_comment`` key kept as it was)."""
    if path is None:
        return {gpu: entries}
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise SystemExit(f"--merge-into {path}: expected a JSON object keyed by GPU name")
    data[gpu] = {**data.get(gpu, {}), **entries}
    return data


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/int8_crossover.py needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    problem = build_problem(args.experts, args.hidden, args.intermediate, device, torch.bfloat16)
    timer = make_timer(device, args.rep_ms)
    entries = {key.removesuffix("_int32"): measure_scheme(key, args, device, problem, timer) for key in args.schemes}
    data = merged(args.merge_into, torch.cuda.get_device_name(), entries)
    with open(args.out, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    for scheme, entry in entries.items():
        print(f"{scheme}: CUTLASS from {entry['cutlass_from_rows_per_expert']} rows per expert")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
