"""The cutlass experts backend: FP8 block-scaled, INT8 channel-scaled and INT8 block-scaled grouped
GEMMs over the contiguous layout, and the INT8 ones over the masked layout.

Considered only with ``SGLANG_CUTLASS_MOE=1`` on compute capability 9.x with CUDA >= 12.3 (the
rule is :func:`epmoe.experts.fp8_selection.cutlass_decision`); the INT8 schemes also need the
CUTLASS headers (sgl-kernel has no INT8 grouped GEMM), and ``int8_channel`` the int32 accumulator.
An FP8 forward is

    quantize x (1x128 e4m3, unless it arrived so) -> grouped GEMM1 (w13)
    -> silu(gate) * up requantized to 1x128 e4m3 -> grouped GEMM2 (w2)

The GEMMs come from sgl-kernel's ``fp8_blockwise_scaled_grouped_mm`` when sgl-kernel imports,
matches the running torch and has that op with the 18-argument signature; otherwise from the
project's own CUTLASS kernel (``epmoe/csrc/block_scaled_contiguous_gemm.cuh``), compiled on first
use with :func:`torch.utils.cpp_extension.load` against the CUTLASS headers of the
``nvidia-cutlass`` PyPI package (or ``EPMOE_CUTLASS_DIR``) and cached under ``EPMOE_CACHE_DIR``
(default ``~/.cache/epmoe``).

An INT8 forward is the Triton backend's with the project's INT8 kernels in place of the Triton
GEMMs: ``int8_channel`` sums K in int32 and applies the per-token and per-channel scales in its
epilogue (``int8_channel_gemm.cuh``; the dense op may run it on CUTLASS's pingpong kernel too);
``int8_block`` is the FP8 kernel's structure with
int8 MMAs, each 128-wide K block summed exactly in int32 and promoted to fp32 with the product of
the 1x128 and 128x128 scales (``int8_block_contiguous_gemm.cu``); on the variants of
:data:`SILU_FUSED_SCHEDULES` its GEMM1 also computes ``silu(gate) * up`` requantized to 1x128 in
the epilogue (``silu_quant_epilogue.cuh``: each tile is 128 gate rows and the same up rows of w13
as stored), so GEMM1's bf16 output and the activation kernel that would read it back are gone.
Which GEMMs a batch runs is chosen by its rows per expert (the host counts, or the dispatcher's
hint when the sizes stayed on the device) from measured crossovers shipped as data (``epmoe/configs/int8_crossover.json``,
:func:`int8_rule`): the Triton backend's pass below the crossover (on the batch packed to its rows,
:func:`packed_batch`, without a host sync either way), the CUTLASS kernels from it; without data
for the GPU and scheme, CUTLASS.

Every wrapper checks its operands in Python before the extension is loaded or reads them
(:func:`check_operands`).

The project's kernels run the whole layout as one CUTLASS problem whose batch index is the expert
of each 128-row block (a table built on the GPU from ``expert_offsets``; no host sync), so every
segment is padded to 128 rows: :attr:`CutlassBackend.alignment` is 128, as DeepGEMM's. An expert
without rows has an empty segment and gets no tiles. The masked layout (``[E, cap, H]`` with
``masked_m``) is the same problem over ``E * cap`` rows with the table built from ``masked_m``
(:func:`int8_block_masked_gemm`, :func:`int8_masked_gemm`; ``cap`` padded to 128 by the backend).

The INT8 block kernel has variants (:data:`INT8_BLOCK_SCHEDULES`: its consumer warpgroups'
schedule and its tile width), each its own instantiation in the one extension; a backend runs the
one named when it is built (the argument, ``EPMOE_INT8_BLOCK_SCHEDULE``), else the one measured
fastest on the GPU that holds its weights (:data:`SCHEDULE_FILE`, :meth:`CutlassBackend.schedule_for`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import json
import logging
import math
import os
import sys
import time
from pathlib import Path

import torch

from .. import devices
from ..errors import CutlassUnavailableError
from ..kernels.common import mn_major_scales
from ..kernels.configs import CUTLASS_DENSE_KERNELS
from ..kernels.pdl import pdl_enabled
from ..layouts import ContiguousBatch, MaskedBatch
from ..quant.schemes import BLOCK, QuantScheme
from ..timing import phase
from .base import ExpertsBackend, ExpertWeights, check_weights, fp8_gemm_input
from .fp8_selection import (
    ENV_VAR,
    RowsRule,
    cutlass_decision,
    cutlass_warning,
    env_enabled,
    int8_rows_rule,
    machine_facts,
)
from . import stages
from .stages import spare_row_slab
from .triton_backend import TritonBackend

log = logging.getLogger("epmoe")

CSRC = Path(__file__).resolve().parent.parent / "csrc"
SOURCES = (
    "fp8_block_contiguous_gemm_binding.cpp",
    "fp8_block_contiguous_gemm.cu",
    "int8_block_contiguous_gemm.cu",
    "int8_block_n256_quarters_run2_gemm.cu",
    "int8_block_n256_quarters_run4_gemm.cu",
    "int8_block_silu_gemm.cu",
    "int8_block_silu_run2_gemm.cu",
    "int8_channel_contiguous_gemm.cu",
    "int8_dense_pingpong_gemm.cu",
)
HEADERS = ("contiguous_gemm_common.cuh", "block_scaled_contiguous_gemm.cuh", "silu_quant_epilogue.cuh",
           "int8_channel_gemm.cuh")  # fmt: skip
ROW_BLOCK = 128
"""Rows of a tile of the project's kernel: every expert segment starts and ends on a multiple."""
INT8_BLOCK_SCHEDULES = ("n256_quarters_i2f_s4", "n256_quarters_run2", "n256_quarters_run4")
"""The INT8 block kernel's variants (``kInt8BlockVariants`` in ``block_scaled_contiguous_gemm.cuh``,
in this order: the op takes the index), all on 128 x 256 tiles (N = 4096 and 7168, the DeepSeek-V3
GEMMs, are whole multiples; a part-empty last tile column elsewhere): each consumer warpgroup
issues a K block's MMAs in four 64-column chunks through two int32 partials started from zero,
each chunk promoted (a conversion instruction and an FMA an element) while the next runs, with
CUTLASS's subtiled epilogue at every K. ``n256_quarters_i2f_s4`` drains the MMAs once per K block;
``n256_quarters_run2`` / ``_run4`` take K blocks in runs of two / four, drained once per run. The
variants measured slower on the H200 (other schedules, tile widths, conversions and operand
paths; README, "The CUTLASS INT8 block kernel's variants") are no longer built."""
INT8_BLOCK_TILE_N = dict.fromkeys(INT8_BLOCK_SCHEDULES, 256)
"""Tile width of each INT8 block variant: each tile lies on whole 128-column weight blocks and
reads the weight scales as stored."""
SILU_FUSED_SCHEDULES = ("n256_quarters_run2", "n256_quarters_run4")
"""The INT8 block variants also built as GEMM1 with the activation fused into the epilogue
(``kSiluQuantVariants``, ``silu_quant_epilogue.cuh``; :func:`int8_block_silu_grouped_gemm`): a
:class:`CutlassBackend` on one of them runs GEMM1 and ``silu(gate) * up`` requantized as one
kernel; on the others, as two."""


def gemm1_note(schedule: str, activation: str = "fused") -> str:
    """How an ``int8_block`` pass on ``schedule`` runs GEMM1 and the activation (for the logs and
    ``epmoe info``)."""
    if activation == "fused" and schedule in SILU_FUSED_SCHEDULES:
        return "GEMM1 with silu(gate) * up requantized in its epilogue"
    return "GEMM1, then silu(gate) * up requantized by its own kernel"


INT8_BLOCK_SCHEDULE_ENV = "EPMOE_INT8_BLOCK_SCHEDULE"
"""Environment variable naming the INT8 block kernel's schedule (one of
:data:`INT8_BLOCK_SCHEDULES`), read when a :class:`CutlassBackend` is built."""
DEFAULT_INT8_BLOCK_SCHEDULE = "n256_quarters_run4"
"""The schedule of a GPU without a measured one (:data:`SCHEDULE_FILE`): the H200's."""
SCHEDULE_FILE = Path(__file__).resolve().parent.parent / "configs" / "int8_block_schedule.json"
"""The fastest INT8 block schedule measured per GPU name, ``{"<GPU name>": {"schedule": ...,
"source": ...}}`` (written by ``benchmarks/int8_block_schedules.py --schedule-out``)."""


def named_int8_block_schedule(name: str | None = None) -> str | None:
    """``name``, else ``$EPMOE_INT8_BLOCK_SCHEDULE``, else ``None`` (then the schedule measured on
    the weights' GPU applies: :func:`int8_block_schedule`).

    Raises:
        ValueError: a name that is not one of :data:`INT8_BLOCK_SCHEDULES` (saying where it came from).
    """
    source = "schedule"
    if name is None:
        name = os.environ.get(INT8_BLOCK_SCHEDULE_ENV) or None
        source = f"{INT8_BLOCK_SCHEDULE_ENV} (from the environment)"
    if name is not None:
        _check_schedule(name, source)
    return name


def int8_block_schedule(device: torch.device | str, name: str | None = None) -> str:
    """:func:`named_int8_block_schedule`, else the one measured fastest on ``device``'s GPU
    (:data:`SCHEDULE_FILE`), else :data:`DEFAULT_INT8_BLOCK_SCHEDULE`.

    ``device`` is where the kernel runs (the weights' device); off CUDA there is no measured one.

    Raises:
        ValueError: a name that is not one of :data:`INT8_BLOCK_SCHEDULES` (saying where it came
            from).
    """
    return named_int8_block_schedule(name) or _measured_schedule_on(device)


def measured_or_default_schedule(device: torch.device | str) -> str:
    """The schedule :data:`SCHEDULE_FILE` names for ``device``'s GPU, else
    :data:`DEFAULT_INT8_BLOCK_SCHEDULE`.

    Raises:
        ValueError: an entry that is not one of :data:`INT8_BLOCK_SCHEDULES`.
    """
    gpu = gpu_name(device)
    name = measured_schedule(gpu)
    if name is None:
        return DEFAULT_INT8_BLOCK_SCHEDULE
    _check_schedule(name, f"{SCHEDULE_FILE} for {gpu!r}")
    return name


