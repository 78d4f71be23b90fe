"""W8A8 INT8 dense linears on DeepSeek-V3 shapes: BF16 cuBLAS vs torch._int_mm vs epmoe.Int8Linear.

One command, one GPU, about two minutes:

    python benchmarks/bench_dense_int8.py --out dense.json --plot dense.png
    SGLANG_CUTLASS_MOE=1 python benchmarks/bench_dense_int8.py ...   # adds the cutlass rows

For each shape (N x K weight) and batch M, side by side in one process:

* ``bf16``: ``torch.matmul`` of bf16 activations and weights (cuBLAS);
* ``int_mm+quant``: what a user has with no extra library: a plain-torch per-token INT8
  quantization, ``torch._int_mm`` (its minimum is 17 rows: smaller batches are padded to 32), both
  scales, back to bf16;
* ``int_mm``: ``torch._int_mm`` alone on already quantized rows (its int32 output, no scales);
* ``epmoe auto / triton / cutlass``: ``Int8Linear.forward`` (activation quantization included),
  ``int8_channel`` with the int32 accumulator; ``cutlass`` only with ``SGLANG_CUTLASS_MOE=1`` where
  it can run (batches the dense plan gives to the small-batch kernel run it, as in the module);
  ``epmoe triton block``: ``int8_block`` (fp32 accumulator).

Three times per cell, because they answer different questions:

* ``us``: ``triton.testing.do_bench`` median (``epmoe.timing.kernel_ms``). It zeroes a 256 MB
  buffer before every call (L2 flush, ~75 us of GPU time) and times each call with events. While
  the host enqueues a call in less than that flush, the result is GPU time; a call whose host side
  takes longer (many small launches, Python work) is timed by its host cost minus the flush's head
  start. An earlier version of this script reported only this number and read it as GPU time:
  every multi-launch path, ``torch._int_mm`` with its plain-torch quantization included, then
  showed the GPU machine's host cost (170-440 us) against a single cuBLAS launch.
* ``graph_us`` (every M): per call of a CUDA graph that replays the call back to back: GPU time
  without host cost, what a CUDA-graph step sees. The ratios the targets are judged by use it.
  (An earlier version timed graphs only up to 1024 rows and judged larger batches by ``us``: on
  the H200 machine, whose host takes 150-350 us to enqueue one epmoe call, the 4096-row cells of
  the narrow layers were then host time, and two backends running the same kernels differed by
  2x from one run to the next.) The variants of a cell are timed **in turns**
  (:func:`graph_turns`): first every variant's graph is captured (``max(2 * copies, 8)`` calls
  rotating over the weight copies below, replayed once untimed after its capture); then
  ``--rounds`` rounds (default 5, in the JSON header as ``rounds``), each replaying every
  variant's graph once, timed by CUDA events around that replay and waited for, the variants in
  the cell's order rotated by one place each round (:func:`epmoe.timing.in_turns`: round ``r``
  starts with the ``r``-th variant, so none is always first). ``graph_us`` is the median over
  the rounds of a variant's us per call; the row also keeps ``graph_us_min``, ``graph_us_max``
  and ``graph_us_rounds`` (its time in each round, in round order: the same index is the same
  round for every variant of the cell). The cell's graphs are freed before the next cell. Why:
  under sustained load the H200 runs at its power cap (700 W), so a kernel's clock depends on
  what ran just before it; when each variant was captured and timed after the other (bf16 first,
  median of 3 replays in a row), "epmoe auto" and "epmoe cutlass", the very same launch, differed
  by 5-9 % at 4096-16384 rows in one run (269 vs 247 us), as much as the margin of the medians
  to their targets.
* ``eager_us`` / ``host_us`` (M <= 4096): per call of back-to-back eager calls (events around the
  loop) and the host's enqueue time per call: eager calls are host-bound wherever ``host_us`` is
  the larger (``host_bound`` on the row; the summary counts them).

``us`` and ``eager_us`` / ``host_us`` are still measured one variant after the other (each
variant's do_bench then its eager loop, bf16 first, before the graphs are captured): they are
not what the targets are judged by, and carry the order's drift described above.

The graph and eager loops rotate over several copies of the weights (enough copies to span 256
MiB, at most 32) so that L2 (50 MB) never holds the weight a call reads; do_bench's flush does
that job for ``us``. Each row carries its ratio to bf16 (per timing), the fraction of the weight-
read floor (weight bytes at 4.3 TB/s) and of INT8 peak (1979 dense TOPS), and two float64 checks
of 8 output rows: ``rel_err_vs_fp64`` against the bf16 inputs' exact product (INT8 rows expect
~1-2 %, the quantization), and ``max_err_vs_dequant`` (max over elements of the error against a
float64 product of the dequantized weight and activations quantized by the project's rule in plain
torch, in units of that row's largest output: bf16 output rounding, at most 2^-8). ``int_mm`` is
checked for exactness."""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks.provenance, epmoe of this checkout
from benchmarks.provenance import git_commit  # noqa: E402
import torch
import torch.nn.functional as F

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
TINY_SHAPES = [("tiny_a", 192, 256), ("tiny_b", 64, 384)]
TINY_MS = [1, 7, 80]
GRAPH_MAX_M = None
"""Largest batch timed as a CUDA graph (``None``: every batch; see the module doc)."""
EAGER_MAX_M = 4096
ROTATE_BYTES = 256 * 2**20
MAX_COPIES = 32
BANDWIDTH = 4.3e12
INT8_PEAK = 1979e12
TARGETS = "ratio to bf16 >= 1.7 for M >= 1024, >= 1.6 for M <= 64, never slower than int_mm+quant"


