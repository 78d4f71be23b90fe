"""``epmoe bench layer``: the EP layer over DeepEP on 2 GPUs at DeepSeek-V3 shapes.

Two ranks (:func:`epmoe.launch.run_ranks`, NCCL), 256 experts, top-8, H = 7168, I = 2048 (128
experts per rank), one shared :class:`~epmoe.dispatch.DeepEPBuffer`. The pieces below take the
rank count from the process group (``benchmarks/ep_scaling.py`` runs them on 2, 4 or 8 ranks);
the command itself runs on 2:

* prefill: 4096 tokens per rank, ``deepep_normal``; decode: 128 tokens per rank,
  ``deepep_low_latency``; schemes bf16, int8_channel (fp32 and int32 accumulator), int8_block
  (backend ``auto``);
* the whole layer's time, and the device time of each phase of that same forward (dispatch,
  scatter, GEMM1, activation, GEMM2, gather, combine: the ``epmoe.*`` profiler ranges the layer
  and the experts backends place, read from a ``torch.profiler`` trace);
* bytes sent per rank, remote and local;
* with ``--rounds R``: the schemes compared under the same load, R rounds in which they take
  turns (:func:`epmoe.timing.in_turns`), prefill with ``normal_max_tokens_per_rank`` set (no
  host sync between dispatch and the experts).

Every rank runs a fixed number of iterations timed with CUDA events (never a per-process
repetition count: ranks that disagree make DeepEP stop with "CPU recv timeout"). The studies
behind the design (DeepEP called directly, CUDA-graph decode, sustained load, low-latency INT8
payloads) are ``benchmarks/layer_studies.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

E, K, H, I = 256, 8, 7168, 2048
WORLD = 2
SCHEMES = ("bf16", "int8_channel", "int8_channel_int32", "int8_block")
"""``int8_channel_int32`` is ``int8_channel`` with the layer's ``accumulator="int32"``."""
PHASES = ("route", "dispatch", "scatter", "experts", "quantize", "gemm1", "activation", "gemm2", "gather",
          "combine")  # fmt: skip
"""The layer's profiler ranges in forward order; ``experts`` holds the four after it when the
backend places them (Triton), so a stacked plot draws it only where they are missing."""
EXPERT_STAGES = ("quantize", "gemm1", "activation", "gemm2")


def add_arguments(p: argparse.ArgumentParser, standard: bool = True, schemes: tuple[str, ...] = SCHEMES,
                  default_schemes: tuple[str, ...] | None = None) -> None:  # fmt: skip
    """The options of ``epmoe bench layer`` (torch-free: ``--help`` imports nothing heavy);
    ``standard=False``: those of the layer studies (no ``--rounds``, no ``--plot``). ``schemes``:
    what ``--schemes`` may name, ``default_schemes`` its default (all of ``schemes``)."""
    p.add_argument("--prefill-tokens", type=int, default=4096, help="tokens per rank of the prefill batch")
    p.add_argument("--decode-tokens", type=int, default=128, help="tokens per rank of the decode batch")
    p.add_argument("--schemes", default=",".join(default_schemes or schemes),
                   help=f"comma-separated subset of {','.join(schemes)}")  # fmt: skip
    p.add_argument("--backend", default="auto", help="experts backend of every layer (as DeepEPMoELayer(backend=))")
    p.add_argument("--iters", type=int, default=10, help="timed iterations (the same on every rank)")
    p.add_argument("--warmup", type=int, default=3, help="untimed iterations before each timing")
    if standard:
        p.add_argument("--rounds", type=int, default=5, help="rounds of the schemes taking turns (0: skip them)")
    p.add_argument("--num-sms", type=int, default=None,
                   help="SMs of DeepEP's normal-mode kernels (DeepEPBuffer(num_sms=...)); default: DeepEP's")
    p.add_argument("--json", default=None, help="write results here")
    if standard:
        p.add_argument("--plot", default=None, help="write a PNG of the phases here (needs the 'plot' extra)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds all ranks together may take")


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace,
               schemes: tuple[str, ...] = SCHEMES) -> argparse.Namespace:  # fmt: skip
    from epmoe.dispatch.deepep_dispatch.sizing import check_num_sms

    from .plotting import check_plot

    check_plot(p, getattr(args, "plot", None))
    try:
        check_num_sms(args.num_sms)
    except ValueError as exc:
        p.error(f"--num-sms: {exc}")
    bad = [s for s in args.schemes.split(",") if s not in schemes]
    if bad:
        p.error(f"--schemes {bad} unknown; allowed: {list(schemes)}")
    for name, least in (("iters", 1), ("warmup", 0), ("rounds", 0), ("prefill_tokens", 1), ("decode_tokens", 1)):
        if getattr(args, name, least) < least:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)}; must be >= {least}")
    return args