def gpu_name(device: torch.device | str) -> str | None:
    """The GPU name of a CUDA ``device``, the key of the measured data files; ``None`` off CUDA.
    ``'cuda'`` without an index is the current device, as everywhere in torch (a layer built with
    ``device='cuda'``); the forward passes its weights' device, which always has one."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return devices.name(device)


def _check_schedule(name: str, source: str) -> None:
    if name not in INT8_BLOCK_SCHEDULES:
        raise ValueError(f"{source}={name!r}; allowed: {list(INT8_BLOCK_SCHEDULES)}")


@functools.lru_cache(maxsize=8)
def measured_schedule(gpu: str | None, path: Path = SCHEDULE_FILE) -> str | None:
    """The schedule the file names for ``gpu`` (package data, read once per GPU), or ``None``
    (no file, no GPU, no entry).

    Raises:
        ValueError: the file is not a JSON object of ``{"schedule": ...}`` entries.
    """
    if gpu is None or not path.is_file():
        return None
    data = json.loads(path.read_text())
    entry = data.get(gpu) if isinstance(data, dict) else None
    if entry is None and isinstance(data, dict):
        return None
    if not isinstance(entry, dict) or not isinstance(entry.get("schedule"), str):
        raise ValueError(f"{path} must map GPU names to {{\"schedule\": ...}} objects; got {entry!r} for {gpu!r}")
    return entry["schedule"]


TILE_ORDER = (1, 2)
"""The persistent tile order of the project's kernel: ``(raster along N, swizzle)``. On an H200,
along N with swizzle 2 was the fastest of five orders in run 64 (along M the slowest) and again
faster than swizzle 1 in run 65 (docs/fp8.md)."""

NVCC_FLAGS = (
    "-gencode=arch=compute_90a,code=sm_90a",
    "-O3",
    "-std=c++17",
    "--expt-relaxed-constexpr",
    "--expt-extended-lambda",
    "-DNDEBUG",
    # CUTLASS's grid dependency control on sm_90 (griddepcontrol.wait / launch_dependents in its
    # kernels): without it a kernel launched as a programmatic dependent would not wait for the
    # one before. Whether a launch is one is the op's ``pdl`` argument (pdl_enabled).
    "-DCUTLASS_ENABLE_GDC_FOR_SM90",
    "-U__CUDA_NO_HALF_OPERATORS__",
    "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT16_OPERATORS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-U__CUDA_NO_HALF2_OPERATORS__",
)


# ----------------------------------------------------------------------------- headers and build
def find_cutlass_include() -> Path | None:
    """The directory holding ``cutlass/cutlass.h`` and ``cute/``: ``EPMOE_CUTLASS_DIR`` (a CUTLASS
    checkout or its ``include/``), else the installed ``cutlass_library`` package
    (``pip install nvidia-cutlass``), else ``None``."""
    candidates = []
    env = os.environ.get("EPMOE_CUTLASS_DIR")
    if env:
        root = Path(env).expanduser()
        candidates += [root, root / "include", root / "source" / "include"]
    else:
        try:
            spec = importlib.util.find_spec("cutlass_library")
        except (ImportError, ValueError):
            spec = None
        if spec is not None and spec.submodule_search_locations:
            for loc in spec.submodule_search_locations:
                candidates.append(Path(loc) / "source" / "include")
    for c in candidates:
        if (c / "cutlass" / "cutlass.h").is_file() and (c / "cute").is_dir():
            return c
    return None


def _headers_error() -> str:
    env = os.environ.get("EPMOE_CUTLASS_DIR")
    where = (
        f"EPMOE_CUTLASS_DIR={env!r} holds no cutlass/cutlass.h (neither in it nor in its include/)"
        if env
        else "EPMOE_CUTLASS_DIR is not set and the cutlass_library package is not installed"
    )
    return (
        f"CUTLASS headers not found: {where}. Install them with `pip install nvidia-cutlass` "
        "(headers under cutlass_library/source/include) or set EPMOE_CUTLASS_DIR to a CUTLASS "
        "checkout or its include/ directory."
    )


def cache_dir() -> Path:
    return Path(os.environ.get("EPMOE_CACHE_DIR", Path.home() / ".cache" / "epmoe")).expanduser()


def _build_key(include: Path) -> str:
    """Hash of what the binary depends on: sources, flags, the CUTLASS version header and the
    torch/CUDA versions (not paths, so a cache built elsewhere for the same inputs is reused).
    The library holds torch ops only (no Python module), so the Python version does not matter."""
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update((CSRC / name).read_bytes())
    version_h = include / "cutlass" / "version.h"
    h.update(version_h.read_bytes() if version_h.is_file() else str(include.resolve()).encode())
    h.update(" ".join(NVCC_FLAGS).encode())
    h.update(f"{torch.__version__}|{torch.version.cuda}".encode())
    return h.hexdigest()[:12]


@functools.lru_cache(maxsize=1)
def load_extension(verbose: bool = False):
    """Build (first use) and load the CUTLASS extension; returns its op namespace
    (``torch.ops.epmoe_cutlass_fp8_<hash>``) with ``fp8_contiguous_gemm``, ``workspace_size``,
    ``int8_contiguous_gemm`` and ``int8_block_contiguous_gemm``.

    A library already in the cache directory is loaded without invoking the compiler.

    Raises:
        CutlassUnavailableError: headers or nvcc missing, or the build failed (message names why).
    """
    include = find_cutlass_include()
    if include is None:
        raise CutlassUnavailableError(_headers_error())
    name, build, library = _library(include)
    if _registered(name):
        # Already loaded in this process, from this or another cache directory: loading a second
        # copy would register the same ops again, which aborts the process inside torch.
        return getattr(torch.ops, name)
    if library.is_file():
        try:
            torch.ops.load_library(str(library))
            log.info("loaded epmoe's CUTLASS grouped GEMMs (FP8 block, INT8 channel, INT8 block) from %s", library)
            return getattr(torch.ops, name)
        except OSError as exc:  # e.g. a cache copied from a machine with other libraries
            log.warning("cannot load the cached %s (%s); rebuilding", library, exc)
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None:
        raise CutlassUnavailableError(
            "cannot build the CUTLASS extension: CUDA_HOME is not set and nvcc is not on PATH"
        )
    includes = [str(include), str(CSRC)]
    cccl = Path(cpp_extension.CUDA_HOME) / "include" / "cccl"
    if cccl.is_dir():  # CUDA 13 keeps libcu++ (cuda/std/...) there
        includes.append(str(cccl))
    build.mkdir(parents=True, exist_ok=True)
    log.warning(
        "compiling epmoe's CUTLASS grouped GEMMs (FP8 block, INT8 channel, INT8 block) (first use; a few minutes) in %s "
        "against CUTLASS headers at %s", build, include,
    )  # fmt: skip
    t0 = time.perf_counter()
    try:
        cpp_extension.load(
            name=name,
            sources=[str(CSRC / s) for s in SOURCES],
            extra_include_paths=includes,
            extra_cflags=["-O3", "-std=c++17"],
            extra_cuda_cflags=list(NVCC_FLAGS),
            build_directory=str(build),
            is_python_module=False,
            verbose=verbose,
        )
    except Exception as exc:  # compiler errors arrive as RuntimeError / subprocess errors
        raise CutlassUnavailableError(f"building the CUTLASS extension in {build} failed: {exc}") from exc
    log.warning(
        "built epmoe's CUTLASS grouped GEMMs (FP8 block, INT8 channel, INT8 block) in %.1f s (cached in %s)",
        time.perf_counter() - t0, build,
    )  # fmt: skip
    return getattr(torch.ops, name)


def _registered(name: str) -> bool:
    """Whether the extension's ops (namespace ``name``) are registered in this process."""
    try:
        getattr(getattr(torch.ops, name), "workspace_size")
    except (AttributeError, RuntimeError):
        return False
    return True


def _library(include: Path) -> tuple[str, Path, Path]:
    """``(op namespace, build directory, library file)`` of the extension built against
    ``include`` (the build key names both)."""
    name = f"epmoe_cutlass_fp8_{_build_key(include)}"
    build = cache_dir() / "cutlass" / name
    return name, build, build / f"{name}.so"


def own_kernel_missing() -> str | None:
    """Why the project's kernels can neither be loaded from the cache nor built here (headers, or
    a compiler without a cached build), or ``None`` when they can."""
    include = find_cutlass_include()
    if include is None:
        return _headers_error()
    if _library(include)[2].is_file():
        return None
    from torch.utils import cpp_extension

    if cpp_extension.CUDA_HOME is None:
        return (
            f"no build is cached under {cache_dir()} and none can be made: CUDA_HOME is not set "
            "and nvcc is not on PATH"
        )
    return None


# ----------------------------------------------------------------------------------- sgl-kernel
@functools.lru_cache(maxsize=1)
def sgl_kernel_op():
    """sgl-kernel's ``fp8_blockwise_scaled_grouped_mm`` when it imports against this torch and has
    the 18-argument signature (ptr arrays + workspace), else ``None``."""
    if importlib.util.find_spec("sgl_kernel") is None:
        return None
    try:
        import sgl_kernel  # noqa: F401  (loads the op library; fails on a torch/CUDA mismatch)

        op = torch.ops.sgl_kernel.fp8_blockwise_scaled_grouped_mm.default
        if len(op._schema.arguments) != 18:
            log.info("sgl-kernel's fp8_blockwise_scaled_grouped_mm has an unknown signature; not used")
            return None
        return op
    except Exception as exc:  # ImportError, OSError (undefined symbol), AttributeError, RuntimeError
        log.info("sgl-kernel is installed but not usable with torch %s: %s", torch.__version__, exc)
        return None


def installed_facts() -> dict[str, bool]:
    """The ``installed`` argument of :func:`cutlass_decision` for this process."""
    return {"sgl_kernel": sgl_kernel_op() is not None, "cutlass_headers": find_cutlass_include() is not None}


_WARNED: set[str] = set()


def _warn_once(text: str) -> None:
    if text not in _WARNED:
        _WARNED.add(text)
        log.warning("%s", text)



# ---------------------------------------------------------------------------------------- GEMMs
CUTLASS_IMPLS = ("auto", "epmoe")
"""``EPMOE_CUTLASS_IMPL``: ``auto`` uses sgl-kernel's FP8 op when importable, ``epmoe`` the package's."""


FP8_IMPLS = ("auto", "sgl", "epmoe")
"""``impl`` of :func:`grouped_gemm`: resolved from the environment now, or one of the two FP8 GEMMs."""


def _use_sgl() -> bool:
    impl = os.environ.get("EPMOE_CUTLASS_IMPL", "auto")
    if impl not in CUTLASS_IMPLS:
        raise ValueError(f"EPMOE_CUTLASS_IMPL={impl!r} (from the environment) is not one of {list(CUTLASS_IMPLS)}")
    return impl == "auto" and sgl_kernel_op() is not None


def fp8_impl() -> str:
    """``"sgl"`` or ``"epmoe"``: the FP8 GEMM ``EPMOE_CUTLASS_IMPL`` and the installed sgl-kernel
    give now (:data:`CUTLASS_IMPLS`)."""
    return "sgl" if _use_sgl() else "epmoe"


MAX_ROWS = 1 << 30
"""Rows of ``a`` the project's kernels take: in the FP8 kernel a block past the last segment may run
at a row index up to about 2 M + 384 (parked_block_offset in contiguous_gemm_common.cuh), which
must stay an int32 TMA coordinate."""


