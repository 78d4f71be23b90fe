"""Convert DeepSeek-V3/R1 FP8 block checkpoints to INT8 (per channel or per 128x128 block).

DeepSeek publishes its weights as float8 e4m3 with one fp32 multiplier per 128x128 block
(``weight_scale_inv``; despite the name, ``w = q * scale_inv``). GPUs without FP8 run INT8
instead. The public channel-wise and block-wise INT8 DeepSeek-R1 checkpoints were made by
dequantizing FP8 to BF16 and quantizing that BF16 tensor again; :func:`convert_tensor` does exactly
that, with the project's one rounding rule (:mod:`epmoe.quant.reference`).

Output naming follows those public checkpoints and the engines that read them:

* ``int8_channel``: ``W.weight`` int8 ``[N, K]`` and ``W.weight_scale`` fp32 ``[N, 1]``;
  ``quantization_config = {"quant_method": "w8a8_int8", "activation_scheme": "dynamic"}``.
* ``int8_block``: ``W.weight`` int8 ``[N, K]`` and ``W.weight_scale_inv`` fp32
  ``[ceil(N/128), ceil(K/128)]``; ``quantization_config = {"quant_method": "blockwise_int8",
  "weight_block_size": [128, 128], "activation_scheme": "dynamic"}``.

The converter works in three steps: :func:`plan_conversion` reads only the safetensors headers of
every shard and validates names, dtypes and shapes before anything is written; each shard is then
converted one tensor at a time (:func:`convert_checkpoint`), streamed through a safetensors writer
whose header is known up front, so peak memory is about one tensor, not one shard; last come the
other files, ``config.json`` and the index. Every file is written to ``NAME.tmp`` and renamed into
place after ``fsync``, and each finished shard is recorded (size, SHA-256) in
``DST/.epmoe-convert.json``, so a crash leaves either a complete file or none, and ``resume=True``
skips the shards already done. The index is written last: a directory with an index is complete.

The module also reads checkpoints for the layer: :func:`iter_expert_weights` streams one layer's
routed-expert tensors in the naming that ``DeepEPMoELayer.load_weights`` takes, and
:func:`checkpoint_scheme` / :func:`layer_kwargs_from_config` say how to build that layer.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import re
import shutil
import struct
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .reference import dequantize_weight, quantize_weight
from .schemes import BLOCK, SCHEMES

log = logging.getLogger("epmoe")

TARGETS = ("int8_channel", "int8_block")
INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.json"
MANIFEST_NAME = ".epmoe-convert.json"
MANIFEST_FORMAT = 1

_TARGET_QUANT_CONFIG = {
    "int8_channel": {"quant_method": "w8a8_int8", "activation_scheme": "dynamic"},
    "int8_block": {
        "quant_method": "blockwise_int8",
        "weight_block_size": [BLOCK, BLOCK],
        "activation_scheme": "dynamic",
    },
}
_TARGET_SCALE_SUFFIX = {"int8_channel": "weight_scale", "int8_block": "weight_scale_inv"}

# quantization_config.quant_method -> epmoe scheme of the expert weights.
_QUANT_METHOD_SCHEME = {"fp8": "fp8_block", "w8a8_int8": "int8_channel", "blockwise_int8": "int8_block"}

_ROUTED_RE = re.compile(
    r"^(?P<prefix>.*)\.mlp\.experts\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$"
)
_SHARED_RE = re.compile(r"^.*\.mlp\.shared_experts\.(gate_proj|up_proj|down_proj)\.weight$")
_SHARD_NAME_RE = re.compile(r"^[^/\\]+\.safetensors$")

# Rows converted at once: a multiple of BLOCK (so blocks never straddle two chunks) that keeps the
# fp32 temporaries of an 18432 x 7168 dense weight at ~30 MB instead of ~2 GB.
_CHUNK_ROWS = 8 * BLOCK
_COPY_CHUNK = 4 << 20  # big enough for full-speed sequential I/O, small next to a shard
_MAX_HEADER = 100 << 20  # the limit the safetensors library itself enforces

_DTYPES: dict[str, tuple[torch.dtype | None, int]] = {
    "BOOL": (torch.bool, 1),
    "U8": (torch.uint8, 1),
    "I8": (torch.int8, 1),
    "F8_E4M3": (torch.float8_e4m3fn, 1),
    "F8_E5M2": (torch.float8_e5m2, 1),
    "I16": (torch.int16, 2),
    "U16": (getattr(torch, "uint16", None), 2),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "I32": (torch.int32, 4),
    "U32": (getattr(torch, "uint32", None), 4),
    "F32": (torch.float32, 4),
    "I64": (torch.int64, 8),
    "U64": (getattr(torch, "uint64", None), 8),
    "F64": (torch.float64, 8),
}
_TORCH_TO_ST = {dt: name for name, (dt, _) in _DTYPES.items() if dt is not None}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --------------------------------------------------------------------------------------------
# Tensor conversion
# --------------------------------------------------------------------------------------------


def _check_target(target: str) -> None:
    if target not in TARGETS:
        raise ValueError(f"target={target!r} is not a conversion target; allowed: {list(TARGETS)}")


def _check_fp8_pair(name: str, weight: torch.Tensor, scale_inv: torch.Tensor) -> None:
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(
            f"{name}: dtype {weight.dtype} (shape {tuple(weight.shape)}); expected torch.float8_e4m3fn"
        )
    if weight.dim() != 2:
        raise ValueError(f"{name}: shape {tuple(weight.shape)}; expected a 2-D [N, K] weight")
    n, k = weight.shape
    want = (_cdiv(n, BLOCK), _cdiv(k, BLOCK))
    if tuple(scale_inv.shape) != want:
        raise ValueError(
            f"{name}_scale_inv: shape {tuple(scale_inv.shape)}; expected {list(want)} = "
            f"[ceil({n}/{BLOCK}), ceil({k}/{BLOCK})] for a [{n}, {k}] weight"
        )
    if scale_inv.dtype != torch.float32:
        raise ValueError(f"{name}_scale_inv: dtype {scale_inv.dtype}; expected torch.float32")
    if not bool(torch.isfinite(scale_inv).all()):
        bad = (~torch.isfinite(scale_inv)).nonzero()[0].tolist()
        raise ValueError(
            f"{name}_scale_inv: non-finite value {scale_inv[tuple(bad)].item()} at block {bad}; "
            "every block scale must be finite"
        )


def dequantize_fp8_block(weight_fp8: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """``weight_fp8 * scale_inv`` (each scale covering a 128x128 block) in fp32, cast to bf16.

    The cast to bf16 is deliberate: it is what DeepSeek's own FP8->BF16 script and the public INT8
    conversions did, so converted weights match theirs bit for bit under the same rounding rule.
    """
    _check_fp8_pair("weight", weight_fp8, scale_inv)
    return dequantize_weight(weight_fp8.unsqueeze(0), scale_inv.unsqueeze(0))[0].to(torch.bfloat16)


def convert_tensor(
    weight_fp8: torch.Tensor, scale_inv: torch.Tensor, target: str, *, name: str = "weight"
) -> dict[str, torch.Tensor]:
    """Convert one FP8-block weight to ``target``: dequantize to BF16, quantize to INT8.

    Args:
        weight_fp8: ``[N, K]`` ``torch.float8_e4m3fn``.
        scale_inv: ``[ceil(N/128), ceil(K/128)]`` fp32 block multipliers (``w = q * scale_inv``).
        target: ``"int8_channel"`` or ``"int8_block"``.
        name: the tensor's name, used in error messages.

    Returns:
        ``{"weight": int8 [N, K], "weight_scale": fp32 [N, 1]}`` for ``int8_channel`` or
        ``{"weight": int8 [N, K], "weight_scale_inv": fp32 [ceil(N/128), ceil(K/128)]}`` for
        ``int8_block``; the keys are the suffixes that replace ``weight`` in the tensor name.

    Raises:
        ValueError: wrong dtype, rank or scale shape, non-finite scales, or a NaN weight.
    """
    _check_target(target)
    _check_fp8_pair(name, weight_fp8, scale_inv)
    scheme = SCHEMES[target]
    n, k = weight_fp8.shape
    q = torch.empty((n, k), dtype=torch.int8)
    if target == "int8_channel":
        scale = torch.empty((n, 1), dtype=torch.float32)
    else:
        scale = torch.empty((_cdiv(n, BLOCK), _cdiv(k, BLOCK)), dtype=torch.float32)
    for r0 in range(0, n, _CHUNK_ROWS):
        r1 = min(n, r0 + _CHUNK_ROWS)
        b0, b1 = r0 // BLOCK, _cdiv(r1, BLOCK)
        w = dequantize_weight(weight_fp8[r0:r1].unsqueeze(0), scale_inv[b0:b1].unsqueeze(0))
        w = w.to(torch.bfloat16)
        if not bool(torch.isfinite(w).all()):
            # e4m3fn has NaN encodings; one would silently poison a whole channel or block scale.
            bad = (~torch.isfinite(w[0])).nonzero()[0].tolist()
            raise ValueError(f"{name}: non-finite weight at [{r0 + bad[0]}, {bad[1]}]")
        qc, sc = quantize_weight(w, scheme)
        q[r0:r1] = qc[0]
        if target == "int8_channel":
            scale[r0:r1] = sc[0]
        else:
            scale[b0:b1] = sc[0]
    return {"weight": q, _TARGET_SCALE_SUFFIX[target]: scale}


# --------------------------------------------------------------------------------------------
# safetensors files, read and written without loading a whole shard
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorInfo:
    """One entry of a safetensors header: dtype string (``"F8_E4M3"``), shape, byte range."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


