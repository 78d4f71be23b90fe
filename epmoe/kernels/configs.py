"""Tile configs of the grouped GEMMs, looked up per (device, mode, N, K, rows per expert).

Tuned configs ship as package data, one JSON file per device name in ``epmoe/configs/`` (the
name with every non-alphanumeric character replaced by ``_``, e.g. ``NVIDIA_H200.json``)::

    {"device": "NVIDIA H200", "triton": "3.6.0", "source": "...",
     "configs": {"int8_channel": {"N=4096,K=7168": {"8": {"BLOCK_M": 16, ...}, ...}}}}

A lookup takes the entry for the smallest tuned row bucket that is >= the batch's rows per expert
(the largest bucket past the end). Shapes or devices without an entry get :func:`default_config`,
a heuristic that fits the device's shared memory. ``EPMOE_CONFIG_DIR`` adds a directory searched
before the package's own. ``epmoe tune`` regenerates the files.
"""

from __future__ import annotations

import bisect
import functools
import json
import os
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from .. import devices
from ..tensors import check_bool

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "configs"
DENSE_SMALL_M_MAX = 64
"""Rows up to which the dense INT8 linear's default rule runs the small-batch kernel
(:func:`epmoe.kernels.dense_configs.default_plan`, re-exported there and by :mod:`epmoe.linear` as
``SMALL_M_MAX``): there a dense linear is a read of its weight, which the tiled GEMMs' 128-wide
tiles spread over too few SMs. Here because this module imports without Triton."""
DENSE_KERNELS = ("small_m", "cutlass", "triton", "tiled")
"""The dense INT8 linear's kernels, those a measured table may name
(:mod:`epmoe.kernels.dense_configs`, which re-exports it as ``KERNELS``): what the ``cutlass``
backend runs on the project's kernel. Here, as :data:`DENSE_TRITON_KERNELS`, because
:mod:`epmoe.linear` reads them at import and this module imports without Triton."""
DENSE_TRITON_KERNELS = ("small_m", "triton", "tiled")
"""The dense kernels the ``triton`` backend runs, and ``cutlass`` through sgl-kernel (whose own
GEMM is its ``tiled``); re-exported by :mod:`epmoe.kernels.dense_configs` as ``TRITON_KERNELS``."""
CUTLASS_DENSE_KERNELS = ("cooperative", "pingpong")
"""The project's CUTLASS dense INT8 GEMM's kernels (``int8_dense_gemm``'s ``kernel``, a
:class:`~epmoe.kernels.dense_configs.CutlassLaunch`'s; the op takes the index): CUTLASS's
cooperative kernel (both consumer warpgroups on one 128 x 256 tile, its epilogue after the MMAs)
and its pingpong kernel (one 128 x 128 tile per warpgroup, one's epilogue under the other's MMAs:
a gain where K is short and the epilogue a large share of a tile). Here so that the launch tables
check them without loading the CUTLASS backend."""
INT32_ACC_MODE = "int8_channel_int32"
"""Mode key of the int32-accumulator variant; its buckets override ``int8_channel``'s one by one."""


def mode_and_accumulator(key: str) -> tuple[str, str]:
    """(kernel mode, accumulator) of a config-table mode key: ``int8_channel_int32`` is
    ``int8_channel`` with the int32 accumulator; every other key is its mode with fp32."""
    return ("int8_channel", "int32") if key == INT32_ACC_MODE else (key, "fp32")


