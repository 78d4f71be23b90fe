"""Decode step of a DeepSeek-V3-shaped decoder block on one GPU: eager vs torch.compile (default and
reduce-overhead) vs a manual CUDA graph, per scheme and batch, against the experts pass alone in a
CUDA graph (what the glue and the host add on top of the expert GEMMs).

The block: RMSNorm -> attention stand-in (two dense bf16 linears, residual) -> RMSNorm -> fp32 router
-> DeepEPMoELayer (128 local experts, top-8, dispatch='local') + one shared expert (bf16 MLP),
residual. Sizes H=7168, I=2048, shared I=2048. Schemes: bf16 and int8_channel on the Triton backend,
fp8_block on the CUTLASS backend (needs SGLANG_CUTLASS_MOE=1 and the CUTLASS headers; skipped with
the reason otherwise; DeepGEMM is not used).

Per scheme and batch, medians of epmoe.timing.kernel_ms (triton's do_bench; a captured graph is
timed by replaying it):

* ``eager``: the block's forward;
* ``compiled``: ``torch.compile(block, fullgraph=True, dynamic=False)`` (one compile per batch size);
* ``reduce_overhead``: the same with ``mode="reduce-overhead"`` (Inductor's CUDA graphs);
* ``graph``: the eager forward captured in a ``torch.CUDAGraph`` and replayed;
* ``layer_graph``: the MoE layer's forward alone (routing, scatter, experts, gather) captured; a
  decode step of at most 128 (token, slot) pairs takes the one-launch decode prep (routing, layout,
  scatter and quantization together, ``DeepEPMoELayer(decode_prep=...)``);
* ``layer_graph_separate``: the same with ``decode_prep=False``: the separate routing, quantizer
  and layout-and-scatter launches, for the prep's gain in the same run;
* ``experts_graph``: ``layer.backend.run_contiguous`` alone on the prepared batch, captured.

Ratios: each graphed / compiled step against ``experts_graph`` (the target: glue and host add at most
5 % -- ``layer_graph`` is the measure of the layer's own glue; the block adds its dense parts) and
eager against the best graphed step at batch 1 (target >= 1.3x).

The MoE layers run with ``validate=False`` (an engine's decode step reads nothing back for checks).

Run (one H200, about 2.5 minutes: ``--budget-s`` (default 40) bounds each scheme's compiles on
its own, so a slow scheme cannot spend a later one's share; CUDA-graph mode first, batches in the
order given, and a compile that would start past its scheme's budget is skipped, its row saying so):

    SGLANG_CUTLASS_MOE=1 python benchmarks/compile_decode.py results.json --plot results.png

The glue alone (no compiles; well under a minute):

    SGLANG_CUTLASS_MOE=1 python benchmarks/compile_decode.py glue.json --schemes int8_channel,fp8_block,bf16 \
        --batches 1,8 --modes layer_graph,layer_graph_separate,experts_graph --rep-ms 50

``--kernels-batch 1`` also lists the layer's GPU kernels per step (names, launches, device us): what
the glue is made of.

CPU dry run of everything but the GPU paths (torch backend, aot_eager, tiny sizes):

    python benchmarks/compile_decode.py /tmp/dry.json --device cpu --tiny
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shlex
import sys
from pathlib import Path
import time

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks.provenance, epmoe of this checkout
from benchmarks.provenance import git_commit  # noqa: E402
import torch
import torch.nn.functional as F
from torch import nn

from epmoe import DeepEPMoELayer
from epmoe.timing import kernel_ms

SCHEMES = ("bf16", "int8_channel", "fp8_block")
BACKENDS = {"bf16": "triton", "int8_channel": "triton", "fp8_block": "cutlass"}
BATCHES = (1, 8, 32, 128)
MODES = ("eager", "compiled", "reduce_overhead", "graph", "layer_graph", "layer_graph_separate", "experts_graph")
FULL = dict(hidden=7168, inter=2048, experts=128, top_k=8, shared_inter=2048)
TINY = dict(hidden=256, inter=128, experts=8, top_k=2, shared_inter=128)


class DecoderBlock(nn.Module):
    """A decode step's worth of a DeepSeek-V3 decoder layer: an attention stand-in (two dense
    linears), then the MoE block (fp32 router, routed experts in ``DeepEPMoELayer``, one shared
    expert), each with a pre-norm and a residual."""

    def __init__(self, hidden, inter, experts, top_k, shared_inter, *, quant, backend, device, dtype=torch.bfloat16,
                 **layer_kwargs):  # fmt: skip
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.norm1, self.norm2 = nn.RMSNorm(hidden, **kw), nn.RMSNorm(hidden, **kw)
        self.q_proj = nn.Linear(hidden, hidden, bias=False, **kw)
        self.o_proj = nn.Linear(hidden, hidden, bias=False, **kw)
        self.gate = nn.Linear(hidden, experts, bias=False, device=device)
        self.experts = DeepEPMoELayer(experts, top_k, hidden, inter, quant=quant, backend=backend, dispatch="local",
                                      device=device, params_dtype=dtype, **layer_kwargs)  # fmt: skip
        self.shared_gate_up = nn.Linear(hidden, 2 * shared_inter, bias=False, **kw)
        self.shared_down = nn.Linear(shared_inter, hidden, bias=False, **kw)

    def moe(self, y: torch.Tensor) -> torch.Tensor:
        gate, up = self.shared_gate_up(y).chunk(2, dim=-1)
        return self.experts(y, self.gate(y.float())) + self.shared_down(F.silu(gate) * up)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.o_proj(F.silu(self.q_proj(self.norm1(x))))
        return h + self.moe(self.norm2(h))


@torch.no_grad()
def fill_random(block: DecoderBlock, seed: int = 0) -> None:
    """Random weights of plausible magnitude in every parameter, the experts' in their storage
    dtype (codes and scales drawn directly: nothing here measures accuracy against a float model),
    a few experts at a time so that no full-size fp32 copy exists."""
    dev = block.experts.w13_weight.device
    g = torch.Generator(device=dev).manual_seed(seed)
    for name, p in block.named_parameters():
        for chunk in p.split(8) if p.dim() == 3 else (p,):
            if chunk.dtype == torch.int8:
                chunk.copy_(torch.randint(-127, 128, chunk.shape, device=dev, dtype=torch.int8, generator=g))
            elif chunk.dtype == torch.float8_e4m3fn:
                chunk.copy_((torch.randn(chunk.shape, device=dev, generator=g) * 64).clamp(-448, 448).to(chunk.dtype))
            elif "scale" in name:
                # int8 codes ~U(-127, 127) / e4m3 ~N(0, 64) times this: weights of ~0.01-0.02.
                chunk.copy_(torch.full(chunk.shape, 1e-4 if block.experts.scheme.qdtype == torch.int8 else 3e-4, device=dev))
            elif "norm" in name:
                chunk.fill_(1.0)
            else:
                fan_in = chunk.shape[-1]
                chunk.copy_(torch.randn(chunk.shape, device=dev, generator=g) / math.sqrt(fan_in))


def captured(fn, device):
    """``fn`` captured in a CUDA graph after two eager warm-up calls on a side stream; returns the
    graph (replay it) and the output tensor the replays write."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def experts_pass(layer: DeepEPMoELayer, y: torch.Tensor, logits: torch.Tensor):
    """``(fn, batch)``: the backend's experts pass alone on the batch the layer's forward would
    build for ``y`` (by the decode prep, or routed, dispatched and scattered, here, outside what is
    timed)."""
    backend = layer.backend
    # The layer's own layout: sizes, alignment, scale layout.
    if layer._uses_prep(y, logits):
        batch = layer._prep_batch(y, logits)[0]
    else:
        ids, w = layer.route(logits)
        batch = layer._contiguous_batch(layer.dispatcher.dispatch(y, ids, w))
    weights = layer.backend.prepare_weights(layer.expert_weights())
    return (lambda: backend.run_contiguous(batch, weights, y.dtype)), batch


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", help="JSON results path")
    p.add_argument("--schemes", default=",".join(SCHEMES), help=f"comma-separated, of {list(SCHEMES)}")
    p.add_argument("--batches", default=",".join(map(str, BATCHES)), help="comma-separated token counts")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {list(MODES)}")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help=f"tiny sizes {TINY} (a dry run)")
    p.add_argument("--rep-ms", type=float, default=100.0, help="do_bench repetition time per measurement")
    p.add_argument("--budget-s", type=float, default=40.0,
                   help="seconds of compiles per scheme (reduce-overhead first, then default mode; batches in the "
                        "order given): a compile that would start past its scheme's budget is skipped (its row says so)")
    p.add_argument("--compile-backend", default=None, help="torch.compile backend (default: inductor on CUDA, aot_eager on CPU)")
    p.add_argument("--commit", default=None, help="commit to record (default: git rev-parse HEAD of this checkout)")
    p.add_argument("--plot", default=None, help="also draw the table into this image (matplotlib)")
    p.add_argument("--prep-warps", default="",
                   help="also time layer_graph with the decode prep's kernel on each of these warp counts "
                        "(comma-separated; epmoe.kernels.prep.PREP_WARPS), into the JSON's 'prep_warps'")
    p.add_argument("--kernels-batch", type=int, default=None,
                   help="also list the GPU kernels of the MoE layer's eager forward at this batch (torch.profiler, "
                        "per step: count and device us per kernel name), per scheme, into the JSON's 'kernels'")
    args = p.parse_args(argv)
    args.schemes = [s for s in args.schemes.split(",") if s]
    args.batches = [int(b) for b in args.batches.split(",") if b]
    args.modes = [m for m in args.modes.split(",") if m]
    args.prep_warps = [int(w) for w in args.prep_warps.split(",") if w]
    if any(w < 1 or w & (w - 1) or w > 16 for w in args.prep_warps):
        p.error(f"--prep-warps: {args.prep_warps}; each must be a power of two in [1, 16]")
    for name, got, allowed in (("--schemes", args.schemes, SCHEMES), ("--modes", args.modes, MODES)):
        bad = [v for v in got if v not in allowed]
        if bad:
            p.error(f"{name}: {bad} not in {list(allowed)}")
    if any(b < 1 for b in args.batches):
        p.error(f"--batches: {args.batches}; each must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available here (use --device cpu --tiny for a dry run)")
    if args.plot:
        from epmoe.bench.plotting import check_plot

        check_plot(p, args.plot)
    return args


