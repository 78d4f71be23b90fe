"""The FP8 block backends' selection rule, as a pure function and through the layer (CPU)."""

import dataclasses
import itertools
import json
import logging
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the plumbing tests run the Triton kernels on CPU

from epmoe.experts import fp8_selection as fs
from epmoe.experts.fp8_selection import (
    cutlass_decision,
    deepgemm_decision,
    fp8_block_auto_choice,
    parse_version,
)

ON = {"SGLANG_CUTLASS_MOE": "1"}
OFF = {}
ZERO = {"SGLANG_CUTLASS_MOE": "0"}
HEADERS = {"cutlass_headers": True, "sgl_kernel": False, "deep_gemm": False}
CAPS = [(8, 0), (9, 0), (10, 0), None]
CUDAS = ["12.2", "12.3", "12.10", "13.0", None]
ENVS = [OFF, ZERO, ON]


@pytest.mark.parametrize(
    "text, expected",
    [("12.3", (12, 3)), ("12.10", (12, 10)), ("13.0", (13, 0)), ("12.4.1", (12, 4, 1)),
     ("12.8a", (12, 8)), (None, None), ("", None), ("cpu", None)],
)  # fmt: skip
def test_parse_version(text, expected):
    assert parse_version(text) == expected


def test_versions_compare_as_tuples_not_strings():
    assert "12.10" < "12.3"  # the trap
    assert parse_version("12.10") > parse_version("12.3")
    d = cutlass_decision((9, 0), "12.10", ON, HEADERS)
    assert d.ok, d.reason


@pytest.mark.parametrize("cap, cuda, env", list(itertools.product(CAPS, CUDAS, ENVS)))
@pytest.mark.parametrize("deep_gemm", [False, True])
def test_cutlass_rule_all_branches(cap, cuda, env, deep_gemm):
    installed = dict(HEADERS, deep_gemm=deep_gemm)
    d = cutlass_decision(cap, cuda, env, installed)
    enabled = env.get("SGLANG_CUTLASS_MOE") == "1"
    cuda_ok = cuda is not None and parse_version(cuda) >= (12, 3)
    expect_ok = enabled and cap is not None and cap[0] == 9 and cuda_ok
    assert d.ok == expect_ok, d
    assert d.considered == enabled
    assert d.warn == (enabled and not expect_ok)
    assert "SGLANG_CUTLASS_MOE" in d.reason
    if not enabled:
        assert "SGLANG_CUTLASS_MOE=1 is required" in d.reason
    elif cap is None:
        assert "no CUDA GPU" in d.reason
    elif cap[0] != 9:
        assert f"compute capability {cap[0]}.{cap[1]}, not 9.x" in d.reason
    elif cuda is None:
        assert "CUDA version is unknown" in d.reason
    elif not cuda_ok:
        assert f"CUDA {cuda} is older than 12.3" in d.reason
    # DeepGEMM's presence never changes the cutlass decision.
    assert d == cutlass_decision(cap, cuda, env, dict(installed, deep_gemm=not deep_gemm))
    # Auto: cutlass when it can run, else DeepGEMM when installed on 9.x/10.x, else torch.
    choice = fp8_block_auto_choice(cap, cuda, env, installed)
    dg_ok = deep_gemm and cap is not None and cap[0] in (9, 10)
    expected = "cutlass" if expect_ok else ("deepgemm" if dg_ok else "torch")
    assert choice.backend == expected
    assert len(choice.warnings) == (1 if d.warn else 0)


def test_cutlass_needs_a_kernel():
    d = cutlass_decision((9, 0), "12.4", ON, {"sgl_kernel": False, "cutlass_headers": False})
    assert not d.ok and d.warn
    assert "pip install nvidia-cutlass" in d.reason and "EPMOE_CUTLASS_DIR" in d.reason
    d = cutlass_decision((9, 0), "12.4", ON, {"sgl_kernel": True, "cutlass_headers": False})
    assert d.ok and "sgl-kernel" in d.reason
    d = cutlass_decision((9, 0), "12.4", ON, {"sgl_kernel": False, "cutlass_headers": True})
    assert d.ok and "epmoe's CUTLASS kernel" in d.reason


@pytest.mark.parametrize("value, enabled", [("1", True), ("true", True), ("0", False), ("", False), ("no", False)])
def test_env_values(value, enabled):
    d = cutlass_decision((9, 0), "12.8", {"SGLANG_CUTLASS_MOE": value}, HEADERS)
    assert d.considered == enabled and d.ok == enabled
    if not enabled:
        assert repr(value) in d.reason


@pytest.mark.parametrize("cap", CAPS)
@pytest.mark.parametrize("installed", [False, True])
def test_deepgemm_rule(cap, installed):
    d = deepgemm_decision(cap, {"deep_gemm": installed})
    assert d.ok == (installed and cap is not None and cap[0] in (9, 10))
    if cap is not None and cap[0] == 8:
        assert "compute capability 8.0" in d.reason
    if cap is not None and cap[0] == 9 and not installed:
        assert "deep_gemm is not importable" in d.reason


def test_auto_without_variable_prefers_deepgemm():
    choice = fp8_block_auto_choice((9, 0), "13.0", OFF, {"deep_gemm": True, "cutlass_headers": True, "sgl_kernel": True})
    assert choice.backend == "deepgemm" and choice.warnings == ()
    assert any("SGLANG_CUTLASS_MOE=1 is required" in r for r in choice.refusals)


def test_auto_warning_and_forced_error_texts():
    d = cutlass_decision((8, 0), "12.4", ON, HEADERS)
    assert fs.cutlass_warning(d) == (
        "cutlass MoE backend not used: SGLANG_CUTLASS_MOE=1 but the GPU has compute "
        "capability 8.0, not 9.x (the kernel is Hopper sm_90a)"
    )
    assert fs.forced_cutlass_error(d).startswith("backend='cutlass' cannot run: SGLANG_CUTLASS_MOE=1 but")
    d = cutlass_decision((9, 0), "12.2", ON, HEADERS)
    assert "CUDA 12.2 is older than 12.3" in fs.cutlass_warning(d)


# ------------------------------------------------------------------- through the real classes
def _layer(backend):
    from epmoe.layer import DeepEPMoELayer

    return DeepEPMoELayer(8, 2, 128, 128, quant="fp8_block", backend=backend, dispatch="local", device="cpu")


def test_backend_available_uses_machine_facts_on_cpu(monkeypatch):
    from epmoe.experts.cutlass_backend import CutlassBackend

    monkeypatch.delenv("SGLANG_CUTLASS_MOE", raising=False)
    ok, reason = CutlassBackend.available(torch.device("cpu"))
    assert not ok and "SGLANG_CUTLASS_MOE=1 is required" in reason
    monkeypatch.setenv("SGLANG_CUTLASS_MOE", "1")
    ok, reason = CutlassBackend.available(torch.device("cpu"))
    assert not ok and "no CUDA GPU" in reason


def test_auto_on_cpu_warns_and_picks_torch(monkeypatch, caplog):
    from epmoe.experts import cutlass_backend

    monkeypatch.setenv("SGLANG_CUTLASS_MOE", "1")
    monkeypatch.delenv("EPMOE_BACKEND", raising=False)
    cutlass_backend._WARNED.clear()
    with caplog.at_level(logging.INFO, logger="epmoe"):
        layer = _layer("auto")
    assert layer.backend.name == "torch"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert any(
        "cutlass MoE backend not used: SGLANG_CUTLASS_MOE=1 but there is no CUDA GPU" in r.getMessage()
        for r in warnings
    ), [r.getMessage() for r in caplog.records]
    infos = [r.getMessage() for r in caplog.records]
    assert any("'deepgemm' refused" in m for m in infos)


def test_auto_without_variable_does_not_warn(monkeypatch, caplog):
    from epmoe.experts import cutlass_backend

    monkeypatch.delenv("SGLANG_CUTLASS_MOE", raising=False)
    monkeypatch.delenv("EPMOE_BACKEND", raising=False)
    cutlass_backend._WARNED.clear()
    with caplog.at_level(logging.INFO, logger="epmoe"):
        layer = _layer("auto")
    assert layer.backend.name == "torch"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("env, text", [
    (None, "SGLANG_CUTLASS_MOE=1 is required to consider cutlass (SGLANG_CUTLASS_MOE is not set)"),
    ("1", "SGLANG_CUTLASS_MOE=1 but there is no CUDA GPU"),
])  # fmt: skip
def test_forced_cutlass_raises_through_layer(monkeypatch, env, text):
    from epmoe.experts.select import BackendUnavailableError

    if env is None:
        monkeypatch.delenv("SGLANG_CUTLASS_MOE", raising=False)
    else:
        monkeypatch.setenv("SGLANG_CUTLASS_MOE", env)
    with pytest.raises(BackendUnavailableError, match="backend='cutlass' cannot run") as info:
        _layer("cutlass")
    assert text in str(info.value)


def test_forced_deepgemm_raises_on_cpu():
    from epmoe.experts.select import BackendUnavailableError

    with pytest.raises(BackendUnavailableError, match="no CUDA GPU"):
        _layer("deepgemm")


def test_deepgemm_api_shim_resolves_renamed_functions():
    from types import SimpleNamespace

    from epmoe.experts.deepgemm_backend import resolve_api

    calls = []
    fn = lambda *a: calls.append(a)  # noqa: E731
    new = SimpleNamespace(
        m_grouped_fp8_gemm_nt_contiguous=fn, m_grouped_fp8_gemm_nt_masked=fn,
        get_mn_major_tma_aligned_tensor=fn, get_mk_alignment_for_contiguous_layout=lambda: 128,
    )  # fmt: skip
    api = resolve_api(new)
    assert api.names["contiguous"] == "m_grouped_fp8_gemm_nt_contiguous"
    assert api.alignment == 128 and not api.needs_tma_scales
    fp4 = SimpleNamespace(m_grouped_fp8_fp4_gemm_nt_contiguous=fn, m_grouped_fp8_fp4_gemm_nt_masked=fn)
    api = resolve_api(fp4)
    assert api.names["masked"] == "m_grouped_fp8_fp4_gemm_nt_masked" and api.alignment == 128
    legacy = SimpleNamespace(
        m_grouped_gemm_fp8_fp8_bf16_nt_contiguous=fn, m_grouped_gemm_fp8_fp8_bf16_nt_masked=fn,
        get_col_major_tma_aligned_tensor=fn, get_m_alignment_for_contiguous_layout=lambda: 64,
    )  # fmt: skip
    api = resolve_api(legacy)
    assert api.needs_tma_scales and api.alignment == 64
    assert api.names["tma_aligned"] == "get_col_major_tma_aligned_tensor"
    assert resolve_api(SimpleNamespace()).contiguous is None


def test_deepgemm_alignment_query_failure_warns_with_the_value_used(caplog):
    from types import SimpleNamespace

    from epmoe.experts.deepgemm_backend import DEFAULT_ALIGNMENT, resolve_api

    def needs_a_device():
        raise RuntimeError("no CUDA device")

    module = SimpleNamespace(get_mk_alignment_for_contiguous_layout=needs_a_device)
    with caplog.at_level(logging.WARNING, logger="epmoe"):
        api = resolve_api(module)
    assert api.alignment == DEFAULT_ALIGNMENT == 128
    [record] = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert record.getMessage() == (
        "deep_gemm.get_mk_alignment_for_contiguous_layout() failed (RuntimeError: no CUDA device); "
        "the contiguous layout pads each expert segment to 128 rows, epmoe's default, instead of "
        "the alignment it would have returned"
    )


@pytest.fixture
def fresh_extension():
    """``load_extension`` with an empty cache before and after the test: it is memoised per
    process, so a test that loaded (or stood in for) the extension must not decide what a later
    test's call does (issue 22.13)."""
    from epmoe.experts import cutlass_backend as cb

    cb.load_extension.cache_clear()
    yield cb
    cb.load_extension.cache_clear()


def _cached_build(cb, monkeypatch, tmp_path):
    """Stand-in CUTLASS headers and an (empty) cached library for them; ``(name, build, library)``."""
    inc = tmp_path / "include"
    (inc / "cutlass").mkdir(parents=True)
    (inc / "cute").mkdir()
    (inc / "cutlass" / "cutlass.h").write_text("")
    monkeypatch.setenv("EPMOE_CUTLASS_DIR", str(inc))
    monkeypatch.setenv("EPMOE_CACHE_DIR", str(tmp_path / "cache"))
    name, build, library = cb._library(inc)
    build.mkdir(parents=True)
    library.write_bytes(b"")
    return name, build, library


def test_load_extension_takes_a_cached_build_without_compiling(fresh_extension, monkeypatch, tmp_path):
    """A library already in the cache directory is loaded as it is: no compiler is asked for."""
    from torch.utils import cpp_extension

    cb = fresh_extension
    name, build, library = _cached_build(cb, monkeypatch, tmp_path)
    assert build == tmp_path / "cache" / "cutlass" / name
    loaded = []
    monkeypatch.setattr(torch.ops, "load_library", loaded.append)
    monkeypatch.setattr(cpp_extension, "load", lambda *a, **k: pytest.fail("compiled despite a cached build"))
    ops = cb.load_extension()
    assert loaded == [str(library)] and ops is getattr(torch.ops, name)


