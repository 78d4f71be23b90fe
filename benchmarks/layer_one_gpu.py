"""One-GPU stand-in for the layer bench: DeepEPMoELayer with dispatch='local', DeepSeek-V3 sizes
(256 experts top-8, H=7168, I=2048), prefill 4096 tokens and decode 128 tokens, schemes in turns.

FP8 is included with SGLANG_CUTLASS_MOE=1 (the CUTLASS FP8 kernel). Uses only the public API, so the same file times the code before and after the redesign."""
import argparse, datetime, json, os, statistics, sys

import torch
import triton

from epmoe import DeepEPMoELayer

ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
ap.add_argument("out", nargs="?", default=None, help="write the results as JSON here (default: print only)")
ap.add_argument("--tokens", default="4096,128", help="comma-separated batch sizes (default: %(default)s)")
ap.add_argument("--schemes", default=None,
                help="comma-separated quant/accumulator pairs, e.g. bf16/fp32,int8_channel/fp32 "
                     "(default: bf16, int8_channel fp32 and int32, int8_block, and fp8_block with SGLANG_CUTLASS_MOE=1)")
ap.add_argument("--commit", default=None, help="the commit of the tree that runs, recorded in the JSON")
ap.add_argument("--rounds", type=int, default=3, help="rounds in which the schemes take turns (default: %(default)s)")
args = ap.parse_args()

E, K, H, I = 256, 8, 7168, 2048
schemes = [("bf16", "fp32"), ("int8_channel", "fp32"), ("int8_channel", "int32"), ("int8_block", "fp32")]
if os.environ.get("SGLANG_CUTLASS_MOE") == "1":
    schemes.append(("fp8_block", "fp32"))
if args.schemes:
    schemes = [tuple(s.split("/")) if "/" in s else (s, "fp32") for s in args.schemes.split(",")]
    if schemes[0] != ("bf16", "fp32"):
        ap.error(f"--schemes={args.schemes!r}: the first must be bf16/fp32 (the baseline of the ratios)")
dev = torch.device("cuda")
g = torch.Generator(device=dev).manual_seed(0)
import epmoe
out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "commit": args.commit,
       "command": " ".join(["python", *sys.argv]), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "epmoe_path": os.path.dirname(epmoe.__file__), "cases": []}
layers = {}
for q, acc in schemes:
    try:
        layer = DeepEPMoELayer(E, K, H, I, quant=q, accumulator=acc, dispatch="local", device=dev)
    except Exception as exc:  # report, keep the others
        print(f"{q}/{acc}: {type(exc).__name__}: {exc}"); continue
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if p.dtype == torch.int8:
                p.copy_(torch.randint(-127, 128, p.shape, device=dev, dtype=torch.int8, generator=g))
            elif p.dtype == torch.float8_e4m3fn:
                p.copy_((torch.randn(p.shape, device=dev, generator=g) * 100).clamp(-448, 448).to(p.dtype))
            elif "scale" in name:
                p.copy_(torch.rand(p.shape, device=dev, generator=g) * 1e-4 + 1e-5)
            else:
                p.copy_(torch.randn(p.shape, device=dev, generator=g) * 0.02)
    layers[f"{q}/{acc}"] = layer
    print("built", q, acc, layer.backend.name, flush=True)
for t in [int(v) for v in args.tokens.split(",")]:
    x = torch.randn(t, H, device=dev, dtype=torch.bfloat16, generator=g)
    logits = torch.randn(t, E, device=dev, generator=g)
    ids = torch.stack([torch.randperm(E, device=dev, generator=g)[:K] for _ in range(t)])
    w = torch.softmax(torch.gather(logits, 1, ids), -1)
    times = {k: [] for k in layers}
    for rnd in range(args.rounds):
        for k, layer in layers.items():
            times[k].append(triton.testing.do_bench(lambda: layer(x, topk_ids=ids, topk_weights=w), warmup=25, rep=200, return_mode="median"))
    base = statistics.median(times["bf16/fp32"])
    for k, v in times.items():
        m = statistics.median(v)
        out["cases"].append({"tokens": t, "scheme": k, "backend": layers[k].backend.name, "ms_rounds": v, "ms": m, "vs_bf16": base / m})
        print(f"tokens {t:5d} {k:22s} {layers[k].backend.name:8s} {m:8.3f} ms  x{base/m:.2f} vs bf16  rounds {['%.3f' % r for r in v]}", flush=True)
if args.out:
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
