"""The exception classes: one home (epmoe.errors), all exported from epmoe, bases as callers catch them."""

import inspect
import re
from pathlib import Path

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
                 "DispatcherUnavailableError"):  # fmt: skip
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
    from epmoe.dispatch import all_to_all, collective, deepep, select as dsel
    from epmoe.experts import cutlass_backend, select as esel

    assert all_to_all.CollectiveError is collective.CollectiveError is epmoe.CollectiveError
    assert collective.RankMismatchError is epmoe.RankMismatchError
    assert deepep.DeepEPBufferError is epmoe.DeepEPBufferError
    assert dsel.DispatcherUnavailableError is epmoe.DispatcherUnavailableError
    assert esel.BackendUnavailableError is epmoe.BackendUnavailableError
    assert cutlass_backend.CutlassUnavailableError is epmoe.CutlassUnavailableError
