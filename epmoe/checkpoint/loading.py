"""Loading checkpoint tensors into one rank's ``DeepEPMoELayer``: which slot of which parameter
each tensor fills, and the checks made before anything is copied."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from ..quant.schemes import BLOCK, QuantScheme
from ..tensors import check_tensor, named_pairs
from .names import (
    CORRECTION_BIAS,
    EXPECTED_FORMS,
    PROJS,
    expert_name,
    is_correction_bias,
    parse_expert_name,
    parse_fused_expert_name,
)

_QUANT_DTYPES = (torch.int8, torch.float8_e4m3fn)
_VALUE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_SHOW_MISSING = 5  # names a strict load's error lists before it gives the count


def check_finite(named: list[tuple[str, torch.Tensor]]) -> None:
    """Raise ``ValueError`` naming the first scale or correction bias among ``named`` with a NaN or
    Inf (one host sync for all): they multiply everything they touch, so a NaN there is a broken
    checkpoint. Weights are not checked (a pass over every weight on each load)."""
    by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
    for name, t in named:
        multiplier = "scale" in name or is_correction_bias(name)
        if multiplier and t.device.type != "meta":  # meta: shapes only, nothing to check
            by_device.setdefault(t.device, []).append((name, torch.isfinite(t).all()))
    for flags in by_device.values():
        for (name, _), good in zip(flags, torch.stack([f for _, f in flags]).tolist()):
            if not good:
                raise ValueError(f"{name} holds NaN or Inf; scales and the correction bias must be finite")


def check_dtype(scheme: QuantScheme, name: str, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Raise ``TypeError`` unless ``src`` may be copied into the parameter ``dst``: quantized
    parameters take their own dtype only, float parameters plain float values only."""
    if dst.dtype in _QUANT_DTYPES and src.dtype != dst.dtype:
        raise TypeError(
            f"{name} has dtype {src.dtype}; quant={scheme.name!r} stores {dst.dtype} "
            "(convert the checkpoint with `epmoe convert`)"
        )
    # A plain float parameter takes plain float values only: e4m3 codes copied without their
    # scales would load silently wrong.
    if dst.dtype not in _QUANT_DTYPES and src.dtype not in _VALUE_DTYPES:
        quantized = src.dtype in _QUANT_DTYPES and "scale" not in name
        raise TypeError(
            f"{name} has dtype {src.dtype}; quant={scheme.name!r} takes "
            f"{[str(d) for d in _VALUE_DTYPES]} here"
            + (" (quantized checkpoints need the matching quant=)" if quantized else "")
        )


@torch.no_grad()
def load_experts(layer, w13, w2, w13_scale=None, w2_scale=None) -> None:
    """Copy the ``layer``'s slice of global stacked expert tensors into its parameters
    (``DeepEPMoELayer.load_experts`` documents the arguments). Everything is checked first."""
    scheme = layer.scheme
    sl = slice(layer.first_expert, layer.first_expert + layer.num_local_experts)
    items = [("w13", w13, layer.w13_weight), ("w2", w2, layer.w2_weight)]
    if scheme.quantized:
        for name, scale in (("w13_scale", w13_scale), ("w2_scale", w2_scale)):
            if scale is None:
                raise ValueError(f"{name} is required for quant={scheme.name!r}")
        items += [("w13_scale", w13_scale, layer.w13_weight_scale), ("w2_scale", w2_scale, layer.w2_weight_scale)]
    for name, src, dst in items:  # check everything before copying anything
        check_tensor(name, src)
        expected = (layer.num_experts, *dst.shape[1:])
        if tuple(src.shape) != expected:
            raise ValueError(f"{name} has shape {tuple(src.shape)}; expected {list(expected)}")
        check_dtype(scheme, name, src, dst)
    check_finite([(name, src[sl]) for name, src, _ in items])
    for _, src, dst in items:
        dst.copy_(src[sl])


def _scale_slot(scheme: QuantScheme, scale: torch.Tensor, proj: str, n: int, k: int):
    """The view of one expert's scale tensor that ``proj`` fills, and its expected shape."""
    if scheme.weight_granularity == "channel":
        if proj == "down_proj":
            return scale, (n, 1)
        start = 0 if proj == "gate_proj" else n
        return scale[start : start + n], (n, 1)
    nb, kb = -(-n // BLOCK), -(-k // BLOCK)
    if proj == "down_proj":
        return scale, (nb, kb)
    start = 0 if proj == "gate_proj" else nb
    return scale[start : start + nb], (nb, kb)


def _plan_copy(copies: dict, slot: tuple, name: str, dst: torch.Tensor, src: torch.Tensor) -> None:
    if slot in copies:
        raise ValueError(
            f"{name} fills the same slot as {copies[slot][0]}: pass one MoE layer's tensors per "
            "load_weights call"
        )
    copies[slot] = (name, dst, src)


def _expected_slots(layer, prefix: str) -> dict[tuple, str]:
    """Every slot of this rank's parameters a full load fills, with the name it expects (global
    expert ids; the scale under the name the scheme's checkpoints use)."""
    scale = {"channel": "weight_scale", "block": "weight_scale_inv"}.get(layer.scheme.weight_granularity)
    slots: dict[tuple, str] = {}
    for e in range(layer.first_expert, layer.first_expert + layer.num_local_experts):
        for proj in PROJS:
            slots[(e, proj, False)] = expert_name(e, proj, "weight", prefix)
            if scale is not None:
                slots[(e, proj, True)] = expert_name(e, proj, scale, prefix)
    if layer.e_score_correction_bias is not None:
        slots[("bias",)] = f"{prefix}gate.{CORRECTION_BIAS}"
    return slots


def expected_weight_names(layer, prefix: str = "") -> list[str]:
    """The names a strict ``load_weights`` needs for ``layer`` (``DeepEPMoELayer.expected_weight_names``)."""
    return list(_expected_slots(layer, prefix).values())


def _plan_fused(layer, copies: dict, name: str, proj: str, tensor: torch.Tensor) -> None:
    """A transformers-5 fused tensor over all experts: this rank's slice fills its weight slots."""
    i, h, e_all = layer.intermediate_size, layer.hidden_size, layer.num_experts
    check_tensor(name, tensor)
    expected = (e_all, 2 * i, h) if proj == "gate_up_proj" else (e_all, h, i)
    if tuple(tensor.shape) != expected:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}; expected {list(expected)} (all experts)")
    local = tensor[layer.first_expert : layer.first_expert + layer.num_local_experts]
    dst = layer.w13_weight if proj == "gate_up_proj" else layer.w2_weight
    check_dtype(layer.scheme, name, local, dst)
    parts = (("gate_proj", slice(0, i)), ("up_proj", slice(i, 2 * i))) if proj == "gate_up_proj" else (("down_proj", slice(0, h)),)
    for j in range(layer.num_local_experts):
        for sub, rows in parts:
            _plan_copy(copies, (layer.first_expert + j, sub, False), name, dst[j, rows], local[j, rows])