class Runner:
    """Times the modes of one scheme's block at each batch; keeps the rows."""

    def __init__(self, args, block: DecoderBlock, scheme: str, started: float):
        self.args, self.block, self.scheme, self.started = args, block, scheme, started
        self.device = torch.device(args.device)
        self.cuda = self.device.type == "cuda"
        self.compiler = args.compile_backend or ("inductor" if self.cuda else "aot_eager")
        self.compiled: dict[str, object] = {}
        self.rows: list[dict] = []
        self.warps_rows: list[dict] = []

    def row(self, batch, mode, ms=None, skipped=None, **extra):
        r = dict(scheme=self.scheme, backend=self.block.experts.backend.name, batch=batch, mode=mode, ms=ms,
                 skipped=skipped, **extra)  # fmt: skip
        self.rows.append(r)
        shown = f"{ms:9.4f} ms" if ms is not None else f"skipped: {skipped}"
        print(f"{self.scheme:13s} T={batch:4d} {mode:16s} {shown} {extra if extra else ''}", flush=True)

    def time(self, fn) -> float:
        return kernel_ms(fn, rep_ms=self.args.rep_ms, device=self.device)

    def compiled_fn(self, mode: str):
        if mode not in self.compiled:
            kw = dict(fullgraph=True, dynamic=False, backend=self.compiler)
            if mode == "reduce_overhead":
                kw["mode"] = "reduce-overhead"
            self.compiled[mode] = torch.compile(self.block, **kw)
        return self.compiled[mode]

    def guarded(self, t: int, mode: str, fn) -> None:
        """Run one measurement; a failure is recorded as a skipped row with its error, and the
        other measurements go on."""
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - reported in the row, never hidden
            self.row(t, mode, skipped=f"error: {type(exc).__name__}: {str(exc)[:300]}")

    def inputs(self, t: int) -> torch.Tensor:
        g = torch.Generator(device=self.device).manual_seed(1000 + t)
        return torch.randn(t, self.block.q_proj.in_features, device=self.device, generator=g).to(torch.bfloat16)

    @torch.no_grad()
    def cheap_modes(self, t: int) -> None:
        """Every mode that compiles nothing: eager, the captured graphs, the experts pass."""
        a, block, dev = self.args, self.block, self.device
        x = self.inputs(t)
        ref = block(x)
        if "eager" in a.modes:
            self.guarded(t, "eager", lambda: self.row(t, "eager", self.time(lambda: block(x))))
        for mode in ("graph", "layer_graph", "layer_graph_separate"):
            if mode in a.modes and not self.cuda:
                self.row(t, mode, skipped="needs CUDA (CUDA graphs)")
        if self.cuda and "graph" in a.modes:

            def graph_mode():
                graph, out = captured(lambda: block(x), dev)
                graph.replay()
                self.row(t, "graph", self.time(graph.replay), rel_err=rel_err(out, ref))

            self.guarded(t, "graph", graph_mode)
        y = block.norm2(x)
        logits = block.gate(y.float())
        layer = block.experts
        for mode, prep in (("layer_graph", layer.decode_prep), ("layer_graph_separate", False)):
            if self.cuda and mode in a.modes:

                def layer_mode(mode=mode, prep=prep):
                    kept, layer.decode_prep = layer.decode_prep, prep
                    try:
                        fused = layer._uses_prep(y, logits)
                        self.row(t, mode, self.time(captured(lambda: layer(y, logits), dev)[0].replay), decode_prep=fused)
                    finally:
                        layer.decode_prep = kept

                self.guarded(t, mode, layer_mode)
        if self.cuda and a.prep_warps and layer._uses_prep(y, logits):
            for warps in a.prep_warps:
                self.guarded(t, f"layer_graph prep_warps={warps}", lambda w=warps: self.prep_warps_row(t, w, y, logits))
        if "experts_graph" in a.modes:

            def experts_mode():
                fn, batch = experts_pass(block.experts, y, logits)
                if self.cuda:
                    self.row(t, "experts_graph", self.time(captured(fn, dev)[0].replay), rows=int(batch.x.shape[0]))
                else:
                    self.row(t, "experts_graph", self.time(fn), rows=int(batch.x.shape[0]), note="eager on CPU")

            self.guarded(t, "experts_graph", experts_mode)

    def prep_warps_row(self, t: int, warps: int, y: torch.Tensor, logits: torch.Tensor) -> None:
        """``layer_graph`` with the decode prep launched on ``warps`` warps (a graph captures the
        launch as it was configured then)."""
        from epmoe.kernels import prep

        kept, prep.PREP_WARPS = prep.PREP_WARPS, warps
        try:
            ms = self.time(captured(lambda: self.block.experts(y, logits), self.device)[0].replay)
        finally:
            prep.PREP_WARPS = kept
        self.warps_rows.append(dict(scheme=self.scheme, batch=t, prep_warps=warps, ms=ms))
        print(f"{self.scheme:13s} T={t:4d} layer_graph prep_warps={warps:<2d} {ms:9.4f} ms", flush=True)

    @torch.no_grad()
    def compiled_mode(self, t: int, mode: str, deadline: float) -> None:
        """``mode`` (``compiled`` / ``reduce_overhead``) at batch ``t``, unless ``deadline`` (a
        ``time.perf_counter()`` value) has passed: then the row says so."""
        if mode == "reduce_overhead" and not self.cuda:
            self.row(t, mode, skipped="needs CUDA (CUDA graphs)")
            return
        if time.perf_counter() > deadline:
            self.row(t, mode, skipped=f"this scheme's compile budget (--budget-s {self.args.budget_s:g}) spent before this compile")
            return
        x = self.inputs(t)
        ref = self.block(x)

        def run():
            from torch._dynamo.utils import counters

            fn = self.compiled_fn(mode)
            skips = counters["inductor"]["cudagraph_skips"]
            t0 = time.perf_counter()
            fn(x)  # compiles for this batch size (dynamic=False)
            out = fn(x).clone()  # reduce-overhead records its graph on a later call
            compile_s = time.perf_counter() - t0
            extra = dict(compile_s=round(compile_s, 2), rel_err=rel_err(out, ref))
            if mode == "reduce_overhead":  # Inductor falls back to no CUDA graph and says so only here
                extra["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"] - skips
            self.row(t, mode, self.time(lambda: fn(x)), **extra)

        self.guarded(t, mode, run)


