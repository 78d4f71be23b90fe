"""``epmoe bench experts``: the routed-experts pass on one GPU, every backend side by side.

For each rows-per-expert ``m`` (uniform routing, fresh random data) it times GEMM1, the
activation, GEMM2 and the whole pass (input quantization included) of:

* ``torch_bf16``: BF16 ``torch._grouped_mm`` GEMMs with torch ``silu * mul`` between (baseline);
* ``triton_int8_channel`` (fp32 accumulator), ``triton_int8_channel_int32``,
  ``triton_int8_block`` and ``triton_bf16``;
* any other :class:`~epmoe.experts.base.ExpertsBackend` given with
  ``--extra module:Class[@scheme][?key=value&...]`` (whole pass only, through its
  ``run_contiguous``; ``@int8_channel_int32`` for the int32 accumulator; the ``key=value`` pairs
  are the backend's keyword arguments, e.g. ``?schedule=n256_quarters_run2&int8_kernel=cutlass``), so FP8
  and CUTLASS INT8 rows need no edit here.

With ``--masked`` each Triton row and each extra backend that runs the masked layout is also timed
there (whole pass, row ``<label>_masked``: every expert's ``m`` rows in a slab of ``m`` rounded up
to 128, as low-latency dispatch delivers them, through its ``run_masked``).

Ceilings measured in the same run: device copy bandwidth, a BF16 8192^3 matmul and
``torch._int_mm`` INT8 8192^3. Each GEMM is reported as a fraction of its memory floor (weight
bytes / copy bandwidth) and of peak (measured ceiling, and the datasheet peak). Accuracy is the
relative mean absolute error of the pass against float64 math on the unquantized weights, on a
few experts. Small batches are timed inside CUDA graphs so launch overhead does not hide the
kernels. The backends are first timed one after the other; ``--turns R`` times every whole pass
again with the backends taking turns for R rounds (:func:`epmoe.timing.in_turns`), the fair comparison
under the GPU's power cap. Kernels are timed with :func:`epmoe.timing.kernel_ms`.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import json
import math
import platform
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..timing import in_turns, kernel_ms
from .options import EXPERTS_BACKENDS as BUILTIN
from .options import add_experts_arguments as add_arguments
from .options import check_experts_args as check_args

DATASHEET = {"int8": 1979.0, "bf16": 989.0, "fp8": 1979.0}
"""H200 SXM dense peaks (TOPS / TFLOP/s)."""

GRAPH_MAX_M = 32
"""Rows per expert up to which timings run inside CUDA graphs (launch overhead is visible)."""


@dataclass
class Case:
    """One timed configuration: stage name -> ms (``None`` when not measurable)."""

    backend: str
    m: int
    precision: str
    ms: dict = field(default_factory=dict)
    error: str | None = None
    accuracy: float | None = None


CPU_MAX_BYTES = 2 << 30
"""Largest problem (fp32 weights + the largest batch) the CPU fallback accepts."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="epmoe bench experts", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return check_args(p, p.parse_args(argv))


# ------------------------------------------------------------------------------- timing


def make_timer(device: torch.device, rep_ms: float) -> Callable[[Callable, bool], float]:
    """``timer(fn, graph)``: :func:`epmoe.timing.kernel_ms` with this run's repetition time."""

    def timer(fn, graph=False):
        return kernel_ms(fn, rep_ms=rep_ms, graph=graph, device=device)

    return timer


def measure_ceilings(device: torch.device, size: int, timer) -> dict:
    """Copy bandwidth (read + write bytes per second) and the dense matmul ceilings."""
    out = {}
    n_bytes = 1 << 30 if device.type == "cuda" else 1 << 24
    src = torch.empty(n_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    out["copy_GBps"] = 2 * n_bytes / ms / 1e6
    del src, dst
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16).t()
    ms = timer(lambda: a @ b)
    out["bf16_matmul_TFLOPs"] = 2 * size**3 / ms / 1e9
    ai = torch.randint(-127, 128, (size, size), device=device, dtype=torch.int8)
    bi = torch.randint(-127, 128, (size, size), device=device, dtype=torch.int8).t()
    try:
        ms = timer(lambda: torch._int_mm(ai, bi))
        out["int8_int_mm_TOPS"] = 2 * size**3 / ms / 1e9
    except RuntimeError as exc:  # CPU builds lack an int8 GEMM for some shapes
        out["int8_int_mm_TOPS"] = None
        out["int8_error"] = str(exc).splitlines()[0]
    return out


# ------------------------------------------------------------------------------- problem


@dataclass
class Problem:
    e: int
    hidden: int
    inter: int
    w13: torch.Tensor  # bf16 [E, 2I, H]
    w2: torch.Tensor  # bf16 [E, H, I]
    quantized: dict = field(default_factory=dict)  # scheme name -> ExpertWeights

    def gemm_shapes(self) -> dict:
        return {"gemm1": (2 * self.inter, self.hidden), "gemm2": (self.hidden, self.inter)}


def build_problem(e: int, hidden: int, inter: int, device: torch.device, dtype: torch.dtype) -> Problem:
    g = torch.Generator(device=device).manual_seed(0)
    w13 = (torch.randn(e, 2 * inter, hidden, device=device, generator=g) / hidden**0.5).to(dtype)
    w2 = (torch.randn(e, hidden, inter, device=device, generator=g) / inter**0.5).to(dtype)
    return Problem(e, hidden, inter, w13, w2)


def weights_for(problem: Problem, scheme_name: str):
    """ExpertWeights of ``scheme_name`` (quantized from the bf16 weights once, in expert chunks)."""
    from ..experts.base import ExpertWeights
    from ..quant.reference import quantize_weight
    from ..quant.schemes import get_scheme

    if scheme_name in problem.quantized:
        return problem.quantized[scheme_name]
    scheme = get_scheme(scheme_name)
    if not scheme.quantized:
        w = ExpertWeights(scheme, problem.w13, problem.w2)
    else:
        parts = {"w13": [], "w2": [], "s13": [], "s2": []}
        chunk = 8  # bounds the fp32 temporaries of the reference quantizer
        for lo in range(0, problem.e, chunk):
            q13, s13 = quantize_weight(problem.w13[lo : lo + chunk], scheme)
            q2, s2 = quantize_weight(problem.w2[lo : lo + chunk], scheme)
            for key, val in zip(("w13", "s13", "w2", "s2"), (q13, s13, q2, s2)):
                parts[key].append(val)
        w = ExpertWeights(scheme, *(torch.cat(parts[k]) for k in ("w13", "w2", "s13", "s2")))
    problem.quantized[scheme_name] = w
    return w


