"""Qwen3-30B-A3B at full width (random bf16 weights, N decoder layers) in transformers: prefill and
decode tokens/s with transformers' ``grouped_mm`` experts and with epmoe's schemes, side by side,
decode both eager and captured in a CUDA graph.

    python benchmarks/bench_hf_moe.py --out hf_moe_h200.json --plot hf_moe_h200.png
    SGLANG_CUTLASS_MOE=1 python benchmarks/bench_hf_moe.py ...   # the cutlass variants (INT8 int32, INT8 block, FP8)
    python benchmarks/bench_hf_moe.py --device cpu --tiny        # dry run of every code path on a CPU

The model is built once; every variant runs from the same weights (epmoe variants build their
layers from the experts modules' weights, time, and are dropped before the next). Per variant:

* prefill: ``model(ids [B, L])`` with a fresh cache, eager, ``--iters`` calls;
* decode: one ``[B, 1]`` step at position ``--cache-len`` over a StaticCache of ``--cache-len + 1``
  positions (random keys/values; every position is valid, so no mask is needed), repeated at that
  position (each step first resets the cache's write position, inside the timed/captured step):
  eager, then the same step captured once in a ``torch.cuda.CUDAGraph`` and replayed (host
  overhead out of the comparison). A step that cannot be captured (a host read inside) is
  recorded with the reason;
* the experts' time: prefill and eager decode from CUDA events around every experts module's
  forward (a separate pass); graphed decode as the graph's time minus that of the same step
  captured with the experts returning zeros (routing, attention and the rest unchanged);
* ``--compile``: also transformers' ``grouped_mm`` under ``torch.compile(mode="reduce-overhead")``
  with the same StaticCache step (compilation takes a minute or more; off by default).

The decode floor is the experts' weight bytes over the measured device-copy bandwidth (every
expert is touched at batch 64 x top-8 of 128). The ``_triton`` variants force the Triton backend
where the auto choice (with ``SGLANG_CUTLASS_MOE=1``) is the cutlass backend, whose INT8 path runs
its own Triton branch below the measured crossover (about 4 rows per expert in this decode): the
two differ by that branch's packing. Variants that cannot run here (e.g.
fp8_block without DeepGEMM or ``SGLANG_CUTLASS_MOE=1``) are recorded with the reason. Output: one
JSON (date, commit, GPU, software, config, per-variant figures, the issue's targets with measured
ratios), a table printed last; ``--plot`` writes a PNG.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks.provenance, epmoe of this checkout
from benchmarks.provenance import git_commit  # noqa: E402
import torch

VARIANTS = {
    "grouped_mm": None,
    "bf16": ("bf16", {}),
    "int8_channel": ("int8_channel", {}),
    "int8_channel_int32": ("int8_channel", {"accumulator": "int32"}),
    "int8_channel_int32_triton": ("int8_channel", {"accumulator": "int32", "backend": "triton"}),
    "int8_block": ("int8_block", {}),
    "int8_block_triton": ("int8_block", {"backend": "triton"}),
    "fp8_block": ("fp8_block", {}),
}
"""Variant -> ``(quant, layer kwargs)`` of ``enable`` (``None``: transformers' ``grouped_mm``)."""
QWEN3_30B_A3B = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
    norm_topk_prob=True, max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6,
)  # fmt: skip
"""Qwen3-30B-A3B's configuration (48 layers in the real model)."""
TINY = dict(
    vocab_size=96, hidden_size=128, intermediate_size=256, moe_intermediate_size=128, num_attention_heads=2,
    num_key_value_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
    max_position_embeddings=256,
)  # fmt: skip
"""A toy of the same family for ``--tiny`` (hidden and intermediate multiples of 128 for the block schemes)."""
NO_EXPERTS = "bench_no_experts"
"""An experts implementation returning zeros: the step without the experts, for their graphed time."""


def _commit(given: str | None) -> str:
    return git_commit(given)


