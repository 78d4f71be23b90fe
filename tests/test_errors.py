"""The exception classes: one home (epmoe.errors), all exported from epmoe, bases as callers catch them."""

import inspect
import re
from pathlib import Path

import pytest

import epmoe
import epmoe.errors


def test_every_error_class_is_exported_with_its_base():
    classes = {n: c for n, c in vars(epmoe.errors).items() if inspect.isclass(c) and issubclass(c, Exception)}
    assert set(classes) == set(epmoe.errors.__all__)
    for name, cls in classes.items():
        assert name in epmoe.__all__ and getattr(epmoe, name) is cls
    # The bases callers catch them by.
    assert issubclass(epmoe.CollectiveTimeoutError, epmoe.CollectiveError)
    assert issubclass(epmoe.RankMismatchError, ValueError)
    for name in ("BackendUnavailableError", "CollectiveError", "CutlassUnavailableError", "DeepEPBufferError",
                 "DispatcherUnavailableError", "RankError"):  # fmt: skip
        assert issubclass(classes[name], RuntimeError)


def test_no_error_class_defined_outside_errors_module():
    # A second definition elsewhere would be a class callers cannot catch through epmoe.
    root = Path(epmoe.__file__).parent
    pattern = re.compile(r"^class \w+\((\w+Error|\w*Exception)\)", re.M)
    stray = [
        f"{path.relative_to(root)}: {m.group(0)}"
        for path in root.rglob("*.py")
        if path.name != "errors.py"
        for m in pattern.finditer(path.read_text())
    ]
    assert stray == []


def test_raising_modules_use_the_exported_classes():
    from epmoe.dispatch import all_to_all, collective, deepep_dispatch as deepep, select as dsel
    from epmoe import launch
    from epmoe.experts import cutlass_backend, select as esel

    assert all_to_all.CollectiveError is collective.CollectiveError is epmoe.CollectiveError
    assert collective.RankMismatchError is epmoe.RankMismatchError
    assert deepep.DeepEPBufferError is epmoe.DeepEPBufferError
    assert dsel.DispatcherUnavailableError is epmoe.DispatcherUnavailableError
    assert esel.BackendUnavailableError is epmoe.BackendUnavailableError
    assert cutlass_backend.CutlassUnavailableError is epmoe.CutlassUnavailableError
    assert launch.RankError is epmoe.RankError


# ------------------------------------------------------- a value from the environment is named so
def _layer(**kw):
    return epmoe.DeepEPMoELayer(num_experts=4, top_k=2, hidden_size=16, intermediate_size=8, device="cpu", **kw)


@pytest.mark.parametrize(
    "var, value, error, reason",
    [
        ("EPMOE_BACKEND", "bogus", ValueError, "is not known"),
        ("EPMOE_BACKEND", "deepgemm", epmoe.BackendUnavailableError, "cannot run"),
        ("EPMOE_DISPATCH", "bogus", ValueError, "is not known"),
        ("EPMOE_DISPATCH", "deepep_normal", epmoe.DispatcherUnavailableError, "cannot run"),
    ],
)
def test_bad_environment_value_is_named_as_the_environment(monkeypatch, var, value, error, reason):
    monkeypatch.setenv(var, value)
    with pytest.raises(error, match=re.escape(f"{var}={value!r} (from the environment) {reason}")) as info:
        _layer()
    assert "backend=" not in str(info.value) and "dispatch=" not in str(info.value)


def test_argument_wins_over_environment_and_is_named_as_the_argument(monkeypatch):
    monkeypatch.setenv("EPMOE_BACKEND", "bogus")
    monkeypatch.setenv("EPMOE_DISPATCH", "bogus")
    layer = _layer(backend="torch", dispatch="local")
    assert (layer.backend.name, layer.dispatcher.name) == ("torch", "local")
    with pytest.raises(ValueError, match=re.escape("backend='nope' is not known")):
        _layer(backend="nope", dispatch="local")


def test_bad_cutlass_impl_and_config_dir_are_named_as_the_environment(monkeypatch, tmp_path):
    from epmoe.experts import cutlass_backend
    from epmoe.kernels import configs

    monkeypatch.setenv("EPMOE_CUTLASS_IMPL", "sgl")  # today: silently the same as "auto"
    with pytest.raises(ValueError, match=re.escape("EPMOE_CUTLASS_IMPL='sgl' (from the environment) is not one of")):
        cutlass_backend._use_sgl()
    missing = str(tmp_path / "no-such-dir")
    monkeypatch.setenv("EPMOE_CONFIG_DIR", missing)  # today: silently the shipped tables
    configs.load_table.cache_clear()
    try:
        with pytest.raises(ValueError, match=re.escape(f"EPMOE_CONFIG_DIR={missing!r} (from the environment)")):
            configs.load_table("NVIDIA_H200")
        # The dense tables look files up the same way, and refuse it the same way.
        with pytest.raises(ValueError, match=re.escape(f"EPMOE_CONFIG_DIR={missing!r} (from the environment)")):
            configs.find_config_file("dense_int8_NVIDIA_H200.json")
    finally:
        configs.load_table.cache_clear()
