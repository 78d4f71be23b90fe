"""Small helpers shared by the Triton kernels' Python wrappers (argument checks, padding)."""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch

from ..tensors import as_contiguous, check_positive_int


def _extend_interpreter_hook(hook: str, attr: str, value) -> None:
    """Make the interpreter's ``hook`` (which patches a ``triton.language`` object for
    interpretation) also set ``attr`` to ``value`` on that object; once, and not at all where the
    hook does not exist. Triton 3.6 passes a scope that records the patches; older interpreters
    patch in place."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, hook, None)
    if original is None or attr in getattr(original, "_epmoe_attrs", ()):
        return

    def patched(target, *scope):
        original(target, *scope)
        if scope:
            scope[0].set_attr(target, attr, value)
        else:
            setattr(target, attr, value)

    patched._epmoe_attrs = (*getattr(original, "_epmoe_attrs", ()), attr)
    setattr(interpreter, hook, patched)


def _patch_interpreter_index() -> None:
    """Let Triton 3.6's interpreter use runtime scalars as loop bounds under NumPy >= 2.4.

    The interpreter holds scalars as 1-element arrays and converts them with ``int(array)``,
    which NumPy 2.4 rejects ("only 0-dimensional arrays can be converted"). This applies the
    upstream fix (triton-lang/triton#9172) to the interpreter only; compiled kernels are
    unaffected.
    """

    def index(self):
        return int(np.asarray(self.handle.data).reshape(-1)[0])

    _extend_interpreter_hook("_patch_lang_tensor", "__index__", index)


def _exact_fma(x: np.ndarray, y: np.ndarray, z: np.ndarray) -> np.ndarray:
    """``x * y + z`` rounded once (round to nearest even), like the GPU's ``fma.rn``.

    float32: the product is exact in float64 and the sum's float64 rounding error is recovered
    with TwoSum; the float64 sum only needs fixing when it sits exactly on a float32 midpoint.
    Other dtypes fall back to numpy's (twice rounded) arithmetic.
    """
    if not (x.dtype == y.dtype == z.dtype == np.float32):
        return x * y + z
    with np.errstate(invalid="ignore", over="ignore"):
        p = x.astype(np.float64) * y.astype(np.float64)
        z64 = z.astype(np.float64)
        s = p + z64
        t = s - p
        err = (p - (s - t)) + (z64 - t)
        out = s.astype(np.float32)
        near = out.astype(np.float64)
        other = np.nextafter(out, np.where(near < s, np.float32(np.inf), np.float32(-np.inf)))
        tie = np.isfinite(s) & (near != s) & ((near + other.astype(np.float64)) * 0.5 == s) & (err != 0)
    if np.any(tie):
        # The exact value is off the midpoint by err: round toward it.
        up = err > 0
        hi = np.maximum(out, other)
        lo = np.minimum(out, other)
        out = np.where(tie, np.where(up, hi, lo), out).astype(np.float32)
    return np.asarray(out, dtype=np.float32)


def _patch_interpreter_fma() -> None:
    """Make the interpreter's ``tl.fma`` a fused multiply-add (one rounding), as on the GPU.

    Triton 3.6's interpreter computes ``x * y + z`` with two float32 roundings, which breaks
    the exact residuals the quantizers' division relies on (``fma(-q, b, a)`` is exact only when
    fused). Compiled kernels are unaffected.
    """
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    builder = getattr(interpreter, "InterpreterBuilder", None)
    original = getattr(builder, "create_fma", None)
    if original is None or getattr(original, "_epmoe_fixed", False):
        return

    def create_fma(self, x, y, z):
        return interpreter.TensorHandle(_exact_fma(x.data, y.data, z.data), z.dtype.scalar)

    create_fma._epmoe_fixed = True
    builder.create_fma = create_fma


def _patch_interpreter_sort() -> None:
    """Let Triton's interpreter run ``tl.sort`` as one NumPy sort.

    The interpreter runs the bitonic network of ``tl.sort`` one op at a time, ~0.6 s for 512
    keys, which made the slot kernels' CPU tests minutes long; ``np.sort`` gives the same result
    (the network sorts along the last dimension). Compiled kernels are unaffected.
    """
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return

    def sort(x, dim=None, descending=False):
        dim, descending = (getattr(v, "value", v) for v in (dim, descending))
        assert dim in (None, -1, len(x.shape) - 1), "tl.sort sorts along the last dimension only"
        data = np.sort(x.handle.data, axis=-1)
        if descending:
            data = np.flip(data, axis=-1)
        return tl.tensor(interpreter.TensorHandle(np.ascontiguousarray(data), x.handle.dtype), x.type)

    _extend_interpreter_hook("_patch_lang_core", "sort", sort)


_patch_interpreter_index()
_patch_interpreter_fma()
_patch_interpreter_sort()

_PLACEHOLDERS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def placeholder(device: torch.device, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """A cached 1-element tensor for a kernel pointer argument that a constexpr flag disables.

    The kernel never reads it, so one uninitialised tensor per (device, dtype) serves every call
    instead of an allocation per call. A CUDA device without an index means the current one, so
    the key carries the index: the cached tensor must live on the device of the launch.
    """
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    key = (device, dtype)
    t = _PLACEHOLDERS.get(key)
    if t is None:
        t = _PLACEHOLDERS[key] = torch.empty(1, dtype=dtype, device=device)
    return t


def next_pow2(n: int) -> int:
    """Smallest power of two >= ``n`` (1 for ``n <= 1``): Triton block shapes must be powers of 2."""
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def check_scale_input(x: torch.Tensor, x_scale: torch.Tensor) -> None:
    """``x_scale`` must be fp32-castable ``[..., S]`` matching ``x [..., K]`` with ``S | K``."""
    if not isinstance(x_scale, torch.Tensor) or not x_scale.is_floating_point():
        got = x_scale.dtype if isinstance(x_scale, torch.Tensor) else type(x_scale).__name__
        raise TypeError(f"x_scale must be a floating-point tensor; got {got}")
    if x_scale.shape[:-1] != x.shape[:-1]:
        raise ValueError(
            f"x_scale shape {tuple(x_scale.shape)} does not match x shape {tuple(x.shape)} "
            "in the leading dims"
        )
    s, k = x_scale.shape[-1], x.shape[-1]
    if s == 0 or k % s:
        raise ValueError(f"x_scale has {s} columns, which does not divide K={k}")


class RowPlan(NamedTuple):
    """How a row-wise kernel covers ``m`` rows: kernel arguments and the row count to tune for.

    ``masked``: rows are ``[E, cap]`` segments with valid counts ``masked_m``; ``masked_m``/``cap``: the ``MASKED_M`` and ``CAP`` arguments (a placeholder and 1 without a
    mask); ``rows``: the rows the launch is chosen for (the expected valid rows of a masked
    batch with a hint, else all ``m``); ``expected_m``: the hint, rows per segment.
    """

    masked: bool
    masked_m: torch.Tensor
    cap: int
    rows: int
    expected_m: int | None

    def grid(self, m: int, block_m: int) -> tuple[int, int]:
        """``(programs along the rows, PROGS)``: one program per ``block_m`` rows, or with a mask
        ``PROGS`` programs per segment, enough for ``expected_m`` rows (for ``cap`` without a
        hint); a segment longer than that is looped over by its programs."""
        if not self.masked:
            return -(-m // block_m), 1
        per = -(-self.cap // block_m)
        if self.expected_m is not None:
            per = min(per, -(-self.expected_m // block_m))
        return (m // self.cap) * per, per


def row_plan(
    masked_m: torch.Tensor | None, shape: torch.Size, device: torch.device, expected_m: int | None = None
) -> RowPlan:
    """Checked kernel arguments that let a row-wise kernel over ``x`` (``[E, cap, K]`` with
    ``masked_m``) skip rows past ``masked_m`` and size its grid from ``expected_m`` (rows per
    expert a masked batch is expected to fill; needs ``masked_m``)."""
    check_positive_int("expected_m", expected_m, optional=True)
    m = math.prod(shape[:-1]) if len(shape) > 1 else 0  # np.prod costs ~4 us of host time
    if masked_m is None:
        if expected_m is not None:
            raise ValueError(f"expected_m={expected_m} sizes the grid of a masked batch; pass masked_m with it")
        return RowPlan(False, placeholder(device, torch.int32), 1, m, None)
    check_masked_m(masked_m, shape, "x")
    if masked_m.device != torch.device(device):
        masked_m = masked_m.to(device)
    cap = shape[1]
    rows = m if expected_m is None else min(m, shape[0] * expected_m)
    return RowPlan(True, as_contiguous(masked_m, torch.int32), cap, max(1, rows), expected_m)


def check_masked_m(masked_m: torch.Tensor, shape: torch.Size, name: str) -> None:
    """``masked_m`` must be an integer ``[E]`` tensor for a ``[E, cap, K]`` operand."""
    if len(shape) != 3:
        raise ValueError(f"{name} must be [E, cap, K] with masked_m; got shape {tuple(shape)}")
    if not isinstance(masked_m, torch.Tensor) or masked_m.dtype not in (torch.int32, torch.int64):
        got = masked_m.dtype if isinstance(masked_m, torch.Tensor) else type(masked_m).__name__
        raise TypeError(f"masked_m must be an int32/int64 tensor; got {got}")
    if tuple(masked_m.shape) != (shape[0],):
        raise ValueError(
            f"masked_m shape {tuple(masked_m.shape)} does not match E={shape[0]} of {name}"
        )