class Clock:
    """Median ms of repeated calls: CUDA events on a GPU, the host clock on a CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def timed(self, fn, iters: int) -> float:
        """Median ms of ``iters`` calls of ``fn``, each timed alone, after one warm-up."""
        fn()
        times = []
        for _ in range(iters):
            self.sync()
            if self.cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
            t0 = time.perf_counter()
            fn()
            if self.cuda:
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b))
            else:
                times.append((time.perf_counter() - t0) * 1e3)
        return sorted(times)[len(times) // 2]

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def between(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else (b - a) * 1e3


def _copy_bandwidth(clock: Clock, device) -> float:
    """Device copy bandwidth, bytes/s (read + write), on 1 GiB (a few MiB on a CPU)."""
    x = torch.empty(1 << (29 if clock.cuda else 22), dtype=torch.int16, device=device)
    y = torch.empty_like(x)
    ms = clock.timed(lambda: y.copy_(x), 10)
    return 2 * x.numel() * 2 / (ms / 1e3)


class ExpertsTimer:
    """Marks around every experts module's forward (hooks; removed by ``close``)."""

    def __init__(self, modules, clock: Clock):
        self.clock, self.pairs, self.handles = clock, [], []
        for m in modules:
            self.handles.append(m.register_forward_pre_hook(self._pre))
            self.handles.append(m.register_forward_hook(self._post))

    def _pre(self, module, args):
        self.pairs.append([self.clock.mark(), None])

    def _post(self, module, args, out):
        self.pairs[-1][1] = self.clock.mark()

    def total_ms(self, fn, calls: int = 1) -> float:
        """Experts' time per call of ``fn`` (``calls`` calls, after one untimed)."""
        fn()
        self.clock.sync()
        self.pairs.clear()
        for _ in range(calls):
            fn()
        self.clock.sync()
        return sum(self.clock.between(a, b) for a, b in self.pairs) / calls

    def close(self):
        for h in self.handles:
            h.remove()


