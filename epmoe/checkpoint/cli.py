"""The ``epmoe convert`` and ``epmoe make-checkpoint`` commands.

Importing this module imports neither torch nor the converter, so ``--help`` is instant:
``add_*_arguments`` declare the options, ``run_*`` import what they need and run.
"""

from __future__ import annotations

import argparse
import json
import sys

from .formats import TARGETS



def add_convert_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``epmoe convert``."""
    parser.add_argument(
        "--to", dest="target", required=True, choices=TARGETS,
        help="output scheme (required): int8_channel (one fp32 scale per output channel) or "
        "int8_block (one per 128x128 block)",
    )  # fmt: skip
    parser.add_argument("src", metavar="SRC", help="DeepSeek FP8 checkpoint directory")
    parser.add_argument("dst", metavar="DST", help="output directory (new or empty; not inside SRC)")
    parser.add_argument(
        "--dense", action="store_true",
        help="also convert the dense linear weights (attention, dense MLP); experts always are (default: off)",
    )  # fmt: skip
    parser.add_argument(
        "--resume", action="store_true",
        help="continue an interrupted conversion in DST; refused when a source shard changed since "
        "it started (default: off)",
    )  # fmt: skip
    parser.add_argument(
        "--verify", "--verify-hash", dest="verify_hash", action="store_true",
        help="hash file contents in full (SHA-256): the source shards, and with --resume the "
        "output shards already written, instead of trusting size, modification time and header "
        "(default: off)",
    )  # fmt: skip
    parser.add_argument("--quiet", action="store_true", help="no progress output (default: off)")
    parser.add_argument(
        "--json", action="store_true",
        help="print a JSON summary on stdout instead of the sentence (default: off)",
    )  # fmt: skip


def run_convert(args: argparse.Namespace) -> int:
    """Run ``epmoe convert`` with parsed ``args``: exit status 0 when done, 2 for a refused input,
    1 for an I/O error (rerun with --resume), 130 when interrupted."""
    from .convert import convert_checkpoint
    from .progress import fmt_bytes

    try:
        res = convert_checkpoint(
            args.src, args.dst, args.target, dense=args.dense, resume=args.resume,
            progress=not args.quiet, verify_hash=args.verify_hash,
        )  # fmt: skip
    except (ValueError, FileNotFoundError) as exc:
        print(f"epmoe convert: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # disk full, permissions: the shards finished so far are kept
        print(f"epmoe convert: error: {exc}; fix the cause and rerun with --resume", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("epmoe convert: interrupted; rerun with --resume to continue", file=sys.stderr)
        return 130
    if args.json:
        print(json.dumps(res.summary(), indent=2))
        return 0
    print(
        f"converted {res.tensors_converted} weights to {res.target}: {len(res.shards_written)} shards "
        f"written, {len(res.shards_skipped)} kept from an earlier run, {fmt_bytes(res.total_size)} "
        f"of tensors in {res.dst}"
    )
    return 0


def add_make_checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``epmoe make-checkpoint``."""
    parser.add_argument("dst", metavar="DST", help="output directory (new or empty)")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers (default: 2)")
    parser.add_argument(
        "--first-k-dense", type=int, default=1,
        help="leading layers with a dense MLP instead of experts (default: 1)",
    )  # fmt: skip
    parser.add_argument("--experts", type=int, default=8, help="routed experts per MoE layer (default: 8)")
    parser.add_argument("--top-k", type=int, default=2, help="experts per token (default: 2)")
    parser.add_argument(
        "--hidden", type=int, default=256, help="hidden size, a multiple of 128 (default: 256)"
    )
    parser.add_argument(
        "--intermediate", type=int, default=128,
        help="expert intermediate size, a multiple of 128 (default: 128)",
    )  # fmt: skip
    parser.add_argument("--shards", type=int, default=3, help="safetensors files (default: 3)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")


def run_make_checkpoint(args: argparse.Namespace) -> int:
    """Run ``epmoe make-checkpoint`` with parsed ``args``: 0 when written, 2 for a refused value."""
    from pathlib import Path

    from .synthetic import write_synthetic_checkpoint

    try:
        root = write_synthetic_checkpoint(
            args.dst, num_layers=args.layers, first_k_dense=args.first_k_dense, experts=args.experts,
            top_k=args.top_k, hidden=args.hidden, intermediate=args.intermediate, shards=args.shards,
            seed=args.seed,
        )  # fmt: skip
    except (ValueError, FileExistsError) as exc:
        print(f"epmoe make-checkpoint: error: {exc}", file=sys.stderr)
        return 2
    size = sum(p.stat().st_size for p in Path(root).glob("*.safetensors"))
    print(
        f"wrote a DeepSeek-V3-named FP8 checkpoint to {root}: {args.layers} layers "
        f"({args.layers - args.first_k_dense} with {args.experts} experts), {args.shards} shards, "
        f"{size} bytes of tensors; try `epmoe convert --to int8_channel {root} OUT`"
    )
    return 0


def convert_main(argv: list[str] | None = None) -> int:
    """``epmoe convert --to int8_channel|int8_block [--dense] [--resume] [--json] SRC DST``."""
    parser = argparse.ArgumentParser(
        prog="epmoe convert",
        description="Convert a DeepSeek FP8 block checkpoint to INT8 (channel-wise or block-wise).",
    )
    add_convert_arguments(parser)
    return run_convert(parser.parse_args(argv))


def make_checkpoint_main(argv: list[str] | None = None) -> int:
    """``epmoe make-checkpoint DST [--layers N --experts E --hidden H --intermediate I ...]``."""
    parser = argparse.ArgumentParser(
        prog="epmoe make-checkpoint",
        description="Write a small synthetic DeepSeek-V3-named FP8 checkpoint, to try conversion "
        "and loading without a real model.",
    )
    add_make_checkpoint_arguments(parser)
    return run_make_checkpoint(parser.parse_args(argv))
