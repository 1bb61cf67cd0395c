"""Reward functions for grpo_colocate.py, the built-in arithmetic task, and the tools.

A reward function follows TRL's convention:

    f(prompts: list[str], completions: list[str], **columns) -> list[float]

`prompts` and `completions` are decoded text, one entry per completion (a prompt appears G times in a row);
`columns` holds every other dataset column (here `answer`), repeated the same way, and from the trainer
`completion_ids` (the completions' token ids, as TRL passes them) and `max_completion_length` (the flag). Return one
float per completion, or None where the function cannot score it: as in TRL, a None counts 0 in the weighted sum
and stays out of its function's logged mean; a completion that every function returns None for stays out of its
group's mean and std, with advantage 0, and out of the logged reward.

Pass functions by name with `--reward_funcs accuracy_reward format_reward` (and `--reward_weights 1.0 0.5`),
or your own as `--reward_funcs my_module:my_reward` (any importable module).

The tools for `--tools` (TRL's convention) are at the end: plain functions with type hints and a
docstring whose Args section describes every argument (transformers' get_json_schema makes them the
schema that the model sees).
"""

import ast
import functools
import hashlib
import json
import math
import operator
import random
import re
import threading
import time
import warnings

# '#### 42' (GSM8K style), '\boxed{42}' (MATH style), and a bare number, with optional sign, commas, decimals
_NUM = r"-?\d[\d,]*(?:\.\d+)?"
HASH_ANSWER = re.compile(r"####\s*\$?\s*(" + _NUM + ")")
BOXED_ANSWER = re.compile(r"\\boxed\{\s*\$?\s*(" + _NUM + r")\s*\}")
ANY_NUMBER = re.compile(_NUM)
PLAIN_NUMBER = re.compile(r"\s*\$?\s*" + _NUM + r"\s*")  # a whole reference that is just a number ("42")
HASH_TAIL = re.compile(r"####\s*(.+)")  # '#### x^2+1' in a completion: the rest of the line is the answer


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


@functools.lru_cache(maxsize=1024)
def _parse_reference(ref: str):
    from math_verify import parse  # HF's math-verify: LaTeX -> sympy

    return parse(ref) or parse(f"${ref}$")  # a bare '\\sqrt{2}' or 'x^2+1' parses once it is marked as math


def math_reward(ref: str, completion: str) -> float | None:
    """1.0 when math-verify finds the completion's answer equal to the LaTeX reference (\\frac{1}{2} == 0.5,
    1 + x^2 == x^2+1), else 0.0; None (not scored) when the reference does not parse or math-verify is missing."""
    try:
        from math_verify import parse, verify
    except ImportError:  # warned once per run (Python shows a warning once per place)
        warnings.warn("accuracy_reward: math-verify is not installed, so references that are not plain numbers "
                      "(LaTeX, expressions) are not scored (reward None); pip install math-verify==0.9.0")
        return None
    gold = _parse_reference(ref)
    if not gold:
        return None
    return float(verify(gold, parse(HASH_TAIL.sub(r"\\boxed{\1}", completion))))


def accuracy_reward(prompts, completions, answer, **columns) -> list[float | None]:
    """1.0 when the completion's final answer equals the reference, else 0.0.

    A reference that is a bare number ("42", the built-in task) or a worked solution ending in '#### 42' (GSM8K) is
    compared numerically: the completion's answer is its last '#### N', else its last '\\boxed{N}', else its last
    number (lenient on format on purpose: format_reward is the separate, strict signal). Any other reference (MATH
    style: '\\frac{1}{2}', '\\sqrt{2}', '\\boxed{x^2+1}', a worked solution) goes through math-verify
    (math_reward).
    """
    rewards = []
    for completion, ref in zip(completions, answer, strict=True):
        ref = str(ref)
        if not (PLAIN_NUMBER.fullmatch(ref) or HASH_ANSWER.search(ref)):
            rewards.append(math_reward(ref, completion))
            continue
        want, got = extract_answer(ref), extract_answer(completion)
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


# The built-in task (--dataset arithmetic, the default), which accuracy_reward grades
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


# --tools: the model calls these with JSON arguments; what a tool raises, it reads as an error.
MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 100  # with MAX_MAGNITUDE: no call can hang the rollout on a huge power
MAX_MAGNITUDE = 1e300  # every intermediate value, so that floats stay finite
OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
             ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
             ast.Pow: operator.pow, ast.USub: operator.neg, ast.UAdd: operator.pos}


