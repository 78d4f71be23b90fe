"""The ``epmoe`` command: info, demo, bench {experts,layer}, convert, make-checkpoint, fidelity.

Parsers are built from torch-free modules, so ``epmoe --help`` and ``epmoe CMD --help`` import no
torch; a command imports what it runs only once its arguments parsed.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from . import __version__

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Help that shows every option's default, descriptions as written."""


def capability_rows(device: "torch.device") -> list[tuple[str, str, str]]:
    """``(kind, name, status)`` for every backend x scheme and every dispatcher on ``device``."""
    from .dispatch.base import DispatchConfig
    from .dispatch.select import DISPATCHERS, dispatcher_decisions
    from .experts.select import BACKENDS, backend_decisions
    from .kernels.configs import INT32_ACC_MODE, mode_and_accumulator
    from .quant.schemes import SCHEMES, get_scheme

    rows = []
    both, contiguous = frozenset({"contiguous", "masked"}), frozenset({"contiguous"})
    keys = [k for name in SCHEMES for k in ((name, INT32_ACC_MODE) if name == "int8_channel" else (name,))]
    for name in BACKENDS:
        for key in keys:
            quant, accumulator = mode_and_accumulator(key)
            scheme = get_scheme(quant)
            ((_, cls, reason),) = backend_decisions(scheme, both, device, 7168, 2048, (name,), accumulator)
            status = "available" if cls else reason
            if cls is None:  # contiguous-only backends (cutlass) still serve DeepEP normal mode
                ((_, cls, _),) = backend_decisions(scheme, contiguous, device, 7168, 2048, (name,), accumulator)
                status = "available (contiguous layout only)" if cls else reason
            rows.append(("backend", f"{name} {key}", status))
    # Which INT8 kernel the cutlass backend runs at which rows per expert (measured crossovers).
    from .experts.cutlass_backend import (
        INT8_BLOCK_SCHEDULE_ENV, INT8_BLOCK_TILE_N, gemm1_note, int8_block_schedule, int8_rule,
    )  # fmt: skip

    for key in ("int8_channel_int32", "int8_block"):
        quant, _ = mode_and_accumulator(key)
        rows.append(("int8 rule", f"cutlass {key}", int8_rule(device, quant).describe()))
    try:  # what a cutlass backend built now would run (a bad value is shown, not raised)
        name = int8_block_schedule(device)
        schedule = (f"{name} (128 x {INT8_BLOCK_TILE_N[name]} tiles; ${INT8_BLOCK_SCHEDULE_ENV}, else the one "
                    f"measured for this GPU, else the default); {gemm1_note(name)}")  # fmt: skip
    except ValueError as exc:
        schedule = str(exc)
    rows.append(("int8 rule", "cutlass int8_block schedule", schedule))
    # Dense INT8 linears (epmoe.Int8Linear) at a DeepSeek-V3 shape (q_a_proj, 7168 -> 1536).
    from .linear import dense_backend_decisions

    for scheme, accumulator in (("int8_channel", "int32"), ("int8_channel", "fp32"), ("int8_block", "fp32")):
        for name, ok, reason in dense_backend_decisions(scheme, accumulator, device, 7168, 1536):
            rows.append(("dense", f"{name} {scheme} {accumulator}", "available" if ok else reason))
    # Two ranks: what an EP deployment of this machine would be offered.
    cfg = DispatchConfig(num_experts=256, hidden_size=7168, top_k=8, world_size=2, device=device)
    for name, cls, reason in dispatcher_decisions(cfg, tuple(DISPATCHERS)):
        rows.append(("dispatcher", name, "available" if cls else reason))
    return rows


INFO_DISPATCH_NOTE = (
    "dispatchers: as offered to a 2-rank EP group on this machine at DeepSeek-V3 sizes "
    "(256 experts, top-8, hidden 7168); in one process only 'local' runs"
)


def _info_rows_json(device) -> dict:
    rows = capability_rows(device)
    out: dict = {"backends": [], "dense": [], "int8_rules": [], "dispatchers": [], "dispatcher_note": INFO_DISPATCH_NOTE}
    for kind, name, status in rows:
        available = status.startswith("available")
        if kind == "backend":
            backend, key = name.split(" ", 1)
            out["backends"].append(dict(backend=backend, scheme=key, available=available, status=status))
        elif kind == "dense":
            backend, scheme, accumulator = name.split(" ")
            out["dense"].append(dict(backend=backend, scheme=scheme, accumulator=accumulator, available=available,
                                     status=status))  # fmt: skip
        elif kind == "dispatcher":
            out["dispatchers"].append(dict(dispatcher=name, available=available, status=status))
        elif kind == "int8 rule":
            out["int8_rules"].append(dict(name=name, rule=status))
        else:
            raise ValueError(f"capability row of unknown kind {kind!r}: add it to epmoe info --json")
    return out