def check_block_offsets(expert_offsets: torch.Tensor, rows: int) -> None:
    """Refuse offsets the project's kernel cannot take: each a multiple of :data:`ROW_BLOCK` (or the
    kernel would put two experts in one tile), at least 0, non-decreasing, the last at most ``rows``.

    Host offsets raise ``ValueError``. Offsets on the GPU are checked by the kernel that maps row
    blocks to experts, ahead of the GEMM, so that no batch waits on the host: a bad batch raises a
    device-side assert (at the next synchronisation, and it ends the process's CUDA context)
    instead of returning wrong rows. The layer's own batches always pass."""
    o = expert_offsets
    if o.device.type != "cpu":
        return
    ok = bool((o.remainder(ROW_BLOCK) == 0).all() & (o[:1] >= 0).all() & (o[-1:] <= rows).all())
    if ok and o.numel() > 1:
        ok = bool((o[1:] >= o[:-1]).all())
    if not ok:
        raise ValueError(
            f"expert_offsets must be non-decreasing multiples of {ROW_BLOCK}, at least 0 and at most "
            f"the {rows} rows of a (segments padded to {ROW_BLOCK} rows); got {o.tolist()}"
        )


def grouped_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    expert_offsets: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    impl: str = "auto",
) -> torch.Tensor:
    """``out[offsets[e]:offsets[e+1]] = (a * a_scale)[rows] @ (b[e] * b_scale[e])^T`` in bf16.

    Args:
        a: ``[M, K]`` e4m3, contiguous.
        a_scale: ``[M, K/128]`` fp32; MN-major (:func:`is_mn_major`) passes to the project's kernel
            as it is, any other layout is made contiguous row-major (and sgl-kernel's op always gets that).
        b: ``[E, N, K]`` e4m3 contiguous; ``b_scale`` ``[E, N/128, K/128]`` fp32.
        expert_offsets: ``[E+1]`` int32 row offsets, multiples of 128 (empty segments allowed);
            on the host they are checked by :func:`check_block_offsets` and copied to ``a``'s
            device, on the GPU the kernel checks them (sgl-kernel's op, when used, takes any).
        out: optional ``[M, N]`` bf16 output; rows outside ``offsets[0]:offsets[E]`` are left
            unwritten.
        impl: ``"sgl"`` (sgl-kernel's op), ``"epmoe"`` (the project's kernel), or ``"auto"``:
            ``EPMOE_CUTLASS_IMPL`` read now (:func:`fp8_impl`). A :class:`CutlassBackend` passes
            the one it resolved when it was built.

    Raises:
        TypeError, ValueError: what :func:`check_operands` refuses (K and N positive multiples of
            128), ``a`` with ``MAX_ROWS`` rows or more, an unknown ``impl``; all before the
            extension is loaded.

    Returns:
        ``out``, ``[M, N]`` bf16.
    """
    if impl not in FP8_IMPLS:
        raise ValueError(f"impl={impl!r}; allowed: {list(FP8_IMPLS)}")
    _check_rows(a)
    _check_block_scaled("grouped_gemm", torch.float8_e4m3fn, a, a_scale, b, b_scale, expert_offsets, out)
    out = _output(a, b, out)
    m = a.shape[0]
    if m == 0 or b.shape[0] == 0:
        return out
    offsets = expert_offsets.to(device=a.device, dtype=torch.int32).contiguous()
    if (fp8_impl() if impl == "auto" else impl) == "sgl":
        _refuse_repeated_for_sgl(b, b_scale)
        _sgl_grouped_gemm(out, a, a_scale.contiguous(), b, b_scale, offsets)
        return out
    load_extension().fp8_contiguous_gemm(
        out, a.contiguous(), kernel_act_scale(a_scale), b, b_scale.contiguous(), offsets, *TILE_ORDER,
        pdl_enabled(a.device),
    )
    return out


