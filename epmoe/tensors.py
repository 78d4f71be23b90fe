"""Small helpers shared by the seams: tensor conversion, capture state, argument checks."""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Iterator, Mapping

import torch


def capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on the current stream of ``device``'s kind."""
    # No capture can be under way before CUDA is initialized; is_initialized() is a flag read,
    # where is_available() costs microseconds of host time on every dispatch.
    return device.type == "cuda" and torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def host_reads_allowed(device: torch.device) -> bool:
    """Whether a forward may read device values back on the host: not while dynamo traces it
    (``torch.compile``; a read would break the graph) nor while a CUDA graph is being captured."""
    # is_compiling() first: dynamo folds it to a constant and never sees the CUDA queries.
    return not torch.compiler.is_compiling() and not capturing(device)


def is_integer(value) -> bool:
    """Whether ``value`` is an integer: Python's or NumPy's, not ``bool``."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_choice(name: str, value, allowed) -> None:
    """Raise ``ValueError`` naming ``name``, ``value`` and ``allowed`` unless ``value`` is one of them."""
    if value not in allowed:
        raise ValueError(f"{name}={value!r}; allowed: {list(allowed)}")


def check_positive_int(name: str, value, *, optional: bool = False) -> int | None:
    """``value`` as an ``int``; raises ``ValueError`` naming ``name`` unless it is an integer >= 1
    (or ``None`` when ``optional``). NumPy integers count, ``bool`` does not."""
    if optional and value is None:
        return None
    if not is_integer(value) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer" + (" or None" if optional else ""))
    return int(value)


def _shown(value) -> str:
    """A value in an error message: strings as written, anything else by its type (a message must
    not print a checkpoint's tensors)."""
    return repr(value) if isinstance(value, str) else type(value).__name__


def named_pairs(named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]) -> Iterator[tuple]:
    """The ``(name, tensor)`` pairs of a mapping (``safetensors.load_file``, a ``state_dict``) or
    of an iterable of pairs (``named_parameters``, a checkpoint reader); raises ``TypeError``
    naming the item that is not a pair. The tensors themselves are the caller's to check."""
    if isinstance(named_tensors, Mapping):
        yield from named_tensors.items()
        return
    if isinstance(named_tensors, (str, bytes, torch.Tensor)) or not isinstance(named_tensors, Iterable):
        raise TypeError(f"named_tensors: got {type(named_tensors).__name__}; "
                        "allowed: (name, tensor) pairs, or a mapping name -> tensor")
    for item in named_tensors:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            shown = f"({', '.join(map(_shown, item))})" if isinstance(item, tuple) else (
                f"[{', '.join(map(_shown, item))}]" if isinstance(item, list) else _shown(item))
            raise TypeError(f"named_tensors item {shown}; allowed: (name: str, tensor) pairs, "
                            "or a mapping name -> tensor")
        yield item


def check_bool(name: str, value) -> bool:
    """``value`` as a ``bool`` if it is one, or the integer 0 or 1; raises ``ValueError`` naming
    ``name`` otherwise (a JSON string ``"false"`` would read as true under ``bool()``)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral) and value in (0, 1):
        return bool(value)
    raise ValueError(f"{name}={value!r}; allowed: true, false, 0 or 1")


def as_contiguous(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``t`` as a contiguous tensor of ``dtype`` (default: its own), without a torch call when it
    already is one: each no-op ``.to()`` / ``.contiguous()`` costs microseconds of host time,
    which an eager decode step or the host-synchronised prefill path pays in full."""
    if (dtype is None or t.dtype == dtype) and t.is_contiguous():
        return t
    return (t if dtype is None else t.to(dtype)).contiguous()


def check_tensor(name: str, value, *, optional: bool = False) -> None:
    """Raise ``TypeError`` naming ``name`` unless ``value`` is a ``torch.Tensor`` (or ``None``
    when ``optional``)."""
    if not isinstance(value, torch.Tensor) and not (optional and value is None):
        allowed = "a torch.Tensor or None" if optional else "a torch.Tensor"
        raise TypeError(f"{name} must be {allowed}; got {type(value).__name__}")


def keeping_dtypes(fn, fixed: list[torch.Tensor | None]):
    """``fn`` (what ``nn.Module._apply`` maps over parameters) changed so that the tensors in
    ``fixed`` keep their dtype: a module dtype cast (``.to(torch.bfloat16)``, ``.half()``) leaves
    them as they are, a device move (``.to("cuda")``) still moves them.

    Quantized weights, their fp32 scales and a routing bias are not activations: casting them
    changes results (a bf16 scale moves every output; e4m3 codes cast to bf16 are no longer codes).
    The cast is probed on an empty tensor of the same dtype and device, so a kept tensor is never
    copied into the other dtype, even for a moment.
    """
    ids = {id(t) for t in fixed if t is not None}

    def apply(t):
        if id(t) not in ids:
            return fn(t)
        probe = fn(t.new_empty(0))
        if probe.dtype == t.dtype:
            return fn(t)
        return t.to(device=probe.device)

    return apply


def resolve_device(device) -> torch.device:
    """``device`` with its index filled in (``"cuda"`` means the current CUDA device); ``None``:
    meta under ``with torch.device("meta")``, else CUDA where available, else the CPU. Raises
    ``ValueError`` naming ``device`` for a CUDA device this process cannot use."""
    asked = device
    device = torch.device(device) if device is not None else None
    if device is None and torch.get_default_device().type == "meta":
        device = torch.device("meta")  # under `with torch.device("meta"):`, as large models are built
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device={asked!r}: CUDA is not available here (torch {torch.__version__}, "
                f"built with CUDA {torch.version.cuda}); use device='cpu'"
            )
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        elif device.index >= torch.cuda.device_count():
            raise ValueError(f"device={asked!r}: this process sees {torch.cuda.device_count()} CUDA device(s)")
    return device
