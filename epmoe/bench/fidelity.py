"""``epmoe fidelity``: how far each quantization scheme moves the MoE layer output.

For one set of expert weights (synthetic, or one layer of a checkpoint) the tool builds
``DeepEPMoELayer`` once per scheme (``backend="torch"``, ``dispatch="local"``), runs it on the same
bf16 hidden states and router logits, and compares the output with a float64 evaluation of the
same routed MLPs on the unquantized weights. It reports, per scheme:

* the weight round-trip error ``||deq(q(W)) - W||_F / ||W||_F`` over all expert weights;
* the output error ``||out - ref||_F / ||ref||_F``, ``mean|out - ref| / mean|ref|`` and the worst
  per-token relative error, for Gaussian activations and for activations with realistic outliers.

The float64 reference takes the same bf16-rounded hidden states as the layer and the same routing,
so the numbers measure weight and activation quantization plus the layer's own arithmetic (fp32
math, bf16 output), nothing else.

INT8 channel-wise schemes may accumulate in fp32 or int32. The torch backend computes with
dequantized fp32 operands, so its int32 row can differ from the fp32 row only by fp32 summation;
a second, layer-independent table therefore emulates both kernel accumulators exactly (int32: exact
integer sums; fp32: exact int32 partial sums per 128-wide K tile added in fp32, as the Triton
kernel's fp32 path does).

:func:`epmoe.checkpoint.synthetic.write_synthetic_checkpoint` (``epmoe make-checkpoint``) writes a
small DeepSeek-named FP8 checkpoint with the same weight distribution, for trying ``epmoe convert``
and ``epmoe fidelity --checkpoint`` without the real weights.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..checkpoint.names import parse_expert_name
from ..checkpoint.reading import checkpoint_scheme, expert_ids, iter_expert_weights
from ..checkpoint.requantize import convert_tensor
from ..checkpoint.synthetic import fp8_block_weight, synthetic_weight
from ..quant.reference import dequantize_weight, quantize_rows, quantize_weight
from ..quant.schemes import BLOCK, SCHEMES
from ..reference import expert_mlp_float64
from ..routing import select_experts
from .options import FIDELITY_DESCRIPTION as DESCRIPTION
from .options import add_fidelity_arguments

PROJS = ("gate_proj", "up_proj", "down_proj")
ACTIVATIONS = ("gaussian", "outliers")

# (label, scheme, accumulator, weights reached through FP8 conversion)
VARIANTS = (
    ("bf16", "bf16", "fp32", False),
    ("fp8_block", "fp8_block", "fp32", False),
    ("int8_channel", "int8_channel", "fp32", False),
    ("int8_channel", "int8_channel", "int32", False),
    ("int8_block", "int8_block", "fp32", False),
    ("int8_channel", "int8_channel", "fp32", True),
    ("int8_block", "int8_block", "fp32", True),
)


# --------------------------------------------------------------------------------------------
# Synthetic weights and activations
# --------------------------------------------------------------------------------------------


def synthetic_activations(tokens: int, hidden: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    """Float64 ``[tokens, hidden]`` hidden states.

    ``gaussian``: i.i.d. N(0, 1). ``outliers``: Student-t (4 dof) entries, a log-normal per-token
    scale (sigma 0.5, so some tokens are several times larger than others), and one channel per
    1024 (at least 2; 7 for H = 7168) carrying 10x-100x the magnitude of the rest: the few
    persistent outlier feature dimensions seen in the hidden states of large transformers.
    """
    if kind == "gaussian":
        return torch.randn(tokens, hidden, generator=gen, dtype=torch.float64)
    if kind != "outliers":
        raise ValueError(f"activation kind {kind!r}; allowed: {list(ACTIVATIONS)}")
    nu = 4
    z = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64)
    chi2 = torch.randn(nu, tokens, hidden, generator=gen, dtype=torch.float64).pow(2).sum(0)
    x = z / torch.sqrt(chi2 / nu) / math.sqrt(nu / (nu - 2))
    x = x * torch.exp(0.5 * torch.randn(tokens, 1, generator=gen, dtype=torch.float64))
    n_out = max(2, hidden // 1024)
    chans = torch.randperm(hidden, generator=gen)[:n_out]
    factors = torch.exp(
        torch.empty(n_out, dtype=torch.float64).uniform_(math.log(10), math.log(100), generator=gen)
    )
    x[:, chans] *= factors
    return x


# --------------------------------------------------------------------------------------------
# Weight sources
# --------------------------------------------------------------------------------------------


@dataclass
class WeightSource:
    """Expert weights of one layer: what is stored, and the float64 weights it stands for.

    ``stored[(e, proj)]`` maps suffixes (``weight``, ``weight_scale``, ``weight_scale_inv``) to
    tensors in the storage format of ``scheme`` (``None``: plain float64 synthetic weights).
    """

    stored: dict[tuple[int, str], dict[str, torch.Tensor]]
    scheme: str | None
    num_experts: int
    hidden: int
    intermediate: int
    description: str

    def reference(self, e: int, proj: str) -> torch.Tensor:
        """The float64 ``[N, K]`` weight every scheme is measured against."""
        return _dequant(self.stored[(e, proj)])

    def fp8(self, e: int, proj: str) -> tuple[torch.Tensor, torch.Tensor]:
        """FP8 e4m3 weight and block scale: the stored ones when the source is FP8."""
        if self.scheme == "fp8_block":
            t = self.stored[(e, proj)]
            return t["weight"], t["weight_scale_inv"]
        return fp8_block_weight(self.reference(e, proj))


def _dequant(t: dict[str, torch.Tensor]) -> torch.Tensor:
    w = t["weight"]
    scale = t.get("weight_scale", t.get("weight_scale_inv"))
    if scale is None:
        return w.double()
    return dequantize_weight(w.unsqueeze(0), scale.unsqueeze(0))[0].double()


def synthetic_source(experts: int, hidden: int, intermediate: int, seed: int) -> WeightSource:
    gen = torch.Generator().manual_seed(seed)
    stored = {}
    for e in range(experts):
        for proj in PROJS:
            n, k = (hidden, intermediate) if proj == "down_proj" else (intermediate, hidden)
            stored[(e, proj)] = {"weight": synthetic_weight(n, k, gen)}
    return WeightSource(
        stored, None, experts, hidden, intermediate,
        f"synthetic float64 weights (seed {seed})",
    )


def checkpoint_source(path: str | Path, layer: int, experts: int | None) -> WeightSource:
    """Routed experts ``0..experts-1`` (all by default) of decoder layer ``layer``."""
    root = Path(path)
    scheme = checkpoint_scheme(root)
    ids = expert_ids(root, layer)
    if not ids:
        raise ValueError(f"{root} has no routed experts for --layer {layer}")
    n_exp = len(ids) if experts is None else experts
    if ids[:n_exp] != list(range(n_exp)):
        raise ValueError(
            f"--experts {n_exp}: layer {layer} of {root} has experts {ids[:8]}...; "
            f"need ids 0..{n_exp - 1}"
        )
    stored: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, t in iter_expert_weights(root, layer, range(n_exp)):
        m = parse_expert_name(name)
        stored.setdefault((m.expert, m.proj), {})[m.kind] = t
    inter, hidden = stored[(0, "gate_proj")]["weight"].shape
    return WeightSource(
        stored, scheme, n_exp, hidden, inter, f"{root} layer {layer} ({scheme} weights)"
    )


def variant_tensors(
    source: WeightSource, scheme: str, via_fp8: bool, e: int, proj: str
) -> dict[str, torch.Tensor]:
    """The weight of expert ``e``'s ``proj`` in ``scheme``'s storage format.

    Stored tensors are used as they are when the source already is in ``scheme``; ``via_fp8``
    takes the checkpoint path: FP8 block weights converted by :func:`convert_tensor`.
    """
    if via_fp8:
        return convert_tensor(*source.fp8(e, proj), scheme)
    if scheme == source.scheme:
        return source.stored[(e, proj)]
    if scheme == "fp8_block":
        q, s = source.fp8(e, proj)
        return {"weight": q, "weight_scale_inv": s}
    w = source.reference(e, proj)
    if scheme == "bf16":
        return {"weight": w.to(torch.bfloat16)}
    q, s = quantize_weight(w.float().unsqueeze(0), SCHEMES[scheme])
    key = "weight_scale" if scheme == "int8_channel" else "weight_scale_inv"
    return {"weight": q[0], key: s[0]}


# --------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------


def reference_output(
    source: WeightSource, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
) -> torch.Tensor:
    """Float64 ``sum_j w_j * W2 (silu(W1 x) * W3 x)`` over each token's routed experts."""
    x = x.double()
    out = torch.zeros_like(x)
    for e in range(source.num_experts):
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        w13 = torch.cat([source.reference(e, "gate_proj"), source.reference(e, "up_proj")])
        y = expert_mlp_float64(x[tok], w13, source.reference(e, "down_proj"))
        out.index_add_(0, tok, y * topk_weights[tok, slot].double().unsqueeze(1))
    return out


