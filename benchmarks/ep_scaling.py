"""EP scaling on N GPUs of one host: the EP test suite over NCCL, the layer benchmark and DeepEP's own
dispatch + combine in one command and one JSON; the scaling table and plot from one or more JSONs.

    python benchmarks/ep_scaling.py --gpus 8 --num-sms 64 --json ep_scaling_8.json
    python benchmarks/ep_scaling.py --report ep_scaling_2.json ep_scaling_4.json ep_scaling_8.json \\
        --markdown scaling.md --plot scaling.png

The command spawns its N ranks itself (:func:`epmoe.launch.run_ranks`: one process per GPU, NCCL
over 127.0.0.1), as ``epmoe bench layer`` does; it is not started under torchrun. Parts
(``--parts``, both by default; the JSON is rewritten after each, so a later failure keeps the
earlier part's figures):

* ``tests``: ``pytest tests/gpu/test_ep_nccl.py tests/gpu/test_deepep.py`` with
  ``EPMOE_TEST_GPUS=N``: all_to_all over NCCL (torch and auto backends) and DeepEP normal, normal
  with ``normal_max_tokens_per_rank``, low-latency and auto, each scheme x backend (auto, torch)
  against a float64 reference on every rank, CUDA-graph replay, auto mode over the capacity;
  each test's outcome from pytest's JUnit XML.
* ``layer``: ``epmoe bench layer``'s measurement (:func:`epmoe.bench.layer.measure`) on N ranks at
  DeepSeek-V3 shapes (256 experts, top-8, H = 7168, I = 2048, E_loc = 256 / N): prefill 4096
  tokens per rank on DeepEP normal, decode 128 on low-latency, the phases of each forward, the
  schemes in turns (``--rounds``), and on the same layers and batches DeepEP's own dispatch +
  combine (``deep_ep.Buffer`` called directly) against the layer dispatcher's
  (``benchmarks/layer_studies.py``'s :func:`dc_comparison`).

Figures are per slowest rank. Redundant experts are not part of the run: epmoe has no expert
load balancing (every rank holds its num_experts / N experts; see :data:`REDUNDANT_EXPERTS`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # epmoe and benchmarks/ from this checkout, also in the spawned ranks
    sys.path.insert(0, str(ROOT))

from epmoe.bench import layer as bench_layer  # noqa: E402
from benchmarks.provenance import git_commit, git_dirty  # noqa: E402
from epmoe.bench.plotting import check_plot  # noqa: E402

GPU_COUNTS = (2, 4, 8)
"""Ranks of one host the command runs on: DeepEP's intranode normal kernels take 2, 4 or 8
(:data:`epmoe.dispatch.deepep_dispatch.sizing.NORMAL_WORLD_SIZES`; a CPU test keeps them equal)."""
SCHEMES = ("bf16", "int8_channel", "int8_channel_int32", "int8_block", "fp8_block")
"""``int8_channel_int32``: ``int8_channel`` with the int32 accumulator."""
PARTS = ("tests", "layer")
PHASES = ("prefill", "decode")
TEST_FILES = ("tests/gpu/test_ep_nccl.py", "tests/gpu/test_deepep.py")
TEST_GPUS_ENV = "EPMOE_TEST_GPUS"
"""The rank count of the multi-GPU EP tests (read by tests/helpers.py)."""
REDUNDANT_EXPERTS = (
    "not implemented: epmoe has no expert load balancing and no redundant (physical) experts; "
    "every rank holds num_experts / N logical experts"
)
FORMAT = 1


# ---------------------------------------------------------------------------------- arguments
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python benchmarks/ep_scaling.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    p.add_argument("--gpus", type=int, default=None,
                   help=f"N, ranks on this host (one GPU each); allowed: {', '.join(map(str, GPU_COUNTS))}")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    bench_layer.add_arguments(p, standard=False, schemes=SCHEMES)
    p.add_argument("--rounds", type=int, default=5, help="rounds of the schemes taking turns (0: skip them)")
    p.add_argument("--tests-timeout", type=float, default=900.0, help="seconds the tests part may take")
    p.add_argument("--commit", default=None, help="commit to record (default: git rev-parse HEAD of this checkout, with whether its tracked files differ)")
    p.add_argument("--report", nargs="+", default=None, metavar="JSON",
                   help="run nothing: the scaling table (and --markdown / --plot) from these JSONs")
    p.add_argument("--markdown", default=None, help="write the scaling table (Markdown) here")
    p.add_argument("--plot", default=None, help="write the scaling plot (PNG) here (needs the 'plot' extra)")
    return p  # fmt: skip


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Checks and normalizes parsed options; ``p.error`` names the option, its value and what is
    allowed. The machine (GPUs, DeepEP) is checked by :func:`check_machine`."""
    if args.report is not None:
        if args.gpus is not None:
            p.error(f"--report reads JSON files and runs nothing; it takes no --gpus (got --gpus {args.gpus})")
        for path in args.report:
            if not os.path.isfile(path):
                p.error(f"--report {path}: no such file")
        check_plot(p, args.plot)
        return args
    if args.gpus is None:
        p.error(f"--gpus is required (or --report JSON ...); allowed: {list(GPU_COUNTS)}")
    if args.gpus not in GPU_COUNTS:
        p.error(f"--gpus {args.gpus}: DeepEP's intranode kernels run on {list(GPU_COUNTS)} ranks of one host; "
                f"allowed: {list(GPU_COUNTS)} (several hosts: docs/scaling.md)")  # fmt: skip
    parts = [x for x in args.parts.split(",") if x]
    bad = [x for x in parts if x not in PARTS]
    if bad or not parts:
        p.error(f"--parts {args.parts!r}: unknown {bad or 'empty'}; allowed: comma-separated subset of {list(PARTS)}")
    args.parts = [x for x in PARTS if x in parts]
    bench_layer.check_args(p, args, SCHEMES)
    if args.tests_timeout <= 0:
        p.error(f"--tests-timeout={args.tests_timeout}; must be > 0")
    if not args.json:
        p.error("--json PATH is required: where the run's figures go")
    return args


