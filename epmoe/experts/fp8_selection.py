"""The FP8 block backends' selection rule (and the cutlass backend's, which also serves INT8) as
pure functions of the machine's facts.

Everything here takes the facts as arguments — compute capability, CUDA version, environment,
which libraries are installed — and touches neither the GPU nor ``os.environ``, so CI checks every
branch on a CPU. :mod:`.cutlass_backend` and :mod:`.deepgemm_backend` call these with the real
facts (see :func:`machine_facts`).

The rule (issue 5):

* ``cutlass`` is considered only when ``SGLANG_CUTLASS_MOE=1``; then it needs a GPU of compute
  capability 9.x, CUDA >= 12.3 (compared as version tuples, so ``"12.10" > "12.3"``), and a kernel:
  a usable sgl-kernel or the CUTLASS headers for the project's own kernel. For the INT8 schemes
  it also needs the project's kernels (headers, and a cached build or a compiler), since
  sgl-kernel has no INT8 grouped GEMM, and for ``int8_channel`` the int32 accumulator. With the variable set
  and a condition failing, ``backend="auto"`` logs a warning naming the condition and moves on;
  ``backend="cutlass"`` raises with the same reason.
* ``deepgemm`` needs compute capability 9.x (DeepGEMM's SM90 kernels; 10.x is SM100, which DeepGEMM
  also supports) and an importable ``deep_gemm``.
* ``backend="auto"`` for ``fp8_block`` therefore walks cutlass -> deepgemm -> torch: without the
  variable it prefers DeepGEMM whenever that is installed.
* Within the cutlass backend, an INT8 batch runs the Triton pass or the CUTLASS kernels by its rows
  per expert (:class:`RowsRule`, from measured crossovers; without data, CUTLASS at every size).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

ENV_VAR = "SGLANG_CUTLASS_MOE"
TRUE_VALUES = frozenset({"1", "true", "yes", "on"})
MIN_CUDA = (12, 3)
CUTLASS_MAJOR = 9
DEEPGEMM_MAJORS = frozenset({9, 10})


@dataclass(frozen=True)
class Decision:
    """Outcome of a selection rule.

    Attributes:
        considered: the backend was enabled for consideration (for cutlass: the variable is set).
        ok: it can run here.
        reason: why (always a sentence naming the deciding condition).
        warn: emit a warning in ``auto`` mode (cutlass enabled but a condition fails).
    """

    considered: bool
    ok: bool
    reason: str
    warn: bool = False


def parse_version(version: str | None) -> tuple[int, ...] | None:
    """``"12.10"`` -> ``(12, 10)``; ``"13.0.1"`` -> ``(13, 0, 1)``; unparsable or ``None`` -> ``None``.

    The release numbers of ``packaging.version.Version`` (PEP 440): a pre-, post- or dev-release
    suffix (``"12.4.post1"``, ``"12.8a"``) is dropped.
    """
    from packaging.version import InvalidVersion, Version

    if not version:
        return None
    try:
        return Version(str(version).strip()).release
    except InvalidVersion:
        return None


def env_enabled(env: Mapping[str, str], name: str = ENV_VAR) -> bool:
    """Whether ``env[name]`` is set to a true value (``1``, ``true``, ``yes``, ``on``)."""
    return str(env.get(name, "")).strip().lower() in TRUE_VALUES


def _fmt_cc(capability: tuple[int, int]) -> str:
    return f"{capability[0]}.{capability[1]}"


def cutlass_decision(
    capability: tuple[int, int] | None,
    cuda_version: str | None,
    env: Mapping[str, str],
    installed: Mapping[str, bool],
) -> Decision:
    """Whether the cutlass backend may run on this machine (FP8 block; INT8 channel adds the
    conditions of ``CutlassBackend.supports``).

    Args:
        capability: compute capability of the target GPU, ``None`` without one.
        cuda_version: the CUDA version torch runs with (``torch.version.cuda``), ``None`` on a CPU
            build.
        env: the environment (``SGLANG_CUTLASS_MOE``).
        installed: ``{"sgl_kernel": bool, "cutlass_headers": bool}``: a usable sgl-kernel with
            ``fp8_blockwise_scaled_grouped_mm`` built for the running torch, and CUTLASS headers
            (``nvidia-cutlass`` or ``EPMOE_CUTLASS_DIR``) for the project's own kernel.

    Returns:
        A :class:`Decision`; ``warn`` is true exactly when the variable is set and a condition fails.
    """
    if not env_enabled(env):
        value = env.get(ENV_VAR)
        got = "is not set" if value is None else f"is {value!r}"
        return Decision(False, False, f"{ENV_VAR}=1 is required to consider cutlass ({ENV_VAR} {got})")

    def fail(reason: str) -> Decision:
        return Decision(True, False, f"{ENV_VAR}=1 but {reason}", warn=True)

    if capability is None:
        return fail("there is no CUDA GPU (cutlass needs compute capability 9.x)")
    if capability[0] != CUTLASS_MAJOR:
        return fail(
            f"the GPU has compute capability {_fmt_cc(capability)}, not 9.x "
            "(the kernel is Hopper sm_90a)"
        )
    parsed = parse_version(cuda_version)
    if parsed is None:
        return fail(f"the CUDA version is unknown ({cuda_version!r}); cutlass needs CUDA >= 12.3")
    if parsed < MIN_CUDA:
        return fail(f"CUDA {cuda_version} is older than 12.3 (compared as version tuples)")
    if installed.get("sgl_kernel"):
        return Decision(True, True, f"{ENV_VAR}=1, compute capability {_fmt_cc(capability)}, "
                        f"CUDA {cuda_version}: sgl-kernel fp8_blockwise_scaled_grouped_mm")
    if installed.get("cutlass_headers"):
        return Decision(True, True, f"{ENV_VAR}=1, compute capability {_fmt_cc(capability)}, "
                        f"CUDA {cuda_version}: epmoe's CUTLASS kernel")
    return fail(
        "no kernel is available: sgl-kernel is not usable with this torch and no CUTLASS headers "
        "were found (pip install nvidia-cutlass, or set EPMOE_CUTLASS_DIR to a CUTLASS checkout "
        "or its include/ directory)"
    )


def deepgemm_decision(
    capability: tuple[int, int] | None, installed: Mapping[str, bool]
) -> Decision:
    """Whether the deepgemm backend may run: compute capability 9.x/10.x and ``deep_gemm``."""
    if capability is None:
        return Decision(True, False, "there is no CUDA GPU (DeepGEMM needs compute capability 9.x)")
    if capability[0] not in DEEPGEMM_MAJORS:
        return Decision(
            True, False,
            f"the GPU has compute capability {_fmt_cc(capability)}; DeepGEMM needs 9.x (or 10.x)",
        )
    if not installed.get("deep_gemm"):
        return Decision(True, False, "deep_gemm is not importable (build DeepGEMM, see docs/fp8.md)")
    return Decision(True, True, f"deep_gemm on compute capability {_fmt_cc(capability)}")


@dataclass(frozen=True)
class AutoChoice:
    """What ``backend="auto"`` picks for ``fp8_block``, with its log lines."""

    backend: str
    warnings: tuple[str, ...]
    refusals: tuple[str, ...]


def fp8_block_auto_choice(
    capability: tuple[int, int] | None,
    cuda_version: str | None,
    env: Mapping[str, str],
    installed: Mapping[str, bool],
) -> AutoChoice:
    """The ``auto`` walk cutlass -> deepgemm -> torch as a pure function (mirrors
    ``epmoe.experts.select.AUTO_ORDER["fp8_block"]``; ``torch`` always runs)."""
    warnings, refusals = [], []
    c = cutlass_decision(capability, cuda_version, env, installed)
    if c.ok:
        return AutoChoice("cutlass", (), ())
    refusals.append(f"cutlass: {c.reason}")
    if c.warn:
        warnings.append(cutlass_warning(c))
    d = deepgemm_decision(capability, installed)
    if d.ok:
        return AutoChoice("deepgemm", tuple(warnings), tuple(refusals))
    refusals.append(f"deepgemm: {d.reason}")
    return AutoChoice("torch", tuple(warnings), tuple(refusals))


def cutlass_warning(decision: Decision) -> str:
    """The warning text for ``auto`` mode when cutlass was asked for but cannot run."""
    return f"cutlass MoE backend not used: {decision.reason}"


def forced_cutlass_error(decision: Decision) -> str:
    """The error text when ``backend="cutlass"`` was forced and cannot run."""
    return f"backend='cutlass' cannot run: {decision.reason}"


def machine_facts(device) -> tuple[tuple[int, int] | None, str | None]:
    """``(compute capability of device or None, torch.version.cuda)`` of this process."""
    import torch

    device = torch.device(device)
    cuda = getattr(torch.version, "cuda", None)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None, cuda
    from .. import devices

    return devices.capability(device), cuda


# ------------------------------------------------------------- INT8: the kernel by rows per expert
INT8_KERNELS = ("triton", "cutlass")
NO_CROSSOVER = "CUTLASS for contiguous batches as today"


def crossover_from_measurements(measured) -> int | None:
    """The rows per expert from which CUTLASS serves: the smallest measured size at which CUTLASS
    is no slower than Triton there and at every larger measured size; ``None`` when Triton wins at
    the largest (CUTLASS never serves).

    Args:
        measured: rows ``{"rows_per_expert": int, "triton_ms": float, "cutlass_ms": float}``.

    Raises:
        ValueError: no rows, a row without those keys, non-positive times or repeated sizes.
    """
    rows = []
    for i, r in enumerate(measured):
        try:
            m, t, c = int(r["rows_per_expert"]), float(r["triton_ms"]), float(r["cutlass_ms"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"measured[{i}] = {r!r} needs rows_per_expert, triton_ms and cutlass_ms ({exc})") from exc
        if m < 1 or not (t > 0 and c > 0):
            raise ValueError(f"measured[{i}] = {r!r}: rows_per_expert must be >= 1 and the times > 0")
        rows.append((m, t, c))
    sizes = [m for m, _, _ in rows]
    if not rows or len(set(sizes)) != len(sizes):
        raise ValueError(f"measured needs at least one row and distinct rows_per_expert; got sizes {sizes}")
    start = None
    for m, t, c in sorted(rows, reverse=True):
        if c > t:
            break
        start = m
    return start


@dataclass(frozen=True)
class RowsRule:
    """Which INT8 kernel serves a contiguous batch, by its rows per expert, for one GPU and scheme.

    Attributes:
        gpu: the device name the data is keyed by (``torch.cuda.get_device_name``).
        scheme: ``"int8_channel"`` or ``"int8_block"``.
        measured: the measurement rows the rule came from (empty: no data).
        cutlass_from: rows per expert from which CUTLASS serves (0 without data: always);
            ``None``: Triton at every size.
        source: where the figures come from (the data's ``source``), or why there are none.
    """

    gpu: str
    scheme: str
    measured: tuple = ()
    cutlass_from: int | None = 0
    source: str = ""

    def kernel_for(self, rows_per_expert: int) -> str:
        """``"triton"`` or ``"cutlass"`` for a batch of ``rows_per_expert`` (mean) rows per expert."""
        if self.cutlass_from is None or rows_per_expert < self.cutlass_from:
            return "triton"
        return "cutlass"

    def describe(self) -> str:
        """One line for ``epmoe info`` and the log: which kernel at which sizes, and why."""
        if not self.measured:
            return f"no crossover data for {self.scheme} on {self.gpu}: {NO_CROSSOVER}"
        figures = ", ".join(f"{r['rows_per_expert']}: {r['triton_ms']:.3g}/{r['cutlass_ms']:.3g}" for r in self.measured)
        if self.cutlass_from is None:
            sizes = "Triton at every size (CUTLASS slower at every measured size)"
        elif self.cutlass_from <= min(r["rows_per_expert"] for r in self.measured):
            sizes = "CUTLASS at every size"
        else:
            sizes = f"Triton below {self.cutlass_from} rows per expert, CUTLASS from {self.cutlass_from}"
        return (f"{self.scheme} on {self.gpu}: {sizes}, for batches sized on the host (sized on the device: "
                f"CUTLASS) (measured Triton/CUTLASS ms by rows per expert: {figures}; {self.source})")  # fmt: skip


def int8_rows_rule(data: Mapping, gpu: str, scheme: str) -> RowsRule:
    """The :class:`RowsRule` for ``gpu`` and ``scheme`` from crossover ``data``
    (``{gpu: {scheme: {"measured": [...], "cutlass_from_rows_per_expert": int | None,
    "source": str}}}``, the file ``epmoe/configs/int8_crossover.json``); without an entry the rule
    is :data:`NO_CROSSOVER` (CUTLASS at every size).

    Raises:
        ValueError: an entry whose stated crossover is not the one its measurements give
            (:func:`crossover_from_measurements`), or whose measurements are malformed.
    """
    entry = (data.get(gpu) or {}).get(scheme)
    if entry is None:
        return RowsRule(gpu, scheme)
    where = f"crossover data for {scheme} on {gpu}"
    try:
        measured = tuple(sorted(entry["measured"], key=lambda r: int(r["rows_per_expert"])))
        start = crossover_from_measurements(measured)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from exc
    stated = entry.get("cutlass_from_rows_per_expert", start)
    if stated != start:
        raise ValueError(f"{where} states cutlass_from_rows_per_expert={stated!r} but its measurements give {start!r}")
    return RowsRule(gpu, scheme, measured, start, str(entry.get("source", "")))