def _evaluate(node):
    """The value of an arithmetic syntax tree: numbers and OPERATORS only; the rest is refused."""
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in OPERATORS:
        return OPERATORS[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
            raise ValueError(f"exponent {right} is too large (at most {MAX_EXPONENT})")
        value = OPERATORS[type(node.op)](left, right)
        if abs(value) > MAX_MAGNITUDE:
            raise ValueError(f"a value is larger than {MAX_MAGNITUDE:g}")
        return value
    raise ValueError(f"unsupported expression: {ast.unparse(node)!r}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression and return its value.

    Args:
        expression: numbers with + - * / // % ** and parentheses, e.g. "37 + 58" or "(3 - 12) * 4"
    """
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    # parsed, never evaluated as Python: only the nodes _evaluate knows are computed
    value = _evaluate(ast.parse(expression.strip(), mode="eval").body)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


TOOLS = {f.__name__: f for f in (calculator,)}


# The tool-call protocol (Qwen's Hermes format): how the model is told of the tools, and how its calls are
# read and run. A chat template without a tools section gets the schemas in a system message.
TOOLS_PROMPT = ("# Tools\n\nYou may call these functions, given as JSON schemas:\n{}\n\n"
                "To call one, write <tool_call>"
                '{{"name": <function-name>, "arguments": <args-json-object>}}</tool_call>')
TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
# Bounds on what a rollout's calls may cost (TRL has none): each call runs at most TOOL_TIMEOUT
# seconds, and all the calls of a rollout end by one deadline (tool_turns: a quarter of
# --ddp_timeout), past which a call fails at once; either way the model reads an error naming the
# tool (the call's thread is left behind, so a stuck tool holds neither the rollout nor its TP
# group). Calls past the first MAX_CALLS_PER_TURN of a turn are not run; a result is cut.
TOOL_TIMEOUT = 10.0  # seconds
MAX_CALLS_PER_TURN = 8
MAX_RESULT_CHARS = 2000


def call_tool(tools: dict, call: str, deadline: float = math.inf) -> tuple[bool, dict]:
    """(failed, the tool message) of a call '{"name": ..., "arguments": {...}}', parsed as JSON, never
    evaluated. As in TRL, a bad call or a tool that raises gives the model {'error': ...}; so (here) does
    one that runs past TOOL_TIMEOUT or the deadline (time.monotonic()), or returns what str() cannot
    render, or raises what is no Exception (SystemExit: its thread ends, the rollout goes on)."""
    message = {"role": "tool", "name": "unknown"}
    outcome = {}
    try:
        call = json.loads(call)
        message["name"] = name = str(call["name"])
        if name not in tools:
            raise ValueError(f"Tool {name} not found.")
        timeout = min(TOOL_TIMEOUT, deadline - time.monotonic())
        if timeout <= 0:
            raise TimeoutError(f"the rollout's time for tools ran out before tool {name}")

        def run():  # in a thread of its own, so that a stuck tool times out
            try:
                outcome["content"] = str(tools[name](**call.get("arguments", {})))[:MAX_RESULT_CHARS]
            except BaseException as e:  # noqa: BLE001 - whatever the tool raises, SystemExit too
                outcome["error"] = e
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(timeout)
        if thread.is_alive():
            raise TimeoutError(f"tool {name} ran past {timeout:.2g} s")
        error = outcome.get("error")
        if isinstance(error, Exception):
            raise error
        if error is not None:  # SystemExit, KeyboardInterrupt...: the tool's, not this process's
            raise RuntimeError(f"tool {name} raised {error!r}")
    except Exception as e:  # noqa: BLE001
        return True, {**message, "content": str({"error": str(e)})}
    return False, {**message, "content": outcome["content"]}


def tool_suffix_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The tokens the chat template puts after a turn's EOS for these tool messages, up to the
    next assistant header. As TRL: rendered after a dummy call, cut at its last EOS."""
    call = {"type": "function", "function": {"name": messages[0]["name"], "arguments": {}}}
    dummy = [{"role": "user", "content": "dummy"},
             {"role": "assistant", "content": "", "tool_calls": [call]}]
    render = functools.partial(tokenizer.apply_chat_template, tokenize=True, return_dict=False)
    prefix = render(dummy)
    ends = [i for i, token in enumerate(prefix) if token == tokenizer.eos_token_id]
    start = ends[-1] + 1 if ends else len(prefix)
    return render(dummy + messages, add_generation_prompt=True)[start:]
