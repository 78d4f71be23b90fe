"""Small helpers shared by the Triton kernels' Python wrappers (argument checks, padding)."""

from __future__ import annotations

import numpy as np
import torch


def _patch_interpreter_index() -> None:
    """Let Triton 3.6's interpreter use runtime scalars as loop bounds under NumPy >= 2.4.

    The interpreter holds scalars as 1-element arrays and converts them with ``int(array)``,
    which NumPy 2.4 rejects ("only 0-dimensional arrays can be converted"). This applies the
    upstream fix (triton-lang/triton#9172) to the interpreter only; compiled kernels are
    unaffected. A Triton that already has the fix is left alone.
    """
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_epmoe_fixed", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    patched._epmoe_fixed = True
    interpreter._patch_lang_tensor = patched


_patch_interpreter_index()


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


def masked_row_args(
    masked_m: torch.Tensor | None, shape: torch.Size, device: torch.device
) -> tuple[torch.Tensor, int]:
    """Kernel arguments that let row-wise kernels skip rows past ``masked_m`` of ``[E, cap, K]``.

    Returns ``(masked_m as int32, cap)``, or a dummy tensor and ``cap = 1`` when not masked.
    """
    if masked_m is None:
        return torch.zeros(1, dtype=torch.int32, device=device), 1
    check_masked_m(masked_m, shape, "x")
    return masked_m.to(device=device, dtype=torch.int32).contiguous(), shape[1]


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
