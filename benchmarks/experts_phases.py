"""Experts passes phase by phase: where one backend's pass spends the time another's does not.

For each ``--m`` (rows per expert, DeepSeek-V3 experts: H = 7168, I = 2048, ``--experts``
experts), the passes of the ``--extra`` backends (``module:Class[@scheme][?key=value]``, as
``epmoe bench experts --extra``; default: the ``cutlass`` backend's INT8 channel int32 and INT8
block passes) on the same rows:

* the device time of each phase of the pass (``epmoe.timing.profile_phases`` over ``--iters``
  passes: ``quantize``, ``gemm1``, ``activation``, ``gemm2``; a GEMM1 with the activation fused
  reports it under ``gemm1``), the passes taking turns for ``--rounds`` rounds;
* the whole pass, median of ``triton.testing.do_bench`` (``--rep-ms``), in turns;
* the GEMM1 input's quantizers alone, per token and per 1x128 group (scales MN-major, as the
  CUTLASS block kernel reads them), in turns.

Medians of the rounds are reported. ``benchmarks/int8_block_gemms.py`` times the GEMMs on their
own; this times them inside the pass. Needs a GPU (``SGLANG_CUTLASS_MOE=1`` and the CUTLASS
headers for the default backends)::

    SGLANG_CUTLASS_MOE=1 python benchmarks/experts_phases.py --out phases.json
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

from epmoe.timing import in_turns, kernel_ms, profile_phases  # noqa: E402

HIDDEN, INTERMEDIATE = 7168, 2048
DEFAULT_EXTRA = (
    "epmoe.experts.cutlass_backend:CutlassBackend@int8_channel_int32",
    "epmoe.experts.cutlass_backend:CutlassBackend@int8_block",
)


def _rows(text: str) -> list[int]:
    try:
        ms = [int(v) for v in text.split(",")]
    except ValueError:
        ms = []
    if not ms or any(m < 1 for m in ms):
        raise argparse.ArgumentTypeError(f"--m={text!r}: comma-separated positive integers")
    return ms


def parse_args(argv):
    p = argparse.ArgumentParser(prog="benchmarks/experts_phases.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="write the JSON here")
    p.add_argument("--m", type=_rows, default=[512, 2048], help="rows per expert, comma-separated (default: 512,2048)")
    p.add_argument("--experts", type=int, default=128, help="experts (default: %(default)s)")
    p.add_argument("--extra", action="append", default=None, metavar="SPEC",
                   help="a backend as module:Class[@scheme][?key=value] (repeatable; default: the cutlass "
                        "backend's int8_channel_int32 and int8_block)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=3, help="rounds in which the passes take turns (>= 1)")
    p.add_argument("--iters", type=int, default=8, help="profiled passes per round (>= 1)")
    p.add_argument("--rep-ms", type=float, default=60.0, help="do_bench repetition time of a whole pass (ms)")
    p.add_argument("--commit", default=None, help="the commit measured (default: git rev-parse HEAD)")
    args = p.parse_args(argv)
    for name in ("experts", "rounds", "iters"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1; got {getattr(args, name)}")
    if not args.rep_ms > 0:  # NaN too
        p.error(f"--rep-ms must be > 0; got {args.rep_ms}")
    args.extra = args.extra or list(DEFAULT_EXTRA)
    repeated = sorted({spec for spec in args.extra if args.extra.count(spec) > 1})
    if repeated:
        p.error(f"--extra {repeated[0]!r} is given more than once; each backend once")
    return args


def medians(samples: dict[str, list]) -> dict:
    """``{name: [per-round value]}`` -> per name the median; per-round dicts -> per key."""
    out = {}
    for name, rounds in samples.items():
        if isinstance(rounds[0], dict):
            keys = dict.fromkeys(k for r in rounds for k in r)  # every round's, in order of appearance
            out[name] = {k: statistics.median(r.get(k, 0.0) for r in rounds) for k in keys}
        else:
            out[name] = statistics.median(rounds)
    return out


def time_passes(passes: dict, args, device: torch.device) -> dict:
    """The passes' phases and whole-pass times, each in turns."""
    phases = in_turns(passes, args.rounds,
                      lambda fn: profile_phases(fn, args.iters, 1, device, collective=False))  # fmt: skip
    totals = in_turns(passes, args.rounds, lambda fn: kernel_ms(fn, rep_ms=args.rep_ms, device=device))
    return {"phases_ms": medians(phases), "total_ms": medians(totals), "total_rounds_ms": totals}


def time_quantizers(x: torch.Tensor, args, device: torch.device) -> dict:
    """GEMM1's input quantizers alone, in turns."""
    from epmoe import ops

    fns = {
        "per_token": lambda: ops.per_token_quant_int8(x),
        "per_group_mn_major": lambda: ops.per_group_quant(x, 128, torch.int8, scale_mn_major=True),
    }
    return medians(in_turns(fns, args.rounds, lambda fn: kernel_ms(fn, rep_ms=args.rep_ms / 2, device=device)))


def table(rows: list[dict]) -> str:
    lines = ["    m backend: whole pass ms (in turns) | phases ms"]
    for row in rows:
        for label, total in row["total_ms"].items():
            ph = "  ".join(f"{k} {v:.3f}" for k, v in row["phases_ms"][label].items())
            lines.append(f"{row['m']:5d} {label}: {total:.3f} | {ph}")
        lines.append("      quantizers alone: " + "  ".join(f"{k} {v:.3f}" for k, v in row["quantizers_ms"].items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/experts_phases.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from epmoe.bench.experts import backend_pass, build_problem, load_extra, uniform_batch

    device = torch.device("cuda")
    problem = build_problem(args.experts, HIDDEN, INTERMEDIATE, device, torch.bfloat16)
    backends = [load_extra(spec) for spec in args.extra]
    labels = [label for label, _ in backends]
    if len(set(labels)) < len(labels):
        print(f"benchmarks/experts_phases.py: --extra {args.extra} name the same backend twice ({labels})", file=sys.stderr)
        return 2
    rows = []
    for i, m in enumerate(args.m):
        batch = uniform_batch(problem, m, device, torch.bfloat16, seed=1000 + i)
        passes = {label: backend_pass(problem, be, m, batch, {}, 1000 + i, 0)[0] for label, be in backends}
        row = {"m": m, **time_passes(passes, args, device), "quantizers_ms": time_quantizers(batch.x, args, device)}
        rows.append(row)
        print(table([row]), flush=True)
        del passes
        torch.cuda.empty_cache()
    report = {**run_record("benchmarks/experts_phases.py", argv, args.commit),
              "experts": args.experts, "hidden": HIDDEN, "intermediate": INTERMEDIATE, "backends": args.extra,
              "rounds": args.rounds, "iters": args.iters, "rep_ms": args.rep_ms, "rows": rows}  # fmt: skip
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
