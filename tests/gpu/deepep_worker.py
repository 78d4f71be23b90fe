"""Code that runs inside each rank of the DeepEP GPU tests (NCCL, one GPU per rank).

One process per rank runs everything on one shared :class:`DeepEPBuffer` (registered for both
modes up front, so the buffer is allocated once and NVSHMEM initialized once):

1. every (dispatch x scheme x backend) over the routing cases of ``tests/cases.py`` (including a
   rank with zero tokens), compared with a float64 single-process reference over all experts;
2. CUDA-graph capture and replay of the layer in low-latency mode;
3. auto mode with one rank over the low-latency capacity (must go normal on all ranks, log once,
   and return to low-latency for the next batch that fits);
4. normal-mode dispatch refused under CUDA-graph capture, with the layer still correct after.

Low-latency mode takes only some hidden sizes, so the shapes here are H = 2048 (the smallest).
Each result is one JSON line in ``out_path.<rank>``, written as soon as it is known.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # tests/ (cases, helpers, reference)

from cases import CASE_NAMES, make_case  # noqa: E402
from helpers import RankRows, gpu_world_size, make_weights  # noqa: E402
from reference import moe_reference, rel_err  # noqa: E402

from epmoe.dispatch.deepep_dispatch import DeepEPBuffer  # noqa: E402
from epmoe.dispatch.deepep_dispatch.sizing import BufferNeeds  # noqa: E402
from epmoe.dispatch.select import DispatcherUnavailableError  # noqa: E402
from epmoe.experts.select import BackendUnavailableError  # noqa: E402
from epmoe.layer import DeepEPMoELayer  # noqa: E402
from epmoe.quant import get_scheme  # noqa: E402
from epmoe.routing import select_experts  # noqa: E402

E, K, H, I = 16, 4, 2048, 256


def _capacity(world: int) -> int:
    """Low-latency capacity: 64, or more where a routing case of some rank is larger (the random
    case grows with the rank: 43 tokens on rank 1, 79 on rank 7)."""
    return max(64, *(make_case(c, r, E, K, H)[0].shape[0] for c in CASE_NAMES for r in range(world)))


CAP = _capacity(gpu_world_size())
TOL_EMULATED = 1.5e-2  # bf16 outputs and bf16 round trips (as tests/ep_worker.py)
# FP8 backends keep GEMM1's output in bf16 before the e4m3 requantization: a 2^-9 nudge flips
# ~3% of the e4m3 codes (one 2^-4 step each), about 2% on the output.
TOL_EMULATED_FP8 = 3e-2


class _Counter(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _init(rank, world, port):
    from epmoe.launch import init_process_group

    return init_process_group(rank, world, port, "cuda", timeout_s=120)


def _layer(scheme, backend, dispatch, device, buf, weights):
    # "<dispatch>+bound": normal mode told every batch fits CAP, so the host does not wait for
    # DeepEP's receive counts (and the triton backend keeps the segment sizes on the device).
    dispatch, _, bound = dispatch.partition("+")
    layer = DeepEPMoELayer(
        E, K, H, I, quant=scheme, backend=backend, dispatch=dispatch, device=device,
        params_dtype=torch.bfloat16, timeout_s=60, max_tokens_per_rank=CAP, deepep_buffer=buf,
        normal_max_tokens_per_rank=CAP if bound else None,
    )  # fmt: skip
    stored, _ = weights[scheme]
    layer.load_experts(*[None if t is None else t.to(device) for t in stored])
    return layer


def _compare(out, x, ids, w, scheme, weights, exact):
    xr = x.float().cpu()
    _, (w13, w2) = weights[scheme]
    f13, f2 = exact
    return dict(
        err_emulated=rel_err(out.float().cpu(), moe_reference(xr, ids.cpu(), w.cpu(), w13, w2, scheme)),
        err_exact=rel_err(out.float().cpu(), moe_reference(xr, ids.cpu(), w.cpu(), f13, f2)),
        bound=get_scheme(scheme).rel_error_bound,
        tol_emulated=TOL_EMULATED_FP8 if scheme == "fp8_block" else TOL_EMULATED,
    )


def run_all(rank, world, port, dispatches, schemes, backends, out_path):
    if _capacity(world) > CAP:
        raise ValueError(f"{world} ranks need a low-latency capacity of {_capacity(world)}, this worker has "
                         f"{CAP}: launch it with EPMOE_TEST_GPUS={world}")  # fmt: skip
    device = _init(rank, world, port)
    results = RankRows(out_path, rank)
    emit = results.emit

    counter = _Counter()
    logging.getLogger("epmoe").addHandler(counter)
    buf = DeepEPBuffer()
    buf.register(BufferNeeds(H, E, K, CAP, frozenset({"normal", "low_latency"})), world)
    weights = {s: make_weights(E, H, I, s) for s in schemes}
    exact = make_weights(E, H, I, "bf16")[1]
    try:
        # CUDA-graph capture and replay in low-latency mode (first: it needs no other backend).
        for scheme in [s for s in ("bf16", "int8_channel") if s in schemes]:
            emit(dict(kind="graph", scheme=scheme, **_graph_test(scheme, device, buf, weights, exact, rank)))
        dist.barrier()
        # Auto mode with one rank over the capacity.
        emit(dict(kind="auto_over_capacity", **_auto_test(device, buf, weights, exact, rank, counter)))
        dist.barrier()
        emit(dict(kind="normal_capture", **_normal_capture_test(device, buf, weights, exact, rank)))
        dist.barrier()
    except Exception:
        emit(dict(kind="error", error=traceback.format_exc()))
        results.close()
        os._exit(1)  # a peer may be stuck in a collective: do not wait for it
    # Every combination over the routing cases. A deterministic failure (both ranks raise at the
    # same point) is recorded and the next combination runs; a one-sided one hangs the peer
    # until the test's deadline, and the rows written so far still count.
    for dispatch in dispatches:
        for scheme in schemes:
            for backend in backends:
                tag = dict(kind="case", dispatch=dispatch, scheme=scheme, backend_req=backend)
                try:
                    layer = _layer(scheme, backend, dispatch, device, buf, weights)
                except (BackendUnavailableError, DispatcherUnavailableError) as exc:
                    emit(dict(tag, skipped=str(exc)))
                    continue
                try:
                    for case in CASE_NAMES:
                        x, ids, w = make_case(case, rank, E, K, H)
                        xin = x.to(device, torch.bfloat16)
                        out = layer(xin, topk_ids=ids.to(device), topk_weights=w.to(device))
                        torch.cuda.synchronize()
                        row = dict(
                            tag, case=case, tokens=x.shape[0], backend=layer.backend.name,
                            dispatcher=layer.dispatcher.name, payload=layer.payload,
                            normal_bound=layer.dispatcher.cfg.normal_max_tokens_per_rank,
                            shape_ok=tuple(out.shape) == tuple(x.shape) and out.dtype == torch.bfloat16,
                            finite=bool(torch.isfinite(out).all()),
                        )  # fmt: skip
                        if x.shape[0]:
                            row.update(_compare(out, xin, ids, w, scheme, weights, exact))
                        emit(row)
                except Exception:
                    emit(dict(tag, kind="error", error=f"{tag}: " + traceback.format_exc()))
                del layer
    dist.barrier()
    buf.close()
    results.close()
    dist.barrier()
    dist.destroy_process_group()


def _batch(t, seed, rank):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    x = torch.randn(t, H, generator=g)
    ids, w = select_experts(torch.randn(t, E, generator=g) * 2, K, renormalize=True)
    return x, ids, w


def _graph_test(scheme, device, buf, weights, exact, rank):
    layer = _layer(scheme, "auto", "deepep_low_latency", device, buf, weights)
    t = 24 + 5 * rank  # different static batch sizes per rank
    x0, ids0, w0 = _batch(t, 10, rank)
    xs = x0.to(device, torch.bfloat16)
    ids_s, ws = ids0.to(device), w0.to(device)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # compile kernels, clean the low-latency buffer
            layer(xs, topk_ids=ids_s, topk_weights=ws)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    dist.barrier()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_s = layer(xs, topk_ids=ids_s, topk_weights=ws)
    torch.cuda.synchronize()
    dist.barrier()
    result = dict(backend=layer.backend.name, tokens=t, replays=[])
    for seed in (11, 12):
        x, ids, w = _batch(t, seed, rank)
        xs.copy_(x.to(device, torch.bfloat16))
        ids_s.copy_(ids.to(device))
        ws.copy_(w.to(device))
        graph.replay()
        torch.cuda.synchronize()
        replayed = out_s.clone()
        eager = layer(x.to(device, torch.bfloat16), topk_ids=ids.to(device), topk_weights=w.to(device))
        torch.cuda.synchronize()
        cmp = _compare(replayed, x.to(torch.bfloat16), ids, w, scheme, weights, exact)
        cmp["replay_vs_eager"] = rel_err(replayed.float().cpu(), eager.float().cpu())
        result["replays"].append(cmp)
    del graph
    return result


def _normal_capture_test(device, buf, weights, exact, rank):
    """deepep_normal's dispatch under capture raises its own error (after DeepEP's local layout
    kernel, before anything crosses ranks), and the layer runs correctly afterwards."""
    layer = _layer("bf16", "auto", "deepep_normal", device, buf, weights)
    x, ids, w = _batch(20 + rank, 30, rank)
    xin, ids_d, w_d = x.to(device, torch.bfloat16), ids.to(device), w.to(device)
    layer(xin, topk_ids=ids_d, topk_weights=w_d)  # compile, allocate
    torch.cuda.synchronize()
    messages = []
    try:
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            layer.dispatcher.dispatch(xin, ids_d, w_d)
    except Exception as exc:  # noqa: BLE001 - what the user sees, and what it wraps
        while exc is not None:
            messages.append(f"{type(exc).__name__}: {exc}")
            exc = exc.__context__
    torch.cuda.synchronize()
    dist.barrier()
    out = layer(xin, topk_ids=ids_d, topk_weights=w_d)
    torch.cuda.synchronize()
    return dict(messages=messages, **_compare(out, xin, ids, w, "bf16", weights, exact))


def _auto_test(device, buf, weights, exact, rank, counter):
    layer = _layer("bf16", "auto", "deepep_auto", device, buf, weights)
    before = len([m for m in counter.messages if "exceeds the low-latency capacity" in m])
    rows = []
    # rank 0 over the capacity twice, then a batch that fits everywhere, then a zero-token rank.
    plan = [(CAP + 17 if rank == 0 else 9), (CAP + 40 if rank == 0 else CAP), 30 + rank, (0 if rank == 1 else 12)]
    for i, t in enumerate(plan):
        x, ids, w = _batch(t, 20 + i, rank)
        xin = x.to(device, torch.bfloat16)
        stats_before = dict(layer.dispatcher.stats)
        out = layer(xin, topk_ids=ids.to(device), topk_weights=w.to(device))
        torch.cuda.synchronize()
        mode = [m for m in ("normal", "low_latency") if layer.dispatcher.stats[m] > stats_before[m]]
        row = dict(tokens=t, mode=mode[0] if mode else None, shape_ok=tuple(out.shape) == (t, H))
        if t:
            row.update(_compare(out, xin, ids, w, "bf16", weights, exact))
        rows.append(row)
    logged = len([m for m in counter.messages if "exceeds the low-latency capacity" in m]) - before
    return dict(batches=rows, over_capacity_logs=logged, backend=layer.backend.name)
