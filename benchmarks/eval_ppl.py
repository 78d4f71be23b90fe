"""Held-out perplexity and next-token agreement of the tiny DeepSeek-V3 LM per epmoe scheme
(docs/accuracy.md).

Reads what ``train_tiny_moe.py --ckpt ROOT`` wrote (``bf16/``, ``fp8/``, ``heldout_tokens.npy``),
converts the FP8 copy with ``epmoe convert`` (``--to int8_channel`` / ``int8_block``, with and
without ``--dense``) into ``--work``, and scores every variant on the same held-out windows:

* ``hf``: transformers' own experts (``--hf-experts``) on the BF16 checkpoint: the reference;
* ``bf16``: epmoe's layer, BF16, same checkpoint; ``bf16_fp8w``: epmoe BF16 on the FP8 copy's
  weights (dequantized): the share of the loss that the weight rounding alone causes;
* ``fp8_block`` (the FP8 copy), ``int8_channel_fp32``, ``int8_channel_int32``, ``int8_block``
  (converted checkpoints: routed and shared experts INT8, the shared experts and the other linears
  dequantized to BF16), and each INT8 one again with ``_dense``: converted with ``--dense``, every
  INT8 linear run by ``epmoe.Int8Linear``.

Each row records the backend the layers chose (``--backend VARIANT=NAME`` forces one; nothing falls
back silently: a forced backend that cannot run is reported as that row's error). Activation
outliers: the per-channel amax of the experts' input per MoE layer (max / median), from the
reference run. EP: every epmoe variant again on CPU (torch backends) for ``--ep-sequences``
sequences per rank, once in this process (EP = 1, one thread, all ranks' sequences in one batch)
and once over 2 gloo ranks (each rank its own sequences). EP = 2 is not bitwise EP = 1 when a
token's experts sit on both ranks: each rank sums its own slots and rounds that partial sum to the
activation dtype before the combine adds the ranks' partials (EP = 1 rounds the whole sum once).
So EP = 1 runs twice: plainly, and with each MoE layer emulating that rounding (the sum over each
rank's experts' slots, rounded, then added in float32); EP = 2 must be bitwise the latter.

    python benchmarks/eval_ppl.py --ckpt /tmp/tinylm --json eval.json
    python benchmarks/eval_ppl.py --table eval.json      # the markdown table of docs/accuracy.md
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import tiny_lm  # noqa: E402

log = logging.getLogger("tinylm")

# name -> (scheme, accumulator, INT8 dense linears, weights: "bf16" | "fp8" | converted directory)
VARIANTS = {
    "hf": ("bf16", None, False, "bf16"),
    "bf16": ("bf16", None, False, "bf16"),
    "bf16_fp8w": ("bf16", None, False, "fp8"),
    "fp8_block": ("fp8_block", None, False, "fp8"),
    "int8_channel_fp32": ("int8_channel", "fp32", False, "int8_channel"),
    "int8_channel_int32": ("int8_channel", "int32", False, "int8_channel"),
    "int8_block": ("int8_block", None, False, "int8_block"),
    "int8_channel_fp32_dense": ("int8_channel", "fp32", True, "int8_channel-dense"),
    "int8_channel_int32_dense": ("int8_channel", "int32", True, "int8_channel-dense"),
    "int8_block_dense": ("int8_block", None, True, "int8_block-dense"),
}
REFERENCE = "hf"
BACKEND_KEYS = ("bf16", "bf16_fp8w", "fp8_block", "int8_channel_fp32", "int8_channel_int32", "int8_block")
"""What ``--backend KEY=NAME`` may name: a variant without ``_dense`` (the dense twin follows it)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ckpt", help="the directory train_tiny_moe.py --ckpt wrote")
    p.add_argument("--json", dest="json_path", help="write the results as JSON here")
    p.add_argument("--table", metavar="JSON", help="only print the markdown tables of an earlier --json and exit")
    p.add_argument("--work", help="where the converted checkpoints go (default: CKPT/converted)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated variants (hf is always run)")
    p.add_argument("--max-tokens", type=int, default=131_072, help="held-out tokens scored per variant")
    p.add_argument("--seq-len", type=int, default=None, help="window length (default: the training's)")
    p.add_argument("--batch", type=int, default=32, help="windows per forward")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--backend", action="append", default=[], metavar="VARIANT=NAME",
                   help=f"force the experts backend of a variant ({', '.join(BACKEND_KEYS)}; its _dense twin "
                   "follows); default auto, recorded per row")  # fmt: skip
    p.add_argument("--dense-backend", default="auto", choices=("auto", "cutlass", "triton", "torch"),
                   help="the Int8Linear backend of the _dense variants")  # fmt: skip
    p.add_argument("--hf-experts", default="grouped_mm", help="transformers experts implementation of the reference")
    p.add_argument("--ep-sequences", type=int, default=2, help="sequences per rank of the EP check (0: skip it)")
    p.add_argument("--ep-seq-len", type=int, default=128, help="tokens per sequence of the EP check")
    p.add_argument("--ep-variants", default=None, help="comma-separated variants of the EP check (default: every epmoe one run)")
    p.add_argument("--commit", default=None, help="commit to record (default: git rev-parse HEAD)")