class SafetensorsFile:
    """A safetensors file read with plain ``read`` calls, one tensor at a time.

    ``safe_open`` would mmap the shard, and every page touched while streaming a shard then counts
    in the process's resident set; explicit reads keep resident memory at the tensor being worked
    on. The header is validated on open, with errors naming the file and the tensor.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            raise FileNotFoundError(f"safetensors file {self.path} does not exist") from None
        with open(self.path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError(f"{self.path}: {size} bytes, too short for a safetensors header")
            (n,) = struct.unpack("<Q", raw)
            if n > _MAX_HEADER or 8 + n > size:
                raise ValueError(
                    f"{self.path}: header length {n} does not fit the file size {size} "
                    "(not a safetensors file, or truncated)"
                )
            header_bytes = f.read(n)
        try:
            header = json.loads(header_bytes)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{self.path}: the safetensors header is not valid JSON ({exc})") from None
        if not isinstance(header, dict):
            raise ValueError(f"{self.path}: the safetensors header is not a JSON object")
        self.header_sha256 = hashlib.sha256(raw + header_bytes).hexdigest()
        self.data_start = 8 + n
        self.size = size
        meta = header.pop("__metadata__", None) or {}
        self.metadata: dict[str, str] = {str(k): str(v) for k, v in meta.items()}
        data_len = size - self.data_start
        self.tensors: dict[str, TensorInfo] = {}
        for name, entry in header.items():
            try:
                dtype, shape, (b, e) = entry["dtype"], entry["shape"], entry["data_offsets"]
                shape = tuple(int(s) for s in shape)
                b, e = int(b), int(e)
            except (KeyError, TypeError, ValueError):
                raise ValueError(
                    f"{self.path}: header entry {name!r} = {entry!r} lacks dtype/shape/data_offsets"
                ) from None
            if not 0 <= b <= e <= data_len or any(s < 0 for s in shape):
                raise ValueError(
                    f"{self.path}: tensor {name!r} has data_offsets [{b}, {e}] or shape "
                    f"{list(shape)} outside the {data_len} data bytes (truncated file?)"
                )
            if dtype in _DTYPES and math.prod(shape) * _DTYPES[dtype][1] != e - b:
                raise ValueError(
                    f"{self.path}: tensor {name!r} {dtype} {list(shape)} needs "
                    f"{math.prod(shape) * _DTYPES[dtype][1]} bytes; its data_offsets give {e - b}"
                )
            self.tensors[name] = TensorInfo(str(dtype), shape, b, e)

    def keys(self) -> list[str]:
        return list(self.tensors)

    def read(self, name: str) -> torch.Tensor:
        """The tensor ``name`` as a CPU tensor that owns its memory."""
        info = self.tensors[name]
        dtype = _DTYPES.get(info.dtype, (None, 0))[0]
        if dtype is None:
            raise ValueError(f"{self.path}: tensor {name!r} has dtype {info.dtype}, which torch cannot hold")
        if info.nbytes == 0:
            return torch.empty(info.shape, dtype=dtype)
        buf = bytearray(info.nbytes)
        with open(self.path, "rb") as f:
            f.seek(self.data_start + info.begin)
            if f.readinto(buf) != info.nbytes:
                raise ValueError(f"{self.path}: tensor {name!r} is truncated")
        return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(info.shape)

    def copy_raw(self, name: str, write) -> None:
        """Stream the bytes of ``name`` to ``write`` in bounded chunks (no dtype needed)."""
        info = self.tensors[name]
        left = info.nbytes
        with open(self.path, "rb") as f:
            f.seek(self.data_start + info.begin)
            while left:
                chunk = f.read(min(left, _COPY_CHUNK))
                if not chunk:
                    raise ValueError(f"{self.path}: tensor {name!r} is truncated")
                write(chunk)
                left -= len(chunk)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # not every platform opens directories; the rename is then all we get
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class _AtomicFile:
    """A file written as ``NAME.tmp`` and renamed to ``NAME`` only after ``fsync``.

    Readers (and a resumed conversion) never see a partial ``NAME``; an exception removes the
    temporary file, and a hard crash leaves only ``NAME.tmp``, which nothing treats as output.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tmp = path.with_name(path.name + ".tmp")
        self.tmp.parent.mkdir(parents=True, exist_ok=True)
        self.f = open(self.tmp, "wb")
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data) -> None:
        self.f.write(data)
        self.sha.update(data)
        self.size += len(data) if isinstance(data, (bytes, bytearray)) else memoryview(data).nbytes

    def commit(self) -> None:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        os.replace(self.tmp, self.path)
        _fsync_dir(self.path.parent)

    def abort(self) -> None:
        if not self.f.closed:
            self.f.close()
        self.tmp.unlink(missing_ok=True)


