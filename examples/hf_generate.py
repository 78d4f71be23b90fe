"""Generate with a Hugging Face transformers MoE model whose routed experts run in epmoe.

    python examples/hf_generate.py --make-tiny qwen3_moe /tmp/tiny       # a tiny random model
    python examples/hf_generate.py /tmp/tiny --quant int8_channel         # one process
    torchrun --nproc-per-node 2 examples/hf_generate.py /tmp/tiny         # expert parallel

Under torchrun every rank runs the whole model on its own prompt batch and holds E / N experts
(read from the checkpoint: no rank reads the others' experts); only the MoE layers exchange tokens.
"""

from __future__ import annotations

import argparse
import logging
import os

import torch
import torch.distributed as dist


def main(argv=None) -> int:
    from epmoe.integrations import transformers as et

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a transformers MoE checkpoint directory")
    p.add_argument("--make-tiny", metavar="FAMILY", choices=sorted(et.TINY_FAMILIES),
                   help="first write a tiny random model of FAMILY to MODEL")
    p.add_argument("--quant", default=None, choices=["bf16", "int8_channel", "int8_block", "fp8_block"],
                   help="experts scheme (default: the checkpoint's)")
    p.add_argument("--backend", default="auto", help="experts backend (auto, torch, triton, deepgemm, cutlass)")
    p.add_argument("--device", default=None, help="default: this rank's CUDA device, else cpu")
    p.add_argument("--batch", type=int, default=2, help="prompts per rank")
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--check", action="store_true", help="compare with the model's eager experts (one process)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if cuda else "gloo")
    if args.make_tiny:
        if rank == 0:
            from transformers import AutoModelForCausalLM

            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(et.tiny_config(args.make_tiny)).save_pretrained(args.model)
        if world > 1:
            dist.barrier()
    model = et.from_pretrained(args.model, quant=args.quant, device=args.device, backend=args.backend)
    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (args.batch, args.prompt_len), generator=torch.Generator().manual_seed(rank))
    with torch.no_grad():
        out = model.generate(prompt.to(device), max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                             do_sample=False)  # fmt: skip
    r = model.epmoe_load_report
    print(f"rank {rank}/{world}: experts {r.local_experts} of {r.num_experts} per layer, read "
          f"{r.bytes_read / 1e6:.2f} of {r.checkpoint_bytes / 1e6:.2f} MB, peak RSS {r.peak_host_rss_bytes / 1e6:.0f} MB, "
          f"peak GPU {r.peak_gpu_bytes / 1e6:.0f} MB")  # fmt: skip
    print(f"rank {rank}: generated {out[:, args.prompt_len:].tolist()}")
    if args.check and world == 1:
        from transformers import AutoModelForCausalLM

        eager = AutoModelForCausalLM.from_pretrained(args.model, experts_implementation="eager", dtype=model.dtype)
        ref = eager.to(device).eval().generate(prompt.to(device), max_new_tokens=args.new_tokens,
                                               min_new_tokens=args.new_tokens, do_sample=False)  # fmt: skip
        same = torch.equal(ref, out)
        print(f"eager experts generate the same tokens: {same}")
        if not same:
            return 1
    if world > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