@torch.no_grad()
def load_weights(
    layer, named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor], strict: bool = True,
    prefix: str | None = None,
) -> set[str]:
    """Copy checkpoint tensors named the DeepSeek/HF way into ``layer``'s parameters
    (``DeepEPMoELayer.load_weights`` documents the rules). Returns the names loaded."""
    if prefix is not None and not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str or None; got {type(prefix).__name__}")
    scheme = layer.scheme
    copies: dict[tuple, tuple[str, torch.Tensor, torch.Tensor]] = {}
    i, h = layer.intermediate_size, layer.hidden_size
    seen_prefix = None  # without prefix=, missing names are reported under the one the tensors had
    for name, tensor in named_pairs(named_tensors):
        key = name
        if prefix is not None:
            # One layer's tensors picked out of a whole checkpoint: everything outside the prefix,
            # and the router weight / shared experts inside it (names no parser below takes),
            # is not this layer's business.
            if not isinstance(name, str) or not name.startswith(prefix):
                continue
            key = name[len(prefix) :]
        if is_correction_bias(key):
            if layer.e_score_correction_bias is None:
                if strict:
                    raise ValueError(
                        f"{name}: this layer was built with use_correction_bias=False "
                        "(pass use_correction_bias=True, or strict=False to skip it)"
                    )
                continue
            check_tensor(name, tensor)
            if tuple(tensor.shape) != (layer.num_experts,):
                raise ValueError(f"{name} has shape {tuple(tensor.shape)}; expected [{layer.num_experts}]")
            _plan_copy(copies, ("bias",), name, layer.e_score_correction_bias, tensor.float())
            continue
        fused = parse_fused_expert_name(key)
        if fused is not None:
            _plan_fused(layer, copies, name, fused[1], tensor)
            continue
        parsed = parse_expert_name(key)
        if parsed is None:
            if strict and prefix is None:
                raise ValueError(
                    f"checkpoint tensor {name!r} is not an expert weight: expected names ending "
                    f"in {EXPECTED_FORMS} (pass prefix= to pick one layer out of a checkpoint, or "
                    "strict=False to skip)"
                )
            continue
        expert, proj, kind = parsed.expert, parsed.proj, parsed.kind
        seen_prefix = parsed.prefix if seen_prefix is None else seen_prefix
        if expert >= layer.num_experts:
            raise ValueError(f"{name}: expert id {expert} is out of range [0, {layer.num_experts})")
        local = expert - layer.first_expert
        if not 0 <= local < layer.num_local_experts:
            continue
        check_tensor(name, tensor)
        rows = {"gate_proj": slice(0, i), "up_proj": slice(i, 2 * i), "down_proj": slice(0, h)}[proj]
        n, k = (i, h) if proj != "down_proj" else (h, i)
        if kind == "weight":
            dst = (layer.w2_weight if proj == "down_proj" else layer.w13_weight)[local, rows]
            expected = (n, k)
        else:
            if not scheme.quantized:
                raise ValueError(f"{name}: quant='bf16' takes no weight scales")
            full = layer.w2_weight_scale if proj == "down_proj" else layer.w13_weight_scale
            dst, expected = _scale_slot(scheme, full[local], proj, n, k)
            if tensor.dim() == 1 and scheme.weight_granularity == "channel":
                tensor = tensor.unsqueeze(1)
        if tuple(tensor.shape) != expected:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}; expected {list(expected)}")
        check_dtype(scheme, name, tensor, dst)
        _plan_copy(copies, (expert, proj, parsed.is_scale), name, dst, tensor)
    check_finite([(name, src) for name, _, src in copies.values()])
    if strict:
        missing = [n for slot, n in _expected_slots(layer, prefix or seen_prefix or "").items() if slot not in copies]
        if missing:
            shown = ", ".join(repr(n) for n in missing[:_SHOW_MISSING])
            more = f" and {len(missing) - _SHOW_MISSING} more" if len(missing) > _SHOW_MISSING else ""
            raise ValueError(
                f"load_weights(strict=True): {len(missing)} tensor(s) of rank {layer.rank}'s experts "
                f"are missing: {shown}{more} (layer.expected_weight_names() lists them all; pass "
                "strict=False to load part of a layer)"
            )
    for _, dst, src in copies.values():
        dst.copy_(src)
    return {name for name, _, _ in copies.values()}
