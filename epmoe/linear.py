"""W8A8 INT8 dense linears: the rest of an INT8 DeepSeek model (attention projections, the shared
experts, the dense MLPs of the first layers).

:class:`Int8Linear` holds ``weight`` int8 ``[N, K]`` and an fp32 ``weight_scale`` (``[N, 1]`` per
output channel for ``int8_channel``, ``[ceil(N/128), ceil(K/128)]`` per 128x128 block for
``int8_block``) and quantizes its input dynamically, per token (channel) or per 1x128 group
(block). :class:`Int8MLP` is the DeepSeek shared-expert (and dense) MLP built from two of them,
with ``silu(gate) * up`` fused into the requantization ahead of ``down_proj`` as the routed
experts do.

Backends, chosen when the module is built and again whenever it moves to another device (logged
at INFO with the reason each other candidate was refused; a forced backend that cannot run
raises :class:`~epmoe.experts.select.BackendUnavailableError`):

* ``cutlass`` (``int8_channel`` with the int32 accumulator, only with ``SGLANG_CUTLASS_MOE=1`` as
  for the experts): sgl-kernel's ``int8_scaled_mm`` when it imports (sm_8x / sm_9x), else the
  project's CUTLASS INT8 kernel (:func:`epmoe.experts.cutlass_backend.int8_dense_gemm`, sm_90a, one
  launch) over rows padded to whole 128-row blocks, its kernel (CUTLASS's cooperative or pingpong
  schedule) and tiles' walk from the dense plan. The activations are quantized by the Triton
  per-token kernel straight into the padded buffer; the scales are applied in the kernel's
  epilogue.
* ``triton``: the per-token / per-group quantizer of :mod:`epmoe.kernels.quantize`, then the
  grouped GEMM of :mod:`epmoe.kernels.grouped_gemm` as one expert (the masked layout with a row
  count that clamps to the batch, so no per-call offsets are built); both scales in its epilogue
  (block: per K block). Tile configs come from the dense plan where the table measured one, else
  from :func:`dense_gemm_config`.
* ``torch`` (reference, any device): the reference quantizer, then ``torch._int_mm`` with the
  scales applied afterwards where it applies (``int8_channel``; on CUDA for more than 16 rows and
  K, N multiples of 8), else dequantized fp32 math.

On both GPU backends each call runs the kernel and launch that the dense plan
(:mod:`epmoe.kernels.dense_configs`, :meth:`Int8Linear.plan`) picks among those the backend runs:
the small-batch kernel of :mod:`epmoe.kernels.dense_int8` (the activations quantized inside the
GEMM while they are few, a grid of narrow N tiles, K split across programs where the layer is too
narrow to keep every SM reading the weight), the Triton tiled GEMM, or (``cutlass`` on the
project's kernel) the CUTLASS kernel with a measured tile walk. The plan reads the device's
measured table; without an entry, the small-batch kernel's own rule up to :data:`SMALL_M_MAX`
rows and above, the backend's tiled GEMM (``int8_block``: the small-batch kernel on 128-row tiles).

``backend="auto"`` walks cutlass -> triton -> torch (``int8_block``: triton -> torch); ``triton``
is picked automatically on CUDA only (its CPU interpreter is for tests).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from .experts.select import BackendUnavailableError
from .kernels.configs import DENSE_KERNELS, DENSE_SMALL_M_MAX, DENSE_TRITON_KERNELS
from .quant.reference import dequantize_rows, dequantize_weight, quantize_rows, quantize_weight
from .quant.schemes import BLOCK, SCHEMES
from .tensors import check_choice, check_positive_int, keeping_dtypes, named_pairs, resolve_device

log = logging.getLogger("epmoe")

LINEAR_SCHEMES = ("int8_channel", "int8_block")
ACCUMULATORS = ("int32", "fp32")
DENSE_BACKENDS = ("cutlass", "triton", "torch")
AUTO_ORDER = {"int8_channel": ("cutlass", "triton", "torch"), "int8_block": ("triton", "torch")}
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
ROW_BLOCK = 128
"""Rows of a tile of the project's CUTLASS kernel: its one segment is padded to a multiple."""
SMALL_M_MAX = DENSE_SMALL_M_MAX
"""Rows up to which the triton and cutlass backends run the small-batch kernel
(:mod:`epmoe.kernels.dense_int8`) where the device has no measured table
(:mod:`epmoe.kernels.dense_configs`, which sets the crossover per shape where it has one): there
the work is one read of the weight, which the tiled GEMMs' wide tiles spread over too few SMs."""
_ALL_ROWS = 2**31 - 1
"""``masked_m`` of the Triton path: clamped to the batch's row count inside the kernel."""


# ------------------------------------------------------------------------------ argument checks
def resolve_accumulator(scheme: str, accumulator: str | None) -> str:
    """``accumulator`` checked against ``scheme``; ``None`` is the scheme's natural one: int32 for
    ``int8_channel`` (exact K sum, fastest), fp32 for ``int8_block`` (scaled per K block)."""
    check_choice("scheme", scheme, LINEAR_SCHEMES)
    if accumulator is None:
        return "int32" if scheme == "int8_channel" else "fp32"
    check_choice("accumulator", accumulator, ACCUMULATORS)
    if scheme == "int8_block" and accumulator != "fp32":
        raise ValueError(
            f"accumulator={accumulator!r} with scheme='int8_block'; allowed: 'fp32' (each K block "
            "has its own scale, so the sum cannot stay in int32); 'int32' needs scheme='int8_channel'"
        )
    return accumulator


