"""Programmatic dependent launch (PDL, Hopper and newer): what a kernel launched that way needs.

A kernel launched with ``launch_pdl=True`` may start while the kernel before it in the stream is
still running, once every program of that kernel has called ``griddepcontrol.launch_dependents``
(or exited). It must call ``griddepcontrol.wait`` (:func:`gdc_wait`) before it reads anything the
kernel before may have written; the wait returns when that kernel has finished and its writes are
visible. So a chain of such kernels overlaps each boundary's launch latency and the previous
kernel's tail, and whatever a kernel does before its wait that touches no predecessor's output
(:func:`prefetch_rows_l2`: weights) overlaps too.

Triggering dependents early is always safe: the dependent waits before it reads. What it costs is
that the dependent's programs may take SM slots (and issue their prefetches) while the trigger's
kernel still runs, which is why the dense GEMM places its trigger where its own loads are done;
the decode step's kernels trigger first thing (:func:`dependent_start`): every program of theirs
is placed by then, and the dependent only waits. The project's CUTLASS GEMMs follow the same
decision (:func:`pdl_enabled`, passed to their ops as ``pdl``): their block-table kernels trigger
first thing, the GEMMs from their last tiles, and every warp of a GEMM waits before its first
read. A kernel launched after one of these as a programmatic dependent (a third-party kernel with
PDL on) must wait likewise before it reads their outputs; ``EPMOE_PDL=0`` launches them plainly,
and none then triggers its dependents early.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

try:  # Triton >= 3.4 (grid dependency control); never traced unless a launch asks for PDL
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait, num_threads
except ImportError:  # pragma: no cover
    gdc_launch_dependents = gdc_wait = num_threads = None

PREFETCH_ALIGN = 16
"""Address and size granularity of ``cp.async.bulk.prefetch.L2`` (bytes)."""
_ALIGN = tl.constexpr(PREFETCH_ALIGN)


@functools.lru_cache(maxsize=None)
def pdl_supported(device: torch.device) -> bool:
    """Whether launches on ``device`` may use programmatic dependent launch: a CUDA GPU of
    compute capability 9.0 or newer and a Triton that has grid dependency control (the interpreter
    is :func:`pdl_enabled`'s to exclude)."""
    if device.type != "cuda" or gdc_wait is None:
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


PDL_VARIABLE = "EPMOE_PDL"
"""Environment variable that turns programmatic dependent launch off (``0``) for every kernel of
the package, for a driver or profiler that mishandles it; ``1`` or unset: on where supported."""


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch as programmatic dependents: :func:`pdl_supported`,
    not under Triton's interpreter (``TRITON_INTERPRET=1``, which cannot run the device calls,
    CUDA tensors or not), and not turned off by :data:`PDL_VARIABLE` (both read at each launch, so
    a benchmark can time both settings).

    Raises:
        ValueError: the variable holds something other than ``0`` or ``1``.
    """
    value = os.environ.get(PDL_VARIABLE, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{PDL_VARIABLE}={value!r} (from the environment); allowed: '0' (off), '1' (on where supported)")
    return value == "1" and os.environ.get("TRITON_INTERPRET") != "1" and pdl_supported(device)


def launch_options(pdl: bool) -> dict:
    """Extra keyword arguments of a Triton launch: ``launch_pdl`` when ``pdl``."""
    return {"launch_pdl": True} if pdl else {}


def dependent(device: torch.device, pdl: bool = True) -> dict:
    """The ``PDL`` flag and launch options of a kernel that calls :func:`dependent_start`: a
    programmatic dependent when ``pdl`` is asked for and :func:`pdl_enabled`."""
    on = pdl and pdl_enabled(device)
    return dict(PDL=on, **launch_options(on))


@triton.jit
def dependent_start(PDL: tl.constexpr):
    """With ``PDL``, a kernel's first step: let the next kernel launch now (its programs take their
    SM slots and wait while this one runs: every program of this kernel is already placed when
    the trigger takes effect), then wait for the kernel before, which may have written any input.
    Nothing is read or written before the wait, so the chain is safe after any predecessor."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


@triton.jit
def prefetch_rows_l2(rows_ptr, nbytes, ROWS: tl.constexpr):
    """Asks L2 to fetch ``nbytes`` (a scalar, rounded down to a multiple of 16) from each of the
    ``ROWS`` addresses of ``rows_ptr`` (16-byte aligned), without waiting:
    ``cp.async.bulk.prefetch.L2`` (sm_90; the addresses must be the tensor's own). A hint, not a
    load: nothing waits for it, and the caller's later loads of those bytes hit L2 if the lines
    are still there. Each row's bytes
    go out as one bulk request per thread (the row cut into 16-byte multiples), so every thread
    issues its own share instead of repeating a copy of a whole row's."""
    CHUNKS: tl.constexpr = num_threads() // ROWS if num_threads() > ROWS else 1
    nbytes = nbytes // _ALIGN * _ALIGN
    chunk = tl.cdiv(tl.cdiv(nbytes, CHUNKS), _ALIGN) * _ALIGN
    start = tl.arange(0, CHUNKS)[None, :] * chunk
    size = tl.minimum(tl.maximum(nbytes - start, 0), chunk)
    tl.inline_asm_elementwise(
        "{ .reg .pred %pf_any; setp.ne.u32 %pf_any, $2, 0; "
        "@%pf_any cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r", [rows_ptr.to(tl.int64)[:, None] + start, size],
        dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip
