"""Code that runs inside each rank of tests/gpu/test_deepep_compile.py (NCCL, one GPU per rank).

First, each DeepEP custom op's fake implementation against real DeepEP (shapes, dtypes, strides).
Then a decode step of a decoder block (attention stand-in, fp32 router, routed experts in a
``DeepEPMoELayer``, one shared expert) on ``deepep_low_latency``, per scheme:

1. eager, on four batches;
2. ``torch._dynamo.explain``: graphs and graph breaks;
3. ``torch.compile(fullgraph=True)`` (Inductor) on the same batches, against eager;
4. a manual ``torch.cuda.CUDAGraph`` of the eager step, replayed with new tokens, against eager;
5. the same of the compiled step;
6. ``torch.compile(mode="reduce-overhead")``: warm-up, record, replay, against eager, and whether
   Inductor skipped its CUDA graph;

and the same block on ``deepep_normal`` with ``normal_max_tokens_per_rank`` (bounded: no host
sync): explain and ``fullgraph=True`` against eager (no capture: that mode refuses it).

Every rank runs the same sequence of DeepEP calls (their batch sizes differ), so the peers'
low-latency kernels always meet. Each result is one JSON line in ``out_path.<rank>``.
"""

from __future__ import annotations

import os
import sys
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/ (helpers, reference)
sys.path.insert(1, os.path.dirname(os.path.dirname(HERE)))  # the repository (benchmarks/)

from helpers import RankRows, make_weights  # noqa: E402
from reference import rel_err  # noqa: E402

from epmoe.dispatch.deepep_dispatch import DeepEPBuffer  # noqa: E402
from epmoe.dispatch.deepep_dispatch.sizing import BufferNeeds  # noqa: E402
from epmoe.layer import DeepEPMoELayer  # noqa: E402

E, K, H, I, SHARED = 16, 4, 2048, 256, 256
CAP = 16  # low-latency capacity and the normal-mode bound, tokens per rank


class Block(nn.Module):
    """Pre-norm attention stand-in and MoE block (routed experts + one shared expert), residuals."""

    def __init__(self, scheme, dispatch, buf, device, **layer_kwargs):
        super().__init__()
        kw = dict(device=device, dtype=torch.bfloat16)
        self.norm1, self.norm2 = nn.RMSNorm(H, **kw), nn.RMSNorm(H, **kw)
        self.q_proj, self.o_proj = nn.Linear(H, H, bias=False, **kw), nn.Linear(H, H, bias=False, **kw)
        self.gate = nn.Linear(H, E, bias=False, device=device)
        self.experts = DeepEPMoELayer(E, K, H, I, quant=scheme, dispatch=dispatch, device=device,
                                      params_dtype=torch.bfloat16, deepep_buffer=buf, timeout_s=60,
                                      **layer_kwargs)  # fmt: skip
        self.shared_gate_up = nn.Linear(H, 2 * SHARED, bias=False, **kw)
        self.shared_down = nn.Linear(SHARED, H, bias=False, **kw)

    def forward(self, x):
        h = x + self.o_proj(F.silu(self.q_proj(self.norm1(x))))
        y = self.norm2(h)
        gate, up = self.shared_gate_up(y).chunk(2, dim=-1)
        return h + self.experts(y, self.gate(y.float())) + self.shared_down(F.silu(gate) * up)


@torch.no_grad()
def _block(scheme, dispatch, buf, device, **layer_kwargs):
    torch.manual_seed(0)  # the same dense weights on every rank
    block = Block(scheme, dispatch, buf, device, **layer_kwargs).eval()
    # Well separated router logits: a bf16 rounding that Inductor fuses differently from eager must
    # not flip a token's top-k choice (a different computation, not an error).
    block.gate.weight.mul_(30)
    stored, _ = make_weights(E, H, I, scheme)
    block.experts.load_experts(*[None if t is None else t.to(device) for t in stored])
    return block


def _x(t, seed, rank, device):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(t, H, generator=g).to(device, torch.bfloat16)


def _captured(fn, device):
    """``fn`` captured in a CUDA graph after two warm-up calls on a side stream, the ranks side by
    side before the replays."""
    from benchmarks.compile_decode import captured

    graph, out = captured(fn, device)
    torch.cuda.synchronize()
    dist.barrier()
    return graph, out


def _replays(graph, out, static, xs, eager):
    errs = []
    for x, ref in zip(xs, eager):
        static.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        errs.append(rel_err(out.float().cpu(), ref.float().cpu()))
    return errs


def _explain(block, x):
    torch._dynamo.reset()
    e = torch._dynamo.explain(block)(x)
    torch._dynamo.reset()
    reasons = [str(b.reason)[:300] for b in e.break_reasons]
    return dict(graphs=e.graph_count, breaks=e.graph_break_count, reasons=reasons)


