"""Patches to Triton's CPU interpreter that the CPU tests run the kernels under (applied by
conftest.py, and by the test workers in spawned ranks through :func:`apply`).

They live with the tests, not in the package: the library never runs its kernels in the
interpreter on its own (``auto`` picks the torch backend on a CPU), and a library that rewrote
another package's internals on import would surprise its users. Compiled kernels are unaffected.
"""

from __future__ import annotations

import numpy as np


def _extend_hook(hook: str, attr: str, value) -> None:
    """Make the interpreter's ``hook`` (which patches a ``triton.language`` object for
    interpretation) also set ``attr`` to ``value`` on that object; once, and not at all where the
    hook does not exist. Triton 3.6 passes a scope that records the patches; older interpreters
    patch in place."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, hook, None)
    if original is None or attr in getattr(original, "_epmoe_test_attrs", ()):
        return

    def patched(target, *scope):
        original(target, *scope)
        if scope:
            scope[0].set_attr(target, attr, value)
        else:
            setattr(target, attr, value)

    patched._epmoe_test_attrs = (*getattr(original, "_epmoe_test_attrs", ()), attr)
    setattr(interpreter, hook, patched)


def patch_index() -> None:
    """Let Triton 3.6's interpreter use runtime scalars as loop bounds under NumPy >= 2.4.

    The interpreter holds scalars as 1-element arrays and converts them with ``int(array)``,
    which NumPy 2.4 rejects ("only 0-dimensional arrays can be converted"). This applies the
    upstream fix (triton-lang/triton#9172) to the interpreter only; compiled kernels are
    unaffected.
    """

    def index(self):
        return int(np.asarray(self.handle.data).reshape(-1)[0])

    _extend_hook("_patch_lang_tensor", "__index__", index)


def exact_fma(x: np.ndarray, y: np.ndarray, z: np.ndarray) -> np.ndarray:
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


def _replace_builder_method(name: str, make) -> None:
    """Set the interpreter builder's method ``name`` to ``make(original, interpreter module)``,
    once, and not at all where Triton or the method does not exist."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    builder = getattr(interpreter, "InterpreterBuilder", None)
    original = getattr(builder, name, None)
    if original is None or getattr(original, "_epmoe_test_fixed", False):
        return
    method = make(original, interpreter)
    method._epmoe_test_fixed = True
    setattr(builder, name, method)


def patch_fma() -> None:
    """Make the interpreter's ``tl.fma`` a fused multiply-add (one rounding), as on the GPU.

    Triton 3.6's interpreter computes ``x * y + z`` with two float32 roundings, which breaks
    the exact residuals the quantizers' division relies on (``fma(-q, b, a)`` is exact only when
    fused). Compiled kernels are unaffected.
    """

    def make(original, interpreter):
        def create_fma(self, x, y, z):
            return interpreter.TensorHandle(exact_fma(x.data, y.data, z.data), z.dtype.scalar)

        return create_fma

    _replace_builder_method("create_fma", make)


def patch_sort() -> None:
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

    _extend_hook("_patch_lang_core", "sort", sort)


def fp32_to_bf16_rne(x: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) of float32 ``x``, rounded to nearest even, as the GPU's
    ``cvt.rn.bf16.f32`` (and torch) round; NaN stays a (quiet) NaN of its sign."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    nan = (bits & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    quiet = (bits >> np.uint32(16)) | np.uint32(0x0040)
    return np.where(nan, quiet, rounded).astype(np.uint16)


def patch_bf16_rounding() -> None:
    """Make the interpreter's float32 -> bfloat16 conversion round to nearest even, as on the GPU.

    Triton 3.6's interpreter truncates (it converts with no rounding mode), so a kernel's bf16
    output under the interpreter sat up to one bf16 ulp below the GPU's in about half of the
    elements. Compiled kernels are unaffected."""
    try:
        import triton.language as tl
    except ImportError:
        return

    def make(original, interpreter):
        def cast_impl(self, src, dst_type):
            if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
                return interpreter.TensorHandle(fp32_to_bf16_rne(src.data), dst_type.scalar)
            return original(self, src, dst_type)

        return cast_impl

    _replace_builder_method("cast_impl", make)


def apply() -> None:
    """Every patch, once (each one checks whether it is already in place)."""
    patch_index()
    patch_fma()
    patch_sort()
    patch_bf16_rounding()
