"""push_ab.py: the in-process weight push through vLLM's internals vs its public LLM.apply_model, one engine.

    python bench/push_ab.py MODEL_DIR [--repeat 5]

One engine (external_launcher, world of one) and the same model in transformers (bf16, on the GPU). Each way of
pushing loads every weight of the HF model into the engine, alternating A, B, A, B, ...; prints the median seconds of
each and the probe's mean |logp gap| (engine vs trainer) after the last push of each way, which must stay small.
"""

import argparse
import os
import statistics
import sys
import time

for key in ("VLLM_ENABLE_V1_MULTIPROCESSING", "VLLM_USE_FLASHINFER_SAMPLER"):  # as grpo_colocate.py sets them
    os.environ.setdefault(key, "0")
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29531")
import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--repeat", type=int, default=5)
    a = p.parse_args()
    torch.distributed.init_process_group("nccl", device_id=torch.device("cuda", 0))
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    llm = LLM(model=a.model, dtype=torch.bfloat16, distributed_executor_backend="external_launcher",
              gpu_memory_utilization=0.3, max_model_len=512, enforce_eager=False)
    lm = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16).cuda().eval()
    with torch.no_grad():  # a visible change, so that a push that did nothing shows in the gap
        for param in lm.parameters():
            param.mul_(1.01)

    def weights():
        return ((name, param.detach()) for name, param in lm.named_parameters())

    ways = {
        "internal (model_runner.model.load_weights)": lambda: llm.llm_engine.model_executor.driver_worker.worker
        .model_runner.model.load_weights(weights()),
        "public (LLM.apply_model)": lambda: llm.apply_model(lambda model: model.load_weights(weights())),
    }
    probe = list(range(1000, 1200))
    times = {k: [] for k in ways}
    gaps = {}
    for _ in range(a.repeat + 1):  # the first round warms up
        for name, push in ways.items():
            torch.cuda.synchronize()
            start = time.perf_counter()
            push()
            torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
            llm.reset_prefix_cache()
            out = llm.generate([{"prompt_token_ids": probe}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                               use_tqdm=False)[0]
            vllm_lp = torch.tensor([out.prompt_logprobs[i][t].logprob for i, t in enumerate(probe) if i > 0])
            with torch.no_grad():
                logits = lm(torch.tensor([probe], device="cuda")).logits[0, :-1].float()
            trainer_lp = logits.log_softmax(-1).gather(-1, torch.tensor(probe[1:], device="cuda")[:, None])[:, 0]
            gaps[name] = (trainer_lp.cpu() - vllm_lp).abs().mean().item()
    gb = sum(p.numel() for p in lm.parameters()) * 2 / 1e9
    for name in ways:
        print(f"{name}: median {statistics.median(times[name][1:]):.4f} s for {gb:.2f} GB "
              f"(all: {' '.join(f'{t:.4f}' for t in times[name][1:])}), probe gap after push {gaps[name]:.4f}")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
