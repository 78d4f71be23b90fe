"""The EP tests of tests/test_ep.py over NCCL on ``EPMOE_TEST_GPUS`` GPUs (default two; skipped
without them)."""

import pytest
import torch

from helpers import SCHEME_NAMES, gpu_world_size

WORLD = gpu_world_size()

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multigpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < WORLD, reason=f"needs {WORLD} CUDA GPUs"
    ),
]


@pytest.mark.parametrize("backend", ["torch", "auto"])
def test_all_to_all_nccl_matches_reference(backend, tmp_path):
    from test_ep import check, run_ranks

    rows = run_ranks(WORLD, tmp_path, SCHEME_NAMES, "all_to_all", device="cuda", backend=backend)
    check(rows, WORLD, "all_to_all")
    print({(r["scheme"], r["backend"]) for r in rows})


def test_ranks_that_disagree_raise_on_every_rank_nccl(tmp_path):
    """The fingerprint, the per-batch header and -1 ids over NCCL (the CPU test's assertions; two
    ranks whatever EPMOE_TEST_GPUS says: the cases are built per rank 0 / rank 1)."""
    from test_ep import test_ranks_that_disagree_raise_on_every_rank

    test_ranks_that_disagree_raise_on_every_rank(tmp_path, device_type="cuda")
