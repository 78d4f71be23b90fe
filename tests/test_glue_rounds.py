"""benchmarks/glue_rounds.py: the ratios it reads from compile_decode's rows, its summary, and a
CPU dry run of its rounds (separate processes, EPMOE_PDL alternating). The ratios it publishes
need CUDA graphs, hence a GPU."""

from __future__ import annotations

import json

from benchmarks import glue_rounds as gr


def _result(layer_ms, experts_ms, scheme="int8_channel"):
    return {"rows": [
        dict(scheme=scheme, batch=1, mode="layer_graph", ms=layer_ms),
        dict(scheme=scheme, batch=1, mode="experts_graph", ms=experts_ms),
        dict(scheme=scheme, batch=8, mode="layer_graph", ms=9.0),  # another batch: not read
        dict(scheme="bf16", batch=1, mode="layer_graph", ms=None, skipped="needs CUDA"),
        dict(scheme="bf16", batch=1, mode="experts_graph", ms=0.2),
    ]}  # fmt: skip


def test_ratio_is_layer_graph_over_experts_graph_at_one_token():
    got = gr.ratios(_result(0.1281, 0.1227))
    assert list(got) == ["int8_channel"]  # bf16's layer graph was skipped: no ratio
    layer, experts, ratio = got["int8_channel"]
    assert (layer, experts) == (128.1, 122.7) and abs(ratio - 0.1281 / 0.1227) < 1e-5


def test_summary_takes_the_median_and_counts_rounds_within_the_target():
    rows = [dict(scheme="fp8_block", EPMOE_PDL=p, ratio=r) for p, r in
            (("1", 1.04), ("0", 1.052), ("1", 1.01), ("0", 1.049), ("1", 1.051), ("0", 1.06))]  # fmt: skip
    s = gr.summarize(rows)
    assert s["fp8_block EPMOE_PDL=1"] == dict(ratios=[1.04, 1.01, 1.051], median=1.04, target_met_in="2 of 3 rounds")
    assert s["fp8_block EPMOE_PDL=0"]["median"] == 1.052  # the median, not the mean (1.0537)
    assert s["fp8_block EPMOE_PDL=0"]["target_met_in"] == "1 of 3 rounds"


def test_cpu_dry_run_alternates_the_setting_in_separate_processes(tmp_path, monkeypatch):
    seen = []
    real = gr.run_once

    def spy(out, pdl, args):
        seen.append(pdl)
        return real(out, pdl, args)

    monkeypatch.setattr(gr, "run_once", spy)
    out = tmp_path / "glue.json"
    assert gr.main([str(out), "--rounds", "1", "--device", "cpu", "--tiny", "--schemes", "bf16", "--commit", "abc1234"]) == 0
    assert seen == ["1", "0"]
    d = json.loads(out.read_text())
    assert d["commit"] == "abc1234" and d["target"] == gr.TARGET and d["rows"] == []  # no CUDA graphs on CPU