def layer_kernels(fn, steps: int = 5) -> list[dict]:
    """The GPU kernels ``fn`` launches, per call: ``[{name, count, us}]`` (device time from the
    profiler's kernel events, averaged over ``steps`` calls), longest first."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    per_name: dict[str, list[float]] = {}
    for evt in prof.events():
        if evt.device_type == DeviceType.CUDA:
            per_name.setdefault(evt.name, []).append(evt.time_range.elapsed_us())
    rows = [dict(name=n, count=round(len(v) / steps, 2), us=round(sum(v) / steps, 2)) for n, v in per_name.items()]
    return sorted(rows, key=lambda r: -r["us"])


def print_kernels(scheme: str, t: int, rows: list[dict]) -> None:
    total = sum(r["us"] for r in rows)
    launches = sum(r["count"] for r in rows)
    print(f"{scheme} T={t}: {launches:g} launches, {total:.1f} us of kernels per layer step")
    for r in rows:
        print(f"  {r['us']:8.2f} us  x{r['count']:<5g} {r['name'][:110]}")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).norm() / ref.float().norm().clamp(min=1e-30))


def summarize(rows: list[dict]) -> list[dict]:
    """Per scheme and batch: each graphed / compiled mode against ``experts_graph`` and eager."""
    out = []
    keys = sorted({(r["scheme"], r["batch"]) for r in rows}, key=lambda k: (SCHEMES.index(k[0]), k[1]))
    for scheme, t in keys:
        ms = {r["mode"]: r["ms"] for r in rows if r["scheme"] == scheme and r["batch"] == t and r["ms"] is not None}
        s = dict(scheme=scheme, batch=t)
        for mode in ("compiled", "reduce_overhead", "graph", "layer_graph", "layer_graph_separate"):
            if mode in ms and "experts_graph" in ms:
                s[f"{mode}_vs_experts_graph"] = round(ms[mode] / ms["experts_graph"], 4)
            if mode in ms and "eager" in ms:
                s[f"eager_vs_{mode}"] = round(ms["eager"] / ms[mode], 4)
        # The targets are judged on the times, not on the rounded ratios shown.
        if "layer_graph" in ms and "experts_graph" in ms:
            s["glue_target_met"] = ms["layer_graph"] <= 1.05 * ms["experts_graph"]
        best = [ms[m] for m in ("reduce_overhead", "graph") if m in ms]
        if t == 1 and best and "eager" in ms:
            s["eager_vs_best_graphed"] = round(ms["eager"] / min(best), 4)
            s["speedup_target_met"] = ms["eager"] >= 1.3 * min(best)
        out.append(s)
    return out


def plot(rows: list[dict], path: str) -> None:
    from epmoe.bench.plotting import pyplot

    plt = pyplot()
    schemes = [s for s in SCHEMES if any(r["scheme"] == s for r in rows)]
    fig, axes = plt.subplots(1, len(schemes), figsize=(5 * len(schemes), 4), squeeze=False)
    for ax, scheme in zip(axes[0], schemes):
        mine = [r for r in rows if r["scheme"] == scheme and r["ms"] is not None]
        batches = sorted({r["batch"] for r in mine})
        # Every mode keeps its slot and colour in every panel (a mode a scheme skipped is an empty slot).
        modes = [m for m in MODES if any(r["mode"] == m for r in rows)]
        width = 0.8 / max(1, len(modes))
        for i, mode in enumerate(modes):
            vals = [next((r["ms"] for r in mine if r["batch"] == b and r["mode"] == mode), 0.0) for b in batches]
            ax.bar([j + i * width for j in range(len(batches))], vals, width, label=mode, color=f"C{i}")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(batches))], [str(b) for b in batches])
        ax.set_xlabel("tokens per decode step")
        ax.set_ylabel("ms (median)")
        ax.set_title(scheme)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> dict:
    args = parse_args(argv)
    # One compiled graph per batch size and mode (dynamic=False): more than dynamo's default limit.
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(64, getattr(torch._dynamo.config, name)))
    started = time.perf_counter()
    device = torch.device(args.device)
    sizes = TINY if args.tiny else FULL
    import triton

    result = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        commit=git_commit(args.commit, fallback=None), device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        torch=torch.__version__, triton=triton.__version__, sizes=sizes, batches=args.batches,
        env={k: os.environ.get(k) for k in ("SGLANG_CUTLASS_MOE", "EPMOE_BACKEND", "EPMOE_PDL")}, rows=[], skipped_schemes={},
        command=" ".join(["python", *map(shlex.quote, sys.argv)]),
    )  # fmt: skip
    rows: list[dict] = []
    for scheme in args.schemes:
        backend = BACKENDS[scheme] if device.type == "cuda" else "torch"
        try:
            # validate=False: an engine's decode step does not read its inputs back for checks
            # (validate=True adds one host sync per eager forward; compiled graphs skip it anyway).
            block = DecoderBlock(**sizes, quant=scheme, backend=backend, device=device, validate=False).eval()
        except (ValueError, RuntimeError) as exc:  # the backend cannot run here: say why, go on
            result["skipped_schemes"][scheme] = f"{type(exc).__name__}: {exc}"
            print(f"{scheme}: skipped: {exc}", flush=True)
            continue
        fill_random(block)
        runner = Runner(args, block, scheme, started)
        if args.kernels_batch is not None:
            if device.type == "cuda":
                with torch.no_grad():
                    y = block.norm2(runner.inputs(args.kernels_batch))
                    logits = block.gate(y.float())
                    listed = layer_kernels(lambda: block.experts(y, logits))
                result.setdefault("kernels", {})[scheme] = dict(batch=args.kernels_batch, kernels=listed)
                print_kernels(scheme, args.kernels_batch, listed)
            else:
                result.setdefault("kernels", {})[scheme] = "needs CUDA (kernel events)"
        for t in args.batches:
            runner.cheap_modes(t)
        # Compiling takes most of the run: each scheme has its own budget, the CUDA-graph mode
        # first (what the targets are about).
        deadline = time.perf_counter() + args.budget_s
        for mode in ("reduce_overhead", "compiled"):
            if mode in args.modes:
                for t in args.batches:
                    runner.compiled_mode(t, mode, deadline)
        rows += runner.rows
        result.setdefault("prep_warps", []).extend(runner.warps_rows)
        del block, runner
        torch._dynamo.reset()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    result["rows"] = rows
    result["summary"] = summarize(rows)
    result["wall_s"] = round(time.perf_counter() - started, 1)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    if args.plot:
        plot(rows, args.plot)
    print("\nscheme        T    eager  compiled  red-ovh    graph  layer_g  layer_sep experts_g  ratios")
    for s in result["summary"]:
        ms = {r["mode"]: r["ms"] for r in rows if r["scheme"] == s["scheme"] and r["batch"] == s["batch"]}
        cell = lambda m: f"{ms[m]:8.3f}" if ms.get(m) is not None else "       -"  # noqa: E731
        ratios = {k: v for k, v in s.items() if k not in ("scheme", "batch")}
        print(f"{s['scheme']:13s}{s['batch']:4d} {cell('eager')} {cell('compiled')} {cell('reduce_overhead')} "
              f"{cell('graph')} {cell('layer_graph')} {cell('layer_graph_separate')}  {cell('experts_graph')}   "
              f"{ratios}")  # fmt: skip
    for r in result.get("prep_warps", []):
        print(f"{r['scheme']:13s}{r['batch']:4d}  layer_graph with the prep on {r['prep_warps']} warps: {r['ms']:.4f} ms")
    print(f"wall {result['wall_s']} s -> {args.out}")
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