def test_load_extension_does_not_load_a_second_copy(fresh_extension, monkeypatch, tmp_path):
    """Ops already registered in this process (the library loaded from another cache directory,
    as a test module with its own build does) are returned as they are: loading a second copy of
    the library would register them again, which aborts the process inside torch."""
    cb = fresh_extension
    name, build, library = _cached_build(cb, monkeypatch, tmp_path)
    monkeypatch.setattr(torch.ops, "load_library", lambda path: pytest.fail(f"loaded {path} a second time"))
    assert not cb._registered(name)
    lib = torch.library.Library(name, "DEF")  # stands in for the copy loaded earlier
    lib.define("workspace_size(Tensor x) -> int")
    try:
        assert cb._registered(name)
        assert cb.load_extension() is getattr(torch.ops, name)
    finally:
        lib._destroy()


def test_cutlass_headers_lookup_and_error(fresh_extension, monkeypatch, tmp_path):
    from epmoe.experts import cutlass_backend as cb

    monkeypatch.setenv("EPMOE_CUTLASS_DIR", str(tmp_path))
    assert cb.find_cutlass_include() is None
    with pytest.raises(cb.CutlassUnavailableError) as info:
        cb.load_extension()
    text = str(info.value)
    assert "CUTLASS headers not found" in text and "pip install nvidia-cutlass" in text
    assert "EPMOE_CUTLASS_DIR" in text
    # A checkout (include/ below it) and an include directory itself are both accepted.
    inc = tmp_path / "include"
    (inc / "cutlass").mkdir(parents=True)
    (inc / "cute").mkdir()
    (inc / "cutlass" / "cutlass.h").write_text("")
    assert cb.find_cutlass_include() == inc
    monkeypatch.setenv("EPMOE_CUTLASS_DIR", str(inc))
    assert cb.find_cutlass_include() == inc
    monkeypatch.delenv("EPMOE_CUTLASS_DIR")
    import importlib.util

    if importlib.util.find_spec("cutlass_library") is None:
        assert cb.find_cutlass_include() is None
        assert "cutlass_library package is not installed" in cb._headers_error()


def test_cutlass_backend_refuses_masked_layout():
    from epmoe.experts.cutlass_backend import CutlassBackend
    from epmoe.quant import get_scheme

    ok, reason = CutlassBackend.supports(get_scheme("fp8_block"), "masked", torch.device("cpu"), 256, 128)
    assert not ok and "masked" in reason
    ok, reason = CutlassBackend.supports(get_scheme("bf16"), "contiguous", torch.device("cpu"), 256, 128)
    assert not ok and "bf16" in reason


def test_cutlass_int8_needs_int32_accumulator_and_headers(monkeypatch, tmp_path):
    from epmoe.experts import cutlass_backend as cb
    from epmoe.experts.select import AUTO_ORDER, select_backend
    from epmoe.quant import get_scheme

    int8 = get_scheme("int8_channel")
    with pytest.raises(ValueError, match="accumulator='int32' only"):
        cb.CutlassBackend(int8)
    backend = cb.CutlassBackend(int8, accumulator="int32")
    assert backend.alignment == cb.ROW_BLOCK and backend.device_segments
    assert cb.CutlassBackend(get_scheme("fp8_block")).device_segments  # FP8 skips spare rows too
    assert backend.prefers_host_sizes and not cb.CutlassBackend(get_scheme("fp8_block")).prefers_host_sizes
    assert AUTO_ORDER["int8_channel"][0] == "cutlass"
    cpu = torch.device("cpu")
    # Without SGLANG_CUTLASS_MOE (or without a GPU) the machine rule refuses first.
    ok, reason = cb.CutlassBackend.supports(int8, "contiguous", cpu, 256, 128, accumulator="int32")
    assert not ok and "SGLANG_CUTLASS_MOE" in reason
    # The INT8 conditions past the machine rule.
    monkeypatch.setattr(cb.CutlassBackend, "available", classmethod(lambda cls, device: (True, "machine ok")))
    ok, reason = cb.CutlassBackend.supports(int8, "contiguous", cpu, 256, 128)
    assert not ok and "accumulator='int32' only" in reason
    ok, reason = cb.CutlassBackend.supports(int8, "contiguous", cpu, 200, 136, accumulator="int32")
    assert not ok and "multiples of 16" in reason and "hidden=200" in reason
    monkeypatch.setattr(cb, "find_cutlass_include", lambda: None)
    ok, reason = cb.CutlassBackend.supports(int8, "contiguous", cpu, 256, 128, accumulator="int32")
    assert not ok and "CUTLASS headers not found" in reason
    monkeypatch.setattr(cb, "own_kernel_missing", lambda: None)
    ok, reason = cb.CutlassBackend.supports(int8, "contiguous", cpu, 256, 128, accumulator="int32")
    assert ok and reason == "machine ok: epmoe's CUTLASS INT8 kernel"
    # auto with the fp32 accumulator walks past cutlass with the accumulator as the reason.
    cls, lines = select_backend("auto", int8, frozenset({"contiguous"}), cpu, 256, 128, "fp32")
    assert cls is not cb.CutlassBackend
    assert any("'cutlass' refused" in line and "accumulator='int32' only" in line for line in lines), lines
    # auto on a GPU-only backend is refused on CPU; forced, the accumulator decides.
    cls, _ = select_backend("cutlass", int8, frozenset({"contiguous"}), cpu, 256, 128, "int32")
    assert cls is cb.CutlassBackend
    with pytest.raises(RuntimeError, match="accumulator='int32' only"):
        select_backend("cutlass", int8, frozenset({"contiguous"}), cpu, 256, 128, "fp32")


def test_own_kernel_missing_says_headers_then_compiler(monkeypatch, tmp_path):
    from torch.utils import cpp_extension

    from epmoe.experts import cutlass_backend as cb

    monkeypatch.setattr(cb, "find_cutlass_include", lambda: None)
    assert "CUTLASS headers not found" in cb.own_kernel_missing()
    monkeypatch.setattr(cb, "find_cutlass_include", lambda: tmp_path)
    monkeypatch.setenv("EPMOE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    assert "CUDA_HOME is not set" in cb.own_kernel_missing()
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(tmp_path))
    assert cb.own_kernel_missing() is None  # a compiler: the first use builds it
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    name = f"epmoe_cutlass_fp8_{cb._build_key(tmp_path)}"
    (tmp_path / "cache" / "cutlass" / name).mkdir(parents=True)
    (tmp_path / "cache" / "cutlass" / name / f"{name}.so").write_bytes(b"")
    assert cb.own_kernel_missing() is None  # a cached build needs no compiler


def test_int8_grouped_gemm_checks_host_offsets():
    from epmoe.experts import cutlass_backend as cb

    a = torch.zeros(256, 32, dtype=torch.int8)
    b = torch.zeros(2, 16, 32, dtype=torch.int8)
    with pytest.raises(ValueError, match="non-decreasing multiples of 128"):
        cb.int8_grouped_gemm(
            a, torch.ones(256, 1), b, torch.ones(2, 16, 1), torch.tensor([0, 100, 256], dtype=torch.int32)
        )


def _int8_operands(m=256, k=128, n=64, e=2):
    return dict(a=torch.zeros(m, k, dtype=torch.int8), a_scale=torch.ones(m, 1), b=torch.zeros(e, n, k, dtype=torch.int8),
                b_scale=torch.ones(e, n, 1), expert_offsets=torch.tensor([0, 128, 256], dtype=torch.int32))  # fmt: skip


