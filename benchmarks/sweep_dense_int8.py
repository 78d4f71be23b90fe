"""Measure, per DeepSeek-V3 dense shape and batch, which INT8 kernel and launch runs fastest on this
GPU, and write the table that ``epmoe.Int8Linear`` ships (``epmoe/configs/dense_int8_<device>.json``,
read by :mod:`epmoe.kernels.dense_configs`). This script is the table's only source: rerun it (a
few minutes on one H200) and commit the file it writes.

    python benchmarks/sweep_dense_int8.py                       # writes the package's table
    SGLANG_CUTLASS_MOE=1 python benchmarks/sweep_dense_int8.py  # the CUTLASS kernel timed too
    python benchmarks/sweep_dense_int8.py --out /tmp/t.json --report sweep.json --budget-s 200

For every (mode, shape, M) cell it times, as CUDA-graph replays over enough weight copies that L2
never holds the weight a call reads (GPU time, what a graph-captured step sees), every kernel the
``auto`` backend can run there, each call through :func:`epmoe.linear.run_kernel` (the function the
layer's forward calls, activation quantization included):

* the small-batch kernel's default launch for the batch (the rule of
  :func:`epmoe.kernels.dense_int8.small_m_config`) and its neighbours: every N tile (16 to 128)
  at the rule's K split, half and twice that split (and none) at the rule's N tile, the
  activation quantization fused or not (channel scheme up to 8 rows, ``--fuse-up-to`` for more;
  elsewhere fusion never won on the H200); from 256 rows, unfused 64- and 128-row tiles with and
  without a K split;
* above :data:`~epmoe.kernels.dense_configs.SMALL_M_MAX` rows (below, the tiled GEMMs lost to the
  small-batch kernel in every cell on the H200): the Triton tiled GEMM (its own tile config, and on
  the GPU persistent TMA tiles of 128 x 128 and 128 x 64, for the narrow layers), and with
  ``SGLANG_CUTLASS_MOE=1`` the CUTLASS INT8 kernels, cooperative and pingpong, each walking its
  tiles along N and along M with swizzles of 1, 2, 4 and 8 (one walk each when the batch is one
  128-row block);

* on a Hopper GPU, the cell's fastest small-batch launch once more as a programmatic dependent
  launch (``SmallMConfig.pdl``: its kernel boundaries overlap the kernel before), and again with
  each weight prefetch of ``PREFETCH_CHOICES`` (``SmallMConfig.prefetch``: the first weight bytes
  fetched into L2 while the kernel before finishes);

at M = 1, 4, 16, 32, 64, 256, 1024, 4096 and 16384 (the table's row buckets).
``--update --small-from-table`` re-times, at up to 64 rows, only the table's own small-batch
launch of each bucket (and its PDL twins; ``--prefetch`` sets their bounds) instead of searching its
neighbours again.

Before it is timed, each candidate's output is checked against a float64 product of the same
quantized operands (:func:`output_error`): a launch that is fast because it skips tiles is
reported under ``failures`` and never enters the table.

A cell's entry lists each kernel's fastest launch, fastest first (the plan takes the first one the
layer's backend runs); ``--report`` also keeps every candidate's time. Cells left when
``--budget-s`` runs out keep the default rule and are listed under ``skipped`` (``--update`` keeps
the table's earlier entries for them and for modes, row buckets and shapes not swept, e.g. one run
per mode). Modes: ``int8_channel_int32`` (``auto``'s default) first, then ``int8_block_fp32``. The
CUTLASS extension is built (first use) before the budget's clock starts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_dense_int8 import (  # noqa: E402
    MAX_COPIES, ROTATE_BYTES, SHAPES, TINY_MS, TINY_SHAPES, time_graph,
)
from benchmarks.provenance import git_commit  # noqa: E402

MODES = ("int8_channel_int32", "int8_block_fp32")
SWEEP_MS = [1, 4, 16, 32, 64, 256, 1024, 4096, 16384]
"""Row buckets: a batch takes the entry of the smallest one at or above its rows, so the small
ones are dense where the best launch changes fastest (fused or not, tile height)."""


def _mode(mode: str) -> tuple[str, str]:
    scheme, acc = mode.rsplit("_", 1)
    return scheme, acc


def candidates(m: int, n: int, k: int, scheme: str, sms: int, fuse_up_to: int | None = None) -> list:
    """Small-batch launches worth timing for one cell (deduplicated, the default first);
    ``fuse_up_to``: fused launches are candidates up to this many rows as well (never fewer than
    :data:`~epmoe.kernels.dense_int8.FUSED_M_MAX`, where fusion won on the H200)."""
    from epmoe.kernels.dense_int8 import FUSED_M_MAX, small_m_config

    out = []

    def add(**kw):
        cfg = small_m_config(m, n, k, scheme, sms, **kw)
        if cfg not in out and not (cfg.fused and scheme == "int8_channel" and cfg.block_m > 32):
            out.append(cfg)

    if m <= 64:
        base = small_m_config(m, n, k, scheme, sms)
        add()
        # Fusion only where it ever won on the H200 (channel scheme, a few rows; see FUSED_M_MAX):
        # half the launches to compile and time.
        fuse_ok = scheme == "int8_channel" and m <= max(FUSED_M_MAX, fuse_up_to or 0) and base.block_m <= 32
        tiles = {bn: -(-n // bn) * -(-m // base.block_m) for bn in (16, 32, 64, 128) if bn >= base.block_m // 2}
        splits = {1, max(1, base.split_k // 2), base.split_k, base.split_k * 2}
        # Every N tile at the rule's split, every split at the rule's N tile (skipping grids of
        # fewer than a quarter as many programs as SMs), fused and not.
        pairs = {(bn, base.split_k) for bn in tiles} | {(base.block_n, s) for s in splits}
        for fused in (True, False) if fuse_ok else (False,):
            for bn, split in sorted(pairs):
                if (split > 1 and k // split < 256) or tiles[bn] * split < sms // 4:
                    continue
                add(fused=fused, block_n=bn, split_k=split)
        # Wide N tiles without a split, at the rule's row tile and at narrower ones (16 or 32 rows
        # of a 33-64 row batch, the row tiles of each N slice side by side (group_m) so that its
        # weight bytes come from HBM once): few programs with deep K steps, as the 16-row batches
        # run. On the H200, 64 rows of the N = 7168 layers ran at 0.65 of the weight-read floor
        # with the rule's tile (split in two, short K steps), 16 rows at 0.83.
        for bm in sorted({16, 32, base.block_m}) if m > 16 else ():
            for bn in (64, 128):
                if bm <= base.block_m and -(-n // bn) * -(-m // bm) >= sms // 4:
                    add(fused=False, block_m=bm, block_n=bn, split_k=1, group_m=-(-m // bm))
    else:
        for bm, bn in ((64, 64), (128, 64), (128, 128)):
            tiles = -(-m // bm) * -(-n // bn)
            for split in (1, 2, 4, 8):
                if split > 1 and (tiles * split > 2 * sms or k // split < 512):
                    continue
                add(fused=False, block_m=bm, block_n=bn, split_k=split)
    return out


def cutlass_launches(m: int) -> list:
    """The CUTLASS kernels' walks worth timing for ``m`` rows: each kernel (cooperative, whose
    epilogue follows its MMAs, and pingpong, whose epilogue overlaps them: which wins depends on
    the shape's K) with both orders and swizzles 1 to 8, or only its default walk where the batch is
    one 128-row block (every walk is then the same)."""
    from epmoe.kernels.configs import CUTLASS_DENSE_KERNELS
    from epmoe.kernels.dense_configs import SWIZZLES, CutlassLaunch
    from epmoe.linear import ROW_BLOCK

    if m <= ROW_BLOCK:
        return [CutlassLaunch(kernel=kernel) for kernel in CUTLASS_DENSE_KERNELS]
    return [CutlassLaunch(along_n, s, kernel) for kernel in CUTLASS_DENSE_KERNELS for along_n in (True, False)
            for s in SWIZZLES]  # fmt: skip


TRITON_TILES = ((128, 128, 8, 4), (128, 64, 4, 4))
"""(BLOCK_M, BLOCK_N, warps, stages) of the persistent TMA tiles timed beside the Triton GEMM's own
config on the GPU (BLOCK_K 128): narrower than its large-batch 128 x 256 default, for layers
whose N gives that tile too few programs (kv_a: 3 N tiles, one of them a quarter full)."""


def triton_launches(tma: bool) -> list:
    """The Triton tiled GEMM's configs worth timing: its own lookup (``None``), and with ``tma``
    (a GPU; the interpreter has no TMA) the tiles of :data:`TRITON_TILES`."""
    from epmoe.kernels.configs import GemmConfig

    out = [None]
    if tma:
        out += [GemmConfig(bm, bn, 128, 8, False, warps, stages, True, True) for bm, bn, warps, stages in TRITON_TILES]
    return out


def cell_candidates(m: int, n: int, k: int, scheme: str, sms: int, kernels: tuple[str, ...], tma: bool = False,
                    fuse_up_to: int | None = None) -> list:
    """``[(kernel, launch)]`` timed in one cell by a backend that runs ``kernels`` (``tma``: see
    :func:`triton_launches`; ``fuse_up_to``: see :func:`candidates`)."""
    from epmoe.kernels.dense_configs import SMALL_M_MAX

    out = [("small_m", cfg) for cfg in candidates(m, n, k, scheme, sms, fuse_up_to)]
    if m > SMALL_M_MAX:
        if "triton" in kernels:
            out.extend(("triton", launch) for launch in triton_launches(tma))
        if "cutlass" in kernels:
            out.extend(("cutlass", launch) for launch in cutlass_launches(m))
    return out


def cell_entry(times: dict) -> list:
    """A bucket of the table from ``{(kernel, launch): us}``: each kernel's fastest launch,
    fastest first."""
    best: dict = {}
    for (kernel, launch), us in times.items():
        if kernel not in best or us < best[kernel][1]:
            best[kernel] = (launch, us)
    out = []
    for kernel, (launch, us) in sorted(best.items(), key=lambda kv: kv[1][1]):
        entry = {"kernel": kernel}
        if launch is not None:
            entry["config"] = launch.to_dict()
        entry["us"] = round(us, 2)
        out.append(entry)
    return out


def pdl_twins(times: dict, prefetch: tuple) -> list:
    """The fastest small-batch launch timed in a cell as a programmatic dependent launch (see
    ``SmallMConfig.pdl``), without and with each weight prefetch of ``prefetch`` (bytes per
    program, ``SmallMConfig.prefetch``); none where no small-batch launch was timed: a few more
    candidates a cell instead of twins of every one."""
    small = [(us, launch) for (kernel, launch), us in times.items() if kernel == "small_m" and not launch.pdl]
    if not small:
        return []
    twin = min(small, key=lambda t: t[0])[1]._replace(pdl=True)
    return [twin] + [twin._replace(prefetch=b) for b in prefetch]


OUTPUT_TOLERANCE = 1e-2
"""Largest relative (Frobenius) difference a candidate's output may have from the float64
reference of the same quantized operands: every kernel multiplies the same codes exactly, so
they differ by output rounding (~2^-9); a tile a launch skipped or wrote twice is far above."""


def reference_output(mod, x: torch.Tensor, scheme: str) -> torch.Tensor:
    """float64 ``x W^T`` with ``x`` quantized by the reference quantizer (plain torch, not the
    kernels under test) and the dequantized weight."""
    from epmoe.quant.reference import dequantize_rows, dequantize_weight, quantize_rows

    q, s = quantize_rows(x, torch.int8, 127.0, None if scheme == "int8_channel" else 128)
    w = dequantize_weight(mod.weight.unsqueeze(0), mod.weight_scale.unsqueeze(0))[0].double()
    return dequantize_rows(q, s).double() @ w.t()


def output_error(out: torch.Tensor, ref: torch.Tensor) -> str | None:
    """Why ``out`` is not the product (non-finite, or further than :data:`OUTPUT_TOLERANCE` from
    ``ref``), or ``None``."""
    o = out.double()
    if not bool(torch.isfinite(o).all()):
        return "non-finite output"
    err = float((o - ref).norm() / ref.norm().clamp(min=1e-30))
    return None if err <= OUTPUT_TOLERANCE else f"output differs from the float64 reference by {err:.3g} (relative)"


def _label(kernel: str, launch) -> str:
    return kernel if launch is None else f"{kernel} {json.dumps(launch.to_dict())}"


def _wall_clock(fns: list, calls: int) -> float:
    """The CPU dry run's stand-in for :func:`time_graph`: us per call, wall clock, one pass."""
    t = time.perf_counter()
    for i in range(min(calls, 2)):
        fns[i % len(fns)]()
    return (time.perf_counter() - t) * 1e6 / min(calls, 2)


