"""Planning a conversion: read the index, the config and every shard header, validate names,
dtypes and shapes, and decide every output tensor before anything is written."""

from __future__ import annotations

import hashlib
import logging
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..quant.schemes import BLOCK
from .files import DTYPES, SafetensorsFile, TensorInfo, read_json
from .formats import CONFIG_NAME, INDEX_NAME, TARGET_SCALE_SUFFIX
from .names import is_shared_expert_weight, parse_expert_name
from .requantize import cdiv, check_target

log = logging.getLogger("epmoe")

_SHARD_NAME_RE = re.compile(r"^[^/\\]+\.safetensors$")


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
        return sum(math.prod(o.shape) * DTYPES[o.dtype][1] for o in self.outputs)


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


def is_expert_weight(name: str) -> bool:
    """A routed or shared expert's ``weight`` (not its scale): converted whatever ``dense``."""
    parsed = parse_expert_name(name)
    return (parsed is not None and parsed.kind == "weight") or is_shared_expert_weight(name)


def _is_converted(name: str, dense: bool) -> bool:
    """Routed and shared expert weights always; any other FP8 linear weight only with ``dense``."""
    return is_expert_weight(name) or dense


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
    check_target(target)
    src, dst = Path(src), Path(dst)
    _check_dirs(src, dst)
    index_path = src / INDEX_NAME
    index = read_json(index_path, "index")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index_path}: 'weight_map' must be a non-empty object of tensor name -> shard")
    config = read_json(src / CONFIG_NAME, "config")
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
        is_expert = is_expert_weight(name)
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
        want = [cdiv(n, BLOCK), cdiv(k, BLOCK)]
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
    suffix = TARGET_SCALE_SUFFIX[target]
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
                sshape = (n, 1) if target == "int8_channel" else (cdiv(n, BLOCK), cdiv(k, BLOCK))
                outputs.append(OutputTensor(name, "I8", (n, k), ("convert", name, "weight")))
                outputs.append(
                    OutputTensor(name[: -len("weight")] + suffix, "F32", sshape, ("convert", name, suffix))
                )
            else:
                if ti.dtype not in DTYPES:
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
        m = parse_expert_name(name)
        if m is None or m.kind != "weight":
            continue
        shape = info(name).shape
        as_gate = shape if m.proj != "down_proj" else tuple(reversed(shape))
        ref_name, ref = first.setdefault(m.prefix, (name, as_gate))
        if as_gate != ref:
            raise ValueError(
                f"expert weight {name!r} has shape {list(shape)}, inconsistent with {ref_name!r} "
                f"{list(info(ref_name).shape)} (gate/up are [I, H] and down is [H, I] for every "
                "expert of a layer)"
            )

