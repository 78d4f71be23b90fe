"""safetensors and JSON files read and written without loading a whole shard.

The converter streams DeepSeek-sized shards (several GB each) one tensor at a time: the reader
uses plain ``read`` calls instead of ``safe_open``'s mmap (every page touched would stay in the
resident set), and the writer streams tensors behind a header known up front. Every file is
written to ``NAME.tmp`` and renamed into place after ``fsync``.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

COPY_CHUNK = 4 << 20  # big enough for full-speed sequential I/O, small next to a shard
_MAX_HEADER = 100 << 20  # the limit the safetensors library itself enforces

DTYPES: dict[str, tuple[torch.dtype | None, int]] = {
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
_TORCH_TO_ST = {dt: name for name, (dt, _) in DTYPES.items() if dt is not None}


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
            if dtype in DTYPES and math.prod(shape) * DTYPES[dtype][1] != e - b:
                raise ValueError(
                    f"{self.path}: tensor {name!r} {dtype} {list(shape)} needs "
                    f"{math.prod(shape) * DTYPES[dtype][1]} bytes; its data_offsets give {e - b}"
                )
            self.tensors[name] = TensorInfo(str(dtype), shape, b, e)

    def keys(self) -> list[str]:
        return list(self.tensors)

    def read(self, name: str) -> torch.Tensor:
        """The tensor ``name`` as a CPU tensor that owns its memory."""
        info = self.tensors[name]
        dtype = DTYPES.get(info.dtype, (None, 0))[0]
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
                chunk = f.read(min(left, COPY_CHUNK))
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


class AtomicFile:
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


def write_atomic_bytes(path: Path, data: bytes) -> None:
    out = AtomicFile(path)
    try:
        out.write(data)
        out.commit()
    except BaseException:
        out.abort()
        raise


def safetensors_header(entries: list[tuple[str, str, tuple[int, ...]]], metadata: dict) -> bytes:
    """Header bytes (length prefix included) for tensors laid out in ``entries`` order."""
    header: dict = {}
    if metadata:
        header["__metadata__"] = metadata
    offset = 0
    for name, dtype, shape in entries:
        n = math.prod(shape) * DTYPES[dtype][1]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the safetensors library pads to 8 bytes; so do we
    return struct.pack("<Q", len(text)) + text


def tensor_bytes(t: torch.Tensor) -> memoryview:
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
            raise ValueError(f"tensor {name!r} has dtype {t.dtype}; safetensors holds {sorted(DTYPES)}")
        entries.append((name, _TORCH_TO_ST[t.dtype], tuple(t.shape)))
    out = AtomicFile(Path(path))
    try:
        out.write(safetensors_header(entries, {"format": "pt", **(metadata or {})}))
        for name, t in tensors.items():
            if t.numel():
                out.write(tensor_bytes(t.detach().cpu()))
        out.commit()
    except BaseException:
        out.abort()
        raise
    return out.size



def read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path} does not exist")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} {path} is not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what} {path} must hold a JSON object; got {type(data).__name__}")
    return data