def _build_cutlass(cuda: bool) -> float | None:
    """Seconds to load (or build, first use) the CUTLASS extension where the sweep will time it."""
    if not cuda or os.environ.get("SGLANG_CUTLASS_MOE") != "1":
        return None
    from epmoe.experts.cutlass_backend import load_extension

    t = time.perf_counter()
    try:
        load_extension()
    except Exception as exc:  # reported; the cells' cutlass candidates then fail one by one
        print(f"CUTLASS extension unavailable: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    return round(time.perf_counter() - t, 1)


def prior_launches(prior: dict, mode: str, n: int, k: int, m: int) -> list:
    """The small-batch launches ``prior`` (a parsed table) has in bucket ``m`` exactly, as plain
    launches (the sweep times the fastest one's programmatic-dependent twins anyway)."""
    from epmoe.kernels.configs import shape_key

    hit = prior.get(mode, {}).get(shape_key(n, k))
    if not hit or m not in hit[0]:
        return []
    plain = [launch._replace(pdl=False, prefetch=0) for kernel, launch in hit[1][hit[0].index(m)] if kernel == "small_m"]
    return list(dict.fromkeys(plain))


def sweep(args, prior: dict | None = None) -> dict:
    """The measurement (see the module doc); ``prior``: the parsed table whose small-batch
    launches ``--small-from-table`` re-times instead of searching."""
    import triton

    from epmoe.kernels.configs import shape_key
    from epmoe.kernels.dense_configs import SMALL_M_MAX, CutlassLaunch, default_plan, mode_key
    from epmoe.kernels.dense_int8 import _sms
    from epmoe.kernels.pdl import pdl_enabled
    from epmoe.linear import Int8Linear, run_kernel
    from epmoe.quant.reference import quantize_weight
    from epmoe.quant.schemes import SCHEMES

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    sms = _sms(dev)
    build_s = _build_cutlass(cuda)
    gen = torch.Generator(device=dev).manual_seed(0)
    t0 = time.perf_counter()
    table, measured, skipped, failures, kernels_of = {}, {}, [], [], {}
    named = {s[0]: s for s in SHAPES}
    shapes = TINY_SHAPES if args.tiny else [named[x] for x in args.shapes] if args.shapes else SHAPES
    ms = args.m or (TINY_MS if args.tiny else SWEEP_MS)
    for mode in args.modes:
        scheme, acc = _mode(mode)
        for name, n, k in shapes:
            if time.perf_counter() - t0 > args.budget_s:
                skipped.extend(f"{mode} {name} M={m}" for m in ms)
                continue
            w = (torch.randn(n, k, device=dev, generator=gen) / k**0.5).to(torch.bfloat16)
            q, s = quantize_weight(w.float().unsqueeze(0), SCHEMES[scheme])
            copies = max(1, min(MAX_COPIES, -(-ROTATE_BYTES // (n * k)))) if cuda else 1
            mods = []
            for _ in range(copies):
                # auto: the backend users get (the interpreter's triton in the CPU dry run).
                mod = Int8Linear(k, n, scheme=scheme, accumulator=acc, backend="auto" if cuda else "triton", device=dev)
                with torch.no_grad():
                    mod.weight.copy_(q[0])
                    mod.weight_scale.copy_(s[0])
                mods.append(mod)
            impl = mods[0]._impl
            kernels_of[mode] = dict(backend=impl.label, kernels=list(impl.kernels))
            for m in ms:
                if time.perf_counter() - t0 > args.budget_s:
                    skipped.append(f"{mode} {name} M={m}")
                    continue
                x = torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16)
                calls = max(2 * copies, 8)
                timer = time_graph if cuda else _wall_clock
                times = {}

                def time_candidate(kernel, launch, x=x, m=m, ref=None):
                    fns = [lambda mod=mod: run_kernel(mod._impl, mod, x, kernel, launch) for mod in mods]
                    try:
                        wrong = output_error(fns[0]()[:m], ref)
                        if wrong:  # a launch that is fast because it skips work must not win
                            raise ValueError(wrong)
                        times[(kernel, launch)] = timer(fns, calls)
                    except Exception as exc:  # a launch the SM cannot take: reported, not fatal
                        failures.append(f"{mode} {name} M={m} {_label(kernel, launch)}: "
                                        f"{type(exc).__name__}: {str(exc)[:200]}")  # fmt: skip

                cands = cell_candidates(m, n, k, scheme, sms, impl.kernels, tma=cuda, fuse_up_to=args.fuse_up_to)
                if args.small_from_table and m <= SMALL_M_MAX:
                    # Only the table's launch (and below its PDL twins): no neighbour search, no compiles
                    # for it; the rule's candidates where the table has none for this bucket.
                    cands = [("small_m", launch) for launch in prior_launches(prior or {}, mode, n, k, m)] or cands
                with torch.no_grad():
                    ref = reference_output(mods[0], x, scheme)
                    for kernel, launch in cands:
                        time_candidate(kernel, launch, ref=ref)
                    for twin in pdl_twins(times, args.prefetch) if cuda and pdl_enabled(dev) else []:
                        time_candidate("small_m", twin, ref=ref)
                if not times:
                    skipped.append(f"{mode} {name} M={m}")
                    continue
                entry = cell_entry(times)
                table.setdefault(mode_key(scheme, acc), {}).setdefault(shape_key(n, k), {})[str(m)] = entry
                # What the rule without a table runs (default_plan), its "tiled" as the backend's own GEMM.
                default = default_plan(scheme, n, k, m, sms)
                if default[0] == "tiled":
                    default = ("cutlass", CutlassLaunch()) if "cutlass" in impl.kernels else ("triton", None)
                cell = dict(best_us=entry[0]["us"], kernel=entry[0]["kernel"],
                            default_us=round(times[default], 2) if default in times else None,
                            **{f"{e['kernel']}_us": e["us"] for e in entry}, tried=len(times))  # fmt: skip
                if args.report:
                    cell["all_us"] = {_label(*key): round(v, 2) for key, v in sorted(times.items(), key=lambda kv: kv[1])}
                measured.setdefault(mode, {}).setdefault(name, {})[str(m)] = cell
                best = entry[0]
                print(f"{mode:20s} {name:15s} M={m:6d} best={best['us']:9.2f} us ({best['kernel']}"
                      f"{' ' + json.dumps(best['config']) if 'config' in best else ''}) default={cell['default_us']} "
                      + " ".join(f"{e['kernel']}={e['us']}" for e in entry[1:])
                      + f" [{time.perf_counter() - t0:.0f} s]", flush=True)  # fmt: skip
                del x
            del mods, w, q, s
            if cuda:
                torch.cuda.empty_cache()
    return dict(
        device=torch.cuda.get_device_name(dev) if cuda else "cpu (dry run)", triton=triton.__version__, torch=torch.__version__,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), commit=git_commit(args.commit),
        source="benchmarks/sweep_dense_int8.py (the only source of this file; rerun it to regenerate)",
        command=" ".join([os.path.basename(sys.executable), *sys.argv]),
        sglang_cutlass_moe=os.environ.get("SGLANG_CUTLASS_MOE"), backends=kernels_of, sms=sms,
        cutlass_build_s=build_s, seconds=round(time.perf_counter() - t0, 1), skipped=skipped, failures=failures,
        configs=table, measured=measured,
    )  # fmt: skip


def _merge(old: dict, new: dict) -> dict:
    """``{mode: {shape: {bucket: value}}}``: ``old`` with every cell of ``new`` written over it."""
    out = {mode: {shape: dict(cells) for shape, cells in shapes.items()} for mode, shapes in old.items()}
    for mode, shapes in new.items():
        for shape, cells in shapes.items():
            out.setdefault(mode, {}).setdefault(shape, {}).update(cells)
    return out


def main(argv: list[str] | None = None) -> int:
    from epmoe.kernels.dense_configs import SMALL_M_MAX, parse_table, table_path, write_dense_table
    from epmoe.kernels.dense_int8 import FUSED_M_MAX, PREFETCH_CHOICES

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="table path (default: the package's epmoe/configs/dense_int8_<device>.json)")
    p.add_argument("--report", default=None, help="also write every candidate's time to this JSON path")
    p.add_argument("--modes", nargs="*", default=list(MODES), choices=MODES, help="scheme_accumulator modes, in order")
    p.add_argument("--shapes", nargs="*", default=None, choices=[s[0] for s in SHAPES],
                   help="subset, swept in the order given (the budget may end before the last)")
    p.add_argument("--m", type=int, nargs="*", default=None, help=f"batch sizes (default {SWEEP_MS})")
    p.add_argument("--budget-s", type=float, default=200.0, help="stop starting new cells after this many seconds")
    p.add_argument("--commit", default=None, help="commit to record (default: git rev-parse HEAD)")
    p.add_argument("--update", action="store_true",
                   help="keep the --out table's entries for the modes and cells this run does not measure")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: a dry run of the script's logic under TRITON_INTERPRET=1 (with --tiny and --out)")
    p.add_argument("--tiny", action="store_true", help=f"tiny shapes {TINY_SHAPES} and M {TINY_MS} instead")
    p.add_argument("--small-from-table", action="store_true",
                   help=f"with --update: at <= {SMALL_M_MAX} rows time the --out table's small-batch launch of the "
                        "bucket (and its programmatic-dependent twins) instead of searching its neighbours")
    p.add_argument("--prefetch", type=int, nargs="*", default=list(PREFETCH_CHOICES),
                   help=f"weight bytes per program the PDL twins prefetch, one twin each (default {PREFETCH_CHOICES}; "
                        "none: only the plain PDL twin)")
    p.add_argument("--fuse-up-to", type=int, default=None, metavar="M",
                   help=f"also time fused launches (channel scheme, 16- and 32-row tiles) up to M rows (default "
                        f"{FUSED_M_MAX}: where fusion ever won on the H200); a study, e.g. --fuse-up-to 32 --m 16 32")
    args = p.parse_args(argv)
    if args.fuse_up_to is not None and args.fuse_up_to <= FUSED_M_MAX:
        p.error(f"--fuse-up-to {args.fuse_up_to}: more than {FUSED_M_MAX} rows (fused launches are timed up to "
                f"{FUSED_M_MAX} already)")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA GPU here; the table records this GPU's measurements")
    if args.device == "cpu" and not args.out:
        p.error("--device cpu writes no package table: give --out")
    if any(b <= 0 for b in args.prefetch):
        p.error(f"--prefetch {args.prefetch}: byte counts above 0")
    if args.small_from_table and not args.update:
        p.error("--small-from-table re-times the --out table's launches: give --update")
    name = torch.cuda.get_device_name(args.device) if args.device == "cuda" else None
    out = Path(args.out) if args.out else table_path(name)
    prior = parse_table(json.loads(out.read_text()), str(out)) if args.update and out.is_file() else {}
    result = sweep(args, prior)
    meta = {key: v for key, v in result.items() if key not in ("configs", "measured")}
    measured = {mode: {shape: {m: {key: v for key, v in cell.items() if key != "all_us"} for m, cell in ms.items()}
                       for shape, ms in shapes.items()} for mode, shapes in result["measured"].items()}  # fmt: skip
    configs = result["configs"]
    if args.update and out.is_file():
        # Keep the entries this run did not measure (other modes, cells past the budget).
        old = json.loads(out.read_text())
        configs, kept = _merge(old.get("configs", {}), configs), _merge(old.get("measured", {}), measured)
        meta["updated_from"] = {key: old.get(key) for key in ("date", "commit", "command")}
        measured = kept
    write_dense_table(out, configs, **meta, measured=measured)
    print(f"wrote {out} ({result['seconds']} s; {len(result['skipped'])} cells skipped, {len(result['failures'])} failures)")
    if args.report:
        Path(args.report).write_text(json.dumps(result, indent=1))
        print(f"wrote {args.report}")
    for line in result["failures"][:20]:
        print("failure:", line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
