"""Train the small DeepSeek-V3-architecture LM of the accuracy study (docs/accuracy.md).

transformers' ``DeepseekV3ForCausalLM`` (MLA attention, sigmoid grouped top-k routing with the
correction bias, a shared expert, the first layer dense) on the text that ships with Python, byte
level (see ``benchmarks/tiny_lm.py`` for the data and the held-out split). Writes, under ``--ckpt``:
``bf16/`` (``save_pretrained``), ``fp8/`` (the same weights FP8-block, as DeepSeek ships them),
``heldout_tokens.npy`` and ``data.json`` (the split: Python version, counts, hashes, held-out
names). ``--json`` gets the run (loss per step, held-out and unigram perplexity, router load),
``--plot`` the loss curve.

Precision: the model's parameters are BF16 (so transformers' ``grouped_mm`` experts run their BF16
kernel) with FP32 master copies that AdamW updates; the router's weight and correction bias stay
FP32.

Router balance: DeepSeek-V3's auxiliary-loss-free rule, outside the gradient. After every step each
MoE layer's ``e_score_correction_bias`` moves by ``--bias-update-speed`` toward balance:
``b_e += speed * sign(mean_load - load_e)`` (load: the tokens routed to expert ``e`` in that step).
The bias only steers which experts are chosen, not their weights; without it a few experts can
take most tokens, and the quantized experts would then be tested on few, well-trained experts.
DeepSeek-V3 used a speed of 0.001 over a very long run; the default here is 0.005 because this run
has a few thousand steps and the freshly initialized router sends nearly every token to the same
experts (its inputs share one direction), which 0.001 would take a few hundred steps to undo.
``train.json`` reports the load per layer at the end (max / mean, experts under a tenth of the mean).

    python benchmarks/train_tiny_moe.py --ckpt /tmp/tinylm --max-minutes 4.5 --json train.json --plot train.png
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import tiny_lm  # noqa: E402

log = logging.getLogger("tinylm")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ckpt", required=True, help="output directory of the checkpoints and held-out tokens (new or empty)")
    p.add_argument("--json", dest="json_path", help="write the run as JSON here")
    p.add_argument("--plot", help="write the loss curve as PNG here (needs matplotlib)")
    p.add_argument("--size", choices=sorted(tiny_lm.SIZES), default="full", help="model size (tiny: the CPU test's)")
    p.add_argument("--max-minutes", type=float, default=8.0, help="wall-clock budget of the training loop")
    p.add_argument("--max-steps", type=int, default=100_000, help="step budget (whichever budget ends first)")
    p.add_argument("--batch", type=int, default=64, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the size's)")
    p.add_argument("--lr", type=float, default=1.5e-3, help="peak AdamW learning rate")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="the cosine decay ends at lr * this")
    p.add_argument("--warmup-steps", type=int, default=100, help="linear warm-up steps")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay (matrices only)")
    p.add_argument("--grad-clip", type=float, default=1.0, help="gradient norm clip")
    p.add_argument("--bias-update-speed", type=float, default=5e-3,
                   help="aux-loss-free balancing step of e_score_correction_bias per training step (0: off)")  # fmt: skip
    p.add_argument("--heldout-fraction", type=float, default=0.02, help="fraction of documents held out (by name hash)")
    p.add_argument("--eval-tokens", type=int, default=131_072, help="held-out tokens scored at the end")
    p.add_argument("--eval-batch", type=int, default=32, help="sequences per forward when scoring")
    p.add_argument("--experts-implementation", default="grouped_mm",
                   help="transformers experts implementation for training (falls back to eager, logged, if refused)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="seed of the initialization and the data order")
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--log-every", type=int, default=25, help="steps between progress lines")
    p.add_argument("--commit", default=None, help="commit to record (default: git rev-parse HEAD)")


def check_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> argparse.Namespace:
    for name in ("max_steps", "batch", "eval_tokens", "eval_batch", "log_every"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(a, name)}; allowed: >= 1")
    for name in ("max_minutes", "lr"):
        if not getattr(a, name) > 0:
            p.error(f"--{name.replace('_', '-')}={getattr(a, name)}; allowed: > 0")
    if a.warmup_steps < 0 or a.bias_update_speed < 0 or a.weight_decay < 0:
        p.error("--warmup-steps, --bias-update-speed and --weight-decay must be >= 0")
    if not 0 < a.heldout_fraction < 1:
        p.error(f"--heldout-fraction={a.heldout_fraction}; allowed: 0 < f < 1")
    if a.seq_len is None:
        a.seq_len = tiny_lm.SIZES[a.size]["seq_len"]
    if a.seq_len < 2:
        p.error(f"--seq-len={a.seq_len}; allowed: >= 2")
    if a.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError as exc:
            p.error(f"--plot needs matplotlib (pip install 'epmoe[plot]'): {exc}")
    ckpt = Path(a.ckpt)
    if ckpt.exists() and (not ckpt.is_dir() or any(ckpt.iterdir())):
        p.error(f"--ckpt {ckpt} exists and is not an empty directory; choose a new or empty one")
    return a


def set_experts_implementation(model, wanted: str) -> tuple[str, str | None]:
    """Switch ``model`` to ``wanted``; returns ``(used, reason it was refused or None)``."""
    try:
        model.set_experts_implementation(wanted)
        return model.config._experts_implementation, None
    except (ValueError, AttributeError, KeyError) as exc:
        reason = f"{type(exc).__name__}: {exc}"
        log.warning("experts_implementation=%r refused (%s); training with 'eager'", wanted, reason)
        model.set_experts_implementation("eager")
        return "eager", reason


class RouterLoad:
    """Tokens routed to each expert of every MoE layer, counted by forward hooks on the routers."""

    def __init__(self, model) -> None:
        import torch

        self.routers = [m for m in model.modules() if type(m).__name__ == "DeepseekV3TopkRouter"]
        self.counts = [torch.zeros(r.num_experts, device=r.weight.device) for r in self.routers]
        self.active = True
        for r, c in zip(self.routers, self.counts):
            r.register_forward_hook(self._hook(c))

    def _hook(self, counts):
        def hook(module, args, output):
            if self.active:
                idx = output[2].detach().reshape(-1)
                counts.add_(torch_bincount(idx, counts.numel()))

        return hook

    def update_bias(self, speed: float) -> None:
        """The aux-loss-free rule: every layer's bias moves ``speed`` toward balance; counts reset."""
        import torch

        with torch.no_grad():
            for r, c in zip(self.routers, self.counts):
                if speed:
                    r.e_score_correction_bias += speed * torch.sign(c.mean() - c)
                c.zero_()

    def imbalance(self) -> list[dict]:
        """Per layer, of the counts since the last update: max / mean load, fraction of experts
        under a tenth of the mean, and the bias range."""
        out = []
        for r, c in zip(self.routers, self.counts):
            mean = float(c.mean())
            out.append(dict(
                max_over_mean=float(c.max()) / mean if mean else None,
                starved_fraction=float((c < 0.1 * mean).float().mean()),
                bias_min=float(r.e_score_correction_bias.min()), bias_max=float(r.e_score_correction_bias.max()),
            ))  # fmt: skip
        return out


