"""benchmarks/ep_scaling.py on a CPU: its argument and machine checks, the slowest-rank summary, the
JUnit parsing of the tests part and the scaling report (the run itself needs N GPUs and DeepEP)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from benchmarks import ep_scaling as es
from helpers import GPU_WORLD_ENV


def _error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as exc:
        es.main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_constants_agree_with_deepep_sizing_and_the_tests():
    from epmoe.dispatch.deepep_dispatch.sizing import NORMAL_WORLD_SIZES

    assert es.GPU_COUNTS == NORMAL_WORLD_SIZES
    assert es.TEST_GPUS_ENV == GPU_WORLD_ENV
    assert "not implemented" in es.REDUNDANT_EXPERTS


@pytest.mark.parametrize("argv, expected", [
    (["--gpus", "3", "--json", "o.json"], ["--gpus 3", "allowed: [2, 4, 8]"]),
    (["--gpus", "16", "--json", "o.json"], ["--gpus 16", "allowed: [2, 4, 8]", "docs/scaling.md"]),
    (["--gpus", "four"], ["--gpus", "invalid int value: 'four'"]),
    (["--json", "o.json"], ["--gpus is required", "allowed: [2, 4, 8]"]),
    (["--gpus", "4", "--schemes", "bf16,int4", "--json", "o.json"],
     ["--schemes ['int4'] unknown", "allowed: ['bf16', 'int8_channel', 'int8_channel_int32', 'int8_block', 'fp8_block']"]),
    (["--gpus", "4", "--parts", "tests,bench", "--json", "o.json"],
     ["--parts 'tests,bench'", "['bench']", "allowed: comma-separated subset of ['tests', 'layer']"]),
    (["--gpus", "4", "--parts", ",", "--json", "o.json"], ["--parts ','", "empty"]),
    (["--gpus", "4"], ["--json PATH is required"]),
    (["--gpus", "4", "--iters", "0", "--json", "o.json"], ["--iters=0; must be >= 1"]),
    (["--gpus", "4", "--rounds", "-1", "--json", "o.json"], ["--rounds=-1; must be >= 0"]),
    (["--gpus", "4", "--tests-timeout", "0", "--json", "o.json"], ["--tests-timeout=0"]),
    (["--gpus", "8", "--num-sms", "63", "--json", "o.json"], ["--num-sms", "63"]),
    (["--report", "no/such.json"], ["--report no/such.json: no such file"]),
])  # fmt: skip
def test_bad_arguments_name_the_option_value_and_what_is_allowed(argv, expected, capsys):
    err = _error(argv, capsys)
    for text in expected:
        assert text in err, (text, err)


def test_report_takes_no_gpus(tmp_path, capsys):
    path = tmp_path / "a.json"
    path.write_text("{}")
    assert "it takes no --gpus (got --gpus 4)" in _error(["--report", str(path), "--gpus", "4"], capsys)


@pytest.mark.skipif(torch.cuda.device_count() >= 4, reason="checks the refusal on a machine with fewer GPUs")
def test_missing_gpus_are_refused_before_anything_runs(tmp_path, capsys):
    out = tmp_path / "o.json"
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    err = _error(["--gpus", "4", "--parts", "tests", "--json", str(out)], capsys)
    assert f"--gpus 4: this machine has {have} CUDA GPU(s)" in err
    assert not out.exists()


def test_machine_check_names_what_fits_and_deepep():
    p = argparse.ArgumentParser(prog="ep_scaling")
    args = argparse.Namespace(gpus=8, parts=["tests", "layer"])
    with pytest.raises(SystemExit):
        es.check_machine(p, args, 4, "")
    args.gpus = 4
    es.check_machine(p, args, 4, "")  # fits: no error
    messages = []
    p.error = lambda msg: (messages.append(msg), (_ for _ in ()).throw(SystemExit(2)))  # noqa: E731
    for gpus, here, problem in ((8, 4, ""), (4, 4, "deep_ep is not importable (ImportError: nope)")):
        args.gpus = gpus
        with pytest.raises(SystemExit):
            es.check_machine(p, args, here, problem)
    assert messages[0] == "--gpus 8: this machine has 4 CUDA GPU(s) (torch.cuda.device_count()); allowed here: [2, 4]"
    assert "the layer part needs DeepEP: deep_ep is not importable (ImportError: nope)" in messages[1]
    args.parts = ["tests"]
    es.check_machine(p, args, 4, "deep_ep is not importable")  # the tests part runs without it


# ---------------------------------------------------------------------------------- summary
def _row(layer_ms, dispatch, combine, raw=(0.4, 0.5), ours=(0.42, 0.5), tokens=4096):
    return dict(backend="triton", payload="int8_token", tokens=tokens, layer_ms=layer_ms,
                phases_ms={"dispatch": dispatch, "gemm1": 1.0, "combine": combine},
                deepep_ms=dict(dispatch_ms=raw[0], combine_ms=raw[1], dispatch_pipelined_ms=raw[0] / 2,
                               combine_pipelined_ms=raw[1] / 2),
                layer_dc_ms=dict(dispatch_ms=ours[0], combine_ms=ours[1], dispatch_pipelined_ms=ours[0] / 2,
                                 combine_pipelined_ms=ours[1] / 2))  # fmt: skip


def _ranks(n, prefill, turns=None, dc=None):
    """``n`` ranks; ``prefill[scheme]`` = per-rank host-synced ms; ``turns[scheme]`` = per-rank ms
    in turns; ``dc[scheme]`` = per-rank (raw, ours) dispatch/combine pairs."""
    ranks = []
    for r in range(n):
        schemes = {}
        for s, ms in prefill.items():
            raw, ours = (dc or {}).get(s, [((0.4, 0.5), (0.42, 0.5))] * n)[r]
            schemes[s] = {"prefill": _row(ms[r], 0.1 * ms[r], 0.2 * ms[r], raw, ours)}
        rank = {"rank": r, "schemes": schemes, "skipped": {}}
        if turns:
            rank["interleaved"] = {"prefill": {s: {"layer_ms": v[r], "rounds_ms": [v[r]]} for s, v in turns.items()}}
        ranks.append(rank)
    return ranks


def test_summary_is_the_slowest_rank():
    ranks = _ranks(4, {"bf16": [8.0, 8.4, 8.1, 8.2], "int8_channel": [5.0, 4.9, 5.2, 5.1]},
                   turns={"bf16": [7.0, 7.2, 7.1, 7.0], "int8_channel": [4.4, 4.5, 4.3, 4.4]},
                   dc={"bf16": [((0.4, 0.5), (0.42, 0.5))] * 3 + [((0.5, 0.6), (0.5, 0.61))],
                       "int8_channel": [((0.3, 0.5), (0.3, 0.5))] * 4})  # fmt: skip
    s = es.summarize(ranks)["prefill"]
    b, i = s["bf16"], s["int8_channel"]
    assert b["timing"] == "in turns" and b["layer_ms"] == 7.2 and i["layer_ms"] == 4.5
    assert i["x_bf16"] == pytest.approx(7.2 / 4.5) and b["x_bf16"] == 1.0
    assert i["tokens_per_s_per_gpu"] == pytest.approx(4096 / 4.5e-3)
    # The share is the slowest host-synced forward's: dispatch + combine = 0.3 of it.
    assert i["dc_share"] == pytest.approx(0.3)
    # d+c: the slowest rank of each side (rank 3 for both here), layer over DeepEP.
    assert b["deepep_dc_ms"] == pytest.approx(1.1) and b["layer_dc_ms"] == pytest.approx(1.11)
    assert b["dc_overhead_pct"] == pytest.approx(100 * (1.11 / 1.1 - 1))
    assert b["dc_pipelined_overhead_pct"] == pytest.approx(100 * (0.555 / 0.55 - 1))
    assert i["dc_overhead_pct"] == pytest.approx(0.0)


def test_summary_without_turns_uses_the_slowest_forward():
    s = es.summarize(_ranks(2, {"bf16": [8.0, 8.4], "int8_block": [6.0, 6.3]}))["prefill"]
    assert s["bf16"]["timing"] == "alone" and s["bf16"]["layer_ms"] == 8.4
    assert s["int8_block"]["x_bf16"] == pytest.approx(8.4 / 6.3)


def test_refuses_to_time_the_reference_backend_under_auto():
    class _B:
        def __init__(self, name):
            self.name = name

    layers = {"normal": argparse.Namespace(backend=_B("torch"))}
    reason = es.refuse_reference_backend("auto", "fp8_block", layers)
    assert "torch reference backend for fp8_block" in reason and "LD_PRELOAD" in reason
    assert es.refuse_reference_backend("torch", "fp8_block", layers) is None  # asked for: timed
    layers["normal"].backend = _B("deepgemm")
    assert es.refuse_reference_backend("auto", "fp8_block", layers) is None


def test_junit_outcomes(tmp_path):
    xml = tmp_path / "j.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.gpu.test_deepep" name="test_a" time="12.5"/>'
        '<testcase classname="tests.gpu.test_deepep" name="test_b" time="1"><failure message="assert 0.2 &lt; 0.1">tb'
        "</failure></testcase>"
        '<testcase classname="tests.gpu.test_ep_nccl" name="test_c" time="0"><skipped message="needs 8 CUDA GPUs"/>'
        "</testcase></testsuite></testsuites>"
    )
    cases = es.parse_junit(str(xml))
    assert [(c["name"], c["outcome"]) for c in cases] == [
        ("tests.gpu.test_deepep::test_a", "passed"), ("tests.gpu.test_deepep::test_b", "failed"),
        ("tests.gpu.test_ep_nccl::test_c", "skipped"),
    ]  # fmt: skip
    assert cases[0]["seconds"] == 12.5 and cases[1]["message"] == "assert 0.2 < 0.1"


# ---------------------------------------------------------------------------------- report
def _doc(n, bf16_ms, int8_ms, **extra):
    ranks = _ranks(n, {"bf16": [bf16_ms] * n, "int8_channel": [int8_ms] * n})
    return dict(kind="ep_scaling", format=es.FORMAT, gpus=n, date="2026-12-02T00:00:00+00:00", commit="abc",
                dirty=False, machine={"gpu_names": ["NVIDIA H200"] * n}, redundant_experts=es.REDUNDANT_EXPERTS,
                layer=dict(ranks=ranks, skipped={}, failed=False), summary=es.summarize(ranks), **extra)  # fmt: skip


def _write(tmp_path, name, doc):
    path = tmp_path / name
    path.write_text(json.dumps(doc))
    return str(path)


def test_report_table_per_n(tmp_path, capsys):
    tests = dict(counts=dict(passed=5, failed=1, error=0, skipped=1), error=None,
                 cases=[dict(name="t::a", outcome="passed", message=""), dict(name="t::b", outcome="failed",
                        message="assert err < tol"), dict(name="t::c", outcome="skipped", message="no deep_ep")])  # fmt: skip
    paths = [_write(tmp_path, f"{n}.json", _doc(n, b, i)) for n, b, i in ((8, 9.0, 5.0), (2, 8.0, 4.0))]
    paths.append(_write(tmp_path, "8-tests.json", dict(kind="ep_scaling", gpus=8, tests=tests)))
    md = tmp_path / "out" / "scaling.md"
    assert es.main(["--report", *paths, "--markdown", str(md)]) == 0
    table = md.read_text()
    assert table == capsys.readouterr().out
    lines = table.splitlines()
    assert lines[0].startswith("| N | phase | scheme | backend | layer ms | tokens/s per GPU | x BF16 |")
    rows = [ln for ln in lines if ln.startswith("| 2 ") or ln.startswith("| 8 ")]
    # N ascending; 4096 tokens / 4 ms = 1,024,000 tokens/s; share 0.1 + 0.2; d+c 0.92 / 0.9 - 1.
    assert rows == [
        "| 2 | prefill (4096 tokens/rank) | bf16 | triton | 8.000 | 512,000 | 1.00 | 30% | +2.2% / +2.2% |",
        "| 2 | prefill (4096 tokens/rank) | int8_channel | triton | 4.000 | 1,024,000 | 2.00 | 30% | +2.2% / +2.2% |",
        "| 8 | prefill (4096 tokens/rank) | bf16 | triton | 9.000 | 455,111 | 1.00 | 30% | +2.2% / +2.2% |",
        "| 8 | prefill (4096 tokens/rank) | int8_channel | triton | 5.000 | 819,200 | 1.80 | 30% | +2.2% / +2.2% |",
    ]
    assert "tests 5 passed, 1 failed, 0 errors, 1 skipped" in table  # merged from the tests-only JSON
    assert "failed: t::b: assert err < tol" in table and "skipped: t::c: no deep_ep" in table
    assert "t::a" not in table
    assert table.count("redundant experts: not implemented") == 2


def test_report_lists_schemes_not_timed(tmp_path, capsys):
    doc = _doc(4, 8.0, 4.0)
    doc["layer"]["skipped"] = {"fp8_block": "backend='auto' chose the torch reference backend for fp8_block"}
    es.main(["--report", _write(tmp_path, "4.json", doc)])
    assert "fp8_block not timed: backend='auto' chose the torch reference backend" in capsys.readouterr().out


def test_report_refuses_the_same_part_twice_and_foreign_json(tmp_path, capsys):
    a, b = _write(tmp_path, "a.json", _doc(4, 8.0, 4.0)), _write(tmp_path, "b.json", _doc(4, 8.1, 4.1))
    err = _error(["--report", a, b], capsys)
    assert f"{a} and {b} both hold the layer part for N = 4" in err
    other = _write(tmp_path, "other.json", {"config": {}, "ranks": []})
    assert f"--report {other}: not a JSON written by benchmarks/ep_scaling.py" in _error(["--report", other], capsys)
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    assert f"--report {bad}: not JSON" in _error(["--report", str(bad)], capsys)


def test_plot_series_per_phase_and_scheme(tmp_path):
    docs = es.load([_write(tmp_path, f"{n}.json", _doc(n, 8.0 + n / 8, 4.0 + n / 8)) for n in (8, 2, 4)])
    s = es.plot_series(docs)["prefill"]
    assert s["bf16"]["n"] == [2, 4, 8] and s["int8_channel"]["x_bf16"] == pytest.approx([8.25 / 4.25, 8.5 / 4.5, 9.0 / 5.0])
    pytest.importorskip("matplotlib")
    es.plot(docs, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 0


def test_tests_part_runs_pytest_with_the_rank_count(tmp_path):
    """The tests part end to end on this machine: pytest in a child with EPMOE_TEST_GPUS=8, every
    GPU test skipped here (no GPUs), each outcome read back from the JUnit file."""
    got = es.run_tests(8, 300, str(tmp_path))
    assert got["returncode"] == 0 and got["error"] is None, got
    assert got["command"].startswith("EPMOE_TEST_GPUS=8 python -m pytest")
    names = {c["name"].split("::")[-1] for c in got["cases"]}
    assert {"test_every_combination_matches_reference", "test_all_to_all_nccl_matches_reference[torch]"} <= names
    if not torch.cuda.is_available():
        assert got["counts"]["skipped"] == len(got["cases"]) > 0
        assert all("needs 8 CUDA GPUs" in c["message"] for c in got["cases"]), got["cases"]


def test_run_writes_one_json_with_every_part_and_fails_on_a_failed_test(tmp_path, monkeypatch, capsys):
    """``run`` with the GPU pieces replaced: the JSON holds the header, the tests part and the
    layer part with its summary; a failed test makes the exit code 1, and the table is printed."""
    ranks = _ranks(4, {"bf16": [8.0] * 4, "int8_channel": [4.0] * 4})
    monkeypatch.setattr(es, "machine", lambda n: {"gpu_names": ["NVIDIA H200"] * n})
    monkeypatch.setattr(es.bench_layer, "launch", lambda fn, args, what, world: (ranks, 0))
    counts = dict(passed=3, failed=0, error=0, skipped=0)
    monkeypatch.setattr(es, "run_tests", lambda n, t, d: dict(returncode=0, error=None, cases=[], counts=dict(counts)))
    out = tmp_path / "r" / "s.json"
    p = es.build_parser()
    args = es.check_args(p, p.parse_args(["--gpus", "4", "--json", str(out), "--commit", "given"]))
    assert es.run(args) == 0
    doc = json.loads(out.read_text())
    assert doc["kind"] == "ep_scaling" and doc["gpus"] == 4 and doc["parts"] == ["tests", "layer"]
    assert doc["commit"] and doc["date"] and doc["config"]["local_experts"] == 64
    assert doc["redundant_experts"].startswith("not implemented")
    assert doc["summary"]["prefill"]["int8_channel"]["x_bf16"] == pytest.approx(2.0)
    assert len(doc["layer"]["ranks"]) == 4 and doc["tests"]["counts"] == counts
    assert "| 4 | prefill (4096 tokens/rank) | int8_channel |" in capsys.readouterr().out
    counts["failed"] = 1
    assert es.run(args) == 1
