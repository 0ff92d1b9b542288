#!/usr/bin/env python3
"""A Hugging Face transformers model with dattn as its attention, the sequence sharded over the
MPI ranks: a small Llama (transformers' LlamaConfig and LlamaForCausalLM, random weights from a
fixed seed, nothing downloaded) whose attention layers call dattn through transformers'
AttentionInterface. The loss and every parameter gradient are checked against one process
running the same model over the whole sequence with transformers' eager attention.

    PYTHONPATH=build/python bash launch/mpirun.sh -n 3 /work/venv/bin/python \\
        examples/python/hf_transformers.py

The recipe:
  1. AttentionInterface.register("dattn", fn) and attn_implementation "dattn" in the config.
     transformers calls fn(module, query, key, value, attention_mask, scaling=, dropout=, ...)
     with bhsd tensors after RoPE (key and value with the KV heads, not repeated); fn returns
     (output in bshd, None). For an implementation it has no mask function for, transformers
     builds no mask (attention_mask is None): dattn applies the causal mask on global positions.
  2. Each rank feeds the tokens of its zigzag shard, input_ids[:, pos] with
     position_ids = pos (dattn.layout_positions("zigzag", S)), so RoPE rotates by global position.
  3. Labels come from the global sequence before sharding (the token after each one; -100 for
     the last), so a shard boundary shifts nothing. The loss is the sum over ranks of the summed
     per-token losses divided by the global token count (dattn.allreduce_sum); each rank's
     backward gives its share of every gradient, and their sum (all-reduced) is the full
     gradient, as dattn's backward routes each query's gradient to the rank holding its keys.

Asserted, rank 0 against the single process (float32 both): |loss - loss_ref| / |loss_ref| and,
for each parameter, max |g - g_ref| / max |g_ref| at most TOLERANCE. Exits 77 (skipped) when
torch or transformers is missing, 1 on a mismatch; an error on any rank aborts the job.
"""

import argparse
import sys

try:
    import torch
    import transformers
    from transformers import AttentionInterface, LlamaConfig, LlamaForCausalLM
except ImportError as e:  # before dattn: MPI is not started yet, so a plain exit is clean
    print(f"hf_transformers: SKIPPED: {e} (needs torch and transformers, e.g. a PyPI venv)")
    sys.exit(77)

import dattn
from example_main import run, verdict

TOLERANCE = 1e-5  # relative, float32 dattn over the ranks vs float32 eager in one process
LAYOUT = "zigzag"


# ---------------------------------------------------------------- the attention function

def dattn_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                    **kwargs):
    """transformers' attention interface over dattn: query [B, H, n, D], key and value
    [B, H_kv, n, D] of this rank's tokens (bhsd) -> (out [B, n, H, D] in query's dtype, None)."""
    if attention_mask is not None:
        raise ValueError("dattn_attention: an attention_mask is not supported (padding: use "
                         "cu_seqlens documents instead); the causal mask is dattn's")
    if dropout != 0.0:
        raise ValueError(f"dattn_attention: dropout = {dropout}: expected 0")
    if kwargs.get("sliding_window") is not None:
        raise ValueError("dattn_attention: sliding_window is not supported by this recipe")
    out = dattn.attention(query.transpose(1, 2).contiguous(), key.transpose(1, 2).contiguous(),
                          value.transpose(1, 2).contiguous(), causal=module.is_causal,
                          softmax_scale=scaling, layout=LAYOUT, strategy="ring")
    return out.to(query.dtype), None


AttentionInterface.register("dattn", dattn_attention)


# ---------------------------------------------------------------- model and data

def make_model(args, attn_implementation):
    """The same small Llama on every rank and for both runs (seeded initialisation)."""
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                         intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                         max_position_embeddings=args.seq, attention_dropout=0.0,
                         tie_word_embeddings=False, use_cache=False)
    config._attn_implementation = attn_implementation
    torch.manual_seed(0)
    return LlamaForCausalLM(config).train()


def make_data(args):
    """input_ids [B, S] and the labels of the global sequence (next token, -100 at the end)."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
    labels = torch.cat([ids[:, 1:], torch.full((args.batch, 1), -100)], dim=1)
    return ids, labels


def summed_token_loss(logits, labels):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             labels.reshape(-1), ignore_index=-100,
                                             reduction="sum")


def run_distributed(args):
    """The global loss and the all-reduced gradients, each rank feeding its zigzag shard."""
    model = make_model(args, "dattn")
    ids, labels = make_data(args)
    pos = torch.from_numpy(dattn.layout_positions(LAYOUT, args.seq))
    tokens = args.batch * (args.seq - 1)  # labelled tokens of the global batch
    logits = model(input_ids=ids[:, pos], position_ids=pos[None].expand(args.batch, -1)).logits
    local = summed_token_loss(logits, labels[:, pos]) / tokens
    local.backward()
    loss = dattn.allreduce_sum(local.item())
    grads = {name: dattn.allreduce_sum(p.grad) for name, p in model.named_parameters()}
    return loss, grads, model


def run_reference(args, state):
    """The same model over the whole sequence in one process, transformers' eager attention."""
    model = make_model(args, "eager")
    model.load_state_dict(state)
    ids, labels = make_data(args)
    logits = model(input_ids=ids).logits
    loss = summed_token_loss(logits, labels) / (args.batch * (args.seq - 1))
    loss.backward()
    return loss.item(), {name: p.grad for name, p in model.named_parameters()}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-s", "--seq", type=int, default=64, help="global sequence length (64)")
    p.add_argument("-b", "--batch", type=int, default=2, help="batch (2)")
    p.add_argument("--hidden", type=int, default=64, help="hidden size (64)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (2)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (4)")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads, GQA (2)")
    p.add_argument("--vocab", type=int, default=128, help="vocabulary size (128)")
    args = p.parse_args()
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()

    rank, P = dattn.rank(), dattn.world_size()
    loss, grads, model = run_distributed(args)
    ok = True
    if rank == 0:
        ref_loss, ref_grads = run_reference(args, model.state_dict())
        rel_loss = abs(loss - ref_loss) / abs(ref_loss)
        rel_grads = {name: float((grads[name].double() - g.double()).abs().max()
                                 / g.abs().max().clamp_min(1e-30))
                     for name, g in ref_grads.items()}
        worst_name = max(rel_grads, key=rel_grads.get)
        ok = rel_loss <= TOLERANCE and rel_grads[worst_name] <= TOLERANCE
        n_params = sum(t.numel() for t in ref_grads.values())
        print(f"hf_transformers: transformers {transformers.__version__}, LlamaForCausalLM "
              f"({args.layers} layers, hidden {args.hidden}, heads {args.heads}/{args.kv_heads}, "
              f"{n_params} parameters), B={args.batch} S={args.seq}, attention 'dattn' over {P} "
              f"ranks ({LAYOUT}, ring) vs 'eager' in one process, float32")
        print(f"  loss {loss:.9f} vs {ref_loss:.9f}: relative difference {rel_loss:.2e}")
        print(f"  gradients of {len(rel_grads)} parameters: worst max|diff| / max|ref| "
              f"{rel_grads[worst_name]:.2e} ({worst_name})")
        print(f"  tolerance {TOLERANCE:.0e}: {'OK' if ok else 'FAILED'}")
    return verdict(ok)  # every rank exits with rank 0's verdict


if __name__ == "__main__":
    run(main, "hf_transformers")
