"""Expert parallelism over gloo with EP in {1, 2, 8}: each rank matches a float64 reference."""

import json

import pytest

import ep_worker
from ep_worker import suite_plan
from epmoe.launch import run_ranks as launch_ranks
from helpers import SCHEME_NAMES, read_rank_rows


def run_plans(world, tmp_path, plans, device="cpu") -> list[list[dict]]:
    """The rows of each :func:`ep_worker.suite_plan` of ``plans``, all run in one launch."""
    out = str(tmp_path / "res")
    launch_ranks(ep_worker.run_suite, world, device, plans, out)
    rows = read_rank_rows(out, world)
    assert not [r for r in rows if "error" in r]
    return [[r for r in rows if r["plan"] == i] for i in range(len(plans))]


def run_ranks(world, tmp_path, schemes=SCHEME_NAMES, dispatch="all_to_all", device="cpu", backend="torch"):
    return run_plans(world, tmp_path, [suite_plan(schemes, dispatch, backend)], device)[0]


def check(rows, world, dispatch, plan=None):
    """Every row matches its references; with ``plan``: every rank ran each of its (scheme,
    case) pairs."""
    assert not [r for r in rows if "error" in r]
    assert {r["rank"] for r in rows} == set(range(world))
    if plan is not None:
        got = sorted((r["rank"], r["scheme"], r["case"]) for r in rows)
        assert got == sorted((k, s, c) for k in range(world) for s in plan["schemes"] for c in plan["cases"])
    for r in rows:
        assert r["shape_ok"], r
        assert r["dispatch"] == dispatch
        if r["tokens"]:
            assert r["err_emulated"] < r["tol_emulated"], r
            assert r["err_exact"] < r["bound"], r
    # The case that starves a rank really ran with zero tokens there.
    if world > 1 and any(r["case"] == "no_tokens" for r in rows):
        assert any(r["case"] == "no_tokens" and r["tokens"] == 0 for r in rows)


# The Triton backend (its interpreter on a CPU) on a tiny shape, one case: int8_block's 128-wide
# blocks and E_loc = 2 segments (4 experts over 2 ranks; at EP = 8 this took 16 experts and six
# more ranks of interpreter time, with the same local batch layout for the backend).
TRITON_TINY = suite_plan(("int8_block",), backend="triton", cases=("random",), shape=(4, 2, 128, 128))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One launch of two ranks for the tests below that need no ranks of their own: every scheme
    and routing case, the Triton backend's tiny plan, then the collective count. Returns
    ``(plan, its rows, Triton rows, count rows)``."""
    plan = suite_plan()
    rows, triton_rows, counts = run_plans(2, tmp_path_factory.mktemp("two_ranks"),
                                          [plan, TRITON_TINY, ep_worker.count_plan()])  # fmt: skip
    return plan, rows, triton_rows, counts


# EP = 4 is left out: the same plan (every scheme and routing case) runs at EP = 2 here and at
# EP = 8 below (fewer local experts, more of a token's experts remote), which bracket it; 4 more
# spawned ranks cost ~10 s on a 2-core runner.
def test_all_to_all_matches_reference(two_ranks):
    plan, rows, _, _ = two_ranks
    check(rows, 2, "all_to_all", plan)
    assert {r["backend"] for r in rows} == {"torch"}


def test_triton_interpreter_over_two_ranks(two_ranks):
    rows = two_ranks[2]
    check(rows, 2, "all_to_all", TRITON_TINY)
    assert {r["backend"] for r in rows} == {"triton"}


def test_eight_ranks(tmp_path):
    """EP = 8, a DeepSeek node's group (2 local experts each here, most of a token's experts on
    other ranks): every scheme and routing case on the torch backend. (The Triton backend's tiny
    plan runs over two ranks above, with the same 2 local experts.)"""
    full = suite_plan()
    (torch_rows,) = run_plans(8, tmp_path, [full])
    check(torch_rows, 8, "all_to_all", full)
    assert {r["backend"] for r in torch_rows} == {"torch"}


def test_ep1_in_a_process_group(tmp_path):
    check(run_ranks(1, tmp_path, dispatch="auto"), 1, "local")


def test_arguments_are_compared_once_per_layer_not_per_batch(two_ranks):
    """The build compares the ranks' arguments in one all-gather; each forward then runs only the
    all_to_all dispatcher's three exchanges (counts header with dtype and widths, payload,
    combine): no collective of the fingerprint's per batch."""
    rows = two_ranks[3]
    assert sorted(r["rank"] for r in rows) == [0, 1], rows
    for calls in rows:
        assert calls["build"] == ["all_gather"], calls
        for i in range(3):
            assert calls[f"forward {i}"] == ["all_to_all_single"] * 3, calls


