"""The small DeepSeek-V3-architecture language model of the accuracy study (docs/accuracy.md):
its data, configurations, checkpoint formats and the held-out scoring shared by
``train_tiny_moe.py``, ``eval_ppl.py`` and ``accuracy_run.py``.

Data: text that ships with every Python, byte-level (no tokenizer): the topics of
``pydoc_data.topics`` (one document per topic) and the standard library's ``.py`` sources (one
document per file; ``site-packages`` and ``pydoc_data/topics.py``, the source of the topics, are
left out). A document is held out when a hash of its *name* falls below the held-out fraction, so
a name goes to the same side on every Python; the contents differ between Python versions, so the
training run saves the held-out token ids (``heldout_tokens.npy``) and every evaluation reads those,
never the stdlib of the Python it runs on.
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
import re
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

BOS, EOS, PAD = 256, 257, 258
VOCAB = 264
"""256 bytes, BOS, EOS, PAD; padded to a multiple of 8 (ids 259..263 never occur)."""
SYMBOLS = 258
"""Ids that occur in the data (bytes, BOS, EOS): the unigram model's alphabet."""
SPLIT_SALT = "epmoe-tinylm-split-v1"
HELDOUT_TOKENS = "heldout_tokens.npy"
DATA_JSON = "data.json"
BF16_DIR, FP8_DIR = "bf16", "fp8"

# (name, config keyword arguments, sequence length): "full" is the study's model, "tiny" the CPU
# test's miniature of the same architecture (grouped routing, shared expert, first layer dense).
SIZES = {
    "full": dict(
        hidden_size=512, num_hidden_layers=6, first_k_dense_replace=1, intermediate_size=1536,
        n_routed_experts=32, num_experts_per_tok=4, n_group=4, topk_group=2, moe_intermediate_size=256,
        n_shared_experts=1, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=256,
        kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, seq_len=512,
    ),
    "tiny": dict(
        hidden_size=128, num_hidden_layers=3, first_k_dense_replace=1, intermediate_size=256,
        n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, moe_intermediate_size=128,
        n_shared_experts=1, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=128,
        kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=64, seq_len=64,
    ),
}  # fmt: skip


def model_config(size: str):
    """The ``DeepseekV3Config`` of ``size`` (``"full"`` or ``"tiny"``)."""
    from transformers import DeepseekV3Config

    if size not in SIZES:
        raise ValueError(f"size={size!r}; allowed: {sorted(SIZES)}")
    kw = {k: v for k, v in SIZES[size].items() if k != "seq_len"}
    return DeepseekV3Config(
        vocab_size=VOCAB, max_position_embeddings=SIZES[size]["seq_len"], bos_token_id=BOS, eos_token_id=EOS,
        pad_token_id=PAD, tie_word_embeddings=False, routed_scaling_factor=2.5, norm_topk_prob=True,
        hidden_act="silu", **kw,
    )  # fmt: skip


# ------------------------------------------------------------------------------------- data
def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus() -> list[tuple[str, bytes]]:
    """``(name, bytes)`` of every document, sorted by name: ``pydoc:<topic>`` and ``stdlib:<path>``."""
    try:
        import pydoc_data.topics

        topics = pydoc_data.topics.topics
    except ImportError:  # some distributions split pydoc_data off; data.json then counts 0 topics
        topics = {}
    docs = [(f"pydoc:{k}", v.encode("utf-8")) for k, v in topics.items()]
    root = stdlib_root()
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if {"site-packages", "dist-packages", "__pycache__"} & set(rel.parts):
            continue
        if rel.as_posix() == "pydoc_data/topics.py":
            continue  # the topics themselves, already in as documents
        try:
            docs.append((f"stdlib:{rel.as_posix()}", path.read_bytes()))
        except OSError:  # a broken link or an unreadable file: not part of this Python's corpus
            continue
    return sorted(docs)


def is_heldout(name: str, fraction: float) -> bool:
    """Whether document ``name`` is held out: a hash of the name only, the same on every Python."""
    h = int.from_bytes(hashlib.sha256(f"{SPLIT_SALT}:{name}".encode()).digest()[:8], "big")
    return h < fraction * 2**64


def encode(docs: list[tuple[str, bytes]]) -> np.ndarray:
    """One uint16 stream: ``BOS bytes EOS`` per document, in the given order."""
    parts = []
    for _, data in docs:
        parts += [np.array([BOS], np.uint16), np.frombuffer(data, np.uint8).astype(np.uint16), np.array([EOS], np.uint16)]
    return np.concatenate(parts) if parts else np.zeros(0, np.uint16)