def check_machine(p: argparse.ArgumentParser, args: argparse.Namespace, gpus_here: int, deep_ep_problem: str) -> None:
    """Refuses a run this machine cannot do, before anything starts: fewer CUDA GPUs than
    ``--gpus`` (``gpus_here``: ``torch.cuda.device_count()``), or the layer part without DeepEP
    (``deep_ep_problem``: why ``deep_ep`` does not import, empty when it does)."""
    if gpus_here < args.gpus:
        fits = [n for n in GPU_COUNTS if n <= gpus_here]
        p.error(f"--gpus {args.gpus}: this machine has {gpus_here} CUDA GPU(s) (torch.cuda.device_count()); "
                f"allowed here: {fits or 'none'}")  # fmt: skip
    if "layer" in args.parts and deep_ep_problem:
        p.error(f"--parts {','.join(args.parts)}: the layer part needs DeepEP: {deep_ep_problem} "
                "(--parts tests runs without it; the DeepEP tests then report skipped)")  # fmt: skip


# ---------------------------------------------------------------------------------- the run
def machine(n: int) -> dict:
    """The GPUs, the link between them and the versions that shape the figures."""
    import importlib.metadata as md

    import torch

    out = dict(gpu_names=[torch.cuda.get_device_name(i) for i in range(n)], torch=torch.__version__,
               cuda=torch.version.cuda)  # fmt: skip
    for name in ("triton", "deep_ep", "deep_gemm"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    try:
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # noqa: BLE001 - informative only
        out["nccl"] = None
    try:  # NVLink (NV18) or PCIe between the GPUs: the figures depend on it
        topo = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=30)
        out["topology"] = topo.stdout if topo.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        out["topology"] = None
    out["env"] = {k: os.environ.get(k) for k in ("SGLANG_CUTLASS_MOE", "EPMOE_BACKEND", "EPMOE_DISPATCH", "LD_PRELOAD",
                                                  "NVSHMEM_DISABLE_P2P")}  # fmt: skip
    return out


def parse_junit(path: str) -> list[dict]:
    """Each test case of a pytest JUnit XML file: ``{name, outcome, seconds, message}``, outcome
    one of passed / failed / error / skipped."""
    cases = []
    for tc in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for child in tc:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
                message = child.get("message") or child.text or ""
        cases.append(dict(name=f"{tc.get('classname')}::{tc.get('name')}", outcome=outcome,
                          seconds=float(tc.get("time") or 0.0), message=message[:4000]))  # fmt: skip
    return cases


def run_tests(n: int, timeout_s: float, workdir: str) -> dict:
    """The EP test suite on ``n`` GPUs (pytest in a child process, its output on this console)."""
    junit = os.path.join(workdir, f"ep_tests_{n}.xml")
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", f"--junitxml={junit}", *TEST_FILES]
    env = dict(os.environ, **{TEST_GPUS_ENV: str(n)})
    t0 = time.time()
    # A session of its own: on a timeout the ranks pytest spawned end with it.
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)
    try:
        code = proc.wait(timeout=timeout_s)
        error = None
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        code, error = None, f"pytest did not finish within --tests-timeout={timeout_s:g} s"
    out = dict(command=f"{TEST_GPUS_ENV}={n} " + " ".join(["python", *cmd[1:]]), returncode=code, error=error,
               seconds=time.time() - t0, cases=parse_junit(junit) if os.path.exists(junit) else [])  # fmt: skip
    out["counts"] = {k: sum(c["outcome"] == k for c in out["cases"]) for k in ("passed", "failed", "error", "skipped")}
    return out


