"""benchmarks/sglang_int8.py without a GPU: its options, its refusal without SGLang's sources, the
torch token alignment and the import shims (on stand-in modules; SGLang's kernel needs a GPU)."""

from __future__ import annotations

import sys

import pytest
import torch

from benchmarks import sglang_int8 as sg


def test_refuses_without_the_sources_naming_how_to_get_them(tmp_path, capsys):
    assert sg.main(["--json", str(tmp_path / "o.json"), "--sglang-dir", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert f"not in --sglang-dir {tmp_path / 'none'}" in err
    assert "fused_moe_triton_kernels.py" in err and "quantization/int8_kernel.py" in err
    assert "never committed" in err and "git -C SGLANG archive HEAD" in err and "--sglang-dir" in err
    assert not (tmp_path / "o.json").exists()


@pytest.mark.parametrize("argv, says", [
    (["--m", "3", "--experts", "12"], "m * --experts must be a multiple of --top-k 8"),
    (["--m", "0"], "--m needs one or more row counts >= 1"),
    (["--m", "8,x"], "expected comma-separated integers"),
    (["--sweep", "21"], "--sweep must be 0 to 20; got 21"),
    (["--turns", "0"], "--turns must be >= 1; got 0"),
    (["--hidden", "200"], "--hidden 200 must be a multiple of 128"),
    (["--top-k", "9", "--experts", "8"], "--top-k 9 is more than --experts 8"),
])  # fmt: skip
def test_bad_options_are_named(argv, says, capsys):
    with pytest.raises(SystemExit) as exc:
        sg.parse_args(["--json", "o.json", *argv])
    assert exc.value.code == 2 and says in capsys.readouterr().err


def test_json_is_required(capsys):
    with pytest.raises(SystemExit):
        sg.parse_args([])
    assert "--json" in capsys.readouterr().err


def test_sweep_candidates_fit_the_scheme():
    small, large = sg.candidates(8, False, 20), sg.candidates(2048, False, 5)
    assert len(small) == 20 and len(large) == 5 and small[0]["BLOCK_SIZE_M"] <= 32 < large[1]["BLOCK_SIZE_M"]
    block = sg.candidates(8, True, 20)
    assert block and all(128 % c["BLOCK_SIZE_K"] == 0 for c in block)
    assert len(block) < 20  # the K tiles of 256 span two scale groups
    assert sg.candidates(8, True, 0) == []


@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_align_block_size_sorts_every_slot_once_into_padded_expert_runs(block_m):
    g = torch.Generator().manual_seed(0)
    e, ids = 5, torch.randint(0, 5, (7, 3), generator=g, dtype=torch.int32)
    ids[0] = 4  # a token whose slots all go to one expert; some expert may get none
    sorted_ids, expert_ids, total = sg.align_block_size(ids, block_m, e)
    numel = ids.numel()
    assert sorted_ids.numel() == numel + e * (block_m - 1)
    real = sorted_ids[sorted_ids < numel]
    assert sorted(real.tolist()) == list(range(numel))
    n = int(total)
    assert n % block_m == 0 and (sorted_ids[n:] == numel).all()
    flat = ids.reshape(-1)
    for b in range(n // block_m):
        slots = sorted_ids[b * block_m:(b + 1) * block_m]
        slots = slots[slots < numel]
        assert (flat[slots.long()] == expert_ids[b]).all()
    assert (expert_ids[n // block_m:] == -1).all()
    counts = torch.bincount(flat.long(), minlength=e)
    assert n == int(((counts + block_m - 1) // block_m * block_m).sum())
    assert expert_ids[: n // block_m].tolist() == sorted(expert_ids[: n // block_m].tolist())


def test_shims_enter_sglang_without_its_packages(tmp_path, monkeypatch):
    """Stand-in modules at SGLang's paths: the package __init__ files never run, sglang.srt.utils
    and the FP8 module are shims, and without sgl-kernel the group quantizer is stood in for."""
    py = tmp_path / "python" / "sglang"
    (py / "__init__.py").parent.mkdir(parents=True)
    (py / "__init__.py").write_text("raise RuntimeError('the server package was imported')\n")
    body = {
        "srt/layers/moe/fused_moe_triton/fused_moe_triton_kernels.py":
            "from sglang.srt.layers.quantization.fp8_kernel import scaled_fp8_quant\n"
            "from sglang.srt.utils import is_cuda, get_bool_env_var\nCUDA = is_cuda()\n",
        "srt/layers/moe/fused_moe_triton/fused_moe_triton_config.py": "def get_default_config(*a):\n    return {}\n",
        "srt/layers/quantization/int8_kernel.py": "from sgl_kernel import sgl_per_token_group_quant_8bit\n",
    }  # fmt: skip
    for rel, text in body.items():
        (py / rel).parent.mkdir(parents=True, exist_ok=True)
        (py / rel).write_text(text)
    (py / "srt" / "__init__.py").write_text("raise RuntimeError('srt imported')\n")
    before = set(sys.modules)
    monkeypatch.setattr(sg.importlib.util, "find_spec", lambda name: None)
    try:
        mods, notes = sg.load_sglang(tmp_path)
        assert mods["fused_moe_triton_kernels"].CUDA == torch.cuda.is_available()
        with pytest.raises(NotImplementedError, match="FP8"):
            mods["fused_moe_triton_kernels"].scaled_fp8_quant(None)
        assert "stands in for sgl_per_token_group_quant_8bit" in notes["group_quant"]
        assert set(notes["files_sha256"]) == set(sg.SOURCES.values())
    finally:
        for name in set(sys.modules) - before:
            del sys.modules[name]


def test_source_commits_are_read_from_the_folder_note(tmp_path):
    rel = sg.SOURCES[f"{sg.FUSED}.fused_moe_triton_kernels"]
    (tmp_path / "SOURCE.md").write_text(f"| {rel} | {'ab12' * 10} | kept |\n| other.py | {'cd' * 20} |\n")
    assert sg.source_commits(tmp_path / "SOURCE.md") == {rel: "ab12" * 10}
    assert sg.source_commits(tmp_path / "none.md") == {}