def _parse(argv):
    p = argparse.ArgumentParser(prog="epmoe bench layer", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return check_args(p, p.parse_args(argv))


# ---------------------------------------------------------------------------------- set-up
def routing(t, seed, rank, device):
    """``t`` random BF16 tokens of this rank and their top-8 of 256 (renormalized)."""
    import torch

    from epmoe.routing import select_experts

    g = torch.Generator(device=device).manual_seed(seed * 1000 + rank)
    x = torch.randn(t, H, generator=g, device=device).to(torch.bfloat16)
    logits = torch.randn(t, E, generator=g, device=device)
    ids, w = select_experts(logits, K, renormalize=True)
    return x, ids.long().contiguous(), w.float().contiguous()


def fill_weights(layer, scheme):
    """Random weights generated on the GPU (dequantized std ~ 1/sqrt(K) per GEMM), seeded per
    rank, so that outputs (``output_abs_sum``) compare between runs and settings."""
    import torch

    g = torch.Generator(device=layer.w13_weight.device).manual_seed(7 + layer.rank)
    with torch.no_grad():
        for w, s, k in ((layer.w13_weight, layer.w13_weight_scale, H), (layer.w2_weight, layer.w2_weight_scale, I)):
            std = k**-0.5
            if scheme == "bf16":
                w.normal_(0.0, std, generator=g)
            else:
                w.copy_(torch.randint(-127, 128, w.shape, dtype=torch.int8, device=w.device, generator=g))
                s.uniform_(0.5 * std / 73.0, 1.5 * std / 73.0, generator=g)  # uniform int8 has std ~73


def _share_weights(dst, src):
    for name in ("w13_weight", "w2_weight", "w13_weight_scale", "w2_weight_scale"):
        if getattr(src, name) is not None:
            setattr(dst, name, getattr(src, name))


def build_layers(scheme, args, owner, device):
    """The layers of one scheme sharing one set of weights: ``normal`` (DeepEP normal, host
    sync on the receive counts), ``low_latency`` and ``bounded`` (normal with
    ``normal_max_tokens_per_rank=args.prefill_tokens``: no host sync)."""
    import torch

    from epmoe.kernels.configs import mode_and_accumulator
    from epmoe.layer import DeepEPMoELayer

    quant, acc = mode_and_accumulator(scheme)
    common = dict(quant=quant, accumulator=acc, backend=args.backend, device=device, params_dtype=torch.bfloat16,
                  deepep_buffer=owner, validate=False, max_tokens_per_rank=args.decode_tokens)  # fmt: skip
    normal = DeepEPMoELayer(E, K, H, I, dispatch="deepep_normal", **common)
    fill_weights(normal, scheme)
    low_latency = DeepEPMoELayer(E, K, H, I, dispatch="deepep_low_latency", **common)
    _share_weights(low_latency, normal)
    bounded = DeepEPMoELayer(E, K, H, I, dispatch="deepep_normal", normal_max_tokens_per_rank=args.prefill_tokens,
                             **common)  # fmt: skip
    _share_weights(bounded, normal)
    torch.cuda.empty_cache()
    return dict(normal=normal, low_latency=low_latency, bounded=bounded)


def open_buffer(args, world):
    """One DeepEP buffer for every layer of the run, sized for both modes."""
    from epmoe.dispatch.deepep_dispatch import DeepEPBuffer
    from epmoe.dispatch.deepep_dispatch.sizing import BufferNeeds

    owner = DeepEPBuffer(num_sms=args.num_sms)
    owner.register(BufferNeeds(H, E, K, args.decode_tokens, frozenset({"normal", "low_latency"})), world)
    return owner


def bytes_sent(ids, rank, payload_row_bytes, mode, world=WORLD):
    """Bytes this rank sends to the ``world`` ranks: dispatch (payload rows + metadata) and, for
    the combine, the BF16 rows that come back; split into remote (other ranks) and local (this rank)."""
    import torch

    e_loc = E // world
    dest = ids // e_loc  # [T, K]
    if mode == "normal":  # one row per (token, destination rank), top-k ids + weights with it
        on = torch.zeros(ids.shape[0], world, dtype=torch.bool, device=ids.device)
        on.scatter_(1, dest, True)
        per_rank = on.sum(0).tolist()
        meta = K * (8 + 4)
    else:  # low-latency: one message per (token, selected expert), 16-byte header
        per_rank = torch.bincount(dest.reshape(-1), minlength=world).tolist()
        meta = 16
    row = payload_row_bytes + meta
    remote = sum(c for r, c in enumerate(per_rank) if r != rank)
    local = per_rank[rank]
    return dict(
        dispatch_remote=remote * row, dispatch_local=local * row,
        combine_remote=remote * H * 2, combine_local=local * H * 2,
        rows_remote=remote, rows_local=local,
    )  # fmt: skip


def payload_row_bytes(payload):
    return {"float": H * 2, "int8_token": H + 4, "int8_group": H + H // 128 * 4,
            "fp8_group": H + H // 128 * 4}[payload]  # fmt: skip


def interleaved(forwards, iters, warmup, rounds, device):
    """Per scheme, the median over ``rounds`` of the mean forward time of ``iters`` back-to-back
    forwards (:func:`epmoe.timing.collective_ms`), the schemes taking turns
    (:func:`epmoe.timing.in_turns`): loops of 10 / 30 / 100 prefill forwards ran 6.78 / 7.08 /
    7.54 ms per BF16 forward, so every scheme gets loops of the same length."""
    from epmoe import timing

    samples = timing.in_turns(forwards, rounds, lambda fn: timing.collective_ms(fn, iters, warmup, device))
    return {n: {"layer_ms": statistics.median(v), "rounds_ms": v} for n, v in samples.items()}


# ---------------------------------------------------------------------------------- the rank
def rank_setup(rank, world, port, args):
    """Inside a rank: the process group, one DeepEP buffer, and this rank's prefill and decode
    batches. Returns ``(device, buffer owner, {"prefill": (x, ids, w), "decode": ...})``."""
    import logging

    from epmoe.launch import init_process_group

    logging.basicConfig(level=logging.WARNING)
    device = init_process_group(rank, world, port, "cuda", timeout_s=300, threads=None)
    owner = open_buffer(args, world)
    batches = {"prefill": routing(args.prefill_tokens, 1, rank, device),
               "decode": routing(args.decode_tokens, 2, rank, device)}  # fmt: skip
    return device, owner, batches


def bench_phases(layers: dict, batches: dict):
    """``(phase, DeepEP mode, layer, batch)``: prefill on the host-synced normal layer, decode on
    the low-latency one."""
    yield "prefill", "normal", layers["normal"], batches["prefill"]
    yield "decode", "low_latency", layers["low_latency"], batches["decode"]


def measure(rank, args, device, owner, batches, *, accept=None, extra=None) -> dict:
    """Every scheme of ``args.schemes`` on this rank: the whole layer, its phases and bytes per
    phase, then (``args.rounds``) the schemes in turns. Every rank calls it with the same
    arguments (the forwards are collectives).

    Args:
        accept: ``(scheme, layers) -> reason or None``: a reason skips the scheme (recorded under
            ``skipped``); it must give the same answer on every rank.
        extra: ``(scheme, phase, mode, layer, (x, ids, w)) -> dict`` merged into each row (more
            measurements on the same layer and batch).

    Returns:
        ``{"rank", "world_size", "schemes": {scheme: {phase: row}}, "skipped": {scheme: reason},
        "interleaved": ...}``; ``device`` names this rank's GPU.
    """
    import torch
    import torch.distributed as dist

    from epmoe import timing

    (xp, idp, wp), (xd, idd, wd) = batches["prefill"], batches["decode"]
    world = dist.get_world_size()
    res: dict = dict(rank=rank, world_size=world, device=device_name(device), schemes={}, skipped={})
    turns: dict[str, dict] = {"prefill": {}, "decode": {}}  # per phase, scheme -> one forward
    try:  # a failing rank raises: the launcher ends its peer, which may wait in a collective
        for scheme in args.schemes.split(","):
            layers = build_layers(scheme, args, owner, device)
            reason = accept(scheme, layers) if accept else None
            if reason:
                res["skipped"][scheme] = reason
                del layers
                torch.cuda.empty_cache()
                continue
            entry = {}
            for phase, mode, layer, (x, ids, w) in bench_phases(layers, batches):
                row = dict(backend=layer.backend.name, dispatcher=layer.dispatcher.name, payload=layer.payload,
                           tokens=x.shape[0])  # fmt: skip
                forward = lambda lay=layer, x=x, ids=ids, w=w: lay(x, topk_ids=ids, topk_weights=w)  # noqa: E731
                ref = forward()
                row["layer_ms"] = timing.collective_ms(forward, args.iters, args.warmup, device)
                row["tokens_per_s"] = x.shape[0] / row["layer_ms"] * 1e3
                row["phases_ms"] = timing.profile_phases(forward, args.iters, args.warmup, device)
                row["output_abs_sum"] = float(ref.float().abs().sum())  # compares runs and configs
                row["bytes"] = bytes_sent(ids, rank, payload_row_bytes(layer.payload), mode, world)
                if extra:
                    row.update(extra(scheme, phase, mode, layer, (x, ids, w)))
                entry[phase] = row
            res["schemes"][scheme] = entry
            if args.rounds:
                # Kept for the comparison under the same load below: every scheme's weights stay
                # on the GPU until then (~11 GB BF16 + ~5.6 GB per INT8 scheme per rank on 2 ranks).
                lb, ll = layers["bounded"], layers["low_latency"]
                turns["prefill"][scheme] = lambda lay=lb: lay(xp, topk_ids=idp, topk_weights=wp)
                turns["decode"][scheme] = lambda lay=ll: lay(xd, topk_ids=idd, topk_weights=wd)
            del layers
            torch.cuda.empty_cache()
        if args.rounds and res["schemes"]:
            res["interleaved"] = {phase: interleaved(fns, args.iters, args.warmup, args.rounds, device)
                                  for phase, fns in turns.items()}  # fmt: skip
    finally:
        turns.clear()
    return res


def _rank_main(rank, world, port, args):
    import torch.distributed as dist

    from epmoe import timing

    t0 = time.time()
    device, owner, batches = rank_setup(rank, world, port, args)
    res = measure(rank, args, device, owner, batches)
    res["rank_seconds"] = time.time() - t0
    timing.barrier(device)
    owner.close()
    dist.destroy_process_group()
    return res


# ---------------------------------------------------------------------------------- report
def device_name(device) -> str | None:
    """The name of the GPU ``device`` (a ``torch.device``), ``None`` for another kind."""
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else None


def ranks_device(ranks: list[dict]) -> str | None:
    """The GPUs the ranks ran on (each rank's ``device``): the one name when they agree, else
    ``"rank 0: <name>; rank 1: <name>; ..."``; ``None`` when no rank recorded one. Asked of the
    ranks, not of the launcher's GPU 0: rank ``r`` runs on GPU ``r``, not always the same model."""
    names = [r.get("device") for r in ranks]
    if not any(names):
        return None
    if len(set(names)) == 1:
        return names[0]
    return "; ".join(f"rank {r['rank']}: {n or 'unknown'}" for r, n in zip(ranks, names))


def _summary(ranks, args):
    import torch

    r0 = ranks[0]
    out = dict(
        config=dict(num_experts=E, top_k=K, hidden=H, intermediate=I, world_size=len(ranks),
                    prefill_tokens=args.prefill_tokens, decode_tokens=args.decode_tokens,
                    iters=args.iters, warmup=args.warmup, rounds=args.rounds,
                    backend_requested=args.backend, deepep_normal_num_sms=args.num_sms,
                    device=ranks_device(ranks),
                    torch=torch.__version__),
        ranks=ranks,
        ratios={},
    )  # fmt: skip
    base = r0["schemes"].get("bf16", {})
    for scheme, entry in r0["schemes"].items():
        for phase in entry:
            if phase in base:
                # Throughput of the slower rank, against BF16's.
                slow = max(r["schemes"][scheme][phase]["layer_ms"] for r in ranks)
                slow_b = max(r["schemes"]["bf16"][phase]["layer_ms"] for r in ranks)
                out["ratios"][f"{scheme}/{phase}"] = slow_b / slow
    got = [r.get("interleaved") for r in ranks]
    if all(got):
        for phase, per in got[0].items():
            if "bf16" in per:
                slow_b = max(g[phase]["bf16"]["layer_ms"] for g in got)
                for scheme in per:
                    slow = max(g[phase][scheme]["layer_ms"] for g in got)
                    out["ratios"][f"{scheme}/{phase}_interleaved"] = slow_b / slow
    return out


def _table(summary) -> str:
    lines = []
    hdr = f"{'scheme':<19}{'phase':<8}{'backend':<8}{'layer ms':>9}{'x bf16':>7}  " + " ".join(
        f"{p[:8]:>8}" for p in PHASES
    )
    lines.append(hdr)
    for r in summary["ranks"]:
        for scheme, entry in r["schemes"].items():
            for phase, row in entry.items():
                ph = row["phases_ms"]
                ratio = summary["ratios"].get(f"{scheme}/{phase}", float("nan"))
                lines.append(
                    f"{scheme:<19}{phase:<8}{row['backend']:<8}{row['layer_ms']:>9.3f}{ratio:>7.2f}  "
                    + " ".join(f"{ph[p]:>8.3f}" if p in ph else f"{'-':>8}" for p in PHASES)
                    + f"  rank {r['rank']}"
                )
    lines.append("phases: device ms per forward of the layer's profiler ranges (experts holds quantize..gemm2)")
    how = f"{summary['config'].get('rounds')} rounds of turns"
    for phase, per in (summary["ranks"][0].get("interleaved") or {}).items():
        what = "bounded prefill (normal_max_tokens_per_rank)" if phase == "prefill" else "low-latency decode"
        lines.append(
            f"interleaved throughput, {what}, {how}, slower rank: "
            + ", ".join(f"{s} {max(r['interleaved'][phase][s]['layer_ms'] for r in summary['ranks']):.3f} ms "
                        f"({summary['ratios'].get(f'{s}/{phase}_interleaved', float('nan')):.2f}x bf16)" for s in per)
        )  # fmt: skip
    return "\n".join(lines)


def _stacked_phases(rank_summary: dict, phase: str) -> tuple[list[str], list[tuple[str, list, list, str]]]:
    """Schemes of one panel and its bar segments ``(layer phase, heights, bottoms, color)``.

    A layer phase keeps its color in every panel (decode has no scatter or gather: colors taken
    in turn from the cycle would shift there and contradict the legend). ``experts`` is drawn
    only for a scheme whose backend placed no stage ranges inside it (they would count twice)."""
    names = [s for s in rank_summary["schemes"] if phase in rank_summary["schemes"][s]]
    bottom = [0.0] * len(names)
    segments = []
    for i, p in enumerate(PHASES):
        vals = []
        for s in names:
            times = rank_summary["schemes"][s][phase]["phases_ms"]
            staged = any(st in times for st in EXPERT_STAGES)
            vals.append(0.0 if p == "experts" and staged else times.get(p, 0.0))
        if any(vals):
            segments.append((p, vals, bottom, f"C{i}"))
            bottom = [b + v for b, v in zip(bottom, vals)]
    return names, segments


def _plot(summary, path):
    from .plotting import pyplot

    plt = pyplot()
    r0 = summary["ranks"][0]
    fig, axes = plt.subplots(1, 2, figsize=(14, 5))
    for ax, phase in zip(axes, ("prefill", "decode")):
        names, segments = _stacked_phases(r0, phase)
        for p, vals, bottom, color in segments:
            ax.bar(names, vals, bottom=bottom, label=p, color=color)
        ax.plot(names, [r0["schemes"][s][phase]["layer_ms"] for s in names], "k_", markersize=40,
                label="whole layer")  # fmt: skip
        ax.set_title(f"{phase} ({r0['schemes'][names[0]][phase]['tokens']} tokens/rank), rank 0")
        ax.set_ylabel("ms")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def launch(rank_main, args: argparse.Namespace, what: str, world: int = WORLD) -> tuple[list | None, int]:
    """``rank_main`` on ``world`` GPUs: ``(per-rank results, 0)``, or ``(None, exit code)`` after
    saying on stderr why not (too few GPUs: 2; a rank failed or timed out: 1)."""
    import torch

    from epmoe.launch import RankError, run_ranks

    if not torch.cuda.is_available() or torch.cuda.device_count() < world:
        print(f"{what} needs {world} CUDA GPUs", file=sys.stderr)
        return None, 2
    try:
        return run_ranks(rank_main, world, args, timeout_s=args.timeout), 0
    except (RankError, TimeoutError) as exc:
        print(f"{what} failed: {exc}", file=sys.stderr)
        return None, 1


def write_json(data: dict, path: str | None) -> None:
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(data, f, indent=1)


def run(args: argparse.Namespace) -> int:
    """The benchmark for parsed (and checked) options; its exit code."""
    ranks, code = launch(_rank_main, args, "epmoe bench layer")
    if ranks is None:
        return code
    summary = _summary(ranks, args)
    write_json(summary, args.json)
    if args.plot:
        os.makedirs(os.path.dirname(os.path.abspath(args.plot)), exist_ok=True)
        _plot(summary, args.plot)
    print(_table(summary))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run(_parse(list(sys.argv[1:] if argv is None else argv)))


if __name__ == "__main__":
    sys.exit(main())