def capture(step, clock: Clock):
    """``step`` captured in a CUDA graph after two eager runs on the capture stream (kernels
    compiled, caches allocated); returns the graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    clock.sync()
    return graph


def not_capturable(model) -> str | None:
    """Why an enabled model's decode step cannot be captured (a layer reads counts back), or None."""
    from epmoe.integrations import transformers as et

    for m in model.modules():
        layer = m._modules.get(et.LAYER_ATTR) if hasattr(m, "_modules") else None
        if layer is not None and not layer.backend.device_segments:
            return (f"backend {layer.backend.name!r} ({layer.scheme.name}) needs host-side segment sizes: the "
                    "layer reads the rows per expert back each forward")  # fmt: skip
    return None


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8, help="decoder layers (the real model has 48)")
    p.add_argument("--prefill-batch", type=int, default=8)
    p.add_argument("--prefill-len", type=int, default=2048)
    p.add_argument("--decode-batch", type=int, default=64)
    p.add_argument("--cache-len", type=int, default=2048)
    p.add_argument("--decode-steps", type=int, default=16, help="back-to-back decode steps per timed sample")
    p.add_argument("--iters", type=int, default=3, help="timed samples per measurement")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {list(VARIANTS)}")
    p.add_argument("--validate", action="store_true", help="the layers' per-batch value checks on (a host sync each)")
    p.add_argument("--compile", action="store_true", help="also grouped_mm under torch.compile(mode='reduce-overhead')")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a dry run (no graphs)")
    p.add_argument("--tiny", action="store_true", help="a toy configuration and sizes (dry runs)")
    p.add_argument("--max-wall-s", type=float, default=500.0,
                   help="skip the variants left once this many seconds have passed (the JSON is still written)")
    p.add_argument("--commit", default=None, help="commit to record (default: git rev-parse HEAD)")
    p.add_argument("--out", default=None, help="JSON path (default: stdout only)")
    p.add_argument("--plot", default=None, help="PNG path")
    args = p.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in args.variants if v not in VARIANTS]
    if bad:
        p.error(f"--variants {bad}: allowed {list(VARIANTS)}")
    for name in ("layers", "prefill_batch", "prefill_len", "decode_batch", "cache_len", "decode_steps", "iters"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if args.plot:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            p.error("--plot needs matplotlib (pip install 'epmoe[plot]')")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA GPU here (use --device cpu --tiny for a dry run)")
    if args.tiny:
        args.prefill_batch, args.prefill_len = min(args.prefill_batch, 2), min(args.prefill_len, 16)
        args.decode_batch, args.cache_len = min(args.decode_batch, 4), min(args.cache_len, 32)
        args.layers, args.decode_steps, args.iters = min(args.layers, 2), min(args.decode_steps, 2), min(args.iters, 2)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import transformers
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig, StaticCache
    from transformers.integrations.moe import ExpertsInterface

    from epmoe.integrations import transformers as et

    ExpertsInterface.register(NO_EXPERTS, lambda self, hidden_states, *_: torch.zeros_like(hidden_states))
    t_start = time.time()
    device = torch.device(args.device)
    clock = Clock(device)
    torch.manual_seed(0)
    config = Qwen3MoeConfig(num_hidden_layers=args.layers, **(TINY if args.tiny else QWEN3_30B_A3B))
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    modules = [m for _, m in et.experts_modules(model)]
    e, h, i = et._shape(modules[0])
    expert_params = sum(m.gate_up_proj.numel() + m.down_proj.numel() for m in modules)
    bw = _copy_bandwidth(clock, device)
    floors_ms = {"bf16": expert_params * 2 / bw * 1e3, "int8": expert_params * 1 / bw * 1e3}
    print(f"model: {args.layers} layers, E={e} H={h} I={i}; experts {expert_params * 2 / 1e9:.2f} GB bf16; "
          f"copy bandwidth {bw / 1e12:.2f} TB/s; decode floor bf16 {floors_ms['bf16']:.2f} ms, int8 "
          f"{floors_ms['int8']:.2f} ms", flush=True)  # fmt: skip

    g = torch.Generator(device=device).manual_seed(1)
    prefill_ids = torch.randint(0, config.vocab_size, (args.prefill_batch, args.prefill_len), device=device, generator=g)
    decode_ids = torch.randint(0, config.vocab_size, (args.decode_batch, 1), device=device, generator=g)
    # Every position of the cache holds a token once the step writes position cache_len: no mask.
    cache = StaticCache(config=config, max_cache_len=args.cache_len + 1)
    kv = (args.decode_batch, config.num_key_value_heads, args.cache_len, config.head_dim)
    filled = torch.arange(args.cache_len, device=device)
    for layer_idx in range(args.layers):
        cache.update(torch.randn(kv, device=device, dtype=torch.bfloat16, generator=g),
                     torch.randn(kv, device=device, dtype=torch.bfloat16, generator=g), layer_idx,
                     {"cache_position": filled})  # fmt: skip
    # transformers >= 5.2x keeps each layer's write position on the device; older ones take it from
    # cache_position. The step resets it (on the device, so inside a graph too).
    positions = [t for t in (getattr(layer, "cumulative_length", None) for layer in cache.layers) if isinstance(t, torch.Tensor)]
    cache_position = torch.full((1,), args.cache_len, device=device, dtype=torch.long)
    position_ids = torch.full((args.decode_batch, 1), args.cache_len, device=device, dtype=torch.long)

    def prefill():
        with torch.no_grad():
            model(prefill_ids, use_cache=True, logits_to_keep=1)  # as generate does: no [B, L, V] logits

    def decode_step(m=model):
        with torch.no_grad():
            for t in positions:
                t.fill_(args.cache_len)
            return m(decode_ids, past_key_values=cache, cache_position=cache_position, position_ids=position_ids,
                     use_cache=True).logits  # fmt: skip

    def decode(step=decode_step):
        for _ in range(args.decode_steps):
            step()

    def graphed(entry: dict, implementation: str) -> None:
        """Decode step captured and replayed; experts' time by subtracting the step without them."""
        if not clock.cuda:
            entry["graph"] = "skipped: CUDA graphs need a GPU"
            return
        why = not_capturable(model)
        if why:
            entry["graph"] = f"not capturable: {why}"
            return
        graph = capture(decode_step, clock)
        entry["decode_graph_ms"] = clock.timed(lambda: decode(graph.replay), args.iters) / args.decode_steps
        del graph
        model.set_experts_implementation(NO_EXPERTS)
        try:
            bare = capture(decode_step, clock)
            bare_ms = clock.timed(lambda: decode(bare.replay), args.iters) / args.decode_steps
            del bare
        finally:
            model.set_experts_implementation(implementation)
        entry["experts_decode_graph_ms"] = entry["decode_graph_ms"] - bare_ms
        entry["decode_graph_tok_s"] = args.decode_batch / entry["decode_graph_ms"] * 1e3

    results = {}
    variants = list(args.variants) + (["grouped_mm_compiled"] if args.compile else [])
    for variant in variants:
        entry, layers = {}, []
        if time.time() - t_start > args.max_wall_s:
            results[variant] = {"skipped": f"--max-wall-s {args.max_wall_s:.0f} s reached before this variant"}
            print(f"{variant:26s} skipped: {results[variant]['skipped']}", flush=True)
            continue
        try:
            if variant.startswith("grouped_mm"):
                implementation = "grouped_mm"
                entry["backend"] = "transformers grouped_mm"
            else:
                quant, kw = VARIANTS[variant]
                for m in modules:
                    layer = et.build_layer(m, quant, validate=args.validate, **kw)
                    et.load_module_experts(layer, m)
                    layers.append(layer)
                    m._modules[et.LAYER_ATTR] = layer  # the epmoe forward uses it; the module keeps its weights
                implementation = et.IMPLEMENTATION
                entry["backend"], entry["dispatch"] = layers[0].backend.name, layers[0].dispatcher.name
            model.set_experts_implementation(implementation)
            if variant == "grouped_mm_compiled":
                compiled = torch.compile(model, mode="reduce-overhead", fullgraph=False)
                step = lambda: decode_step(compiled)  # noqa: E731
                for _ in range(3):
                    step()  # compile and record the graphs
                entry["decode_compiled_ms"] = clock.timed(lambda: decode(step), args.iters) / args.decode_steps
                entry["decode_compiled_tok_s"] = args.decode_batch / entry["decode_compiled_ms"] * 1e3
                print(f"{variant:26s} decode compiled {entry['decode_compiled_ms']:7.2f} ms", flush=True)
                results[variant] = entry
                continue
            prefill_ms = clock.timed(prefill, args.iters)
            decode_ms = clock.timed(decode, args.iters) / args.decode_steps
            timer = ExpertsTimer(modules, clock)
            try:
                exp_prefill = timer.total_ms(prefill)
                exp_decode = timer.total_ms(decode) / args.decode_steps
            finally:
                timer.close()
            entry.update(
                prefill_ms=prefill_ms, prefill_tok_s=args.prefill_batch * args.prefill_len / prefill_ms * 1e3,
                decode_ms=decode_ms, decode_tok_s=args.decode_batch / decode_ms * 1e3,
                experts_prefill_ms=exp_prefill, experts_decode_ms=exp_decode,
                experts_share_prefill=exp_prefill / prefill_ms, experts_share_decode=exp_decode / decode_ms,
            )  # fmt: skip
            try:
                graphed(entry, implementation)
            except Exception as exc:  # recorded: the eager figures above stand
                entry["graph"] = f"failed: {type(exc).__name__}: {exc}"
            if "decode_graph_ms" in entry:
                entry["experts_share_decode_graph"] = entry["experts_decode_graph_ms"] / entry["decode_graph_ms"]
            graph_text = (f"graph {entry['decode_graph_ms']:6.2f} ms (experts {entry['experts_decode_graph_ms']:5.2f})"
                          if "decode_graph_ms" in entry else f"graph: {entry.get('graph')}")  # fmt: skip
            print(f"{variant:26s} {entry['backend']:10s} prefill {prefill_ms:7.2f} ms (experts {exp_prefill:6.2f})  "
                  f"decode eager {decode_ms:6.2f} ms (experts {exp_decode:5.2f})  {graph_text}", flush=True)  # fmt: skip
        except Exception as exc:  # a variant this machine cannot run: recorded, never silently dropped
            entry = {"skipped": f"{type(exc).__name__}: {exc}"}
            print(f"{variant:26s} skipped: {entry['skipped']}", flush=True)
        finally:
            for m in modules:
                m._modules.pop(et.LAYER_ATTR, None)
            del layers
            if variant == "grouped_mm_compiled":
                torch._dynamo.reset()
            if clock.cuda:
                torch.cuda.empty_cache()
        results[variant] = entry

    doc = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": _commit(args.commit),
        "gpu": torch.cuda.get_device_name() if clock.cuda else "none (CPU dry run)",
        "software": {"torch": torch.__version__, "transformers": transformers.__version__, "triton": _version("triton"),
                     "python": sys.version.split()[0]},
        "command": " ".join(["python", *sys.argv]),
        "config": {"model": "Qwen3-30B-A3B (random bf16 weights)" if not args.tiny else "tiny Qwen3-MoE (dry run)",
                   "layers": args.layers, "num_experts": e, "hidden": h, "moe_intermediate": i,
                   "top_k": config.num_experts_per_tok, "prefill": [args.prefill_batch, args.prefill_len],
                   "decode_batch": args.decode_batch, "cache_len": args.cache_len, "decode_steps": args.decode_steps,
                   "iters": args.iters, "validate": args.validate,
                   "cache": "prefill: DynamicCache; decode: StaticCache of cache_len + 1, eager and one CUDA graph per variant"},
        "copy_bandwidth_bytes_s": bw,
        "decode_weight_read_floor_ms": floors_ms,
        "results": results,
        "targets": targets(results, floors_ms),
        "wall_s": time.time() - t_start,
    }  # fmt: skip
    text = json.dumps(doc, indent=1)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    if args.plot:
        plot(doc, args.plot)
    print(table(doc))
    return 0


