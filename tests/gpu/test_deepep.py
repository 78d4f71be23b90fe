"""DeepEP dispatch on ``EPMOE_TEST_GPUS`` GPUs (default two): every (dispatch x scheme x backend) against a float64 reference,
CUDA-graph capture and replay in low-latency mode, and auto mode over the capacity.

Skipped unless ``deep_ep`` imports and that many CUDA GPUs are present. All checks share one launch of
the ranks (tests/gpu/deepep_worker.py) because a DeepEP buffer and NVSHMEM are set up once per
process; each test below reads its part of the results.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from helpers import deepep_gpu_marks, gpu_world_size, read_rank_rows  # noqa: E402

WORLD = gpu_world_size()
pytestmark = deepep_gpu_marks(WORLD)

DISPATCHES = ("deepep_normal", "deepep_normal+bound", "deepep_low_latency", "deepep_auto")
SCHEMES = ("bf16", "int8_channel", "int8_block", "fp8_block")
BACKENDS = ("auto", "torch")
DEADLINE_S = 230.0


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    import deepep_worker
    from epmoe.launch import RankError, run_ranks

    out = str(tmp_path_factory.mktemp("deepep") / "res")
    failure = None
    try:
        run_ranks(deepep_worker.run_all, WORLD, DISPATCHES, SCHEMES, BACKENDS, out, timeout_s=DEADLINE_S)
    except TimeoutError:
        failure = f"the DeepEP workers did not finish within {DEADLINE_S:.0f} s"
    except RankError as exc:  # a rank exited with an error; rows tell which
        failure = f"a DeepEP worker failed: {exc}"
    rows = read_rank_rows(out, WORLD)
    errors = [r["error"] for r in rows if r.get("kind") == "error"]
    return dict(rows=rows, failure=failure, errors=errors)


def _no_errors(res):
    assert not res["errors"], "\n".join(res["errors"])
    assert res["failure"] is None, res["failure"]


def test_every_combination_matches_reference(results):
    _no_errors(results)
    rows = [r for r in results["rows"] if r.get("kind") == "case"]
    ran = [r for r in rows if "skipped" not in r]
    skipped = {(r["dispatch"], r["scheme"], r["backend_req"]): r["skipped"] for r in rows if "skipped" in r}
    for key, reason in sorted(skipped.items()):
        print("skipped", key, reason)
    assert ran, "no combination ran"
    bad = []
    for r in ran:
        name, _, bound = r["dispatch"].partition("+")
        ok = r["shape_ok"] and r["finite"] and r["dispatcher"] == name and bool(r["normal_bound"]) == bool(bound)
        if r["tokens"]:
            ok = ok and r["err_emulated"] < r["tol_emulated"] and r["err_exact"] < r["bound"]
        if not ok:
            bad.append(r)
    print(f"{len(ran)} rows ran, {len(bad)} failed")
    # Every failing row, not only the first: one GPU run has to tell the whole story.
    assert not bad, "\n".join(map(str, bad))
    # Both ranks ran every combination that was not skipped, including the zero-token case.
    for dispatch in DISPATCHES:
        assert any(r["dispatch"] == dispatch for r in ran), f"{dispatch} never ran: {skipped}"
        assert any(
            r["dispatch"] == dispatch and r["case"] == "no_tokens" and r["tokens"] == 0 for r in ran
        )
    assert {r["rank"] for r in ran} == set(range(WORLD))
    print(sorted({(r["dispatch"], r["scheme"], r["backend"], r["payload"]) for r in ran}))


def test_low_latency_cuda_graph_replay(results):
    _no_errors(results)
    rows = [r for r in results["rows"] if r.get("kind") == "graph"]
    assert {r["rank"] for r in rows} == set(range(WORLD)), rows
    for r in rows:
        assert len(r["replays"]) == 2
        for rep in r["replays"]:
            assert rep["replay_vs_eager"] < 1e-3, r
            assert rep["err_emulated"] < rep["tol_emulated"], r
            assert rep["err_exact"] < rep["bound"], r


def test_auto_over_capacity_runs_normal_and_logs_once(results):
    _no_errors(results)
    rows = [r for r in results["rows"] if r.get("kind") == "auto_over_capacity"]
    assert {r["rank"] for r in rows} == set(range(WORLD)), rows
    for r in rows:
        modes = [b["mode"] for b in r["batches"]]
        # Rank 0 was over the capacity in the first two batches: every rank ran normal mode.
        assert modes == ["normal", "normal", "low_latency", "low_latency"], r
        assert r["over_capacity_logs"] == 1, r
        for b in r["batches"]:
            assert b["shape_ok"], r
            if b["tokens"]:
                assert b["err_emulated"] < b["tol_emulated"], r
                assert b["err_exact"] < b["bound"], r


def test_normal_mode_refuses_capture_and_recovers(results):
    _no_errors(results)
    rows = [r for r in results["rows"] if r.get("kind") == "normal_capture"]
    assert {r["rank"] for r in rows} == set(range(WORLD)), rows
    for r in rows:
        assert r["messages"] and "deepep_normal is not CUDA-graph capturable" in r["messages"][0], r
        assert r["err_emulated"] < r["tol_emulated"] and r["err_exact"] < r["bound"], r