@dataclass
class Split:
    """The corpus of this Python split by whole documents."""

    train: np.ndarray
    heldout: np.ndarray
    train_names: list[str]
    heldout_names: list[str]
    info: dict


def split_corpus(fraction: float) -> Split:
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"heldout fraction={fraction!r}; allowed: 0 < fraction < 1")
    docs = corpus()
    held = [d for d in docs if is_heldout(d[0], fraction)]
    train = [d for d in docs if not is_heldout(d[0], fraction)]
    if not held or not train:
        raise ValueError(f"heldout fraction={fraction} leaves {len(held)} held-out and {len(train)} training documents")
    train_ids, held_ids = encode(train), encode(held)

    def digest(a: np.ndarray) -> str:
        return hashlib.sha256(a.tobytes()).hexdigest()

    info = dict(
        python=platform.python_version(), stdlib=str(stdlib_root()), split_salt=SPLIT_SALT,
        heldout_fraction=fraction, documents=len(docs),
        pydoc_topics=sum(n.startswith("pydoc:") for n, _ in docs),
        train_documents=len(train), train_pydoc_topics=sum(n.startswith("pydoc:") for n, _ in train),
        train_tokens=int(train_ids.size), train_sha256=digest(train_ids),
        heldout_documents=len(held), heldout_tokens=int(held_ids.size), heldout_sha256=digest(held_ids),
        heldout_names=[n for n, _ in held],
        heldout_document_sha256={n: hashlib.sha256(d).hexdigest()[:16] for n, d in held},
    )  # fmt: skip
    return Split(train_ids, held_ids, [n for n, _ in train], [n for n, _ in held], info)


def train_batches(tokens: np.ndarray, seq_len: int, batch: int, seed: int):
    """Endless ``[batch, seq_len]`` int64 arrays: non-overlapping windows of the training stream,
    shuffled per epoch by a generator seeded with ``(seed, epoch)`` (the same order on every run)."""
    n = tokens.size // seq_len
    if n < batch:
        raise ValueError(f"the training stream has {n} windows of {seq_len} tokens; batch={batch} needs more")
    windows = tokens[: n * seq_len].reshape(n, seq_len)
    epoch = 0
    while True:
        order = np.random.default_rng([seed, epoch]).permutation(n)
        for i in range(0, n - batch + 1, batch):
            yield epoch, windows[order[i : i + batch]].astype(np.int64)
        epoch += 1


def eval_windows(tokens: np.ndarray, seq_len: int, max_tokens: int) -> np.ndarray:
    """``[W, seq_len]`` int64: the held-out stream from its start in non-overlapping windows, as
    many as ``max_tokens`` allows (each scored independently: ``seq_len - 1`` targets)."""
    n = min(tokens.size, max_tokens) // seq_len
    if n < 1:
        raise ValueError(
            f"max_tokens={max_tokens} with {tokens.size} held-out tokens gives no window of seq_len={seq_len}"
        )
    return tokens[: n * seq_len].reshape(n, seq_len).astype(np.int64)


def unigram_perplexity(train: np.ndarray, windows: np.ndarray) -> float:
    """Perplexity of the add-one unigram model of the training stream on the held-out targets
    (every window position after the first), over the :data:`SYMBOLS` ids that occur."""
    counts = np.bincount(train, minlength=VOCAB)[:SYMBOLS].astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    targets = windows[:, 1:].reshape(-1)
    return float(math.exp(-logp[targets].mean()))


# --------------------------------------------------------------------------------- scoring
def score(model, windows: np.ndarray, batch: int, device, reference_top1=None, hooks_off=None) -> dict:
    """Next-token scoring of ``windows`` (each independently, from position 0).

    Returns ``nll_sum`` and ``targets`` (float64 sum over every position after the first),
    ``perplexity``, ``top1`` (int16 ``[W, seq_len - 1]`` argmax per position, on the host) and,
    with ``reference_top1``, ``top1_agreement`` (fraction of positions with the same argmax).
    """
    import torch

    nll, count, top1 = 0.0, 0, []
    with torch.no_grad():
        for i in range(0, windows.shape[0], batch):
            ids = torch.from_numpy(windows[i : i + batch]).to(device)
            logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
            targets = ids[:, 1:]
            logp = torch.log_softmax(logits, dim=-1)
            nll += float(-logp.gather(-1, targets.unsqueeze(-1)).sum().double())
            count += targets.numel()
            top1.append(logits.argmax(-1).to(torch.int16).cpu())
    out = dict(nll_sum=nll, targets=count, perplexity=math.exp(nll / count), top1=torch.cat(top1).numpy())
    if reference_top1 is not None:
        out["top1_agreement"] = float((out["top1"] == reference_top1).mean())
    return out