def torch_bincount(idx, n: int):
    import torch

    return torch.bincount(idx, minlength=n)[:n].to(torch.float32)


def lr_at(step: int, total: int, a: argparse.Namespace) -> float:
    if step < a.warmup_steps:
        return a.lr * (step + 1) / a.warmup_steps
    span = max(total - a.warmup_steps, 1)
    t = min((step - a.warmup_steps) / span, 1.0)
    return a.lr * (a.min_lr_ratio + (1 - a.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def build_model(a: argparse.Namespace, device):
    """The model in BF16 (router FP32) on ``device``, its FP32 master weights and the optimizer."""
    import torch
    from transformers import DeepseekV3ForCausalLM

    torch.manual_seed(a.seed)
    config = tiny_lm.model_config(a.size)
    config.max_position_embeddings = a.seq_len
    model = DeepseekV3ForCausalLM(config).to(device)
    used, refused = set_experts_implementation(model, a.experts_implementation)
    pairs, decay, no_decay = [], [], []
    for name, p in model.named_parameters():
        if name.endswith("mlp.gate.weight"):
            master = p  # the router stays FP32 and is optimized in place
        else:
            master = p.detach().clone().requires_grad_(True)
            p.data = p.data.to(torch.bfloat16)
            pairs.append((p, master))
        matrix = p.dim() >= 2 and "embed_tokens" not in name and not name.endswith("mlp.gate.weight")
        (decay if matrix else no_decay).append(master)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": a.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=a.lr, betas=(0.9, 0.95), eps=1e-8,
    )  # fmt: skip
    return model, pairs, opt, used, refused


def train(a: argparse.Namespace) -> dict:
    import numpy as np
    import torch

    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    facts = tiny_lm.run_facts(device, a.commit)
    t0 = time.time()
    split = tiny_lm.split_corpus(a.heldout_fraction)
    print(f"data: Python {split.info['python']}, {split.info['train_documents']} training documents "
          f"({split.info['train_tokens']} tokens), {split.info['heldout_documents']} held out "
          f"({split.info['heldout_tokens']} tokens): {', '.join(split.heldout_names)}", flush=True)  # fmt: skip
    model, pairs, opt, impl, refused = build_model(a, device)
    load = RouterLoad(model)
    n_params = sum(p.numel() for p in model.parameters())
    batches = tiny_lm.train_batches(split.train, a.seq_len, a.batch, a.seed)
    print(f"model: {n_params / 1e6:.1f} M parameters, experts implementation {impl!r}; setup {time.time() - t0:.1f} s",
          flush=True)  # fmt: skip

    windows = tiny_lm.eval_windows(split.heldout, a.seq_len, a.eval_tokens)
    model.eval()
    load.active = False
    initial = tiny_lm.score(model, windows, a.eval_batch, device)["perplexity"]
    load.active = True
    print(f"held-out perplexity at initialization {initial:.2f}", flush=True)
    curve: list[dict] = []
    pending: list = []  # (step, loss tensor, lr, epoch): read back at log points (one sync per log)
    planned, calib_from, calib_to = a.max_steps, min(5, a.max_steps), min(30, a.max_steps)
    start = time.time()
    deadline = start + 60 * a.max_minutes
    stopped_by, t_calib, step = "steps", None, 0
    model.train()

    def flush(step_now: int) -> None:
        if not pending:
            return
        values = torch.stack([p[1] for p in pending]).float().cpu().tolist()
        for (s, _, lr, ep), v in zip(pending, values):
            curve.append(dict(step=s, loss=v, lr=lr, epoch=ep, tokens=(s + 1) * a.batch * a.seq_len))
        pending.clear()
        rate = (step_now + 1) * a.batch * a.seq_len / max(time.time() - start, 1e-9)
        bal = load.imbalance()
        worst = max((b["max_over_mean"] or 0.0) for b in bal) if bal else 0.0
        print(f"step {step_now + 1}/{planned}: loss {curve[-1]['loss']:.4f}, lr {curve[-1]['lr']:.2e}, "
              f"{rate / 1e3:.0f} k tokens/s, worst router max/mean load {worst:.2f}", flush=True)  # fmt: skip

    while step < planned:
        if time.time() > deadline:
            stopped_by = "time"
            break
        lr = lr_at(step, planned, a)
        for g in opt.param_groups:
            g["lr"] = lr
        epoch, batch = next(batches)
        ids = torch.from_numpy(batch).to(device, non_blocking=True)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        for p, master in pairs:
            if p.grad is not None:  # a parameter the batch did not reach keeps no gradient
                master.grad = p.grad.float()
                p.grad = None
        torch.nn.utils.clip_grad_norm_([m for g in opt.param_groups for m in g["params"]], a.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, master in pairs:
                p.copy_(master)
        pending.append((step, loss.detach(), lr, epoch))
        last_step = (step + 1) % a.log_every == 0 or step + 1 == planned
        if last_step:
            flush(step)
        load.update_bias(a.bias_update_speed)
        if step + 1 == calib_from:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t_calib = time.time()
        elif step + 1 == calib_to and t_calib is not None and calib_to > calib_from:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            per_step = (time.time() - t_calib) / (calib_to - calib_from)
            fit = calib_to + int((deadline - time.time()) / per_step)
            if fit < planned:
                planned = max(fit, calib_to)
                stopped_by = "time"
            print(f"{per_step * 1e3:.0f} ms per step: planning {planned} steps "
                  f"({'time' if stopped_by == 'time' else 'step'} budget)", flush=True)  # fmt: skip
        step += 1
    flush(step - 1)
    train_s = time.time() - start

    # One more pass over a training batch without updates, for the final router load.
    model.eval()
    with torch.no_grad():
        _, batch = next(batches)
        model(input_ids=torch.from_numpy(batch).to(device), use_cache=False)
    balance = load.imbalance()
    load.active = False

    t_eval = time.time()
    scored = tiny_lm.score(model, windows, a.eval_batch, device)
    unigram = tiny_lm.unigram_perplexity(split.train, windows)
    eval_s = time.time() - t_eval
    print(f"held-out perplexity {scored['perplexity']:.3f} over {scored['targets']} tokens "
          f"(unigram model: {unigram:.3f}); trained {step} steps in {train_s:.0f} s", flush=True)  # fmt: skip

    t_save = time.time()
    ckpt = Path(a.ckpt)
    ckpt.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(ckpt / tiny_lm.BF16_DIR)
    fp8 = tiny_lm.write_fp8_copy(ckpt / tiny_lm.BF16_DIR, ckpt / tiny_lm.FP8_DIR)
    tiny_lm.write_data(ckpt, split, a.seq_len)
    save_s = time.time() - t_save
    print(f"saved {ckpt / tiny_lm.BF16_DIR} and {ckpt / tiny_lm.FP8_DIR} ({fp8['fp8_weights']} FP8 weights) "
          f"in {save_s:.1f} s", flush=True)  # fmt: skip

    args = {k: v for k, v in vars(a).items()}
    return dict(
        kind="epmoe tiny DeepSeek-V3 LM training", **facts.asdict(), args=args,
        config=json.loads((ckpt / tiny_lm.BF16_DIR / "config.json").read_text()),
        parameters=n_params, experts_implementation=impl, experts_implementation_refused=refused,
        data=split.info, steps=step, planned_steps=planned, stopped_by=stopped_by,
        train_seconds=train_s, eval_seconds=eval_s, save_seconds=save_s,
        tokens_seen=step * a.batch * a.seq_len, tokens_per_second=step * a.batch * a.seq_len / max(train_s, 1e-9),
        heldout=dict(perplexity=scored["perplexity"], initial_perplexity=initial, targets=scored["targets"], windows=int(windows.shape[0]),
                     seq_len=a.seq_len, unigram_perplexity=unigram),
        router_balance=balance, fp8_copy=fp8, curve=curve,
        final_train_loss=float(np.mean([c["loss"] for c in curve[-10:]])) if curve else None,
    )  # fmt: skip


def plot(result: dict, path: str) -> None:
    import numpy as np

    plt = tiny_lm.pyplot()
    steps = [c["step"] + 1 for c in result["curve"]]
    losses = [c["loss"] for c in result["curve"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, losses, lw=0.5, alpha=0.5, label="training loss (nats/byte)")
    k = max(1, len(losses) // 100)
    if k > 1:  # a running mean over k steps: the trend under the per-batch noise
        smooth = np.convolve(losses, np.ones(k) / k, mode="valid")
        ax.plot(steps[k - 1 :], smooth, color="C0", lw=1.2, label=f"mean of {k} steps")
    h = result["heldout"]
    ax.axhline(math.log(h["perplexity"]), color="C1", ls="--", label=f"held-out, end ({h['perplexity']:.2f} ppl)")
    ax.axhline(math.log(h["unigram_perplexity"]), color="C2", ls=":",
               label=f"unigram model ({h['unigram_perplexity']:.1f} ppl)")  # fmt: skip
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"tiny DeepSeek-V3 LM ({result['parameters'] / 1e6:.0f} M params), {result['gpu'] or result['device']}")
    ax.legend()
    tiny_lm.save_figure(fig, path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="train_tiny_moe.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    add_arguments(p)
    a = check_args(p, p.parse_args(argv))
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    result = train(a)
    if a.json_path:
        Path(a.json_path).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {a.json_path}")
    if a.plot:
        plot(result, a.plot)
        print(f"wrote {a.plot}")
    return result


if __name__ == "__main__":
    main()
