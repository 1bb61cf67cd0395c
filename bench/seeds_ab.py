"""seeds_ab.py MODEL: one engine, the same 32 prompts x G 8 x 256 forced tokens, generated with and without per-request
seeds (the trainer's rollouts use them), with and without sampled-token logprobs; three calls of each, printed.

Updated to the API of issue 33: check_inputs returns (cfg, env, inputs, error), setup_distributed takes the env and
any rank's error and facts (as main does), make_engine takes the model config and the memory plan's sleep (off here).
Not run on a GPU after the update; verified by pyflakes and on the CPU with make_engine replaced by a stand-in engine
(the inputs, the process group, sampling_params and generate's calls).
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # grpo_colocate.py: the repo root
import grpo_colocate as gc  # noqa: E402

cfg, env, inputs, error = gc.check_inputs([
    "--model", sys.argv[1], "--max_prompt_length", "128", "--max_completion_length", "256", "--ignore_eos",
    "--per_device_train_batch_size", "32", "--gradient_accumulation_steps", "8", "--vllm_enable_sleep_mode", "false"])
gc.setup_distributed(cfg, env, error, inputs and inputs.facts)
tok, rows, _ = inputs.data
llm = gc.make_engine(cfg, env, inputs.model_config, inputs.plan.sleep)
prompts = [r["prompt_ids"] for r in rows[:32]]
for logprobs in (True, False):
    params = gc.sampling_params(cfg, logprobs=logprobs)
    for label, seeds in (("no seeds", None), ("per-request seeds", list(range(0, 256, 8)))) * 3:
        gc.cuda_sync(env)
        start = time.perf_counter()
        out = gc.generate(llm, env, prompts, params, seeds)
        gc.cuda_sync(env)
        seconds = time.perf_counter() - start
        n = sum(len(c.token_ids) for o in out for c in o.outputs)
        print(f"logprobs {logprobs}, {label}: {n} tokens in {seconds:.3f} s = {n / seconds:.0f} tok/s", flush=True)
del llm
torch.distributed.destroy_process_group()
