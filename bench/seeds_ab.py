"""seeds_ab.py MODEL: one engine, the same 32 prompts x G 8 x 256 forced tokens, generated with and without per-request
seeds (the trainer's rollouts use them), with and without sampled-token logprobs; three calls of each, printed."""
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 2)[0])
import grpo_colocate as gc  # noqa: E402

cfg, (model_config, (tok, rows, _)), _ = gc.check_inputs([
    "--model", sys.argv[1], "--max_prompt_length", "128", "--max_completion_length", "256", "--ignore_eos",
    "--per_device_train_batch_size", "32", "--gradient_accumulation_steps", "8", "--vllm_enable_sleep_mode", "false"])
env = gc.setup_distributed(cfg)
llm = gc.make_engine(cfg, env, model_config)
prompts = [r["prompt_ids"] for r in rows[:32]]
for logprobs in (True, False):
    params = gc.sampling_params(cfg, logprobs=logprobs)
    for label, seeds in (("no seeds", None), ("per-request seeds", list(range(0, 256, 8)))) * 3:
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = gc.generate(llm, env, prompts, params, seeds)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        n = sum(len(c.token_ids) for o in out for c in o.outputs)
        print(f"logprobs {logprobs}, {label}: {n} tokens in {seconds:.3f} s = {n / seconds:.0f} tok/s", flush=True)
del llm
torch.distributed.destroy_process_group()