@dataclass(frozen=True)
class GemmConfig:
    """One tile config of the grouped GEMM kernels.

    ``tma`` selects the kernel whose A and B tiles arrive through TMA tensor descriptors instead
    of pointer loads (Hopper and newer; the call falls back to the pointer kernel when the
    operands do not meet TMA's 16-byte alignment, see :func:`epmoe.kernels.grouped_gemm.tma_fallback_reason`).
    With ``tma``: ``persistent`` launches one program per SM walking every output tile;
    ``flatten`` sets the same-named ``tl.range`` option of the tile loop. (Triton's
    ``warp_specialize`` loop option is deliberately absent: on an H200 with Triton 3.6 the
    warp-specialized kernel hung on its first launch.) These three are left out of
    :meth:`to_dict` while False, so entries written before they existed mean (and round-trip to)
    the same thing.
    """

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    swap_ab: bool = False
    num_warps: int = 4
    num_stages: int = 3
    tma: bool = False
    persistent: bool = False
    flatten: bool = False

    _KEYS = (
        "BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "SWAP_AB", "num_warps", "num_stages",
        "TMA", "PERSISTENT", "FLATTEN",
    )
    _OPTIONAL = ("TMA", "PERSISTENT", "FLATTEN")

    def to_dict(self) -> dict:
        d = dict(zip(self._KEYS, asdict(self).values()))
        for key in self._OPTIONAL:
            if not d[key]:
                del d[key]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "GemmConfig":
        unknown = set(d) - set(cls._KEYS)
        if unknown:
            raise ValueError(f"unknown config keys {sorted(unknown)}; allowed: {list(cls._KEYS)}")
        missing = {"BLOCK_M", "BLOCK_N", "BLOCK_K"} - set(d)
        if missing:
            raise ValueError(f"config {d} lacks {sorted(missing)}")
        cfg = cls(
            int(d["BLOCK_M"]), int(d["BLOCK_N"]), int(d["BLOCK_K"]), int(d.get("GROUP_M", 8)),
            check_bool("SWAP_AB", d.get("SWAP_AB", False)), int(d.get("num_warps", 4)), int(d.get("num_stages", 3)),
            check_bool("TMA", d.get("TMA", False)), check_bool("PERSISTENT", d.get("PERSISTENT", False)),
            check_bool("FLATTEN", d.get("FLATTEN", False)),
        )
        cfg.validate()
        return cfg

    def validate(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name.upper()}={v}; must be a power of two >= 16")
        if self.group_m < 1 or self.num_warps not in (1, 2, 4, 8, 16) or self.num_stages < 1:
            raise ValueError(f"config {self.to_dict()} has an invalid GROUP_M, num_warps or num_stages")
        if not self.tma and (self.persistent or self.flatten):
            raise ValueError(f"config {self.to_dict()}: PERSISTENT and FLATTEN need TMA")
        if self.tma and self.swap_ab:
            raise ValueError(f"config {self.to_dict()}: the TMA kernel has no SWAP_AB variant")

    def smem_bytes(self, elem_bytes: int) -> int:
        """Shared memory the pipelined A and B tiles need."""
        return (self.block_m + self.block_n) * self.block_k * elem_bytes * self.num_stages


def device_name(device: torch.device | str | None = None) -> str:
    """The name configs are keyed by: the CUDA device name, or ``"cpu"``."""
    device = torch.device(device) if device is not None else None
    if device is not None and device.type != "cuda":
        return "cpu"
    # is_initialized() is a flag read (true for any CUDA tensor's device); is_available() costs
    # microseconds, and this runs for every GEMM's config lookup.
    if not (torch.cuda.is_initialized() or torch.cuda.is_available()):
        return "cpu"
    return devices.name(device)


