"""The accuracy study's pipeline on the GPU at toy sizes: training with transformers' grouped_mm
experts in BF16 on CUDA, then every variant scored with the backends ``auto`` picks there (the
EP check is the CPU test's). Plumbing and finiteness, not values."""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)
pytest.importorskip("transformers")

from benchmarks import eval_ppl, train_tiny_moe  # noqa: E402


def test_tiny_pipeline_on_cuda(tmp_path):
    train = train_tiny_moe.main([
        "--ckpt", str(tmp_path / "ckpt"), "--size", "tiny", "--device", "cuda", "--batch", "16",
        "--max-steps", "20", "--warmup-steps", "2", "--lr", "3e-3", "--eval-tokens", "4096", "--log-every", "10",
    ])  # fmt: skip
    assert train["experts_implementation"] == "grouped_mm", train["experts_implementation_refused"]
    assert train["heldout"]["perplexity"] < train["heldout"]["initial_perplexity"]
    out = eval_ppl.main([
        "--ckpt", str(tmp_path / "ckpt"), "--work", str(tmp_path / "work"), "--device", "cuda",
        "--max-tokens", "4096", "--ep-sequences", "0",
    ])  # fmt: skip
    rows = {r["variant"]: r for r in out["rows"]}
    assert set(rows) == set(eval_ppl.VARIANTS)
    for v, r in rows.items():
        assert "error" not in r, (v, r.get("error"))
        assert math.isfinite(r["perplexity"]) and r["top1_agreement"] > 0.8, (v, r)
    assert rows["bf16"]["backends"]["experts"] == ["triton"]
    assert rows["int8_block"]["backends"]["experts"] in (["triton"], ["cutlass"])
    assert rows["int8_block_dense"]["backends"]["dense_int8"] in (["triton"], ["cutlass"])
    assert rows["fp8_block"]["backends"]["experts"][0] in ("cutlass", "deepgemm", "torch")