def refuse_reference_backend(requested: str, scheme: str, layers: dict) -> str | None:
    """Why a scheme is not timed: ``backend='auto'`` fell back to the torch reference backend
    (nothing faster runs ``scheme`` here; timing it would measure the reference). The same
    answer on every rank: the choice depends on the scheme, the GPU model and the environment."""
    name = layers["normal"].backend.name
    if requested == "auto" and name == "torch":
        hint = ("FP8 needs DeepGEMM (run with LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libstdc++.so.6) or "
                "SGLANG_CUTLASS_MOE=1" if scheme == "fp8_block" else "see epmoe info")  # fmt: skip
        return f"backend='auto' chose the torch reference backend for {scheme}: not timed ({hint})"
    return None


def _rank_main(rank, world, port, args):
    """One rank of the layer part."""
    import functools

    import torch.distributed as dist

    from benchmarks.layer_studies import dc_comparison
    from epmoe import timing

    t0 = time.time()
    device, owner, batches = bench_layer.rank_setup(rank, world, port, args)

    def deepep_own(scheme, phase, mode, layer, batch):
        x, ids, w = batch
        return dc_comparison(owner, layer, x, ids, w, mode, args.iters, args.warmup, device)

    accept = functools.partial(refuse_reference_backend, args.backend)
    res = bench_layer.measure(rank, args, device, owner, batches, accept=accept, extra=deepep_own)
    res["rank_seconds"] = time.time() - t0
    timing.barrier(device)
    owner.close()
    dist.destroy_process_group()
    return res


def summarize(ranks: list[dict]) -> dict:
    """``{phase: {scheme: figures}}`` of the slowest rank, from the layer part's per-rank results.

    * ``layer_ms``: the slowest rank's median forward time in turns (prefill with
      ``normal_max_tokens_per_rank``, no host sync) when the run took turns, else the slowest
      rank's host-synced forward (``timing`` says which); ``tokens_per_s_per_gpu`` from it;
      ``x_bf16``: BF16's ``layer_ms`` over the scheme's;
    * ``dc_share``: dispatch + combine device time over the whole forward, on the rank with the
      slowest host-synced forward (the profiler ranges of that forward);
    * ``deepep_dc_ms`` / ``layer_dc_ms``: DeepEP's own dispatch + combine and the layer
      dispatcher's on the same batch, each timed alone (slowest rank), and
      ``dc_overhead_pct`` = layer / DeepEP - 1; ``_pipelined``: timed as DeepEP's tests time theirs.
    """
    out: dict = {}
    r0 = ranks[0]
    for scheme, entry in r0["schemes"].items():
        for phase, row in entry.items():
            per = [r["schemes"][scheme][phase] for r in ranks]
            turns = [(r.get("interleaved") or {}).get(phase, {}).get(scheme) for r in ranks]
            slow = max(per, key=lambda x: x["layer_ms"])
            if all(turns):
                layer_ms, how = max(t["layer_ms"] for t in turns), "in turns"
            else:
                layer_ms, how = slow["layer_ms"], "alone"
            fig = dict(backend=row["backend"], payload=row.get("payload"), tokens_per_rank=row["tokens"],
                       layer_ms=layer_ms, timing=how, tokens_per_s_per_gpu=row["tokens"] / layer_ms * 1e3)  # fmt: skip
            ph = slow.get("phases_ms") or {}
            if "dispatch" in ph and "combine" in ph:
                fig["dc_share"] = (ph["dispatch"] + ph["combine"]) / slow["layer_ms"]
            if all("deepep_ms" in x and "layer_dc_ms" in x for x in per):
                for suffix, keys in (("", ("dispatch_ms", "combine_ms")),
                                     ("_pipelined", ("dispatch_pipelined_ms", "combine_pipelined_ms"))):  # fmt: skip
                    raw = max(sum(x["deepep_ms"][k] for k in keys) for x in per)
                    ours = max(sum(x["layer_dc_ms"][k] for k in keys) for x in per)
                    fig[f"deepep_dc{suffix}_ms"], fig[f"layer_dc{suffix}_ms"] = raw, ours
                    fig[f"dc{suffix}_overhead_pct"] = 100.0 * (ours / raw - 1.0)
            out.setdefault(phase, {})[scheme] = fig
    for per_scheme in out.values():
        base = per_scheme.get("bf16")
        for fig in per_scheme.values():
            if base is not None:
                fig["x_bf16"] = base["layer_ms"] / fig["layer_ms"]
    return out


