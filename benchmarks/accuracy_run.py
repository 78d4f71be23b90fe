"""The accuracy study in one command (docs/accuracy.md): train the tiny DeepSeek-V3 LM, convert its
FP8 copy with ``epmoe convert``, score every scheme, and write everything into ``--out``.

``--out DIR`` receives at most six files, flat: ``train.json`` (loss per step, held-out and unigram
perplexity, router load, the split), ``train_curve.png``, ``eval.json`` (every variant, the EP
check, the activation outliers), ``accuracy_table.md`` (the tables of docs/accuracy.md),
``accuracy_delta.png`` and ``run.json`` (the commands' options and the time of each phase). The
checkpoints go to ``--ckpt`` (default: a new directory under the system's temporary directory),
never into ``--out``.

    python benchmarks/accuracy_run.py --out DIR --train-minutes 4.5       # one H200: about 8 minutes
    python benchmarks/accuracy_run.py --out DIR --tiny                    # CPU dry run, tiny sizes
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import eval_ppl, tiny_lm, train_tiny_moe  # noqa: E402

OUT_FILES = ("train.json", "train_curve.png", "eval.json", "accuracy_table.md", "accuracy_delta.png", "run.json")


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot_delta(result: dict, path: Path) -> None:
    """Perplexity change against the reference and top-1 agreement per variant (bars)."""
    plt = tiny_lm.pyplot()
    rows = [r for r in result["rows"] if "error" not in r and r["variant"] != result["reference"]]
    names = [r["variant"] for r in rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    a1.barh(names, [r["delta_pct"] for r in rows], color="C0")
    a1.axvline(0, color="k", lw=0.5)
    a1.set_xlabel("held-out perplexity change vs transformers BF16 (%)")
    a2.barh(names, [100 * r["top1_agreement"] for r in rows], color="C1")
    a2.set_xlim(min(95.0, min((100 * r["top1_agreement"] for r in rows), default=95.0) - 0.5), 100)
    a2.set_xlabel("next-token top-1 agreement with BF16 (%)")
    a2.set_yticklabels([])
    fig.suptitle(f"tiny DeepSeek-V3 LM, {result['tokens_scored']} held-out tokens, {result['gpu'] or result['device']}")
    tiny_lm.save_figure(fig, path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="accuracy_run.py", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
    p.add_argument("--out", required=True, help="directory of the results (flat; new or empty)")
    p.add_argument("--ckpt", default=None, help="where the checkpoints go (default: a new temporary directory)")
    p.add_argument("--train-minutes", type=float, default=4.5, help="wall-clock budget of the training loop")
    p.add_argument("--max-tokens", type=int, default=None, help="held-out tokens scored per variant (default 131072; --tiny 1024)")
    p.add_argument("--backend", action="append", default=[], metavar="VARIANT=NAME", help="passed to eval_ppl.py")
    p.add_argument("--dense-backend", default="auto", help="passed to eval_ppl.py")
    p.add_argument("--ep-sequences", type=int, default=None, help="sequences per rank of the EP check (default 2; --tiny 1)")
    p.add_argument("--tiny", action="store_true", help="CPU dry run at tiny sizes (a few steps, a few hundred tokens)")
    p.add_argument("--commit", default=None, help="commit to record (default: git rev-parse HEAD)")
    a = p.parse_args(argv)
    out = Path(a.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        p.error(f"--out {out} exists and is not an empty directory; choose a new or empty one")
    ckpt = Path(a.ckpt) if a.ckpt else Path(tempfile.mkdtemp(prefix="epmoe-tinylm-"))
    if ckpt.resolve() == out.resolve() or out.resolve() in ckpt.resolve().parents:
        p.error(f"--ckpt {ckpt} is inside --out {out}; the checkpoints stay out of the results")
    out.mkdir(parents=True, exist_ok=True)
    plots = _has_matplotlib()
    if not plots:
        print("matplotlib is not installed: no PNGs (pip install 'epmoe[plot]')", flush=True)

    train_argv = ["--ckpt", str(ckpt), "--json", str(out / "train.json"), "--max-minutes", str(a.train_minutes)]
    eval_argv = ["--ckpt", str(ckpt), "--json", str(out / "eval.json"), "--dense-backend", a.dense_backend]
    eval_argv += [x for b in a.backend for x in ("--backend", b)]
    if plots:
        train_argv += ["--plot", str(out / "train_curve.png")]
    if a.commit:
        train_argv += ["--commit", a.commit]
        eval_argv += ["--commit", a.commit]
    if a.tiny:
        train_argv += ["--size", "tiny", "--device", "cpu", "--max-steps", "16", "--batch", "8", "--warmup-steps", "2",
                       "--eval-tokens", "2048", "--log-every", "4"]  # fmt: skip
        eval_argv += ["--device", "cpu", "--batch", "8", "--ep-seq-len", "32"]
    eval_argv += ["--max-tokens", str(a.max_tokens or (1024 if a.tiny else 131_072))]
    eval_argv += ["--ep-sequences", str(a.ep_sequences if a.ep_sequences is not None else (1 if a.tiny else 2))]

    phases, t0 = {}, time.time()
    print(f"== training: python benchmarks/train_tiny_moe.py {' '.join(train_argv)}", flush=True)
    train = train_tiny_moe.main(train_argv)
    phases["train_script_seconds"] = time.time() - t0
    t = time.time()
    print(f"== evaluation: python benchmarks/eval_ppl.py {' '.join(eval_argv)}", flush=True)
    code = 0
    try:
        eval_ppl.main(eval_argv)
    except SystemExit as exc:  # eval.json is written before a failed variant or EP mismatch exits
        code = int(exc.code or 0)
    phases["eval_script_seconds"] = time.time() - t
    result = json.loads((out / "eval.json").read_text())
    (out / "accuracy_table.md").write_text(eval_ppl.render_table(result))
    if plots:
        plot_delta(result, out / "accuracy_delta.png")
    phases["total_seconds"] = time.time() - t0
    h = train["heldout"]
    run = dict(train_argv=train_argv, eval_argv=eval_argv, checkpoints=str(ckpt), exit_code=code, **phases,
               heldout_perplexity=h["perplexity"], unigram_perplexity=h["unigram_perplexity"],
               initial_perplexity=h["initial_perplexity"], train_steps=train["steps"])  # fmt: skip
    (out / "run.json").write_text(json.dumps(run, indent=1) + "\n")
    written = sorted(f.name for f in out.iterdir())
    unexpected = [f for f in written if f not in OUT_FILES]
    if unexpected:
        raise RuntimeError(f"internal: {out} holds files the driver does not document: {unexpected}")
    print(f"\ntrained {train['steps']} steps: held-out perplexity {h['initial_perplexity']:.1f} -> "
          f"{h['perplexity']:.3f} (unigram model {h['unigram_perplexity']:.2f}); total {phases['total_seconds']:.0f} s "
          f"(train script {phases['train_script_seconds']:.0f} s, eval script {phases['eval_script_seconds']:.0f} s)")  # fmt: skip
    print(f"results in {out}: {', '.join(written)}; checkpoints in {ckpt}")
    return code


if __name__ == "__main__":
    sys.exit(main())
