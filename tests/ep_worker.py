"""Code that runs inside each rank of the multi-process EP tests (gloo on CPU, NCCL on GPUs).

Every rank builds the same global weights, keeps its experts, runs each routing case on its own
tokens and compares its output with a single-process float64 reference over all experts.
"""

from __future__ import annotations

import datetime
import json
import os
import time
import traceback

import torch
import torch.distributed as dist

from cases import CASE_NAMES, make_case
from epmoe.layer import DeepEPMoELayer
from epmoe.quant import get_scheme
from helpers import make_weights
from reference import moe_reference, rel_err

E, K, H, I = 16, 4, 256, 128


def init(rank: int, world: int, port: int, device_type: str) -> torch.device:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    backend = "nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=120),
        **({"device_id": torch.device("cuda", rank)} if device_type == "cuda" else {}),
    )  # fmt: skip
    return torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")


def emulated_tolerance(scheme: str, dtype: torch.dtype, backend: str) -> float:
    """Bound on the layer's error against the reference with the same quantization points.

    bf16 outputs and bf16 return trips round at 2^-9 relative, fp32 at 2^-24. With bf16 params the
    FP8 GPU backends (deepgemm, cutlass) write GEMM1's output in bf16 before the e4m3
    requantization, and that rounding flips e4m3 codes of the intermediate (one code is 1/16
    relative): docs/fp8.md's layer bound, 3e-2, the one tests/gpu/test_fp8_backends.py uses.
    """
    if dtype == torch.float32:
        return 1e-3
    return 3e-2 if scheme == "fp8_block" and backend in ("deepgemm", "cutlass") else 1.5e-2


def run_suite(rank, world, port, device_type, schemes, dispatch, backend, out_path):
    """Runs every (scheme, case); writes one JSON line per result to ``out_path.<rank>``."""
    device = init(rank, world, port, device_type)
    results = []
    try:
        for scheme in schemes:
            dtype = torch.float32 if device_type == "cpu" else torch.bfloat16
            layer = DeepEPMoELayer(
                E, K, H, I, quant=scheme, backend=backend, dispatch=dispatch, device=device,
                params_dtype=dtype, timeout_s=60,
            )  # fmt: skip
            stored, (w13, w2) = make_weights(E, H, I, scheme)
            layer.load_experts(*[None if t is None else t.to(device) for t in stored])
            _, (f13, f2) = make_weights(E, H, I, "bf16")
            for case in CASE_NAMES:
                x, ids, w = make_case(case, rank, E, K, H)
                xin = x.to(device, dtype)
                out = layer(xin, topk_ids=ids.to(device), topk_weights=w.to(device))
                row = dict(rank=rank, scheme=scheme, case=case, tokens=x.shape[0],
                           backend=layer.backend.name, dispatch=layer.dispatcher.name,
                           shape_ok=tuple(out.shape) == tuple(x.shape) and out.dtype == dtype)  # fmt: skip
                if x.shape[0]:
                    xr = xin.float().cpu()
                    row["err_emulated"] = rel_err(out.cpu(), moe_reference(xr, ids, w, w13, w2, scheme))
                    row["err_exact"] = rel_err(out.cpu(), moe_reference(xr, ids, w, f13, f2))
                    row["bound"] = get_scheme(scheme).rel_error_bound
                    row["tol_emulated"] = emulated_tolerance(scheme, dtype, layer.backend.name)
                results.append(row)
    except Exception:
        results.append(dict(rank=rank, error=traceback.format_exc()))
        raise
    finally:
        with open(f"{out_path}.{rank}", "w") as f:
            for r in results:
                f.write(json.dumps(r) + "\n")
    dist.barrier()
    dist.destroy_process_group()


def run_dead_peer(rank, world, port, out_path):
    """Rank 1 dies right after joining: rank 0's collective fails with an error naming it."""
    device = init(rank, world, port, "cpu")
    layer = DeepEPMoELayer(E, K, H, I, dispatch="all_to_all", backend="torch", device=device,
                           params_dtype=torch.float32, timeout_s=20.0)  # fmt: skip
    dist.barrier()
    if rank == 1:
        os._exit(0)
    time.sleep(0.5)
    x, ids, w = make_case("random", rank, E, K, H)
    try:
        layer(x, topk_ids=ids, topk_weights=w)
        result = dict(raised=None)
    except Exception as exc:  # noqa: BLE001 - the test inspects what was raised
        import epmoe

        result = dict(raised=type(exc).__name__, message=str(exc),
                      is_collective_error=isinstance(exc, epmoe.CollectiveError))  # fmt: skip
    with open(out_path, "w") as f:
        json.dump(result, f)
    os._exit(0)


def run_timeout(rank, world, port, out_path):
    """Rank 1 never calls the layer: rank 0 must raise a timeout naming the collective."""
    device = init(rank, world, port, "cpu")
    layer = DeepEPMoELayer(E, K, H, I, dispatch="all_to_all", backend="torch", device=device,
                           params_dtype=torch.float32, timeout_s=2.0)  # fmt: skip
    if rank == 1:
        time.sleep(6)
        os._exit(0)
    start = time.monotonic()
    x, ids, w = make_case("random", rank, E, K, H)
    try:
        layer(x, topk_ids=ids, topk_weights=w)
        result = dict(raised=None)
    except Exception as exc:  # noqa: BLE001 - the test inspects what was raised
        result = dict(raised=type(exc).__name__, message=str(exc))
    result["seconds"] = time.monotonic() - start
    with open(out_path, "w") as f:
        json.dump(result, f)
    os._exit(0)