@torch.no_grad()
def _fake_matches_real(buf, device, rank):
    """Each DeepEP op's fake implementation against what real DeepEP returns (shapes, dtypes,
    strides: opcheck's fake-tensor check, one real call per op on every rank alike)."""
    from epmoe import ops

    t = 8 if rank == 0 else 3
    g = torch.Generator().manual_seed(60 + rank)
    x = torch.randn(t, H, generator=g).to(device, torch.bfloat16)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(t)]).to(device)
    w = torch.rand(t, K, generator=g).to(device)
    q8 = torch.randint(-127, 128, (t, H), generator=g, dtype=torch.int8).to(device)
    q8_scale = (torch.rand(t, H // 128, generator=g) + 0.1).to(device)
    n, world, worst = buf.plan.ll_max_tokens, dist.get_world_size(), dist.get_world_size() * CAP
    channels, e_loc = buf.normal_channels, E // world
    y_normal = torch.randn(worst, H, generator=g).to(device, torch.bfloat16)
    y_ll = torch.randn(e_loc, world * n, H, generator=g).to(device, torch.bfloat16)
    ll, nd = ops._deepep_low_latency_dispatch.op, ops._deepep_normal_dispatch.op
    # Each combine takes the handle of the dispatch just before it (a real call on every rank).
    cases = [
        ("deepep_normal_dispatch", nd, lambda: (buf.id, q8, q8_scale, ids, w, E, 1, worst, world, channels)),
        ("deepep_normal_dispatch[bf16]", nd, lambda: (buf.id, x, None, ids, w, E, 1, worst, world, channels)),
        ("deepep_normal_combine", ops._deepep_normal_combine.op, lambda: (
            buf.id, y_normal, nd(buf.id, q8, q8_scale, ids, w, E, 1, worst, world, channels)[4:])),
        ("deepep_low_latency_dispatch", ll, lambda: (buf.id, x, ids, n, E, world, False)),
        ("deepep_low_latency_dispatch[fp8]", ll, lambda: (buf.id, x, ids, n, E, world, True)),
        ("deepep_low_latency_combine", ops._deepep_low_latency_combine.op, lambda: (
            buf.id, y_ll, ids, w, *ll(buf.id, x, ids, n, E, world, False)[2:], n, E)),
    ]  # fmt: skip
    out = {}
    for name, op, args in cases:  # the same order on every rank: each runs DeepEP the same times
        try:
            torch.library.opcheck(op, args(), test_utils=("test_faketensor",))
            out[name] = "ok"
        except Exception as exc:  # noqa: BLE001 - recorded, and the next op still runs on every rank
            out[name] = f"{type(exc).__name__}: {exc}"[:800]
        torch.cuda.synchronize()
    return out


def _eager_and_compiled(block, xs, t):
    """``block`` eagerly and compiled (fullgraph) on ``xs``: the eager outputs, the compiled block
    and the row with what both checks saw."""
    eager = [block(x).clone() for x in xs]
    torch.cuda.synchronize()
    row = dict(backend=block.experts.backend.name, dispatcher=block.experts.dispatcher.name, tokens=t,
               finite=all(bool(torch.isfinite(e).all()) for e in eager), explain=_explain(block, xs[0]))  # fmt: skip
    compiled = torch.compile(block, fullgraph=True, dynamic=False)
    row["compiled_vs_eager"] = [rel_err(compiled(x).float().cpu(), e.float().cpu()) for x, e in zip(xs, eager)]
    return eager, compiled, row


@torch.no_grad()
def _low_latency(scheme, buf, device, rank):
    block = _block(scheme, "deepep_low_latency", buf, device, max_tokens_per_rank=CAP)
    t = 8 if rank == 0 else 3  # different static batch sizes per rank
    xs = [_x(t, s, rank, device) for s in range(4)]
    eager, compiled, row = _eager_and_compiled(block, xs, t)
    static = xs[0].clone()
    graph, out = _captured(lambda: block(static), device)
    row["graph_vs_eager"] = _replays(graph, out, static, xs[1:], eager[1:])
    del graph
    graph, out = _captured(lambda: compiled(static), device)
    row["compiled_graph_vs_eager"] = _replays(graph, out, static, xs[1:], eager[1:])
    del graph
    from torch._dynamo.utils import counters

    skips = counters["inductor"]["cudagraph_skips"]
    torch._dynamo.reset()
    fn = torch.compile(block, fullgraph=True, dynamic=False, mode="reduce-overhead")
    for x in xs[:3]:  # warm-up, record, replay
        fn(x)
    row["reduce_overhead_vs_eager"] = rel_err(fn(xs[3]).clone().float().cpu(), eager[3].float().cpu())
    row["reduce_overhead_skipped_cudagraph"] = counters["inductor"]["cudagraph_skips"] - skips
    torch.cuda.synchronize()
    torch._dynamo.reset()
    return row


@torch.no_grad()
def _normal_bounded(buf, device, rank):
    block = _block("bf16", "deepep_normal", buf, device, normal_max_tokens_per_rank=CAP)
    t = 12 if rank == 0 else 5
    xs = [_x(t, 10 + s, rank, device) for s in range(3)]
    _, _, row = _eager_and_compiled(block, xs, t)
    torch.cuda.synchronize()
    torch._dynamo.reset()
    return row


def run_compile(rank, world, port, schemes, out_path):
    from epmoe.launch import init_process_group

    device = init_process_group(rank, world, port, "cuda", timeout_s=120)
    torch._dynamo.config.recompile_limit = 64  # one compile per (block, batch size, mode)
    results = RankRows(out_path, rank)
    emit = results.emit

    buf = DeepEPBuffer()
    buf.register(BufferNeeds(H, E, K, CAP, frozenset({"normal", "low_latency"})), world)
    try:
        buf.get()  # allocated up front (a collective): the ops' fake implementations take its sizes
        emit(dict(kind="fake_vs_real", ops=_fake_matches_real(buf, device, rank)))
        dist.barrier()
        for scheme in schemes:
            emit(dict(kind="low_latency", scheme=scheme, **_low_latency(scheme, buf, device, rank)))
            dist.barrier()
        emit(dict(kind="normal_bounded", scheme="bf16", **_normal_bounded(buf, device, rank)))
        dist.barrier()
    except Exception:
        emit(dict(kind="error", error=traceback.format_exc()))
        results.close()
        os._exit(1)  # a peer may be stuck in a collective: do not wait for it
    buf.close()
    results.close()
    dist.barrier()
    dist.destroy_process_group()
