"""``epmoe demo``: a DeepSeek-style MoE layer, scaled down, under EP in several local processes.

For every scheme this machine can run it builds the layer on each rank (gloo and the CPU without a
GPU; NCCL and one GPU per rank with them), checks each rank's output against a float64 reference
over all experts on that rank's tokens, times the forward pass and prints a table.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

# torch and the layer are imported where they run: `epmoe demo --help` needs neither.


def _weights(args, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    e, h, i = args.experts, args.hidden, args.intermediate
    w13 = torch.randn(e, 2 * i, h, generator=g) / h**0.5
    w2 = torch.randn(e, h, i, generator=g) / i**0.5
    bias = torch.randn(e, generator=g) * 0.05
    return w13, w2, bias


def _rank_main(rank: int, world: int, port: int, args) -> list[dict]:
    """One rank of the demo: every scheme's row (or why it was skipped)."""
    import torch
    import torch.distributed as dist

    from .dispatch import DeepEPBuffer
    from .launch import init_process_group
    from .layer import DeepEPMoELayer
    from .quant import get_scheme, quantize_weight
    from .reference import moe_float64
    from .timing import collective_ms

    # The spawned rank starts with no logging set up: -v / --log-level reach it through args.
    logging.basicConfig(level=args.log_level, format="%(name)s: %(message)s")
    use_cuda = args.device == "cuda"
    threads = None if use_cuda else max(1, (os.cpu_count() or 2) // world)
    device = init_process_group(rank, world, port, args.device, timeout_s=300, threads=threads)
    dtype = torch.bfloat16 if use_cuda else torch.float32
    w13, w2, bias = _weights(args)
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(args.tokens, args.hidden, generator=g).to(dtype)
    logits = torch.randn(args.tokens, args.experts, generator=g)
    rows = []
    # One DeepEP buffer for every layer of the group (allocated only if DeepEP is chosen), freed
    # before the group goes away.
    deepep_buffer = DeepEPBuffer()
    for name in args.schemes:
        scheme = get_scheme(name)
        try:
            layer = DeepEPMoELayer(
                args.experts, args.top_k, args.hidden, args.intermediate, quant=name,
                device=device, params_dtype=dtype, scoring_func="sigmoid",
                num_expert_group=args.groups, topk_group=args.topk_groups,
                routed_scaling_factor=2.5, use_correction_bias=True, deepep_buffer=deepep_buffer,
            )  # fmt: skip
        except (RuntimeError, ValueError) as exc:  # this machine or these sizes cannot run it
            rows.append(dict(scheme=name, skipped=str(exc)))
            continue
        q13, s13 = quantize_weight(w13, scheme)
        q2, s2 = quantize_weight(w2, scheme)
        if not scheme.quantized:
            q13, q2 = q13.to(dtype), q2.to(dtype)
        layer.load_experts(*[None if t is None else t.to(device) for t in (q13, q2, s13, s2)])
        layer.load_weights([("mlp.gate.e_score_correction_bias", bias.to(device))], strict=False)
        xd, ld = x.to(device), logits.to(device)
        out = layer(xd, ld)
        ids, weights = layer.route(ld)
        ref = moe_float64(x.float(), ids.cpu(), weights.cpu(), w13, w2)
        err = float((out.cpu().double() - ref).norm() / ref.norm())
        seconds = collective_ms(lambda: layer(xd, ld), args.iters, 0, device) / 1e3
        rows.append(
            dict(scheme=name, backend=layer.backend.name, dispatch=layer.dispatcher.name,
                 payload=layer.payload, err=err, bound=scheme.rel_error_bound,
                 tokens_per_s=args.tokens * args.ranks / seconds)  # fmt: skip
        )
    dist.barrier()
    deepep_buffer.close()  # collective, like its allocation
    dist.destroy_process_group()
    return rows


def _table(rank_rows: list[list[dict]]) -> tuple[str, bool]:
    lines = [
        f"{'scheme':<13} {'backend':<8} {'dispatcher':<18} {'payload':<11} {'rel.err (max rank)':>18}"
        f" {'bound':>6} {'tokens/s':>10}"
    ]
    ok = True
    for i, row in enumerate(rank_rows[0]):
        if "skipped" in row:
            lines.append(f"{row['scheme']:<13} skipped: {row['skipped']}")
            continue
        err = max(rows[i]["err"] for rows in rank_rows)
        ok &= err < row["bound"]
        lines.append(
            f"{row['scheme']:<13} {row['backend']:<8} {row['dispatch']:<18} {row['payload']:<11} "
            f"{err:>18.2e} {row['bound']:>6.0e} {row['tokens_per_s']:>10.0f}"
            + ("" if err < row["bound"] else "  OVER BOUND")
        )
    return "\n".join(lines), ok


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``epmoe demo`` (torch-free)."""
    p.add_argument("--ranks", type=int, default=2, help="EP ranks (local processes)")
    p.add_argument("--experts", type=int, default=32, help="routed experts (divisible by --ranks)")
    p.add_argument("--top-k", type=int, default=8, help="experts per token")
    p.add_argument("--groups", type=int, default=4, help="expert groups of the grouped top-k")
    p.add_argument("--topk-groups", type=int, default=2, help="groups each token may use")
    p.add_argument("--hidden", type=int, default=512, help="hidden size H")
    p.add_argument("--intermediate", type=int, default=256, help="intermediate size I of one expert")
    p.add_argument("--tokens", type=int, default=256, help="tokens per rank")
    p.add_argument("--iters", type=int, default=5, help="timed forwards per scheme")
    p.add_argument("--schemes", default="all", help="comma-separated quant schemes, or 'all' (every scheme)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: one GPU per rank when there are enough, else the CPU")
    p.add_argument("--json", help="write the rows of every rank here")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds all ranks together may take")


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    import torch

    from .quant import SCHEMES, get_scheme

    names = list(SCHEMES) if args.schemes == "all" else [s.strip() for s in args.schemes.split(",") if s.strip()]
    for s in names:
        try:
            get_scheme(s)
        except ValueError as exc:
            p.error(f"--schemes: {exc}")
    args.schemes = names
    for name in ("ranks", "experts", "top_k", "groups", "topk_groups", "hidden", "intermediate", "tokens", "iters"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if args.experts % args.ranks:
        p.error(f"--experts={args.experts} must be divisible by --ranks={args.ranks}")
    # The routing's own conditions, by the flags' names (the layer's messages name its arguments).
    if args.experts % args.groups:
        p.error(f"--groups={args.groups}; allowed: a divisor of --experts={args.experts}")
    if args.topk_groups > args.groups:
        p.error(f"--topk-groups={args.topk_groups}; allowed: 1 to --groups={args.groups}")
    reachable = args.experts // args.groups * args.topk_groups
    if args.top_k > reachable:
        p.error(f"--top-k={args.top_k}; allowed: at most the {reachable} experts of --topk-groups={args.topk_groups} "
                f"groups of --experts={args.experts} / --groups={args.groups}")
    if args.device == "auto":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        args.device = "cuda" if gpus >= args.ranks else "cpu"
    if args.device == "cuda" and torch.cuda.device_count() < args.ranks:
        p.error(f"--ranks={args.ranks} needs as many GPUs; {torch.cuda.device_count()} visible")
    if not hasattr(args, "log_level"):
        args.log_level = "WARNING"
    return args


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="epmoe demo", description=__doc__)
    add_arguments(p)
    return run(check_args(p, p.parse_args(argv)))


def run(args: argparse.Namespace) -> int:
    """The demo for checked options; 0, or 1 when a scheme's error is over its bound."""
    from .launch import run_ranks

    print(
        f"epmoe demo: {args.experts} experts, top-{args.top_k} in {args.groups} groups, "
        f"H={args.hidden}, I={args.intermediate}, EP={args.ranks} on {args.device}, "
        f"{args.tokens} tokens per rank; activations and bf16-scheme weights in "
        f"{'bfloat16' if args.device == 'cuda' else 'float32 (bfloat16 on a GPU)'}",
        flush=True,
    )
    rank_rows = run_ranks(_rank_main, args.ranks, args, timeout_s=args.timeout)
    table, ok = _table(rank_rows)
    print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(args=vars(args), ranks=rank_rows), f, indent=1)
    if not ok:
        print("error: a scheme's relative error is over its documented bound", file=sys.stderr)
    return 0 if ok else 1
