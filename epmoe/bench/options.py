"""The options of ``epmoe bench experts`` and ``epmoe fidelity``, importable without torch (``--help``
and the parsers)."""

from __future__ import annotations

import argparse

from .plotting import check_plot

EXPERTS_BACKENDS = ("torch_bf16", "triton_int8_channel", "triton_int8_channel_int32", "triton_int8_block", "triton_bf16")
"""The built-in rows of ``epmoe bench experts``: the BF16 ``torch._grouped_mm`` baseline and the
Triton backend per scheme (``_int32``: the int32 accumulator)."""


def add_experts_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``epmoe bench experts``."""
    p.add_argument("--m", default="8,32,128,512,2048", help="rows per expert, comma separated")
    p.add_argument("--experts", type=int, default=128, help="local experts E_loc")
    p.add_argument("--hidden", type=int, default=7168, help="hidden size H")
    p.add_argument("--intermediate", type=int, default=2048, help="intermediate size I of one expert")
    p.add_argument("--backends", default=",".join(EXPERTS_BACKENDS),
                   help=f"comma-separated subset of {','.join(EXPERTS_BACKENDS)}")
    p.add_argument("--extra", action="append", default=[],
                   help="module:Class[@scheme][?key=value&...] of another ExpertsBackend (repeatable; scheme may "
                        "be int8_channel_int32 for the int32 accumulator; key=value: keyword arguments of the "
                        "backend, e.g. ?schedule=n256_quarters_run2)")
    p.add_argument("--masked", action="store_true",
                   help="also time each Triton row and each --extra backend that runs the masked layout on it "
                        "(rows per expert in slabs of m rounded up to 128, as low-latency dispatch delivers them)")
    p.add_argument("--json", default=None, help="write all numbers here")
    p.add_argument("--plot", default=None, help="write a PNG here (needs the 'plot' extra)")
    p.add_argument("--rep-ms", type=float, default=200.0, help="do_bench repetition time per measurement")
    p.add_argument("--ceiling-size", type=int, default=8192, help="edge of the ceiling matmuls")
    p.add_argument("--accuracy-experts", type=int, default=2, help="experts checked against float64")
    p.add_argument(
        "--turns", type=int, default=0,
        help="also time every backend's whole pass in turns, this many rounds per m (0: off); "
        "the fair comparison under the GPU's power cap (epmoe.timing.in_turns)",
    )  # fmt: skip


def check_experts_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Checks and normalizes parsed options (``p.error`` names the bad one)."""
    try:
        args.m = [int(v) for v in args.m.split(",") if v]
    except ValueError:
        p.error(f"--m must be comma-separated integers; got {args.m!r}")
    if not args.m or min(args.m) < 1:
        p.error(f"--m needs one or more row counts >= 1; got {args.m}")
    args.backends = [b for b in args.backends.split(",") if b]
    unknown = set(args.backends) - set(EXPERTS_BACKENDS)
    if unknown:
        p.error(f"unknown --backends {sorted(unknown)}; allowed: {list(EXPERTS_BACKENDS)}")
    if args.turns < 0:
        p.error(f"--turns must be 0 (off) or a number of rounds; got {args.turns}")
    check_plot(p, args.plot)
    return args


FIDELITY_DESCRIPTION = "Error of each quantization scheme against float64 on the MoE layer output."


def add_fidelity_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``epmoe fidelity``."""
    p.add_argument("--checkpoint", help="checkpoint directory (FP8 or converted INT8); default: synthetic weights")
    p.add_argument("--layer", type=int, help="decoder layer of --checkpoint to read (required with it)")
    p.add_argument(
        "--experts", type=int, help="experts to use (synthetic: default 32; checkpoint: the first N, default all)"
    )
    p.add_argument("--hidden", type=int, default=512, help="synthetic hidden size, a multiple of 128")
    p.add_argument("--intermediate", type=int, default=256, help="synthetic expert intermediate size, a multiple of 128")
    p.add_argument("--tokens", type=int, default=512, help="tokens routed through the layer, >= 1")
    p.add_argument("--top-k", type=int, default=8, help="experts per token")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic weights, activations and router")
    p.add_argument("--json", help="write the full result as JSON here")
    p.add_argument("--markdown", help="write the table here")