def _write_atomic_bytes(path: Path, data: bytes) -> None:
    out = _AtomicFile(path)
    try:
        out.write(data)
        out.commit()
    except BaseException:
        out.abort()
        raise


def _safetensors_header(entries: list[tuple[str, str, tuple[int, ...]]], metadata: dict) -> bytes:
    """Header bytes (length prefix included) for tensors laid out in ``entries`` order."""
    header: dict = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    for name, dtype, shape in entries:
        n = math.prod(shape) * _DTYPES[dtype][1]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the safetensors library pads to 8 bytes; so do we
    return struct.pack("<Q", len(text)) + text


def _tensor_bytes(t: torch.Tensor) -> memoryview:
    if sys.byteorder != "little":  # safetensors is little-endian; raw views would be wrong
        raise RuntimeError("writing safetensors needs a little-endian host")
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def write_safetensors(
    path: str | os.PathLike, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None
) -> int:
    """Write ``tensors`` as a safetensors file, atomically (``NAME.tmp`` then rename).

    Readable by the safetensors library; needs no dependency beyond torch. Returns the file size.
    """
    entries = []
    for name, t in tensors.items():
        if t.dtype not in _TORCH_TO_ST:
            raise ValueError(f"tensor {name!r} has dtype {t.dtype}; safetensors holds {sorted(_DTYPES)}")
        entries.append((name, _TORCH_TO_ST[t.dtype], tuple(t.shape)))
    out = _AtomicFile(Path(path))
    try:
        out.write(_safetensors_header(entries, {"format": "pt", **(metadata or {})}))
        for name, t in tensors.items():
            if t.numel():
                out.write(_tensor_bytes(t.detach().cpu()))
        out.commit()
    except BaseException:
        out.abort()
        raise
    return out.size


# --------------------------------------------------------------------------------------------
# Planning: read every header, validate, decide every output tensor
# --------------------------------------------------------------------------------------------


