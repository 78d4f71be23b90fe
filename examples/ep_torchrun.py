"""Expert parallelism across ranks launched by torchrun (one process per GPU, or gloo on CPUs).

    torchrun --nproc-per-node 2 examples/ep_torchrun.py --quant int8_channel

Every rank builds the same DeepSeek-style block, loads the checkpoint (keeping its own experts),
runs its own tokens, and rank 0 prints what was chosen and the time per forward.
"""

from __future__ import annotations

import argparse
import logging
import os
import time

import torch
import torch.distributed as dist

from deepseek_moe_block import DeepseekV3MoE, MoEConfig, random_checkpoint
from epmoe.dispatch import DeepEPBuffer


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quant", default="bf16")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args()
    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if use_cuda:
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank = dist.get_rank()
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING)
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    dtype = torch.bfloat16 if use_cuda else torch.float32
    cfg = MoEConfig()
    # One DeepEP buffer for all MoE layers of the group (allocated only if DeepEP is chosen).
    deepep_buffer = DeepEPBuffer()
    block = DeepseekV3MoE(cfg, quant=args.quant, device=device, dtype=dtype, deepep_buffer=deepep_buffer)
    tensors = [(n, t.to(device)) for n, t in random_checkpoint(cfg, args.quant)]
    block.experts.load_weights(nt for nt in tensors if ".shared_experts." not in nt[0])
    block.load_shared_experts(nt for nt in tensors if ".shared_experts." in nt[0])
    torch.manual_seed(rank)
    x = torch.randn(args.tokens, cfg.hidden_size, device=device, dtype=dtype)
    with torch.no_grad():
        block(x)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.iters):
            y = block(x)
        if use_cuda:
            torch.cuda.synchronize()
        dist.barrier()
    ms = (time.perf_counter() - start) / args.iters * 1e3
    if rank == 0:
        print(f"{dist.get_world_size()} ranks, {args.tokens} tokens/rank, {args.quant}: {ms:.2f} ms/forward, "
              f"out {tuple(y.shape)} finite={bool(torch.isfinite(y).all())}")
    deepep_buffer.close()  # collective, like its allocation
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