def _sync():
    torch.cuda.synchronize()


def capture_graph(fns: list, calls: int) -> torch.cuda.CUDAGraph:
    """A CUDA graph of ``calls`` back-to-back calls rotating over ``fns`` (two calls first on a
    side stream, as capture wants), replayed once untimed."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns[:2]:
            f()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()
    graph.replay()
    return graph


def replay_us(graph: torch.cuda.CUDAGraph, calls: int) -> float:
    """us per call of one replay of ``graph`` (``calls`` calls; events around it, waited for)."""
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    graph.replay()
    e1.record()
    _sync()
    return e0.elapsed_time(e1) * 1e3 / calls


def time_graph(fns: list, calls: int) -> float:
    """us per call of a CUDA graph replaying ``calls`` calls (rotating over ``fns``), median of 3
    replays in a row (one implementation alone; this script compares its variants with
    :func:`graph_turns`)."""
    graph = capture_graph(fns, calls)
    return statistics.median(replay_us(graph, calls) for _ in range(3))


def graph_turns(fns: dict, rounds: int, capture, measure) -> dict[str, dict]:
    """Every variant of a cell timed in turns (see the module doc): ``capture(fns[label])`` for
    each label first, then ``rounds`` rounds of ``measure(captured)`` (us per call), one per
    variant a round, in an order rotated every round (:func:`epmoe.timing.in_turns`).

    Returns, per label, ``graph_us`` (the median over rounds), ``graph_us_min``,
    ``graph_us_max`` and ``graph_us_rounds`` (per round, in round order), or ``graph_error``
    where the capture or a replay failed (that variant leaves the turns, the others go on). The
    captured graphs are dropped on return: the caller's next cell starts without them."""
    from epmoe.timing import in_turns

    graphs, out = {}, {}
    for label, group in fns.items():
        try:
            graphs[label] = capture(group)
        except Exception as exc:  # reported per cell, the run goes on
            out[label] = {"graph_error": f"{type(exc).__name__}: {exc}"[:300]}

    def one(label):
        if label in out:
            return None
        try:
            return measure(graphs[label])
        except Exception as exc:  # as above: this variant leaves the turns
            out[label] = {"graph_error": f"{type(exc).__name__}: {exc}"[:300]}
            graphs.pop(label)
            return None

    samples = in_turns({label: label for label in graphs}, rounds, one)
    graphs.clear()
    for label, us in samples.items():
        if label not in out:
            out[label] = dict(graph_us=round(statistics.median(us), 2), graph_us_min=round(min(us), 2),
                              graph_us_max=round(max(us), 2), graph_us_rounds=[round(t, 2) for t in us])  # fmt: skip
    return {label: out[label] for label in fns if label in out}