@dataclass
class OutputTensor:
    """One tensor of an output shard.

    ``source`` is ``("copy", src_shard, src_name)`` for bytes copied unchanged, or
    ``("convert", weight_name, suffix)`` for one part of a converted weight.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    source: tuple[str, str, str]


@dataclass
class ShardPlan:
    name: str
    src_bytes: int
    metadata: dict[str, str]
    outputs: list[OutputTensor]

    @property
    def out_bytes(self) -> int:
        return sum(math.prod(o.shape) * _DTYPES[o.dtype][1] for o in self.outputs)


@dataclass
class ConversionPlan:
    """Everything the conversion will write, decided from the source headers alone."""

    src: Path
    dst: Path
    target: str
    dense: bool
    shards: list[ShardPlan]
    # weight name -> (shard of the weight, shard of its scale_inv)
    converted: dict[str, tuple[str, str]]
    index: dict
    config: dict
    source_fingerprint: str
    other_files: list[str]
    unconverted_fp8: list[str] = field(default_factory=list)

    @property
    def weight_map(self) -> dict[str, str]:
        return {o.name: s.name for s in self.shards for o in s.outputs}


def _read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path} does not exist")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} {path} is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what} {path} must hold a JSON object; got {type(data).__name__}")
    return data


def _check_source_quant_config(config: dict, path: Path) -> None:
    qc = config.get("quantization_config")
    if not isinstance(qc, dict):
        raise ValueError(
            f"{path} has no quantization_config; expected DeepSeek's FP8 one "
            '({"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]})'
        )
    method, fmt, block = qc.get("quant_method"), qc.get("fmt", "e4m3"), qc.get("weight_block_size")
    if method != "fp8" or fmt != "e4m3" or list(block or []) != [BLOCK, BLOCK]:
        raise ValueError(
            f"{path}: quantization_config has quant_method={method!r}, fmt={fmt!r}, "
            f"weight_block_size={block!r}; only quant_method='fp8', fmt='e4m3', "
            f"weight_block_size=[{BLOCK}, {BLOCK}] can be converted"
        )


def _check_dirs(src: Path, dst: Path) -> None:
    if not src.is_dir():
        raise FileNotFoundError(f"SRC {src} is not a directory")
    s, d = src.resolve(), dst.resolve()
    if d == s or s in d.parents:
        raise ValueError(f"DST {dst} is inside SRC {src}; choose a directory outside the source checkpoint")
    if d in s.parents:
        raise ValueError(f"SRC {src} is inside DST {dst}; choose a directory outside the source checkpoint")


def _is_converted(name: str, dense: bool) -> bool:
    """Routed and shared expert weights always; any other FP8 linear weight only with ``dense``."""
    return bool(_ROUTED_RE.match(name) or _SHARED_RE.match(name)) or dense


def plan_conversion(
    src: str | os.PathLike, dst: str | os.PathLike, target: str, *, dense: bool = False
) -> ConversionPlan:
    """Read the source index, config and every shard header; validate; decide every output.

    Nothing is written. Every problem is reported before any conversion work starts.

    Raises:
        FileNotFoundError: SRC, its index, its config or a shard named by the index is missing.
        ValueError: an unknown target, DST inside SRC, a malformed index, header or config, a
            tensor missing from its shard or absent from the index, an expert weight that is not
            float8_e4m3fn or not 2-D, a weight without its ``weight_scale_inv`` (or the reverse),
            a scale whose shape is not ``[ceil(N/128), ceil(K/128)]``, or experts of one layer with
            inconsistent shapes.
    """
    _check_target(target)
    src, dst = Path(src), Path(dst)
    _check_dirs(src, dst)
    index_path = src / INDEX_NAME
    index = _read_json(index_path, "index")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index_path}: 'weight_map' must be a non-empty object of tensor name -> shard")
    config = _read_json(src / CONFIG_NAME, "config")
    _check_source_quant_config(config, src / CONFIG_NAME)

    shard_names = sorted(set(weight_map.values()))
    for s in shard_names:
        if not isinstance(s, str) or not _SHARD_NAME_RE.match(s) or s.startswith("."):
            raise ValueError(
                f"{index_path}: shard name {s!r} must be a plain file name ending in .safetensors"
            )
    files: dict[str, SafetensorsFile] = {}
    fp = hashlib.sha256(index_path.read_bytes())
    for s in shard_names:
        path = src / s
        if not path.is_file():
            owners = [n for n, v in weight_map.items() if v == s]
            raise FileNotFoundError(
                f"shard {path} named by {INDEX_NAME} (for {len(owners)} tensors, e.g. {owners[0]!r}) "
                "does not exist"
            )
        files[s] = SafetensorsFile(path)
        fp.update(f"{s}:{files[s].size}:{files[s].header_sha256}".encode())
        for name in files[s].tensors:
            if name not in weight_map:
                raise ValueError(f"{path}: tensor {name!r} is in the shard but not in {INDEX_NAME}")
    for name, s in weight_map.items():
        if name not in files[s].tensors:
            raise ValueError(f"{INDEX_NAME} maps tensor {name!r} to {s}, but that shard does not hold it")

    def info(name: str) -> TensorInfo:
        return files[weight_map[name]].tensors[name]

    converted: dict[str, tuple[str, str]] = {}
    unconverted: list[str] = []
    for name in weight_map:
        if name.endswith(".weight_scale_inv"):
            w = name[: -len("_scale_inv")]
            if w not in weight_map:
                raise ValueError(f"tensor {name!r} has no weight {w!r} in {INDEX_NAME}")
            continue
        if not name.endswith(".weight"):
            continue
        wi = info(name)
        is_expert = bool(_ROUTED_RE.match(name) or _SHARED_RE.match(name))
        if wi.dtype != "F8_E4M3":
            if is_expert:
                hint = " (already converted?)" if wi.dtype == "I8" else ""
                raise ValueError(
                    f"expert weight {name!r} in {weight_map[name]} has dtype {wi.dtype} shape "
                    f"{list(wi.shape)}; expected F8_E4M3 (float8_e4m3fn){hint}"
                )
            continue
        scale_name = name + "_scale_inv"
        if scale_name not in weight_map:
            raise ValueError(
                f"FP8 weight {name!r} {list(wi.shape)} in {weight_map[name]} has no "
                f"{scale_name!r}; every F8_E4M3 weight needs its fp32 block scale"
            )
        if len(wi.shape) != 2:
            raise ValueError(f"FP8 weight {name!r} has shape {list(wi.shape)}; expected 2-D [N, K]")
        si = info(scale_name)
        n, k = wi.shape
        want = [_cdiv(n, BLOCK), _cdiv(k, BLOCK)]
        if list(si.shape) != want or si.dtype != "F32":
            raise ValueError(
                f"{scale_name!r} in {weight_map[scale_name]} is {si.dtype} {list(si.shape)}; "
                f"expected F32 {want} = [ceil({n}/{BLOCK}), ceil({k}/{BLOCK})] for the [{n}, {k}] weight"
            )
        if _is_converted(name, dense):
            converted[name] = (weight_map[name], weight_map[scale_name])
        else:
            unconverted.append(name)
    _check_expert_shapes(weight_map, info)

    shards = []
    suffix = _TARGET_SCALE_SUFFIX[target]
    dropped = {w + "_scale_inv" for w in converted}
    for s in shard_names:
        f = files[s]
        outputs = []
        # Source byte order keeps reads sequential; a converted weight's scale follows it.
        for name, ti in sorted(f.tensors.items(), key=lambda kv: kv[1].begin):
            if name in dropped:
                continue
            if name in converted:
                n, k = ti.shape
                sshape = (n, 1) if target == "int8_channel" else (_cdiv(n, BLOCK), _cdiv(k, BLOCK))
                outputs.append(OutputTensor(name, "I8", (n, k), ("convert", name, "weight")))
                outputs.append(
                    OutputTensor(name[: -len("weight")] + suffix, "F32", sshape, ("convert", name, suffix))
                )
            else:
                if ti.dtype not in _DTYPES:
                    raise ValueError(f"{f.path}: tensor {name!r} has unknown dtype {ti.dtype!r}")
                outputs.append(OutputTensor(name, ti.dtype, ti.shape, ("copy", s, name)))
        shards.append(ShardPlan(s, f.size, f.metadata, outputs))

    skip = {INDEX_NAME, CONFIG_NAME, *shard_names}
    other = []
    for p in sorted(src.rglob("*")):
        rel = p.relative_to(src).as_posix()
        if not p.is_file() or rel in skip or ".git" in p.relative_to(src).parts:
            continue
        if rel.endswith(".safetensors"):
            log.warning("%s is not in %s; copying it unchanged", p, INDEX_NAME)
        other.append(rel)
    return ConversionPlan(
        src, dst, target, dense, shards, converted, index, config, fp.hexdigest(), other, unconverted
    )


def _check_expert_shapes(weight_map: dict, info) -> None:
    """All routed experts of a layer share [I, H] gate/up and [H, I] down shapes."""
    first: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name in weight_map:
        m = _ROUTED_RE.match(name)
        if not m:
            continue
        shape = info(name).shape
        as_gate = shape if m["proj"] != "down_proj" else tuple(reversed(shape))
        ref_name, ref = first.setdefault(m["prefix"], (name, as_gate))
        if as_gate != ref:
            raise ValueError(
                f"expert weight {name!r} has shape {list(shape)}, inconsistent with {ref_name!r} "
                f"{list(info(ref_name).shape)} (gate/up are [I, H] and down is [H, I] for every "
                "expert of a layer)"
            )


# --------------------------------------------------------------------------------------------
# Conversion
# --------------------------------------------------------------------------------------------


class _Progress:
    """Byte progress over the source shards: tqdm when installed, else a plain stderr line."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled = total, 0, enabled
        self.start = self.last = time.monotonic()
        self.bar = None
        self.desc = ""
        if enabled:
            try:
                from tqdm.auto import tqdm  # optional dependency
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self.bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr)

    def shard(self, i: int, n: int, name: str) -> None:
        self.desc = f"[{i}/{n}] {name}"
        if self.bar is not None:
            self.bar.set_description(self.desc)
        elif self.enabled:
            self._line(force=True)

    def update(self, nbytes: int) -> None:
        self.done += nbytes
        if self.bar is not None:
            self.bar.update(nbytes)
        elif self.enabled and time.monotonic() - self.last >= 1.0:
            self._line()

    def _line(self, force: bool = False) -> None:
        self.last = now = time.monotonic()
        rate = self.done / max(now - self.start, 1e-9)
        eta = (self.total - self.done) / rate if rate > 0 and self.done else float("nan")
        pct = 100.0 * self.done / max(self.total, 1)
        end = "\r" if sys.stderr.isatty() and not force else "\n"
        sys.stderr.write(
            f"convert {self.desc}: {pct:5.1f}% {_fmt_bytes(self.done)}/{_fmt_bytes(self.total)} "
            f"{_fmt_bytes(rate)}/s ETA {_fmt_secs(eta)}{end}"
        )
        sys.stderr.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            self.desc = "done"
            self._line(force=True)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def _fmt_secs(s: float) -> str:
    if not math.isfinite(s):
        return "?"
    return f"{int(s // 60)}m{int(s % 60):02d}s"