def _version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # not installed
        return None


def targets(results: dict, floors_ms: dict) -> dict:
    """The issue's targets with the measured ratios (``None`` where a side is missing)."""
    base = results.get("grouped_mm", {})

    def ratio(v, key, base_key=None):
        r = results.get(v, {})
        b = base.get(base_key or key)
        return r[key] / b if key in r and b else None

    out = {
        "prefill_experts_bf16_vs_grouped_mm": {"target": "<= 0.6", "measured": ratio("bf16", "experts_prefill_ms")},
        "prefill_experts_int8_channel_vs_grouped_mm": {
            v: ratio(v, "experts_prefill_ms") for v in ("int8_channel", "int8_channel_int32", "int8_channel_int32_triton")
        } | {"target": "<= 0.4"},
    }
    for v, r in results.items():
        if v.startswith("grouped_mm") or "skipped" in r:
            continue
        floor = floors_ms["bf16" if v == "bf16" else "int8"]
        for mode, key in (("eager", "experts_decode_ms"), ("graph", "experts_decode_graph_ms")):
            if key in r:
                out[f"decode_experts_{v}_{mode}_vs_weight_read_floor"] = {"target": "<= 1.3", "measured": r[key] / floor}
        for name, key, base_key in (("prefill", "prefill_tok_s", None), ("decode_eager", "decode_tok_s", None),
                                    ("decode_graph", "decode_graph_tok_s", None)):  # fmt: skip
            m = ratio(v, key, base_key)
            if m is not None:
                out[f"{name}_tok_s_{v}_vs_grouped_mm"] = {"target": ">= 1.0", "measured": m}
    return out