def check_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> argparse.Namespace:
    if a.table:
        return a
    if not a.ckpt:
        p.error("--ckpt is required (or --table JSON)")
    names = [v for v in a.variants.split(",") if v]
    unknown = [v for v in names if v not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {unknown}; allowed: {list(VARIANTS)}")
    a.variant_list = [REFERENCE] + [v for v in names if v != REFERENCE]
    forced = {}
    for item in a.backend:
        key, sep, name = item.partition("=")
        if not sep or key not in BACKEND_KEYS or name not in ("auto", "torch", "triton", "cutlass", "deepgemm"):
            p.error(f"--backend {item!r}; allowed: VARIANT=NAME with VARIANT in {list(BACKEND_KEYS)} and NAME in "
                    "auto, torch, triton, cutlass, deepgemm")  # fmt: skip
        forced[key] = name
    a.forced = forced
    ep = [v for v in (a.ep_variants or ",".join(a.variant_list)).split(",") if v and v != REFERENCE]
    if [v for v in ep if v not in a.variant_list]:
        p.error(f"--ep-variants: {[v for v in ep if v not in a.variant_list]} are not among --variants {a.variant_list}")
    a.ep_list = ep
    for name in ("max_tokens", "batch", "ep_seq_len"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(a, name)}; allowed: >= 1")
    if a.ep_sequences < 0:
        p.error(f"--ep-sequences={a.ep_sequences}; allowed: >= 0")
    return a


def backend_of(variant: str, forced: dict) -> str:
    return forced.get(variant.removesuffix("_dense"), "auto")


# ----------------------------------------------------------------------------- conversion
def convert_all(fp8_dir: Path, work: Path, needed: set[str]) -> dict:
    """``epmoe convert`` (the command's own entry, as a user runs it) for every converted
    directory the variants need; returns seconds per directory."""
    from epmoe.cli import main as epmoe_main

    seconds = {}
    for name in sorted(needed):
        target, _, dense = name.partition("-")
        dst = work / name
        if dst.exists():
            shutil.rmtree(dst)
        argv = ["convert", "--to", target, "--quiet", str(fp8_dir), str(dst)] + (["--dense"] if dense else [])
        t = time.time()
        code = epmoe_main(argv)
        if code != 0:
            raise RuntimeError(f"epmoe {' '.join(argv)} exited with {code}")
        seconds[name] = time.time() - t
        print(f"epmoe {' '.join(argv)}: {seconds[name]:.1f} s", flush=True)
    return seconds


def weights_dir(ckpt: Path, work: Path, source: str) -> Path:
    if source == "bf16":
        return ckpt / tiny_lm.BF16_DIR
    if source == "fp8":
        return ckpt / tiny_lm.FP8_DIR
    return work / source


# -------------------------------------------------------------------------------- loading
def load_variant(variant: str, ckpt: Path, work: Path, device, backend: str, dense_backend: str, hf_experts: str):
    """The model of ``variant`` on ``device`` in BF16."""
    import torch

    scheme, accumulator, dense, source = VARIANTS[variant]
    path = weights_dir(ckpt, work, source)
    if variant == REFERENCE:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, experts_implementation=hf_experts)
        return model.to(device).eval()
    from epmoe.integrations.transformers import from_pretrained

    kwargs = dict(backend=backend)
    if accumulator is not None:
        kwargs["accumulator"] = accumulator
    if dense:
        kwargs.update(int8_dense=True, dense_backend=dense_backend)
    return from_pretrained(path, quant=scheme, device=device, dtype=torch.bfloat16, **kwargs)