@dataclass
class ConversionResult:
    """What :func:`convert_checkpoint` did."""

    dst: Path
    target: str
    shards_written: list[str]
    shards_skipped: list[str]
    tensors_converted: int
    total_size: int


def _load_manifest(dst: Path) -> dict | None:
    path = dst / MANIFEST_NAME
    if not path.exists():
        return None
    try:
        m = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is corrupt ({exc}); delete DST and convert again") from None
    if m.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"{path} has format {m.get('format')!r}; this epmoe writes {MANIFEST_FORMAT}")
    return m


def _save_manifest(dst: Path, manifest: dict) -> None:
    _write_atomic_bytes(dst / MANIFEST_NAME, json.dumps(manifest, indent=1, sort_keys=True).encode())


def _shard_intact(path: Path, rec: dict, verify_hash: bool) -> tuple[bool, str]:
    """Whether a shard recorded as complete is still exactly what was written."""
    if not path.is_file():
        return False, "missing"
    size = path.stat().st_size
    if size != rec["size"]:
        return False, f"size {size} != recorded {rec['size']}"
    try:
        header_sha = SafetensorsFile(path).header_sha256
    except ValueError as exc:
        return False, str(exc)
    if header_sha != rec["header_sha256"]:
        return False, "header differs from the recorded one"
    if verify_hash:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(_COPY_CHUNK):
                h.update(chunk)
        if h.hexdigest() != rec["sha256"]:
            return False, "SHA-256 differs from the recorded one"
    return True, ""