# --------------------------------------------------------------------------------- saving
_DENSE_LINEAR = re.compile(r"\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|gate_proj|up_proj|down_proj)\.weight$")
FP8_QUANT_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
"""DeepSeek-V3's ``quantization_config`` (what ``epmoe convert`` reads)."""


def is_fp8_weight(name: str) -> bool:
    """The linear weights DeepSeek ships in FP8: attention projections, dense and shared MLPs,
    routed experts (not the router ``mlp.gate``, the embeddings, the norms or the head)."""
    return name.startswith("model.layers.") and _DENSE_LINEAR.search(name) is not None


def write_fp8_copy(bf16_dir: Path, fp8_dir: Path, shards: int = 2) -> dict:
    """An FP8-block copy of the ``save_pretrained`` directory ``bf16_dir``, the way DeepSeek ships
    weights: every :func:`is_fp8_weight` tensor as float8_e4m3fn with an fp32 ``weight_scale_inv``
    per 128x128 block (the project's rounding rule), the rest as saved; ``shards`` safetensors
    files with an index; ``config.json`` with DeepSeek's ``quantization_config``."""
    from safetensors.torch import load_file

    from epmoe.checkpoint.files import write_safetensors
    from epmoe.checkpoint.synthetic import fp8_block_weight

    fp8_dir.mkdir(parents=True, exist_ok=False)
    tensors: dict = {}
    for f in sorted(bf16_dir.glob("*.safetensors")):
        tensors.update(load_file(f))
    out: dict = {}
    for name in sorted(tensors):
        t = tensors[name]
        if is_fp8_weight(name):
            out[name], out[name + "_scale_inv"] = fp8_block_weight(t)
        else:
            out[name] = t
    bases = [n for n in out if not n.endswith("_scale_inv")]  # a weight and its scale share a shard
    weight_map = {}
    for i in range(shards):
        shard = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {}
        for n in bases[i * len(bases) // shards : (i + 1) * len(bases) // shards]:
            part[n] = out[n]
            if n + "_scale_inv" in out:
                part[n + "_scale_inv"] = out[n + "_scale_inv"]
        write_safetensors(fp8_dir / shard, part)
        weight_map.update({n: shard for n in part})
    total = sum(t.numel() * t.element_size() for t in out.values())
    (fp8_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2)
    )
    config = json.loads((bf16_dir / "config.json").read_text())
    config["quantization_config"] = dict(FP8_QUANT_CONFIG)
    (fp8_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    n_fp8 = sum(is_fp8_weight(n) for n in tensors)
    return dict(fp8_weights=n_fp8, other_tensors=len(tensors) - n_fp8, bytes=total, shards=shards)


def write_data(root: Path, split: Split, seq_len: int) -> None:
    """The held-out token ids and the split's facts next to the checkpoints."""
    np.save(root / HELDOUT_TOKENS, split.heldout)
    (root / DATA_JSON).write_text(json.dumps({**split.info, "seq_len": seq_len}, indent=1) + "\n")


def read_data(root: Path) -> tuple[np.ndarray, dict]:
    path = root / HELDOUT_TOKENS
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: train first (benchmarks/train_tiny_moe.py --ckpt {root})")
    tokens, data = np.load(path), json.loads((root / DATA_JSON).read_text())
    digest = hashlib.sha256(tokens.tobytes()).hexdigest()
    if digest != data["heldout_sha256"]:
        raise ValueError(f"{path} has SHA-256 {digest}; {root / DATA_JSON} records {data['heldout_sha256']}")
    return tokens, data


def pyplot():
    """matplotlib's pyplot on the file-only Agg backend; SystemExit naming the extra without it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit(f"plots need matplotlib (pip install 'epmoe[plot]'): {exc}") from None
    return plt


def save_figure(fig, path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)


@dataclass
class RunFacts:
    date: str
    commit: str
    python: str
    torch: str
    transformers: str
    triton: str | None
    device: str
    gpu: str | None

    def asdict(self) -> dict:
        return asdict(self)


def run_facts(device, commit: str | None = None) -> RunFacts:
    """Date, commit (``git rev-parse HEAD`` of this checkout unless given), versions and GPU."""
    import datetime

    import torch
    import transformers

    from benchmarks.provenance import git_commit

    commit = git_commit(commit, fallback="unknown (pass --commit)")
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    dev = torch.device(device)
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else None
    return RunFacts(
        datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), commit,
        platform.python_version(), torch.__version__, transformers.__version__, triton_version, str(dev), gpu,
    )  # fmt: skip
