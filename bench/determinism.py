"""Where two identical multi-GPU runs part (issue 35): an unmodified run of grpo_colocate.py, watched. Per rank
and step it records a digest of the rollout's tokens, of the gradients AdamW receives, of the weights after its
step, of the engine's weights after each push, and the step's loss and grad norm.

    torchrun --nproc_per_node 2 bench/determinism.py OUT <grpo_colocate flags>    # writes OUT.rank<r>.jsonl
    python bench/determinism.py compare A B                                     # the first record that differs
Pass --full_determinism among the flags for the trainer's deterministic kernels (issue 35; DETERMINISTIC=1, which
switched them on before the engine, crashed vLLM's compiler: the flag switches them on after it).
ENGINE_SYNC=1 starts the engine without async scheduling and without prefix caching.
"""
import hashlib
import json
import os
import sys

import torch  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import grpo_colocate as gc  # noqa: E402


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        h.update(t.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def engine_sync():
    import vllm

    make = vllm.LLM

    def synchronous(*args, **kwargs):
        return make(*args, **{**kwargs, "async_scheduling": False, "enable_prefix_caching": False})
    vllm.LLM = synchronous


def watch(out):
    def record(**fields):
        with open(f"{out}.rank{os.environ['RANK']}.jsonl", "a") as f:
            f.write(json.dumps(fields) + "\n")

    rollout, push_weights, train_step, step = gc.rollout, gc.push_weights, gc.train_step, torch.optim.AdamW.step

    def watched_rollout(llm, cfg, env, tokenizer, prompt_ids, positions=None):
        samples, counts = rollout(llm, cfg, env, tokenizer, prompt_ids, positions)
        tokens = hashlib.sha256(repr([s.token_ids for s in samples]).encode()).hexdigest()[:16]
        record(what="rollout" if positions is not None else "eval", tokens=tokens)
        return samples, counts

    def watched_push(llm, lm, env, bucket_mb):
        pushed = push_weights(llm, lm, env, bucket_mb)
        record(what="engine weights", digest=llm.apply_model(lambda model: digest(model.parameters()))[0])
        return pushed

    def watched_train_step(*args):
        stats = train_step(*args)
        record(what="step", loss=stats["loss"], grad_norm=stats["grad_norm"])
        return stats

    def watched_step(self, *args, **kwargs):
        params = [p for group in self.param_groups for p in group["params"]]
        record(what="gradients", digest=digest(p.grad for p in params if p.grad is not None))
        result = step(self, *args, **kwargs)
        record(what="weights", digest=digest(params))
        return result

    gc.rollout, gc.push_weights, gc.train_step, torch.optim.AdamW.step = (
        watched_rollout, watched_push, watched_train_step, watched_step)


def compare(a, b):
    for rank in range(8):
        paths = [f"{x}.rank{rank}.jsonl" for x in (a, b)]
        if not all(os.path.exists(p) for p in paths):
            break
        runs = [[json.loads(line) for line in open(p)] for p in paths]
        first = next((i for i, (x, y) in enumerate(zip(*runs)) if x != y), None)
        print(f"rank {rank}: {len(runs[0])} records; " + ("identical" if first is None else
              f"record {first} differs: {runs[0][first]} vs {runs[1][first]}"))


if __name__ == "__main__":
    if sys.argv[1] == "compare":
        compare(sys.argv[2], sys.argv[3])
    else:
        if os.environ.get("ENGINE_SYNC") == "1":
            engine_sync()
        watch(sys.argv[1])
        gc.main(sys.argv[2:])