def run(args: argparse.Namespace) -> int:
    """The parts asked for on ``args.gpus`` GPUs; the JSON after each; the table last. Exit code
    0 when every part ran and no test failed, else 1."""
    import tempfile

    # a given --commit names the tree that ran (the GPU machine's copy has stale git metadata)
    commit = git_commit(args.commit, fallback=None)
    dirty = None if args.commit else git_dirty()
    doc = dict(kind="ep_scaling", format=FORMAT, date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
               commit=commit, dirty=dirty, gpus=args.gpus, machine=machine(args.gpus), parts=args.parts,
               redundant_experts=REDUNDANT_EXPERTS,
               config=dict(num_experts=bench_layer.E, top_k=bench_layer.K, hidden=bench_layer.H,
                           intermediate=bench_layer.I, local_experts=bench_layer.E // args.gpus,
                           prefill_tokens=args.prefill_tokens, decode_tokens=args.decode_tokens,
                           schemes=args.schemes.split(","), backend=args.backend, iters=args.iters,
                           warmup=args.warmup, rounds=args.rounds, num_sms=args.num_sms))  # fmt: skip
    ok = True
    if "tests" in args.parts:
        with tempfile.TemporaryDirectory(prefix="ep_scaling_") as workdir:
            doc["tests"] = tests = run_tests(args.gpus, args.tests_timeout, workdir)
        ok &= tests["returncode"] == 0 and not tests["counts"]["failed"] and not tests["counts"]["error"]
        bench_layer.write_json(doc, args.json)
    if "layer" in args.parts:
        t0 = time.time()
        ranks, code = bench_layer.launch(_rank_main, args, "the layer part", world=args.gpus)
        doc["layer"] = dict(seconds=time.time() - t0, ranks=ranks, failed=ranks is None)
        if ranks is not None:
            doc["layer"]["skipped"] = ranks[0]["skipped"]
            doc["summary"] = summarize(ranks)
        ok &= ranks is not None
        bench_layer.write_json(doc, args.json)
    write_outputs([doc], args.markdown, args.plot)
    print(report([doc]))
    return 0 if ok else 1


# ---------------------------------------------------------------------------------- report
def load(paths: list[str]) -> list[dict]:
    """The JSONs of ``paths``, one per N: runs of different parts on the same N merge; the same
    part twice for one N is refused (naming both files)."""
    by_n: dict[int, tuple[dict, dict[str, str]]] = {}
    for path in paths:
        with open(path) as f:
            try:
                doc = json.load(f)
            except json.JSONDecodeError as exc:
                raise ValueError(f"--report {path}: not JSON ({exc})") from None
        if not isinstance(doc, dict) or doc.get("kind") != "ep_scaling":
            raise ValueError(f"--report {path}: not a JSON written by benchmarks/ep_scaling.py (no kind='ep_scaling')")
        merged, sources = by_n.setdefault(doc["gpus"], ({}, {}))
        for key in ("tests", "layer"):
            if key in doc and key in sources:
                raise ValueError(f"--report: {sources[key]} and {path} both hold the {key} part for N = {doc['gpus']}")
            if key in doc:
                sources[key] = path
        merged.update({k: v for k, v in doc.items() if k not in merged or k in ("tests", "layer", "summary")})
    return [by_n[n][0] for n in sorted(by_n)]


def _fmt(v, spec: str, suffix: str = "") -> str:
    return "-" if v is None else f"{v:{spec}}{suffix}"