def table(doc: dict) -> str:
    """The short table printed last."""
    floor = doc["decode_weight_read_floor_ms"]
    lines = [f"{doc['gpu']}, {doc['config']['layers']} layers; decode floor bf16 {floor['bf16']:.2f} ms, int8 {floor['int8']:.2f} ms",
             f"{'variant':26s} {'backend':10s} {'prefill ms':>10s} {'exp':>7s} {'dec eager':>9s} {'exp':>6s} {'dec graph':>9s} {'exp':>6s} {'tok/s graph':>11s}"]  # fmt: skip
    f = lambda r, k, w: f"{r[k]:{w}.2f}" if k in r else f"{'-':>{w}s}"  # noqa: E731
    for v, r in doc["results"].items():
        if "skipped" in r:
            lines.append(f"{v:26s} skipped: {r['skipped'][:80]}")
            continue
        if v == "grouped_mm_compiled":
            lines.append(f"{v:26s} {'compiled':10s} {'':>10s} {'':>7s} {'':>9s} {'':>6s} {f(r, 'decode_compiled_ms', 9)} {'':>6s} {f(r, 'decode_compiled_tok_s', 11)}")
            continue
        lines.append(f"{v:26s} {r['backend'].replace('transformers ', ''):10s} {f(r, 'prefill_ms', 10)} {f(r, 'experts_prefill_ms', 7)} {f(r, 'decode_ms', 9)} "
                     f"{f(r, 'experts_decode_ms', 6)} {f(r, 'decode_graph_ms', 9)} {f(r, 'experts_decode_graph_ms', 6)} "
                     f"{f(r, 'decode_graph_tok_s', 11)}" + ("" if "graph" not in r else f"  graph {r['graph'][:60]}"))  # fmt: skip
    return "\n".join(lines)


def plot(doc: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {k: v for k, v in doc["results"].items() if "prefill_ms" in v}
    names = list(runs)
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    for ax, (title, total_key, experts_key) in zip(axes, (
        ("prefill", "prefill_ms", "experts_prefill_ms"),
        ("decode, eager", "decode_ms", "experts_decode_ms"),
        ("decode, CUDA graph", "decode_graph_ms", "experts_decode_graph_ms"),
    )):  # fmt: skip
        total = [runs[n].get(total_key, 0.0) for n in names]
        experts = [runs[n].get(experts_key, 0.0) for n in names]
        ax.bar(names, total, color="#bbb", label="whole step")
        ax.bar(names, experts, color="#3070b0", label="experts")
        if title.startswith("decode"):
            for kind, color in (("bf16", "r"), ("int8", "m")):
                ax.axhline(doc["decode_weight_read_floor_ms"][kind], color=color, ls="--", lw=1, label=f"{kind} weight-read floor")
        ax.set_ylabel("ms per step")
        ax.set_title(f"{title} ({doc['config']['layers']} layers)")
        ax.tick_params(axis="x", rotation=40, labelsize=8)
        ax.legend(fontsize=8)
    fig.suptitle(f"Qwen3-30B-A3B shapes, random weights, {doc['gpu']}: transformers grouped_mm vs epmoe (0 = not run)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
