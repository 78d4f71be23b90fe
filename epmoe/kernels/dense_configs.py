"""Which kernel runs one dense INT8 linear call, and with which launch: per device, scheme,
accumulator, shape and batch, as measured by ``benchmarks/sweep_dense_int8.py``.

Tables ship as package data beside the grouped GEMM's, one file per device name,
``epmoe/configs/dense_int8_<device>.json`` (``EPMOE_CONFIG_DIR`` is searched first)::

    {"device": "NVIDIA H200", "triton": "3.6.0", "source": "...", "measured": {...},
     "configs": {"int8_channel_int32": {"N=36864,K=7168": {
         "1": [{"kernel": "small_m", "config": {"block_m": 16, ..., "split_k": 1}, "us": 70.3}],
         "1024": [{"kernel": "cutlass", "config": {"raster_along_n": false, "max_swizzle": 4}, "us": 420.0},
                  {"kernel": "triton", "us": 491.1},
                  {"kernel": "small_m", "config": {...}, "us": 900.2}]}}}}

A bucket lists the kernels the sweep timed there, fastest first, each with its best launch:

* ``small_m``: :func:`epmoe.kernels.dense_int8.dense_int8_small_m` with that launch (split-K
  included); every GPU backend runs it;
* ``cutlass``: the project's CUTLASS INT8 kernel (cooperative or pingpong) with that
  rasterization (:class:`CutlassLaunch`), on the ``cutlass`` backend when it runs the project's
  kernel;
* ``triton``: the Triton tiled grouped GEMM with that tile config (a
  :class:`~epmoe.kernels.configs.GemmConfig`; none: its own lookup), on ``triton`` and ``cutlass``;
* ``tiled`` (tables written before the tiled kernels were told apart): the backend's own tiled
  GEMM at its default launch.

A call takes the first entry its backend can run (:func:`dense_plan`'s ``kernels``) in the
bucket of the smallest row count >= its rows (the largest bucket past the end); a bucket may
also be one entry object instead of a list. Without a runnable entry the rule is
:func:`default_plan`: the small-batch kernel's own launch rule up to :data:`SMALL_M_MAX` rows;
above, the tiled GEMM (``int8_block``: the small-batch kernel with 128-row tiles).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import NamedTuple

import torch

from ..tensors import check_bool
from .configs import (
    CUTLASS_DENSE_KERNELS, DENSE_KERNELS, DENSE_SMALL_M_MAX, DENSE_TRITON_KERNELS, PACKAGE_DIR, GemmConfig, _bucket_index,
    config_filename, device_name, find_config_file, shape_key,
)
from .dense_int8 import SmallMConfig, _sms, small_m_config

KERNELS = DENSE_KERNELS
"""The kernels a table may name (:data:`~epmoe.kernels.configs.DENSE_KERNELS`)."""
SWIZZLES = (1, 2, 4, 8)
FILE_PREFIX = "dense_int8_"
SMALL_M_MAX = DENSE_SMALL_M_MAX
"""Rows up to which the default rule runs the small-batch kernel (see
:data:`~epmoe.kernels.configs.DENSE_SMALL_M_MAX`)."""


class CutlassLaunch(NamedTuple):
    """Which CUTLASS INT8 kernel runs and how it walks its output tiles: along N (every N tile of
    one 128-row block, then the next block) or along M, in groups of ``max_swizzle`` tiles of the
    other dimension. Along N a weight wider than L2 is read from HBM once per row block; along M
    once per group of row blocks. ``kernel``: one of
    :data:`~epmoe.kernels.configs.CUTLASS_DENSE_KERNELS`, ``"cooperative"`` (128 x 256 tiles, the
    default: tables written before there was a choice name none) or ``"pingpong"`` (128 x 128
    tiles, one warpgroup's epilogue under the other's MMAs), whichever the sweep timed faster."""

    raster_along_n: bool = True
    max_swizzle: int = 1
    kernel: str = "cooperative"

    def to_dict(self) -> dict:
        return self._asdict()

    @classmethod
    def from_dict(cls, d: dict) -> "CutlassLaunch":
        unknown = set(d) - set(cls._fields)
        if unknown:
            raise ValueError(f"cutlass launch {d}: unknown keys {sorted(unknown)}; allowed: {list(cls._fields)}")
        cfg = cls(check_bool("cutlass launch raster_along_n", d.get("raster_along_n", True)), int(d.get("max_swizzle", 1)),
                  d.get("kernel", "cooperative"))  # fmt: skip
        if cfg.max_swizzle not in SWIZZLES:
            raise ValueError(f"cutlass launch max_swizzle={cfg.max_swizzle}; allowed: {list(SWIZZLES)}")
        if cfg.kernel not in CUTLASS_DENSE_KERNELS:
            raise ValueError(f"cutlass launch kernel={cfg.kernel!r}; allowed: {list(CUTLASS_DENSE_KERNELS)}")
        return cfg


def _launch(kernel: str, entry: dict):
    if kernel == "small_m":
        return SmallMConfig.from_dict(entry["config"])
    if kernel == "cutlass":
        return CutlassLaunch.from_dict(entry.get("config", {}))
    if kernel == "triton" and "config" in entry:
        return GemmConfig.from_dict(entry["config"])
    return None


def mode_key(scheme: str, accumulator: str) -> str:
    return f"{scheme}_{accumulator}"


def table_path(name: str, directory: Path | str = PACKAGE_DIR) -> Path:
    return Path(directory) / (FILE_PREFIX + config_filename(name))


@functools.lru_cache(maxsize=None)
def load_dense_table(name: str) -> dict:
    """``{mode: {shape_key: (buckets ascending, plans)}}`` of a device's table, parsed and checked
    once (empty when none ships)."""
    path = find_config_file(FILE_PREFIX + config_filename(name))
    return {} if path is None else parse_table(json.loads(path.read_text()), str(path))


def parse_table(data: dict, where: str = "table") -> dict:
    """The checked, parsed form of a table file's JSON (see the module doc):
    ``{mode: {shape: (buckets ascending, ((kernel, launch), ...) per bucket)}}``."""
    configs = data.get("configs") if isinstance(data, dict) else None
    if not isinstance(configs, dict):
        raise ValueError(f"{where}: expected a JSON object with a 'configs' object")
    out: dict = {}
    for mode, shapes in configs.items():
        for shape, buckets in shapes.items():
            parsed = {}
            for bucket, entries in buckets.items():
                at = f"{where}: {mode} {shape} bucket {bucket}"
                choices = []
                for entry in entries if isinstance(entries, list) else [entries]:
                    kernel = entry.get("kernel") if isinstance(entry, dict) else None
                    if kernel not in KERNELS:
                        raise ValueError(f"{at}: kernel={kernel!r}; allowed: {list(KERNELS)} (an entry is "
                                         '{"kernel": ..., "config": {...}}, a bucket one entry or a list)')  # fmt: skip
                    try:
                        choices.append((kernel, _launch(kernel, entry)))
                    except (KeyError, TypeError, ValueError, AttributeError) as exc:
                        raise ValueError(f"{at}: {type(exc).__name__}: {exc} (a small_m entry has a 'config' "
                                         "object of SmallMConfig fields, a cutlass entry one of CutlassLaunch "
                                         "fields, a triton entry's optional one GemmConfig keys)") from exc  # fmt: skip
                if not choices:
                    raise ValueError(f"{at}: an empty list; allowed: one entry or more")
                try:
                    rows = int(bucket)
                except ValueError as exc:
                    raise ValueError(f"{at}: ValueError: {exc} (a bucket is a row count)") from exc
                if rows < 1:
                    raise ValueError(f"{at}: a bucket of {rows} rows; allowed: a row count >= 1")
                parsed[rows] = tuple(choices)
            order = sorted(parsed)
            out.setdefault(mode, {})[shape] = (tuple(order), tuple(parsed[b] for b in order))
    return out


def default_plan(scheme: str, n: int, k: int, m: int, sms: int) -> tuple[str, SmallMConfig | None]:
    """The rule without a measured entry: the small-batch kernel (its own launch rule) up to
    :data:`SMALL_M_MAX` rows; above, the tiled GEMM for ``int8_channel`` and the same kernel with
    unfused 128 x 128 tiles for ``int8_block`` (on the H200 it ran the block scheme 1.2-3.7x
    faster than the Triton tiled GEMM from 256 to 16384 rows, where that GEMM's per-K-block
    scaling made it several times slower than BF16)."""
    if m <= SMALL_M_MAX:
        return "small_m", small_m_config(m, n, k, scheme, sms)
    if scheme == "int8_block":
        return "small_m", small_m_config(m, n, k, scheme, sms, False, block_m=128, block_n=128)
    return "tiled", None


TRITON_KERNELS = DENSE_TRITON_KERNELS
"""What the ``triton`` backend runs (:data:`~epmoe.kernels.configs.DENSE_TRITON_KERNELS`)."""


@functools.lru_cache(maxsize=8192)
def dense_plan(
    scheme: str, accumulator: str, n: int, k: int, m: int, device: torch.device,
    kernels: tuple[str, ...] = TRITON_KERNELS,
) -> tuple[str, SmallMConfig | CutlassLaunch | None]:
    """``(kernel, launch)`` for an ``[m, k] x [n, k]^T`` call on ``device`` by a backend that runs
    ``kernels``: the first of those in the device table's bucket covering ``m`` (at most the
    shape's largest measured bucket), else :func:`default_plan` (cached: the forward asks on every
    call). A shape the sweep measured only at small batches (its time budget ran out) is not
    extrapolated to large ones."""
    sms = _sms(device)
    table = load_dense_table(device_name(device)) if device.type == "cuda" else {}
    hit = table.get(mode_key(scheme, accumulator), {}).get(shape_key(n, k))
    if hit and m <= hit[0][-1]:
        bounds, plans = hit
        for kernel, launch in plans[_bucket_index(bounds, m)]:
            if kernel in kernels:
                return kernel, launch
    return default_plan(scheme, n, k, m, sms)


def write_dense_table(path: Path | str, configs: dict, **meta) -> None:
    """Write a table the way :func:`load_dense_table` reads it (checked first), ``meta`` beside
    ``configs``; clears the caches of loaded tables and plans."""
    data = {**meta, "configs": configs}
    parse_table(data, str(path))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    load_dense_table.cache_clear()
    dense_plan.cache_clear()