def is_mn_major(a_scale: torch.Tensor) -> bool:
    """Whether ``a_scale [M, S]`` is the MN-major layout the project's block-scaled kernels read
    (:func:`~epmoe.kernels.common.mn_major_scales`: strides ``(1, M rounded up to 4)``)."""
    return a_scale.dim() == 2 and a_scale.stride(0) == 1 and a_scale.stride(1) == -(-a_scale.shape[0] // 4) * 4


def kernel_act_scale(a_scale: torch.Tensor) -> torch.Tensor:
    """``a_scale`` for the project's block-scaled kernels: as it is when MN-major already (they
    read it without a transposing copy), else row-major contiguous (they transpose it)."""
    return a_scale if is_mn_major(a_scale) else a_scale.contiguous()


def _shape(t) -> str:
    return f"{tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else repr(t)


def check_operands(
    op: str,
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    expert_offsets: torch.Tensor | None,
    out: torch.Tensor | None,
    *,
    dtype: torch.dtype,
    k_multiple: int,
    n_multiple: int,
    a_scale_shapes,
    b_scale_shapes,
    devices: bool = True,
) -> None:
    """Refuse operands a CUTLASS GEMM wrapper cannot take, before anything reads them: shapes,
    dtypes, sizes, the scales' shapes, then (host) offsets, then devices.

    The extension checks the same again, but a check compiled into it is only as safe as the
    toolchain that built it (issue 22: a build on the GPU machine crashed in its error path), so
    every refusal a user can reach happens here, in Python, without loading the extension.

    Args:
        op: the wrapper's name, for the messages.
        a: ``[M, K]`` of ``dtype``; ``b``: ``[E, N, K]`` of ``dtype``, contiguous.
        a_scale, b_scale: fp32; their allowed shapes are ``a_scale_shapes(m, k)`` and
            ``b_scale_shapes(e, n, k)`` (lists of shape tuples).
        expert_offsets: ``[E+1]`` integer row offsets (checked by :func:`check_block_offsets` on
            the host), or ``None`` for the masked layout (its slabs are whole row blocks:
            :func:`_check_masked`), or for a call without them
            (:func:`int8_dense_gemm`).
        out: ``None`` or a contiguous bf16 ``[M, N]`` tensor.
        k_multiple, n_multiple: what K and N must be positive multiples of.
        devices: check the devices too (the masked wrappers check them on their own shapes).

    Raises:
        TypeError: a tensor of the wrong dtype (or not a tensor).
        ValueError: a wrong shape, a size of 0 or not a multiple, a bad host offset, an operand
            not on ``a``'s CUDA device.
    """
    named = [("a", a, dtype), ("b", b, dtype), ("a_scale", a_scale, torch.float32), ("b_scale", b_scale, torch.float32)]
    if expert_offsets is not None:
        named.append(("expert_offsets", expert_offsets, None))
    for name, t, want in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a tensor; got {t!r}")
        if want is not None and t.dtype != want:
            raise TypeError(f"{op}: {name} must be {want}; got {_shape(t)}")
    if a.dim() != 2 or b.dim() != 3:
        raise ValueError(f"{op}: a must be [M, K] and b [E, N, K]; got a {_shape(a)} and b {_shape(b)}")
    (m, k), (e, n, kb) = a.shape, b.shape
    if kb != k:
        raise ValueError(f"{op}: a has K={k} but b {tuple(b.shape)} has K={kb}")
    if k <= 0 or k % k_multiple:
        raise ValueError(f"{op}: K={k} must be a positive multiple of {k_multiple}")
    if n <= 0 or n % n_multiple:
        raise ValueError(f"{op}: N={n} (b {tuple(b.shape)}) must be a positive multiple of {n_multiple}")
    if n * k >= 1 << 31:
        raise ValueError(f"{op}: N*K={n * k} (b {tuple(b.shape)}) must stay below 2**31 (int32 offsets)")
    if not b.is_contiguous():
        raise ValueError(f"{op}: b must be contiguous (the weights are read as stored); got strides {b.stride()}")
    for name, t, allowed in (("a_scale", a_scale, a_scale_shapes(m, k)), ("b_scale", b_scale, b_scale_shapes(e, n, k))):
        if tuple(t.shape) not in allowed:
            raise ValueError(f"{op}: {name} has shape {tuple(t.shape)}; allowed: {' or '.join(map(str, allowed))} "
                             f"(a {tuple(a.shape)}, b {tuple(b.shape)})")  # fmt: skip
    if out is not None and (out.dtype != torch.bfloat16 or tuple(out.shape) != (m, n) or not out.is_contiguous()):
        raise ValueError(f"{op}: out must be a contiguous bf16 [M, N] = [{m}, {n}] tensor; got {_shape(out)}")
    if expert_offsets is not None:
        if expert_offsets.dtype.is_floating_point or expert_offsets.dtype.is_complex or expert_offsets.dtype == torch.bool:
            raise TypeError(f"{op}: expert_offsets must be an integer tensor; got {_shape(expert_offsets)}")
        if tuple(expert_offsets.shape) != (e + 1,):
            raise ValueError(f"{op}: expert_offsets must be [E+1] = [{e + 1}]; got {_shape(expert_offsets)}")
        check_block_offsets(expert_offsets, m)
    if devices:
        _check_devices(op, a, a_scale, b, b_scale, out)


def _check_devices(op, a, a_scale, b, b_scale, out) -> None:
    """``a`` a CUDA tensor and ``b``, the scales and ``out`` (when given) on its device."""
    if a.device.type != "cuda":
        raise ValueError(f"{op}: a must be a CUDA tensor; got {_shape(a)}")
    for name, t in (("b", b), ("a_scale", a_scale), ("b_scale", b_scale), ("out", out)):
        if t is not None and t.device != a.device:
            raise ValueError(f"{op}: {name} must be on a's device {a.device}; got {_shape(t)}")


def _check_block_scaled(op, dtype, a, a_scale, b, b_scale, expert_offsets, out, devices=True, tile_n=192) -> None:
    """The block-scaled kernels' operands (FP8 or INT8): K and N positive multiples of 128 (the
    kernels step K in whole 128-wide scale blocks and read one weight scale per 128 columns),
    ``a_scale [M, K/128]``, ``b_scale [E, N/128, K/128]`` or, for the kernels of 192-wide tiles
    (``tile_n``), :func:`kernel_weight_scale`'s ``[E, N/64, K/128]``. The caller checks the
    rows first (:func:`_check_rows`)."""
    groups = (BLOCK, WEIGHT_SCALE_GROUP_N) if tile_n % BLOCK else (BLOCK,)
    check_operands(op, a, a_scale, b, b_scale, expert_offsets, out, dtype=dtype, k_multiple=BLOCK,
                   n_multiple=BLOCK, a_scale_shapes=lambda m, k: [(m, k // BLOCK)],
                   b_scale_shapes=lambda e, n, k: [(e, n // g, k // BLOCK) for g in groups],
                   devices=devices)  # fmt: skip


WEIGHT_SCALE_GROUP_N = 64
"""Columns per weight scale in the project's block-scaled kernels (``kGroupN`` of the
configurations in ``block_scaled_contiguous_gemm.cuh``: a 192-column tile meets two 128-column
weight blocks). They take ``b_scale`` on that grid, and repeat a ``[E, N/128, K/128]`` one to it
themselves, a copy kernel per GEMM call."""


def kernel_weight_scale(b_scale: torch.Tensor) -> torch.Tensor:
    """``[E, N/128, K/128]`` 128x128 block scales on the kernels' grid, ``[E, N/64, K/128]`` (each
    repeated for its 64-column groups): what :meth:`CutlassBackend.prepare_weights` makes once, so
    that no GEMM call repeats them."""
    return b_scale.float().repeat_interleave(BLOCK // WEIGHT_SCALE_GROUP_N, 1).contiguous()


def _refuse_repeated_for_sgl(b: torch.Tensor, b_scale: torch.Tensor) -> None:
    if b_scale.shape[1] != b.shape[1] // BLOCK:
        raise ValueError(
            f"sgl-kernel's FP8 op takes one weight scale per 128x128 block, [E, N/128, K/128]; got b_scale "
            f"{tuple(b_scale.shape)} for b {tuple(b.shape)} (the project's kernel's grid: EPMOE_CUTLASS_IMPL=epmoe)"
        )


def _output(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``out``, or a new bf16 ``[M, N]`` tensor."""
    m = a.shape[0]
    return torch.empty((m, b.shape[1]), dtype=torch.bfloat16, device=a.device) if out is None else out


def _check_rows(a) -> None:
    """``a``'s rows must fit the kernels (checked first: a view of that many rows is cheap)."""
    m = a.shape[0]
    if m >= MAX_ROWS:
        raise ValueError(f"a has {m} rows; the CUTLASS kernel takes fewer than {MAX_ROWS}")


def _check_channel_scaled(op, a, a_scale, b, b_scale, expert_offsets, out, devices=True) -> None:
    """The INT8 channel-scaled kernel's operands: K a positive multiple of 16 (16-byte TMA rows of
    A and B), N of 8 (of the bf16 output), ``a_scale [M, 1]`` or ``[M]``, ``b_scale [E, N, 1]`` or
    ``[E, N]``. The caller checks the rows first (:func:`_check_rows`)."""
    check_operands(op, a, a_scale, b, b_scale, expert_offsets, out, dtype=torch.int8, k_multiple=16, n_multiple=8,
                   a_scale_shapes=lambda m, k: [(m, 1), (m,)], b_scale_shapes=lambda e, n, k: [(e, n, 1), (e, n)],
                   devices=devices)  # fmt: skip


def _check_swizzle(op: str, max_swizzle) -> None:
    if max_swizzle not in (1, 2, 4, 8):
        raise ValueError(f"{op}: max_swizzle={max_swizzle!r}; allowed: 1, 2, 4 or 8")


def int8_grouped_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    expert_offsets: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    raster_along_n: bool = True,
    max_swizzle: int = 1,
) -> torch.Tensor:
    """``out[offsets[e]:offsets[e+1]] = (a[rows] @ b[e]^T) * a_scale[rows] * b_scale[e]^T`` in bf16,
    the K sum exact in int32 (the project's INT8 kernel; sgl-kernel has no such grouped op).

    Args:
        a: ``[M, K]`` int8, contiguous; ``K`` a multiple of 16.
        a_scale: ``[M, 1]`` (or ``[M]``) fp32 per-row multipliers.
        b: ``[E, N, K]`` int8 contiguous; ``N`` a multiple of 8.
        b_scale: ``[E, N, 1]`` (or ``[E, N]``) fp32 per-output-channel multipliers.
        expert_offsets: ``[E+1]`` int32 row offsets, multiples of 128, as in :func:`grouped_gemm`.
        out: optional ``[M, N]`` bf16 output; rows outside ``offsets[0]:offsets[E]`` are left
            unwritten.
        raster_along_n: the persistent tiles walk every N tile of a 128-row block before the next
            block (``True``, the default) or every block of an N tile first (``False``: a weight
            wider than L2 is then read from HBM once per wave instead of once per row block).
        max_swizzle: tiles of the other dimension taken together (1, 2, 4 or 8).

    Raises:
        TypeError, ValueError: what :func:`check_operands` refuses (K a positive multiple of 16, N
            of 8), ``a`` with ``MAX_ROWS`` rows or more, ``max_swizzle`` not 1, 2, 4 or 8; all
            before the extension is loaded.

    Returns:
        ``out``, ``[M, N]`` bf16.
    """
    _check_swizzle("int8_grouped_gemm", max_swizzle)  # first, as int8_dense_gemm: not hidden by a device refusal
    _check_rows(a)
    _check_channel_scaled("int8_grouped_gemm", a, a_scale, b, b_scale, expert_offsets, out)
    out = _output(a, b, out)
    m = a.shape[0]
    if m == 0 or b.shape[0] == 0:
        return out
    offsets = expert_offsets.to(device=a.device, dtype=torch.int32).contiguous()
    load_extension().int8_contiguous_gemm(out, a.contiguous(), a_scale.contiguous(), b, b_scale.contiguous(), offsets,
                                          int(bool(raster_along_n)), int(max_swizzle), pdl_enabled(a.device))  # fmt: skip
    return out


def int8_dense_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    raster_along_n: bool = True,
    max_swizzle: int = 1,
    kernel: str = "cooperative",
) -> torch.Tensor:
    """``out = (a @ b^T) * a_scale * b_scale^T`` in bf16 for one weight, the K sum exact in int32:
    the kernel of :func:`int8_grouped_gemm` over every row of ``a`` as one expert, without the
    offsets tensor and the row-block table that call builds on the GPU (two launches fewer; a
    dense linear's call), or CUTLASS's pingpong kernel on the same operands.

    Args:
        a: ``[M, K]`` int8, contiguous; ``M`` a multiple of 128 (pad the rows: the padding rows are
            computed, their outputs are the caller's to drop), ``K`` of 16.
        a_scale: ``[M, 1]`` (or ``[M]``) fp32 per-row multipliers.
        b: ``[N, K]`` (or ``[1, N, K]``) int8 contiguous; ``N`` a multiple of 8.
        b_scale: ``[N, 1]`` (or ``[N]``, ``[1, N, 1]``, ``[1, N]``) fp32 per-output-channel multipliers.
        out: optional contiguous ``[M, N]`` bf16 output.
        raster_along_n, max_swizzle: the tiles' walk, as in :func:`int8_grouped_gemm`.
        kernel: one of :data:`~epmoe.kernels.configs.CUTLASS_DENSE_KERNELS`: ``"cooperative"``
            (:func:`int8_grouped_gemm`'s kernel, 128 x 256 tiles) or ``"pingpong"`` (128 x 128
            tiles, each consumer warpgroup on its own, one's epilogue under the other's MMAs). The
            same int32 sums and epilogue arithmetic, so the same output bits; the dense plan's
            table says which is faster per shape and batch.

    Raises:
        TypeError, ValueError: what :func:`check_operands` refuses, ``M`` not a multiple of 128 or
            ``MAX_ROWS`` or more, ``max_swizzle`` not 1, 2, 4 or 8, ``kernel`` not one of
            :data:`~epmoe.kernels.configs.CUTLASS_DENSE_KERNELS`; all before the extension is
            loaded.

    Returns:
        ``out``, ``[M, N]`` bf16.
    """
    op = "int8_dense_gemm"
    if kernel not in CUTLASS_DENSE_KERNELS:
        raise ValueError(f"{op}: kernel={kernel!r}; allowed: {list(CUTLASS_DENSE_KERNELS)}")
    _check_rows(a)
    if isinstance(b, torch.Tensor) and b.dim() == 2:
        b = b.unsqueeze(0)
    if isinstance(b_scale, torch.Tensor) and b_scale.dim() in (1, 2) and b_scale.shape[0] != 1:
        b_scale = b_scale.unsqueeze(0)
    # What only this op refuses first (a wrong device would otherwise be named before it).
    if isinstance(b, torch.Tensor) and b.dim() == 3 and b.shape[0] != 1:
        raise ValueError(f"{op}: b must be one weight, [N, K] or [1, N, K]; got {tuple(b.shape)}")
    if isinstance(a, torch.Tensor) and a.dim() == 2 and a.shape[0] % ROW_BLOCK:
        raise ValueError(f"{op}: a has {a.shape[0]} rows; allowed: a multiple of {ROW_BLOCK} (pad the rows)")
    _check_swizzle(op, max_swizzle)
    _check_channel_scaled(op, a, a_scale, b, b_scale, None, out)  # b is [1, N, K] here: E = 1
    out = _output(a, b, out)
    if a.shape[0] == 0:
        return out
    load_extension().int8_dense_gemm(out, a.contiguous(), a_scale.contiguous(), b, b_scale.contiguous(),
                                     int(bool(raster_along_n)), int(max_swizzle), pdl_enabled(a.device),
                                     CUTLASS_DENSE_KERNELS.index(kernel))  # fmt: skip
    return out


def int8_block_grouped_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    expert_offsets: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    schedule: str = DEFAULT_INT8_BLOCK_SCHEDULE,
) -> torch.Tensor:
    """``out[r] = sum_kb (a[r, kb] @ b[e, :, kb]^T) * a_scale[r, kb] * b_scale[e, :, kb]`` in bf16
    for the rows ``r`` of each expert ``e`` (``kb``: the 128-wide K blocks, each summed exactly in
    int32, promoted to fp32 once; the scales' N blocks repeated over their 128 columns). The
    project's INT8 block kernel; sgl-kernel has none.

    Args:
        a: ``[M, K]`` int8; ``K`` a multiple of 128 (the 1x128 scale groups; the layer's
            int8_block sizes always are).
        a_scale: ``[M, K/128]`` fp32 activation scales (one per 1x128 group).
        b: ``[E, N, K]`` int8 contiguous; ``N`` a multiple of 128.
        b_scale: ``[E, N/128, K/128]`` fp32 weight scales (one per 128x128 block).
        expert_offsets: ``[E+1]`` int32 row offsets, multiples of 128, as in :func:`grouped_gemm`.
        out: optional ``[M, N]`` bf16 output; rows outside ``offsets[0]:offsets[E]`` are left
            unwritten.
        schedule: one of :data:`INT8_BLOCK_SCHEDULES` (the same sums whichever).

    Raises:
        TypeError, ValueError: what :func:`check_operands` refuses (K or N not a positive multiple
            of 128 among them), ``a`` with ``MAX_ROWS`` rows or more, an unknown ``schedule``; all
            before the extension is loaded.

    Returns:
        ``out``, ``[M, N]`` bf16.
    """
    index = _schedule_index(schedule)
    _check_rows(a)
    _check_block_scaled("int8_block_grouped_gemm", torch.int8, a, a_scale, b, b_scale, expert_offsets, out,
                        tile_n=INT8_BLOCK_TILE_N[schedule])  # fmt: skip
    out = _output(a, b, out)
    if a.shape[0] == 0 or b.shape[0] == 0:
        return out
    offsets = expert_offsets.to(device=a.device, dtype=torch.int32).contiguous()
    load_extension().int8_block_contiguous_gemm(
        out, a.contiguous(), kernel_act_scale(a_scale), b, b_scale.contiguous(), offsets, *TILE_ORDER, index,
        pdl_enabled(a.device),
    )
    return out


def int8_block_silu_grouped_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    expert_offsets: torch.Tensor,
    *,
    schedule: str = DEFAULT_INT8_BLOCK_SCHEDULE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GEMM1 of an ``int8_block`` pass with ``silu(gate) * up`` and its 1x128 requantization fused
    into the epilogue: :func:`int8_block_grouped_gemm`'s fp32 sums of each expert's rows with
    ``b`` = w13 as stored (gate rows ``[0, N/2)``, up rows ``[N/2, N)``) become
    ``h = silu(gate) * up`` (``[M, N/2]``), quantized per 1 x 128 group by the rule of
    :mod:`epmoe.kernels.quantize` (``scale = max(amax, 1e-10) / 127``, codes ``h / scale`` rounded
    to nearest even). A tile is 128 gate rows and the same 128 up rows of ``b`` (two loads), so
    GEMM1's output never reaches memory and the weights are read as stored.

    Args:
        a, a_scale, expert_offsets: as in :func:`int8_block_grouped_gemm`.
        b: ``[E, N, K]`` int8 contiguous, ``N`` a multiple of 256 (``I`` of 128).
        b_scale: ``[E, N/128, K/128]`` fp32.
        schedule: one of :data:`SILU_FUSED_SCHEDULES`.

    Raises:
        TypeError, ValueError: what :func:`int8_block_grouped_gemm` refuses, ``N`` not a multiple
            of 256, a schedule without a fused build; all before the extension is loaded.

    Returns:
        ``(q, q_scale)``: ``[M, N/2]`` int8 and ``[M, N/256]`` fp32 stored MN-major
        (:func:`is_mn_major`: what GEMM2 reads without a copy); rows outside
        ``offsets[0]:offsets[E]`` hold anything.
    """
    op = "int8_block_silu_grouped_gemm"
    index = _fused_schedule_index(op, schedule)
    _check_rows(a)
    _check_block_scaled(op, torch.int8, a, a_scale, b, b_scale, expert_offsets, None, devices=False,
                        tile_n=INT8_BLOCK_TILE_N[schedule])  # fmt: skip
    _check_gate_up_rows(op, b)
    _check_devices(op, a, a_scale, b, b_scale, None)
    m, n = a.shape[0], b.shape[1]
    q = torch.empty((m, n // 2), dtype=torch.int8, device=a.device)
    q_scale = mn_major_scales(m, n // 2 // BLOCK, a.device)
    if m == 0 or b.shape[0] == 0:
        return q, q_scale
    offsets = expert_offsets.to(device=a.device, dtype=torch.int32).contiguous()
    load_extension().int8_block_silu_gemm(
        q, q_scale, a.contiguous(), kernel_act_scale(a_scale), b, b_scale.contiguous(), offsets, *TILE_ORDER, index,
        pdl_enabled(a.device),
    )
    return q, q_scale


def _fused_schedule_index(op: str, schedule: str) -> int:
    if schedule not in SILU_FUSED_SCHEDULES:
        raise ValueError(f"{op}: schedule={schedule!r}; allowed (the fused builds): {list(SILU_FUSED_SCHEDULES)}")
    return _schedule_index(schedule)


def _check_gate_up_rows(op: str, b: torch.Tensor) -> None:
    """The fused GEMM1's ``N = 2I``: gate and up halves of whole 128-row blocks."""
    if b.shape[1] % (2 * BLOCK):
        raise ValueError(f"{op}: b has N={b.shape[1]} rows; the fused GEMM1 needs a multiple of {2 * BLOCK} "
                         f"(gate and up halves of whole {BLOCK}-row blocks)")  # fmt: skip


def _schedule_index(schedule: str) -> int:
    _check_schedule(schedule, "schedule")
    return INT8_BLOCK_SCHEDULES.index(schedule)


# --------------------------------------------------------------------------- the masked layout
def _check_masked(op, a, a_scale, b, masked_m, out, scale_cols) -> None:
    """The masked layout's own conditions, before the contiguous checks run on its rows:
    ``a [E, max_m, K]`` with ``max_m`` a multiple of :data:`ROW_BLOCK` (the kernels tile whole
    128-row blocks of each expert's slab; pad the capacity, :func:`pad_capacity`), ``a_scale
    [E, max_m, scale_cols(K)]``, ``masked_m`` an integer ``[E]`` tensor (on the host: each 0 to
    ``max_m``), ``out`` ``None`` or a contiguous bf16 ``[E, max_m, N]`` tensor."""
    for name, t in (("a", a), ("a_scale", a_scale), ("b", b), ("masked_m", masked_m)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a tensor; got {t!r}")
    if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0]:
        raise ValueError(f"{op}: a must be [E, max_m, K] and b [E, N, K] with the same E; got a {_shape(a)} and b {_shape(b)}")
    e, max_m, k = a.shape
    if max_m % ROW_BLOCK:
        raise ValueError(f"{op}: a has max_m={max_m} rows per expert; the kernel needs a multiple of {ROW_BLOCK} "
                         "(pad the capacity: pad_capacity)")  # fmt: skip
    want = (e, max_m, *scale_cols(k))
    if tuple(a_scale.shape) != want:
        raise ValueError(f"{op}: a_scale has shape {tuple(a_scale.shape)}; allowed: {want} (a {tuple(a.shape)})")
    if masked_m.dtype.is_floating_point or masked_m.dtype.is_complex or masked_m.dtype == torch.bool:
        raise TypeError(f"{op}: masked_m must be an integer tensor; got {_shape(masked_m)}")
    if tuple(masked_m.shape) != (e,):
        raise ValueError(f"{op}: masked_m must be [E] = [{e}]; got {_shape(masked_m)}")
    if out is not None and (out.dtype != torch.bfloat16 or tuple(out.shape) != (e, max_m, b.shape[1])
                            or not out.is_contiguous()):  # fmt: skip
        raise ValueError(f"{op}: out must be a contiguous bf16 [E, max_m, N] = [{e}, {max_m}, {b.shape[1]}] "
                         f"tensor; got {_shape(out)}")  # fmt: skip
    if masked_m.device.type == "cpu" and masked_m.numel() and not bool(((masked_m >= 0) & (masked_m <= max_m)).all()):
        raise ValueError(f"{op}: masked_m must lie between 0 and max_m={max_m}; got {masked_m.tolist()}")


def _check_masked_devices(op, a, a_scale, b, b_scale, masked_m, out) -> None:
    """Every operand on ``a``'s CUDA device (``masked_m`` may also be a host tensor)."""
    _check_devices(op, a, a_scale, b, b_scale, out)
    if masked_m.device.type not in ("cpu", a.device.type) or (masked_m.is_cuda and masked_m.device != a.device):
        raise ValueError(f"{op}: masked_m must be on the host or on a's device {a.device}; got {_shape(masked_m)}")


def _masked_output(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    return torch.empty((*a.shape[:2], b.shape[1]), dtype=torch.bfloat16, device=a.device) if out is None else out


def _masked_rows(op, a, a_scale, b, masked_m, out, scale_cols):
    """:func:`_check_masked`, then ``(a, a_scale)`` contiguous and their ``E * max_m`` rows as the
    contiguous kernels take them (checked against the kernels' row limit)."""
    _check_masked(op, a, a_scale, b, masked_m, out, scale_cols)
    a, a_scale = a.contiguous(), a_scale.contiguous()
    e, max_m, k = a.shape
    rows = a.reshape(e * max_m, k)
    _check_rows(rows)
    return a, a_scale, rows, a_scale.reshape(e * max_m, -1)


def _masked_gemm(kind: str, a, a_scale, b, b_scale, masked_m, out, schedule: str | None) -> torch.Tensor:
    """The INT8 GEMM ``kind`` (``int8_block`` or ``int8_channel``) on the masked layout: its own
    conditions (:func:`_check_masked`), then the kernel's operand rule on the ``E * max_m`` rows
    (no offsets: the slabs are whole row blocks), the devices, and the op."""
    block = kind == "int8_block"
    op = "int8_block_masked_gemm" if block else "int8_masked_gemm"
    index = _schedule_index(schedule) if block else None
    per_row = isinstance(a_scale, torch.Tensor) and a_scale.dim() == 2  # channel: [E, max_m] or [E, max_m, 1]
    a, a_scale, rows, row_scales = _masked_rows(op, a, a_scale, b, masked_m, out, (lambda k: (k // BLOCK,)) if block
                                                else (lambda k: () if per_row else (1,)))  # fmt: skip
    if block:
        _check_block_scaled(op, torch.int8, rows, row_scales, b, b_scale, None, None, devices=False,
                            tile_n=INT8_BLOCK_TILE_N[schedule])  # fmt: skip
    else:
        _check_channel_scaled(op, rows, row_scales, b, b_scale, None, None, devices=False)
    _check_masked_devices(op, a, a_scale, b, b_scale, masked_m, out)
    out = _masked_output(a, b, out)
    if out.numel() == 0:
        return out
    masked_m = masked_m.to(device=a.device, dtype=torch.int32).contiguous()
    ext, pdl = load_extension(), pdl_enabled(a.device)
    if block:
        ext.int8_block_masked_gemm(out, a, a_scale, b, b_scale.contiguous(), masked_m, *TILE_ORDER, index, pdl)
    else:
        ext.int8_masked_gemm(out, a, a_scale, b, b_scale.contiguous(), masked_m, pdl)
    return out


def int8_block_masked_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    masked_m: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    schedule: str = DEFAULT_INT8_BLOCK_SCHEDULE,
) -> torch.Tensor:
    """:func:`int8_block_grouped_gemm` on the masked layout: ``out[e, r]`` for the first
    ``masked_m[e]`` rows ``r`` of each expert's slab (rows past them hold anything). No host
    read: the kernel's table of 128-row blocks is built on the GPU from ``masked_m``, and blocks
    with no valid row get no tiles.

    Args:
        a: ``[E, max_m, K]`` int8, ``max_m`` a multiple of 128, ``K`` of 128.
        a_scale: ``[E, max_m, K/128]`` fp32.
        b, b_scale: as in :func:`int8_block_grouped_gemm`.
        masked_m: ``[E]`` integer valid rows per expert, 0 to ``max_m`` (checked on the host, or
            by the kernel that builds the block table: a device-side assert).
        out: optional contiguous bf16 ``[E, max_m, N]``.
        schedule: one of :data:`INT8_BLOCK_SCHEDULES`.

    Raises:
        TypeError, ValueError: what :func:`_check_masked` and :func:`check_operands` refuse, an
            unknown ``schedule``; all before the extension is loaded.

    Returns:
        ``out``, ``[E, max_m, N]`` bf16.
    """
    return _masked_gemm("int8_block", a, a_scale, b, b_scale, masked_m, out, schedule)


def int8_block_silu_masked_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    masked_m: torch.Tensor,
    *,
    schedule: str = DEFAULT_INT8_BLOCK_SCHEDULE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`int8_block_silu_grouped_gemm` on the masked layout (operands as in
    :func:`int8_block_masked_gemm`): ``(q, q_scale)``, ``[E, max_m, N/2]`` int8 and
    ``[E, max_m, N/256]`` fp32 row-major (what the masked GEMM2 reads); rows past ``masked_m[e]``
    hold anything.

    Raises:
        TypeError, ValueError: what :func:`int8_block_masked_gemm` refuses, ``N`` not a multiple of
            256, a schedule without a fused build; all before the extension is loaded.
    """
    op = "int8_block_silu_masked_gemm"
    index = _fused_schedule_index(op, schedule)
    a, a_scale, rows, row_scales = _masked_rows(op, a, a_scale, b, masked_m, None, lambda k: (k // BLOCK,))
    _check_block_scaled(op, torch.int8, rows, row_scales, b, b_scale, None, None, devices=False,
                        tile_n=INT8_BLOCK_TILE_N[schedule])  # fmt: skip
    _check_gate_up_rows(op, b)
    _check_masked_devices(op, a, a_scale, b, b_scale, masked_m, None)
    (e, max_m, _), n = a.shape, b.shape[1]
    q = torch.empty((e, max_m, n // 2), dtype=torch.int8, device=a.device)
    q_scale = torch.empty((e, max_m, n // 2 // BLOCK), dtype=torch.float32, device=a.device)
    if q.numel() == 0:
        return q, q_scale
    masked_m = masked_m.to(device=a.device, dtype=torch.int32).contiguous()
    load_extension().int8_block_silu_masked_gemm(
        q, q_scale, a, a_scale, b, b_scale.contiguous(), masked_m, *TILE_ORDER, index, pdl_enabled(a.device)
    )
    return q, q_scale


def int8_masked_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor,
    masked_m: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`int8_grouped_gemm` (per-token and per-channel scales, int32 K sum) on the masked
    layout, as :func:`int8_block_masked_gemm`: ``a [E, max_m, K]`` int8 (``max_m`` a multiple of
    128, ``K`` of 16), ``a_scale [E, max_m, 1]`` or ``[E, max_m]`` fp32, ``b [E, N, K]``,
    ``b_scale [E, N, 1]`` or ``[E, N]``; returns ``out`` ``[E, max_m, N]`` bf16, its rows past
    ``masked_m[e]`` holding anything.

    Raises:
        TypeError, ValueError: what :func:`_check_masked` and :func:`check_operands` refuse; all
            before the extension is loaded.
    """
    return _masked_gemm("int8_channel", a, a_scale, b, b_scale, masked_m, out, None)


def pad_capacity(t: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    """``t [E, cap, ...]`` as ``[E, rows, ...]`` (``rows >= cap``), its first ``cap`` rows of
    each expert copied and the rest uninitialised (rows past ``masked_m`` are never read back);
    ``t`` itself when ``cap == rows``."""
    if t is None or t.shape[1] == rows:
        return t
    padded = t.new_empty((t.shape[0], rows, *t.shape[2:]))
    padded[:, : t.shape[1]] = t
    return padded


def _sgl_grouped_gemm(out, a, a_scale, b, b_scale, offsets) -> None:
    """sgl-kernel's op: it takes weights as ``[E, K, N]`` views (K-major underneath) and fills the
    per-group arrays itself from ``problem_sizes`` and ``expert_offsets``."""
    e, n, k = b.shape
    dev = a.device
    counts = (offsets[1:] - offsets[:-1]).to(torch.int32)
    problem_sizes = torch.stack(
        [counts, torch.full_like(counts, n), torch.full_like(counts, k)], dim=1
    ).contiguous()
    i64 = dict(dtype=torch.int64, device=dev)
    ptrs = [torch.empty(e, **i64) for _ in range(5)]
    strides = [torch.full((e,), k, **i64), torch.full((e,), k, **i64), torch.full((e,), n, **i64)]
    layouts = [torch.empty((e, 5), dtype=torch.int32, device=dev) for _ in range(2)]
    # sgl-kernel takes the workspace from the caller and exposes no size query. A CUTLASS SM90
    # ptr-array grouped GEMM (sgl-kernel's) needs one 128-byte TMA descriptor per operand (A, B, C,
    # D) per SM (GemmKernel::get_workspace_size: sm_count * 4 * 128); twice that.
    sm = devices.sm_count(dev)
    workspace = torch.empty(sm * 8 * 128, dtype=torch.uint8, device=dev)
    sgl_kernel_op()(
        out, *ptrs, a, b.transpose(1, 2), a_scale, b_scale.transpose(1, 2), *strides, *layouts,
        problem_sizes, offsets[:-1].contiguous(), workspace,
    )  # fmt: skip


# ------------------------------------------------------------- INT8 kernel by rows per expert
CROSSOVER_FILE = Path(__file__).resolve().parent.parent / "configs" / "int8_crossover.json"
"""Measured Triton/CUTLASS crossovers of the INT8 schemes, keyed by GPU name and scheme (written by
``benchmarks/int8_crossover.py``; see :func:`~epmoe.experts.fp8_selection.int8_rows_rule`)."""


@functools.lru_cache(maxsize=4)
def crossover_data(path: Path = CROSSOVER_FILE) -> dict:
    """The crossover file's contents (package data, read once), ``{}`` when it is not shipped.

    Raises:
        ValueError: the file is not a JSON object.
    """
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object keyed by GPU name; got {type(data).__name__}")
    return {gpu: entries for gpu, entries in data.items() if not gpu.startswith("_")}  # "_comment" keys


def int8_rule(device: torch.device, scheme: str) -> RowsRule:
    """The rows-per-expert rule of ``scheme`` on ``device`` (its GPU name, :func:`gpu_name`;
    ``device.type`` off CUDA), logged the first time it is asked for."""
    device = torch.device(device)
    return _rule(gpu_name(device) or device.type, scheme)


@torch.compiler.assume_constant_result
def _cutlass_from(device: torch.device, scheme: str) -> int:
    """:func:`int8_rule`'s threshold, a plain int (``sys.maxsize``: never CUTLASS). The forward
    asks for it, and under ``torch.compile`` the answer is taken once at trace time as a constant:
    the rule reads the crossover file and the GPU name, which dynamo cannot trace."""
    rule = int8_rule(device, scheme)
    return sys.maxsize if rule.cutlass_from is None else rule.cutlass_from


def int8_kernel_for(device: torch.device, scheme: str, rows_per_expert: int) -> str:
    """``"triton"`` or ``"cutlass"``: :meth:`RowsRule.kernel_for` of :func:`int8_rule`, traceable
    (``rows_per_expert`` may be a symbolic size)."""
    return "triton" if rows_per_expert < _cutlass_from(torch.device(device), scheme) else "cutlass"


@functools.lru_cache(maxsize=None)
def _rule(gpu: str, scheme: str) -> RowsRule:
    rule = int8_rows_rule(crossover_data(), gpu, scheme)
    log.info("cutlass backend, INT8 kernel by rows per expert: %s", rule.describe())
    return rule


def _measured_schedule_on(device: torch.device | str) -> str:
    """:func:`measured_or_default_schedule` through the per-device cached, compile-constant lookup
    the forward uses."""
    return INT8_BLOCK_SCHEDULES[_measured_schedule_index(torch.device(device))]


@torch.compiler.assume_constant_result
def _measured_schedule_index(device: torch.device) -> int:
    """The index in :data:`INT8_BLOCK_SCHEDULES` of :func:`measured_or_default_schedule` on
    ``device``. A plain int, taken once at trace time under ``torch.compile``: the lookup reads
    the schedule file and the GPU name, which dynamo cannot trace."""
    return _schedule_index_on(torch.device("cuda", devices.cuda_index(device)) if device.type == "cuda" else device)


@functools.lru_cache(maxsize=None)
def _schedule_index_on(device: torch.device) -> int:
    # Cached per device: the forward asks on every call, and the file and the GPU name are fixed
    # for the process; the choice is logged the first time.
    name = measured_or_default_schedule(device)
    fused = " unless activation='separate'" if name in SILU_FUSED_SCHEDULES else ""
    log.info("cutlass backend, INT8 block kernel on %s (%s): variant %s (128 x %d tiles; the one measured "
             "for this GPU, else the default; %s%s)", device, gpu_name(device) or device.type, name,
             INT8_BLOCK_TILE_N[name], gemm1_note(name), fused)  # fmt: skip
    return INT8_BLOCK_SCHEDULES.index(name)


def batch_rows_per_expert(batch: ContiguousBatch) -> int:
    """The mean rows per local expert of ``batch`` without a device sync: the dispatcher's hint
    (``expected_m``) when the segment sizes stayed on the device, else the host counts; a batch
    that has neither gives its padded rows per expert (an upper bound)."""
    e = max(1, batch.num_experts)
    if batch.expected_m is not None:
        return int(batch.expected_m)
    if not isinstance(batch.num_rows, torch.Tensor):
        return math.ceil(sum(batch.num_rows) / e)
    return math.ceil(batch.x.shape[0] / e)


def host_sized(batch: ContiguousBatch) -> bool:
    """Whether ``batch``'s rows per expert are known on the host (:func:`packed_batch` then packs it
    to exactly its rows)."""
    return batch.expected_m is None and not isinstance(batch.num_rows, torch.Tensor)


def packed_batch(batch: ContiguousBatch) -> tuple[ContiguousBatch, torch.Tensor]:
    """``batch`` without its padding rows, and the rows of ``batch`` that the packed rows came
    from (``[R]`` int64 on its device). No host synchronisation: the rows are found with
    ``nonzero_static`` and the packed offsets and slot positions are computed on the device (so a
    CUDA graph may hold it).

    A host-sized batch packs to exactly its valid rows. A batch whose sizes stayed on the device
    packs to one row per (token, slot) of ``slot_pos``, the most valid rows it can have: rows past
    the valid ones are spare (``m_indices`` -1, past the packed ``expert_offsets[-1]``, its
    ``expected_m`` kept), and their entry in the returned rows is ``batch.x.shape[0]``, one past
    the last row of ``batch``."""
    m = batch.m_indices.numel()
    valid = batch.m_indices >= 0
    sized = host_sized(batch)
    size = int(sum(batch.num_rows)) if sized else batch.slot_pos.numel()
    rows = torch.nonzero_static(valid, size=size, fill_value=m).squeeze(1)
    inside = rows.clamp(max=max(m - 1, 0))
    experts = torch.where(rows < m, batch.m_indices.index_select(0, inside), -1).long()
    bins = torch.where(experts >= 0, experts, batch.num_experts)  # spare rows counted in an extra bin
    counts = torch.zeros(batch.num_experts + 1, dtype=torch.int64, device=rows.device)
    counts.scatter_add_(0, bins, torch.ones_like(bins))
    counts = counts[: batch.num_experts]
    offsets = torch.zeros(batch.num_experts + 1, dtype=torch.int32, device=rows.device)
    offsets[1:] = counts.cumsum(0).to(torch.int32)
    new_row = torch.cumsum(valid.to(torch.int64), 0) - 1  # packed index of each valid row
    slot = batch.slot_pos
    slot_pos = torch.where(slot >= 0, new_row.index_select(0, slot.clamp(min=0).reshape(-1)).view_as(slot), slot)
    take = (lambda t: None if t is None else t.index_select(0, inside))  # noqa: E731
    num_rows = list(batch.num_rows) if sized else counts.to(torch.int32)
    small = ContiguousBatch(take(batch.x), take(batch.x_scale), offsets, experts.to(torch.int32), slot_pos, num_rows,
                            None if sized else batch.expected_m)  # fmt: skip
    return small, rows


# -------------------------------------------------------------------------------------- backend
INT8_SCHEMES = frozenset({"int8_channel", "int8_block"})
INT8_KERNELS = ("auto", "cutlass", "triton")
"""``int8_kernel`` of :class:`CutlassBackend`: by rows per expert, or one of the two always."""
ACTIVATIONS = ("fused", "separate")
"""``activation`` of :class:`CutlassBackend`: ``int8_block``'s ``silu(gate) * up`` in GEMM1's
epilogue where the schedule has a fused build (:data:`SILU_FUSED_SCHEDULES`), or a kernel of its
own after GEMM1 (what every other schedule and scheme runs; the benchmarks compare the two)."""
KERNEL_NAMES = {
    "fp8_block": "CUTLASS FP8 block kernel",
    "int8_channel": "CUTLASS INT8 kernel",
    "int8_block": "CUTLASS INT8 block kernel",
}


class CutlassBackend(ExpertsBackend):
    """``fp8_block`` (sgl-kernel's op or the project's kernel) over the contiguous layout;
    ``int8_channel`` with the int32 accumulator and ``int8_block`` (the project's kernels) over the
    contiguous and the masked layouts.

    ``schedule``: the INT8 block kernel's, the argument, else ``$EPMOE_INT8_BLOCK_SCHEDULE`` (read
    when the backend is built; :attr:`schedule`), else the one measured on the GPU that holds the
    weights (:meth:`schedule_for`, looked up per device, not for the current one).
    ``int8_kernel``: ``"auto"`` (the INT8 GEMMs by rows per expert, :meth:`int8_kernel`), or
    ``"cutlass"`` / ``"triton"`` at every size (what the benchmarks compare). ``activation``: one
    of :data:`ACTIVATIONS`."""

    name = "cutlass"
    schemes = frozenset({"fp8_block", "int8_channel", "int8_block"})
    layouts = frozenset({"contiguous", "masked"})

    def __init__(
        self, scheme: QuantScheme, *, accumulator: str = "fp32", schedule: str | None = None, int8_kernel: str = "auto",
        activation: str = "fused",
    ) -> None:  # fmt: skip
        super().__init__(scheme, accumulator=accumulator)
        if scheme.name == "int8_channel" and accumulator != "int32":
            raise ValueError(_INT8_ACCUMULATOR)
        if int8_kernel not in INT8_KERNELS:
            raise ValueError(f"int8_kernel={int8_kernel!r}; allowed: {list(INT8_KERNELS)}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation={activation!r}; allowed: {list(ACTIVATIONS)}")
        self.activation = activation
        # Only the INT8 block kernel has schedules: a bad $EPMOE_INT8_BLOCK_SCHEDULE must not stop
        # FP8 or channel-wise layers from building (a schedule named here is still checked).
        self.schedule = (named_int8_block_schedule(schedule) if scheme.name == "int8_block" or schedule is not None
                         else None)  # fmt: skip
        self.forced_int8_kernel = None if int8_kernel == "auto" else int8_kernel
        if scheme.name == "int8_block" and self.schedule is not None:
            log.info("cutlass backend, INT8 block kernel: variant %s (128 x %d tiles; INT8_BLOCK_SCHEDULES); %s",
                     self.schedule, INT8_BLOCK_TILE_N[self.schedule],
                     gemm1_note(self.schedule, activation))  # fmt: skip
        # Below the measured INT8 crossover the whole pass is the Triton backend's (its GEMMs
        # too), so a Triton backend of the same scheme is held as a composed part for that
        # branch only; the CUTLASS pass calls the shared row-wise stages (stages.py) directly.
        self._triton_below_crossover = TritonBackend(scheme, accumulator=accumulator) if self.int8 else None
        # Decided once: the forward reads it (alignment) and torch.compile cannot trace the
        # package lookup behind it (importlib's find_spec).
        self._sgl_fp8 = not self.int8 and _use_sgl()

    @property
    def int8(self) -> bool:
        """An INT8 scheme (channel or block): the project's INT8 kernels and Triton's row stages."""
        return self.scheme.name in INT8_SCHEMES

    @property
    def alignment(self) -> int:
        """Rows each expert segment is padded to: the project's kernels give each 128-row block of
        the layout to one expert; sgl-kernel's FP8 op takes any segments."""
        return 1 if self._sgl_fp8 else ROW_BLOCK

    def alignment_for(self, rows_per_expert: int, device: torch.device) -> int:
        """INT8 batches that the measured rule gives to the Triton pass are laid out for it
        (no 128-row padding to compute on or pack away); the rest for the CUTLASS kernels."""
        if self.int8 and self._int8_kernel_at(device, rows_per_expert) == "triton":
            return self._triton_below_crossover.alignment
        return self.alignment

    @property
    def mn_major_scales(self) -> bool:  # type: ignore[override]
        """FP8 on the project's kernel reads activation scales MN-major: the layer's scatter (and
        the decode prep) write them so and GEMM1 takes them as they arrive
        (:func:`kernel_act_scale` passes them through). Not INT8: int8_channel's scales are one per
        token (a ``[M, 1]`` column, no layout to choose), and int8_block's written MN-major by the
        scatter made the layer slower on one H200 (decode at 128 tokens, where the Triton pass
        below the crossover runs, 3.51 against 3.36 ms; prefill at 4096 tokens no faster), so its
        scatter writes them row-major and the CUTLASS GEMM1 copies them transposed (its pass's
        own quantizers write MN-major, see :meth:`_run_int8`). sgl-kernel's FP8 op reads them
        row-major."""
        return not self.int8 and not self._sgl_fp8

    device_segments = True
    """Batches may keep their segment sizes on the device: the GEMMs read the offsets there and
    skip the blocks past the last segment, the row-wise stages skip the spare rows
    (:func:`~epmoe.experts.stages.spare_row_slab`)."""

    @property
    def prefers_host_sizes(self) -> bool:  # type: ignore[override]
        """INT8 picks CUTLASS or Triton GEMMs by the host's rows per expert (:meth:`int8_kernel`)."""
        return self.int8

    @classmethod
    def available(cls, device: torch.device) -> tuple[bool, str]:
        device = torch.device(device)
        env = os.environ
        installed = installed_facts() if env_enabled(env) else {}
        capability, cuda = machine_facts(device)
        decision = cutlass_decision(capability, cuda, env, installed)
        if decision.warn:
            _warn_once(cutlass_warning(decision))
        if env_enabled(env) and "EPMOE_CUTLASS_CONFIG" in env:  # read until session 9; said once
            _warn_once(
                "EPMOE_CUTLASS_CONFIG is no longer read: the CUTLASS kernel picks its configuration "
                "itself (128x192 tiles, 2x1 clusters, the epilogue by K; docs/fp8.md)"
            )
        return decision.ok, decision.reason

    @classmethod
    def supports(
        cls,
        scheme: QuantScheme,
        layout: str,
        device: torch.device,
        hidden: int,
        intermediate: int,
        *,
        accumulator: str = "fp32",
    ) -> tuple[bool, str]:
        # The INT8 conditions that do not depend on the machine come first, so that a layer the
        # kernel could never serve (fp32 accumulator) is not told about the machine's. int8_block's
        # sizes (multiples of 128) are the base's scheme rule.
        if layout == "masked" and scheme.name not in INT8_SCHEMES and scheme.name in cls.schemes:
            return False, (
                f"runs quant={scheme.name!r} on the contiguous layout only (the masked layout: "
                "INT8 schemes; FP8 masked runs on backend='deepgemm')"
            )
        if scheme.name == "int8_channel" and layout in cls.layouts:
            if accumulator != "int32":
                return False, _INT8_ACCUMULATOR
            if hidden % 16 or intermediate % 16:
                return False, (
                    f"the INT8 kernel needs hidden and intermediate sizes that are multiples of 16 "
                    f"(TMA rows of 16 bytes); got hidden={hidden}, intermediate={intermediate}"
                )
        ok, reason = super().supports(scheme, layout, device, hidden, intermediate, accumulator=accumulator)
        if not ok or scheme.name not in INT8_SCHEMES:
            return ok, reason
        missing = own_kernel_missing()  # sgl-kernel has no INT8 grouped GEMM
        if missing:
            reason = f"{ENV_VAR}=1 but the INT8 kernels are the project's own and {missing}"
            _warn_once(f"cutlass MoE backend not used for {scheme.name}: {reason}")
            return False, reason
        int8_rule(device, scheme.name)  # logs, when the layer selects, which kernel serves which sizes
        return True, f"{reason.rsplit(': ', 1)[0]}: epmoe's {KERNEL_NAMES[scheme.name]}"

    def prepare_weights(self, weights: ExpertWeights) -> ExpertWeights:
        """The base's checked, contiguous weights; for FP8 on the project's kernel with the block
        scales repeated to its 64-column grid once (:func:`kernel_weight_scale`), instead of
        inside each of the two GEMM calls of every forward. INT8 keeps the checkpoint's grid:
        below the crossover its batches run on the Triton GEMMs, which read that."""
        weights = super().prepare_weights(weights)
        if self.int8 or self._sgl_fp8:
            return weights
        return dataclasses.replace(
            weights, w13_scale=kernel_weight_scale(weights.w13_scale), w2_scale=kernel_weight_scale(weights.w2_scale)
        )

    def warmup(self, weights: ExpertWeights, max_m: int = 0) -> None:
        """Build the extension (first use) so no compile happens inside a timed or captured region."""
        if not self._sgl_fp8:
            load_extension()

    def schedule_for(self, device: torch.device) -> str:
        """The INT8 block kernel's schedule on ``device`` (the weights'): :attr:`schedule`, else
        the one measured on that GPU (:func:`measured_or_default_schedule`). Other schemes'
        kernels take none: the default, which their op ignores."""
        if self.schedule is not None:
            return self.schedule
        if self.scheme.name != "int8_block":
            return DEFAULT_INT8_BLOCK_SCHEDULE
        return _measured_schedule_on(device)

    def int8_kernel(self, batch: ContiguousBatch) -> str:
        """``"cutlass"`` or ``"triton"``: which GEMMs an INT8 batch runs on, by its rows per expert
        (:func:`batch_rows_per_expert`) and the measured crossover of this GPU and scheme
        (:func:`int8_rule`; without data, CUTLASS). A batch whose sizes stayed on the device is
        judged by the dispatcher's hint (a host number, fixed inside a CUDA graph), so a captured
        decode step runs the Triton branch below the crossover as an eager one does. The rule is
        logged once per GPU and scheme."""
        return self._int8_kernel_at(batch.x.device, batch_rows_per_expert(batch))

    def _int8_kernel_at(self, device: torch.device, rows_per_expert: int) -> str:
        """The forced ``int8_kernel``, else :func:`int8_kernel_for`."""
        return self.forced_int8_kernel or int8_kernel_for(device, self.scheme.name, rows_per_expert)

    def run_contiguous(
        self, batch: ContiguousBatch, weights: ExpertWeights, out_dtype: torch.dtype
    ) -> torch.Tensor:
        kernel = self.int8_kernel(batch) if self.int8 else "cutlass"
        return self.run_kernel(batch, weights, out_dtype, kernel)

    def run_kernel(
        self, batch: ContiguousBatch, weights: ExpertWeights, out_dtype: torch.dtype, kernel: str
    ) -> torch.Tensor:
        """:meth:`run_contiguous` on the given GEMMs, whatever the rule would pick (public so that
        ``benchmarks/int8_crossover.py`` times exactly what each branch runs): ``"cutlass"``, or
        for INT8 ``"triton"``, the Triton backend's whole pass (:meth:`_triton_pass`)."""
        if kernel == "triton" and self.int8:
            return self._triton_pass(batch, weights, out_dtype)
        if kernel != "cutlass":
            allowed = ["cutlass", "triton"] if self.int8 else ["cutlass"]
            raise ValueError(f"kernel={kernel!r}; allowed for quant={self.scheme.name!r}: {allowed}")
        out = self._run_int8(batch, weights) if self.int8 else self._run_fp8(batch, weights)
        return out if out_dtype == torch.bfloat16 else out.to(out_dtype)

    def _triton_pass(self, batch: ContiguousBatch, weights: ExpertWeights, out_dtype: torch.dtype) -> torch.Tensor:
        """The Triton backend's pass. A batch laid out without padding (:meth:`alignment_for`: the
        layer's own scatter) runs as it is; a 128-row layout (a dispatcher's, e.g. DeepEP normal) is packed
        to segments of its rows first (:func:`packed_batch`: the Triton GEMMs tile any segment and
        would spend as many MMAs on the padding as on its rows), its output rows put back in their
        padded places (padding rows hold anything). The packed spare rows of a batch sized on the
        device land in one extra row past the end, dropped."""
        if batch.alignment == 1:  # no padding rows: laid out for this pass (alignment_for)
            return self._triton_below_crossover.run_contiguous(batch, weights, out_dtype)
        small, rows = packed_batch(batch)
        out = self._triton_below_crossover.run_contiguous(small, weights, out_dtype)
        m = batch.x.shape[0]
        full = torch.empty((m + 1, out.shape[1]), dtype=out.dtype, device=out.device)
        return full.index_copy_(0, rows, out)[:m]

    def _run_fp8(self, batch: ContiguousBatch, weights: ExpertWeights) -> torch.Tensor:
        """quantize (1x128 e4m3, unless it arrived so) -> GEMM1 -> silu(gate) * up requantized to
        1x128 e4m3 -> GEMM2, bf16 out. With spare rows (``batch.expected_m``) the row-wise stages
        skip them as in :meth:`_run_int8` and the GEMMs leave them unwritten."""
        from .. import ops

        hidden = weights.hidden_size
        if batch.x.shape[0] == 0:
            return torch.empty((0, hidden), dtype=torch.bfloat16, device=batch.x.device)
        offsets = batch.expert_offsets
        bound, lift, drop = spare_row_slab(batch)
        gemm = functools.partial(ops.cutlass_grouped_gemm, "fp8_block", impl="sgl" if self._sgl_fp8 else "epmoe")
        padding = stages.padding_rows(batch)
        with phase("epmoe.quantize"):
            a, a_scale = fp8_gemm_input(lift(batch.x), lift(batch.x_scale), hidden, *bound, padding,
                                        scale_mn_major=self.mn_major_scales)  # fmt: skip
        with phase("epmoe.gemm1"):
            gate_up = gemm(drop(a), drop(a_scale), weights.w13, weights.w13_scale, offsets)
        with phase("epmoe.activation"):
            rows = stages.row_args(*bound)
            h, h_scale = ops.silu_and_mul_quant(lift(gate_up), "group", BLOCK, torch.float8_e4m3fn,
                                                row_expert=padding, scale_mn_major=self.mn_major_scales, **rows)  # fmt: skip
        with phase("epmoe.gemm2"):
            return gemm(drop(h), drop(h_scale), weights.w2, weights.w2_scale, offsets)

    def _run_int8(self, batch: ContiguousBatch, weights: ExpertWeights) -> torch.Tensor:
        """quantize (per token or per 1x128 group, unless it arrived so) -> GEMM1 -> silu(gate) *
        up requantized the same way -> GEMM2, on the scheme's kernel; GEMM1 and the activation in
        one kernel where :meth:`_fused_gemm1` says so (GEMM1's output then never reaches memory).
        A separate GEMM1's output and the pass's are bf16 whatever the layer's dtype (the kernels
        write bf16). The row-wise stages are the shared Triton ones (:mod:`epmoe.experts.stages`);
        with spare rows (``batch.expected_m``) they skip them as in
        :meth:`TritonBackend.run_contiguous` (:func:`~epmoe.experts.stages.spare_row_slab`), and
        the GEMMs skip the blocks past the last segment."""
        check_weights(weights, self.scheme)
        from .. import ops

        scheme = self.scheme
        schedule = self.schedule_for(weights.w13.device)
        gemm = functools.partial(ops.cutlass_grouped_gemm, scheme.name, schedule=schedule)
        offsets = batch.expert_offsets
        bound, lift, drop = spare_row_slab(batch)
        padding = stages.padding_rows(batch)
        # The block kernel reads its activation scales MN-major: the pass's quantizers write them
        # so, no transposing copy per GEMM.
        mn_major = scheme.act_granularity != "token"
        with phase("epmoe.quantize"):
            a, a_scale = stages.gemm1_input(scheme, lift(batch.x), lift(batch.x_scale), weights, *bound, padding,
                                            scale_mn_major=mn_major)  # fmt: skip
        if self._fused_gemm1(schedule):
            with phase("epmoe.gemm1"):  # and the activation, in its epilogue
                h, h_scale = ops.cutlass_silu_gemm(drop(a), drop(a_scale), weights.w13, weights.w13_scale, offsets,
                                                   schedule)  # fmt: skip
        else:
            with phase("epmoe.gemm1"):
                gate_up = gemm(drop(a), drop(a_scale), weights.w13, weights.w13_scale, offsets)
            with phase("epmoe.activation"):
                h, h_scale = stages.activation(scheme, lift(gate_up), weights, *bound, padding, scale_mn_major=mn_major)
                h, h_scale = drop(h), drop(h_scale)
        with phase("epmoe.gemm2"):
            return gemm(h, h_scale, weights.w2, weights.w2_scale, offsets)

    def _fused_gemm1(self, schedule: str) -> bool:
        """Whether GEMM1 runs with the activation in its epilogue: ``activation="fused"``,
        ``int8_block`` (whose sizes are whole 128-column blocks by the scheme's rule) and a
        schedule with a fused build (:data:`SILU_FUSED_SCHEDULES`)."""
        return self.activation == "fused" and self.scheme.name == "int8_block" and schedule in SILU_FUSED_SCHEDULES

    def run_masked(
        self, batch: MaskedBatch, weights: ExpertWeights, out_dtype: torch.dtype
    ) -> torch.Tensor:
        """INT8 only: the Triton backend's masked pass below the measured crossover (judged by
        ``batch.expected_m``, a host number), else :meth:`_run_int8_masked`."""
        if not self.int8:
            raise NotImplementedError(
                f"the cutlass backend runs quant={self.scheme.name!r} on the contiguous layout only; "
                "use backend='deepgemm' for FP8 on the masked layout"
            )
        hint = max(1, int(batch.expected_m)) if batch.expected_m is not None else batch.x.shape[1]
        if self._int8_kernel_at(batch.x.device, hint) == "triton":
            return self._triton_below_crossover.run_masked(batch, weights, out_dtype)
        out = self._run_int8_masked(batch, weights)
        return out if out_dtype == torch.bfloat16 else out.to(out_dtype)

    def _run_int8_masked(self, batch: MaskedBatch, weights: ExpertWeights) -> torch.Tensor:
        """quantize (the valid rows; unless they arrived so) -> GEMM1 -> silu(gate) * up
        requantized (in GEMM1's epilogue where :meth:`_fused_gemm1` says so) -> GEMM2 on the
        masked layout, ``[E, cap, H]`` bf16 out. The kernels tile whole
        128-row blocks of each expert's slab, so a capacity off the block is padded (GEMM1's
        operand, after quantization: one copy of the int8 rows) and the output cut back; the
        blocks past ``masked_m`` get no tiles and the row-wise stages skip those rows."""
        check_weights(weights, self.scheme)
        from .. import ops

        scheme = self.scheme
        masked_m = batch.masked_m.to(device=batch.x.device, dtype=torch.int32)
        hint = None if batch.expected_m is None else max(1, int(batch.expected_m))
        cap = batch.x.shape[1]
        rows = -(-cap // ROW_BLOCK) * ROW_BLOCK
        schedule = self.schedule_for(weights.w13.device)
        gemm = functools.partial(ops.cutlass_masked_gemm, scheme.name, schedule=schedule)
        with phase("epmoe.quantize"):
            a, a_scale = stages.gemm1_input(scheme, batch.x, batch.x_scale, weights, masked_m, hint)
            a, a_scale = pad_capacity(a, rows), pad_capacity(a_scale.contiguous(), rows)
        if self._fused_gemm1(schedule):
            with phase("epmoe.gemm1"):  # and the activation, in its epilogue
                h, h_scale = ops.cutlass_silu_masked_gemm(a, a_scale, weights.w13, weights.w13_scale, masked_m,
                                                          schedule)  # fmt: skip
        else:
            with phase("epmoe.gemm1"):
                gate_up = gemm(a, a_scale, weights.w13, weights.w13_scale, masked_m)
            with phase("epmoe.activation"):
                h, h_scale = stages.activation(scheme, gate_up, weights, masked_m, hint)
        with phase("epmoe.gemm2"):
            out = gemm(h, h_scale, weights.w2, weights.w2_scale, masked_m)
        return out if rows == cap else out[:, :cap]


_INT8_ACCUMULATOR = (
    "the cutlass INT8 kernel sums K in int32 (exact): it runs quant='int8_channel' with "
    "accumulator='int32' only; accumulator='fp32' runs on backend='triton'"
)