def _fp8_operands(m=256, k=256, n=128, e=2):
    f8 = torch.float8_e4m3fn
    return dict(a=torch.zeros(m, k, dtype=f8), a_scale=torch.ones(m, k // 128), b=torch.zeros(e, n, k, dtype=f8),
                b_scale=torch.ones(e, n // 128, k // 128), expert_offsets=torch.tensor([0, 128, 256], dtype=torch.int32))  # fmt: skip


def _int8_block_operands(m=256, k=256, n=128, e=2):
    return dict(a=torch.zeros(m, k, dtype=torch.int8), a_scale=torch.ones(m, k // 128), b=torch.zeros(e, n, k, dtype=torch.int8),
                b_scale=torch.ones(e, n // 128, k // 128), expert_offsets=torch.tensor([0, 128, 256], dtype=torch.int32))  # fmt: skip


def _int8_block_masked_operands(e=2, max_m=128, k=256, n=128):
    return dict(a=torch.zeros(e, max_m, k, dtype=torch.int8), a_scale=torch.ones(e, max_m, k // 128),
                b=torch.zeros(e, n, k, dtype=torch.int8), b_scale=torch.ones(e, n // 128, k // 128),
                masked_m=torch.tensor([3, 128], dtype=torch.int32))  # fmt: skip


def _int8_masked_operands(e=2, max_m=128, k=128, n=64):
    return dict(a=torch.zeros(e, max_m, k, dtype=torch.int8), a_scale=torch.ones(e, max_m, 1),
                b=torch.zeros(e, n, k, dtype=torch.int8), b_scale=torch.ones(e, n, 1),
                masked_m=torch.tensor([0, 100], dtype=torch.int32))  # fmt: skip


_BAD_OPERANDS = [
    # (wrapper, operands, changes, error, message)
    ("int8", _int8_operands, lambda o: dict(a=o["a"][:, :0], b=o["b"][:, :, :0].contiguous()), ValueError,
     "K=0 must be a positive multiple of 16"),
    ("int8", _int8_operands, lambda o: dict(b=o["b"][:, :0], b_scale=o["b_scale"][:, :0]), ValueError,
     r"N=0 \(b \(2, 0, 128\)\) must be a positive multiple of 8"),
    ("int8", _int8_operands, lambda o: dict(b_scale=torch.ones(64, 2)), ValueError,
     r"b_scale has shape \(64, 2\); allowed: \(2, 64, 1\) or \(2, 64\)"),
    ("int8", _int8_operands, lambda o: dict(a_scale=torch.ones(256, 4)), ValueError, r"a_scale has shape \(256, 4\)"),
    ("int8", _int8_operands, lambda o: dict(a=o["a"].float()), TypeError, "a must be torch.int8"),
    ("int8", _int8_operands, lambda o: dict(b_scale=o["b_scale"].double()), TypeError, "b_scale must be torch.float32"),
    ("int8", _int8_operands, lambda o: dict(a=torch.zeros(256, 96, dtype=torch.int8)), ValueError,
     r"a has K=96 but b \(2, 64, 128\) has K=128"),
    ("int8", _int8_operands, lambda o: dict(a=torch.zeros(256, 120, dtype=torch.int8), b=torch.zeros(2, 64, 120, dtype=torch.int8)),
     ValueError, "K=120 must be a positive multiple of 16"),
    ("int8", _int8_operands, lambda o: dict(b=o["b"].transpose(1, 2).contiguous().transpose(1, 2)), ValueError,
     "b must be contiguous"),
    ("int8", _int8_operands, lambda o: dict(expert_offsets=torch.tensor([0, 256], dtype=torch.int32)), ValueError,
     r"expert_offsets must be \[E\+1\] = \[3\]"),
    ("int8", _int8_operands, lambda o: dict(out=torch.empty(256, 64)), ValueError, "out must be a contiguous bf16"),
    ("int8", _int8_operands, lambda o: dict(max_swizzle=16), ValueError,
     "int8_grouped_gemm: max_swizzle=16; allowed: 1, 2, 4 or 8"),
    ("int8", _int8_operands, lambda o: {}, ValueError, "a must be a CUDA tensor"),
    ("fp8", _fp8_operands, lambda o: dict(a=o["a"][:, :0], a_scale=o["a_scale"][:, :0], b=o["b"][:, :, :0].contiguous(),
                                          b_scale=o["b_scale"][:, :, :0].contiguous()), ValueError,
     "K=0 must be a positive multiple of 128"),
    ("fp8", _fp8_operands, lambda o: dict(b=torch.zeros(2, 200, 256, dtype=torch.float8_e4m3fn)), ValueError,
     "N=200 .* must be a positive multiple of 128"),
    ("fp8", _fp8_operands, lambda o: dict(b_scale=torch.ones(2, 2, 1)), ValueError,
     r"b_scale has shape \(2, 2, 1\); allowed: \(2, 1, 2\)"),
    ("fp8", _fp8_operands, lambda o: {}, ValueError, "a must be a CUDA tensor"),
    # block scales already on the kernel's 64-column grid pass the checks (prepare_weights makes them)
    ("fp8", _fp8_operands, lambda o: dict(b_scale=torch.ones(2, 2, 2)), ValueError, "a must be a CUDA tensor"),
    ("fp8", _fp8_operands, lambda o: dict(b_scale=torch.ones(2, 4, 2)), ValueError,
     r"b_scale has shape \(2, 4, 2\); allowed: \(2, 1, 2\) or \(2, 2, 2\)"),
    ("fp8", _fp8_operands, lambda o: dict(impl="cublas"), ValueError, r"impl='cublas'; allowed: \['auto', 'sgl', 'epmoe'\]"),
    # int8_block: K (and N) in whole 128-wide scale blocks
    ("int8_block", _int8_block_operands, lambda o: dict(a=torch.zeros(256, 200, dtype=torch.int8), a_scale=torch.ones(256, 2),
                                                        b=torch.zeros(2, 128, 200, dtype=torch.int8), b_scale=torch.ones(2, 1, 2)),
     ValueError, "int8_block_grouped_gemm: K=200 must be a positive multiple of 128"),
    ("int8_block", _int8_block_operands, lambda o: dict(a=o["a"][:, :0], a_scale=o["a_scale"][:, :0], b=o["b"][:, :, :0].contiguous(),
                                                        b_scale=o["b_scale"][:, :, :0].contiguous()), ValueError,
     "K=0 must be a positive multiple of 128"),
    ("int8_block", _int8_block_operands, lambda o: dict(b=torch.zeros(2, 192, 256, dtype=torch.int8)), ValueError,
     "N=192 .* must be a positive multiple of 128"),
    ("int8_block", _int8_block_operands, lambda o: dict(a_scale=torch.ones(256, 1)), ValueError,
     r"a_scale has shape \(256, 1\); allowed: \(256, 2\)"),
    ("int8_block", _int8_block_operands, lambda o: dict(b_scale=torch.ones(2, 128, 1)), ValueError,
     r"b_scale has shape \(2, 128, 1\); allowed: \(2, 1, 2\)"),
    ("int8_block", _int8_block_operands, lambda o: dict(a=o["a"].to(torch.float8_e4m3fn)), TypeError, "a must be torch.int8"),
    # the weight scales as stored, one per 128 columns, on every variant (no 64-column grid)
    ("int8_block", _int8_block_operands, lambda o: dict(b_scale=torch.ones(2, 2, 2), schedule="n256_quarters_run2"),
     ValueError, r"b_scale has shape \(2, 2, 2\); allowed: \(2, 1, 2\) \("),
    ("int8_block_masked", _int8_block_masked_operands, lambda o: dict(b_scale=torch.ones(2, 2, 2)),
     ValueError, r"b_scale has shape \(2, 2, 2\); allowed: \(2, 1, 2\) \("),
    ("int8_block", _int8_block_operands, lambda o: dict(expert_offsets=torch.tensor([0, 100, 256], dtype=torch.int32)),
     ValueError, "non-decreasing multiples of 128"),
    ("int8_block", _int8_block_operands, lambda o: {}, ValueError, "a must be a CUDA tensor"),
    ("int8_block", _int8_block_operands, lambda o: dict(schedule="pingpong"), ValueError,
     r"schedule='pingpong'; allowed: \['n256_quarters_i2f_s4', 'n256_quarters_run2', 'n256_quarters_run4'\]"),
    # the masked layout: whole 128-row blocks per expert, masked_m within them, the kind's scales
    ("int8_block_masked", _int8_block_masked_operands,
     lambda o: dict(a=torch.zeros(2, 96, 256, dtype=torch.int8), a_scale=torch.ones(2, 96, 2)), ValueError,
     r"max_m=96 rows per expert; the kernel needs a multiple of 128 \(pad the capacity"),
    ("int8_block_masked", _int8_block_masked_operands, lambda o: dict(masked_m=torch.tensor([3, 129], dtype=torch.int32)),
     ValueError, r"masked_m must lie between 0 and max_m=128; got \[3, 129\]"),
    ("int8_block_masked", _int8_block_masked_operands, lambda o: dict(masked_m=torch.tensor([3], dtype=torch.int32)),
     ValueError, r"masked_m must be \[E\] = \[2\]"),
    ("int8_block_masked", _int8_block_masked_operands, lambda o: dict(masked_m=torch.tensor([3.0, 1.0])), TypeError,
     "masked_m must be an integer tensor"),
    ("int8_block_masked", _int8_block_masked_operands, lambda o: dict(a_scale=torch.ones(2, 128, 1)), ValueError,
     r"a_scale has shape \(2, 128, 1\); allowed: \(2, 128, 2\)"),
    ("int8_block_masked", _int8_block_masked_operands, lambda o: dict(b=torch.zeros(3, 128, 256, dtype=torch.int8)),
     ValueError, "a must be \\[E, max_m, K\\] and b \\[E, N, K\\] with the same E"),
    ("int8_block_masked", _int8_block_masked_operands, lambda o: dict(b_scale=torch.ones(2, 128, 2)), ValueError,
     r"b_scale has shape \(2, 128, 2\); allowed: \(2, 1, 2\)"),
    ("int8_block_masked", _int8_block_masked_operands, lambda o: dict(out=torch.empty(2, 128, 128)), ValueError,
     r"out must be a contiguous bf16 \[E, max_m, N\] = \[2, 128, 128\]"),
    ("int8_block_masked", _int8_block_masked_operands, lambda o: dict(schedule="x"), ValueError, "schedule='x'"),
    ("int8_block_masked", _int8_block_masked_operands, lambda o: {}, ValueError, "a must be a CUDA tensor"),
    ("int8_masked", _int8_masked_operands, lambda o: dict(a_scale=torch.ones(2, 128, 2)), ValueError,
     r"a_scale has shape \(2, 128, 2\); allowed: \(2, 128, 1\)"),
    ("int8_masked", _int8_masked_operands, lambda o: dict(a=torch.zeros(2, 128, 120, dtype=torch.int8),
                                                          b=torch.zeros(2, 64, 120, dtype=torch.int8)),
     ValueError, "K=120 must be a positive multiple of 16"),
    ("int8_masked", _int8_masked_operands, lambda o: {}, ValueError, "a must be a CUDA tensor"),
]  # fmt: skip


@pytest.mark.parametrize("wrapper, operands, change, error, message", _BAD_OPERANDS)
def test_cutlass_gemm_wrappers_refuse_bad_operands_before_loading(monkeypatch, wrapper, operands, change, error, message):
    """Issue 22.12: every refusal happens in Python before the extension is loaded (here there is
    none: loading it fails the test)."""
    from epmoe.experts import cutlass_backend as cb

    monkeypatch.setattr(cb, "load_extension", lambda *a, **k: pytest.fail("the extension was loaded"))
    fn = {"int8": cb.int8_grouped_gemm, "fp8": cb.grouped_gemm, "int8_block": cb.int8_block_grouped_gemm,
          "int8_block_masked": cb.int8_block_masked_gemm, "int8_masked": cb.int8_masked_gemm}[wrapper]  # fmt: skip
    o = operands()
    with pytest.raises(error, match=message):
        fn(**{**o, **change(o)})


def test_cutlass_offsets_must_be_row_blocks():
    from epmoe.experts.cutlass_backend import ROW_BLOCK, check_block_offsets

    check_block_offsets(torch.tensor([0, 0, ROW_BLOCK, 3 * ROW_BLOCK], dtype=torch.int32), 3 * ROW_BLOCK + 5)
    check_block_offsets(torch.tensor([0], dtype=torch.int32), 0)
    for bad, rows in (([0, 1, 128], 128), ([0, 128, 129], 256), ([64, 128, 256], 256),
                      ([0, 256, 128], 256), ([-128, 0, 128], 256), ([0, 128, 384], 300)):  # fmt: skip
        with pytest.raises(ValueError, match=f"non-decreasing multiples of {ROW_BLOCK}") as info:
            check_block_offsets(torch.tensor(bad, dtype=torch.int32), rows)
        assert str(bad) in str(info.value) and f"the {rows} rows" in str(info.value)


def test_cutlass_grouped_gemm_refuses_too_many_rows():
    from epmoe.experts import cutlass_backend as cb

    a = torch.empty(1, 128, dtype=torch.float8_e4m3fn).expand(cb.MAX_ROWS, 128)  # one row stored
    with pytest.raises(ValueError, match=f"fewer than {cb.MAX_ROWS}"):
        cb.grouped_gemm(a, None, torch.empty(1, 128, 128, dtype=torch.float8_e4m3fn), None,
                        torch.zeros(2, dtype=torch.int32))  # fmt: skip


# ------------------------------------------------- backend plumbing with stand-in GEMMs (CPU)
def _dequant(q, s):
    from epmoe.quant.reference import dequantize_rows

    return dequantize_rows(q, s)


def _fake_deep_gemm():
    """DeepGEMM's contiguous/masked contract in plain torch (fp32 math, bf16 output)."""
    from types import SimpleNamespace

    from epmoe.quant.reference import dequantize_weight

    def contiguous(a, b, d, m_indices):
        x = _dequant(*a)
        w = dequantize_weight(*b)
        for g in torch.unique(m_indices[m_indices >= 0]).tolist():
            rows = m_indices == g
            d[rows] = (x[rows] @ w[g].t()).to(d.dtype)

    def masked(a, b, d, masked_m, expected_m):
        assert expected_m >= 1
        # The real SM90 kernels return wrong groups for a capacity off the 128-row block (seen on
        # an H200): the backend must pad before calling.
        assert d.shape[1] % 128 == 0 and a[0].shape[1] % 128 == 0, d.shape
        x = _dequant(*a)
        w = dequantize_weight(*b)
        for g, m in enumerate(masked_m.tolist()):
            d[g, :m] = (x[g, :m] @ w[g].t()).to(d.dtype)

    return SimpleNamespace(
        m_grouped_fp8_gemm_nt_contiguous=contiguous, m_grouped_fp8_gemm_nt_masked=masked,
        get_mk_alignment_for_contiguous_layout=lambda: 128,
    )  # fmt: skip


def cb_group_n() -> int:
    from epmoe.experts.cutlass_backend import WEIGHT_SCALE_GROUP_N

    return WEIGHT_SCALE_GROUP_N


def test_cutlass_fp8_prepares_weight_scales_on_the_kernel_grid_once(monkeypatch):
    """FP8 on the project's kernel: each 128x128 block scale repeated for its two 64-column groups
    (what the kernel would otherwise repeat in every GEMM call); with sgl-kernel's op, or for
    INT8 (whose small batches run on the Triton GEMMs), the checkpoint's grid."""
    from epmoe.experts import cutlass_backend as cb
    from epmoe.experts.base import ExpertWeights
    from epmoe.quant import get_scheme
    from epmoe.quant.reference import quantize_weight

    fp8 = get_scheme("fp8_block")
    g = torch.Generator().manual_seed(0)
    (q13, s13), (q2, s2) = (quantize_weight(torch.randn(*shape, generator=g), fp8) for shape in ((2, 256, 384), (2, 384, 128)))
    weights = ExpertWeights(fp8, q13, q2, s13, s2)
    monkeypatch.setattr(cb, "_use_sgl", lambda: False)
    prepared = cb.CutlassBackend(fp8).prepare_weights(weights)
    assert prepared.w13_scale.shape == (2, 4, 3) and prepared.w2_scale.shape == (2, 6, 1)
    assert torch.equal(prepared.w13_scale[:, ::2], s13) and torch.equal(prepared.w13_scale[:, 1::2], s13)
    assert torch.equal(prepared.w2_scale[:, 1::2], s2) and prepared.w13 is q13
    monkeypatch.setattr(cb, "_use_sgl", lambda: True)
    assert cb.CutlassBackend(fp8).prepare_weights(weights).w13_scale.shape == s13.shape
    with pytest.raises(ValueError, match=r"sgl-kernel's FP8 op takes one weight scale per 128x128 block"):
        cb._refuse_repeated_for_sgl(q13, prepared.w13_scale)


def test_cutlass_act_scales_pass_through_when_mn_major():
    """MN-major activation scales (strides (1, M rounded up to 4)) reach the kernel as they are;
    any other layout is made row-major contiguous (the kernel transposes it)."""
    from epmoe.experts.cutlass_backend import is_mn_major, kernel_act_scale
    from epmoe.kernels.common import mn_major_scales

    mn = mn_major_scales(6, 3, "cpu")
    assert mn.shape == (6, 3) and is_mn_major(mn) and kernel_act_scale(mn) is mn
    row = torch.ones(6, 3)
    assert not is_mn_major(row) and kernel_act_scale(row) is row
    col = torch.ones(6, 1)  # strides (1, 1): row-major, not a transposed [1, 8] buffer
    assert not is_mn_major(col)
    other = torch.ones(3, 6).t()  # transposed but not padded to 4 rows: copied
    assert not is_mn_major(other) and kernel_act_scale(other).is_contiguous()


def _fake_grouped_gemm(a, a_scale, b, b_scale, expert_offsets, out=None, *, impl="auto"):
    from epmoe.experts.cutlass_backend import FP8_IMPLS, check_block_offsets
    from epmoe.quant.reference import dequantize_weight

    check_block_offsets(expert_offsets, a.shape[0])  # what the real kernel needs of its layout
    # The backend passes the implementation it resolved when it was built (no environment read per call).
    assert impl in FP8_IMPLS and impl != "auto", impl

    x = _dequant(a, a_scale)
    if b_scale.shape[1] * cb_group_n() == b.shape[1]:  # prepare_weights' repeated grid: one per 128 back
        b_scale = b_scale[:, :: 128 // cb_group_n()]
    w = dequantize_weight(b, b_scale)
    out = torch.empty(a.shape[0], b.shape[1], dtype=torch.bfloat16) if out is None else out
    offs = expert_offsets.tolist()
    for e in range(b.shape[0]):
        if offs[e + 1] > offs[e]:
            out[offs[e] : offs[e + 1]] = (x[offs[e] : offs[e + 1]] @ w[e].t()).to(out.dtype)
    return out


PE, PK, PH, PI = 4, 2, 256, 128


def _plumbing_case():
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from cases import make_case
    from helpers import make_weights

    from epmoe.experts.base import ExpertWeights
    from epmoe.quant import get_scheme

    stored, (w13, w2) = make_weights(PE, PH, PI, "fp8_block")
    x, ids, w = make_case("empty_experts", 0, PE, PK, PH)
    return ExpertWeights(get_scheme("fp8_block"), *stored), (w13, w2), x, ids, w


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter on CPU")
@pytest.mark.parametrize("name", ["deepgemm", "cutlass"])
# GEMM1 leaves padding rows unwritten (as DeepGEMM does), so SiLU * up may meet arbitrary bits
# there and NumPy warns; the gather never reads those rows, which the result check covers.
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_backend_plumbing_contiguous(monkeypatch, name):
    from reference import moe_reference, rel_err

    from epmoe.experts import cutlass_backend as cb
    from epmoe.experts import deepgemm_backend as dgb
    from epmoe.layouts import gather_weighted, to_contiguous

    api = dgb.resolve_api(_fake_deep_gemm())
    monkeypatch.setattr(dgb, "deep_gemm_api", lambda: api)
    monkeypatch.setattr(cb, "grouped_gemm", _fake_grouped_gemm)
    weights, (w13, w2), x, ids, w = _plumbing_case()
    backend = (dgb.DeepGemmBackend if name == "deepgemm" else cb.CutlassBackend)(weights.scheme)
    assert backend.alignment == 128
    weights = backend.prepare_weights(weights)
    # EPMOE_CUTLASS_IMPL is resolved when the backend is built: a forward that read it again
    # would raise on this value.
    monkeypatch.setenv("EPMOE_CUTLASS_IMPL", "read-per-call")
    ref = moe_reference(x, ids, w, w13, w2, "fp8_block")
    for payload in ("float", "fp8"):
        xs = None
        xin = x
        if payload == "fp8":
            from epmoe.quant.reference import quantize_rows

            xin, xs = quantize_rows(x, torch.float8_e4m3fn, 448.0, 128)
        # CUTLASS also takes a batch whose segment sizes stayed on the device (spare rows past
        # the last segment, skipped by the row-wise stages, never written by the GEMMs).
        for hint in (None, 2) if name == "cutlass" else (None,):
            batch = to_contiguous(xin, xs, ids, PE, backend.alignment, expected_m=hint)
            assert (batch.expected_m is not None) == (hint is not None)
            out = backend.run_contiguous(batch, weights, torch.float32)
            assert out.dtype == torch.float32 and out.shape == (batch.x.shape[0], PH)
            got = gather_weighted(out, batch.slot_pos, w)
            assert rel_err(got, ref) < 2e-2, (payload, hint, rel_err(got, ref))


def _fake_int8_grouped_gemm(a, a_scale, b, b_scale, expert_offsets, out=None):
    """The project's INT8 kernel's contract in float64: exact integer products, scales after."""
    from epmoe.experts.cutlass_backend import check_block_offsets

    check_block_offsets(expert_offsets, a.shape[0])
    assert a.dtype == b.dtype == torch.int8 and a_scale.numel() == a.shape[0]
    out = torch.full((a.shape[0], b.shape[1]), float("nan"), dtype=torch.bfloat16) if out is None else out
    offs = expert_offsets.tolist()
    for e in range(b.shape[0]):
        lo, hi = offs[e], offs[e + 1]
        if hi > lo:
            acc = a[lo:hi].double() @ b[e].double().t()
            scaled = acc * a_scale.reshape(-1, 1)[lo:hi].double() * b_scale[e].reshape(1, -1).double()
            out[lo:hi] = scaled.to(out.dtype)
    return out


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter on CPU")
@pytest.mark.parametrize("spare", [False, True], ids=["exact", "spare_rows"])
def test_cutlass_int8_plumbing_contiguous(monkeypatch, spare):
    """The INT8 path around the kernel: Triton's row-wise stages, 128-row segments, and (with
    ``expected_m``) spare rows past the last segment, which nothing reads."""
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from cases import make_case
    from helpers import make_weights
    from reference import moe_reference, rel_err

    from epmoe.experts import cutlass_backend as cb
    from epmoe.experts.base import ExpertWeights
    from epmoe.layouts import _to_contiguous_kernels, gather_weighted
    from epmoe.quant import get_scheme
    from epmoe.quant.reference import quantize_rows

    monkeypatch.setattr(cb, "int8_grouped_gemm", _fake_int8_grouped_gemm)
    stored, (w13, w2) = make_weights(PE, PH, PI, "int8_channel")
    x, ids, w = make_case("empty_experts", 0, PE, PK, PH)
    backend = cb.CutlassBackend(get_scheme("int8_channel"), accumulator="int32")
    weights = backend.prepare_weights(ExpertWeights(get_scheme("int8_channel"), *stored))
    ref = moe_reference(x, ids, w, w13, w2, "int8_channel")
    for xin, xs in ((x, None), quantize_rows(x, torch.int8, 127.0, None)):
        # The Triton scatter (the GPU path, here under the interpreter): with expected_m it keeps
        # the segment sizes on the device and leaves spare rows past the last segment.
        batch = _to_contiguous_kernels(xin, xs, ids, PE, backend.alignment, None, expected_m=4 if spare else None)
        assert (batch.expected_m is not None) == spare
        assert not spare or batch.x.shape[0] > int(batch.expert_offsets[-1])
        out = backend.run_contiguous(batch, weights, torch.float32)
        assert out.dtype == torch.float32 and out.shape == (batch.x.shape[0], PH)
        got = gather_weighted(out, batch.slot_pos, w)
        assert rel_err(got, ref) < get_scheme("int8_channel").rel_error_bound, rel_err(got, ref)


def _fake_int8_block_grouped_gemm(a, a_scale, b, b_scale, expert_offsets, out=None, *, schedule):
    """The INT8 block kernel's contract in float64: each 128-wide K block an exact integer sum,
    scaled by the row's 1x128 scale times the 128x128 weight block's, the blocks added."""
    from epmoe.experts.cutlass_backend import INT8_BLOCK_SCHEDULES, check_block_offsets

    assert schedule in INT8_BLOCK_SCHEDULES
    check_block_offsets(expert_offsets, a.shape[0])
    m, k = a.shape
    e, n, _ = b.shape
    assert a.dtype == b.dtype == torch.int8 and k % 128 == 0 and n % 128 == 0
    assert a_scale.shape == (m, k // 128) and b_scale.shape == (e, n // 128, k // 128)
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16) if out is None else out
    offs = expert_offsets.tolist()
    for x in range(e):
        lo, hi = offs[x], offs[x + 1]
        if hi > lo:
            acc = torch.zeros(hi - lo, n, dtype=torch.float64)
            for kb in range(k // 128):
                cols = slice(kb * 128, (kb + 1) * 128)
                block = a[lo:hi, cols].double() @ b[x, :, cols].double().t()
                acc += block * a_scale[lo:hi, kb : kb + 1].double() * b_scale[x, :, kb].double().repeat_interleave(128)
            out[lo:hi] = acc.to(out.dtype)
    return out


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter on CPU")
@pytest.mark.parametrize("spare", [False, True], ids=["exact", "spare_rows"])
def test_cutlass_int8_block_plumbing_contiguous(monkeypatch, spare):
    """int8_block on the cutlass backend around a stand-in kernel: Triton's 1x128 quantization
    and requantization, the block kernel's operands ([M, K/128] and [E, N/128, K/128] scales),
    128-row segments and spare rows."""
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from cases import make_case
    from helpers import make_weights
    from reference import moe_reference, rel_err

    from epmoe.experts import cutlass_backend as cb
    from epmoe.experts.base import ExpertWeights
    from epmoe.layouts import _to_contiguous_kernels, gather_weighted
    from epmoe.quant import get_scheme
    from epmoe.quant.reference import quantize_rows

    block = get_scheme("int8_block")
    schedules, asked = [], []

    def gemm(*args, schedule, **kw):
        schedules.append(schedule)
        return _fake_int8_block_grouped_gemm(*args, schedule=schedule, **kw)

    def measured(device):  # the schedule is looked up for the weights' device, here the host
        asked.append(torch.device(device))
        return "n256_quarters_i2f_s4"  # no fused build: GEMM1 and the activation apart

    monkeypatch.setattr(cb, "int8_block_grouped_gemm", gemm)
    monkeypatch.setattr(cb, "int8_grouped_gemm", lambda *a, **k: pytest.fail("the channel kernel ran for int8_block"))
    monkeypatch.delenv(cb.INT8_BLOCK_SCHEDULE_ENV, raising=False)
    monkeypatch.setattr(cb, "measured_or_default_schedule", measured)
    stored, (w13, w2) = make_weights(PE, PH, PI, "int8_block")
    x, ids, w = make_case("empty_experts", 0, PE, PK, PH)
    backend = cb.CutlassBackend(block)
    assert backend.int8 and backend.alignment == cb.ROW_BLOCK and backend.device_segments
    weights = backend.prepare_weights(ExpertWeights(block, *stored))
    ref = moe_reference(x, ids, w, w13, w2, "int8_block")
    for xin, xs in ((x, None), quantize_rows(x, torch.int8, 127.0, 128)):
        batch = _to_contiguous_kernels(xin, xs, ids, PE, backend.alignment, None, expected_m=4 if spare else None)
        assert (batch.expected_m is not None) == spare
        out = backend.run_contiguous(batch, weights, torch.float32)
        assert out.dtype == torch.float32 and out.shape == (batch.x.shape[0], PH)
        got = gather_weighted(out, batch.slot_pos, w)
        assert rel_err(got, ref) < block.rel_error_bound, rel_err(got, ref)
    assert schedules == ["n256_quarters_i2f_s4"] * 4 and set(asked) == {torch.device("cpu")}, (schedules, asked)


def _fake_masked(contiguous_fake, calls):
    """A masked-layout stand-in built on a contiguous one: the 128-row blocks of each expert's
    slab that hold valid rows (masked_m[e]) are computed as a segment, the rest stay NaN. It
    checks what the real kernels need (max_m a multiple of 128) and records the schedule it was
    given."""

    def masked(a, a_scale, b, b_scale, masked_m, out=None, **kw):
        e, max_m, k = a.shape
        assert max_m % 128 == 0, a.shape
        calls.append(kw.get("schedule"))
        flat = torch.full((e * max_m, b.shape[1]), float("nan"), dtype=torch.bfloat16)
        for x, rows in enumerate(masked_m.tolist()):
            rows = -(-rows // 128) * 128  # whole blocks, as the kernel's tiles
            if rows:
                lo = x * max_m
                sub = torch.tensor([0] * (x + 1) + [rows] * (e - x), dtype=torch.int32)
                part = contiguous_fake(a.reshape(e * max_m, k)[lo : lo + rows], a_scale.reshape(e * max_m, -1)[lo : lo + rows],
                                       b, b_scale, sub, **kw)  # fmt: skip
                flat[lo : lo + rows] = part
        result = flat.view(e, max_m, -1)
        return result if out is None else out.copy_(result)

    return masked


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter on CPU")
@pytest.mark.parametrize("scheme_name", ["int8_channel", "int8_block"])
def test_cutlass_int8_plumbing_masked(monkeypatch, scheme_name):
    """The cutlass backend's INT8 masked pass around stand-in kernels: Triton's row-wise stages on
    the valid rows, a capacity off the 128-row block padded for the kernels and cut back, the
    backend's schedule (the environment's, read when it is built) given to the block kernel;
    a hint below the crossover runs the Triton backend's masked pass instead."""
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from cases import make_case
    from helpers import make_weights
    from reference import moe_reference, rel_err

    from epmoe.experts import cutlass_backend as cb
    from epmoe.experts.base import ExpertWeights
    from epmoe.layouts import gather_weighted, to_masked
    from epmoe.quant import get_scheme

    scheme = get_scheme(scheme_name)
    calls = []
    monkeypatch.setattr(cb, "int8_block_masked_gemm", _fake_masked(_fake_int8_block_grouped_gemm, calls))
    monkeypatch.setattr(cb, "int8_masked_gemm", _fake_masked(_fake_int8_grouped_gemm, calls))
    monkeypatch.setenv(cb.INT8_BLOCK_SCHEDULE_ENV, "n256_quarters_i2f_s4")
    stored, (w13, w2) = make_weights(PE, PH, PI, scheme_name)
    x, ids, w = make_case("empty_experts", 0, PE, PK, PH)
    backend = cb.CutlassBackend(scheme, accumulator="int32" if scheme_name == "int8_channel" else "fp32")
    monkeypatch.delenv(cb.INT8_BLOCK_SCHEDULE_ENV)
    assert backend.schedule == ("n256_quarters_i2f_s4" if scheme_name == "int8_block" else None)
    assert "masked" in backend.layouts
    weights = backend.prepare_weights(ExpertWeights(scheme, *stored))
    ref = moe_reference(x, ids, w, w13, w2, scheme_name)
    for capacity in (x.shape[0], 128):
        masked, slot_pos = to_masked(x, None, ids, PE, capacity=capacity)
        out = backend.run_masked(masked, weights, torch.float32)  # CUTLASS: no crossover data for the CPU
        assert out.dtype == torch.float32 and out.shape == (PE, capacity, PH)
        got = gather_weighted(out.reshape(-1, PH), slot_pos, w)
        assert rel_err(got, ref) < scheme.rel_error_bound, (capacity, rel_err(got, ref))
    want = ["n256_quarters_i2f_s4"] * 4 if scheme_name == "int8_block" else [None] * 4
    assert calls == want, calls  # two GEMMs per pass
    # Below the crossover: the Triton backend's masked pass, not the CUTLASS kernels; a backend
    # built with int8_kernel="cutlass" runs them whatever the rule says.
    monkeypatch.setattr(cb, "int8_kernel_for", lambda device, name, rows: "triton" if rows < 64 else "cutlass")
    out = backend.run_masked(masked, weights, torch.float32)
    assert len(calls) == 4
    assert rel_err(gather_weighted(out.reshape(-1, PH), slot_pos, w), ref) < scheme.rel_error_bound
    forced = cb.CutlassBackend(scheme, accumulator=backend.accumulator, int8_kernel="cutlass",
                               **({"schedule": backend.schedule} if scheme_name == "int8_block" else {}))
    forced.run_masked(masked, weights, torch.float32)
    assert len(calls) == 6


def _fake_int8_block_silu_gemm(a, a_scale, b, b_scale, expert_offsets, *, schedule):
    """The fused GEMM1's contract in float64: the block kernel's sums of b's rows (w13's gate rows
    then up rows), silu(gate) * up, quantized per 1 x 128 by the reference rule; scales row-major
    (the real op's are MN-major, which GEMM2 reads either way)."""
    from epmoe.experts.cutlass_backend import SILU_FUSED_SCHEDULES
    from epmoe.quant.reference import quantize_rows

    assert schedule in SILU_FUSED_SCHEDULES, schedule
    m, n = a.shape[0], b.shape[1]
    gate_up = torch.full((m, n), float("nan"), dtype=torch.float64)
    _fake_int8_block_grouped_gemm(a, a_scale, b, b_scale, expert_offsets, gate_up, schedule=schedule)
    h = torch.nn.functional.silu(gate_up[:, : n // 2]) * gate_up[:, n // 2 :]
    return quantize_rows(h.float().nan_to_num(), torch.int8, 127.0, 128)


def _fake_int8_block_silu_masked(calls):
    def masked(a, a_scale, b, b_scale, masked_m, *, schedule):
        e, max_m, k = a.shape
        assert max_m % 128 == 0, a.shape
        calls.append(("fused", schedule))
        offsets = torch.arange(e + 1, dtype=torch.int32) * max_m
        q, s = _fake_int8_block_silu_gemm(a.reshape(e * max_m, k), a_scale.reshape(e * max_m, -1), b, b_scale,
                                          offsets, schedule=schedule)  # fmt: skip
        return q.view(e, max_m, -1), s.view(e, max_m, -1)

    return masked


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter on CPU")
def test_cutlass_int8_block_fused_activation_plumbing(monkeypatch):
    """int8_block on a schedule with a fused build: GEMM1 with the activation in its epilogue (a
    stand-in here) and GEMM2 on its codes, on the contiguous layout (spare rows too) and the
    masked one, the weights as stored; activation="separate" runs GEMM1 and the Triton activation
    instead; both within the scheme's bound of float64 and close to each other."""
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from cases import make_case
    from helpers import make_weights
    from reference import moe_reference, rel_err

    from epmoe.experts import cutlass_backend as cb
    from epmoe.experts.base import ExpertWeights
    from epmoe.layouts import _to_contiguous_kernels, gather_weighted, to_masked
    from epmoe.quant import get_scheme

    block = get_scheme("int8_block")
    calls = []

    def gemm(*args, schedule, **kw):
        calls.append(("gemm", args[2].shape[1]))
        return _fake_int8_block_grouped_gemm(*args, schedule=schedule, **kw)

    def fused(*args, schedule):
        calls.append(("fused", schedule))
        return _fake_int8_block_silu_gemm(*args, schedule=schedule)

    monkeypatch.setattr(cb, "int8_block_grouped_gemm", gemm)
    monkeypatch.setattr(cb, "int8_block_silu_grouped_gemm", fused)
    monkeypatch.setattr(cb, "int8_block_silu_masked_gemm", _fake_int8_block_silu_masked(calls))
    monkeypatch.setattr(cb, "int8_block_masked_gemm", _fake_masked(_fake_int8_block_grouped_gemm, calls))
    stored, (w13, w2) = make_weights(PE, PH, PI, "int8_block")
    x, ids, w = make_case("empty_experts", 0, PE, PK, PH)
    ref = moe_reference(x, ids, w, w13, w2, "int8_block")
    outs = {}
    for activation in cb.ACTIVATIONS:
        backend = cb.CutlassBackend(block, schedule="n256_quarters_run4", activation=activation)
        weights = backend.prepare_weights(ExpertWeights(block, *stored))
        assert torch.equal(weights.w13, stored[0])
        for spare in (None, 4):
            calls.clear()
            batch = _to_contiguous_kernels(x, None, ids, PE, backend.alignment, None, expected_m=spare)
            got = gather_weighted(backend.run_contiguous(batch, weights, torch.float32), batch.slot_pos, w)
            assert rel_err(got, ref) < block.rel_error_bound, (activation, spare, rel_err(got, ref))
            want = [("fused", "n256_quarters_run4"), ("gemm", PH)] if activation == "fused" else [("gemm", 2 * PI), ("gemm", PH)]
            assert calls == want, (activation, calls)
            outs[activation, spare] = got
        calls.clear()
        masked, slot_pos = to_masked(x, None, ids, PE, capacity=x.shape[0])
        got = gather_weighted(backend.run_masked(masked, weights, torch.float32).reshape(-1, PH), slot_pos, w)
        assert rel_err(got, ref) < block.rel_error_bound, (activation, "masked", rel_err(got, ref))
        assert calls[0] == (("fused", "n256_quarters_run4") if activation == "fused" else "n256_quarters_run4"), calls
    assert rel_err(outs["fused", None], outs["separate", None]) < 2e-2


def test_int8_block_schedule_choice(monkeypatch, caplog):
    """The schedule of the INT8 block kernel: the argument, else the environment (read when the
    backend is built), else the measured one or the default; a name not in the list is refused with
    where it came from."""
    from epmoe import ops
    from epmoe.experts import cutlass_backend as cb
    from epmoe.quant import get_scheme

    block = get_scheme("int8_block")
    monkeypatch.delenv(cb.INT8_BLOCK_SCHEDULE_ENV, raising=False)
    monkeypatch.setattr(cb, "measured_schedule", lambda gpu: None)  # a GPU without a measured one
    assert cb.DEFAULT_INT8_BLOCK_SCHEDULE in cb.INT8_BLOCK_SCHEDULES
    assert ops.DEFAULT_INT8_BLOCK_SCHEDULE == cb.DEFAULT_INT8_BLOCK_SCHEDULE  # the ops' default, named there
    assert cb.DEFAULT_INT8_BLOCK_SCHEDULE in cb.SILU_FUSED_SCHEDULES  # the fused wrappers' default too
    with caplog.at_level(logging.INFO, logger="epmoe"):
        cb.CutlassBackend(block, schedule="n256_quarters_run2")
    assert "INT8 block kernel: variant n256_quarters_run2 (128 x 256 tiles" in caplog.text
    assert cb.CutlassBackend(block).schedule is None  # the measured one, looked up per device
    assert cb.CutlassBackend(block).schedule_for(torch.device("cpu")) == cb.DEFAULT_INT8_BLOCK_SCHEDULE
    assert cb.CutlassBackend(block, schedule="n256_quarters_i2f_s4").schedule == "n256_quarters_i2f_s4"
    monkeypatch.setenv(cb.INT8_BLOCK_SCHEDULE_ENV, "n256_quarters_run2")
    assert cb.CutlassBackend(block).schedule == "n256_quarters_run2"
    assert cb.CutlassBackend(block, schedule="n256_quarters_run4").schedule == "n256_quarters_run4"
    monkeypatch.setenv(cb.INT8_BLOCK_SCHEDULE_ENV, "pingpong")
    with pytest.raises(ValueError, match=r"EPMOE_INT8_BLOCK_SCHEDULE \(from the environment\)='pingpong'; allowed"):
        cb.CutlassBackend(block)
    with pytest.raises(ValueError, match=r"^schedule='fast'; allowed: \['n256_quarters_i2f_s4', 'n256_quarters_run2', 'n256_quarters_run4'\]"):
        cb.CutlassBackend(block, schedule="fast")
    # Only int8_block has schedules: the bad environment value does not stop the other schemes.
    for other in (cb.CutlassBackend(get_scheme("fp8_block")), cb.CutlassBackend(get_scheme("int8_channel"), accumulator="int32")):
        assert other.schedule is None and other.schedule_for(torch.device("cpu")) == cb.DEFAULT_INT8_BLOCK_SCHEDULE


def test_int8_block_schedule_measured_per_gpu(monkeypatch, tmp_path):
    """Without an argument or the environment, the schedule measured fastest on this GPU
    (the shipped file), else the default; a bad entry names the file."""
    from epmoe.experts import cutlass_backend as cb

    cb.measured_schedule.cache_clear()
    assert cb.measured_schedule("NVIDIA H200") in (None, *cb.INT8_BLOCK_SCHEDULES)  # the shipped file loads
    path = tmp_path / "schedule.json"
    path.write_text('{"GPU A": {"schedule": "n256_quarters_run2", "source": "x"}, "GPU B": {"schedule": "fast"}}')
    assert cb.measured_schedule("GPU A", path) == "n256_quarters_run2"
    assert cb.measured_schedule("GPU C", path) is None and cb.measured_schedule(None, path) is None
    assert cb.measured_schedule("GPU A", tmp_path / "none.json") is None
    path.write_text('{"GPU A": "n256_quarters_run2"}')
    cb.measured_schedule.cache_clear()  # the file is read once per GPU
    with pytest.raises(ValueError, match="must map GPU names to"):
        cb.measured_schedule("GPU A", path)
    monkeypatch.delenv(cb.INT8_BLOCK_SCHEDULE_ENV, raising=False)
    gpus = {0: "GPU A", 1: "GPU B", 2: "GPU C"}
    monkeypatch.setattr(cb.devices, "name", lambda device=None: gpus[torch.device(device).index])
    monkeypatch.setattr(cb, "measured_schedule", lambda gpu: {"GPU A": "n256_quarters_i2f_s4", "GPU B": "fast"}.get(gpu))
    with pytest.raises(ValueError, match=r"int8_block_schedule.json for 'GPU B'='fast'; allowed"):
        cb.int8_block_schedule("cuda:1")
    assert cb.int8_block_schedule("cuda:0") == "n256_quarters_i2f_s4"
    assert cb.int8_block_schedule(torch.device("cpu")) == cb.DEFAULT_INT8_BLOCK_SCHEDULE  # no measured one off CUDA
    monkeypatch.setenv(cb.INT8_BLOCK_SCHEDULE_ENV, "n256_quarters_run2")
    assert cb.int8_block_schedule("cuda:0") == "n256_quarters_run2"  # the environment first
    monkeypatch.delenv(cb.INT8_BLOCK_SCHEDULE_ENV)
    assert cb.int8_block_schedule("cuda:2") == cb.DEFAULT_INT8_BLOCK_SCHEDULE


def test_int8_block_schedule_follows_the_weights_gpu(monkeypatch, caplog):
    """Two GPUs of different kinds in one host: the schedule is the one measured on the GPU that
    holds the weights, whichever device is current when the backend is built or run; a CUDA
    device without an index is the current one, as in torch."""
    from epmoe.experts import cutlass_backend as cb
    from epmoe.quant import get_scheme

    block = get_scheme("int8_block")
    gpus = {0: "GPU A", 1: "GPU B"}
    monkeypatch.delenv(cb.INT8_BLOCK_SCHEDULE_ENV, raising=False)
    monkeypatch.setattr(cb.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cb.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cb.devices, "name", lambda device=None: gpus[cb.devices.cuda_index(device)])
    monkeypatch.setattr(cb, "measured_schedule", lambda gpu: {"GPU A": "n256_quarters_i2f_s4", "GPU B": "n256_quarters_run4"}.get(gpu))
    backend = cb.CutlassBackend(block)  # built while cuda:0 (GPU A) is current
    with caplog.at_level(logging.INFO, logger="epmoe"):
        assert backend.schedule_for(torch.device("cuda", 1)) == "n256_quarters_run4"
    assert "INT8 block kernel on cuda:1 (GPU B): variant n256_quarters_run4 (128 x 256 tiles" in caplog.text
    assert backend.schedule_for(torch.device("cuda", 0)) == "n256_quarters_i2f_s4"
    assert cb.int8_block_schedule(torch.device("cuda", 1)) == "n256_quarters_run4"
    assert cb.CutlassBackend(block, schedule="n256_quarters_run2").schedule_for(torch.device("cuda", 1)) == "n256_quarters_run2"
    # 'cuda' without an index is the current device, as in torch (a layer built with device='cuda').
    assert cb.int8_block_schedule("cuda") == "n256_quarters_i2f_s4"
    assert cb.gpu_name(torch.device("cuda")) == "GPU A" and cb.gpu_name("cpu") is None


def test_cutlass_masked_layout_is_int8_only(monkeypatch):
    """The masked layout runs on the INT8 kernels; FP8 masked stays DeepGEMM's, said before the
    machine is asked about."""
    from epmoe.experts import cutlass_backend as cb
    from epmoe.quant import get_scheme

    cpu = torch.device("cpu")
    ok, reason = cb.CutlassBackend.supports(get_scheme("fp8_block"), "masked", cpu, 256, 128)
    assert not ok and "contiguous layout only" in reason and "deepgemm" in reason
    monkeypatch.setattr(cb.CutlassBackend, "available", classmethod(lambda cls, device: (True, "machine ok")))
    monkeypatch.setattr(cb, "own_kernel_missing", lambda: None)
    for name, acc in (("int8_block", "fp32"), ("int8_channel", "int32")):
        ok, reason = cb.CutlassBackend.supports(get_scheme(name), "masked", cpu, 256, 128, accumulator=acc)
        assert ok, reason
    with pytest.raises(NotImplementedError, match="deepgemm"):
        cb.CutlassBackend(get_scheme("fp8_block")).run_masked(None, None, torch.bfloat16)


def test_cutlass_int8_block_selection(monkeypatch):
    """int8_block on cutlass: the machine rule first (SGLANG_CUTLASS_MOE, GPU), the scheme's sizes,
    then the project's kernel (headers); auto walks cutlass -> triton -> torch; the fp32
    accumulator is the scheme's (int32 is int8_channel's)."""
    from epmoe.experts import cutlass_backend as cb
    from epmoe.experts.select import AUTO_ORDER, select_backend
    from epmoe.quant import get_scheme

    block = get_scheme("int8_block")
    cpu = torch.device("cpu")
    assert AUTO_ORDER["int8_block"] == ("cutlass", "triton", "torch")
    with pytest.raises(ValueError, match="accumulator='int32' applies to quant='int8_channel' only"):
        cb.CutlassBackend(block, accumulator="int32")
    monkeypatch.delenv("SGLANG_CUTLASS_MOE", raising=False)
    ok, reason = cb.CutlassBackend.supports(block, "contiguous", cpu, 256, 128)
    assert not ok and "SGLANG_CUTLASS_MOE=1 is required" in reason
    ok, reason = cb.CutlassBackend.supports(block, "masked", cpu, 256, 128)
    assert not ok and "SGLANG_CUTLASS_MOE=1 is required" in reason  # masked as contiguous: the machine
    monkeypatch.setattr(cb.CutlassBackend, "available", classmethod(lambda cls, device: (True, "machine ok")))
    ok, reason = cb.CutlassBackend.supports(block, "contiguous", cpu, 256, 200)
    assert not ok and "multiples of 128" in reason and "intermediate=200" in reason
    monkeypatch.setattr(cb, "find_cutlass_include", lambda: None)
    ok, reason = cb.CutlassBackend.supports(block, "contiguous", cpu, 256, 128)
    assert not ok and "CUTLASS headers not found" in reason and "INT8 kernels are the project's own" in reason
    monkeypatch.setattr(cb, "own_kernel_missing", lambda: None)
    ok, reason = cb.CutlassBackend.supports(block, "contiguous", cpu, 256, 128)
    assert ok and reason == "machine ok: epmoe's CUTLASS INT8 block kernel"
    cls, lines = select_backend("cutlass", block, frozenset({"contiguous"}), cpu, 256, 128)
    assert cls is cb.CutlassBackend
    # auto picks GPU-only backends on CUDA only: on CPU it says so and moves on.
    cls, lines = select_backend("auto", block, frozenset({"contiguous"}), cpu, 256, 128)
    assert cls is not cb.CutlassBackend and any("'cutlass' refused" in line for line in lines), lines


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter on CPU")
def test_deepgemm_plumbing_masked(monkeypatch):
    from reference import moe_reference, rel_err

    from epmoe.experts import deepgemm_backend as dgb
    from epmoe.layouts import gather_weighted, to_masked
    from epmoe.quant.reference import quantize_rows

    api = dgb.resolve_api(_fake_deep_gemm())
    monkeypatch.setattr(dgb, "deep_gemm_api", lambda: api)
    weights, (w13, w2), x, ids, w = _plumbing_case()
    backend = dgb.DeepGemmBackend(weights.scheme)
    weights = backend.prepare_weights(weights)
    ref = moe_reference(x, ids, w, w13, w2, "fp8_block")
    xq, xs = quantize_rows(x, torch.float8_e4m3fn, 448.0, 128)
    for xin, scale in ((x, None), (xq, xs)):
        masked, slot_pos = to_masked(xin, scale, ids, PE, capacity=x.shape[0])
        if scale is not None:  # DeepEP low-latency's MN-major strided scales
            masked.x_scale = masked.x_scale.transpose(1, 2).contiguous().transpose(1, 2)
        y = backend.run_masked(masked, weights, torch.bfloat16)
        got = gather_weighted(y.reshape(-1, PH), slot_pos, w)
        assert rel_err(got, ref) < 2e-2


def test_gemm_masked_pads_capacity_to_the_block(monkeypatch):
    from epmoe.experts import deepgemm_backend as dgb
    from epmoe.quant.reference import dequantize_weight, quantize_rows, quantize_weight
    from epmoe.quant import get_scheme

    api = dgb.resolve_api(_fake_deep_gemm())
    monkeypatch.setattr(dgb, "deep_gemm_api", lambda: api)
    torch.manual_seed(0)
    e, cap, n, k = 3, 96, 256, 256
    xq, xs = quantize_rows(torch.randn(e * cap, k), torch.float8_e4m3fn, 448.0, 128)
    wq, ws = quantize_weight(torch.randn(e, n, k) * 0.05, get_scheme("fp8_block"))
    masked_m = torch.tensor([0, 95, 17], dtype=torch.int32)
    out = torch.full((e, cap, n), float("nan"), dtype=torch.bfloat16)
    got = dgb.gemm_masked(xq.view(e, cap, k), xs.view(e, cap, -1), wq, ws, masked_m, 40, out=out)
    assert got is out and got.shape == (e, cap, n)
    x = _dequant(xq, xs).view(e, cap, k)
    w = dequantize_weight(wq, ws)
    for g, m in enumerate(masked_m.tolist()):
        torch.testing.assert_close(got[g, :m].float(), (x[g, :m] @ w[g].t()).bfloat16().float())


@pytest.mark.parametrize("module, cls", [("cutlass_backend", "CutlassBackend"), ("deepgemm_backend", "DeepGemmBackend"),
                                         ("triton_backend", "TritonBackend")])
def test_a_backend_refuses_a_scheme_it_does_not_run(module, cls):
    """Built directly (as the benches do), a backend names the schemes it runs instead of
    accepting weights of another scheme and feeding them to its kernels."""
    import importlib

    from epmoe.quant.schemes import get_scheme

    backend_cls = getattr(importlib.import_module(f"epmoe.experts.{module}"), cls)
    other = next(s for s in ("bf16", "fp8_block") if s not in backend_cls.schemes)
    with pytest.raises(ValueError, match=rf"runs quant in \[.*\]; got quant='{other}'"):
        backend_cls(get_scheme(other))
    backend_cls(get_scheme(sorted(backend_cls.schemes)[0]))  # its own schemes are accepted


@pytest.mark.parametrize("backend_path", ["epmoe.experts.deepgemm_backend:DeepGemmBackend"])
def test_fp8_backends_refuse_a_batch_with_spare_rows(backend_path):
    """DeepGEMM runs over every row of the batch: one sized for the worst case with its segment
    sizes on the device is refused with a readable error, not computed (CUTLASS takes it)."""
    import importlib

    from epmoe.layouts import ContiguousBatch
    from epmoe.quant import get_scheme

    module, cls = backend_path.split(":")
    backend = getattr(importlib.import_module(module), cls)(get_scheme("fp8_block"))
    assert not backend.device_segments
    batch = ContiguousBatch(torch.zeros(16, 128), None, torch.tensor([0, 3, 5], dtype=torch.int32),
                            torch.full((16,), -1, dtype=torch.int32), torch.zeros(4, 2, dtype=torch.int64),
                            torch.tensor([3, 2], dtype=torch.int32), expected_m=3)  # fmt: skip
    with pytest.raises(ValueError, match="needs a contiguous batch sized on the host; got one with spare rows"):
        backend.run_contiguous(batch, None, torch.bfloat16)


# ---------------------------------------------------- INT8: the kernel by rows per expert (crossovers)
def _measured(*rows):
    return [dict(rows_per_expert=m, triton_ms=t, cutlass_ms=c) for m, t, c in rows]


def test_crossover_from_measurements():
    from epmoe.experts.fp8_selection import crossover_from_measurements as cross

    assert cross(_measured((8, 1.3, 1.6), (32, 1.4, 1.6), (128, 1.9, 1.7), (512, 6.0, 5.2))) == 128
    assert cross(_measured((512, 6.0, 5.2), (8, 1.3, 1.2))) == 8  # order does not matter; CUTLASS everywhere
    assert cross(_measured((8, 1.3, 1.2), (32, 1.4, 1.6), (128, 1.9, 1.7))) == 128  # a win below a loss is not taken
    assert cross(_measured((8, 1.3, 1.6), (2048, 19.0, 24.0))) is None  # Triton at the largest: never CUTLASS
    assert cross(_measured((128, 1.7, 1.7))) == 128  # a tie goes to CUTLASS (today's choice)
    for bad in ([], _measured((8, 1.0, 1.0), (8, 2.0, 2.0)), _measured((0, 1.0, 1.0)), _measured((8, 0.0, 1.0)),
                [{"rows_per_expert": 8, "triton_ms": 1.0}]):  # fmt: skip
        with pytest.raises(ValueError):
            cross(bad)


def test_int8_rows_rule_from_data():
    from epmoe.experts.fp8_selection import NO_CROSSOVER, int8_rows_rule

    rule = int8_rows_rule({}, "NVIDIA H200", "int8_block")
    assert rule.kernel_for(1) == rule.kernel_for(4096) == "cutlass"
    assert rule.describe() == f"no crossover data for int8_block on NVIDIA H200: {NO_CROSSOVER}"
    entry = dict(measured=_measured((8, 1.3, 1.6), (32, 1.4, 1.6), (128, 1.9, 1.7)), cutlass_from_rows_per_expert=128,
                 source="benchmarks/int8_crossover.py, one H200")  # fmt: skip
    data = {"NVIDIA H200": {"int8_block": entry}}
    rule = int8_rows_rule(data, "NVIDIA H200", "int8_block")
    assert [rule.kernel_for(m) for m in (1, 8, 127, 128, 4096)] == ["triton"] * 3 + ["cutlass"] * 2
    text = rule.describe()
    assert "Triton below 128 rows per expert, CUTLASS from 128" in text and "8: 1.3/1.6" in text and "one H200" in text
    assert int8_rows_rule(data, "NVIDIA H100", "int8_block").measured == ()  # another GPU: no data
    assert int8_rows_rule(data, "NVIDIA H200", "int8_channel").measured == ()
    never = {"g": {"int8_block": dict(measured=_measured((8, 1.0, 2.0)), cutlass_from_rows_per_expert=None)}}
    rule = int8_rows_rule(never, "g", "int8_block")
    assert rule.kernel_for(10**6) == "triton" and "Triton at every size" in rule.describe()
    with pytest.raises(ValueError, match="states cutlass_from_rows_per_expert=32 but its measurements give 128"):
        int8_rows_rule({"NVIDIA H200": {"int8_block": {**entry, "cutlass_from_rows_per_expert": 32}}}, "NVIDIA H200", "int8_block")
    with pytest.raises(ValueError, match="crossover data for int8_block on g"):
        int8_rows_rule({"g": {"int8_block": {"measured": []}}}, "g", "int8_block")


def test_shipped_crossover_data_loads():
    """Every entry of the shipped file (when there is one) gives a rule: its stated crossovers
    are the ones its measurements give."""
    from epmoe.experts import cutlass_backend as cb
    from epmoe.experts.fp8_selection import int8_rows_rule

    data = cb.crossover_data()
    if not cb.CROSSOVER_FILE.is_file():
        assert data == {}
    for gpu, entries in data.items():
        for scheme in entries:
            assert scheme in cb.INT8_SCHEMES, (gpu, scheme)
            assert int8_rows_rule(data, gpu, scheme).measured, (gpu, scheme)


def test_batch_rows_per_expert():
    from epmoe.experts.cutlass_backend import batch_rows_per_expert
    from epmoe.layouts import ContiguousBatch

    def batch(m, e, num_rows, expected_m=None):
        return ContiguousBatch(torch.zeros(m, 8), None, torch.zeros(e + 1, dtype=torch.int32), torch.zeros(m, dtype=torch.int32),
                               torch.zeros(1, 1, dtype=torch.int64), num_rows, expected_m)  # fmt: skip

    assert batch_rows_per_expert(batch(512, 4, [3, 0, 5, 9])) == 5  # host counts: ceil(17 / 4)
    assert batch_rows_per_expert(batch(2048, 4, torch.zeros(4, dtype=torch.int32), expected_m=40)) == 40
    assert batch_rows_per_expert(batch(1024, 4, torch.zeros(4, dtype=torch.int32))) == 256  # padded rows: a bound


@pytest.mark.parametrize("scheme_name", ["int8_channel", "int8_block"])
def test_cutlass_int8_batches_take_the_kernel_of_their_size(monkeypatch, caplog, scheme_name):
    """Below the measured crossover a batch runs the Triton backend's pass, from it the CUTLASS
    kernel; the rule is logged once, when the backend is selected."""
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from helpers import make_weights

    from epmoe.experts import cutlass_backend as cb
    from epmoe.experts.base import ExpertWeights
    from epmoe.layouts import to_contiguous
    from epmoe.quant import get_scheme

    scheme = get_scheme(scheme_name)
    acc = "int32" if scheme_name == "int8_channel" else "fp32"
    data = {"cpu": {scheme_name: dict(measured=_measured((2, 1.0, 2.0), (8, 3.0, 2.0)), cutlass_from_rows_per_expert=8)}}
    monkeypatch.setattr(cb, "crossover_data", lambda: data)
    monkeypatch.setattr(cb.CutlassBackend, "available", classmethod(lambda cls, device: (True, "machine ok")))
    monkeypatch.setattr(cb, "own_kernel_missing", lambda: None)
    cb._rule.cache_clear()
    try:
        with caplog.at_level(logging.INFO, logger="epmoe"):
            ok, _ = cb.CutlassBackend.supports(scheme, "contiguous", torch.device("cpu"), PH, PI, accumulator=acc)
        assert ok and "Triton below 8 rows per expert, CUTLASS from 8" in caplog.text
        backend = cb.CutlassBackend(scheme, accumulator=acc)
        stored, _ = make_weights(PE, PH, PI, scheme_name)
        weights = backend.prepare_weights(ExpertWeights(scheme, *stored))
        ran = []
        monkeypatch.setattr(backend._triton_below_crossover, "run_contiguous", lambda b, w, d: ran.append("triton") or torch.zeros(b.x.shape[0], PH, dtype=d))
        monkeypatch.setattr(backend, "_run_int8", lambda b, w: ran.append("cutlass") or torch.zeros(b.x.shape[0], PH, dtype=torch.bfloat16))
        for tokens, want in ((4, "triton"), (64, "cutlass")):
            ids = torch.arange(tokens * PK).remainder(PE).view(tokens, PK)
            batch = to_contiguous(torch.randn(tokens, PH), None, ids, PE, backend.alignment)
            assert backend.int8_kernel(batch) == want
            backend.run_contiguous(batch, weights, torch.bfloat16)
            assert ran[-1] == want, (tokens, ran)
        # Sizes on the device (a captured decode step): the dispatcher's hint decides.
        for hint, want in ((1, "triton"), (8, "cutlass")):
            device_sized = dataclasses.replace(batch, num_rows=torch.tensor(batch.num_rows), expected_m=hint)
            assert cb.batch_rows_per_expert(device_sized) == hint and backend.int8_kernel(device_sized) == want
    finally:
        cb._rule.cache_clear()


def test_int8_crossover_script_arguments(tmp_path, capsys):
    """The measuring script refuses bad arguments by name and needs a GPU (it writes nothing
    without one)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "int8_crossover.py"
    spec = importlib.util.spec_from_file_location("int8_crossover", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "x.json"
    args = script.parse_args(["--out", str(out), "--m", "32,8,8", "--schemes", "int8_block"])
    assert args.m == [8, 32] and args.schemes == ["int8_block"]
    for bad, text in ((["--schemes", "fp8_block"], "allowed"), (["--m", "0"], "must be >= 1"), (["--m", "x"], "integers"),
                      (["--turns", "0"], "at least 1")):  # fmt: skip
        with pytest.raises(SystemExit):
            script.parse_args(["--out", str(out), *bad])
        assert text in capsys.readouterr().err
    args = script.parse_args(["--out", str(out), "--schemes", "int8_block", "--schedule", "n256_quarters_run2", "--no-unpadded"])
    assert args.schedule == "n256_quarters_run2" and not args.unpadded
    with pytest.raises(SystemExit):
        script.parse_args(["--out", str(out), "--schedule", "fastest"])
    assert "invalid choice" in capsys.readouterr().err
    shipped = tmp_path / "shipped.json"
    shipped.write_text(json.dumps({"_comment": "c", "GPU A": {"int8_block": 1, "int8_channel": 2}, "GPU B": {"int8_block": 3}}))
    assert script.merged(str(shipped), "GPU A", {"int8_block": 9}) == {
        "_comment": "c", "GPU A": {"int8_block": 9, "int8_channel": 2}, "GPU B": {"int8_block": 3}}
    assert script.merged(None, "GPU C", {"int8_block": 9}) == {"GPU C": {"int8_block": 9}}
    if not torch.cuda.is_available():
        assert script.main(["--out", str(out)]) == 2 and not out.exists()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter on CPU")
@pytest.mark.parametrize("scheme_name", ["int8_channel", "int8_block"])
def test_cutlass_triton_branch_runs_packed_segments(scheme_name):
    """Below the crossover a host-sized batch runs Triton on segments of exactly its rows (the
    128-row padding would cost Triton as many MMAs as real rows): the packed batch is the one the
    unpadded layout gives, and the pass equals the Triton backend's on it, row for row; a batch
    with device-side sizes packs to its slots with spare rows, same result."""
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from cases import make_case
    from helpers import make_weights

    from epmoe.experts import cutlass_backend as cb
    from epmoe.experts.base import ExpertWeights
    from epmoe.experts.triton_backend import TritonBackend
    from epmoe.layouts import _to_contiguous_kernels, gather_weighted, to_contiguous
    from epmoe.quant import get_scheme

    scheme = get_scheme(scheme_name)
    acc = "int32" if scheme_name == "int8_channel" else "fp32"
    stored, _ = make_weights(PE, PH, PI, scheme_name)
    backend = cb.CutlassBackend(scheme, accumulator=acc)
    weights = backend.prepare_weights(ExpertWeights(scheme, *stored))
    x, ids, w = make_case("empty_experts", 0, PE, PK, PH)
    padded = to_contiguous(x, None, ids, PE, backend.alignment)
    exact = to_contiguous(x, None, ids, PE, 1)
    small, rows = cb.packed_batch(padded)
    for name in ("x", "expert_offsets", "m_indices", "slot_pos"):
        assert torch.equal(getattr(small, name), getattr(exact, name).to(getattr(small, name).dtype)), name
    assert bool((padded.m_indices[rows] >= 0).all()) and rows.numel() == sum(exact.num_rows)
    got = gather_weighted(backend.run_kernel(padded, weights, torch.float32, "triton"), padded.slot_pos, w)
    want = gather_weighted(TritonBackend(scheme, accumulator=acc).run_contiguous(exact, weights, torch.float32), exact.slot_pos, w)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # Sizes on the device: packed to one row per slot (spare rows past the valid ones), no host
    # read; the pass equals the Triton backend's on the exact layout, row for row.
    device_sized = _to_contiguous_kernels(x, None, ids, PE, backend.alignment, None, expected_m=4)
    small, rows = cb.packed_batch(device_sized)
    valid = sum(exact.num_rows)
    assert small.x.shape[0] == ids.numel() and small.expected_m == 4 and small.num_rows.tolist() == exact.num_rows
    assert torch.equal(small.expert_offsets, exact.expert_offsets.to(torch.int32))
    assert torch.equal(small.x[:valid], exact.x) and bool((small.m_indices[valid:] == -1).all())
    assert bool((rows[valid:] == device_sized.x.shape[0]).all())
    got = gather_weighted(backend.run_kernel(device_sized, weights, torch.float32, "triton"), device_sized.slot_pos, w)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter on CPU")
def test_cutlass_int8_small_batches_are_laid_out_for_the_triton_pass(monkeypatch):
    """A batch the layer lays out itself (local dispatch) below the crossover gets the Triton
    pass's alignment: it runs as it is, with no 128-row padding to compute on or pack away, and
    equals the Triton backend's pass; above the crossover it gets the CUTLASS kernels' 128 rows."""
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from cases import make_case
    from helpers import make_weights

    from epmoe.experts import cutlass_backend as cb
    from epmoe.experts.base import ExpertWeights
    from epmoe.experts.triton_backend import TritonBackend
    from epmoe.layouts import gather_weighted, to_contiguous
    from epmoe.quant import get_scheme

    scheme = get_scheme("int8_channel")
    data = {"cpu": {"int8_channel": dict(measured=_measured((2, 1.0, 2.0), (8, 3.0, 2.0)), cutlass_from_rows_per_expert=8)}}
    monkeypatch.setattr(cb, "crossover_data", lambda: data)
    cb._rule.cache_clear()
    try:
        backend = cb.CutlassBackend(scheme, accumulator="int32")
        cpu = torch.device("cpu")
        assert backend.alignment_for(4, cpu) == 1 and backend.alignment_for(8, cpu) == cb.ROW_BLOCK
        stored, _ = make_weights(PE, PH, PI, "int8_channel")
        weights = backend.prepare_weights(ExpertWeights(scheme, *stored))
        x, ids, w = make_case("empty_experts", 0, PE, PK, PH)
        batch = to_contiguous(x, None, ids, PE, backend.alignment_for(4, cpu), expected_m=4)
        assert batch.alignment == 1 and backend.int8_kernel(batch) == "triton"
        monkeypatch.setattr(cb, "packed_batch", lambda b: pytest.fail("packed a batch laid out for Triton"))
        got = gather_weighted(backend.run_contiguous(batch, weights, torch.float32), batch.slot_pos, w)
        exact = to_contiguous(x, None, ids, PE, 1)
        want = gather_weighted(TritonBackend(scheme, accumulator="int32").run_contiguous(exact, weights, torch.float32),
                               exact.slot_pos, w)  # fmt: skip
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    finally:
        cb._rule.cache_clear()


def test_int8_block_variants_agree_across_the_sources():
    # The variant list lives in the header (kInt8BlockVariants), the dispatch switch, the binding's
    # bound, the build's source list and the Python names; a new variant must touch them all.
    import re

    from epmoe.experts import cutlass_backend as cb

    header = (cb.CSRC / "block_scaled_contiguous_gemm.cuh").read_text()
    table = header[header.index("kInt8BlockVariants[] = {"):]
    table = table[: table.index("};")]
    tiles = [int(t) for t in re.findall(r"\{[^{}]*,\s*(\d+)\}", table)]
    assert len(tiles) == len(cb.INT8_BLOCK_SCHEDULES)
    assert tiles == [cb.INT8_BLOCK_TILE_N[s] for s in cb.INT8_BLOCK_SCHEDULES]
    n = len(tiles)
    binding = (cb.CSRC / "fp8_block_contiguous_gemm_binding.cpp").read_text()
    assert f"kInt8BlockVariants = {n};" in binding
    # The ops' default schedule index: the package's default variant, for every INT8 block op.
    defaults = re.findall(r'"(int8_block\w*)\(.*?int schedule=(\d+)', binding.replace('"\n      "', ""), re.S)
    assert len(defaults) == 4 and {int(v) for _, v in defaults} == {cb.INT8_BLOCK_SCHEDULES.index(cb.DEFAULT_INT8_BLOCK_SCHEDULE)}, defaults
    dispatch = (cb.CSRC / "int8_block_contiguous_gemm.cu").read_text()
    assert f"kNumInt8BlockVariants == {n}" in dispatch
    assert sorted(int(v) for v in re.findall(r"case (\d+): run", dispatch)) == list(range(1, n))
    # Variant 0 is built by the dispatch file; every other one by a file of its own, in SOURCES.
    built = {}
    for src in cb.SOURCES:
        m = re.search(r"template void int8_block_gemm_variant<(\d+)>", (cb.CSRC / src).read_text())
        if m:
            built[int(m.group(1))] = src
    assert sorted(built) == list(range(1, n))
    # The fused GEMM1's builds: the Python names, the header's list, the binding's, the files.
    fused = [cb.INT8_BLOCK_SCHEDULES.index(s) for s in cb.SILU_FUSED_SCHEDULES]
    listed = lambda text: [int(v) for v in re.findall(r"\d+", re.search(r"kSiluQuantVariants\[\] = \{([^}]*)\}", text).group(1))]  # noqa: E731
    assert listed(header) == fused and listed(binding) == fused
    silu_built = set()
    for src in cb.SOURCES:
        silu_built |= {int(v) for v in re.findall(r"^template void int8_block_silu_gemm_variant<(\d+)>",
                                                   (cb.CSRC / src).read_text(), re.M)}  # fmt: skip
    assert sorted(silu_built) == fused


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter on CPU")
@pytest.mark.parametrize("expected_m", [None, 3], ids=["host_sized", "device_sized"])
@pytest.mark.parametrize("scheme_name", ["int8_channel", "int8_block", "fp8_block"])
def test_cutlass_pass_writes_scales_in_the_kernels_layout(monkeypatch, scheme_name, expected_m):
    """The project's block-scaled CUTLASS GEMMs read activation scales MN-major; given row-major
    ones they copy them transposed on every call (on one H200: 0.16 ms of a 24 ms int8_block pass at
    2048 rows per expert). The pass's quantizers write them MN-major for both GEMMs (int8_block,
    fp8_block on the project's kernel); per-token scales stay a column; the same with the sizes on
    the device (the row-wise stages then see one [1, M] slab). The GEMMs are stand-ins here that
    record what they are given."""
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from helpers import make_weights

    from epmoe import ops
    from epmoe.experts import cutlass_backend as cb
    from epmoe.experts.base import ExpertWeights
    from epmoe.layouts import _to_contiguous_kernels
    from epmoe.quant import get_scheme

    scheme = get_scheme(scheme_name)
    acc = "int32" if scheme_name == "int8_channel" else "fp32"
    monkeypatch.setattr(cb, "own_kernel_missing", lambda: None)
    # activation="separate": the activation kernel's scales are what this checks (a fused GEMM1
    # writes them itself).
    separate = {"activation": "separate"} if scheme_name == "int8_block" else {}
    backend = cb.CutlassBackend(scheme, accumulator=acc, **separate)
    stored, _ = make_weights(PE, PH, PI, scheme_name)
    weights = backend.prepare_weights(ExpertWeights(scheme, *stored))
    seen = []

    def gemm(kind, a, a_scale, b, b_scale, offsets, schedule="n256_quarters_run4", impl="auto"):
        seen.append((kind, a.shape[0], tuple(a_scale.shape), cb.is_mn_major(a_scale)))
        return torch.zeros(a.shape[0], b.shape[1], dtype=torch.bfloat16)

    monkeypatch.setattr(ops, "cutlass_grouped_gemm", gemm)
    ids = torch.arange(6 * PK).remainder(PE).view(6, PK)
    batch = _to_contiguous_kernels(torch.randn(6, PH), None, ids, PE, backend.alignment, None, expected_m=expected_m)
    assert batch.expected_m == expected_m
    backend.run_kernel(batch, weights, torch.bfloat16, "cutlass")
    rows = batch.x.shape[0]
    if scheme_name == "int8_channel":
        assert seen == [("int8_channel", rows, (rows, 1), False)] * 2
    else:
        assert seen == [(scheme_name, rows, (rows, PH // 128), True), (scheme_name, rows, (rows, PI // 128), True)]


def test_cutlass_mn_major_scales_by_scheme(monkeypatch):
    """The layer asks the scatter (and the decode prep) for MN-major activation scales for FP8 on
    the project's kernel only: not int8_channel (one scale per token: a column, no layout to
    choose), not int8_block (measured slower in the layer on the H200), nor FP8 on sgl-kernel's op
    (row-major)."""
    from epmoe.experts import cutlass_backend as cb
    from epmoe.quant import get_scheme

    monkeypatch.setattr(cb, "_use_sgl", lambda: False)
    assert cb.CutlassBackend(get_scheme("int8_block")).mn_major_scales is False
    assert cb.CutlassBackend(get_scheme("int8_channel"), accumulator="int32").mn_major_scales is False
    assert cb.CutlassBackend(get_scheme("fp8_block")).mn_major_scales is True
    monkeypatch.setattr(cb, "_use_sgl", lambda: True)
    assert cb.CutlassBackend(get_scheme("fp8_block")).mn_major_scales is False
    assert cb.CutlassBackend(get_scheme("int8_block")).mn_major_scales is False


def _int8_block_scattered(backend, expected_m, alignment=None, scale_mn_major=None):
    """An int8_group payload scattered as the layer scatters it for ``backend`` (on CPU through
    the Triton scatter under the interpreter), and the weights."""
    import sys

    sys.path.insert(0, os.path.dirname(__file__))
    from helpers import make_weights

    from epmoe.experts.base import ExpertWeights
    from epmoe.layouts import _to_contiguous_kernels
    from epmoe.quant.payload import quantize_payload

    stored, _ = make_weights(PE, PH, PI, "int8_block")
    weights = backend.prepare_weights(ExpertWeights(backend.scheme, *stored))
    xq, xs = quantize_payload(torch.randn(6, PH, generator=torch.Generator().manual_seed(1)), "int8_group")
    ids = torch.arange(6 * PK).remainder(PE).view(6, PK)
    mn = backend.mn_major_scales if scale_mn_major is None else scale_mn_major
    align = backend.alignment if alignment is None else alignment
    batch = _to_contiguous_kernels(xq, xs, ids, PE, align, None, expected_m=expected_m, scale_mn_major=mn)
    return batch, weights


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter on CPU")
@pytest.mark.parametrize("expected_m", [None, 3], ids=["host_sized", "device_sized"])
def test_cutlass_int8_block_gemm1_takes_the_scattered_mn_major_scales_as_they_are(monkeypatch, expected_m):
    """int8_block: dispatched activation scales that a scatter wrote MN-major (the layer asks for
    row-major, CutlassBackend.mn_major_scales; a caller may hand a batch so) reach GEMM1 as that
    very tensor (no transposing copy, the same values as a row-major scatter's); GEMM2's come
    MN-major from the activation. The GEMMs are stand-ins that record what they are given."""
    from epmoe import ops
    from epmoe.experts import cutlass_backend as cb
    from epmoe.quant import get_scheme

    monkeypatch.setattr(cb, "own_kernel_missing", lambda: None)
    backend = cb.CutlassBackend(get_scheme("int8_block"), activation="separate")  # GEMM1 on its own
    batch, weights = _int8_block_scattered(backend, expected_m, scale_mn_major=True)
    row_major, _ = _int8_block_scattered(backend, expected_m, scale_mn_major=False)
    assert cb.is_mn_major(batch.x_scale) and not cb.is_mn_major(row_major.x_scale)
    seen = []

    def gemm(kind, a, a_scale, b, b_scale, offsets, schedule="n256_quarters_run4", impl="auto"):
        seen.append((a, a_scale))
        return torch.zeros(a.shape[0], b.shape[1], dtype=torch.bfloat16)

    monkeypatch.setattr(ops, "cutlass_grouped_gemm", gemm)
    backend.run_kernel(batch, weights, torch.bfloat16, "cutlass")
    (a1, s1), (_, s2) = seen
    assert a1.data_ptr() == batch.x.data_ptr()  # the int8 payload passes through
    assert s1.data_ptr() == batch.x_scale.data_ptr() and s1.stride() == batch.x_scale.stride() and cb.is_mn_major(s1)
    assert cb.kernel_act_scale(s1) is s1  # what the kernel wrapper then hands the extension
    valid = batch.m_indices >= 0  # padding and spare rows hold anything
    assert torch.equal(valid, row_major.m_indices >= 0)
    assert torch.equal(s1[valid], row_major.x_scale[valid])
    assert cb.is_mn_major(s2) and s2.shape == (batch.x.shape[0], PI // 128)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter on CPU")
@pytest.mark.parametrize("expected_m", [None, 3], ids=["host_sized", "device_sized"])
def test_cutlass_int8_block_triton_pass_reads_mn_major_scales_in_place(monkeypatch, expected_m):
    """Below the INT8 crossover the cutlass backend runs the Triton pass on the batch laid out for
    it (alignment 1); given scales written MN-major, its GEMM1 reads them through their strides
    (no copy) and gives the same bits as from row-major scales."""
    from epmoe.experts import cutlass_backend as cb
    from epmoe.kernels import grouped_gemm
    from epmoe.quant import get_scheme

    monkeypatch.setattr(cb, "own_kernel_missing", lambda: None)
    backend = cb.CutlassBackend(get_scheme("int8_block"), int8_kernel="triton")
    batch, weights = _int8_block_scattered(backend, expected_m, alignment=1, scale_mn_major=True)
    row_major, _ = _int8_block_scattered(backend, expected_m, alignment=1, scale_mn_major=False)
    assert batch.alignment == 1 and cb.is_mn_major(batch.x_scale)
    handed = []
    real = grouped_gemm._scale_rows
    monkeypatch.setattr(grouped_gemm, "_scale_rows", lambda s, rows: handed.append(real(s, rows)) or handed[-1])
    got = backend.run_contiguous(batch, weights, torch.bfloat16)
    assert handed[0].data_ptr() == batch.x_scale.data_ptr() and handed[0].stride()[0] == 1
    want = backend.run_contiguous(row_major, weights, torch.bfloat16)
    valid = batch.m_indices >= 0
    assert torch.equal(got[valid], want[valid])


def test_cutlass_backend_activation_argument(caplog):
    """``activation`` is one of ACTIVATIONS (refused by name otherwise), and the backend's log and
    gemm1_note say which GEMM1 a schedule runs: fused only on the variants with a fused build."""
    import logging

    from epmoe.experts import cutlass_backend as cb
    from epmoe.quant import get_scheme

    with pytest.raises(ValueError, match=r"activation='fast'; allowed: \['fused', 'separate'\]"):
        cb.CutlassBackend(get_scheme("int8_block"), activation="fast")
    assert "in its epilogue" in cb.gemm1_note("n256_quarters_run4")
    assert "by its own kernel" in cb.gemm1_note("n256_quarters_run4", "separate")
    assert "by its own kernel" in cb.gemm1_note("n256_quarters_i2f_s4")
    with caplog.at_level(logging.INFO, logger="epmoe"):
        cb.CutlassBackend(get_scheme("int8_block"), schedule="n256_quarters_run2")
    assert "variant n256_quarters_run2" in caplog.text and "in its epilogue" in caplog.text


def test_cutlass_int8_block_silu_wrappers_refuse_before_loading(monkeypatch):
    """The fused GEMM1's wrappers refuse, in Python and before the extension is loaded: N not gate
    and up halves of whole 128-row blocks, a schedule without a fused build, what the block kernel
    refuses (here a CPU tensor), on both layouts."""
    from epmoe.experts import cutlass_backend as cb

    monkeypatch.setattr(cb, "load_extension", lambda: pytest.fail("the extension was loaded"))
    a = torch.zeros(128, 128, dtype=torch.int8)
    offsets = torch.tensor([0, 128], dtype=torch.int32)
    sa = torch.ones(128, 1)
    b = torch.zeros(1, 384, 128, dtype=torch.int8)
    with pytest.raises(ValueError, match="N=384 rows; the fused GEMM1 needs a multiple of 256"):
        cb.int8_block_silu_grouped_gemm(a, sa, b, torch.ones(1, 3, 1), offsets)
    with pytest.raises(ValueError, match=r"schedule='n256_quarters_i2f_s4'; allowed \(the fused builds\): \['n256_quarters_run2'"):
        cb.int8_block_silu_grouped_gemm(a, sa, b[:, :256], torch.ones(1, 2, 1), offsets, schedule="n256_quarters_i2f_s4")
    with pytest.raises(ValueError, match="a must be a CUDA tensor"):
        cb.int8_block_silu_grouped_gemm(a, sa, b[:, :256], torch.ones(1, 2, 1), offsets)
    am, sam, counts = a.view(1, 128, 128), sa.view(1, 128, 1), torch.tensor([100], dtype=torch.int32)
    with pytest.raises(ValueError, match="N=384 rows; the fused GEMM1 needs a multiple of 256"):
        cb.int8_block_silu_masked_gemm(am, sam, b, torch.ones(1, 3, 1), counts)
    with pytest.raises(ValueError, match="max_m=100 rows per expert"):
        cb.int8_block_silu_masked_gemm(am[:, :100], sam[:, :100], b[:, :256], torch.ones(1, 2, 1), counts)
    with pytest.raises(ValueError, match="a must be a CUDA tensor"):
        cb.int8_block_silu_masked_gemm(am, sam, b[:, :256], torch.ones(1, 2, 1), counts)