def output_errors(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    diff = out.double() - ref
    tok_ref = ref.norm(dim=1)
    tok_rel = diff.norm(dim=1)[tok_ref > 0] / tok_ref[tok_ref > 0]
    return {
        "rel_fro": float(diff.norm() / ref.norm()),
        "rel_mean_abs": float(diff.abs().mean() / ref.abs().mean()),
        "worst_token": float(tok_rel.max()) if tok_rel.numel() else 0.0,
    }


def build_layer(source: WeightSource, scheme: str, accumulator: str, via_fp8: bool, top_k: int):
    """A ``DeepEPMoELayer`` (torch backend, local dispatch) loaded with the variant's weights.

    Returns ``(layer, weight_error, conversion_error)``; the conversion error (``None`` unless
    ``via_fp8``) is measured against the FP8 weights that were converted.
    """
    from ..layer import DeepEPMoELayer

    kwargs = dict(
        quant=scheme,
        accumulator=accumulator,
        backend="torch",
        dispatch="local",
        params_dtype=torch.bfloat16,
        device="cpu",
        renormalize=True,
        scoring_func="softmax",
    )
    layer = DeepEPMoELayer(source.num_experts, top_k, source.hidden, source.intermediate, **kwargs)
    err = {"sq": 0.0, "ref": 0.0, "conv_sq": 0.0, "fp8": 0.0}

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for e in range(source.num_experts):
            for proj in PROJS:
                t = variant_tensors(source, scheme, via_fp8, e, proj)
                ref, deq = source.reference(e, proj), _dequant(t)
                err["sq"] += float((deq - ref).pow(2).sum())
                err["ref"] += float(ref.pow(2).sum())
                if via_fp8:
                    q, s = source.fp8(e, proj)
                    w8 = _dequant({"weight": q, "weight_scale_inv": s})
                    err["conv_sq"] += float((deq - w8).pow(2).sum())
                    err["fp8"] += float(w8.pow(2).sum())
                for suffix, v in t.items():
                    yield f"model.layers.0.mlp.experts.{e}.{proj}.{suffix}", v

    layer.load_weights(tensors())
    conv = math.sqrt(err["conv_sq"] / err["fp8"]) if via_fp8 else None
    return layer, math.sqrt(err["sq"] / err["ref"]), conv


def emulate_int8_channel(
    source: WeightSource,
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    accumulator: str,
    k_tile: int = BLOCK,
) -> torch.Tensor:
    """The INT8 channel-wise MoE as an integer kernel computes it, in fp32 (no output cast).

    ``int32``: each output is an exact integer dot product (float64 holds any sum of int8
    products below 2^53), converted to fp32 once and scaled. ``fp32``: exact int32 partial sums
    over ``k_tile``-wide K tiles, each converted to fp32 and added in fp32, then scaled.
    """
    scheme = SCHEMES["int8_channel"]

    def gemm(aq: torch.Tensor, a_s: torch.Tensor, wq: torch.Tensor, w_s: torch.Tensor) -> torch.Tensor:
        a64, w64 = aq.double(), wq.double()
        if accumulator == "int32":
            acc = (a64 @ w64.t()).float()
        else:
            acc = torch.zeros(aq.shape[0], wq.shape[0], dtype=torch.float32)
            for k0 in range(0, aq.shape[1], k_tile):
                acc += (a64[:, k0 : k0 + k_tile] @ w64[:, k0 : k0 + k_tile].t()).float()
        return acc * a_s * w_s.reshape(1, -1)

    out = torch.zeros(x.shape, dtype=torch.float32)
    for e in range(source.num_experts):
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        w = {p: variant_tensors(source, "int8_channel", False, e, p) for p in PROJS}
        xq, xs = quantize_rows(x[tok].float(), scheme.qdtype, scheme.qmax)
        g = gemm(xq, xs, w["gate_proj"]["weight"], w["gate_proj"]["weight_scale"])
        u = gemm(xq, xs, w["up_proj"]["weight"], w["up_proj"]["weight_scale"])
        hq, hs = quantize_rows(F.silu(g) * u, scheme.qdtype, scheme.qmax)
        y = gemm(hq, hs, w["down_proj"]["weight"], w["down_proj"]["weight_scale"])
        out.index_add_(0, tok, y * topk_weights[tok, slot].float().unsqueeze(1))
    return out


def run_fidelity(source: WeightSource, tokens: int, top_k: int, seed: int) -> dict:
    """Every variant on every activation kind; returns the JSON-able result."""
    if not 1 <= top_k <= source.num_experts:
        raise ValueError(f"--top-k {top_k} must be in [1, {source.num_experts}] (the experts used)")
    gen = torch.Generator().manual_seed(seed + 1)
    inputs = {}
    for kind in ACTIVATIONS:
        x = synthetic_activations(tokens, source.hidden, kind, gen).to(torch.bfloat16)
        logits = torch.randn(tokens, source.num_experts, generator=gen)
        ids, weights = select_experts(logits, top_k, renormalize=True, scoring_func="softmax")
        inputs[kind] = (x, logits, ids, weights, reference_output(source, x, ids, weights))

    rows = []
    for label, scheme, acc, via in VARIANTS:
        if via and source.scheme not in (None, "fp8_block"):
            continue  # the FP8 conversion path exists only for FP8 (or unquantized) sources
        t0 = time.perf_counter()
        layer, werr, conv_err = build_layer(source, scheme, acc, via, top_k)
        row = {
            "scheme": label,
            "accumulator": acc,
            "accumulator_in_layer": True,  # the layer ran this accumulator (the emulation below is apart)
            "weights": "fp8 -> bf16 -> int8 (epmoe convert)" if via else "direct",
            "weight_rel_err": werr,
            "conversion_rel_err": conv_err,
            "bound": SCHEMES[scheme].rel_error_bound,
        }
        with torch.inference_mode():
            for kind, (x, _, ids, weights, ref) in inputs.items():
                # Explicit routing: every scheme and the reference see the same experts.
                row[kind] = output_errors(layer(x, topk_ids=ids, topk_weights=weights), ref)
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
        del layer

    emulation = {"fp32": {}, "int32": {}}
    for kind, (x, _, ids, weights, ref) in inputs.items():
        outs = {acc: emulate_int8_channel(source, x, ids, weights, acc) for acc in emulation}
        for acc, out in outs.items():
            emulation[acc][kind] = output_errors(out, ref)
        emulation["fp32"][kind]["rel_diff_vs_int32"] = float(
            (outs["fp32"].double() - outs["int32"].double()).norm() / ref.norm()
        )
    return {
        "source": source.description,
        "experts": source.num_experts,
        "hidden": source.hidden,
        "intermediate": source.intermediate,
        "tokens": tokens,
        "top_k": top_k,
        "seed": seed,
        "rows": rows,
        "accumulator_emulation": [{"accumulator": a, **v} for a, v in emulation.items()],
    }


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------


def _pct(v: float) -> str:
    return f"{100 * v:.3f}%"


def format_markdown(result: dict) -> str:
    r = result
    lines = [
        f"Weights: {r['source']}; E={r['experts']}, H={r['hidden']}, I={r['intermediate']}, "
        f"top-{r['top_k']}, {r['tokens']} tokens, seed {r['seed']}.",
        "",
        "| scheme | accumulate | weights | weight err | conversion err | gaussian: out err "
        "| gaussian: mean-abs err | outliers: out err | outliers: mean-abs err "
        "| outliers: worst token | bound (gaussian, direct) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        g, o = row["gaussian"], row["outliers"]
        conv = "-" if row["conversion_rel_err"] is None else _pct(row["conversion_rel_err"])
        lines.append(
            f"| {row['scheme']} | {row['accumulator']} | {row['weights']} | {_pct(row['weight_rel_err'])} | {conv} | "
            f"{_pct(g['rel_fro'])} | {_pct(g['rel_mean_abs'])} | {_pct(o['rel_fro'])} | "
            f"{_pct(o['rel_mean_abs'])} | {_pct(o['worst_token'])} | {_pct(row['bound'])} |"
        )
    lines += [
        "",
        "The bound is the scheme's documented one (docs/quantization.md): it holds for Gaussian "
        "activations on directly quantized weights. Outlier activations and converted weights are "
        "measured beside it, not held to it.",
        "",
        "INT8 channel-wise accumulator, emulated exactly (layer-independent, fp32 output, no bf16 cast):",
        "",
        "| accumulate | gaussian: out err | outliers: out err "
        "| fp32 minus int32, rel. to ref (gaussian / outliers) |",
        "|---|---|---|---|",
    ]
    for e in r["accumulator_emulation"]:
        diff = e["gaussian"].get("rel_diff_vs_int32")
        diff_o = e["outliers"].get("rel_diff_vs_int32")
        d = "-" if diff is None else f"{diff:.2e} / {diff_o:.2e}"
        lines.append(
            f"| {e['accumulator']} | {_pct(e['gaussian']['rel_fro'])} | "
            f"{_pct(e['outliers']['rel_fro'])} | {d} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``epmoe fidelity [--checkpoint DIR --layer L] [--experts N --hidden H --intermediate I
    --tokens T --top-k K --seed S] [--json PATH] [--markdown PATH]``."""
    parser = argparse.ArgumentParser(prog="epmoe fidelity", description=DESCRIPTION)
    add_fidelity_arguments(parser)
    return run(parser.parse_args(argv), parser)


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """The tool for parsed options (``parser.error`` names a bad one); 0, or 2 on a bad input."""
    try:
        if args.checkpoint is not None:
            if args.layer is None:
                parser.error("--checkpoint needs --layer (the decoder layer whose experts to read)")
            source = checkpoint_source(args.checkpoint, args.layer, args.experts)
        else:
            if args.layer is not None:
                parser.error("--layer applies only with --checkpoint")
            for opt in ("hidden", "intermediate"):
                v = getattr(args, opt)
                if v <= 0 or v % BLOCK:
                    parser.error(f"--{opt} {v} must be a positive multiple of {BLOCK} (block schemes)")
            experts = 32 if args.experts is None else args.experts
            if experts < 1:
                parser.error(f"--experts {experts} must be >= 1")
            source = synthetic_source(experts, args.hidden, args.intermediate, args.seed)
        if args.tokens < 1:
            parser.error(f"--tokens {args.tokens} must be >= 1")
        result = run_fidelity(source, args.tokens, args.top_k, args.seed)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"epmoe fidelity: error: {exc}", file=sys.stderr)
        return 2
    table = format_markdown(result)
    print(table, end="")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
