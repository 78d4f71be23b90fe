"""Issue 22.3 on one process: ``-1`` in ``topk_ids`` selects no expert (the local dispatcher, the
layer's validation). The all-to-all case runs over gloo in tests/test_ep.py, the DeepEP
dispatchers against a fake deep_ep in tests/test_deepep_cpu.py."""

import pytest
import torch

from cases import make_case
from epmoe.inputs import check_forward_values
from epmoe.layer import DeepEPMoELayer
from helpers import make_weights
from reference import moe_reference, rel_err

E, K, H, I = 8, 3, 128, 64


@pytest.mark.parametrize("validate", [True, False])
def test_local_minus_one_slots_contribute_nothing(validate):
    layer = DeepEPMoELayer(E, K, H, I, backend="torch", device="cpu", params_dtype=torch.float32, validate=validate)
    stored, (w13, w2) = make_weights(E, H, I, "bf16")
    layer.load_experts(*stored)
    x, ids, w = make_case("random", 0, E, K, H)
    ids = ids.clone()
    ids[::2, 0] = -1
    ids[3] = -1
    w = w.clone()
    w[3] = float("nan") if not validate else 1.0  # a padded slot's weight is never read
    out = layer(x, topk_ids=ids, topk_weights=w)
    keep = ids >= 0
    ref = moe_reference(x, ids.clamp(min=0), torch.where(keep, w, 0.0), w13, w2, "bf16")
    assert rel_err(out, ref) < 1e-5
    assert (out[3] == 0).all()


@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_batch_of_only_minus_one_slots_gives_zeros(validate, backend):
    """No slot of the batch selects an expert: nothing reaches the experts and every token gets
    zeros (the documented rule), rather than an error from indexing an empty expert output."""
    layer = DeepEPMoELayer(E, K, H, I, backend=backend, dispatch="local", device="cpu", params_dtype=torch.float32,
                           validate=validate)  # fmt: skip
    stored, _ = make_weights(E, H, I, "bf16")
    layer.load_experts(*stored)
    x = torch.randn(5, H)
    out = layer(x, topk_ids=torch.full((5, K), -1), topk_weights=torch.rand(5, K))
    assert out.shape == x.shape and bool((out == 0).all())


def test_validation_accepts_minus_one_refuses_other_negatives_and_repeats_only_real_ids():
    w = torch.ones(2, K)

    def check(ids, distinct=False):
        check_forward_values(None, torch.tensor(ids), w, num_experts=E, device=torch.device("cpu"),
                             dispatch_name="deepep_low_latency", distinct_experts=distinct)  # fmt: skip

    check([[-1, -1, 2], [0, -1, 7]])
    with pytest.raises(ValueError, match=r"expert id -2, outside \[0, 8\) \(-1 is allowed"):
        check([[-2, 0, 1], [0, 1, 2]])
    with pytest.raises(ValueError, match="expert id 8, outside"):
        check([[8, 0, 1], [0, 1, 2]])
    # Fixed-capacity dispatch refuses an expert named twice in a row, but not repeated padding.
    check([[-1, -1, 2], [-1, -1, -1]], distinct=True)
    with pytest.raises(ValueError, match=r"row 1 names an expert more than once \(\[3, -1, 3\]\)"):
        check([[-1, -1, 2], [3, -1, 3]], distinct=True)