def _prepare_dst(plan: ConversionPlan, resume: bool) -> dict:
    dst = plan.dst
    options = {
        "source": str(plan.src.resolve()),
        "source_fingerprint": plan.source_fingerprint,
        "target": plan.target,
        "dense": plan.dense,
    }
    manifest = _load_manifest(dst) if dst.is_dir() else None
    if manifest is None:
        if dst.exists() and not dst.is_dir():
            raise ValueError(f"DST {dst} is a file; choose a new or empty directory")
        if dst.exists() and any(dst.iterdir()):
            if resume:
                raise ValueError(
                    f"DST {dst} has no {MANIFEST_NAME}: it is not a conversion that can be resumed; "
                    "choose an empty or new directory"
                )
            raise ValueError(
                f"DST {dst} exists and is not empty; choose an empty or new directory "
                "(or pass --resume to continue an interrupted conversion into it)"
            )
        dst.mkdir(parents=True, exist_ok=True)
        manifest = {"format": MANIFEST_FORMAT, **options, "shards": {}, "files": {}, "complete": False}
        _save_manifest(dst, manifest)
        return manifest
    if not resume:
        state = "a finished" if manifest.get("complete") else "an unfinished"
        raise ValueError(
            f"DST {dst} holds {state} conversion ({MANIFEST_NAME}); pass --resume to continue or "
            "verify it, or choose an empty or new directory"
        )
    for key, value in options.items():
        if manifest.get(key) != value:
            raise ValueError(
                f"cannot resume into {dst}: it was started with {key}={manifest.get(key)!r}, "
                f"this run has {key}={value!r}"
            )
    # A *.tmp is by construction an unfinished write; it is never output.
    for tmp in dst.rglob("*.tmp"):
        log.info("removing leftover %s from an interrupted write", tmp)
        tmp.unlink()
    return manifest


def _write_shard(plan: ConversionPlan, shard: ShardPlan, progress: _Progress) -> tuple[dict, int]:
    entries = [(o.name, o.dtype, o.shape) for o in shard.outputs]
    header = _safetensors_header(entries, shard.metadata)
    out = _AtomicFile(plan.dst / shard.name)
    converted, counted = 0, 0
    try:
        out.write(header)
        src_file = SafetensorsFile(plan.src / shard.name)
        pending: dict[str, torch.Tensor] = {}
        for o in shard.outputs:
            kind, a, b = o.source
            if kind == "copy":
                src_file.copy_raw(b, out.write)
                counted += src_file.tensors[b].nbytes
                progress.update(src_file.tensors[b].nbytes)
                continue
            if b == "weight":
                s_shard = plan.converted[a][1]
                scale_file = src_file if s_shard == shard.name else SafetensorsFile(plan.src / s_shard)
                weight = src_file.read(a)
                pending = convert_tensor(weight, scale_file.read(a + "_scale_inv"), plan.target, name=a)
                converted += 1
                counted += weight.numel()
                progress.update(weight.numel())
                del weight
            t = pending.pop(b)
            if t.dtype != _DTYPES[o.dtype][0] or tuple(t.shape) != o.shape:
                raise RuntimeError(
                    f"internal: {o.name} came out {t.dtype} {list(t.shape)}, "
                    f"planned {o.dtype} {list(o.shape)}"
                )
            out.write(_tensor_bytes(t))
        if out.size != len(header) + shard.out_bytes:
            raise RuntimeError(
                f"internal: wrote {out.size} bytes to {out.tmp}, planned {len(header) + shard.out_bytes}"
            )
        out.commit()
    except BaseException:
        out.abort()
        raise
    # Scales and the header were read but not counted; settle the shard's share of the total.
    progress.update(max(shard.src_bytes - counted, 0))
    return {
        "size": out.size,
        "sha256": out.sha.hexdigest(),
        "header_sha256": hashlib.sha256(header).hexdigest(),
    }, converted


def _output_config(plan: ConversionPlan) -> dict:
    config = json.loads(json.dumps(plan.config))
    src_qc = config["quantization_config"]
    qc = dict(_TARGET_QUANT_CONFIG[plan.target])
    qc["epmoe_conversion"] = {
        "source_quantization_config": src_qc,
        "target": plan.target,
        "converted": ["routed_experts", "shared_experts"] + (["dense"] if plan.dense else []),
        # Without --dense the dense linear weights stay FP8 with their 128x128 weight_scale_inv.
        "fp8_block_weights_kept": len(plan.unconverted_fp8),
        "recipe": "fp8 e4m3 x block scale -> bf16 -> symmetric int8, round half to even",
    }
    config["quantization_config"] = qc
    return config


