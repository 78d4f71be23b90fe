"""SGLang's INT8 fused-MoE Triton kernel beside epmoe's INT8 experts, timed in one run on one GPU.

The whole routed-experts pass of E_loc experts (default 128, H=7168, I=2048) with ``m`` rows per
expert, input quantization, GEMM1, SiLU*up, GEMM2, for:

* SGLang ``fused_moe_kernel`` with channel-wise INT8 (``int8_w8a8``, per-token activations):
  its default config (``get_default_config``: what SGLang users get without a tuned file for
  the shape), and the best of a ``--sweep N`` config sweep (the best of this sweep, NOT a config
  SGLang ships);
* the same kernel with block-wise INT8 (``block_shape=[128, 128]``, 1x128 activation groups),
  default and sweep best;
* epmoe ``int8_channel`` (int32 accumulator) and ``int8_block`` on the Triton backend, and on the
  cutlass backend when ``SGLANG_CUTLASS_MOE=1`` (a failure there is reported, not fatal);
* BF16 ``torch._grouped_mm`` (the baseline of every ratio).

SGLang's tokens are routed top-k (default 8) so that every expert gets exactly ``m`` rows: token
``t``'s slot ``j`` goes to expert ``(t * k + j) % E``. Its token-to-block alignment
(``moe_align_block_size``, an sgl-kernel CUDA op in SGLang) is computed once, outside the timing,
in torch here, as epmoe's contiguous layout is built before its pass; the routed weights are 1,
so both sides compute the same ``w2 . silu(w13 . x)`` rows. Every pass is checked against a float64
reference on unquantized weights before it is timed (relative mean absolute error below
``--max-error``), so both sides do the same work. The passes are then timed in turns
(:func:`epmoe.timing.in_turns`, ``--turns`` rounds, median), as ``epmoe bench experts --turns``.

SGLang's code is never committed here. The harness imports it from an ignored folder
(``.thirdparty/sglang`` at the repository root, or ``--sglang-dir``) holding SGLang's
``python/sglang/srt/layers/moe/fused_moe_triton/fused_moe_triton_kernels.py`` and
``fused_moe_triton_config.py`` and ``python/sglang/srt/layers/quantization/int8_kernel.py``
(whole files or the functions used). Harness shims, never the kernels' math: SGLang's packages are
entered without running their ``__init__`` files; ``sglang.srt.utils`` answers the few platform
questions the modules ask; the FP8 quantizers the kernels module imports are absent (FP8 is not
timed); without sgl-kernel, its CUDA 1x128 INT8 group quantizer is replaced by SGLang's own Triton
one (``per_token_group_quant_int8``, which SGLang runs off CUDA) and its CUDA ``silu_and_mul`` by
epmoe's Triton ``silu_and_mul`` (one fused pass as well). The JSON names what ran, each source
file's sha256, and the SGLang commit of each file as the folder's ``SOURCE.md`` gives it (a line
naming the file and its 40-hex commit).

Usage (one H200, about two minutes):
    SGLANG_CUTLASS_MOE=1 python benchmarks/sglang_int8.py --json sglang-int8.json
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib
import importlib.util
import json
import math
import os
import re
import statistics
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # benchmarks.provenance, epmoe of this checkout
from benchmarks.provenance import git_commit  # noqa: E402
ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DIR = ROOT / ".thirdparty" / "sglang"
FUSED = "sglang.srt.layers.moe.fused_moe_triton"
SOURCES = {
    f"{FUSED}.fused_moe_triton_kernels": "python/sglang/srt/layers/moe/fused_moe_triton/fused_moe_triton_kernels.py",
    f"{FUSED}.fused_moe_triton_config": "python/sglang/srt/layers/moe/fused_moe_triton/fused_moe_triton_config.py",
    "sglang.srt.layers.quantization.int8_kernel": "python/sglang/srt/layers/quantization/int8_kernel.py",
}
GET_IT = (
    "it is never committed: copy the prepared folder to {dir} (the lead's copy: .thirdparty/sglang), or "
    "from a checkout of github.com/sgl-project/sglang: `git -C SGLANG archive HEAD {files} | tar -x -C {dir}`, "
    "or pass --sglang-dir"
)
BLOCK = [128, 128]

# (BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, GROUP_SIZE_M, num_warps, num_stages), most promising
# first: --sweep N takes the first N that fit the scheme. Few rows per expert want short M tiles.
SMALL_M = [
    (16, 64, 128, 1, 4, 4), (16, 128, 128, 1, 4, 3), (32, 64, 128, 1, 4, 4), (16, 64, 256, 1, 4, 3),
    (32, 128, 128, 1, 4, 3), (16, 128, 64, 1, 4, 4), (16, 256, 128, 1, 8, 3), (32, 64, 64, 1, 4, 5),
    (64, 64, 128, 1, 4, 4), (16, 32, 128, 1, 2, 4), (32, 128, 64, 1, 4, 4), (16, 64, 128, 16, 4, 5),
    (64, 128, 128, 1, 4, 3), (32, 256, 128, 1, 8, 3), (16, 128, 256, 1, 8, 3), (32, 64, 256, 1, 4, 3),
    (16, 64, 64, 1, 4, 5), (64, 64, 64, 1, 4, 4), (32, 32, 128, 1, 4, 4), (16, 256, 64, 1, 8, 4),
]
LARGE_M = [
    (64, 128, 128, 32, 4, 3), (128, 128, 128, 32, 8, 3), (128, 256, 128, 32, 8, 3), (64, 256, 128, 16, 8, 3),
    (128, 128, 64, 16, 4, 4), (64, 128, 64, 32, 4, 4), (128, 64, 128, 32, 4, 4), (64, 64, 128, 16, 4, 4),
    (128, 256, 64, 16, 8, 4), (128, 128, 128, 1, 8, 4), (64, 256, 64, 32, 8, 4), (128, 128, 256, 32, 8, 3),
    (64, 128, 256, 16, 8, 3), (128, 64, 64, 32, 4, 4), (64, 64, 64, 32, 4, 5), (128, 128, 128, 64, 8, 3),
    (64, 128, 128, 1, 4, 4), (128, 256, 128, 1, 8, 3), (256, 128, 128, 32, 8, 3), (64, 64, 256, 32, 4, 3),
]
SMALL_M_MAX = 32
"""Rows per expert up to which the sweep draws from SMALL_M (and timings run in CUDA graphs)."""


def candidates(m: int, block: bool, n: int) -> list[dict]:
    """The first ``n`` sweep configs for ``m`` rows per expert. The block kernel applies one
    activation and one weight scale per K tile, so its K tile must lie inside one 128-group."""
    keys = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")
    table = SMALL_M if m <= SMALL_M_MAX else LARGE_M
    fits = [c for c in table if not block or BLOCK[1] % c[2] == 0]
    return [dict(zip(keys, c)) for c in fits[:n]]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks/sglang_int8.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", required=True, help="write the results here")
    p.add_argument("--sglang-dir", type=Path, default=DEFAULT_DIR,
                   help=f"folder holding SGLang's python/sglang/... sources (default: {DEFAULT_DIR})")
    p.add_argument("--m", default="8,32,128,512,2048", help="rows per expert, comma separated (default: %(default)s)")
    p.add_argument("--experts", type=int, default=128, help="local experts E_loc (default: %(default)s)")
    p.add_argument("--hidden", type=int, default=7168, help="hidden size H, a multiple of 128 (default: %(default)s)")
    p.add_argument("--intermediate", type=int, default=2048,
                   help="intermediate size I of one expert, a multiple of 128 (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=8, help="experts per SGLang token (default: %(default)s)")
    p.add_argument("--sweep", type=int, default=10,
                   help=f"SGLang configs tried per scheme and m, 0 to 20 (default: %(default)s; 0: default config only)")
    p.add_argument("--turns", type=int, default=3, help="rounds of the in-turns timing, >= 1 (default: %(default)s)")
    p.add_argument("--rep-ms", type=float, default=100.0, help="do_bench time per in-turns measurement (default: %(default)s)")
    p.add_argument("--sweep-rep-ms", type=float, default=20.0, help="do_bench time per sweep config (default: %(default)s)")
    p.add_argument("--max-error", type=float, default=0.08,
                   help="largest relative mean abs error against float64 a pass may have (default: %(default)s; "
                        "INT8 passes measure 0.02-0.03 at the default shapes, truncating quantizers about twice "
                        "that, a pass with wrong math far more)")
    p.add_argument("--commit", default=None, help="the epmoe commit to record (default: git rev-parse HEAD)")
    args = p.parse_args(argv)
    try:
        args.m = [int(v) for v in args.m.split(",") if v.strip()]
    except ValueError:
        p.error(f"--m {args.m!r}: expected comma-separated integers")
    for name in ("experts", "hidden", "intermediate", "top_k", "turns"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    if not args.m or min(args.m) < 1:
        p.error(f"--m needs one or more row counts >= 1; got {args.m}")
    if not 0 <= args.sweep <= len(SMALL_M):
        p.error(f"--sweep must be 0 to {len(SMALL_M)}; got {args.sweep}")
    if args.top_k > args.experts:
        p.error(f"--top-k {args.top_k} is more than --experts {args.experts}")
    bad = [m for m in args.m if m * args.experts % args.top_k]
    if bad:
        p.error(f"--m {bad}: m * --experts must be a multiple of --top-k {args.top_k} (whole tokens)")
    for name in ("hidden", "intermediate"):
        if getattr(args, name) % 128:
            p.error(f"--{name} {getattr(args, name)} must be a multiple of 128 (INT8 block scales)")
    return args


def missing_sources(root: Path) -> list[str]:
    return [rel for rel in SOURCES.values() if not (root / rel).is_file()]


# ------------------------------------------------------------------------------- SGLang import


def _package(name: str, path: Path) -> None:
    """An empty package module for ``name`` over ``path``: SGLang's ``__init__`` files (which
    import the whole server) never run."""
    mod = types.ModuleType(name)
    mod.__path__ = [str(path)]
    sys.modules[name] = mod


def load_sglang(root: Path) -> tuple[dict, dict]:
    """SGLang's modules from ``root`` behind the harness shims: ``(modules, notes)``; ``notes``
    says which shim stood in for what."""
    import torch

    notes = {}
    py = root / "python"
    for name in ("sglang", "sglang.srt", "sglang.srt.layers", "sglang.srt.layers.moe", FUSED,
                 "sglang.srt.layers.quantization"):  # fmt: skip
        _package(name, py.joinpath(*name.split(".")))
    utils = types.ModuleType("sglang.srt.utils")
    utils.is_cuda = lambda: torch.cuda.is_available() and torch.version.cuda is not None
    utils.is_hip = lambda: False
    utils.is_cpu = lambda: False
    utils.cpu_has_amx_support = lambda: False
    utils.get_bool_env_var = lambda name, default="false": os.environ.get(name, default).lower() in ("1", "true")
    utils.get_device_name = lambda device_id=0: (
        torch.cuda.get_device_name(device_id) if torch.cuda.is_available() else "cpu"
    )
    sys.modules["sglang.srt.utils"] = utils
    fp8 = types.ModuleType("sglang.srt.layers.quantization.fp8_kernel")
    for fn in ("per_token_group_quant_fp8", "scaled_fp8_quant", "sglang_per_token_group_quant_fp8"):
        setattr(fp8, fn, _absent(fn))
    sys.modules[fp8.__name__] = fp8
    if importlib.util.find_spec("sgl_kernel") is None:
        sys.modules["sgl_kernel"] = _group_quant_shim()
        notes["group_quant"] = ("sgl-kernel absent: SGLang's Triton per_token_group_quant_int8 (its quantizer "
                                "off CUDA) stands in for sgl_per_token_group_quant_8bit")  # fmt: skip
    else:
        notes["group_quant"] = "sgl-kernel sgl_per_token_group_quant_8bit"
    notes["silu_and_mul"] = "epmoe.kernels.activation.silu_and_mul (stands in for sgl-kernel's CUDA silu_and_mul)"
    mods = {name.rsplit(".", 1)[1]: importlib.import_module(name) for name in SOURCES}
    notes["files_sha256"] = {rel: hashlib.sha256((root / rel).read_bytes()).hexdigest() for rel in SOURCES.values()}
    notes["commits"] = source_commits(root / "SOURCE.md")
    return mods, notes


def source_commits(note: Path) -> dict[str, str]:
    """The SGLang commit of each source file, from the folder's ``SOURCE.md`` (a line naming the
    file and a 40-hex commit); files it does not name are absent."""
    text = note.read_text() if note.is_file() else ""
    out = {}
    for line in text.splitlines():
        commit = re.search(r"\b[0-9a-f]{40}\b", line)
        for rel in SOURCES.values():
            if commit and rel in line:
                out[rel] = commit.group(0)
    return out


def _absent(name: str):
    def fn(*args, **kwargs):
        raise NotImplementedError(f"harness shim: {name} (FP8) is not part of this INT8 comparison")

    return fn


def _group_quant_shim() -> types.ModuleType:
    """``sgl_kernel`` with ``sgl_per_token_group_quant_8bit`` writing through SGLang's own Triton
    group quantizer into the caller's buffers (its launch, as ``per_token_group_quant_int8``)."""
    mod = types.ModuleType("sgl_kernel")

    def sgl_per_token_group_quant_8bit(x, x_q, x_s, group_size, eps, int8_min, int8_max, enable_v2=None):
        import triton

        q = sys.modules["sglang.srt.layers.quantization.int8_kernel"]
        block = triton.next_power_of_2(group_size)
        q._per_token_group_quant_int8[(x.numel() // group_size,)](
            x, x_q, x_s, group_size, group_size, eps, int8_min=int8_min, int8_max=int8_max, BLOCK=block,
            num_warps=min(max(block // 256, 1), 8), num_stages=1,
        )  # fmt: skip

    mod.sgl_per_token_group_quant_8bit = sgl_per_token_group_quant_8bit
    return mod


# ------------------------------------------------------------------------------- the SGLang pass


def align_block_size(topk_ids, block_m: int, num_experts: int):
    """``moe_align_block_size`` in torch: slots (``t * k + j``) sorted by expert, each expert's
    run padded to a multiple of ``block_m`` with the sentinel ``topk_ids.numel()``; the expert of
    every ``block_m`` block (-1 past the end); the padded total. Sized as SGLang sizes them."""
    import torch

    dev = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    numel = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded
    order = torch.sort(flat, stable=True).indices
    rank = torch.arange(numel, device=dev) - (torch.cumsum(counts, 0) - counts)[flat[order]]
    size = numel + num_experts * (block_m - 1)
    sorted_ids = torch.full((size,), numel, dtype=torch.int32, device=dev)
    sorted_ids[starts[flat[order]] + rank] = order.to(torch.int32)
    blocks = -(-size // block_m)
    expert_ids = torch.full((blocks,), -1, dtype=torch.int32, device=dev)
    expert_ids[: int(padded.sum()) // block_m] = torch.repeat_interleave(
        torch.arange(num_experts, device=dev, dtype=torch.int32), padded // block_m
    )
    return sorted_ids, expert_ids, padded.sum().reshape(1).to(torch.int32)


class SglangPass:
    """SGLang's fused-MoE experts pass (as its ``fused_experts_impl`` runs one chunk) over
    ``tokens`` routed top-``k`` with ``m`` rows for every expert."""

    def __init__(self, mods, weights, block: bool, m: int, k: int, seed: int):
        import torch
        import triton.language as tl

        self.kernels, self.config_mod = mods["fused_moe_triton_kernels"], mods["fused_moe_triton_config"]
        self.w, self.block, self.k, self.tl_bf16 = weights, BLOCK if block else None, k, tl.bfloat16
        e, n2, h = weights.w13.shape
        self.e, self.inter = e, n2 // 2
        dev = weights.w13.device
        tokens = m * e // k
        g = torch.Generator(device=dev).manual_seed(seed)
        self.x = torch.randn(tokens, h, device=dev, generator=g).to(torch.bfloat16)
        self.topk_ids = ((torch.arange(tokens, device=dev)[:, None] * k + torch.arange(k, device=dev)) % e).to(torch.int32)
        self.topk_weights = torch.ones(tokens, k, device=dev, dtype=torch.float32)
        self.cache1 = torch.empty(tokens, k, n2, device=dev, dtype=torch.bfloat16)
        self.cache3 = torch.empty(tokens, k, h, device=dev, dtype=torch.bfloat16)
        self._aligned = {}

    def default_config(self) -> dict:
        tokens = self.x.shape[0]
        h = self.x.shape[1]
        return self.config_mod.get_default_config(tokens, self.e, self.inter, h, self.k, "int8_w8a8", False, self.block)

    def _gemm(self, a, w, w_scale, out, aligned, routed: bool, top_k: int, config: dict) -> None:
        self.kernels.invoke_fused_moe_kernel(
            a, w, None, out, None, w_scale, None, self.topk_weights, self.topk_ids, *aligned, routed, top_k,
            config, compute_type=self.tl_bf16, use_fp8_w8a8=False, use_int8_w8a8=True, use_int8_w8a16=False,
            use_int4_w4a16=False, per_channel_quant=self.block is None, block_shape=self.block,
        )  # fmt: skip

    def run(self, config: dict):
        """One pass with ``config`` for both GEMMs (as SGLang without a separate down config);
        returns ``[tokens, k, H]``, slot ``j`` of token ``t`` holding its expert's output."""
        from epmoe.kernels.activation import silu_and_mul

        bm = config["BLOCK_SIZE_M"]
        if bm not in self._aligned:
            self._aligned[bm] = align_block_size(self.topk_ids, bm, self.e)
        aligned = self._aligned[bm]
        w = self.w
        self._gemm(self.x, w.w13, w.w13_scale, self.cache1, aligned, False, self.k, config)
        act = silu_and_mul(self.cache1.view(-1, 2 * self.inter))
        self._gemm(act, w.w2, w.w2_scale, self.cache3, aligned, True, 1, config)
        return self.cache3

    def error(self, out, w13_bf16, w2_bf16, experts: int, max_rows: int = 64) -> float:
        """Relative mean abs error of ``out`` on the first ``experts`` experts against float64
        math on the unquantized weights."""
        from epmoe.reference import expert_mlp_float64

        num = den = 0.0
        for e in range(min(experts, self.e)):
            t, j = (self.topk_ids == e).nonzero(as_tuple=True)
            t, j = t[:max_rows], j[:max_rows]
            ref = expert_mlp_float64(self.x[t], w13_bf16[e], w2_bf16[e])
            num += float((out[t, j].double() - ref).abs().sum())
            den += float(ref.abs().sum())
        return num / den if den else math.nan


# ------------------------------------------------------------------------------- run


def _commit(given: str | None) -> str:
    return git_commit(given, fallback="unknown (pass --commit)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    missing = missing_sources(args.sglang_dir)
    if missing:
        files = " ".join(sorted({str(Path(r).parent) for r in SOURCES.values()}))
        print(f"benchmarks/sglang_int8.py: SGLang's INT8 fused-MoE sources are not in --sglang-dir {args.sglang_dir} "
              f"(missing: {', '.join(missing)}); " + GET_IT.format(dir=args.sglang_dir, files=files),
              file=sys.stderr)  # fmt: skip
        return 2
    import torch

    if not torch.cuda.is_available():
        print("benchmarks/sglang_int8.py needs a CUDA GPU (SGLang's kernel uses libdevice, which Triton's CPU "
              "interpreter lacks)", file=sys.stderr)  # fmt: skip
        return 2
    return run(args, torch.device("cuda"))


def run(args: argparse.Namespace, dev) -> int:
    """The comparison on ``dev`` (a GPU; a CPU only for a dry run under Triton's interpreter)."""
    import torch
    import triton

    from epmoe.bench import experts as eb
    from epmoe.timing import in_turns, kernel_ms

    t0 = time.time()
    mods, notes = load_sglang(args.sglang_dir)
    problem = eb.build_problem(args.experts, args.hidden, args.intermediate, dev, torch.bfloat16)
    w = {s: eb.weights_for(problem, s).contiguous() for s in ("int8_channel", "int8_block")}
    extras = []
    if os.environ.get("SGLANG_CUTLASS_MOE") == "1":
        for spec in ("int8_channel_int32", "int8_block"):
            try:
                extras.append(eb.load_extra(f"epmoe.experts.cutlass_backend:CutlassBackend@{spec}"))
            except Exception as exc:  # no headers or no extension: report and go on
                print(f"cutlass {spec}: {type(exc).__name__}: {exc}", file=sys.stderr)
    results, failed = [], []
    for i, m in enumerate(args.m):
        graph = m <= SMALL_M_MAX
        measure = lambda fn: kernel_ms(fn, rep_ms=args.rep_ms, graph=graph, device=dev)  # noqa: E731
        passes, rows = {}, {}
        batch = eb.uniform_batch(problem, m, dev, torch.bfloat16, seed=1000 + i)
        refs = eb.reference_rows(problem, batch, 4)
        # ---- SGLang: default config, then the sweep
        for scheme, block in (("ch", False), ("block", True)):
            sg = SglangPass(mods, w["int8_block" if block else "int8_channel"], block, m, args.top_k, seed=2000 + i)
            default = sg.default_config()
            tried = []
            for cfg in candidates(m, block, args.sweep):
                try:
                    tried.append((kernel_ms(lambda c=cfg: sg.run(c), rep_ms=args.sweep_rep_ms, graph=graph, device=dev), cfg))
                except Exception as exc:  # a config the GPU cannot run (shared memory): skip it
                    print(f"m={m} sglang {scheme} {cfg}: {type(exc).__name__}: {str(exc)[:120]}", file=sys.stderr)
            best = min(tried, key=lambda t: t[0])[1] if tried else None
            for which, cfg in (("default", default), ("sweep_best", best)):
                if cfg is None:
                    continue
                label = f"sglang_{scheme}_{which}"
                err = sg.error(sg.run(cfg), problem.w13, problem.w2, 4)
                rows[label] = dict(kind="sglang", scheme=scheme, config=cfg, error=err,
                                   note="best of this sweep, not a config SGLang ships" if which == "sweep_best" else
                                   "SGLang get_default_config (int8_w8a8)")  # fmt: skip
                passes[label] = lambda c=cfg, sg=sg: sg.run(c)
            rows.setdefault(f"sglang_{scheme}_sweep_best", {})["sweep"] = [{"ms": ms, "config": c} for ms, c in tried]
        # ---- epmoe, then BF16
        for scheme, acc in (("int8_channel", "int32"), ("int8_block", "fp32")):
            label = f"epmoe_{scheme}{'_int32' if acc == 'int32' else ''}_triton"
            _, total = eb.triton_stages(problem, batch, scheme, acc)
            rows[label] = dict(kind="epmoe", error=eb.accuracy(total(), refs))
            passes[label] = total
        for label, backend in extras:
            name = f"epmoe_{label.removeprefix('cutlass_')}_cutlass"
            try:
                total, own_refs = eb.backend_pass(problem, backend, m, batch, refs, 1000 + i, 4)
                rows[name] = dict(kind="epmoe", error=eb.accuracy(total(), own_refs))
                passes[name] = total
            except Exception as exc:
                rows[name] = dict(kind="epmoe", skipped=f"{type(exc).__name__}: {exc}")
        total = eb.torch_bf16_stages(problem, batch)["total"]
        rows["bf16_grouped_mm"] = dict(kind="baseline", error=eb.accuracy(total(), refs))
        passes["bf16_grouped_mm"] = total
        for label in [lb for lb in passes if not rows[lb]["error"] <= args.max_error]:  # NaN fails too
            failed.append(f"m={m} {label}: error {rows[label]['error']:.3g} > --max-error {args.max_error}")
            del passes[label]
        print(f"m={m}: {len(passes)} passes in turns ({args.turns} rounds), {time.time() - t0:.0f} s so far ...", flush=True)
        samples = in_turns(passes, args.turns, measure)
        base = statistics.median(samples["bf16_grouped_mm"]) if "bf16_grouped_mm" in samples else None
        for label, row in rows.items():
            if label in samples:
                row["ms_rounds"] = samples[label]
                row["ms"] = statistics.median(samples[label])
                row["speedup_vs_bf16"] = base / row["ms"] if base else None
            results.append(dict(m=m, label=label, **row))
        del batch, refs, passes
        torch.cuda.empty_cache()
    report = dict(
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), commit=_commit(args.commit),
        gpu=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", torch=torch.__version__, triton=triton.__version__,
        shapes=dict(experts=args.experts, hidden=args.hidden, intermediate=args.intermediate, top_k=args.top_k),
        options=dict(sweep=args.sweep, turns=args.turns, rep_ms=args.rep_ms, sweep_rep_ms=args.sweep_rep_ms,
                     max_error=args.max_error, cutlass=os.environ.get("SGLANG_CUTLASS_MOE") == "1"),
        sglang=notes, results=results, failed=failed, seconds=round(time.time() - t0, 1),
    )  # fmt: skip
    with open(args.json, "w") as f:
        json.dump(report, f, indent=1)
    print(table(results))
    print(f"wrote {args.json} ({report['seconds']} s)")
    for line in failed:
        print("FAILED accuracy:", line, file=sys.stderr)
    return 1 if failed else 0


COLUMNS = [
    ("bf16_grouped_mm", "BF16 grouped_mm"),
    ("sglang_ch_default", "SGLang ch default"),
    ("sglang_ch_sweep_best", "SGLang ch sweep best*"),
    ("epmoe_int8_channel_int32_triton", "epmoe ch int32 Triton"),
    ("epmoe_int8_channel_int32_cutlass", "epmoe ch CUTLASS"),
    ("sglang_block_default", "SGLang block default"),
    ("sglang_block_sweep_best", "SGLang block sweep best*"),
    ("epmoe_int8_block_triton", "epmoe block Triton"),
    ("epmoe_int8_block_cutlass", "epmoe block CUTLASS"),
]


def table(results: list[dict]) -> str:
    """ms (speed-up over BF16) per m and pass; '-' where a pass did not run."""
    cells = {(r["m"], r["label"]): r for r in results}
    ms = sorted({r["m"] for r in results})
    width = max(len(h) for _, h in COLUMNS)
    lines = [f"{'pass':<{width}} " + " ".join(f"{'m=' + str(m):>15}" for m in ms)]
    for label, head in COLUMNS:
        out = []
        for m in ms:
            r = cells.get((m, label), {})
            out.append(f"{r['ms']:.3f} ({r['speedup_vs_bf16']:.2f}x)" if r.get("ms") and r.get("speedup_vs_bf16")
                       else "-")  # fmt: skip
        lines.append(f"{head:<{width}} " + " ".join(f"{c:>15}" for c in out))
    lines.append("ms: median of the in-turns rounds; (x): speed-up over BF16 torch._grouped_mm; "
                 "*: the best config of this sweep, not a config SGLang ships")  # fmt: skip
    return "\n".join(lines)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main())
