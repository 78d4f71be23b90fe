"""torch.compile and CUDA graphs over DeepEP on ``EPMOE_TEST_GPUS`` GPUs (default two): a decode
step of a decoder block on ``deepep_low_latency`` compiled with ``fullgraph=True`` (Inductor), captured
by hand in a ``torch.cuda.CUDAGraph`` (eager and compiled), and compiled with
``mode="reduce-overhead"``, each against the eager step; and bounded ``deepep_normal`` compiled with
``fullgraph=True`` against eager. ``torch._dynamo.explain`` must count no graph break for either,
and every DeepEP op's fake implementation must give what real DeepEP gives (shapes, dtypes, strides).

Skipped unless ``deep_ep`` imports and that many CUDA GPUs are present. All checks share one launch
of the ranks (tests/gpu/deepep_compile_worker.py): a DeepEP buffer and NVSHMEM are set up once per
process. Run alone (NVSHMEM once per process, and the ranks need the GPUs to themselves):

    EPMOE_TEST_GPUS=2 python -m pytest -q -m multigpu tests/gpu/test_deepep_compile.py
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

SCHEMES = ("bf16", "int8_channel")
DEADLINE_S = 540.0  # five Inductor compiles per rank, in parallel
# The same kernels on the same data: a captured eager step replays what eager computes.
SAME = 1e-3
# Inductor fuses the dense bf16 parts (norms, residuals, the shared expert) differently from eager.
FUSED = 2e-2


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    import deepep_compile_worker
    from epmoe.launch import RankError, run_ranks

    out = str(tmp_path_factory.mktemp("deepep_compile") / "res")
    failure = None
    try:
        run_ranks(deepep_compile_worker.run_compile, WORLD, SCHEMES, out, timeout_s=DEADLINE_S)
    except TimeoutError:
        failure = f"the workers did not finish within {DEADLINE_S:.0f} s"
    except RankError as exc:
        failure = f"a worker failed: {exc}"
    rows = read_rank_rows(out, WORLD)
    for row in rows:  # one GPU run has to tell the whole story
        print(row)
    return dict(rows=rows, failure=failure, errors=[r["error"] for r in rows if r.get("kind") == "error"])


def _rows(res, kind):
    assert not res["errors"], "\n".join(res["errors"])
    assert res["failure"] is None, res["failure"]
    rows = [r for r in res["rows"] if r.get("kind") == kind]
    assert {r["rank"] for r in rows} == set(range(WORLD)), rows
    return rows


def test_deepep_ops_fake_implementations_match_real_deep_ep(results):
    for r in _rows(results, "fake_vs_real"):
        assert len(r["ops"]) == 6 and all(v == "ok" for v in r["ops"].values()), r


def test_low_latency_decode_compiles_in_one_graph_and_matches_eager(results):
    rows = _rows(results, "low_latency")
    assert {r["scheme"] for r in rows} == set(SCHEMES)
    for r in rows:
        assert r["dispatcher"] == "deepep_low_latency" and r["finite"], r
        assert (r["explain"]["graphs"], r["explain"]["breaks"]) == (1, 0), r
        assert max(r["compiled_vs_eager"]) < FUSED, r


def test_low_latency_decode_captured_by_hand_replays_new_tokens(results):
    for r in _rows(results, "low_latency"):
        assert len(r["graph_vs_eager"]) == 3 and max(r["graph_vs_eager"]) < SAME, r
        assert len(r["compiled_graph_vs_eager"]) == 3 and max(r["compiled_graph_vs_eager"]) < FUSED, r


def test_low_latency_decode_reduce_overhead(results):
    for r in _rows(results, "low_latency"):
        assert r["reduce_overhead_skipped_cudagraph"] == 0, r
        assert r["reduce_overhead_vs_eager"] < FUSED, r


def test_bounded_normal_compiles_in_one_graph_and_matches_eager(results):
    for r in _rows(results, "normal_bounded"):
        assert r["dispatcher"] == "deepep_normal" and r["finite"], r
        assert (r["explain"]["graphs"], r["explain"]["breaks"]) == (1, 0), r
        assert max(r["compiled_vs_eager"]) < FUSED, r
