"""``epmoe bench experts`` on a machine without a GPU: refuses shapes the CPU cannot hold."""

from __future__ import annotations

import pytest
import torch

from epmoe.bench import experts


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallback only")
def test_cpu_refuses_the_deepseek_shapes_before_allocating(capsys):
    assert experts.main(["--m", "8"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device, and --experts 128 --hidden 7168 --intermediate 2048 --m 8 need ~" in err
    assert "--experts 4 --hidden 256 --intermediate 128 --m 8" in err


@pytest.mark.parametrize("m", [",", "0,8"])
def test_row_counts_are_checked(m, capsys):
    with pytest.raises(SystemExit):
        experts.parse_args(["--m", m])
    assert "--m needs one or more row counts >= 1" in capsys.readouterr().err