def convert_checkpoint(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    target: str,
    *,
    dense: bool = False,
    resume: bool = False,
    progress: bool = True,
    verify_hash: bool = False,
) -> ConversionResult:
    """Convert the FP8 checkpoint in ``src`` into ``dst``, shard by shard.

    Args:
        src: directory with ``model.safetensors.index.json``, ``config.json`` and the shards.
        dst: output directory; must be new or empty unless ``resume``; never inside ``src``.
        target: ``"int8_channel"`` or ``"int8_block"``.
        dense: also convert the dense linear weights (attention projections, the dense MLPs of
            the first layers, any other F8_E4M3 weight with a scale). Routed and shared expert
            weights are always converted.
        resume: continue an interrupted conversion into ``dst`` (same source and options):
            recorded shards that are intact are kept, everything else is (re)written.
        progress: show progress on stderr.
        verify_hash: on resume, re-hash kept shards in full instead of checking size and header.

    Returns:
        A :class:`ConversionResult`.
    """
    plan = plan_conversion(src, dst, target, dense=dense)
    manifest = _prepare_dst(plan, resume)
    done: dict = manifest["shards"]
    written, skipped, n_conv = [], [], 0
    todo = []
    for shard in plan.shards:
        rec = done.get(shard.name)
        if rec is not None:
            ok, why = _shard_intact(plan.dst / shard.name, rec, verify_hash)
            if ok:
                skipped.append(shard.name)
                continue
            log.warning("%s was recorded as converted but %s; converting it again", shard.name, why)
            del done[shard.name]
            manifest["complete"] = False
            _save_manifest(plan.dst, manifest)
        todo.append(shard)
    bar = _Progress(sum(s.src_bytes for s in todo), progress and bool(todo))
    try:
        for i, shard in enumerate(todo, 1):
            bar.shard(i, len(todo), shard.name)
            done[shard.name], c = _write_shard(plan, shard, bar)
            n_conv += c
            written.append(shard.name)
            _save_manifest(plan.dst, manifest)
    finally:
        bar.close()

    files: dict = manifest.setdefault("files", {})
    for rel in plan.other_files:
        s, d = plan.src / rel, plan.dst / rel
        size = s.stat().st_size
        if files.get(rel) == size and d.is_file() and d.stat().st_size == size:
            continue
        d.parent.mkdir(parents=True, exist_ok=True)
        tmp = d.with_name(d.name + ".tmp")
        shutil.copyfile(s, tmp)  # follows symlinks: HF cache snapshots are links to blobs
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, d)
        files[rel] = size
    _save_manifest(plan.dst, manifest)

    total = sum(s.out_bytes for s in plan.shards)
    _write_atomic_bytes(
        plan.dst / CONFIG_NAME, (json.dumps(_output_config(plan), indent=2) + "\n").encode()
    )
    index = json.loads(json.dumps(plan.index))
    index["metadata"] = {**(index.get("metadata") or {}), "total_size": total}
    index["weight_map"] = dict(sorted(plan.weight_map.items()))
    # The index goes last: its presence is what marks the directory as a usable checkpoint.
    _write_atomic_bytes(plan.dst / INDEX_NAME, (json.dumps(index, indent=2) + "\n").encode())
    manifest["complete"] = True
    _save_manifest(plan.dst, manifest)
    return ConversionResult(plan.dst, target, written, skipped, n_conv, total)


# --------------------------------------------------------------------------------------------
# Reading checkpoints for the layer
# --------------------------------------------------------------------------------------------


def checkpoint_scheme(path: str | os.PathLike) -> str:
    """The epmoe scheme of the routed-expert weights of the checkpoint in ``path``.

    ``fp8`` -> ``fp8_block``, ``w8a8_int8`` -> ``int8_channel``, ``blockwise_int8`` ->
    ``int8_block``, no quantization_config -> ``bf16``.
    """
    config = _read_json(Path(path) / CONFIG_NAME, "config")
    qc = config.get("quantization_config")
    if qc is None:
        return "bf16"
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method not in _QUANT_METHOD_SCHEME:
        raise ValueError(
            f"{Path(path) / CONFIG_NAME}: quantization_config.quant_method={method!r}; "
            f"epmoe reads {sorted(_QUANT_METHOD_SCHEME)} (or no quantization_config for bf16)"
        )
    return _QUANT_METHOD_SCHEME[method]


def layer_kwargs_from_config(path: str | os.PathLike) -> dict:
    """``DeepEPMoELayer`` constructor arguments read from a DeepSeek ``config.json``.

    Routing follows the DeepSeek-V3 config keys (``n_routed_experts``, ``num_experts_per_tok``,
    ``moe_intermediate_size``, ``n_group``, ``topk_group``, ``norm_topk_prob``, ``scoring_func``,
    ``routed_scaling_factor``, ``topk_method``); ``quant`` comes from :func:`checkpoint_scheme`.
    """
    cfg_path = Path(path) / CONFIG_NAME
    config = _read_json(cfg_path, "config")
    required = ("n_routed_experts", "num_experts_per_tok", "hidden_size", "moe_intermediate_size")
    missing = [k for k in required if k not in config]
    if missing:
        raise ValueError(f"{cfg_path} lacks {missing}; it does not describe a DeepSeek MoE model")
    n_group, topk_group = config.get("n_group"), config.get("topk_group")
    grouped = n_group is not None and topk_group is not None and n_group > 1
    return {
        "num_experts": int(config["n_routed_experts"]),
        "top_k": int(config["num_experts_per_tok"]),
        "hidden_size": int(config["hidden_size"]),
        "intermediate_size": int(config["moe_intermediate_size"]),
        "quant": checkpoint_scheme(path),
        "renormalize": bool(config.get("norm_topk_prob", True)),
        "scoring_func": config.get("scoring_func", "softmax"),
        "num_expert_group": int(n_group) if grouped else None,
        "topk_group": int(topk_group) if grouped else None,
        "routed_scaling_factor": float(config.get("routed_scaling_factor", 1.0)),
        "use_correction_bias": config.get("topk_method") == "noaux_tc",
    }