def run_info(args: argparse.Namespace, parser: argparse.ArgumentParser | None = None) -> int:
    import torch

    try:
        import triton

        triton_version, triton_text = triton.__version__, f"triton {triton.__version__}"
    except ImportError as exc:
        triton_version, triton_text = None, f"no triton ({exc})"
    # The current GPU, named with its index: the measured rules are looked up per device.
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    gpu = None
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability(device)
        gpu = dict(name=torch.cuda.get_device_name(device), sm=f"sm_{cap[0]}{cap[1]}", cuda=torch.version.cuda)
    if args.json:
        report = dict(epmoe=__version__, torch=torch.__version__, triton=triton_version, device=device.type, gpu=gpu)
        report.update(_info_rows_json(device))
        print(json.dumps(report, indent=1))
        return 0
    print(f"epmoe {__version__}; torch {torch.__version__}; {triton_text}; device {device}", end="")
    if gpu:
        print(f" ({gpu['name']}, {gpu['sm']}, CUDA {gpu['cuda']})", end="")
    print()
    rows = capability_rows(device)
    for i, (kind, name, status) in enumerate(rows):
        if kind == "dispatcher" and rows[i - 1][0] != "dispatcher":
            print(INFO_DISPATCH_NOTE)
        print(f"{kind:<10} {name:<36} {status}")
    return 0


def _run_demo(args, parser):
    from .demo import check_args, run

    return run(check_args(parser, args))


def _run_bench_experts(args, parser):
    from .bench.experts import run
    from .bench.options import check_experts_args

    return run(check_experts_args(parser, args))


def _run_bench_layer(args, parser):
    from .bench.layer import check_args, run

    return run(check_args(parser, args))


def _run_convert(args, parser):
    from .checkpoint.cli import run_convert

    return run_convert(args)


def _run_make_checkpoint(args, parser):
    from .checkpoint.cli import run_make_checkpoint

    return run_make_checkpoint(args)


def _run_fidelity(args, parser):
    from .bench.fidelity import run

    return run(args, parser)


def build_parser() -> argparse.ArgumentParser:
    """The whole command line (torch-free)."""
    from .bench import layer as bench_layer
    from .bench.options import FIDELITY_DESCRIPTION, add_experts_arguments, add_fidelity_arguments
    from .checkpoint.cli import add_convert_arguments, add_make_checkpoint_arguments
    from .demo import add_arguments as add_demo_arguments

    common = argparse.ArgumentParser(add_help=False)
    logs = common.add_argument_group("logging")
    logs.add_argument("-v", "--verbose", dest="log_level", action="store_const", const="INFO", default="WARNING",
                      help="log every choice and its reason (the 'epmoe' logger at INFO)")
    logs.add_argument("--log-level", dest="log_level", choices=LOG_LEVELS, default="WARNING",
                      help="level of the 'epmoe' logger")  # fmt: skip

    p = argparse.ArgumentParser(prog="epmoe", description="Expert-parallel MoE layers for inference.",
                                formatter_class=_Formatter)  # fmt: skip
    p.add_argument("--version", action="version", version=f"epmoe {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", title="commands")

    def command(name, help_text, func, add=None, parent=sub, prog_help=None):
        sp = parent.add_parser(name, help=help_text, description=prog_help or help_text, parents=[common],
                               formatter_class=_Formatter)  # fmt: skip
        if add is not None:
            add(sp)
        sp.set_defaults(_func=func, _parser=sp)
        return sp

    info = command("info", "what this machine can run, and why not", run_info,
                   prog_help="What this machine can run: every backend x scheme and every dispatcher, with "
                   "'available' or the reason it is not.")  # fmt: skip
    info.add_argument("--json", action="store_true", help="print one JSON object (backends, dispatchers) instead")
    command("demo", "a DeepSeek-style MoE layer under EP in local processes", _run_demo, add_demo_arguments)
    bench = sub.add_parser("bench", help="the standard benchmarks: experts | layer", formatter_class=_Formatter,
                           description="The standard benchmarks (studies: benchmarks/ in the repository).")
    bench_sub = bench.add_subparsers(dest="benchmark", metavar="BENCHMARK", title="benchmarks")
    bench.set_defaults(_func=None, _parser=bench)
    command("experts", "the routed-experts pass on one GPU, every backend side by side", _run_bench_experts,
            add_experts_arguments, parent=bench_sub)  # fmt: skip
    command("layer", "the EP layer over DeepEP on 2 GPUs at DeepSeek-V3 shapes", _run_bench_layer,
            bench_layer.add_arguments, parent=bench_sub)  # fmt: skip
    command("convert", "convert an FP8 checkpoint to INT8", _run_convert, add_convert_arguments)
    command("make-checkpoint", "a small synthetic FP8 checkpoint to try convert on", _run_make_checkpoint,
            add_make_checkpoint_arguments)  # fmt: skip
    command("fidelity", "error of every scheme against float64", _run_fidelity, add_fidelity_arguments,
            prog_help=FIDELITY_DESCRIPTION)  # fmt: skip
    return p


def main(argv: list[str] | None = None) -> int:
    """``epmoe ...``: the command's exit code (2: no or an unknown command, bad arguments)."""
    p = build_parser()
    try:
        args = p.parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as exc:  # --help, --version (0) and argument errors (2)
        return int(exc.code or 0)
    if args.command is None or args._func is None:
        args._parser.print_usage(sys.stderr) if args.command else p.print_usage(sys.stderr)
        what = "a benchmark" if args.command else "a command"
        print(f"{p.prog}: error: {what} is required (--help lists them)", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level, format="%(name)s: %(message)s")
    logging.getLogger("epmoe").setLevel(args.log_level)
    func, parser = args._func, args._parser
    del args._func, args._parser  # the options travel to spawned ranks: plain data only
    try:
        return int(func(args, parser) or 0)
    except SystemExit as exc:  # a command's own argument check (p.error)
        return int(exc.code or 0)


if __name__ == "__main__":
    sys.exit(main())
