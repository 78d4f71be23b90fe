"""A decode step's glue at one token with programmatic dependent launch on and off, in rounds.

    SGLANG_CUTLASS_MOE=1 python benchmarks/glue_rounds.py glue.json --rounds 3

Runs ``benchmarks/compile_decode.py --modes layer_graph,experts_graph --batches 1`` (the MoE
layer alone captured in a CUDA graph against the experts pass alone, DeepSeek-V3 shapes) once per
setting and round, ``EPMOE_PDL=1`` then ``0`` in each round, each in its own process (the variable
is read at each launch, but a process keeps its compiled kernels and its allocator state; separate
processes give both settings the same start). Alternating rounds spread the machine's drift over
both settings. Writes one JSON: every run's rows, and per scheme and setting the ratio of each
round (layer graph / experts graph), their median and in how many rounds the issue's target (at
most ``TARGET``) held. ``--device cpu --tiny`` is a dry run of the same logic.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.provenance import git_commit  # noqa: E402

TARGET = 1.05
"""Layer graph / experts graph at one token: the glue adds at most 5 % (issue 26)."""
SETTINGS = ("1", "0")
SCRIPT = Path(__file__).resolve().parent / "compile_decode.py"


def run_once(out: Path, pdl: str, args) -> dict:
    """One ``compile_decode.py`` process with ``EPMOE_PDL=pdl``; its JSON."""
    cmd = [sys.executable, str(SCRIPT), str(out), "--schemes", args.schemes, "--batches", "1",
           "--modes", "layer_graph,experts_graph", "--rep-ms", str(args.rep_ms), "--device", args.device,
           "--commit", git_commit(args.commit)]  # fmt: skip
    if args.tiny:
        cmd.append("--tiny")
    env = {**os.environ, "EPMOE_PDL": pdl}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} (EPMOE_PDL={pdl}) failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return json.loads(out.read_text())


def ratios(result: dict) -> dict[str, tuple[float, float, float]]:
    """``{scheme: (layer graph us, experts graph us, ratio)}`` of one run's batch-1 rows."""
    ms = {(r["scheme"], r["mode"]): r["ms"] for r in result["rows"] if r["batch"] == 1 and r.get("ms")}
    out = {}
    for (scheme, mode), layer in ms.items():
        experts = ms.get((scheme, "experts_graph"))
        if mode == "layer_graph" and experts:
            out[scheme] = (round(layer * 1e3, 3), round(experts * 1e3, 3), round(layer / experts, 5))
    return out


def summarize(rows: list[dict]) -> dict:
    """Per ``"<scheme> EPMOE_PDL=<setting>"``: the rounds' ratios, their median, rounds at or
    under :data:`TARGET`."""
    groups: dict[str, list[float]] = {}
    for r in rows:
        groups.setdefault(f"{r['scheme']} EPMOE_PDL={r['EPMOE_PDL']}", []).append(r["ratio"])
    return {key: dict(ratios=v, median=round(statistics.median(v), 5),
                      target_met_in=f"{sum(x <= TARGET for x in v)} of {len(v)} rounds") for key, v in groups.items()}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="JSON results path")
    p.add_argument("--rounds", type=int, default=3, help="rounds, each EPMOE_PDL=1 then 0 (default 3)")
    p.add_argument("--schemes", default="int8_channel,fp8_block,bf16", help="comma-separated, passed on")
    p.add_argument("--rep-ms", type=float, default=50.0, help="do_bench repetition time per measurement")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="tiny sizes (a dry run)")
    p.add_argument("--commit", default=None, help="commit to record (default: git rev-parse HEAD)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: at least 1")
    rows, meta = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(1, args.rounds + 1):
            for pdl in SETTINGS:
                result = run_once(Path(tmp) / f"r{r}-pdl{pdl}.json", pdl, args)
                meta = meta or {k: result.get(k) for k in ("device", "torch", "triton", "sizes")}
                got = ratios(result)
                for scheme, (layer, experts, ratio) in got.items():
                    rows.append(dict(run=f"round {r}", EPMOE_PDL=pdl, scheme=scheme, batch=1, layer_graph_us=layer,
                                     experts_graph_us=experts, ratio=ratio, date=result.get("date")))  # fmt: skip
                print(f"round {r} EPMOE_PDL={pdl}: " + " ".join(f"{s}={v[2]:.4f}" for s, v in got.items()), flush=True)
    out = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               commit=git_commit(args.commit), **meta, sglang_cutlass_moe=os.environ.get("SGLANG_CUTLASS_MOE"),
               command=" ".join([os.path.basename(sys.executable), *sys.argv]), target=TARGET,
               summary=summarize(rows), rows=rows)  # fmt: skip
    Path(args.out).write_text(json.dumps(out, indent=1))
    for key, s in out["summary"].items():
        print(f"{key:28s} {' '.join(f'{x:.4f}' for x in s['ratios'])}  median {s['median']:.4f}  <= {TARGET}: {s['target_met_in']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