def report(docs: list[dict]) -> str:
    """The scaling table (Markdown) of ``docs`` (one per N, N ascending), with what ran."""
    lines = ["| N | phase | scheme | backend | layer ms | tokens/s per GPU | x BF16 | dispatch+combine share | "
             "layer d+c over DeepEP's (alone / pipelined) |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    notes = []
    for doc in docs:
        n = doc["gpus"]
        for phase in PHASES:
            for scheme, fig in (doc.get("summary") or {}).get(phase, {}).items():
                over = (f"{_fmt(fig.get('dc_overhead_pct'), '+.1f', '%')} / "
                        f"{_fmt(fig.get('dc_pipelined_overhead_pct'), '+.1f', '%')}")  # fmt: skip
                lines.append(
                    f"| {n} | {phase} ({fig['tokens_per_rank']} tokens/rank) | {scheme} | {fig['backend']} | "
                    f"{fig['layer_ms']:.3f} | {fig['tokens_per_s_per_gpu']:,.0f} | {_fmt(fig.get('x_bf16'), '.2f')} | "
                    f"{_fmt(fig.get('dc_share') and 100 * fig['dc_share'], '.0f', '%')} | {over} |"
                )  # fmt: skip
        what = [f"N = {n}: {', '.join(doc.get('machine', {}).get('gpu_names', [])[:1]) or '?'} x {n}, "
                f"commit {doc.get('commit') or '?'}"
                f"{' (dirty)' if doc.get('dirty') and not str(doc.get('commit')).endswith('-dirty') else ''}, "
                f"{doc.get('date', '?')}"]
        tests = doc.get("tests")
        if tests:
            c = tests["counts"]
            what.append(f"tests {c['passed']} passed, {c['failed']} failed, {c['error']} errors, {c['skipped']} skipped"
                        + (f" ({tests['error']})" if tests.get("error") else ""))  # fmt: skip
            what += [f"  {x['outcome']}: {x['name']}: {x['message'][:200]}" for x in tests["cases"]
                     if x["outcome"] != "passed"]  # fmt: skip
        layer = doc.get("layer")
        if layer and layer.get("failed"):
            what.append("layer part failed (see the run's console)")
        for scheme, reason in ((layer or {}).get("skipped") or {}).items():
            what.append(f"  {scheme} not timed: {reason}")
        what.append(f"redundant experts: {doc.get('redundant_experts', REDUNDANT_EXPERTS)}")
        notes.append("\n".join(what))
    legend = ("layer ms: slowest rank (in turns where the run took turns: prefill with normal_max_tokens_per_rank); "
              "share: dispatch + combine device time of the host-synced forward; DeepEP: deep_ep.Buffer called "
              "directly on the same batch (slowest rank, each call alone / pipelined)")  # fmt: skip
    return "\n".join(lines) + "\n\n" + legend + "\n\n" + "\n\n".join(notes)


def plot_series(docs: list[dict]) -> dict[str, dict[str, dict[str, list]]]:
    """``{phase: {scheme: {"n": [...], "tokens_per_s_per_gpu": [...], "x_bf16": [...]}}}``."""
    out: dict = {}
    for doc in docs:
        for phase, per in (doc.get("summary") or {}).items():
            for scheme, fig in per.items():
                s = out.setdefault(phase, {}).setdefault(scheme, {"n": [], "tokens_per_s_per_gpu": [], "x_bf16": []})
                s["n"].append(doc["gpus"])
                s["tokens_per_s_per_gpu"].append(fig["tokens_per_s_per_gpu"])
                s["x_bf16"].append(fig.get("x_bf16"))
    return out


def plot(docs: list[dict], path: str) -> None:
    from epmoe.bench.plotting import pyplot

    plt = pyplot()
    series = plot_series(docs)
    fig, axes = plt.subplots(2, len(PHASES), figsize=(12, 8), squeeze=False)
    for col, phase in enumerate(PHASES):
        for scheme, s in series.get(phase, {}).items():
            axes[0][col].plot(s["n"], s["tokens_per_s_per_gpu"], "o-", label=scheme)
            axes[1][col].plot(s["n"], [float("nan") if v is None else v for v in s["x_bf16"]], "o-", label=scheme)
        axes[0][col].set_title(f"{phase}: tokens/s per GPU (slowest rank)")
        axes[1][col].set_title(f"{phase}: throughput over BF16")
        for ax in (axes[0][col], axes[1][col]):
            ax.set_xscale("log", base=2)
            ax.set_xticks(list(GPU_COUNTS), [str(n) for n in GPU_COUNTS])
            ax.set_xlabel("GPUs (EP size)")
            if series.get(phase):
                ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def write_outputs(docs: list[dict], markdown: str | None, png: str | None) -> None:
    for path in (markdown, png):
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if markdown:
        with open(markdown, "w") as f:
            f.write(report(docs) + "\n")
    if png:
        plot(docs, png)


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = check_args(p, p.parse_args(argv))
    if args.report is not None:
        try:
            docs = load(args.report)
        except ValueError as exc:
            p.error(str(exc))
        write_outputs(docs, args.markdown, args.plot)
        print(report(docs))
        return 0
    import torch

    from epmoe.dispatch.deepep_dispatch.buffer import import_deep_ep

    gpus_here = torch.cuda.device_count() if torch.cuda.is_available() else 0
    check_machine(p, args, gpus_here, import_deep_ep()[1] if "layer" in args.parts else "")
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
