"""Code that runs inside each rank of the multi-process EP tests (gloo on CPU, NCCL on GPUs).

Every rank builds the same global weights, keeps its experts, runs each routing case on its own
tokens and compares its output with a single-process float64 reference over all experts.
"""

from __future__ import annotations

import json
import os
import time
import traceback

import torch
import torch.distributed as dist

import interpreter_patches

from cases import CASE_NAMES, make_case
from epmoe.launch import init_process_group
from epmoe.layer import DeepEPMoELayer
from epmoe.quant import get_scheme
from helpers import SCHEME_NAMES, RankRows, make_weights
from reference import moe_reference, rel_err

# Spawned ranks do not run conftest.py: the Triton-interpreter fixes the CPU tests rely on are
# applied here too (no effect on compiled kernels).
interpreter_patches.apply()

E, K, H, I = 16, 4, 256, 128


def init(rank: int, world: int, port: int, device_type: str) -> torch.device:
    return init_process_group(rank, world, port, device_type, timeout_s=120)


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


def suite_plan(schemes=SCHEME_NAMES, dispatch="all_to_all", backend="torch", cases=CASE_NAMES, shape=(E, K, H, I)):
    """One part of a :func:`run_suite` launch: every (scheme, case) on a layer of ``shape``
    (experts, top-k, hidden, intermediate) built with ``dispatch`` and ``backend``."""
    return dict(schemes=tuple(schemes), dispatch=dispatch, backend=backend, cases=tuple(cases), shape=tuple(shape))


def run_suite(rank, world, port, device_type, plans, out_path):
    """Runs every :func:`suite_plan` (or :func:`count_plan`) of ``plans`` in one process group
    (spawning ranks costs more than a tiny case on a small CPU); writes one JSON line per result, tagged with its plan's
    index, to ``out_path.<rank>`` (:class:`~helpers.RankRows`)."""
    device = init(rank, world, port, device_type)
    dtype = torch.float32 if device_type == "cpu" else torch.bfloat16
    results = RankRows(out_path, rank)
    try:
        for index, plan in enumerate(plans):
            if plan.get("kind") == "collective_count":
                results.emit(dict(plan=index, **count_collectives(rank)))
                continue
            experts, top_k, hidden, inter = plan["shape"]
            backend = plan["backend"]
            for scheme in plan["schemes"]:
                layer = DeepEPMoELayer(
                    experts, top_k, hidden, inter, quant=scheme, backend=backend, dispatch=plan["dispatch"],
                    device=device, params_dtype=dtype, timeout_s=60,
                )  # fmt: skip
                stored, (w13, w2) = make_weights(experts, hidden, inter, scheme)
                layer.load_experts(*[None if t is None else t.to(device) for t in stored])
                _, (f13, f2) = make_weights(experts, hidden, inter, "bf16")
                for case in plan["cases"]:
                    x, ids, w = make_case(case, rank, experts, top_k, hidden)
                    xin = x.to(device, dtype)
                    out = layer(xin, topk_ids=ids.to(device), topk_weights=w.to(device))
                    row = dict(plan=index, scheme=scheme, case=case, tokens=x.shape[0],
                               backend=layer.backend.name, dispatch=layer.dispatcher.name,
                               shape_ok=tuple(out.shape) == tuple(x.shape) and out.dtype == dtype)  # fmt: skip
                    if x.shape[0]:
                        xr = xin.float().cpu()
                        row["err_emulated"] = rel_err(out.cpu(), moe_reference(xr, ids, w, w13, w2, scheme))
                        row["err_exact"] = rel_err(out.cpu(), moe_reference(xr, ids, w, f13, f2))
                        row["bound"] = get_scheme(scheme).rel_error_bound
                        row["tol_emulated"] = emulated_tolerance(scheme, dtype, layer.backend.name)
                    results.emit(row)
    except Exception:
        results.emit(dict(error=traceback.format_exc()))
        raise
    finally:
        results.close()
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
        # Stay in the group, silent, until rank 0 has timed out and written what it raised (a
        # fixed sleep long enough for that cost seconds of every run); at most 60 s.
        deadline = time.monotonic() + 60
        while not os.path.exists(out_path) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
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


def _raised(call) -> dict:
    """What ``call()`` raised: ``{raised, message, is_collective_error}`` (``raised`` None if nothing)."""
    import epmoe.dispatch as ed

    start = time.monotonic()
    try:
        call()
        out = dict(raised=None)
    except Exception as exc:  # noqa: BLE001 - the test inspects what was raised
        out = dict(raised=type(exc).__name__, message=str(exc),
                   is_collective_error=isinstance(exc, ed.CollectiveError),
                   is_mismatch=isinstance(exc, ed.RankMismatchError))  # fmt: skip
    out["seconds"] = time.monotonic() - start
    return out


