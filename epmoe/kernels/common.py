"""Small helpers shared by the Triton kernels' Python wrappers (argument checks, padding)."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ..tensors import as_contiguous, check_positive_int


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


INTERPRETER_TILE = 65536
"""Elements per program on CPU, where Triton's interpreter pays per program, not per element
(the kernels' GPU tiles are much smaller)."""

COPY_MAX_SLOTS = 128
"""Most (token, slot) pairs laid out and copied in one launch
(:func:`epmoe.kernels.permute.slot_layout_scatter`, :func:`epmoe.kernels.prep.decode_prep`): 16
tokens of top-8, one sorting step of every program."""
PREP_ROUTE_TILE = 8192
"""Most elements of the ``[tokens, experts]`` routing tile every program of the decode prep holds
(padded to powers of two): 16 tokens of 256 experts (DeepSeek-V3's top-8 at the slot limit) take
half of it."""


def prep_refusal(num_tokens: int, top_k: int, num_experts: int) -> str | None:
    """Why :func:`epmoe.kernels.prep.decode_prep` does not take a batch of these sizes (``None``
    when it does); Triton-free, for the layer to decide per batch (from shapes only)."""
    if num_tokens < 1:
        return f"num_tokens={num_tokens}: the prep takes batches of at least one token"
    if num_tokens * top_k > COPY_MAX_SLOTS:
        return f"{num_tokens} tokens x top_k={top_k} slots are over the prep's {COPY_MAX_SLOTS}"
    if next_pow2(num_tokens) * next_pow2(num_experts) > PREP_ROUTE_TILE:
        return (
            f"{num_tokens} tokens x {num_experts} experts (padded to powers of two) are over the prep's "
            f"routing tile of {PREP_ROUTE_TILE}"
        )
    return None


def max_rows(num_tokens: int, top_k: int, num_experts: int, alignment: int) -> int:
    """Most rows a contiguous layout of ``num_tokens x top_k`` slots over ``num_experts`` experts
    can need, every segment padded to a multiple of ``alignment``: the size of a layout whose
    segment sizes stay on the device.

    With ``N`` local slots in ``n`` non-empty experts the rows are ``sum_e ceil(c_e / A) * A <=
    N + n * (A - 1)``, and ``n <= min(N, E)`` (a token may name an expert twice, so ``n`` can be
    below ``N`` but never above it). The sum is a multiple of ``A``, so the bound is rounded down
    to one. It is reached (``N <= E``: one slot per expert gives ``N * A``), so no smaller buffer is
    safe; sizing by ``E * (A - 1)`` instead would allocate (and any fill would touch) up to ``E / N``
    times the rows a decode step can use. Symbolic sizes stay symbolic (``torch.sym_min``)."""
    slots = num_tokens * top_k
    bound = slots + torch.sym_min(slots, num_experts) * (alignment - 1)
    return bound // alignment * alignment


def mn_major_scales(rows: int, cols: int, device, like: torch.Tensor | None = None) -> torch.Tensor:
    """An uninitialised fp32 ``[rows, cols]`` scale tensor stored MN-major: the first ``rows``
    columns of a ``[cols, rows rounded up to 4]`` buffer, seen transposed (strides ``(1, R4)``).
    That is the activation-scale layout the project's CUTLASS block-scaled kernels read (TMA wants
    16-byte rows); scales written there need no transposing copy before each GEMM. ``like``: make
    it with ``like.new_empty`` (fake tensors while tracing)."""
    shape = (cols, -(-rows // 4) * 4)
    buf = like.new_empty(shape, dtype=torch.float32) if like is not None else torch.empty(
        shape, dtype=torch.float32, device=device)  # fmt: skip
    return buf.t()[:rows]


def empty_scales(
    rows: int, cols: int, device, mn_major: bool = False, like: torch.Tensor | None = None
) -> torch.Tensor:
    """An uninitialised fp32 ``[rows, cols]`` scale tensor, MN-major (:func:`mn_major_scales`) or
    row-major; ``like`` as there."""
    if mn_major:
        return mn_major_scales(rows, cols, device, like)
    if like is not None:
        return like.new_empty((rows, cols), dtype=torch.float32)
    return torch.empty((rows, cols), dtype=torch.float32, device=device)


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
    row_expert: torch.Tensor | None = None
    """``[rows]`` int32 expert of every row (a contiguous layout's ``m_indices``): rows of ``-1``
    (padding) are skipped, their outputs left unwritten; ``None``: every row is computed."""

    @property
    def row_mask(self) -> torch.Tensor:
        """The ``ROW_EXPERT`` kernel argument (a placeholder without a mask)."""
        return self.masked_m if self.row_expert is None else self.row_expert

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
    masked_m: torch.Tensor | None,
    shape: torch.Size,
    device: torch.device,
    expected_m: int | None = None,
    row_expert: torch.Tensor | None = None,
) -> RowPlan:
    """Checked kernel arguments that let a row-wise kernel over ``x`` (``[E, cap, K]`` with
    ``masked_m``) skip rows past ``masked_m`` and size its grid from ``expected_m`` (rows per
    expert a masked batch is expected to fill; needs ``masked_m``), and skip the rows whose
    ``row_expert`` (one int32 per row of ``x``, all leading dims flattened) is -1."""
    check_positive_int("expected_m", expected_m, optional=True)
    m = math.prod(shape[:-1]) if len(shape) > 1 else 0  # np.prod costs ~4 us of host time
    if row_expert is not None:
        if (not isinstance(row_expert, torch.Tensor) or row_expert.dtype != torch.int32 or row_expert.dim() != 1
                or row_expert.numel() != m or row_expert.device != torch.device(device)):  # fmt: skip
            got = f"{row_expert.dtype} {tuple(row_expert.shape)} on {row_expert.device}" if isinstance(
                row_expert, torch.Tensor) else type(row_expert).__name__  # fmt: skip
            raise ValueError(f"row_expert must be an int32 [{m}] tensor on {device} (one per row); got {got}")
        row_expert = as_contiguous(row_expert, torch.int32)
    if masked_m is None:
        if expected_m is not None:
            raise ValueError(f"expected_m={expected_m} sizes the grid of a masked batch; pass masked_m with it")
        return RowPlan(False, placeholder(device, torch.int32), 1, m, None, row_expert)
    check_masked_m(masked_m, shape, "x")
    if masked_m.device != torch.device(device):
        masked_m = masked_m.to(device)
    cap = shape[1]
    rows = m if expected_m is None else min(m, shape[0] * expected_m)
    return RowPlan(True, as_contiguous(masked_m, torch.int32), cap, max(1, rows), expected_m, row_expert)


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
