"""A rank of the transformers EP test (spawned; importable by name in the child)."""

from __future__ import annotations

import torch

from epmoe.launch import init_process_group

VOCAB = 96


def ids(seed: int = 1, batch: int = 2, seq: int = 9) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def ep_rank(rank: int, world: int, port: int, path: str, out: str) -> None:
    from epmoe.integrations import transformers as et

    init_process_group(rank, world, port, "cpu", timeout_s=120)
    x = ids(seed=10 + rank, batch=1 + rank, seq=6 + rank)  # each rank its own batch
    model = et.from_pretrained(path, backend="torch", device="cpu")
    with torch.no_grad():
        logits = model(x).logits
        gen = model.generate(x, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    torch.save({"logits": logits, "gen": gen, "report": model.epmoe_load_report.__dict__}, f"{out}.{rank}")
