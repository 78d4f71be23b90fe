"""Qwen3-30B-A3B at full width (random bf16 weights, N decoder layers) in transformers: prefill and
decode tokens/s with transformers' ``grouped_mm`` experts and with epmoe's schemes, side by side.

    python benchmarks/bench_hf_moe.py --out benchmarks/results/hf_moe_h200.json --plot hf_moe_h200.png
    SGLANG_CUTLASS_MOE=1 python benchmarks/bench_hf_moe.py ...   # fp8_block through the project's CUTLASS kernel

The model is built once; every variant runs from the same weights (epmoe variants build their
layers from the experts modules' weights, time, and are dropped before the next). Per variant:

* prefill: ``model(ids [B, L])`` with a fresh cache, CUDA events around ``--iters`` calls;
* decode: ``--decode-steps`` one-token steps of a ``[B, 1]`` batch over a ``--cache-len``-token
  DynamicCache (random keys/values, cropped back after each variant);
* the experts' share of the step: CUDA events around every experts module's forward, in a
  separate pass (the whole-step figures are timed without them).

The decode floor is the experts' weight bytes over the measured device-copy bandwidth (every
expert is touched at batch 64 x top-8 of 128). Variants that cannot run here (fp8_block without
DeepGEMM or SGLANG_CUTLASS_MOE=1) are skipped with the reason. Output: one JSON (date, commit, GPU,
software, config, per-variant figures, the issue's targets with measured ratios); ``--plot``
writes a PNG.
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

VARIANTS = ("grouped_mm", "bf16", "int8_channel", "int8_channel_int32", "int8_block", "fp8_block")
QWEN3_30B_A3B = dict(
    vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
    norm_topk_prob=True, max_position_embeddings=40960, rope_theta=1e6, rms_norm_eps=1e-6,
)  # fmt: skip
"""Qwen3-30B-A3B's configuration (48 layers in the real model)."""


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent,
                              check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _timed(fn, iters: int) -> float:
    """Median ms of ``iters`` calls of ``fn`` (after one warm-up), each bracketed by CUDA events."""
    fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def _copy_bandwidth() -> float:
    """Device copy bandwidth, bytes/s (read + write), on 1 GiB."""
    x = torch.empty(1 << 29, dtype=torch.int16, device="cuda")
    y = torch.empty_like(x)
    ms = _timed(lambda: y.copy_(x), 10)
    return 2 * x.numel() * 2 / (ms / 1e3)