def _check_features(in_features, out_features, scheme: str) -> tuple[int, int]:
    check_positive_int("in_features", in_features)
    check_positive_int("out_features", out_features)
    if scheme == "int8_block" and in_features % BLOCK:
        raise ValueError(
            f"in_features={in_features} with scheme='int8_block'; allowed: multiples of {BLOCK} "
            "(activations are quantized per 1x128 group)"
        )
    return in_features, out_features


def weight_scale_shape(scheme: str, out_features: int, in_features: int) -> tuple[int, int]:
    if scheme == "int8_channel":
        return (out_features, 1)
    return (-(-out_features // BLOCK), -(-in_features // BLOCK))


# ------------------------------------------------------------------------------ backend choice
@functools.lru_cache(maxsize=1)
def _sgl_int8_mm():
    """sgl-kernel's ``int8_scaled_mm`` op when sgl-kernel imports against this torch, else ``None``."""
    if importlib.util.find_spec("sgl_kernel") is None:
        return None
    try:
        import sgl_kernel  # noqa: F401  (loads the op library; fails on a torch/CUDA mismatch)

        op = torch.ops.sgl_kernel.int8_scaled_mm.default
        if len(op._schema.arguments) != 6:
            log.info("sgl-kernel's int8_scaled_mm has an unknown signature; not used")
            return None
        return op
    except Exception as exc:  # ImportError, OSError (undefined symbol), AttributeError
        log.info("sgl-kernel is installed but its int8_scaled_mm is not usable: %s", exc)
        return None


def _cutlass_decision(
    scheme: str, accumulator: str, device: torch.device, k: int, n: int, env: Mapping[str, str]
) -> tuple[str | None, str]:
    """``(implementation or None, reason)``: ``"sgl"`` (sgl-kernel's ``int8_scaled_mm``) or
    ``"epmoe"`` (the project's CUTLASS INT8 kernel)."""
    from .experts.fp8_selection import ENV_VAR, MIN_CUDA, env_enabled, machine_facts, parse_version

    if scheme != "int8_channel":
        return None, "the CUTLASS INT8 GEMMs scale per output channel; scheme='int8_block' runs on triton or torch"
    if accumulator != "int32":
        return None, "the CUTLASS INT8 GEMMs sum K in int32; accumulator='fp32' runs on triton or torch"
    if not env_enabled(env):
        value = env.get(ENV_VAR)
        got = "is not set" if value is None else f"is {value!r}"
        return None, f"{ENV_VAR}=1 is required to consider cutlass ({ENV_VAR} {got})"
    capability, cuda = machine_facts(device)
    if capability is None:
        return None, f"{ENV_VAR}=1 but {device} is not a CUDA GPU"
    cc = f"{capability[0]}.{capability[1]}"
    if k % 16 or n % 8:
        return None, f"{ENV_VAR}=1 but the INT8 GEMMs need K % 16 == 0 and N % 8 == 0; got K={k}, N={n}"
    if capability[0] in (8, 9) and _sgl_int8_mm() is not None:
        return "sgl", f"{ENV_VAR}=1, compute capability {cc}: sgl-kernel int8_scaled_mm"
    if capability[0] != 9:
        return None, (
            f"{ENV_VAR}=1 but the GPU has compute capability {cc}: the project's kernel is sm_90a and "
            "sgl-kernel's int8_scaled_mm (sm_8x/sm_9x) is not importable"
        )
    parsed = parse_version(cuda)
    if parsed is None or parsed < MIN_CUDA:
        return None, f"{ENV_VAR}=1 but CUDA {cuda!r} is older than 12.3 or unknown"
    from .experts.cutlass_backend import own_kernel_missing

    missing = own_kernel_missing()
    if missing:
        return None, f"{ENV_VAR}=1 but sgl-kernel's int8_scaled_mm is not importable and {missing}"
    return "epmoe", f"{ENV_VAR}=1, compute capability {cc}, CUDA {cuda}: epmoe's CUTLASS INT8 kernel"


def dense_backend_decisions(
    scheme: str,
    accumulator: str | None,
    device: torch.device | str,
    in_features: int,
    out_features: int,
    *,
    candidates: tuple[str, ...] = DENSE_BACKENDS,
    env: Mapping[str, str] | None = None,
) -> list[tuple[str, bool, str]]:
    """Whether each dense backend can run an ``[out_features, in_features]`` linear here.

    Args:
        scheme: ``"int8_channel"`` or ``"int8_block"``.
        accumulator: ``"int32"``, ``"fp32"`` or ``None`` (see :func:`resolve_accumulator`).
        device: the device the module's weights are on.
        in_features, out_features: K and N.
        candidates: the backend names to decide, in order.
        env: the environment (default ``os.environ``; ``SGLANG_CUTLASS_MOE``, ``TRITON_INTERPRET``).

    Returns:
        ``[(name, ok, reason)]`` in the order of ``candidates``; ``reason`` is a sentence either way.
    """
    accumulator = resolve_accumulator(scheme, accumulator)
    device = torch.device(device)
    env = os.environ if env is None else env
    out = []
    for name in candidates:
        check_choice("backend", name, DENSE_BACKENDS)
        if name == "cutlass":
            impl, reason = _cutlass_decision(scheme, accumulator, device, in_features, out_features, env)
            out.append((name, impl is not None, reason))
        elif name == "triton":
            out.append((name, *_triton_decision(device, env)))
        else:
            out.append((name, True, "torch reference (torch._int_mm where it applies, else fp32 math)"))
    return out


def _triton_decision(device: torch.device, env: Mapping[str, str]) -> tuple[bool, str]:
    if importlib.util.find_spec("triton") is None:
        return False, "triton is not installed"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            return False, "CUDA is not available"
        return True, "triton on CUDA"
    if device.type == "cpu":
        if env.get("TRITON_INTERPRET") == "1":
            return True, "triton interpreter (TRITON_INTERPRET=1) on CPU"
        return False, "on CPU triton needs TRITON_INTERPRET=1 (interpreter, slow)"
    return False, f"triton kernels do not run on device type {device.type!r}"


def select_dense_backend(
    requested: str, scheme: str, accumulator: str, device: torch.device, k: int, n: int
) -> tuple["_Impl", list[str]]:
    """The implementation for ``requested`` (``"auto"`` or a backend name) and the log lines
    (the choice and every refusal). A named backend that cannot run raises
    :class:`BackendUnavailableError` with the reason."""
    check_choice("backend", requested, ("auto", *DENSE_BACKENDS))
    candidates = AUTO_ORDER[scheme] if requested == "auto" else (requested,)
    lines = []
    for name, ok, reason in dense_backend_decisions(scheme, accumulator, device, k, n, candidates=candidates):
        if ok and requested == "auto" and name == "triton" and device.type != "cuda":
            ok, reason = False, "auto picks triton on CUDA only (force backend='triton' to use the interpreter)"
        if not ok:
            if requested != "auto":
                raise BackendUnavailableError(
                    f"backend={requested!r} cannot run Int8Linear(in_features={k}, out_features={n}, "
                    f"scheme={scheme!r}, accumulator={accumulator!r}) on {device}: {reason}"
                )
            lines.append(f"dense backend {name!r} refused: {reason}")
            continue
        if name == "cutlass":
            impl = _CutlassImpl(_cutlass_decision(scheme, accumulator, device, k, n, os.environ)[0])
        else:
            impl = _TritonImpl() if name == "triton" else _TorchImpl()
        small = (f"; each call runs the kernel the dense plan picks among {list(impl.kernels)} (the device's measured "
                 f"table, else the small-batch kernel up to {SMALL_M_MAX} rows)") if name != "torch" else ""
        lines.append(f"dense backend {impl.label!r} chosen for scheme={scheme!r}, accumulator={accumulator!r}, "
                     f"[{n}, {k}] on {device}: {reason}{small}")  # fmt: skip
        return impl, lines
    raise BackendUnavailableError(f"no dense backend can run scheme={scheme!r} on {device}: " + "; ".join(lines))


# ------------------------------------------------------------------------------ Triton configs
def dense_gemm_config(mode: str, accumulator: str, n: int, k: int, m: int, device: torch.device):
    """Tile config of the Triton GEMM for one ``[m, k] x [n, k]^T`` dense call.

    Starts from the grouped GEMM's lookup for one expert of ``m`` rows (tuned entries where the
    shape has one, else the heuristic) and narrows the tiles until the grid covers the GPU's SMs:
    those entries were tuned for 128 experts, whose grid is 128 times larger, and a decode-sized
    dense call with 128-wide tiles would leave most SMs idle while it streams the weight.
    Narrower N tiles come first (the weight read is what a small batch waits on), then M tiles no
    taller than the batch.
    """
    from . import devices
    from .kernels.common import next_pow2
    from .kernels.configs import get_config

    cfg = get_config(mode, n, k, m, device=device, accumulator=accumulator)
    if device.type != "cuda":
        return cfg
    sms = devices.sm_count(device)
    cfg = replace(cfg, block_m=max(16, min(cfg.block_m, next_pow2(m))))

    def programs(c):
        return -(-m // c.block_m) * -(-n // c.block_n)

    while programs(cfg) < sms and cfg.block_n > 32:
        half = cfg.block_n // 2
        # SWAP_AB puts the weight tile on the MMA's M side, which is at least 64 rows.
        cfg = replace(cfg, block_n=half, swap_ab=cfg.swap_ab and half >= 64)
    return cfg


_cached_gemm_config = functools.lru_cache(maxsize=4096)(dense_gemm_config)
"""The forward's lookup: one dict hit instead of the table walk and tile narrowing per call."""


# ------------------------------------------------------------------------------ implementations
class _Impl:
    """One backend's stages. ``quantize`` may return more rows than it was given (whole row
    blocks for a kernel that wants them); ``tiled_gemm`` returns as many rows as its input has."""

    name = ""
    label = ""
    row_block = 1

    def quantize(self, x2: torch.Tensor, scheme: str):
        raise NotImplementedError

    def silu_quantize(self, gate_up: torch.Tensor, scheme: str):
        raise NotImplementedError

    def tiled_gemm(self, lin: "Int8Linear", q, s, out_dtype: torch.dtype, launch=None) -> torch.Tensor:
        raise NotImplementedError

    def gemm(self, lin: "Int8Linear", q, s, out_dtype: torch.dtype, rows: int | None = None) -> torch.Tensor:
        """The GEMM of int8 codes ``q`` with their scales ``s`` (the MLP's down projection);
        ``rows``: the call's real rows when ``q`` carries padding rows (the plan is for those)."""
        return self.tiled_gemm(lin, q, s, out_dtype)

    def linear(self, lin: "Int8Linear", x2: torch.Tensor) -> torch.Tensor:
        """Quantize and multiply ``x2 [M, K]``; may return more than ``M`` rows (see ``quantize``)."""
        q, s = self.quantize(x2, lin.scheme)
        return self.gemm(lin, q, s, x2.dtype)

    def plan(self, lin: "Int8Linear", m: int):
        """``(kernel, launch)`` that a call of ``m`` rows runs (see :func:`run_kernel`)."""
        return "tiled", None


class _Planned:
    """The GPU backends' calls go where the dense plan (:func:`epmoe.kernels.dense_configs.dense_plan`:
    the device's measured table, else the small-batch kernel up to ``SMALL_M_MAX`` rows and the
    backend's tiled GEMM above) sends them, among the kernels the backend runs (``kernels``):
    the small-batch kernel :func:`epmoe.kernels.dense_int8.dense_int8_small_m` (one launch, or two
    with split-K; the activations quantized inside the GEMM while they are few), the Triton tiled
    GEMM, or the CUTLASS kernel with a measured rasterization. Mixed into the GPU backends ahead of
    their class."""

    kernels: tuple[str, ...] = ()

    def plan(self, lin, m):
        return _dense_kernels().dense_plan(lin.scheme, lin.accumulator, lin.out_features, lin.in_features, m,
                                           lin.weight.device, self.kernels)  # fmt: skip

    def tiled(self, kernel: str) -> _Impl:
        """The implementation of tiled kernel ``kernel`` (``"tiled"``: this backend's own)."""
        return _TRITON_GEMM if kernel == "triton" else self

    def linear(self, lin, x2):
        return run_kernel(self, lin, x2, *self.plan(lin, x2.shape[0]))

    def gemm(self, lin, q, s, out_dtype, rows=None):
        kernel, launch = self.plan(lin, q.shape[0] if rows is None else rows)
        if kernel == "small_m":
            # Codes with their scales: the same launch without the fused quantization (_replace
            # costs ~1 us of host time, so only where the plan's launch is fused).
            return _small_m(lin, q, s, out_dtype, launch._replace(fused=False) if launch.fused else launch)
        return self.tiled(kernel).tiled_gemm(lin, q, s, out_dtype, launch)


def run_kernel(impl: _Impl, lin: "Int8Linear", x2: torch.Tensor, kernel: str, launch) -> torch.Tensor:
    """``lin(x2)`` on one dense kernel and launch: what the forward runs for its plan, and what
    ``benchmarks/sweep_dense_int8.py`` times for every candidate (so the table's times are those
    of the launches the layer makes, quantization included). May return more rows than ``x2``
    has (whole row blocks of the CUTLASS kernel).

    Raises:
        ValueError: ``kernel`` is not one ``impl`` runs (its ``kernels``; ``"tiled"`` only on a
            backend without a plan)."""
    allowed = impl.kernels if isinstance(impl, _Planned) else ("tiled",)
    if kernel not in allowed:
        raise ValueError(f"run_kernel: kernel={kernel!r} is not one the {impl.name!r} backend runs; "
                         f"allowed: {list(allowed)}")  # fmt: skip
    if kernel == "small_m":
        return _small_m(lin, x2, None, x2.dtype, launch)
    if kernel == "tiled" and not isinstance(impl, _Planned):
        return impl.linear(lin, x2)
    tiled = impl.tiled(kernel)
    q, s = tiled.quantize(x2, lin.scheme)
    return tiled.tiled_gemm(lin, q, s, x2.dtype, launch)


def _small_m(lin, x2, s, out_dtype, cfg):
    k = _dense_kernels()
    return k.dense_int8_small_m(x2, lin.weight, lin.weight_scale, lin.bias, scheme=lin.scheme,
                                accumulator=lin.accumulator, x_scale=s, out_dtype=out_dtype,
                                config=k.checked_launch(cfg, x2, lin.weight))  # fmt: skip


@functools.cache
def _dense_kernels():
    """The kernel and plan functions, imported on first use (this module imports without
    Triton) and then looked up without an import statement's host cost on every call."""
    from types import SimpleNamespace

    from .kernels.dense_configs import dense_plan
    from .kernels.dense_int8 import checked_launch, dense_int8_small_m

    return SimpleNamespace(dense_plan=dense_plan, dense_int8_small_m=dense_int8_small_m, checked_launch=checked_launch)


class _TorchImpl(_Impl):
    name = label = "torch"

    def quantize(self, x2, scheme):
        return quantize_rows(x2, torch.int8, 127.0, None if scheme == "int8_channel" else BLOCK)

    def silu_quantize(self, gate_up, scheme):
        g, u = gate_up.float().chunk(2, dim=-1)
        return self.quantize(F.silu(g) * u, scheme)

    def tiled_gemm(self, lin, q, s, out_dtype, launch=None):
        w, ws = lin.weight, lin.weight_scale
        if lin.scheme == "int8_channel" and _int_mm_applies(q, w):
            acc = torch._int_mm(q, w.t())
            out = acc.float() * s.float() * ws.float().view(1, -1)
        else:
            wf = dequantize_weight(w.unsqueeze(0), ws.unsqueeze(0))[0]
            out = dequantize_rows(q, s) @ wf.t()
        if lin.bias is not None:
            out = out + lin.bias.float()
        return out.to(out_dtype)


def _int_mm_applies(q: torch.Tensor, w: torch.Tensor) -> bool:
    """``torch._int_mm`` runs on CPU for any shape; on CUDA for more than 16 rows and K, N
    multiples of 8 (cuBLASLt's INT8 rules)."""
    if q.device.type == "cpu":
        return True
    m, k = q.shape
    return q.device.type == "cuda" and m > 16 and k % 8 == 0 and w.shape[0] % 8 == 0


class _TritonGemm(_Impl):
    name = label = "triton"

    def quantize(self, x2, scheme):
        from .kernels import quantize as qz

        if scheme == "int8_channel":
            return qz.per_token_quant_int8(x2)
        return qz.per_group_quant(x2, BLOCK, torch.int8)

    def silu_quantize(self, gate_up, scheme):
        from .kernels.activation import silu_and_mul_quant

        return silu_and_mul_quant(gate_up, "token" if scheme == "int8_channel" else "group", BLOCK, torch.int8)

    def tiled_gemm(self, lin, q, s, out_dtype, launch=None):
        """``launch``: a grouped-GEMM tile config, or ``None`` for :func:`dense_gemm_config`'s."""
        from .kernels.grouped_gemm import grouped_gemm_masked

        m, k = q.shape
        n = lin.out_features
        cfg = launch if launch is not None else _cached_gemm_config(lin.scheme, lin.accumulator, n, k, m, q.device)
        out = grouped_gemm_masked(
            q.view(1, m, k), lin.weight.unsqueeze(0), lin._all_rows, mode=lin.scheme,
            a_scale=s.view(1, m, s.shape[-1]), b_scale=lin.weight_scale.unsqueeze(0),
            accumulator=lin.accumulator, out_dtype=out_dtype, config=cfg,
        )[0]  # fmt: skip
        if lin.bias is not None:
            out += lin.bias.to(out_dtype)
        return out


_TRITON_GEMM = _TritonGemm()
"""The Triton tiled GEMM where the cutlass backend's plan chooses it (the object holds no state)."""


class _TritonImpl(_Planned, _TritonGemm):
    kernels = DENSE_TRITON_KERNELS


class _CutlassGemm(_Impl):
    """``impl="epmoe"``: the project's kernel, rows padded to 128-row blocks (the padding rows'
    codes and scales are left uninitialised: they are computed and never returned), with the
    plan's rasterization. ``"sgl"``: sgl-kernel's ``int8_scaled_mm`` (any rows, bias fused)."""

    name = "cutlass"

    def __init__(self, impl: str) -> None:
        self.impl = impl
        self.label = "cutlass (sgl-kernel int8_scaled_mm)" if impl == "sgl" else "cutlass (epmoe INT8 kernel)"
        self.row_block = ROW_BLOCK if impl == "epmoe" else 1
        self.kernels = DENSE_KERNELS if impl == "epmoe" else DENSE_TRITON_KERNELS

    def quantize(self, x2, scheme):
        from .kernels.common import row_plan
        from .kernels.quantize import token_quant

        m, k = x2.shape
        if self.row_block == 1:
            from .kernels.quantize import per_token_quant_int8

            return per_token_quant_int8(x2)
        rows = max(ROW_BLOCK, -(-m // ROW_BLOCK) * ROW_BLOCK)
        q = torch.empty((rows, k), dtype=torch.int8, device=x2.device)
        s = torch.empty((rows, 1), dtype=torch.float32, device=x2.device)
        # A programmatic dependent (where enabled): the project's GEMM after it is one and waits for
        # it, so the quantizer's launch and the GEMM's overlap the kernels before them.
        token_quant(x2, None, 1, x2.shape, row_plan(None, x2.shape, x2.device), None, silu=False,
                    out=(q[:m], s[:m]), pdl=True)  # fmt: skip
        return q, s

    def silu_quantize(self, gate_up, scheme):
        from .kernels.activation import silu_and_mul_quant

        return silu_and_mul_quant(gate_up, "token", BLOCK, torch.int8)

    def tiled_gemm(self, lin, q, s, out_dtype, launch=None):
        """``launch``: a :class:`~epmoe.kernels.dense_configs.CutlassLaunch` (which of the
        project's kernels, and its walk), or ``None`` for the cooperative kernel's default walk
        (along N, no swizzle)."""
        m = q.shape[0]
        if self.impl == "sgl":
            sgl_dtype = out_dtype if out_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
            bias = None if lin.bias is None else lin.bias.to(sgl_dtype)
            out = _sgl_int8_mm()(q, lin.weight.t(), s.view(-1), lin.weight_scale.view(-1), sgl_dtype, bias)
            return out if out.dtype == out_dtype else out.to(out_dtype)
        from .experts.cutlass_backend import int8_dense_gemm

        if m % ROW_BLOCK:  # rows that did not come from this backend's quantizer
            pad = -(-m // ROW_BLOCK) * ROW_BLOCK - m
            q, s = F.pad(q, (0, 0, 0, pad)), F.pad(s, (0, 0, 0, pad), value=1.0)
        raster = {} if launch is None else launch._asdict()  # CutlassLaunch's fields are the op's keywords
        # One launch: the dense op needs neither expert offsets nor the row-block table.
        out = int8_dense_gemm(q, s, lin.weight, lin.weight_scale, **raster)[:m]
        if lin.bias is not None:
            out += lin.bias.to(out.dtype)
        return out if out.dtype == out_dtype else out.to(out_dtype)


class _CutlassImpl(_Planned, _CutlassGemm):
    pass


# ------------------------------------------------------------------------------ the modules
class Int8Linear(nn.Module):
    """``y = x W^T (+ b)`` with INT8 weights and dynamically quantized INT8 activations.

    Args:
        in_features: K.
        out_features: N.
        bias: whether the module has a float ``bias [N]`` (added after the scales, in fp32 on the
            torch backend, in the output dtype otherwise).
        scheme: ``"int8_channel"`` (weights per output channel, activations per token) or
            ``"int8_block"`` (weights per 128x128 block, activations per 1x128 group; K a
            multiple of 128).
        accumulator: ``"int32"`` (exact K sum; ``int8_channel`` only) or ``"fp32"`` (each K step's
            exact int32 product added in fp32, as in the INT8 DeepSeek-R1 work); ``None``: int32
            for channel, fp32 for block.
        backend: ``"auto"``, ``"cutlass"``, ``"triton"`` or ``"torch"`` (see the module doc).
        device: where the parameters live; ``"meta"`` defers the backend choice until the module
            is moved to a real device (``to_empty``).

    Attributes:
        weight: ``[N, K]`` int8 (a parameter without gradient).
        weight_scale: fp32 ``[N, 1]`` (channel) or ``[ceil(N/128), ceil(K/128)]`` (block).
        bias: ``[N]`` float or ``None``.

    Module casts move the int8 weight and the fp32 scales but never change their dtypes
    (``.to(torch.bfloat16)`` casts only the bias).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        scheme: str = "int8_channel",
        accumulator: str | None = None,
        backend: str = "auto",
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.accumulator = resolve_accumulator(scheme, accumulator)
        self.scheme = scheme
        self.in_features, self.out_features = _check_features(in_features, out_features, scheme)
        if not isinstance(bias, bool):
            raise TypeError(f"bias={bias!r}; allowed: True or False")
        check_choice("backend", backend, ("auto", *DENSE_BACKENDS))
        self.backend = backend
        device = resolve_device("cpu" if device is None else device)
        shape = weight_scale_shape(scheme, out_features, in_features)
        self.weight = nn.Parameter(
            torch.zeros(out_features, in_features, dtype=torch.int8, device=device), requires_grad=False
        )
        self.weight_scale = nn.Parameter(torch.ones(shape, dtype=torch.float32, device=device), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_features, device=device), requires_grad=False) if bias else None
        self.register_buffer("_all_rows", torch.full((1,), _ALL_ROWS, dtype=torch.int32, device=device), persistent=False)
        self._impl: _Impl | None = None
        self._resolve()

    # -- backend
    def _resolve(self) -> None:
        device = self.weight.device
        if device.type == "meta":
            self._impl = None
            return
        self._impl, lines = select_dense_backend(
            self.backend, self.scheme, self.accumulator, device, self.in_features, self.out_features
        )
        for line in lines:
            log.info("%s", line)

    @property
    def backend_name(self) -> str | None:
        """The backend that runs this module (``None`` on the meta device)."""
        return None if self._impl is None else self._impl.name

    def plan(self, rows: int) -> tuple[str, object]:
        """``(kernel, launch)`` a forward of ``rows`` rows runs: ``"small_m"`` with its
        :class:`~epmoe.kernels.dense_int8.SmallMConfig`, ``"cutlass"`` with its
        :class:`~epmoe.kernels.dense_configs.CutlassLaunch`, ``"triton"`` (the Triton tiled GEMM)
        or ``"tiled"`` (the backend's own tiled GEMM; the torch backend's only path)."""
        if self._impl is None:
            raise RuntimeError("Int8Linear is on the meta device; move it to a real device (to_empty) first")
        check_positive_int("rows", rows)
        return self._impl.plan(self, rows)

    def _apply(self, fn, recurse=True):
        before = self.weight.device
        out = super()._apply(keeping_dtypes(fn, [self.weight, self.weight_scale]), recurse)
        if self.weight.device != before:
            if before.type == "meta":
                # to_empty leaves buffers uninitialised; this one is a constant, in no state dict.
                with torch.no_grad():
                    self._all_rows.fill_(_ALL_ROWS)
            self._resolve()
        return out

    # -- construction from other weights
    @classmethod
    def from_float(
        cls,
        linear: nn.Linear,
        scheme: str = "int8_channel",
        accumulator: str | None = None,
        backend: str = "auto",
    ) -> "Int8Linear":
        """An :class:`Int8Linear` from a float ``nn.Linear`` (weights quantized with the project's
        rounding rule, on the linear's device; the bias kept as fp32)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be a torch.nn.Linear; got {type(linear).__name__}")
        w = linear.weight.detach()
        mod = cls(linear.in_features, linear.out_features, linear.bias is not None, scheme, accumulator,
                  backend, device=w.device)  # fmt: skip
        with torch.no_grad():
            mod._set_float_weight(w)
            if linear.bias is not None:
                mod.bias.copy_(linear.bias.detach().float())
        return mod

    def _set_float_weight(self, w: torch.Tensor) -> None:
        q, s = quantize_weight(w.float().unsqueeze(0), SCHEMES[self.scheme])
        self.weight.copy_(q[0])
        self.weight_scale.copy_(s[0])

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]) -> set[str]:
        """Load one linear's tensors as ``epmoe convert --dense`` (or DeepSeek) writes them.

        Args:
            named_tensors: ``(name, tensor)`` pairs or a mapping; a name is the suffix
                (``weight``, ``weight_scale``, ``weight_scale_inv``, ``bias``) or any dotted name
                ending in one (``model.layers.0.self_attn.q_a_proj.weight``). Accepted sets:
                int8 ``weight`` with fp32 ``weight_scale`` ``[N, 1]`` or ``weight_scale_inv``
                ``[ceil(N/128), ceil(K/128)]`` (used as they are when they match ``scheme``,
                otherwise dequantized and requantized); float8_e4m3fn ``weight`` with its 128x128
                ``weight_scale_inv`` (dequantized to BF16 and requantized, as ``epmoe convert``
                does, so the result is the converter's bit for bit); a float ``weight`` (quantized).

        Returns:
            The names loaded.

        Raises:
            ValueError / TypeError: unknown or repeated names, a missing weight, wrong shapes or
            dtypes (each message names the tensor, what it got and what is allowed).
        """
        items = named_pairs(named_tensors)
        got: dict[str, tuple[str, torch.Tensor]] = {}
        allowed = ("weight", "weight_scale", "weight_scale_inv", "bias")
        for name, t in items:
            suffix = name.rsplit(".", 1)[-1]
            if suffix not in allowed:
                raise ValueError(f"tensor {name!r}: unknown name; allowed: names ending in {list(allowed)}")
            if suffix in got:
                raise ValueError(f"tensor {name!r}: a second {suffix!r} (first {got[suffix][0]!r}); pass one linear's tensors")
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"tensor {name!r}: got {type(t).__name__}; allowed: a torch.Tensor")
            got[suffix] = (name, t)
        if "weight" not in got:
            raise ValueError(f"no weight among {[n for n, _ in got.values()]}; a linear needs its 'weight'")
        wname, w = got["weight"]
        n, k = self.out_features, self.in_features
        if tuple(w.shape) != (n, k):
            raise ValueError(f"tensor {wname!r}: shape {tuple(w.shape)}; allowed: [{n}, {k}] (out_features, in_features)")
        scales = [got[s] for s in ("weight_scale", "weight_scale_inv") if s in got]
        if len(scales) > 1:
            raise ValueError(f"both {scales[0][0]!r} and {scales[1][0]!r} given; allowed: one scale per weight")
        dev = self.weight.device
        if w.dtype == torch.float8_e4m3fn:
            if not scales or not scales[0][0].endswith("weight_scale_inv"):
                raise ValueError(f"tensor {wname!r} is float8_e4m3fn; allowed only with its 128x128 'weight_scale_inv'")
            from .checkpoint.requantize import dequantize_fp8_block

            self._set_float_weight(dequantize_fp8_block(w.cpu(), scales[0][1].float().cpu()).to(dev))
        elif w.dtype == torch.int8:
            if not scales:
                raise ValueError(f"tensor {wname!r} is int8; allowed only with 'weight_scale' [N, 1] or 'weight_scale_inv' blocks")
            sname, s = scales[0]
            channel, block = (n, 1), weight_scale_shape("int8_block", n, k)
            if s.dtype != torch.float32 or tuple(s.shape) not in (channel, block):
                raise ValueError(
                    f"tensor {sname!r}: {s.dtype} {tuple(s.shape)}; allowed: torch.float32 {list(channel)} "
                    f"(channel) or {list(block)} (128x128 blocks) for a [{n}, {k}] weight"
                )
            own = weight_scale_shape(self.scheme, n, k)
            if tuple(s.shape) == own:
                self.weight.copy_(w)
                self.weight_scale.copy_(s)
            else:
                log.info("Int8Linear: %s has %s scales; requantized to %s", wname, list(s.shape), self.scheme)
                self._set_float_weight(dequantize_weight(w.unsqueeze(0).to(dev), s.unsqueeze(0).to(dev))[0])
        elif w.is_floating_point():
            if scales:
                raise ValueError(f"tensor {wname!r} is {w.dtype}: a float weight takes no scale (got {scales[0][0]!r})")
            self._set_float_weight(w.to(dev))
        else:
            raise TypeError(f"tensor {wname!r}: dtype {w.dtype}; allowed: int8, float8_e4m3fn or a float dtype")
        if "bias" in got:
            bname, b = got["bias"]
            if self.bias is None:
                raise ValueError(f"tensor {bname!r}: this Int8Linear was built with bias=False")
            if tuple(b.shape) != (n,) or not b.is_floating_point():
                raise ValueError(f"tensor {bname!r}: {b.dtype} {tuple(b.shape)}; allowed: a float [{n}] tensor")
            self.bias.copy_(b)
        return {name for name, _ in got.values()}

    # -- forward
    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x: got {type(x).__name__}; allowed: a torch.Tensor [..., {self.in_features}]")
        if x.dtype not in INPUT_DTYPES:
            raise TypeError(f"x: dtype {x.dtype}; allowed: {list(INPUT_DTYPES)}")
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"x: shape {tuple(x.shape)}; allowed: [..., {self.in_features}] (in_features)")
        if x.device != self.weight.device:
            raise ValueError(f"x is on {x.device} but the weights are on {self.weight.device}; move one of them")
        if self._impl is None:
            raise RuntimeError("Int8Linear is on the meta device; move it to a real device (to_empty) first")
        return x.reshape(-1, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., K]`` (bf16, fp16 or fp32) -> ``[..., N]`` of ``x``'s dtype."""
        x2 = self._rows(x)
        m = x2.shape[0]
        if m == 0:
            return x.new_zeros(*x.shape[:-1], self.out_features)
        out = self._impl.linear(self, x2)[:m]
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"scheme={self.scheme!r}, accumulator={self.accumulator!r}, "
                f"backend={None if self._impl is None else self._impl.label!r}")  # fmt: skip


class Int8MLP(nn.Module):
    """The DeepSeek shared-expert (and dense) MLP in INT8: ``down(silu(gate(x)) * up(x))``.

    ``gate_up_proj`` is one :class:`Int8Linear` ``[2I, H]`` (gate rows, then up rows, as the routed
    experts' ``w13``); ``silu(gate) * up`` is formed in fp32 and quantized for ``down_proj`` in the
    same kernel (:func:`epmoe.kernels.activation.silu_and_mul_quant` on triton and cutlass), so the
    intermediate is written once, in INT8.

    Args:
        hidden_size: H.
        intermediate_size: I.
        scheme, accumulator, backend, device: as in :class:`Int8Linear` (both linears alike).
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        scheme: str = "int8_channel",
        accumulator: str | None = None,
        backend: str = "auto",
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        check_positive_int("hidden_size", hidden_size)
        check_positive_int("intermediate_size", intermediate_size)
        self.gate_up_proj = Int8Linear(hidden_size, 2 * intermediate_size, False, scheme, accumulator, backend, device)
        self.down_proj = Int8Linear(intermediate_size, hidden_size, False, scheme, accumulator, backend, device)
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size

    @classmethod
    def from_float(cls, gate_proj: nn.Linear, up_proj: nn.Linear, down_proj: nn.Linear,
                   scheme: str = "int8_channel", accumulator: str | None = None,
                   backend: str = "auto") -> "Int8MLP":  # fmt: skip
        """From float gate, up and down ``nn.Linear`` s (no biases)."""
        for name, lin in (("gate_proj", gate_proj), ("up_proj", up_proj), ("down_proj", down_proj)):
            if not isinstance(lin, nn.Linear) or lin.bias is not None:
                raise ValueError(f"{name}: allowed: an nn.Linear without bias; got {lin!r}")
        h, i = gate_proj.in_features, gate_proj.out_features
        mod = cls(h, i, scheme, accumulator, backend, device=gate_proj.weight.device)
        with torch.no_grad():
            mod.load_weights({"gate_proj.weight": gate_proj.weight, "up_proj.weight": up_proj.weight,
                              "down_proj.weight": down_proj.weight})  # fmt: skip
        return mod

    @torch.no_grad()
    def load_weights(self, named_tensors) -> set[str]:
        """Load ``gate_proj`` / ``up_proj`` / ``down_proj`` tensors (any prefix; suffixes as in
        :meth:`Int8Linear.load_weights`). Gate and up are fused into ``gate_up_proj`` in their
        float values (FP8 and mismatched INT8 inputs are dequantized first), so a block scale is
        never shared across the two."""
        parts: dict[str, dict[str, torch.Tensor]] = {"gate_proj": {}, "up_proj": {}, "down_proj": {}}
        prefix = None
        for name, t in named_pairs(named_tensors):
            pieces = name.split(".")
            proj = pieces[-2] if len(pieces) >= 2 else ""
            if proj not in parts:
                raise ValueError(f"tensor {name!r}: allowed: names '<prefix>.(gate_proj|up_proj|down_proj).<suffix>'")
            here = ".".join(pieces[:-2])
            if prefix is not None and here != prefix:
                raise ValueError(f"tensor {name!r}: prefix {here!r}, where the first tensor had {prefix!r}; "
                                 "allowed: one MLP's tensors per call")
            prefix = here
            if name in parts[proj]:
                raise ValueError(f"tensor {name!r} given twice; allowed: each tensor once")
            parts[proj][name] = t  # whole names: Int8Linear refuses a repeat by both names
        for proj, d in parts.items():
            if not any(n.rsplit(".", 1)[-1] == "weight" for n in d):
                raise ValueError(f"no {proj}.weight given; an Int8MLP needs gate_proj, up_proj and down_proj")
        # All three checked (and quantized) in modules of their own before any is copied in.
        loaded = {}
        for proj, out_f, in_f in (("gate_proj", self.intermediate_size, self.hidden_size),
                                  ("up_proj", self.intermediate_size, self.hidden_size),
                                  ("down_proj", self.hidden_size, self.intermediate_size)):  # fmt: skip
            dst = self.down_proj if proj == "down_proj" else self.gate_up_proj
            tmp = Int8Linear(in_f, out_f, False, dst.scheme, dst.accumulator, "torch", device=dst.weight.device)
            tmp.load_weights(parts[proj])
            loaded[proj] = tmp
        self.down_proj.weight.copy_(loaded["down_proj"].weight)
        self.down_proj.weight_scale.copy_(loaded["down_proj"].weight_scale)
        gate, up = loaded["gate_proj"], loaded["up_proj"]
        if self.gate_up_proj.scheme == "int8_channel" or self.intermediate_size % BLOCK == 0:
            # Channel scales, or blocks that never straddle gate and up: concatenated as they are.
            self.gate_up_proj.weight.copy_(torch.cat([gate.weight, up.weight]))
            self.gate_up_proj.weight_scale.copy_(torch.cat([gate.weight_scale, up.weight_scale]))
        else:
            w = torch.cat([dequantize_weight(m.weight.unsqueeze(0), m.weight_scale.unsqueeze(0))[0] for m in (gate, up)])
            self.gate_up_proj._set_float_weight(w)
        return {name for d in parts.values() for name in d}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., H]`` (bf16, fp16 or fp32) -> ``[..., H]`` of ``x``'s dtype."""
        gu = self.gate_up_proj
        x2 = gu._rows(x)
        m = x2.shape[0]
        if m == 0:
            return x.new_zeros(x.shape)
        # The padded rows (if any) stay through both GEMMs; they are dropped at the end.
        gate_up = gu._impl.linear(gu, x2)
        h, hs = self.down_proj._impl.silu_quantize(gate_up, gu.scheme)
        out = self.down_proj._impl.gemm(self.down_proj, h, hs, x.dtype, rows=m)[:m]
        return out.reshape(x.shape)