def config_filename(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_") + ".json"


def shape_key(n: int, k: int) -> str:
    return f"N={n},K={k}"


@functools.lru_cache(maxsize=None)
def load_table(name: str) -> dict:
    """``{mode: {shape_key: {bucket: config dict}}}`` for a device name (empty when none ships)."""
    path = find_config_file(config_filename(name))
    return {} if path is None else read_config_file(path)


def find_config_file(filename: str) -> Path | None:
    """The first ``filename`` in ``$EPMOE_CONFIG_DIR``'s directories, else in the package's
    configs, else ``None``.

    Raises:
        ValueError: ``$EPMOE_CONFIG_DIR`` names something that is not a directory (a typo would
            silently fall back to the shipped tables)."""
    dirs = [Path(p) for p in os.environ.get("EPMOE_CONFIG_DIR", "").split(os.pathsep) if p]
    missing = [str(d) for d in dirs if not d.is_dir()]
    if missing:
        raise ValueError(
            f"EPMOE_CONFIG_DIR={os.environ['EPMOE_CONFIG_DIR']!r} (from the environment) names "
            f"{missing}, not a directory"
        )
    return next((d / filename for d in dirs + [PACKAGE_DIR] if (d / filename).is_file()), None)


def read_config_file(path: Path | str) -> dict:
    """The ``configs`` table of a config file: ``{mode: {shape_key: {bucket: config dict}}}``."""
    with open(path) as f:
        data = json.load(f)
    table = data.get("configs") if isinstance(data, dict) else None
    if not isinstance(table, dict):
        raise ValueError(f"{path}: expected a JSON object with a 'configs' object")
    return table


def write_config_file(path: Path | str, table: dict, **meta) -> None:
    """Writes a config file the way :func:`load_table` reads it: ``meta`` (device, versions,
    where it came from, measurements) beside ``configs``; clears the cache of loaded tables."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**meta, "configs": table}, indent=1) + "\n")
    load_table.cache_clear()


def pick_bucket(buckets: dict, m_per_expert: float):
    """Value (``{bucket: value}``, buckets as strings) of the smallest bucket >= ``m_per_expert``,
    else of the largest bucket; ``None`` when empty."""
    if not buckets:
        return None
    keys = sorted(int(b) for b in buckets)
    return buckets[str(keys[_bucket_index(keys, m_per_expert)])]


def _bucket_index(bounds: Sequence[int], m_per_expert: float) -> int:
    """Index into the ascending, non-empty ``bounds`` of the smallest bucket >= ``m_per_expert``,
    else of the largest."""
    return min(bisect.bisect_left(bounds, m_per_expert), len(bounds) - 1)


def get_config(
    mode: str,
    n: int,
    k: int,
    m_per_expert: float,
    *,
    device: torch.device | str | None = None,
    accumulator: str = "fp32",
) -> GemmConfig:
    """The config for one grouped GEMM call (tuned entry if one ships, else the default)."""
    bounds, cfgs = _tuned_configs(device_name(device), mode, shape_key(n, k), accumulator)
    if not cfgs:
        return default_config(mode, m_per_expert, device=device)
    return cfgs[_bucket_index(bounds, m_per_expert)]


_TUNED: dict = {}
"""(name, mode, shape, accumulator) -> (the loaded table, its parsed buckets): every GEMM call
looks its config up, so the entries are parsed, checked and sorted once per loaded table, not per
call."""


def _tuned_configs(name: str, mode: str, shape: str, accumulator: str) -> tuple[tuple[int, ...], tuple[GemmConfig, ...]]:
    """``(buckets, configs)`` of one (mode, shape) in the device's table, buckets ascending
    (both empty when none)."""
    table = load_table(name)
    key = (name, mode, shape, accumulator)
    hit = _TUNED.get(key)
    if hit is not None and hit[0] is table:  # a reloaded table (load_table.cache_clear) re-parses
        return hit[1]
    buckets = dict(table.get(mode, {}).get(shape, {}))
    if accumulator == "int32":
        # int32 entries override the mode's bucket by bucket: a file that tuned only some
        # buckets for the int32 accumulator keeps the mode's entries for the others.
        buckets.update(table.get(INT32_ACC_MODE, {}).get(shape, {}))
    parsed = {}
    for bucket, entry in buckets.items():
        cfg = GemmConfig.from_dict(entry)
        if mode == "int8_block" and 128 % cfg.block_k:
            # Refused as an explicit config is: the kernel would run another K step than the
            # table's measurement says.
            raise ValueError(
                f"{find_config_file(config_filename(name))}: int8_block {shape} bucket {bucket}: "
                f"BLOCK_K={cfg.block_k}; allowed: a BLOCK_K dividing 128 (the scale block)"
            )
        parsed[int(bucket)] = cfg
    order = sorted(parsed)
    result = (tuple(order), tuple(parsed[b] for b in order))
    _TUNED[key] = (table, result)
    return result


def default_config(mode: str, m_per_expert: float, *, device: torch.device | str | None = None) -> GemmConfig:
    """Config for shapes without a tuned entry: :func:`heuristic_config` fitted to the device."""
    if device_name(device) == "cpu":
        # Triton's interpreter: few large programs are fastest; MMA shapes do not matter.
        return GemmConfig(16 if m_per_expert <= 16 else 32, 64, 64, 8, False, 4, 1)
    return fit_shared_memory(heuristic_config(mode, m_per_expert), 2 if mode == "bf16" else 1, device)


def heuristic_config(mode: str, m_per_expert: float) -> GemmConfig:
    """Weight-streaming tiles for small batches (short M, long K, deep pipeline), large MMA tiles
    for big ones; sized for Hopper's 227 KB of shared memory."""
    int8 = mode != "bf16"
    kb = 128 if int8 else 64
    if m_per_expert <= 16:
        cfg = GemmConfig(16, 128, 256 if int8 else 128, 1, False, 4, 4)
    elif m_per_expert <= 32:
        cfg = GemmConfig(32, 128, 256 if int8 else 128, 1, False, 4, 4)
    elif m_per_expert <= 64:
        cfg = GemmConfig(64, 128, kb, 8, False, 4, 4)
    elif m_per_expert <= 256:
        cfg = GemmConfig(128, 128, kb, 8, False, 8, 4)
    else:
        cfg = GemmConfig(128, 256, kb, 8, False, 8, 3)
    if mode == "int8_block" and cfg.block_k > 128:
        cfg = replace(cfg, block_k=128, num_stages=cfg.num_stages + 2)
    return cfg


def fit_shared_memory(cfg: GemmConfig, elem_bytes: int, device) -> GemmConfig:
    """Drop pipeline stages (then K width) until the tiles fit the device's shared memory."""
    limit = _smem_limit(device)
    while cfg.smem_bytes(elem_bytes) > limit and cfg.num_stages > 2:
        cfg = replace(cfg, num_stages=cfg.num_stages - 1)
    while cfg.smem_bytes(elem_bytes) > limit and cfg.block_k > 32:
        cfg = replace(cfg, block_k=cfg.block_k // 2)
    return cfg


def _smem_limit(device) -> int:
    if not (torch.cuda.is_initialized() or torch.cuda.is_available()):  # see device_name
        return 1 << 30
    d = torch.device(device) if device is not None else torch.device("cuda")
    if d.type != "cuda":
        return 1 << 30
    # Leave room for the kernel's own scratch (reductions, layout conversions).
    return max(devices.shared_memory_optin(d), 48 * 1024) - 8 * 1024