# Fields of the layer's fingerprint, each built differently on rank 1 than on rank 0:
# (field, common kwargs, rank 0's kwargs, rank 1's kwargs).
MISMATCHES = [
    ("num_experts", {}, dict(num_experts=16), dict(num_experts=32)),
    ("hidden_size", {}, dict(hidden_size=256), dict(hidden_size=128)),
    ("intermediate_size", {}, dict(intermediate_size=128), dict(intermediate_size=256)),
    ("top_k", {}, dict(top_k=4), dict(top_k=2)),
    ("quant", {}, dict(quant="bf16"), dict(quant="int8_channel")),
    ("accumulator", dict(quant="int8_channel"), dict(accumulator="fp32"), dict(accumulator="int32")),
    ("params_dtype", {}, dict(params_dtype=torch.float32), dict(params_dtype=torch.bfloat16)),
    ("low_latency_payload", dict(quant="int8_channel"), dict(low_latency_int8_payload="float"),
     dict(low_latency_int8_payload="fp8_group")),
    ("max_tokens_per_rank", {}, dict(max_tokens_per_rank=128), dict(max_tokens_per_rank=64)),
    ("normal_max_tokens_per_rank", {}, {}, dict(normal_max_tokens_per_rank=64)),
]  # fmt: skip


def run_mismatch(rank, world, port, out_path, device_type="cpu"):
    """Two ranks built or called with arguments that must agree: every case raises on both ranks
    (and leaves the group usable: a matching batch afterwards is correct); ``-1`` ids over
    all-to-all. One JSON line per case in ``out_path.<rank>`` (:class:`~helpers.RankRows`)."""
    dev = init(rank, world, port, device_type)
    rows = RankRows(out_path, rank)

    def layer(**kw):
        args = dict(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I, dispatch="all_to_all",
                    backend="torch", device=dev, params_dtype=torch.float32, timeout_s=20)  # fmt: skip
        args.update(kw)
        return DeepEPMoELayer(**args)

    try:
        for field, common, kw0, kw1 in MISMATCHES:
            rows.emit(dict(case=field, **_raised(lambda: layer(**common, **(kw0 if rank == 0 else kw1)))))
        # Fields the CPU cannot build differently (one dispatcher runs here): the comparison itself.
        from epmoe.dispatch.collective import check_agreement

        for field in ("dispatch", "payload", "alignment"):
            fields = dict(num_experts="16", dispatch="all_to_all", payload="int8_token", alignment="1")
            fields[field] = {"dispatch": ("all_to_all", "deepep_auto"), "payload": ("int8_token", "float"),
                             "alignment": ("1", "128")}[field][rank]  # fmt: skip
            rows.emit(dict(case=field, **_raised(lambda: check_agreement(
                fields, what="DeepEPMoELayer arguments", group=None, device=dev,
                rank=rank, world=world, timeout_s=20))))  # fmt: skip
        # A meta-device layer does not communicate at build (rank 1 builds none; timeout_s=1).
        rows.emit(dict(case="meta_build", **_raised(
            lambda: layer(device="meta", timeout_s=1) if rank == 0 else None)))  # fmt: skip
        # Both ranks build on meta with different num_experts: nothing raised at build; the
        # comparison the first forward runs (once materialized) raises on both.
        meta = layer(device="meta", num_experts=16 * (rank + 1))
        rows.emit(dict(case="meta_deferred", agreed_at_build=meta._agreed, **_raised(lambda: meta._agree(dev))))

        # Per-batch header: the input dtype differs between the ranks (same width, other bits; and
        # another width), for a float payload and for an int8 payload (the combine brings back
        # each rank's own dtype).
        x, ids, w = (t.to(dev) for t in make_case("random", rank, E, K, H))
        xc, idc, wc = (t.cpu() for t in (x, ids, w))  # the float64 references run on the CPU
        for quant in ("bf16", "int8_channel"):
            lay = layer(quant=quant)
            stored, _ = make_weights(E, H, I, quant)
            lay.load_experts(*[None if t is None else t.to(dev) for t in stored])
            for dtypes in ((torch.float16, torch.bfloat16), (torch.float32, torch.bfloat16)):
                xin = x.to(dtypes[rank])
                rows.emit(dict(case=f"header_{quant}_{dtypes[0]}_{dtypes[1]}",
                                 **_raised(lambda: lay(xin, topk_ids=ids, topk_weights=w))))  # fmt: skip
            # The group is still in step: a batch that agrees runs and is right.
            _, (w13, w2) = make_weights(E, H, I, quant)
            out = lay(x, topk_ids=ids, topk_weights=w)
            ref = moe_reference(xc, idc, wc, w13, w2, quant)
            rows.emit(dict(case=f"after_header_{quant}", err=rel_err(out.cpu(), ref)))

        # -1 ids (padding): the slot contributes nothing; a token of only -1 slots gets zeros.
        stored, (w13, w2) = make_weights(E, H, I, "bf16")
        pad = ids.clone()
        pad[::3, 1] = -1
        pad[1::4] = -1
        keep = pad >= 0
        ref = moe_reference(xc, pad.clamp(min=0).cpu(), (w * keep).cpu(), w13, w2, "bf16")
        for validate in (True, False):
            lay = layer(validate=validate)
            lay.load_experts(*[None if t is None else t.to(dev) for t in stored])
            out = lay(x, topk_ids=pad, topk_weights=w).cpu()
            rows.emit(dict(case=f"pad_validate_{validate}", err=rel_err(out, ref),
                             zero_rows=bool((out[1::4] == 0).all())))  # fmt: skip
        bad = pad.clone()
        bad[0, 0] = -2  # on both ranks: validation refuses it before any collective
        lay = layer()
        rows.emit(dict(case="pad_minus_two", **_raised(lambda: lay(x, topk_ids=bad, topk_weights=w))))
    except Exception:
        rows.emit(dict(case="worker", error=traceback.format_exc()))
    rows.close()
    os._exit(0)