def test_dead_peer_times_out_with_named_collective(tmp_path):
    out = str(tmp_path / "timeout.json")
    launch_ranks(ep_worker.run_timeout, 2, out)
    with open(out) as f:
        result = json.load(f)
    assert result["raised"] == "CollectiveTimeoutError"
    assert "collective 'dispatch counts' on rank 0 of 2 did not complete within timeout_s=2" in result["message"]
    assert result["seconds"] < 30


def test_dead_peer_raises_a_collective_error(tmp_path):
    out = str(tmp_path / "dead.json")
    launch_ranks(ep_worker.run_dead_peer, 2, out)
    with open(out) as f:
        result = json.load(f)
    assert result["is_collective_error"], result
    assert "all_to_all dispatcher: collective 'dispatch counts' on rank 0 of 2" in result["message"]


def _spawn(fn, world, tmp_path, name, *extra):
    out = str(tmp_path / name)
    launch_ranks(fn, world, out, *extra)
    return out


def test_ranks_that_disagree_raise_on_every_rank(tmp_path, device_type="cpu"):
    """Issue 22.1-22.3 over gloo, one spawn: each fingerprint field built differently per rank
    raises on both ranks naming the field and both values (today: wrong outputs or SIGABRT in
    gloo); input dtypes that differ per batch raise on both ranks and leave the group in step;
    -1 ids contribute nothing over all_to_all, validated or not, and -2 is still refused.
    (tests/gpu/test_ep_nccl.py runs it over NCCL.)"""
    out = _spawn(ep_worker.run_mismatch, 2, tmp_path, "mismatch", device_type)
    every = read_rank_rows(out, 2)
    assert {row["rank"] for row in every} == {0, 1}, every
    for rows in ({row["case"]: row for row in every if row["rank"] == r} for r in range(2)):
        assert "worker" not in rows, rows.get("worker")
        for field, common, kw0, kw1 in ep_worker.MISMATCHES:
            row = rows[field]
            assert row["is_mismatch"], (field, row)
            assert f"the ranks disagree on {field} (rank 0: " in row["message"], (field, row)
        for field, values in (("dispatch", ("all_to_all", "deepep_auto")), ("payload", ("int8_token", "float")),
                              ("alignment", ("1", "128"))):  # fmt: skip
            assert f"the ranks disagree on {field} (rank 0: {values[0]}, rank 1: {values[1]})" in rows[field]["message"]
        assert rows["num_experts"]["message"].count("rank 0: 16, rank 1: 32") == 1
        assert "rank 0: torch.float32, rank 1: torch.bfloat16" in rows["params_dtype"]["message"]
        assert rows["meta_build"]["raised"] is None and rows["meta_build"]["seconds"] < 1
        meta = rows["meta_deferred"]
        assert not meta["agreed_at_build"] and meta["is_mismatch"] and "rank 0: 16, rank 1: 32" in meta["message"]
        for quant in ("bf16", "int8_channel"):
            fp16 = rows[f"header_{quant}_torch.float16_torch.bfloat16"]
            assert fp16["is_mismatch"] and "input dtype (rank 0: torch.float16, rank 1: torch.bfloat16)" in fp16["message"]
            assert rows[f"header_{quant}_torch.float32_torch.bfloat16"]["is_mismatch"]
            assert rows[f"after_header_{quant}"]["err"] < 1e-3  # fp32 activations and weights
        for validate in (True, False):
            row = rows[f"pad_validate_{validate}"]
            assert row["err"] < 1e-5 and row["zero_rows"], row
        assert "expert id -2, outside" in rows["pad_minus_two"]["message"]


def test_peer_dying_at_each_collective_raises_naming_it(tmp_path):
    """Issue 22.4: a peer killed at the build's comparison and at each collective of a forward
    (counts, payload, combine): the survivor raises CollectiveError naming it within timeout_s."""
    out = _spawn(ep_worker.run_dead_peers, 1 + len(ep_worker.KILL_POINTS), tmp_path, "dead.json")
    with open(out) as f:
        rows = json.load(f)
    assert [r["collective"] for r in rows] == list(ep_worker.KILL_POINTS)
    for r in rows:
        assert r["is_collective_error"], r
        assert f"collective '{r['collective']}' on rank 0 of 2" in r["message"], r
        assert r["seconds"] < r["timeout_s"] + 5, r
