"""benchmarks/bench_hf_moe.py without a GPU: argument refusals, the targets and the table from a
result document (the whole script runs on a CPU with --device cpu --tiny; too slow for CI)."""

import pytest

pytest.importorskip("transformers")

from benchmarks import bench_hf_moe as bench  # noqa: E402


def test_arguments_are_checked(capsys):
    for bad, text in ((["--variants", "bf16,int4"], "allowed"), (["--iters", "0"], "--iters=0 must be >= 1"),
                      (["--device", "cuda"] if not bench.torch.cuda.is_available() else ["--layers", "0"], "")):  # fmt: skip
        with pytest.raises(SystemExit):
            bench.parse_args(bad)
        assert text in capsys.readouterr().err
    args = bench.parse_args(["--device", "cpu", "--tiny", "--variants", "grouped_mm,int8_block_triton"])
    assert args.variants == ["grouped_mm", "int8_block_triton"] and args.decode_batch <= 4 and args.layers <= 2


def test_targets_and_table():
    floors = {"bf16": 2.0, "int8": 1.0}
    results = {
        "grouped_mm": {"backend": "transformers grouped_mm", "prefill_ms": 100.0, "prefill_tok_s": 1000.0, "decode_ms": 10.0,
                       "decode_tok_s": 64.0, "experts_prefill_ms": 50.0, "experts_decode_ms": 4.0, "decode_graph_ms": 8.0,
                       "decode_graph_tok_s": 80.0, "experts_decode_graph_ms": 3.0},
        "bf16": {"backend": "triton", "prefill_ms": 80.0, "prefill_tok_s": 1250.0, "decode_ms": 20.0, "decode_tok_s": 32.0,
                 "experts_prefill_ms": 25.0, "experts_decode_ms": 9.0, "decode_graph_ms": 6.0, "decode_graph_tok_s": 120.0,
                 "experts_decode_graph_ms": 2.4},
        "fp8_block": {"backend": "cutlass", "prefill_ms": 70.0, "prefill_tok_s": 1400.0, "decode_ms": 30.0, "decode_tok_s": 20.0,
                      "experts_prefill_ms": 20.0, "experts_decode_ms": 9.0, "graph": "not capturable: reads counts"},
        "int8_block": {"skipped": "BackendUnavailableError: no"},
    }  # fmt: skip
    t = bench.targets(results, floors)
    assert t["prefill_experts_bf16_vs_grouped_mm"]["measured"] == pytest.approx(0.5)
    assert t["decode_experts_bf16_graph_vs_weight_read_floor"]["measured"] == pytest.approx(1.2)
    assert t["decode_experts_fp8_block_eager_vs_weight_read_floor"]["measured"] == pytest.approx(9.0)
    assert "decode_experts_fp8_block_graph_vs_weight_read_floor" not in t
    assert t["decode_graph_tok_s_bf16_vs_grouped_mm"]["measured"] == pytest.approx(1.5)
    text = bench.table({"gpu": "X", "config": {"layers": 8}, "decode_weight_read_floor_ms": floors, "results": results})
    assert "int8_block" in text and "skipped" in text and "not capturable" in text and "120.00" in text
