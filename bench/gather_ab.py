"""gather_ab.py: the push's gather under FSDP2, one full_tensor a parameter against one all-gather a layer.

    torchrun --nproc_per_node 4 bench/gather_ab.py MODEL_DIR [REPEAT, default 5]

The trainer's own FSDP2 policy (wrap_policy, fp32 shards, bf16 compute) on every rank; each way walks
full_weights in bf16 as the push does (the engine left out), alternating A, B, A, B, ...; rank 0 prints the median
seconds of each and the largest difference between the two walks' tensors, which must be 0.
"""

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import grpo_colocate as gc  # noqa: E402


def main(model: str, repeat: int = 5):
    cfg = gc.parse_args(["--model", model, "--fsdp", "--output_dir", "/tmp/gather_ab"])
    env = gc.setup_env(cfg)
    gc.setup_distributed(cfg, env)
    lm = gc.load_lm(model, "cpu", env.attention, meta=not env.is_main)
    policy = gc.wrap_policy(lm, env, cfg, checkpointing=False)
    lm = gc.unwrap(policy).lm

    def walk(by_layer):
        gc.cuda_sync(env)
        start = time.perf_counter()
        tensors = dict(gc.full_weights(lm, env.dtype, env.device, 1 << 30, by_layer))
        gc.cuda_sync(env)
        return time.perf_counter() - start, tensors

    times = {False: [], True: []}
    for _ in range(repeat + 1):  # the first of each: a warm-up
        for by_layer in (False, True):
            seconds, tensors = walk(by_layer)
            times[by_layer].append(seconds)
            if by_layer:
                diff = max((tensors[n] - last[n]).abs().max().item() for n in last)
            last = tensors
    if env.is_main:
        per_param, per_layer = (statistics.median(times[k][1:]) for k in (False, True))
        print(f"gather_ab: world {env.world}, {len(last)} tensors, {sum(t.nbytes for t in last.values()) / 2**30:.2f} "
              f"GiB {str(env.dtype)[6:]} | per parameter {per_param:.4f} s, per layer {per_layer:.4f} s ({per_param / per_layer:.1f}x) "
              f"| max |difference| {diff} | all: {[round(t, 4) for t in times[False]]} {[round(t, 4) for t in times[True]]}",
              flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], *map(int, sys.argv[2:3]))
