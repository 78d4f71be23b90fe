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
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from .files import (
    COPY_CHUNK,
    DTYPES,
    SafetensorsFile,
    AtomicFile,
    safetensors_header,
    tensor_bytes,
    write_atomic_bytes,
)
from .formats import CONFIG_NAME, INDEX_NAME, TARGET_QUANT_CONFIG
from .plan import ConversionPlan, ShardPlan, plan_conversion
from .progress import Progress
from .requantize import convert_tensor

log = logging.getLogger("epmoe")

MANIFEST_NAME = ".epmoe-convert.json"
MANIFEST_FORMAT = 2  # 2: the state of every source shard is recorded (resume refuses a changed one)

@dataclass
class ConversionResult:
    """What :func:`convert_checkpoint` did."""

    dst: Path
    target: str
    shards_written: list[str]
    shards_skipped: list[str]
    tensors_converted: int
    total_size: int

    def summary(self) -> dict:
        """The result as JSON-able values (``epmoe convert --json``)."""
        return {
            "dst": str(self.dst),
            "target": self.target,
            "shards_written": list(self.shards_written),
            "shards_skipped": list(self.shards_skipped),
            "tensors_converted": self.tensors_converted,
            "total_size": self.total_size,
        }


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
    write_atomic_bytes(dst / MANIFEST_NAME, json.dumps(manifest, indent=1, sort_keys=True).encode())


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
    if verify_hash and _file_sha256(path) != rec["sha256"]:
        return False, "SHA-256 differs from the recorded one"
    return True, ""


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(COPY_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _source_state(plan: ConversionPlan, verify_hash: bool) -> dict[str, dict]:
    """Size and modification time of every source shard, and its SHA-256 with ``verify_hash``:
    an in-place rewrite keeps the header and the size, so those alone cannot tell it."""
    state = {}
    for shard in plan.shards:
        path = plan.src / shard.name
        st = path.stat()
        state[shard.name] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
        if verify_hash:
            state[shard.name]["sha256"] = _file_sha256(path)
    return state


def _check_sources(dst: Path, recorded: dict, now: dict, verify_hash: bool) -> None:
    """Refuse to resume when a source shard is not what the conversion started from. With
    ``verify_hash`` and a hash recorded (the first run had ``--verify`` too), the content decides;
    otherwise size and modification time do."""
    for name, rec in sorted(recorded.items()):
        cur = now.get(name)
        if cur is None:
            continue  # a shard no longer in the index changes the fingerprint, refused below
        if verify_hash and "sha256" in rec:
            if cur["sha256"] != rec["sha256"]:
                raise ValueError(
                    f"cannot resume into {dst}: source shard {name} changed since the conversion "
                    "started (its SHA-256 differs); convert again into an empty directory"
                )
            continue
        for key in ("size", "mtime_ns"):
            if cur[key] != rec[key]:
                raise ValueError(
                    f"cannot resume into {dst}: source shard {name} changed since the conversion "
                    f"started ({key} {rec[key]} then, {cur[key]} now); convert again into an empty "
                    "directory (when both runs pass --verify, the content hash decides instead)"
                )


def _prepare_dst(plan: ConversionPlan, resume: bool, verify_hash: bool) -> dict:
    dst = plan.dst
    sources = _source_state(plan, verify_hash)
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
        manifest = {"format": MANIFEST_FORMAT, **options, "sources": sources, "shards": {}, "files": {},
                    "complete": False}  # fmt: skip
        _save_manifest(dst, manifest)
        return manifest
    if not resume:
        state = "a finished" if manifest.get("complete") else "an unfinished"
        raise ValueError(
            f"DST {dst} holds {state} conversion ({MANIFEST_NAME}); pass --resume to continue or "
            "verify it, or choose an empty or new directory"
        )
    _check_sources(dst, manifest.get("sources") or {}, sources, verify_hash)
    for key, value in options.items():
        if manifest.get(key) != value:
            raise ValueError(
                f"cannot resume into {dst}: it was started with {key}={manifest.get(key)!r}, "
                f"this run has {key}={value!r}"
            )
    if verify_hash:  # a hash taken now covers later resumes (size and time matched, or content did)
        manifest["sources"] = sources
    # A *.tmp is by construction an unfinished write; it is never output.
    for tmp in dst.rglob("*.tmp"):
        log.info("removing leftover %s from an interrupted write", tmp)
        tmp.unlink()
    return manifest


def _write_shard(plan: ConversionPlan, shard: ShardPlan, progress: Progress) -> tuple[dict, int]:
    entries = [(o.name, o.dtype, o.shape) for o in shard.outputs]
    header = safetensors_header(entries, shard.metadata)
    out = AtomicFile(plan.dst / shard.name)
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
            if t.dtype != DTYPES[o.dtype][0] or tuple(t.shape) != o.shape:
                raise RuntimeError(
                    f"internal: {o.name} came out {t.dtype} {list(t.shape)}, "
                    f"planned {o.dtype} {list(o.shape)}"
                )
            out.write(tensor_bytes(t))
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
    qc = dict(TARGET_QUANT_CONFIG[plan.target])
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
            recorded shards that are intact are kept, everything else is (re)written. Refused,
            naming the shard, when a source shard's size or modification time (or content, see
            ``verify_hash``) is not what the conversion started from.
        progress: show progress on stderr.
        verify_hash: hash every source shard in full (SHA-256) and record it; on resume, re-hash
            kept output shards instead of checking size and header, and compare source shards by
            content (when the first run recorded a hash) instead of size and modification time.

    Returns:
        A :class:`ConversionResult`.
    """
    plan = plan_conversion(src, dst, target, dense=dense)
    manifest = _prepare_dst(plan, resume, verify_hash)
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
    bar = Progress(sum(s.src_bytes for s in todo), progress and bool(todo))
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
    write_atomic_bytes(
        plan.dst / CONFIG_NAME, (json.dumps(_output_config(plan), indent=2) + "\n").encode()
    )
    index = json.loads(json.dumps(plan.index))
    index["metadata"] = {**(index.get("metadata") or {}), "total_size": total}
    index["weight_map"] = dict(sorted(plan.weight_map.items()))
    # The index goes last: its presence is what marks the directory as a usable checkpoint.
    write_atomic_bytes(plan.dst / INDEX_NAME, (json.dumps(index, indent=2) + "\n").encode())
    manifest["complete"] = True
    _save_manifest(plan.dst, manifest)
    return ConversionResult(plan.dst, target, written, skipped, n_conv, total)