def iter_expert_weights(
    path: str | os.PathLike,
    layer: int,
    experts: Iterable[int] | None = None,
    *,
    correction_bias: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream the routed-expert tensors of decoder layer ``layer`` from a checkpoint directory.

    Yields ``(name, tensor)`` with DeepSeek names (``model.layers.{L}.mlp.experts.{e}.{proj}.
    {weight|weight_scale|weight_scale_inv}``), one tensor read at a time, shard by shard, in the
    storage format of the checkpoint's scheme: pass the iterator to
    ``DeepEPMoELayer.load_weights``. ``experts`` restricts to those global expert ids.
    ``correction_bias`` also yields the layer's ``mlp.gate.e_score_correction_bias`` (for a layer
    built with ``use_correction_bias=True``).

    Raises:
        FileNotFoundError: no index or a missing shard.
        ValueError: the layer has no routed experts in the checkpoint, or a requested expert lacks
            one of its three projections.
    """
    root = Path(path)
    index = _read_json(root / INDEX_NAME, "index")
    weight_map = index.get("weight_map") or {}
    wanted = None if experts is None else {int(e) for e in experts}
    pat = re.compile(
        rf"^(?:.*\.)?layers\.{int(layer)}\.mlp\.experts\.(\d+)\."
        r"(gate_proj|up_proj|down_proj)\.(weight|weight_scale|weight_scale_inv)$"
    )
    bias_re = re.compile(rf"^(?:.*\.)?layers\.{int(layer)}\.mlp\.gate\.e_score_correction_bias$")
    by_shard: dict[str, list[str]] = {}
    found: dict[int, dict[str, str]] = {}
    layer_ids: set[int] = set()
    have_bias = False
    for name, shard in weight_map.items():
        if correction_bias and bias_re.match(name):
            by_shard.setdefault(shard, []).append(name)
            have_bias = True
            continue
        m = pat.match(name)
        if m is None:
            continue
        layer_ids.add(int(m[1]))
        if wanted is None or int(m[1]) in wanted:
            by_shard.setdefault(shard, []).append(name)
            if m[3] == "weight":
                found.setdefault(int(m[1]), {})[m[2]] = name
    if not layer_ids:
        raise ValueError(f"{root / INDEX_NAME} has no routed expert weights for layer {layer}")
    if correction_bias and not have_bias:
        raise ValueError(
            f"{root / INDEX_NAME} has no e_score_correction_bias for layer {layer}; "
            "pass correction_bias=False for a model without one"
        )
    scale_suffix = {"fp8_block": "weight_scale_inv", "int8_block": "weight_scale_inv",
                    "int8_channel": "weight_scale", "bf16": None}[checkpoint_scheme(root)]  # fmt: skip
    for e in sorted(wanted if wanted is not None else found):
        have = found.get(e, {})
        if set(have) != {"gate_proj", "up_proj", "down_proj"}:
            raise ValueError(
                f"layer {layer} expert {e}: checkpoint has projections {sorted(have)}; "
                "expected gate_proj, up_proj and down_proj"
            )
        for w in have.values():
            if scale_suffix is not None and w[: -len("weight")] + scale_suffix not in weight_map:
                raise ValueError(
                    f"{w!r} has no {scale_suffix!r}: a {checkpoint_scheme(root)} checkpoint stores "
                    "one fp32 scale tensor with every expert weight"
                )
    for shard in sorted(by_shard):
        f = SafetensorsFile(root / shard)
        for name in sorted(by_shard[shard], key=lambda n: f.tensors[n].begin if n in f.tensors else -1):
            if name not in f.tensors:
                raise ValueError(f"{INDEX_NAME} maps {name!r} to {shard}, but that shard does not hold it")
            yield name, f.read(name)


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``epmoe convert``."""
    parser.add_argument("--to", dest="target", required=True, choices=TARGETS, help="output scheme")
    parser.add_argument("src", metavar="SRC", help="DeepSeek FP8 checkpoint directory")
    parser.add_argument("dst", metavar="DST", help="output directory (new or empty; not inside SRC)")
    parser.add_argument(
        "--dense",
        action="store_true",
        help="also convert the dense linear weights (attention, dense MLP); experts always are",
    )
    parser.add_argument("--resume", action="store_true", help="continue an interrupted conversion in DST")
    parser.add_argument(
        "--verify-hash",
        action="store_true",
        help="with --resume, re-hash already written shards instead of checking size and header",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress output")


def run(args: argparse.Namespace) -> int:
    """Run ``epmoe convert`` with parsed ``args``; errors become a message and exit status 2."""
    try:
        res = convert_checkpoint(
            args.src,
            args.dst,
            args.target,
            dense=args.dense,
            resume=args.resume,
            progress=not args.quiet,
            verify_hash=args.verify_hash,
        )
    except (ValueError, FileNotFoundError) as exc:
        print(f"epmoe convert: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # disk full, permissions: the shards finished so far are kept
        print(f"epmoe convert: error: {exc}; fix the cause and rerun with --resume", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("epmoe convert: interrupted; rerun with --resume to continue", file=sys.stderr)
        return 130
    print(
        f"converted {res.tensors_converted} weights to {res.target}: {len(res.shards_written)} shards "
        f"written, {len(res.shards_skipped)} kept from an earlier run, {_fmt_bytes(res.total_size)} "
        f"of tensors in {res.dst}"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """``epmoe convert --to int8_channel|int8_block [--dense] [--resume] SRC DST``."""
    parser = argparse.ArgumentParser(
        prog="epmoe convert",
        description="Convert a DeepSeek FP8 block checkpoint to INT8 (channel-wise or block-wise).",
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