def _wall_clock_us(fn) -> float:
    """The CPU dry run's stand-in for :func:`replay_us`: us of one call of ``fn``, wall clock."""
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e6


def time_eager(fns: list, calls: int) -> tuple[float, float]:
    """(GPU-clock us per call of ``calls`` back-to-back eager calls, host enqueue us per call)."""
    for f in fns[:2]:
        f()
    _sync()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record()
    t0 = time.perf_counter()
    for i in range(calls):
        fns[i % len(fns)]()
    host = time.perf_counter() - t0
    e1.record()
    _sync()
    return e0.elapsed_time(e1) * 1e3 / calls, host * 1e6 / calls


def ref_codes(x: torch.Tensor, group: int | None) -> torch.Tensor:
    """The activations the INT8 kernels multiply, by the project's rule in plain torch
    (:func:`epmoe.quant.reference.quantize_rows`: fp32 scale ``amax / 127`` correctly rounded, the
    fp32 quotient rounded half to even), dequantized in float64; per row, or per 1 x ``group``.

    Not ``amax / 127.0``: on CUDA, torch divides by a Python number as a multiplication by its
    fp32 reciprocal, which misses the correctly rounded scale by an ulp for ~4% of amax values
    and so moves the codes of near-tie elements (bf16 inputs have many exact ties)."""
    from epmoe.quant.reference import quantize_rows

    m, k = x.shape
    g = k if group is None else group
    q, s = quantize_rows(x, torch.int8, 127.0, group)
    return (q.double().reshape(m, k // g, g) * s.double().unsqueeze(-1)).reshape(m, k)


def int_mm_quant(x: torch.Tensor, wq_t: torch.Tensor, ws_row: torch.Tensor) -> torch.Tensor:
    """What a user writes with plain torch: per-token quantization, ``torch._int_mm``, both scales."""
    m = x.shape[0]
    xf = x.float()
    s = xf.abs().amax(-1, keepdim=True).clamp(min=1e-10) / 127.0
    q = torch.round(xf / s).clamp(-127, 127).to(torch.int8)
    if m <= 16:
        q = F.pad(q, (0, 0, 0, 32 - m))
    return (torch._int_mm(q, wq_t)[:m].float() * s * ws_row).to(x.dtype)


def int_mm_alone(q: torch.Tensor, wq_t: torch.Tensor) -> torch.Tensor:
    return torch._int_mm(q, wq_t)


def _variants(env_cutlass: bool):
    """(label, scheme, accumulator, backend) of the epmoe rows that this machine can run."""
    out = [("epmoe auto", "int8_channel", "int32", "auto"), ("epmoe triton", "int8_channel", "int32", "triton")]
    if env_cutlass:
        out.append(("epmoe cutlass", "int8_channel", "int32", "cutlass"))
    out.append(("epmoe triton block", "int8_block", "fp32", "triton"))
    return out


def _checks(label, out, x8, w64_bf16, deq_ch, deq_blk, q8=None, wq64=None) -> dict:
    """float64 checks of up to 8 output rows (see the module doc)."""
    if label == "int_mm":
        exact = q8.double() @ wq64.t()
        return dict(int_mm_exact=bool(torch.equal(out[: q8.shape[0]].double(), exact)))
    o = out[: x8.shape[0]].double()
    exact = x8.double() @ w64_bf16.t()
    row = {"rel_err_vs_fp64": round(float((o - exact).norm() / exact.norm()), 5)}
    if label.startswith("epmoe") or label == "int_mm+quant":
        block = label.endswith("block")
        ref = ref_codes(x8, 128 if block else None) @ (deq_blk if block else deq_ch).t()
        scale = ref.abs().amax(-1, keepdim=True).clamp(min=1e-30)
        row["max_err_vs_dequant"] = float(((o - ref).abs() / scale).max())
    return row


def run(args) -> dict:
    import triton

    import epmoe
    from epmoe.experts.select import BackendUnavailableError
    from epmoe.kernels.configs import device_name
    from epmoe.kernels.dense_configs import load_dense_table
    from epmoe.linear import SMALL_M_MAX, Int8Linear, _cached_gemm_config
    from epmoe.quant.reference import dequantize_weight, quantize_weight
    from epmoe.quant.schemes import SCHEMES
    from epmoe.timing import kernel_ms

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    env_cutlass = os.environ.get("SGLANG_CUTLASS_MOE") == "1"
    shapes = TINY_SHAPES if args.tiny else [s for s in SHAPES if not args.shapes or s[0] in args.shapes]
    ms = args.m or (TINY_MS if args.tiny else MS)
    rows, refusals, backends = [], {}, {}
    t_start = time.perf_counter()
    for name, n, k in shapes:
        w = (torch.randn(n, k, device=dev, generator=gen) / k**0.5).to(torch.bfloat16)
        copies = max(1, min(MAX_COPIES, -(-ROTATE_BYTES // (n * k))))
        qc, sc = quantize_weight(w.float().unsqueeze(0), SCHEMES["int8_channel"])
        qb, sb = quantize_weight(w.float().unsqueeze(0), SCHEMES["int8_block"])
        wq, ws = qc[0], sc[0]
        deq_ch = dequantize_weight(qc, sc)[0].double()
        deq_blk = dequantize_weight(qb, sb)[0].double()
        w64 = w.double()
        mods = {}
        for label, scheme, acc, backend in _variants(env_cutlass):
            try:
                mod = Int8Linear(k, n, scheme=scheme, accumulator=acc, backend=backend, device=dev)
            except BackendUnavailableError as exc:
                refusals[label] = str(exc)
                continue
            with torch.no_grad():
                mod.weight.copy_(qc[0] if scheme == "int8_channel" else qb[0])
                mod.weight_scale.copy_(sc[0] if scheme == "int8_channel" else sb[0])
            backends[label] = mod.extra_repr().rsplit("backend=", 1)[-1]
            mods[label] = [mod] + [copy.deepcopy(mod) for _ in range(copies - 1)]
        w_copies = [w] + [w.clone() for _ in range(copies - 1)]
        wq_t = [wq.t()] + [wq.clone().t() for _ in range(copies - 1)]
        ws_row = ws.view(1, -1)
        floor_int8 = n * k / BANDWIDTH * 1e6
        for m in ms:
            x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
            x8 = x[:8]
            q_in = torch.randint(-127, 128, (max(m, 32), k), device=dev, dtype=torch.int8, generator=gen)
            fns = {
                "bf16": [lambda w_=w_: torch.matmul(x, w_.t()) for w_ in w_copies],
                "int_mm+quant": [lambda t=t: int_mm_quant(x, t, ws_row) for t in wq_t],
                "int_mm": [lambda t=t: int_mm_alone(q_in, t) for t in wq_t],
            }
            for label, group in mods.items():
                fns[label] = [lambda mod=mod: mod(x) for mod in group]
            cell = {}
            with torch.no_grad():
                for label, group in fns.items():
                    out = group[0]()
                    row = dict(shape=name, N=n, K=k, M=m, variant=label, copies=copies)
                    row.update(_checks(label, out, x8, w64, deq_ch, deq_blk, q_in[:8], wq.double()))
                    del out
                    # do_bench median on CUDA (a wall-clock median on CPU, the dry run).
                    row["us"] = round(kernel_ms(group[0], rep_ms=args.rep, warmup_ms=args.warmup, device=dev) * 1e3, 2)
                    if cuda and m <= EAGER_MAX_M:
                        eager, host = time_eager(group, max(2 * copies, 8))
                        row["eager_us"], row["host_us"] = round(eager, 2), round(host, 2)
                    cell[label] = row
                if (GRAPH_MAX_M is None or m <= GRAPH_MAX_M) and not args.no_graph:
                    # Every variant's graph captured, then replayed in turns (the module doc); on
                    # CPU (the dry run) the turns time one wall-clock call instead of a replay.
                    calls = max(2 * copies, 8)
                    if cuda:
                        turns = graph_turns(fns, args.rounds, lambda g: capture_graph(g, calls),
                                            lambda graph: replay_us(graph, calls))  # fmt: skip
                    else:
                        turns = graph_turns(fns, args.rounds, lambda g: g[0], _wall_clock_us)
                    for label, got in turns.items():
                        cell[label].update(got)
                    del turns
                    if cuda:
                        torch.cuda.empty_cache()  # the cell's graph pools, freed on graph_turns' return
            base = {key: cell["bf16"][key] for key in ("us", "graph_us", "eager_us") if key in cell["bf16"]}
            for label, row in cell.items():
                if "graph_us" in row and "host_us" in row:
                    row["host_bound"] = row["host_us"] > row["graph_us"]
                weight_floor = floor_int8 * (2 if label == "bf16" else 1)
                for key in ("us", "graph_us", "eager_us"):
                    if key in row:
                        row[f"ratio_{key}"] = round(base[key] / row[key], 3) if key in base else None
                        row[f"floor_fraction_{key}"] = round(weight_floor / row[key], 3)
                best = min(row.get("graph_us", row["us"]), row["us"])
                row["int8_peak_fraction"] = round(2 * m * n * k / (best * 1e-6) / INT8_PEAK, 3)
                if label.startswith("epmoe"):
                    row.update(path_of(mods[label][0], m, _cached_gemm_config))
            cell = list(cell.values())
            rows.extend(cell)
            show = {r["variant"]: r.get("graph_us", r["us"]) for r in cell}
            print(f"{name:15s} M={m:6d} " + " ".join(f"{v.replace('epmoe ', '')}={t:.1f}" for v, t in show.items())
                  + f"  [{time.perf_counter() - t_start:.0f} s]", flush=True)  # fmt: skip
            del x, q_in, fns
        del mods, w, w_copies, wq_t, deq_ch, deq_blk, w64
        if cuda:
            torch.cuda.empty_cache()
    return dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        commit=git_commit(args.commit), gpu=torch.cuda.get_device_name(dev) if cuda else "cpu (dry run)",
        torch=torch.__version__,
        triton=triton.__version__, epmoe=getattr(epmoe, "__version__", "unknown"),
        command=" ".join([os.path.basename(sys.executable), *sys.argv]),
        sglang_cutlass_moe=os.environ.get("SGLANG_CUTLASS_MOE"), warmup_ms=args.warmup, rep_ms=args.rep,
        rounds=None if args.no_graph else args.rounds,
        rotate_bytes=ROTATE_BYTES, max_copies=MAX_COPIES, graph_max_m=GRAPH_MAX_M, eager_max_m=EAGER_MAX_M,
        small_m_max=SMALL_M_MAX, dense_table=bool(load_dense_table(device_name(dev))) if cuda else False,
        bandwidth_Bps=BANDWIDTH, int8_peak_ops=INT8_PEAK, targets=TARGETS,
        refusals=refusals, backends=backends, seconds=round(time.perf_counter() - t_start, 1), rows=rows,
        summary=summary(rows),
    )  # fmt: skip


PATHS = {"small_m": "small-batch kernel", "triton": "triton tiled", "cutlass": "cutlass", "tiled": None}


def path_of(mod, m: int, gemm_config) -> dict:
    """``{"path", "config"}`` of what ``mod`` runs at ``m`` rows (:meth:`Int8Linear.plan`, the
    forward's own answer): the kernel, and its launch where it has one."""
    kernel, launch = mod.plan(m)
    out = {"path": PATHS.get(kernel) or mod.backend_name}
    if launch is not None:
        out["config"] = launch.to_dict()
    elif kernel == "triton" or (kernel == "tiled" and mod.backend_name == "triton"):
        dev = mod.weight.device
        out["config"] = gemm_config(mod.scheme, mod.accumulator, mod.out_features, mod.in_features, m, dev).to_dict()
    return out


def summary(rows: list[dict], bandwidth: float = BANDWIDTH) -> dict:
    """Per variant: median and worst ratio to bf16 for M <= 64 and M >= 1024 (graph time, and
    do_bench for reference), in how many cells it is slower than int_mm+quant (graph time where
    measured) and in how many its eager calls are host-bound. The targets are judged on the
    graph-time medians (``target_*_met``) and on every cell (``every_cell_*_met``). Under ``bf16``:
    :func:`at_bf16_fixed_cost`, the yardstick of the M <= 64 target."""
    out = {}
    cells = [r for r in rows if "us" in r]

    def t(r):
        return r.get("graph_us", r["us"])

    ref = {(r["shape"], r["M"]): t(r) for r in cells if r["variant"] == "int_mm+quant"}
    bf16 = {(r["shape"], r["M"]): r for r in cells if r["variant"] == "bf16"}
    for v in sorted({r["variant"] for r in cells} - {"bf16"}):
        rs = [r for r in cells if r["variant"] == v]
        d, exact = {}, {}
        for key, sel in (("graph_m_le_64", lambda r: r["M"] <= 64),
                         ("do_bench_m_le_64", lambda r: r["M"] <= 64),
                         ("graph_m_ge_1024", lambda r: r["M"] >= 1024),
                         ("do_bench_m_ge_1024", lambda r: r["M"] >= 1024)):  # fmt: skip
            # Ratios from the times, not the rows' rounded ratio fields: a median at a target's
            # edge (1.6995 against 1.7) must not be judged met by its rounding.
            field = "graph_us" if key.startswith("graph") else "us"
            base = [(bf16.get((r["shape"], r["M"]), {}).get(field), r.get(field)) for r in rs if sel(r)]
            vals = [b / x for b, x in base if b and x]
            if vals:
                exact[key] = (statistics.median(vals), min(vals))
                d[f"median_ratio_{key}"] = round(exact[key][0], 4)
                d[f"min_ratio_{key}"] = round(exact[key][1], 4)
        if v != "int_mm+quant" and ref:
            d["slower_than_int_mm_quant"] = sum(t(r) > ref[(r["shape"], r["M"])] for r in rs if (r["shape"], r["M"]) in ref)
        d["host_bound_cells"] = sum(bool(r.get("host_bound")) for r in rs)
        if v.startswith("epmoe"):
            # The targets on GPU time (graph replays): medians, and every cell.
            for key, bar in (("m_le_64", 1.6), ("m_ge_1024", 1.7)):
                if f"graph_{key}" in exact:
                    d[f"target_{key}_met"] = exact[f"graph_{key}"][0] >= bar
                    d[f"every_cell_{key}_met"] = exact[f"graph_{key}"][1] >= bar
            if "slower_than_int_mm_quant" in d:
                d["target_never_slower_than_int_mm_quant_met"] = d["slower_than_int_mm_quant"] == 0
        d["cells"] = len(rs)
        out[v] = d
    fixed = at_bf16_fixed_cost(list(bf16.values()), bandwidth)
    if fixed:
        out["bf16"] = fixed
    return out


def at_bf16_fixed_cost(bf16_rows: list[dict], bandwidth: float = BANDWIDTH) -> dict:
    """What the M <= 64 target asks against what a single-kernel INT8 linear could reach: per cell,
    the ratio an INT8 linear would have if it cost BF16's graph time minus half BF16's weight-read
    floor (half the weight bytes at ``BANDWIDTH``, the same time beside that read: launch, ramp,
    tail, activations, output), ``bf16_us / (bf16_us - N K / bandwidth)``; its median and range
    (``bandwidth``: the result's ``bandwidth_Bps``; a cell whose BF16 time is not above that read
    is left out).
    Only up to 64 rows, where the weight read is what INT8 halves. Not a bound (a kernel may cost
    less beside its read than cuBLAS's), a yardstick: the INT8 path runs a quantizer and a GEMM
    (and a split-K reduction) where BF16 runs one kernel."""
    cells = [(r["graph_us"], r["N"] * r["K"] / bandwidth * 1e6)
             for r in bf16_rows if r["M"] <= 64 and r.get("graph_us") and "N" in r and "K" in r]
    vals = [us / (us - read) for us, read in cells if us > read]
    if not vals:
        return {}
    return {"median_ratio_at_bf16_fixed_cost_graph_m_le_64": round(statistics.median(vals), 4),
            "min_ratio_at_bf16_fixed_cost_graph_m_le_64": round(min(vals), 4),
            "max_ratio_at_bf16_fixed_cost_graph_m_le_64": round(max(vals), 4)}


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if "us" in r and r["variant"] not in ("bf16", "int_mm")]
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    cols = (len(shapes) + 1) // 2
    fig, axes = plt.subplots(2, cols, figsize=(4.2 * cols, 7.5), squeeze=False)
    for ax, shape in zip(axes.flat, shapes):
        rs = [r for r in rows if r["shape"] == shape]
        for i, v in enumerate(dict.fromkeys(r["variant"] for r in rs)):
            color = f"C{i}"
            pts = [(r["M"], r["ratio_us"]) for r in rs if r["variant"] == v]
            ax.plot(*zip(*pts), marker="o", color=color, label=f"{v.replace('epmoe ', '')} (do_bench)")
            g = [(r["M"], r["ratio_graph_us"]) for r in rs if r["variant"] == v and r.get("ratio_graph_us")]
            if g:
                ax.plot(*zip(*g), marker="x", ls="--", color=color, label=f"{v.replace('epmoe ', '')} (graph)")
        ax.set_xscale("log", base=2)
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.axhline(1.6, color="gray", lw=0.5, ls=":")
        ax.set_title(f"{shape} ({rs[0]['K']}->{rs[0]['N']})")
        ax.set_xlabel("M")
        ax.set_ylabel("speed-up over BF16")
    axes.flat[0].legend(fontsize=6)
    fig.suptitle(f"W8A8 INT8 dense linears, {result['gpu']}, {result['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(result: dict) -> str:
    """The short table printed last, per shape and M: us of bf16, int_mm+quant and each epmoe
    variant (CUDA-graph replay where measured, else do_bench), each epmoe variant's speed-up over
    bf16 and over int_mm+quant, and its fraction of the INT8 weight-read floor."""
    rows = [r for r in result["rows"] if "us" in r and r["variant"] != "int_mm"]
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    epmoe = [v for v in variants if v.startswith("epmoe")]

    def t(r):
        return r.get("graph_us", r["us"])

    head = f"{'shape':15s} {'M':>6s} " + " ".join(f"{v.replace('epmoe ', '')[:13]:>13s}" for v in variants)
    head += "".join(f" | {v.replace('epmoe ', '')[:12]:>12s} x bf16  x i_mm  floor" for v in epmoe)
    lines = [head]
    for key in dict.fromkeys((r["shape"], r["M"]) for r in rows):
        by = {r["variant"]: r for r in rows if (r["shape"], r["M"]) == key}
        cells = [f"{'-':>13s}" if by.get(v) is None else f"{t(by[v]):13.1f}" for v in variants]
        line = f"{key[0]:15s} {key[1]:6d} " + " ".join(cells)
        for v in epmoe:
            r, b, i = by.get(v), by.get("bf16"), by.get("int_mm+quant")
            if r is None:
                line += f" | {'-':>12s}"
                continue
            floor = r.get("floor_fraction_graph_us", r.get("floor_fraction_us"))
            line += (f" | {'':12s} {t(b) / t(r) if b else float('nan'):6.2f} {t(i) / t(r) if i else float('nan'):6.2f}"
                     f" {floor:6.2f}")  # fmt: skip
        lines.append(line)
    graphs = "every M" if GRAPH_MAX_M is None else f"M <= {GRAPH_MAX_M}, do_bench median above"
    turns = f", median of {result['rounds']} rounds in turns" if result.get("rounds") else ""
    lines.append(f"(us per call: CUDA-graph replay for {graphs}{turns} (do_bench where no graph ran); x bf16 / "
                 "x i_mm: speed-up over bf16 and over int_mm+quant; floor: INT8 weight-read floor / time)")
    return "\n".join(lines)


def resummarize(path: Path) -> int:
    """``--summarize``: the summary of ``path`` derived again from its rows by this version of
    :func:`summary` (fields added since it was measured), the rows and header untouched."""
    result = json.loads(path.read_text())
    if not isinstance(result, dict) or not isinstance(result.get("rows"), list):
        raise SystemExit(f"--summarize {path}: not a result of this script (no 'rows' list)")
    result["summary"] = summary(result["rows"], result.get("bandwidth_Bps", BANDWIDTH))
    path.write_text(json.dumps(result, indent=1))
    print(json.dumps(result["summary"], indent=1))
    print(f"rewrote the summary of {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench_dense_int8.json", help="JSON result path")
    p.add_argument("--plot", default=None, help="also write a PNG of the ratios to this path")
    p.add_argument("--commit", default=None, help="commit to record (default: git rev-parse HEAD)")
    p.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph timings")
    p.add_argument("--shapes", nargs="*", default=None, help=f"subset of {[s[0] for s in SHAPES]}")
    p.add_argument("--m", type=int, nargs="*", default=None, help=f"batch sizes (default {MS})")
    p.add_argument("--rounds", type=int, default=5,
                   help="rounds of the CUDA-graph turns: each replays every variant of the cell once (default 5)")
    p.add_argument("--warmup", type=int, default=2, help="do_bench warmup, ms (default 2)")
    p.add_argument("--rep", type=int, default=8, help="do_bench repetition window, ms (default 8)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: a dry run of the script's logic (wall-clock times; the graph turns time one "
                   "call per turn, no graphs; use with --tiny)")
    p.add_argument("--tiny", action="store_true", help=f"tiny shapes {TINY_SHAPES} and M {TINY_MS} instead")
    p.add_argument("--summarize", metavar="JSON", default=None,
                   help="measure nothing: recompute the summary of this earlier result from its rows and rewrite it")
    args = p.parse_args(argv)
    if args.summarize:
        return resummarize(Path(args.summarize))
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA GPU here (--device cpu --tiny dry-runs the script)")
    if args.rounds < 1:
        p.error(f"--rounds {args.rounds}: at least 1")
    bad = set(args.shapes or ()) - {s[0] for s in SHAPES}
    if bad:
        p.error(f"--shapes {sorted(bad)}: allowed: {[s[0] for s in SHAPES]}")
    result = run(args)
    Path(args.out).write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(result, args.plot)
        print(f"wrote {args.plot}")
    print(json.dumps(result["summary"], indent=1))
    print(f"wrote {args.out} ({result['seconds']} s)")
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
