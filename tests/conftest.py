import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
# benchmarks/ (scripts beside the package) imports as a namespace package from the repository root.
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Without a GPU, Triton kernels run in its interpreter; set before anything imports triton so
# every test module sees the same mode whatever the collection order.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # One intra-op thread for the CPU tests and what they start (ranks set theirs to 1 too): the
    # tensors here are tiny, so a second thread buys nothing, and when anything else runs on a
    # small runner (spawned ranks, a parallel job) torch's OpenMP threads wait on each other for
    # whole scheduler slices: ops measured 20x slower, a fidelity test 15 s instead of 0.6 s.
    # (GPU machines keep torch's threads for their float64 references.)
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# The interpreter's fixes (loop bounds under NumPy >= 2.4, a fused fma, a fast tl.sort, bf16
# conversion rounded to nearest even) belong to the tests, not to the package; compiled kernels
# never see them.
import interpreter_patches  # noqa: E402

interpreter_patches.apply()


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line("markers", "multigpu: needs two or more CUDA GPUs")


import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_schedule_lookup():
    """The cutlass backend caches the INT8 block schedule per device for the process; tests that
    fake the GPU name or the measured file must not see another test's answer."""
    cb = sys.modules.get("epmoe.experts.cutlass_backend")
    if cb is not None:
        cb._schedule_index_on.cache_clear()
    yield
