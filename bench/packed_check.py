"""packed_check.py: the trainer's packed (varlen) path against every sequence run alone.

    python bench/packed_check.py        # one GPU, about a minute; exits 1 if a check fails

A small random Qwen2 (8 query heads, 2 KV heads: GQA), fp32 weights under bf16 autocast as the trainer runs it, 12
sequences of very unequal lengths (a completion of 0 tokens among them). Checks, each printed with its number:
1. Policy's packed forward, attn_implementation "varlen" (torch.nn.attention.varlen.varlen_attn, registered by
   grpo_colocate.load_lm) vs each sequence alone through sdpa, unpadded: max |logp difference| (bf16 noise).
2. The same for the packed sdpa path (the CPU's: transformers' block-diagonal mask from the position ids).
3. Gradients of a weighted sum of the logprobs, varlen packed vs sdpa alone: max |difference| / max |gradient|.
4. Without autocast (fp32 activations; varlen_attention casts q/k/v to bf16 and back): max |logp difference|.
A wiring error (wrong sequence boundaries, a missing causal window, GQA heads crossed) gives differences of order 1.

Updated to the API of issue 33: gc.pack takes the model mask [B, T] and the device; the mask is built as make_batch
builds batch.model_mask (completion_mask_of is gone); each sequence alone is scored through gc.TokenLogprobs, what
Policy runs (chunked_logprobs is gone). Without CUDA (varlen_attn is a CUDA kernel) check 1 is skipped and checks 3
and 4 run on the packed sdpa path: that run (on the CPU) is how this version was verified; the CUDA path was not run
after the update.
"""

import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # grpo_colocate.py: the repo root
import grpo_colocate as gc  # noqa: E402


def model_mask_of(completions: list[list[int]]) -> torch.Tensor:
    """[B, T] as make_batch builds batch.model_mask: 1 on every token the model wrote (here all), left-aligned."""
    rows = [torch.ones(len(c), dtype=torch.long) for c in completions]
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True)


def main():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    packed_attn = "varlen" if cuda else "sdpa"  # checks 3 and 4: the trainer's packed path on this device
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=True)
    with tempfile.TemporaryDirectory() as path:
        Qwen2ForCausalLM(config).save_pretrained(path)
        policies = {attn: gc.Policy(gc.load_lm(path, dev, attn)) for attn in {"sdpa", packed_attn}}
    g = torch.Generator().manual_seed(1)

    def tokens(lo, hi):
        return torch.randint(1, 1000, (int(torch.randint(lo, hi, (), generator=g)),), generator=g).tolist()
    prompts = [tokens(5, 60) for _ in range(12)]
    completions = [tokens(1, 300) for _ in range(11)] + [[]]
    host_mask = model_mask_of(completions)  # [B, T]: pack reads it on the host
    mask = host_mask.to(dev)
    packed = gc.pack(prompts, completions, host_mask, dev)
    weights = torch.randn(mask.shape, device=dev, generator=torch.Generator(device=dev).manual_seed(2))
    print(f"{len(prompts)} sequences, {packed[0].shape[1]} tokens packed, lengths "
          f"{[len(p) + len(c) for p, c in zip(prompts, completions)]}; "
          f"{torch.cuda.get_device_name() if cuda else 'CPU (no varlen_attn: sdpa only)'}, torch {torch.__version__}")

    def alone(policy, autocast=True):  # each sequence alone through the policy's lm, unpadded -> [B, T]
        lm = policy.lm
        rows = []
        for p, c in zip(prompts, completions):
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
                hidden = lm.get_decoder()(input_ids=torch.tensor([p + c], device=dev)).last_hidden_state[0]
                lp, _ = gc.TokenLogprobs.apply(hidden[len(p) - 1:-1], lm.get_output_embeddings().weight,
                                               torch.tensor(c, dtype=torch.long, device=dev), 1.0, 0, 1.0,
                                               policy.chunk_size)
            rows.append(torch.cat([lp, lp.new_zeros(mask.shape[1] - len(c))]))
        return torch.stack(rows)

    def packed_logps(policy, autocast=True):
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=autocast):
            return policy(*packed, mask, 1.0)[0]

    def grads(logps, policy):
        return torch.autograd.grad((logps * weights * mask).sum(), list(policy.lm.parameters()))

    ok = True

    def report(n, what, value, limit):
        nonlocal ok
        ok &= value < limit
        print(f"{n}. {what}: {value:.3e} (limit {limit:g}) {'ok' if value < limit else 'FAILED'}")

    sdpa, fast = policies["sdpa"], policies[packed_attn]
    want = alone(sdpa)
    got = packed_logps(fast)
    if cuda:
        report(1, "varlen packed vs sdpa alone, max |dlogp|", ((got - want) * mask).abs().max().item(), 0.1)
    else:
        print("1. varlen packed vs sdpa alone: skipped (varlen_attn needs CUDA)")
    report(2, "sdpa packed vs sdpa alone, max |dlogp|", ((packed_logps(sdpa) - want) * mask).abs().max().item(), 0.1)
    g_want, g_got = grads(want, sdpa), grads(got, fast)
    rel = max(((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item() for a, b in zip(g_got, g_want))
    report(3, f"gradients, {packed_attn} packed vs sdpa alone, max relative difference", rel, 0.1)
    with torch.no_grad():
        diff = ((packed_logps(fast, False) - alone(sdpa, False)) * mask).abs().max().item()
    report(4, f"fp32 activations, {packed_attn} packed vs sdpa alone, max |dlogp|", diff, 0.1)
    print("all checks passed" if ok else "SOME CHECKS FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
