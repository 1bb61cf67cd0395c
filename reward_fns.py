"""Reward functions for grpo_colocate.py.

A reward function follows TRL's convention:

    f(prompts: list[str], completions: list[str], **columns) -> list[float]

`prompts` and `completions` are decoded text, one entry per completion (a prompt appears G times in a row);
`columns` holds every other dataset column (here `answer`), repeated the same way, and from the trainer
`completion_ids` (the completions' token ids, as TRL passes them) and `max_completion_length` (the flag). Return one
float per completion; None is allowed for "not applicable" and is treated as 0 by the trainer.

Pass functions by name with `--reward_funcs accuracy_reward format_reward` (and `--reward_weights 1.0 0.5`),
or your own as `--reward_funcs my_module:my_reward` (any importable module).
"""

import re

# '#### 42' (GSM8K style), '\boxed{42}' (MATH style), and a bare number, with optional sign, commas, decimals
_NUM = r"-?\d[\d,]*(?:\.\d+)?"
HASH_ANSWER = re.compile(r"####\s*\$?\s*(" + _NUM + ")")
BOXED_ANSWER = re.compile(r"\\boxed\{\s*\$?\s*(" + _NUM + r")\s*\}")
ANY_NUMBER = re.compile(_NUM)


def _to_number(s: str) -> float | None:
    try:
        return float(s.replace(",", ""))
    except ValueError:
        return None


def extract_answer(text: str) -> float | None:
    """The final numeric answer in `text`: the last '#### N', else the last '\\boxed{N}', else the last number."""
    for pattern in (HASH_ANSWER, BOXED_ANSWER, ANY_NUMBER):
        found = pattern.findall(text)
        if found:
            return _to_number(found[-1])
    return None


def reward_len(prompts, completions, **columns) -> list[float]:
    """The colocate blog post's toy reward: -|20 - number of characters|, best at exactly 20 characters."""
    return [-float(abs(20 - len(c))) for c in completions]


def format_reward(prompts, completions, **columns) -> list[float]:
    """1.0 when the completion states a final answer as '#### N' or '\\boxed{N}', else 0.0."""
    return [1.0 if HASH_ANSWER.search(c) or BOXED_ANSWER.search(c) else 0.0 for c in completions]


def accuracy_reward(prompts, completions, answer, **columns) -> list[float]:
    """1.0 when the completion's final answer equals the reference numerically, else 0.0.

    The reference may be a bare number ("42", the built-in task) or a worked solution ending in '#### 42' (GSM8K);
    the completion's answer is its last '#### N', else its last '\\boxed{N}', else its last number (lenient on
    format on purpose: format_reward is the separate, strict signal).
    """
    rewards = []
    for completion, ref in zip(completions, answer, strict=True):
        want, got = extract_answer(str(ref)), extract_answer(completion)
        rewards.append(1.0 if want is not None and got is not None and abs(want - got) < 1e-6 else 0.0)
    return rewards


OVERLONG_BUFFER = 0.2  # L_cache as a fraction of max_completion_length (DAPO: 4096 of 20480 tokens)


def soft_overlong_punishment(prompts, completions, completion_ids, max_completion_length, **columns) -> list[float]:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13; TRL's get_soft_overlong_punishment), in tokens:

        0 while |y| <= L_max - L_cache,   (L_max - L_cache - |y|) / L_cache up to L_max (down to -1),   -1 beyond
    with L_max = --max_completion_length and L_cache = OVERLONG_BUFFER * L_max. Add it to a task reward.
    """
    cache = max(1, round(OVERLONG_BUFFER * max_completion_length))
    start = max_completion_length - cache
    return [0.0 if len(ids) <= start else max(-1.0, (start - len(ids)) / cache) for ids in completion_ids]


REWARD_FUNCS = {f.__name__: f for f in (accuracy_reward, format_reward, reward_len, soft_overlong_punishment)}
