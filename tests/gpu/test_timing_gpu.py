"""epmoe.timing.profile_phases on a GPU: Triton work inside a phase, and a phase that launches
nothing itself but holds others (as ``epmoe.experts`` holds ``quantize`` .. ``gemm2``)."""

from __future__ import annotations

import pytest
import torch

from epmoe import ops, timing
from epmoe.timing import phase

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_phases_count_triton_work_and_the_phases_nested_in_them():
    x = torch.randn(4096, 7168, device="cuda", dtype=torch.bfloat16)

    def forward():
        with phase("epmoe.outer"):
            with phase("epmoe.inner_triton"):
                ops.per_group_quant(x, 128, torch.int8, scale_mn_major=True)
            with phase("epmoe.inner_torch"):
                x.mul(2)

    got = timing.profile_phases(forward, 4, 1, "cuda", collective=False)
    alone = timing.kernel_ms(lambda: ops.per_group_quant(x, 128, torch.int8, scale_mn_major=True), rep_ms=20)
    # The quantizer's kernel time, which the profiler does not link to the host range.
    assert 0.5 * alone < got["inner_triton"] < 2.0 * alone, (got, alone)
    assert got["inner_torch"] > 0
    assert got["outer"] == pytest.approx(got["inner_triton"] + got["inner_torch"], rel=1e-6)
