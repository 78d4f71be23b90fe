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

# The interpreter's fixes (loop bounds under NumPy >= 2.4, a fused fma, a fast tl.sort) belong to
# the tests, not to the package; compiled kernels never see them.
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