def backends_used(model) -> dict:
    """Which experts backend, dispatcher and dense INT8 backend each kind of module runs."""
    from epmoe.layer import DeepEPMoELayer
    from epmoe.linear import Int8Linear

    experts, dispatch, dense, rules = set(), set(), set(), set()
    for m in model.modules():
        if isinstance(m, DeepEPMoELayer):
            experts.add(m.backend.name)
            dispatch.add(m.dispatcher.name)
            if m.backend.name == "cutlass" and m.scheme.name.startswith("int8"):
                # This backend runs an INT8 batch on Triton below a measured rows-per-expert crossover.
                from epmoe.experts.cutlass_backend import int8_rule

                rules.add(int8_rule(m.device, m.scheme.name).describe())
        elif isinstance(m, Int8Linear):
            dense.add(m.backend_name)
    return dict(experts=sorted(experts), dispatch=sorted(dispatch), dense_int8=sorted(dense),
                int8_linears=sum(isinstance(m, Int8Linear) for m in model.modules()),
                cutlass_int8_rule=sorted(rules))  # fmt: skip


class SelectionLog(logging.Handler):
    """The distinct INFO+ lines of the ``epmoe`` logger while a variant loads: every backend and
    dispatcher the layers and dense linears considered, with the reason each other was refused."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        line = record.getMessage()
        if line not in self.lines and len(self.lines) < 40:
            self.lines.append(line)

    def __enter__(self) -> "SelectionLog":
        self.logger = logging.getLogger("epmoe")
        self.saved = self.logger.level, self.logger.propagate  # (self.level is this handler's threshold)
        self.logger.setLevel(logging.INFO)
        self.logger.propagate = False  # the lines go to the JSON, not to the console
        self.logger.addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self.saved[0])
        self.logger.propagate = self.saved[1]


# ------------------------------------------------------------------------------- outliers
class ExpertInputAmax:
    """Per-channel amax of the routed experts' input (``hidden_states [T, H]``) per MoE layer,
    over every token scored (forward pre-hooks on the experts modules)."""

    def __init__(self, model) -> None:
        self.amax: dict[str, object] = {}
        self.token_amax: dict[str, list] = {}
        self.handles = []
        for name, m in model.named_modules():
            if type(m).__name__.endswith("Experts") and hasattr(m, "gate_up_proj"):
                self.handles.append(m.register_forward_pre_hook(self._hook(name)))

    def _hook(self, name):
        def hook(module, args):
            x = args[0].detach().float().reshape(-1, args[0].shape[-1]).abs()
            ch = x.amax(dim=0)
            self.amax[name] = ch if name not in self.amax else self.amax[name].maximum(ch)
            self.token_amax.setdefault(name, []).append(x.amax(dim=1).cpu())

        return hook

    def report(self) -> list[dict]:
        import torch

        for h in self.handles:
            h.remove()
        out = []
        for name, ch in self.amax.items():
            ch = ch.cpu()
            med = float(ch.median())
            tok = torch.cat(self.token_amax[name])
            top = torch.topk(ch, k=min(5, ch.numel()))
            out.append(dict(
                module=name, layer=int(name.split("layers.")[1].split(".")[0]) if "layers." in name else None,
                channel_amax_max=float(ch.max()), channel_amax_median=med,
                max_over_median=float(ch.max()) / med if med else None,
                p99_over_median=float(torch.quantile(ch, 0.99)) / med if med else None,
                top_channels=top.indices.tolist(), top_channel_amax=[float(v) for v in top.values],
                token_amax_max_over_median=float(tok.max() / tok.median()) if float(tok.median()) else None,
            ))  # fmt: skip
        return out


# ------------------------------------------------------------------------------------- EP
def _split_rounding(layer, world: int, split: list) -> None:
    """Makes ``layer`` (EP = 1) compute what EP = ``world`` computes: the weighted sum over each
    rank's experts' slots in the activation dtype (the ``-1`` ids of the other ranks' slots add
    nothing), then those partial sums added in float32, as the all-to-all combine does. Appends to
    ``split`` the number of tokens whose slots span more than one rank and the number of tokens."""
    import torch

    plain = layer.forward
    e_loc = layer.num_experts // world

    def forward(hidden_states, router_logits=None, *, topk_ids=None, topk_weights=None):
        if router_logits is not None:
            topk_ids, topk_weights = layer.route(router_logits)
        owner = topk_ids // e_loc
        split.append((int((owner != owner[:, :1]).any(1).sum()), int(topk_ids.shape[0])))
        total = torch.zeros(hidden_states.shape, dtype=torch.float32)
        for r in range(world):
            if not bool((owner == r).any()):
                continue  # EP = 2 sends this rank nothing (and the layer refuses a batch of -1 ids only)
            mine = torch.where(owner == r, topk_ids, torch.full_like(topk_ids, -1))
            total += plain(hidden_states, topk_ids=mine, topk_weights=topk_weights).float()
        return total.to(hidden_states.dtype)

    layer.forward = forward


def _ep_logits(ckpt: str, work: str, variants: list[str], seqs, emulate_ranks: int | None = None) -> dict:
    """Logits (float32 numpy) of every variant on ``seqs`` on the CPU, experts and dense INT8
    linears on the torch backends (named, not chosen: ``auto`` would pick the same on a CPU).
    ``emulate_ranks``: also ``VARIANT:split`` logits, every MoE layer rounding as EP = that many
    ranks does (:func:`_split_rounding`), and ``VARIANT:split_tokens`` (tokens whose experts span
    ranks, tokens) summed over the MoE layers."""
    import torch

    from epmoe.layer import DeepEPMoELayer

    out = {}
    for v in variants:
        model = load_variant(v, Path(ckpt), Path(work), torch.device("cpu"), "torch", "torch", "eager")
        with torch.no_grad():
            out[v] = model(input_ids=torch.from_numpy(seqs), use_cache=False).logits.float().numpy()
        out[v + ":backends"] = backends_used(model)
        if emulate_ranks and v != REFERENCE:
            split: list = []
            for m in model.modules():
                if isinstance(m, DeepEPMoELayer):
                    _split_rounding(m, emulate_ranks, split)
            with torch.no_grad():
                out[v + ":split"] = model(input_ids=torch.from_numpy(seqs), use_cache=False).logits.float().numpy()
            out[v + ":split_tokens"] = [sum(a for a, _ in split), sum(b for _, b in split)]
        del model
    return out


def ep_rank(rank: int, world: int, port: int, ckpt: str, work: str, variants: list, seqs_path: str) -> dict:
    """One rank of the EP = 2 check (spawned by :func:`epmoe.launch.run_ranks`): its own sequences."""
    import numpy as np

    from epmoe.launch import init_process_group

    init_process_group(rank, world, port, "cpu", timeout_s=600)  # one thread, as the EP = 1 run
    seqs = np.load(seqs_path)
    n = seqs.shape[0] // world
    return _ep_logits(ckpt, work, variants, seqs[rank * n : (rank + 1) * n])


def ep_check(ckpt: Path, work: Path, variants: list[str], windows, n_per_rank: int, seq_len: int,
             scratch: Path) -> dict:
    """EP = 2 over gloo against EP = 1 on the same sequences, every epmoe variant, on the CPU.

    EP = 1 runs here with one thread (as each rank: a CPU GEMM's rounding may depend on its thread
    count) on all ranks' sequences in one batch, so each expert sees the same rows in the same
    order as under EP = 2 (rank 0's tokens, then rank 1's), and every other layer computes the
    same per-row products. ``logits_identical``: EP = 2 bitwise the plain EP = 1; it holds only
    when no token's experts span the ranks. ``split_rounding_identical``: EP = 2 bitwise EP = 1
    with every MoE layer rounding each rank's partial sum as EP = 2 does (:func:`_split_rounding`);
    it must hold whatever the routing, so a miss is a bug, not rounding.
    """
    import numpy as np
    import torch

    from epmoe.launch import run_ranks

    world = 2
    seqs = np.ascontiguousarray(windows[: world * n_per_rank, :seq_len])
    if seqs.shape[0] < world * n_per_rank:
        raise ValueError(f"the EP check needs {world * n_per_rank} windows; the held-out set has {seqs.shape[0]}")
    scratch.mkdir(parents=True, exist_ok=True)
    seqs_path = scratch / "ep_sequences.npy"
    np.save(seqs_path, seqs)
    t = time.time()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ep1 = _ep_logits(str(ckpt), str(work), [REFERENCE] + variants, seqs, emulate_ranks=world)
    finally:
        torch.set_num_threads(threads)
    t1 = time.time() - t
    t = time.time()
    ranks = run_ranks(ep_rank, world, str(ckpt), str(work), variants, str(seqs_path), timeout_s=600)
    t2 = time.time() - t
    ref = ep1[REFERENCE]
    targets = seqs[:, 1:]

    def metrics(logits):
        lt = torch.from_numpy(logits[:, :-1])
        nll = -torch.log_softmax(lt, -1).gather(-1, torch.from_numpy(targets).unsqueeze(-1)).double().mean()
        agree = float((lt.argmax(-1) == torch.from_numpy(ref[:, :-1]).argmax(-1)).float().mean())
        return math.exp(float(nll)), agree

    rows = []
    for v in variants:
        ep2 = np.concatenate([r[v] for r in ranks])
        p1, a1 = metrics(ep1[v])
        p2, a2 = metrics(ep2)
        rows.append(dict(
            variant=v, ep1_perplexity=p1, ep2_perplexity=p2, ep1_top1_agreement=a1, ep2_top1_agreement=a2,
            logits_identical=bool(np.array_equal(ep1[v], ep2)),
            max_abs_logit_difference=float(np.abs(ep1[v] - ep2).max()),
            split_rounding_identical=bool(np.array_equal(ep1[v + ":split"], ep2)),
            tokens_split_over_ranks=ep1[v + ":split_tokens"][0], moe_tokens=ep1[v + ":split_tokens"][1],
            ep1_backends=ep1[v + ":backends"], ep2_backends=ranks[0][v + ":backends"],
        ))  # fmt: skip
    return dict(
        sequences_per_rank=n_per_rank, seq_len=seq_len, ranks=world, device="cpu", backend="torch",
        dense_backend="torch", threads_per_rank=1, reference_perplexity=metrics(ref)[0],
        ep1_seconds=t1, ep2_seconds=t2, rows=rows,
        all_identical=all(r["logits_identical"] for r in rows),
        all_split_rounding_identical=all(r["split_rounding_identical"] for r in rows),
    )  # fmt: skip


# ------------------------------------------------------------------------------------ run
def evaluate(a: argparse.Namespace) -> dict:
    import torch

    ckpt = Path(a.ckpt)
    work = Path(a.work) if a.work else ckpt / "converted"
    work.mkdir(parents=True, exist_ok=True)
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    facts = tiny_lm.run_facts(device, a.commit)
    heldout, data = tiny_lm.read_data(ckpt)
    seq_len = a.seq_len or data["seq_len"]
    windows = tiny_lm.eval_windows(heldout, seq_len, a.max_tokens)
    t_all = time.time()

    needed = {VARIANTS[v][3] for v in a.variant_list} - {"bf16", "fp8"}
    convert_s = convert_all(ckpt / tiny_lm.FP8_DIR, work, needed)

    rows, ref_top1, ref_ppl, outliers = [], None, None, None
    for v in a.variant_list:
        scheme, accumulator, dense, source = VARIANTS[v]
        row = dict(variant=v, scheme=scheme, accumulator=accumulator, dense_int8=dense, weights=source,
                   implementation=("transformers " + a.hf_experts) if v == REFERENCE else "epmoe",
                   requested_backend=None if v == REFERENCE else backend_of(v, a.forced))  # fmt: skip
        t = time.time()
        try:
            with SelectionLog() as selection:
                model = load_variant(v, ckpt, work, device, backend_of(v, a.forced), a.dense_backend, a.hf_experts)
            row["load_seconds"] = time.time() - t
            row["selection_log"] = selection.lines
            row["backends"] = backends_used(model)
            hooks = ExpertInputAmax(model) if v == REFERENCE else None
            t = time.time()
            s = tiny_lm.score(model, windows, a.batch, device, ref_top1)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            row["score_seconds"] = time.time() - t
            if hooks is not None:
                outliers = hooks.report()
            del model
        except Exception as exc:  # noqa: BLE001 - a refused forced backend is a result, not a crash
            if v == REFERENCE:
                raise
            row["error"] = f"{type(exc).__name__}: {exc}"
            rows.append(row)
            print(f"{v}: error: {row['error']}", flush=True)
            continue
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if v == REFERENCE:
            ref_top1, ref_ppl = s["top1"], s["perplexity"]
            s["top1_agreement"] = 1.0
        row.update(perplexity=s["perplexity"], delta_pct=100.0 * (s["perplexity"] / ref_ppl - 1.0),
                   top1_agreement=s["top1_agreement"], targets=s["targets"], nll_sum=s["nll_sum"])  # fmt: skip
        rows.append(row)
        print(f"{v}: perplexity {row['perplexity']:.4f} ({row['delta_pct']:+.3f} %), top-1 agreement "
              f"{row['top1_agreement']:.4f}, experts on {row['backends']['experts'] or '-'}, dense INT8 on "
              f"{row['backends']['dense_int8'] or '-'} ({row['load_seconds']:.1f} s load, "
              f"{row['score_seconds']:.1f} s score)", flush=True)  # fmt: skip

    ep = None
    if a.ep_sequences:
        ep = ep_check(ckpt, work, a.ep_list, windows, a.ep_sequences, min(a.ep_seq_len, seq_len), work / "ep")
        print(f"EP = 2 over gloo against EP = 1 ({ep['sequences_per_rank']} x {ep['seq_len']} tokens per rank, "
              f"CPU, torch backends): plain EP = 1 {'bitwise identical' if ep['all_identical'] else 'differs'}, "
              f"EP = 1 with per-rank partial sums "
              f"{'bitwise identical' if ep['all_split_rounding_identical'] else 'DIFFERENT'} "
              f"({ep['ep1_seconds']:.0f} s + {ep['ep2_seconds']:.0f} s)", flush=True)  # fmt: skip

    config = json.loads((ckpt / tiny_lm.BF16_DIR / "config.json").read_text())
    mean_rows = a.batch * seq_len * config["num_experts_per_tok"] / config["n_routed_experts"]
    return dict(
        kind="epmoe tiny DeepSeek-V3 LM accuracy per scheme", **facts.asdict(),
        args={k: v for k, v in vars(a).items() if k not in ("forced", "variant_list", "ep_list")},
        data={k: v for k, v in data.items() if k != "heldout_names"}, heldout_names=data.get("heldout_names"),
        windows=int(windows.shape[0]), seq_len=seq_len, batch=a.batch,
        mean_rows_per_expert_per_forward=mean_rows, tokens_scored=int(windows.shape[0] * (seq_len - 1)),
        reference=REFERENCE, convert_seconds=convert_s, rows=rows, expert_input_outliers=outliers, ep=ep,
        seconds=time.time() - t_all,
    )  # fmt: skip


# ---------------------------------------------------------------------------------- tables
def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def render_table(result: dict) -> str:
    """The markdown tables of docs/accuracy.md from an eval JSON (``--table``)."""
    lines = [
        f"{result.get('gpu') or result.get('device')}, {result.get('date')}, commit {result.get('commit')}, "
        f"{result.get('tokens_scored')} held-out tokens ({result.get('windows')} windows of {result.get('seq_len')}).",
        "",
        "| variant | scheme | accumulator | dense linears | weights | experts backend | perplexity | Δ % | top-1 agreement |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        dense = "INT8 (Int8Linear" + (f", {'/'.join(r['backends']['dense_int8'])})" if r.get("backends") else ")") \
            if r["dense_int8"] else "BF16"  # fmt: skip
        backend = r["implementation"] if r["variant"] == result["reference"] else \
            "/".join((r.get("backends") or {}).get("experts") or [r.get("requested_backend") or "-"])  # fmt: skip
        if "error" in r:
            lines.append(f"| {r['variant']} | {r['scheme']} | {r['accumulator'] or '-'} | {dense} | {r['weights']} | "
                         f"{backend} | error: {r['error'][:120]} | | |")  # fmt: skip
            continue
        lines.append(
            f"| {r['variant']} | {r['scheme']} | {r['accumulator'] or '-'} | {dense} | {r['weights']} | {backend} | "
            f"{r['perplexity']:.4f} | {r['delta_pct']:+.3f} | {100 * r['top1_agreement']:.2f} % |"
        )
    ep = result.get("ep")
    if ep:
        lines += [
            "",
            f"EP = 2 (2 gloo ranks, CPU, torch backends, {ep['sequences_per_rank']} x {ep['seq_len']} tokens per rank) "
            "against EP = 1 on the same sequences:",
            "",
            "| variant | EP = 1 perplexity | EP = 2 perplexity | EP = 2 top-1 agreement | max abs logit difference "
            "| tokens with experts on both ranks | bitwise = EP = 1 | bitwise = EP = 1 with per-rank partial sums |",
            "|---|---|---|---|---|---|---|---|",
        ]

        def yes(value):  # None: a run from before the check existed
            return "not measured" if value is None else ("yes" if value else "NO")

        for r in ep["rows"]:
            split = (f"{100 * r['tokens_split_over_ranks'] / r['moe_tokens']:.1f} %" if r.get("moe_tokens")
                     else "not measured")  # fmt: skip
            lines.append(f"| {r['variant']} | {r['ep1_perplexity']:.4f} | {r['ep2_perplexity']:.4f} | "
                         f"{100 * r['ep2_top1_agreement']:.2f} % | {r['max_abs_logit_difference']:.3g} | {split} | "
                         f"{yes(r['logits_identical'])} | {yes(r.get('split_rounding_identical'))} |")  # fmt: skip
    out = result.get("expert_input_outliers")
    if out:
        lines += [
            "",
            "Experts' input (the reference run): per-channel amax over all scored tokens.",
            "",
            "| layer | max channel amax | median channel amax | max / median | p99 / median | top channels | token amax max / median |",
            "|---|---|---|---|---|---|---|",
        ]
        for o in out:
            lines.append(
                f"| {o['layer']} | {o['channel_amax_max']:.3g} | {o['channel_amax_median']:.3g} | "
                f"{_fmt(o['max_over_median'], '.1f')} | {_fmt(o['p99_over_median'], '.1f')} | "
                f"{', '.join(map(str, o['top_channels'][:3]))} | {_fmt(o['token_amax_max_over_median'], '.1f')} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict | None:
    p = argparse.ArgumentParser(prog="eval_ppl.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    add_arguments(p)
    a = check_args(p, p.parse_args(argv))
    if a.table:
        print(render_table(json.loads(Path(a.table).read_text())), end="")
        return None
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    result = evaluate(a)
    if a.json_path:
        Path(a.json_path).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {a.json_path}")
    print()
    print(render_table(result), end="")
    failed = [r["variant"] for r in result["rows"] if "error" in r]
    # EP = 2 against plain EP = 1 differs by rounding wherever tokens' experts span the ranks; against
    # EP = 1 with that rounding emulated it must not differ at all.
    ep_ok = not result["ep"] or result["ep"]["all_split_rounding_identical"]
    if failed or not ep_ok:
        print(f"\nfailed variants: {failed}; EP = 2 bitwise EP = 1 with per-rank partial sums: {ep_ok}")
        raise SystemExit(1)
    return result


if __name__ == "__main__":
    main()