KILL_POINTS = ("DeepEPMoELayer arguments", "dispatch counts", "dispatch payload", "combine payload")


def run_dead_peers(rank, world, port, out_path):
    """Rank 0 and rank k (k = 1..4) form pair group k; rank k dies at collective k - 1 of
    :data:`KILL_POINTS` (the layer's build-time comparison, then the three collectives of a
    forward). Rank 0 must raise CollectiveError naming that collective each time, within
    timeout_s; each pair has its own gloo context, so one death leaves the other pairs intact."""
    init(rank, world, port, "cpu")
    groups = [dist.new_group([0, k]) for k in range(1, world)]
    timeout_s = 5.0

    def build(group):
        return DeepEPMoELayer(E, K, H, I, dispatch="all_to_all", backend="torch", device="cpu", group=group,
                              params_dtype=torch.float32, timeout_s=timeout_s)  # fmt: skip

    x, ids, w = make_case("random", 0, E, K, H)
    if rank > 0:
        point = rank - 1
        if point == 0:
            os._exit(0)  # before the build's comparison
        layer = build(groups[rank - 1])
        real, calls = dist.all_to_all_single, [0]

        def dying(*args, **kwargs):
            calls[0] += 1
            if calls[0] == point:
                os._exit(0)
            return real(*args, **kwargs)

        dist.all_to_all_single = dying
        layer(x, topk_ids=ids, topk_weights=w)
        time.sleep(60)  # never reached: the peer died above
        os._exit(1)
    rows = []
    for k, what in enumerate(KILL_POINTS):

        def case(g=groups[k]):
            layer = build(g)
            layer(x, topk_ids=ids, topk_weights=w)

        rows.append(dict(collective=what, timeout_s=timeout_s, **_raised(case)))
    with open(out_path, "w") as f:
        json.dump(rows, f)
    os._exit(0)


COLLECTIVES = ("all_gather", "all_gather_into_tensor", "all_reduce", "all_to_all", "all_to_all_single",
               "broadcast", "barrier", "send", "recv", "isend", "irecv", "gather", "scatter", "reduce")  # fmt: skip


def count_plan() -> dict:
    """A part of a :func:`run_suite` launch that runs :func:`count_collectives` (its one row per
    rank: the calls of each step), so that it shares the launch of the ranks with a suite."""
    return dict(kind="collective_count")


def count_collectives(rank) -> dict:
    """Counts the torch.distributed calls of building a layer and of each of three forwards
    (all_to_all dispatch, default group): the argument comparison must cost one collective at build
    and nothing per batch (issue 22's acceptance: the fingerprint adds nothing per forward).
    torch.distributed's functions are restored afterwards."""
    calls: list[str] = []
    saved = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

    def counting(name, fn):
        def call(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)

        return call

    for name, fn in saved.items():
        setattr(dist, name, counting(name, fn))
    try:
        layer = DeepEPMoELayer(E, K, H, I, dispatch="all_to_all", backend="torch", device="cpu",
                               params_dtype=torch.float32, timeout_s=60)  # fmt: skip
        stored, _ = make_weights(E, H, I, "bf16")
        layer.load_experts(*[None if t is None else t.float() for t in stored])
        per_call = {"build": list(calls)}
        for i, case in enumerate(("random", "random", "one_expert")):
            calls.clear()
            x, ids, w = make_case(case, rank, E, K, H)
            layer(x, topk_ids=ids, topk_weights=w)
            per_call[f"forward {i}"] = list(calls)
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
    return per_call