def uniform_batch(problem: Problem, m: int, device: torch.device, dtype: torch.dtype, seed: int, alignment: int = 1):
    """``m`` rows for every expert (the same rows for any alignment); padding rows are zero."""
    from ..layouts import ContiguousBatch

    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m * problem.e, problem.hidden, device=device, generator=g).to(dtype)
    seg = -(-m // alignment) * alignment
    if seg != m:
        padded = torch.zeros(problem.e, seg, problem.hidden, device=device, dtype=dtype)
        padded[:, :m] = x.view(problem.e, m, -1)
        x = padded.view(problem.e * seg, -1)
    offsets = (torch.arange(problem.e + 1, device=device) * seg).to(torch.int32)
    m_indices = torch.arange(problem.e, device=device, dtype=torch.int32).repeat_interleave(seg)
    m_indices.view(problem.e, seg)[:, m:] = -1
    valid = (m_indices >= 0).nonzero().squeeze(1)
    return ContiguousBatch(x, None, offsets, m_indices, valid.unsqueeze(1), [m] * problem.e, alignment=alignment)


# ------------------------------------------------------------------------------- stages


def silu_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """``silu(gate) * up`` of a ``[M, 2 * inter]`` GEMM1 output, in torch."""
    import torch.nn.functional as F

    return F.silu(gate_up[:, :inter]) * gate_up[:, inter:]


def bf16_grouped_mm_pass(x, w13, w2, offs, inter) -> torch.Tensor:
    """The BF16 experts pass on ``torch._grouped_mm``: ``x [M, H]``, ``w13 [E, 2I, H]``,
    ``w2 [E, H, I]`` (stored out x in), ``offs [E]`` int32 segment ends."""
    gate_up = torch._grouped_mm(x, w13.transpose(1, 2), offs=offs)
    return torch._grouped_mm(silu_mul(gate_up, inter), w2.transpose(1, 2), offs=offs)


def torch_bf16_stages(problem: Problem, batch) -> dict[str, Callable]:
    """The BF16 baseline: torch._grouped_mm GEMMs, torch silu * mul between."""
    offs = batch.expert_offsets[1:].contiguous()
    w13t, w2t = problem.w13.transpose(1, 2), problem.w2.transpose(1, 2)
    x = batch.x
    gate_up = torch._grouped_mm(x, w13t, offs=offs)
    h = silu_mul(gate_up, problem.inter)
    return {
        "gemm1": lambda: torch._grouped_mm(x, w13t, offs=offs),
        "act": lambda: silu_mul(gate_up, problem.inter),
        "gemm2": lambda: torch._grouped_mm(h, w2t, offs=offs),
        "total": lambda: bf16_grouped_mm_pass(x, problem.w13, problem.w2, offs, problem.inter),
    }


def triton_stages(problem: Problem, batch, scheme_name: str, accumulator: str) -> tuple[dict, Callable]:
    """Stages of the triton backend: its own stage methods, the ones its run_contiguous chains."""
    from ..experts.triton_backend import TritonBackend
    from ..layouts import ContiguousBatch
    from ..quant.schemes import get_scheme

    scheme = get_scheme(scheme_name)
    backend = TritonBackend(scheme, accumulator=accumulator)
    w = backend.prepare_weights(weights_for(problem, scheme_name))
    dtype = batch.x.dtype
    offsets = batch.expert_offsets
    quant = lambda: backend.gemm1_input(batch.x, None, w, None)  # noqa: E731
    act = lambda gu: backend.activation(gu, w, None)  # noqa: E731
    xq, xs = quant()

    def gemm(a, a_scale, which):
        out_dtype = backend.mid_dtype(w, dtype) if which == 1 else dtype
        return backend.gemm(a, a_scale, w, which, out_dtype, expert_offsets=offsets)

    gate_up = gemm(xq, xs, 1)
    hq, hs = act(gate_up)
    stages = {
        "gemm1": lambda: gemm(xq, xs, 1),
        "act": lambda: act(gate_up),
        "gemm2": lambda: gemm(hq, hs, 2),
        "total": lambda: backend.run_contiguous(batch, w, dtype),
    }
    if scheme.quantized:
        stages["quant"] = quant
        # The pass as it runs after an INT8 dispatch (normal mode delivers quantized rows):
        # GEMM1, activation, GEMM2, no input quantization.
        qbatch = ContiguousBatch(xq, xs, offsets, batch.m_indices, batch.slot_pos, batch.num_rows)
        stages["pass_q"] = lambda: backend.run_contiguous(qbatch, w, dtype)
    return stages, stages["total"]


def load_extra(spec: str):
    """``module:Class[@scheme][?key=value&...]`` -> (label, backend instance); ``scheme`` may also
    be ``int8_channel_int32`` (``int8_channel`` with the int32 accumulator, as in the config
    tables); the pairs are keyword arguments of the backend (string values), their values appended
    to the label (``cutlass_int8_block_n256_quarters_run2``)."""
    from ..kernels.configs import mode_and_accumulator
    from ..quant.schemes import get_scheme

    spec_main, _, query = spec.partition("?")
    path, _, scheme_name = spec_main.partition("@")
    module, _, cls_name = path.partition(":")
    if not module or not cls_name:
        raise ValueError(f"--extra {spec!r}: expected module:Class[@scheme][?key=value&...]")
    kwargs = {}
    for pair in filter(None, query.split("&")):
        key, eq, value = pair.partition("=")
        if not eq or not key.isidentifier():
            raise ValueError(f"--extra {spec!r}: {pair!r} is not key=value")
        kwargs[key] = value
    cls = getattr(importlib.import_module(module), cls_name)
    scheme_name = scheme_name or sorted(cls.schemes)[0]
    quant, accumulator = mode_and_accumulator(scheme_name)
    label = "_".join([f"{cls.name}_{scheme_name}", *kwargs.values()])
    return label, cls(get_scheme(quant), accumulator=accumulator, **kwargs)


def backend_pass(problem: Problem, backend, m: int, batch, refs: dict, seed: int, accuracy_experts: int):
    """``(whole pass, reference rows)`` of any :class:`~epmoe.experts.base.ExpertsBackend` on
    ``batch`` (``m`` rows per expert, with its float64 ``refs``); a backend that needs aligned
    segments gets the same rows rebuilt from ``seed`` with the alignment the layer would lay them out
    for (``alignment_for``), and references of its own."""
    dtype = batch.x.dtype
    w = backend.prepare_weights(weights_for(problem, backend.scheme.name))
    align = backend.alignment_for(m, batch.x.device)
    if align > 1 and m % align:
        batch = uniform_batch(problem, m, batch.x.device, dtype, seed, align)
        refs = reference_rows(problem, batch, accuracy_experts)
    return (lambda: backend.run_contiguous(batch, w, dtype)), refs


def masked_batch(problem: Problem, batch, m: int):
    """``batch``'s rows (``m`` per expert, unpadded) laid out as low-latency dispatch delivers
    them: one slab of ``m`` rounded up to 128 rows per expert, ``masked_m = m``."""
    from ..layouts import MaskedBatch

    e = problem.e
    cap = -(-m // 128) * 128
    x = torch.zeros(e, cap, problem.hidden, dtype=batch.x.dtype, device=batch.x.device)
    x[:, :m] = batch.x[: e * m].view(e, m, -1)
    return MaskedBatch(x, None, torch.full((e,), m, dtype=torch.int32, device=x.device), m)


def masked_pass(problem: Problem, backend, masked):
    """``(whole pass, output rows)`` of ``backend.run_masked`` on ``masked`` (:func:`masked_batch`):
    ``output rows(out)`` gives the valid rows in the contiguous batch's order, for
    :func:`accuracy` against its references."""
    e, m = problem.e, masked.expected_m
    w = backend.prepare_weights(weights_for(problem, backend.scheme.name))
    return (lambda: backend.run_masked(masked, w, masked.x.dtype)), (lambda out: out[:, :m].reshape(e * m, -1))


def triton_backend(name: str):
    """The Triton backend of a built-in ``triton_<scheme>[_int32]`` row."""
    from ..experts.triton_backend import TritonBackend
    from ..quant.schemes import get_scheme

    scheme = name.removeprefix("triton_").removesuffix("_int32")
    return TritonBackend(get_scheme(scheme), accumulator="int32" if name.endswith("_int32") else "fp32")


def add_masked(label: str, backend, m: int, problem: Problem, masked, refs: dict, timer, cases: list, passes: dict | None):
    """The ``<label>_masked`` case (:func:`masked_pass`) appended to ``cases`` (its whole pass to
    ``passes`` for the turns, when given); a failure is recorded in the case, not raised."""
    name = f"{label}_masked"
    print(f"m={m} {name} ...", flush=True)
    try:
        total, rows = masked_pass(problem, backend, masked)
        cases.append(run_case(name, m, {"total": total}, timer, refs, rows))
        if passes is not None:
            passes[name] = total
    except Exception as exc:
        traceback.print_exc(file=sys.stderr)
        cases.append(Case(name, m, precision_of(name), error=f"{type(exc).__name__}: {exc}"))


# ------------------------------------------------------------------------------- accuracy


def reference_rows(problem: Problem, batch, experts: int, max_rows: int = 64) -> dict[int, tuple[slice, torch.Tensor]]:
    """float64 outputs of the first ``experts`` experts on unquantized weights."""
    from epmoe.reference import expert_mlp_float64

    out = {}
    offs = batch.expert_offsets.tolist()
    counts = batch.rows_per_expert()  # one read-back, not one per expert
    for e in range(min(experts, problem.e)):
        rows = slice(offs[e], offs[e] + min(counts[e], max_rows))
        out[e] = (rows, expert_mlp_float64(batch.x[rows], problem.w13[e], problem.w2[e]))
    return out


def accuracy(output: torch.Tensor, refs: dict) -> float:
    num = sum(float((output[rows].double() - ref).abs().sum()) for rows, ref in refs.values())
    den = sum(float(ref.abs().sum()) for _, ref in refs.values())
    return num / den if den else float("nan")


# ------------------------------------------------------------------------------- run


def precision_of(label: str) -> str:
    if "int8" in label:
        return "int8"
    if "fp8" in label:
        return "fp8"
    return "bf16"


def run_case(label: str, m: int, stages: dict, timer, refs: dict, rows: Callable = lambda out: out) -> Case:
    """Times every stage of ``stages``; the accuracy of ``rows(total's output)`` against ``refs``."""
    case = Case(label, m, precision_of(label))
    graph = m <= GRAPH_MAX_M
    try:
        case.accuracy = accuracy(rows(stages["total"]()), refs)
        for name, fn in stages.items():
            case.ms[name] = timer(fn, graph)
    except Exception as exc:  # one failing backend must not end the run
        case.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        traceback.print_exc(file=sys.stderr)
    return case


def time_in_turns(cases: list[Case], passes: dict[str, Callable], rounds: int, timer) -> None:
    """Times the whole pass of every case without an error again, the backends taking turns for
    ``rounds`` rounds; stores the median as ``ms["total_turns"]``. The first timings run each
    backend once after the other, so a later one meets a GPU heated by the earlier ones. A backend
    that fails here gets no turns time (the traceback goes to stderr); the others go on."""
    ok = {c.backend: passes[c.backend] for c in cases if not c.error and c.backend in passes}
    if not ok or rounds < 1:
        return
    graph = cases[0].m <= GRAPH_MAX_M
    failed: set[Callable] = set()

    def measure(fn: Callable) -> float:
        if fn in failed:
            return math.nan
        try:
            return timer(fn, graph)
        except Exception:  # one failing backend must not end the run
            traceback.print_exc(file=sys.stderr)
            failed.add(fn)
            return math.nan

    samples = in_turns(ok, rounds, measure)
    for c in cases:
        if c.backend in ok and ok[c.backend] not in failed:
            c.ms["total_turns"] = statistics.median(samples[c.backend])


def derive(case: Case, problem: Problem, ceilings: dict, baseline: Case | None) -> dict:
    """TOPS, floor and peak fractions and the speed-up over BF16 of one case."""
    rows = case.m * problem.e
    wbytes = 1 if case.precision in ("int8", "fp8") else 2
    measured_peak = ceilings.get("int8_int_mm_TOPS") if wbytes == 1 else ceilings.get("bf16_matmul_TFLOPs")
    d = {}
    total_flops = total_floor = 0.0
    for gemm, (n, k) in problem.gemm_shapes().items():
        flops = 2.0 * rows * n * k
        floor_ms = problem.e * n * k * wbytes / (ceilings["copy_GBps"] * 1e6)
        total_flops += flops
        total_floor += floor_ms
        ms = case.ms.get(gemm)
        if ms:
            d[gemm] = {
                "ms": ms,
                "TOPS": flops / ms / 1e9,
                "floor_ms": floor_ms,
                "frac_floor": floor_ms / ms,
                "frac_peak_measured": flops / ms / 1e9 / measured_peak if measured_peak else None,
                "frac_peak_datasheet": flops / ms / 1e9 / DATASHEET[case.precision],
                "speedup_vs_bf16": baseline.ms[gemm] / ms if baseline and baseline.ms.get(gemm) else None,
            }
    if case.ms.get("pass_q"):
        d["pass_q"] = {"ms": case.ms["pass_q"], "frac_floor": total_floor / case.ms["pass_q"]}
    ms = case.ms.get("total")
    if ms:
        d["total"] = {
            "ms": ms,
            "TOPS": total_flops / ms / 1e9,
            "floor_ms": total_floor,
            "frac_floor": total_floor / ms,
            "speedup_vs_bf16": baseline.ms["total"] / ms if baseline and baseline.ms.get("total") else None,
        }
    ms = case.ms.get("total_turns")
    if ms:
        base = baseline.ms.get("total_turns") if baseline else None
        d["total_turns"] = {"ms": ms, "speedup_vs_bf16": base / ms if base else None}
    return d


def fmt(v, spec=".3f") -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def table(results: list[dict]) -> str:
    head = (
        f"{'m':>5} {'backend':<28} {'g1 ms':>7} {'g1 TOPS':>7} {'g1 flr':>6} {'g1 pk':>5} {'g1 ds':>5} "
        f"{'act ms':>6} {'g2 ms':>7} {'g2 TOPS':>7} {'g2 flr':>6} {'g2 pk':>5} {'g2 ds':>5} "
        f"{'tot ms':>7} {'flr':>5} {'xBF16':>5} {'q-in ms':>7} {'flr':>5} {'turns':>7} {'xBF16':>5} "
        f"{'err':>8}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        d = r["derived"]
        g1, g2, tot = d.get("gemm1", {}), d.get("gemm2", {}), d.get("total", {})
        if r["error"]:
            lines.append(f"{r['m']:>5} {r['backend']:<28} ERROR {r['error'][:90]}")
            continue
        lines.append(
            f"{r['m']:>5} {r['backend']:<28} {fmt(g1.get('ms'))!s:>7} {fmt(g1.get('TOPS'), '.0f'):>7} "
            f"{fmt(g1.get('frac_floor'), '.2f'):>6} {fmt(g1.get('frac_peak_measured'), '.2f'):>5} "
            f"{fmt(g1.get('frac_peak_datasheet'), '.2f'):>5} {fmt(r['ms'].get('act')):>6} "
            f"{fmt(g2.get('ms')):>7} {fmt(g2.get('TOPS'), '.0f'):>7} {fmt(g2.get('frac_floor'), '.2f'):>6} "
            f"{fmt(g2.get('frac_peak_measured'), '.2f'):>5} {fmt(g2.get('frac_peak_datasheet'), '.2f'):>5} "
            f"{fmt(tot.get('ms')):>7} {fmt(tot.get('frac_floor'), '.2f'):>5} "
            f"{fmt(tot.get('speedup_vs_bf16'), '.2f'):>5} {fmt(d.get('pass_q', {}).get('ms')):>7} "
            f"{fmt(d.get('pass_q', {}).get('frac_floor'), '.2f'):>5} "
            f"{fmt(d.get('total_turns', {}).get('ms')):>7} "
            f"{fmt(d.get('total_turns', {}).get('speedup_vs_bf16'), '.2f'):>5} {fmt(r['accuracy'], '.2e'):>8}"
        )
    legend = (
        "flr: memory floor (weight bytes / copy bandwidth) / time; pk: fraction of the measured "
        "ceiling (int8 _int_mm or bf16 matmul); ds: of the datasheet peak (1979 int8 / 989 bf16); "
        "xBF16: whole-pass speed-up over torch_bf16; q-in: the pass from INT8 activations (GEMM1, "
        "activation, GEMM2: as after an INT8 dispatch); turns: the whole pass timed again with the "
        "backends taking turns (--turns), and its speed-up over torch_bf16; err: rel. mean abs error "
        "vs float64 (unquantized weights)."
    )
    return "\n".join(lines + [legend])


def plot(results: list[dict], path: str) -> None:
    from .plotting import pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for backend in dict.fromkeys(r["backend"] for r in results):
        rs = [r for r in results if r["backend"] == backend and "total" in r["derived"]]
        if not rs:
            continue
        ms = [r["m"] for r in rs]
        axes[0].plot(ms, [r["derived"]["total"]["ms"] for r in rs], marker="o", label=backend)
        axes[1].plot(ms, [r["derived"]["total"]["TOPS"] for r in rs], marker="o", label=backend)
    for ax, ylabel in zip(axes, ("whole pass ms", "effective TOPS")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("rows per expert m")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


TORCH_EXPERTS = "epmoe.experts.torch_backend:TorchBackend"


def cpu_backends(backends: list[str], extra: list[str]) -> tuple[list[str], list[str]]:
    """The rows a CPU run times: each ``triton_<scheme>`` row runs on the torch experts backend
    (``--extra`` of that scheme, labelled ``torch_<scheme>``), because Triton's CPU interpreter is
    for the library's tests, not for users; ``triton_bf16`` is left out (``torch_bf16`` is the
    BF16 pass). Says so on stdout: no row is swapped silently."""
    triton = [b for b in backends if b.startswith("triton_")]
    swapped = [f"{TORCH_EXPERTS}@{b.removeprefix('triton_')}" for b in triton if b != "triton_bf16"]
    print("no CUDA device: timing on CPU (numbers are not meaningful)" + (
        f"; {', '.join(triton)} run on the torch experts backend instead (Triton kernels need a GPU)"
        if triton else ""))  # fmt: skip
    return [b for b in backends if b not in triton], [*extra, *swapped]


def main(argv: list[str] | None = None) -> int:
    return run(parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """The benchmark for parsed (and checked) options; 0, or 1 when a backend failed."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    if device.type == "cpu":
        # fp32 temporaries of the weights and of the largest batch: the DeepSeek-V3 defaults need
        # ~30 GB, which a CPU machine runs out of long before any number means anything.
        need = 4 * args.experts * args.hidden * (3 * args.intermediate + max(args.m))
        if need > CPU_MAX_BYTES:
            print(
                f"epmoe bench experts: no CUDA device, and --experts {args.experts} --hidden {args.hidden} "
                f"--intermediate {args.intermediate} --m {max(args.m)} need ~{need / 2**30:.0f} GiB on the CPU "
                f"(limit {CPU_MAX_BYTES / 2**30:.0f} GiB); pass small sizes for a smoke run, e.g. "
                "--experts 4 --hidden 256 --intermediate 128 --m 8",
                file=sys.stderr,
            )
            return 2
        backends, extra = cpu_backends(args.backends, args.extra)
    else:
        backends, extra = args.backends, args.extra
    t_start = time.time()
    timer = make_timer(device, args.rep_ms)
    ceilings = measure_ceilings(device, args.ceiling_size, timer)
    print("ceilings:", {k: (round(v, 1) if isinstance(v, float) else v) for k, v in ceilings.items()}, flush=True)
    problem = build_problem(args.experts, args.hidden, args.intermediate, device, dtype)
    extras = []
    for spec in extra:
        try:
            extras.append(load_extra(spec))
        except Exception as exc:
            print(f"--extra {spec}: cannot load ({type(exc).__name__}: {exc})", file=sys.stderr)
    results = []
    for i, m in enumerate(args.m):
        batch = uniform_batch(problem, m, device, dtype, seed=1000 + i)
        refs = reference_rows(problem, batch, args.accuracy_experts)
        masked = masked_batch(problem, batch, m) if args.masked else None  # one for every backend
        cases, passes = [], {}
        for name in backends:
            print(f"m={m} {name} ...", flush=True)
            if name == "torch_bf16":
                try:
                    stages = torch_bf16_stages(problem, batch)
                except Exception as exc:
                    cases.append(Case(name, m, "bf16", error=f"{type(exc).__name__}: {exc}"))
                    continue
            else:
                scheme = name.removeprefix("triton_").removesuffix("_int32")
                try:
                    stages, _ = triton_stages(problem, batch, scheme, "int32" if name.endswith("_int32") else "fp32")
                except Exception as exc:
                    traceback.print_exc(file=sys.stderr)
                    cases.append(Case(name, m, precision_of(name), error=f"{type(exc).__name__}: {exc}"))
                    continue
            cases.append(run_case(name, m, stages, timer, refs))
            if args.turns:  # else let each backend's buffers go before the next one runs
                passes[name] = stages["total"]
            if args.masked and name != "torch_bf16":
                add_masked(name, triton_backend(name), m, problem, masked, refs, timer, cases, passes if args.turns else None)
        for label, backend in extras:
            print(f"m={m} {label} ...", flush=True)
            try:
                total, own_refs = backend_pass(problem, backend, m, batch, refs, 1000 + i, args.accuracy_experts)
                cases.append(run_case(label, m, {"total": total}, timer, own_refs))
                if args.turns:
                    passes[label] = total
            except Exception as exc:
                cases.append(Case(label, m, precision_of(label), error=f"{type(exc).__name__}: {exc}"))
            if args.masked and "masked" in backend.layouts:
                add_masked(label, backend, m, problem, masked, refs, timer, cases, passes if args.turns else None)
        if args.turns:
            print(f"m={m} whole passes in turns ({args.turns} rounds) ...", flush=True)
            time_in_turns(cases, passes, args.turns, timer)
        del passes
        baseline = next((c for c in cases if c.backend == "torch_bf16" and not c.error), None)
        for c in cases:
            results.append({
                "backend": c.backend, "m": m, "precision": c.precision, "ms": c.ms, "error": c.error,
                "accuracy": c.accuracy, "derived": derive(c, problem, ceilings, baseline),
            })
        del batch, refs, masked
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "triton": _triton_version(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "shapes": {"experts": args.experts, "hidden": args.hidden, "intermediate": args.intermediate},
        "ceilings": ceilings,
        "datasheet_peaks": DATASHEET,
        "results": results,
        "seconds": round(time.time() - t_start, 1),
    }
    print()
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        plot(results, args.plot)
    return 1 if any(r["error"] for r in results) else 0


def _triton_version() -> str | None:
    try:
        import triton

        return triton.__version__
    except ImportError:
        return None


if __name__ == "__main__":
    raise SystemExit(main())
