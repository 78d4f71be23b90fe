"""The ``epmoe`` command: info, demo, bench, convert, make-checkpoint, fidelity."""

from __future__ import annotations

import importlib
import sys

import torch

COMMANDS = {
    "info": ("epmoe.cli", "info_main", "what this machine can run, and why not"),
    "demo": ("epmoe.demo", "main", "a DeepSeek-style MoE layer under EP in local processes"),
    "bench": (None, None, "bench experts | bench layer"),
    "convert": ("epmoe.checkpoint.cli", "convert_main", "convert an FP8 checkpoint to INT8"),
    "make-checkpoint": ("epmoe.checkpoint.cli", "make_checkpoint_main", "a small synthetic FP8 checkpoint to try convert on"),
    "fidelity": ("epmoe.bench.fidelity", "main", "error of every scheme against float64"),
}
BENCHES = {
    "experts": ("epmoe.bench.experts", "main"),
    "layer": ("epmoe.bench.layer", "main"),
}


def capability_rows(device: torch.device) -> list[tuple[str, str, str]]:
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
    from .experts.cutlass_backend import int8_rule

    for key in ("int8_channel_int32", "int8_block"):
        quant, _ = mode_and_accumulator(key)
        rows.append(("int8 rule", f"cutlass {key}", int8_rule(device, quant).describe()))
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


def info_main(argv: list[str] | None = None) -> int:
    import argparse

    from . import __version__

    argparse.ArgumentParser(
        prog="epmoe info",
        description="What this machine can run: every backend x scheme and every dispatcher, with "
        "'available' or the reason it is not.",
    ).parse_args(argv)

    try:
        import triton

        triton_text = f"triton {triton.__version__}"
    except ImportError as exc:
        triton_text = f"no triton ({exc})"
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    print(f"epmoe {__version__}; torch {torch.__version__}; {triton_text}; device {device}", end="")
    if device.type == "cuda":
        cap = torch.cuda.get_device_capability()
        print(f" ({torch.cuda.get_device_name()}, sm_{cap[0]}{cap[1]}, CUDA {torch.version.cuda})", end="")
    print()
    rows = capability_rows(device)
    for i, (kind, name, status) in enumerate(rows):
        if kind == "dispatcher" and rows[i - 1][0] != "dispatcher":
            print(INFO_DISPATCH_NOTE)
        print(f"{kind:<10} {name:<36} {status}")
    return 0


def _usage(word: str | None, unknown: str, allowed: list[str], lines: list[str]) -> int:
    """The usage ``lines`` for ``word``: asked for (``-h`` / ``--help``) on stdout, exit code 0;
    otherwise on stderr, after naming an unknown ``word`` (``None``: nothing given), exit code 2."""
    asked = word in ("-h", "--help")
    out = sys.stdout if asked else sys.stderr
    if word is not None and not asked:
        print(f"{unknown} {word!r}; allowed: {allowed}", file=out)
    for line in lines:
        print(line, file=out)
    return 0 if asked else 2


def _run(module: str, func: str, argv: list[str]) -> int:
    return int(getattr(importlib.import_module(module), func)(argv) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        lines = ["usage: epmoe <command> [args]  (epmoe <command> --help for its options)\n\ncommands:"]
        lines += [f"  {name:<15} {help_text}" for name, (_, _, help_text) in COMMANDS.items()]
        return _usage(argv[0] if argv else "-h", "epmoe: unknown command", list(COMMANDS), lines)
    cmd, rest = argv[0], argv[1:]
    if cmd == "bench":
        if not rest or rest[0] not in BENCHES:
            usage = [f"usage: epmoe bench {{{'|'.join(BENCHES)}}} [args]"]
            return _usage(rest[0] if rest else None, "epmoe bench: unknown benchmark", list(BENCHES), usage)
        return _run(*BENCHES[rest[0]], rest[1:])
    module, func, _ = COMMANDS[cmd]
    return _run(module, func, rest)


if __name__ == "__main__":
    sys.exit(main())
