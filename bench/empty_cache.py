"""empty_cache.py: what torch.cuda.empty_cache costs after a train step, alone and under DDP (no vLLM).

    torchrun --nproc_per_node N bench/empty_cache.py MODE [STEPS]

The trainer calls empty_cache before vLLM wakes (the engine maps its memory from the driver). On four GPUs under DDP
it cost 0.19-0.36 s a step, against 0.06 s on one GPU and under FSDP2 x 4. This reproduces the trainer's memory
pattern with a stand-in for the 1.5B shape (56 blocks of two fp32 Linear weights, 1.54B parameters, AdamW, bf16
autocast, 11 micro-batches of 6,144 tokens, DDP's no_sync on all but the last) and times empty_cache after each
step, with the caching allocator's segment count and cached bytes. MODE:
    plain   no DDP (every rank trains alone; the process group only says hello)
    ddp     DDP(gradient_as_bucket_view=True), as the trainer builds it; ddp:MB with bucket_cap_mb MB (default 25)
Environment variables (NCCL_P2P_DISABLE, NCCL_CUMEM_ENABLE, TORCH_NCCL_AVOID_RECORD_STREAMS...) pass through.
Rank 0 prints one JSON line per rank: empty_cache seconds per step, segments and GiB it gave back, and the 11 micro-batches'
time (fwd_bwd: what DDP adds to the train phase).
"""
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main(mode: str, steps: int):
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    hello = torch.ones(1, device=device)
    dist.all_reduce(hello)

    torch.manual_seed(0)
    hidden, inner, layers, tokens = 1536, 8960, 56, 6144
    with torch.device(device):
        model = nn.Sequential(*[nn.Sequential(nn.Linear(hidden, inner, bias=False), nn.GELU(),
                                              nn.Linear(inner, hidden, bias=False)) for _ in range(layers)])
    if mode.startswith("ddp"):
        bucket_mb = int(mode.split(":")[1]) if ":" in mode else 25
        model = DDP(model, device_ids=[device.index], gradient_as_bucket_view=True, bucket_cap_mb=bucket_mb)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)

    rows = []
    for step in range(steps):
        torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        for i in range(11):
            no_sync = isinstance(model, DDP) and i < 10
            with model.no_sync() if no_sync else torch.enable_grad():
                x = torch.randn(tokens, hidden, device=device)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    y = model(x)
                    logits = torch.randn(tokens // 4, 151_936, device=device)  # the logprob chunk's temporaries
                    loss = y.float().pow(2).mean() + logits.logsumexp(-1).mean() * 0
                loss.backward()
                del x, y, logits, loss
        torch.cuda.synchronize()
        fwd_bwd = time.perf_counter() - start
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)  # as the trainer
        torch.cuda.synchronize()
        stats = torch.cuda.memory_stats(device)
        segments, cached = stats["segment.all.current"], stats["reserved_bytes.all.current"]
        start = time.perf_counter()
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        stats = torch.cuda.memory_stats(device)
        rows.append({"s": round(seconds, 4), "fwd_bwd_s": round(fwd_bwd, 3),
                     "segments_freed": segments - stats["segment.all.current"],
                     "gib_freed": round((cached - stats["reserved_bytes.all.current"]) / 2**30, 2)})
        dist.barrier()
    later = rows[1:] or rows
    mine = {"mode": mode, "rank": rank, "world": world,
            "env": {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "TORCH_NCCL"))},
            "median_s": statistics.median(r["s"] for r in later),
            "fwd_bwd_s": statistics.median(r["fwd_bwd_s"] for r in later),
            "segments_freed": later[-1]["segments_freed"], "gib_freed": later[-1]["gib_freed"], "steps": rows}
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)  # rank 0 prints them all: one line each, not interleaved
    if rank == 0:
        print("\n".join(json.dumps(r) for r in everyone), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 5)