class ExpertsTimer:
    """CUDA events around every experts module's forward (hooks; removed by ``close``)."""

    def __init__(self, modules):
        self.pairs, self.handles = [], []
        for m in modules:
            self.handles.append(m.register_forward_pre_hook(self._pre))
            self.handles.append(m.register_forward_hook(self._post))

    def _pre(self, module, args):
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        self.pairs.append([e, None])

    def _post(self, module, args, out):
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        self.pairs[-1][1] = e

    def total_ms(self) -> float:
        torch.cuda.synchronize()
        return sum(a.elapsed_time(b) for a, b in self.pairs)

    def close(self):
        for h in self.handles:
            h.remove()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8, help="decoder layers (the real model has 48)")
    p.add_argument("--prefill-batch", type=int, default=8)
    p.add_argument("--prefill-len", type=int, default=2048)
    p.add_argument("--decode-batch", type=int, default=64)
    p.add_argument("--cache-len", type=int, default=2048)
    p.add_argument("--decode-steps", type=int, default=16, help="timed decode steps per measurement")
    p.add_argument("--iters", type=int, default=3, help="timed prefills (and decode repeats) per variant")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {VARIANTS}")
    p.add_argument("--validate", action="store_true", help="keep the layer's input checks (host syncs) on")
    p.add_argument("--out", default=None, help="JSON path (default: stdout only)")
    p.add_argument("--plot", default=None, help="PNG path")
    args = p.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        p.error(f"--variants {bad}: allowed {list(VARIANTS)}")
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")

    import transformers
    from transformers import AutoModelForCausalLM, DynamicCache, Qwen3MoeConfig

    from epmoe.integrations import transformers as et

    t_start = time.time()
    torch.manual_seed(0)
    config = Qwen3MoeConfig(num_hidden_layers=args.layers, **QWEN3_30B_A3B)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    modules = [m for _, m in et.experts_modules(model)]
    e, h, i = et._shape(modules[0])
    expert_params = sum(m.gate_up_proj.numel() + m.down_proj.numel() for m in modules)
    bw = _copy_bandwidth()
    floors_ms = {"bf16": expert_params * 2 / bw * 1e3, "int8": expert_params * 1 / bw * 1e3}
    print(f"model: {args.layers} layers, E={e} H={h} I={i}; experts {expert_params * 2 / 1e9:.2f} GB bf16; "
          f"copy bandwidth {bw / 1e12:.2f} TB/s; decode floor bf16 {floors_ms['bf16']:.2f} ms, int8 "
          f"{floors_ms['int8']:.2f} ms", flush=True)  # fmt: skip

    g = torch.Generator(device="cuda").manual_seed(1)
    prefill_ids = torch.randint(0, config.vocab_size, (args.prefill_batch, args.prefill_len), device="cuda", generator=g)
    decode_ids = torch.randint(0, config.vocab_size, (args.decode_batch, 1), device="cuda", generator=g)
    cache = DynamicCache(config=config)
    kv = (args.decode_batch, config.num_key_value_heads, args.cache_len, config.head_dim)
    for layer_idx in range(args.layers):
        cache.update(torch.randn(kv, device="cuda", dtype=torch.bfloat16),
                     torch.randn(kv, device="cuda", dtype=torch.bfloat16), layer_idx)  # fmt: skip

    def prefill():
        with torch.no_grad():
            model(prefill_ids, use_cache=True, logits_to_keep=1)  # as generate does: no [B, L, V] logits

    def decode():
        with torch.no_grad():
            for s in range(args.decode_steps):
                pos = torch.full((args.decode_batch, 1), args.cache_len + s, device="cuda")
                model(decode_ids, past_key_values=cache, position_ids=pos, use_cache=True)
        cache.crop(-args.decode_steps)  # back to the --cache-len tokens

    results = {}
    for variant in variants:
        entry = {}
        layers = []
        try:
            if variant == "grouped_mm":
                model.set_experts_implementation("grouped_mm")
                entry["backend"] = "transformers grouped_mm"
            else:
                quant, kw = (variant, {}) if variant != "int8_channel_int32" else ("int8_channel", {"accumulator": "int32"})
                for m in modules:
                    layer = et.build_layer(m, quant, validate=args.validate, **kw)
                    et.load_module_experts(layer, m)
                    layers.append(layer)
                    m._modules[et.LAYER_ATTR] = layer  # the epmoe forward uses it; the module keeps its weights
                model.set_experts_implementation(et.IMPLEMENTATION)
                entry["backend"] = layers[0].backend.name
                entry["dispatch"] = layers[0].dispatcher.name
            prefill_ms = _timed(prefill, args.iters)
            decode_ms = _timed(decode, max(1, args.iters - 1)) / args.decode_steps
            timer = ExpertsTimer(modules)
            prefill()
            torch.cuda.synchronize()
            timer.pairs.clear()
            prefill()
            exp_prefill = timer.total_ms()
            timer.pairs.clear()
            decode()
            exp_decode = timer.total_ms() / args.decode_steps
            timer.close()
            entry.update(
                prefill_ms=prefill_ms, prefill_tok_s=args.prefill_batch * args.prefill_len / prefill_ms * 1e3,
                decode_ms=decode_ms, decode_tok_s=args.decode_batch / decode_ms * 1e3,
                experts_prefill_ms=exp_prefill, experts_decode_ms=exp_decode,
                experts_share_prefill=exp_prefill / prefill_ms, experts_share_decode=exp_decode / decode_ms,
            )  # fmt: skip
            print(f"{variant:20s} {entry['backend']:10s} prefill {prefill_ms:7.2f} ms ({entry['prefill_tok_s'] / 1e3:6.1f}k tok/s, "
                  f"experts {exp_prefill:6.2f} ms = {100 * entry['experts_share_prefill']:4.1f} %)  decode {decode_ms:6.2f} ms "
                  f"({entry['decode_tok_s'] / 1e3:5.2f}k tok/s, experts {exp_decode:5.2f} ms = "
                  f"{100 * entry['experts_share_decode']:4.1f} %)", flush=True)  # fmt: skip
        except Exception as exc:  # a variant this machine cannot run: recorded, never silently dropped
            entry = {"skipped": f"{type(exc).__name__}: {exc}"}
            print(f"{variant:20s} skipped: {entry['skipped']}", flush=True)
        finally:
            for m in modules:
                m._modules.pop(et.LAYER_ATTR, None)
            del layers
            torch.cuda.empty_cache()
        results[variant] = entry

    base = results.get("grouped_mm", {})
    targets = {}

    def ratio(v, key):
        r = results.get(v, {})
        return r[key] / base[key] if key in r and key in base else None

    targets["prefill_experts_bf16_vs_grouped_mm"] = {"target": 0.6, "measured": ratio("bf16", "experts_prefill_ms")}
    targets["prefill_experts_int8_channel_vs_grouped_mm"] = {"target": 0.4, "measured": ratio("int8_channel", "experts_prefill_ms")}
    for v in variants:
        r = results.get(v, {})
        if "experts_decode_ms" in r and v != "grouped_mm":
            floor = floors_ms["bf16" if v == "bf16" else "int8"]
            targets[f"decode_experts_{v}_vs_weight_read_floor"] = {"target": 1.3, "measured": r["experts_decode_ms"] / floor}
        if v != "grouped_mm":
            for phase in ("prefill", "decode"):
                rr = ratio(v, f"{phase}_tok_s")
                if rr is not None:
                    targets[f"{phase}_tok_s_{v}_vs_grouped_mm"] = {"target": ">= 1.0", "measured": rr}
    doc = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": _commit(),
        "gpu": torch.cuda.get_device_name(),
        "software": {"torch": torch.__version__, "transformers": transformers.__version__, "python": sys.version.split()[0]},
        "command": " ".join(["python", *sys.argv]),
        "config": {"model": "Qwen3-30B-A3B (random bf16 weights)", "layers": args.layers, "num_experts": e, "hidden": h,
                   "moe_intermediate": i, "top_k": config.num_experts_per_tok, "prefill": [args.prefill_batch, args.prefill_len],
                   "decode_batch": args.decode_batch, "cache_len": args.cache_len, "decode_steps": args.decode_steps,
                   "iters": args.iters, "validate": args.validate, "cache": "DynamicCache, eager (no torch.compile)"},
        "copy_bandwidth_bytes_s": bw,
        "decode_weight_read_floor_ms": floors_ms,
        "results": results,
        "targets": targets,
        "wall_s": time.time() - t_start,
    }  # fmt: skip
    text = json.dumps(doc, indent=1)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    if args.plot:
        plot(doc, args.plot)
    return 0


def plot(doc: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {k: v for k, v in doc["results"].items() if "skipped" not in v}
    names = list(runs)
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, phase in zip(axes, ("prefill", "decode")):
        total = [runs[n][f"{phase}_ms"] for n in names]
        experts = [runs[n][f"experts_{phase}_ms"] for n in names]
        ax.bar(names, total, color="#bbb", label="whole step")
        ax.bar(names, experts, color="#3070b0", label="experts")
        if phase == "decode":
            ax.axhline(doc["decode_weight_read_floor_ms"]["bf16"], color="r", ls="--", lw=1, label="bf16 weight-read floor")
        ax.set_ylabel("ms per step")
        ax.set_title(f"{phase} ({doc['config']['layers']} layers, {doc['gpu']})")
        ax.tick_params(axis="x", rotation=30)
        ax.legend()
    fig.suptitle("Qwen3-30B-A3B shapes, random weights: transformers grouped_mm vs epmoe")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
