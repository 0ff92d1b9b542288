#!/usr/bin/env python3
"""A small decoder-only language model in plain torch (token embedding, pre-norm blocks of RoPE
GQA attention and a gated MLP, LM head) trained for a few AdamW steps with its sequence
zigzag-sharded over the MPI ranks, attention by dattn.attention(causal=True, layout="zigzag").
Rank 0 then trains the same model in one process over the whole sequence in float64 with torch's
attention and checks every step's loss.

    PYTHONPATH=build/python bash launch/mpirun.sh -n 4 /work/venv/bin/python \\
        examples/python/train_zigzag.py

The training loop, on every rank with the same weights (fixed seed) and the same batch:
  pos = dattn.layout_positions("zigzag", S)              the global positions this rank holds
  logits = model(ids[:, pos], positions=pos)             RoPE by global position; token-wise
                                                         layers on the local tokens only
  local = cross_entropy(logits, labels[:, pos], reduction="sum") / (B * (S - 1))
  local.backward(); p.grad = dattn.allreduce_sum(p.grad); optimizer.step()
Labels are the next token of the global sequence (-100 for the last), taken before sharding. The
loss of a step is the sum of the ranks' `local`. Each rank's backward gives its share of every
gradient (dattn's backward sends each query's gradient to the rank holding its keys), so the
all-reduced gradients are the full ones and every rank takes the same optimizer step.

Asserted on rank 0: |loss - loss_ref| / loss_ref <= TOLERANCE at every step (float32 over the
ranks vs float64 in one process), and the loss goes down. The reference attention is torch's
scaled_dot_product_attention where torch has it (>= 2.0), else plain softmax attention (Debian's
torch 1.13, where dattn.attention is a torch.autograd.Function instead of a custom operator).
Exits 1 on a mismatch; an error on any rank aborts the job.
"""

import argparse
import sys

try:
    import torch
    import torch.nn.functional as F
except ImportError as e:  # before dattn: MPI is not started yet, so a plain exit is clean
    print(f"train_zigzag: SKIPPED: {e} (needs torch)")
    sys.exit(77)

import dattn
from example_main import compare_losses, run, verdict

TOLERANCE = 1e-5  # relative, per step: float32 over the ranks vs float64 in one process


# ---------------------------------------------------------------- the model

class RMSNorm(torch.nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


def rope(x, positions, base=10000.0):
    """Rotary position embedding of x [B, n, H, D] at global positions [n] (rotate-half form)."""
    D = x.shape[-1]
    inv_freq = 1.0 / base ** (torch.arange(0, D, 2, dtype=x.dtype) / D)
    angles = positions.to(x.dtype)[:, None] * inv_freq[None, :]          # [n, D/2]
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)[None, :, None]  # [1, n, 1, D]
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1)[None, :, None]
    x1, x2 = x[..., : D // 2], x[..., D // 2:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class Block(torch.nn.Module):
    """Pre-norm decoder block: x + attention(norm(x)), then x + MLP(norm(x))."""

    def __init__(self, E, H, Hkv, D):
        super().__init__()
        self.H, self.Hkv, self.D = H, Hkv, D
        self.attn_norm = RMSNorm(E)
        self.wq = torch.nn.Linear(E, H * D, bias=False)
        self.wk = torch.nn.Linear(E, Hkv * D, bias=False)
        self.wv = torch.nn.Linear(E, Hkv * D, bias=False)
        self.wo = torch.nn.Linear(H * D, E, bias=False)
        self.mlp_norm = RMSNorm(E)
        self.gate = torch.nn.Linear(E, 2 * E, bias=False)
        self.up = torch.nn.Linear(E, 2 * E, bias=False)
        self.down = torch.nn.Linear(2 * E, E, bias=False)

    def forward(self, x, positions, attend):
        B, n, _ = x.shape
        h = self.attn_norm(x)
        q = rope(self.wq(h).view(B, n, self.H, self.D), positions)
        k = rope(self.wk(h).view(B, n, self.Hkv, self.D), positions)
        v = self.wv(h).view(B, n, self.Hkv, self.D)
        x = x + self.wo(attend(q, k, v).reshape(B, n, self.H * self.D))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Decoder(torch.nn.Module):
    """Token ids [B, n] at global positions [n] -> logits [B, n, V]; `attend` is causal
    attention on bshd tensors (dattn over the ranks' shards, or torch over the whole sequence)."""

    def __init__(self, V, E, layers, H, Hkv, D, attend):
        super().__init__()
        self.attend = attend
        self.embed = torch.nn.Embedding(V, E)
        self.blocks = torch.nn.ModuleList(Block(E, H, Hkv, D) for _ in range(layers))
        self.norm = RMSNorm(E)
        self.head = torch.nn.Linear(E, V, bias=False)

    def forward(self, ids, positions):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, positions, self.attend)
        return self.head(self.norm(x))


def dattn_attention(q, k, v):
    return dattn.attention(q.contiguous(), k.contiguous(), v.contiguous(), causal=True,
                           layout="zigzag", strategy="ring")


def torch_attention(q, k, v):
    """Causal attention of the whole sequence, bshd, GQA by repeating the K/V heads."""
    g = q.shape[2] // k.shape[2]
    q, k, v = (t.transpose(1, 2) for t in (q, k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)))
    if hasattr(F, "scaled_dot_product_attention"):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        S = q.shape[2]
        s = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
        s = s.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
        out = torch.softmax(s, dim=-1) @ v
    return out.transpose(1, 2)


# ---------------------------------------------------------------- data and training

def make_batch(args):
    """The training batch, the same on every rank and at every step (the model learns it by
    heart, so the loss falls): ids [B, S] and labels [B, S], the next token of the global
    sequence and -100 after the last."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
    return ids, torch.cat([ids[:, 1:], torch.full((args.batch, 1), -100)], dim=1)


def make_model(args, attend):
    torch.manual_seed(0)
    return Decoder(args.vocab, args.embed, args.layers, args.heads, args.kv_heads, args.head_dim,
                   attend)


def summed_token_loss(logits, labels):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           ignore_index=-100, reduction="sum")


def optimizer(args, model):
    return torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)


def train_distributed(args, model):
    """AdamW steps with the sequence zigzag-sharded over the ranks; returns each step's loss."""
    pos = torch.from_numpy(dattn.layout_positions("zigzag", args.seq))
    tokens = args.batch * (args.seq - 1)
    ids, labels = make_batch(args)
    opt = optimizer(args, model)
    losses = []
    for _ in range(args.steps):
        opt.zero_grad(set_to_none=True)
        local = summed_token_loss(model(ids[:, pos], pos), labels[:, pos]) / tokens
        local.backward()
        for p in model.parameters():
            p.grad = dattn.allreduce_sum(p.grad)
        opt.step()
        losses.append(dattn.allreduce_sum(local.item()))
    return losses


def train_reference(args, model):
    """The same steps in one process over the whole sequence (the model in float64)."""
    positions = torch.arange(args.seq)
    ids, labels = make_batch(args)
    opt = optimizer(args, model)
    losses = []
    for _ in range(args.steps):
        opt.zero_grad(set_to_none=True)
        loss = summed_token_loss(model(ids, positions), labels) / (args.batch * (args.seq - 1))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-s", "--seq", type=int, default=90, help="global sequence length (90)")
    p.add_argument("-b", "--batch", type=int, default=2, help="batch (2)")
    p.add_argument("-e", "--embed", type=int, default=64, help="model width (64)")
    p.add_argument("-l", "--layers", type=int, default=3, help="decoder blocks (3)")
    p.add_argument("--heads", type=int, default=4, help="query heads (4)")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads, GQA (2)")
    p.add_argument("-d", "--head-dim", type=int, default=16, help="head dimension (16)")
    p.add_argument("-V", "--vocab", type=int, default=96, help="vocabulary size (96)")
    p.add_argument("-n", "--steps", type=int, default=5, help="AdamW steps (5)")
    p.add_argument("--lr", type=float, default=1e-2, help="learning rate (1e-2)")
    args = p.parse_args()
    torch.set_num_threads(1)

    rank, P = dattn.rank(), dattn.world_size()
    model = make_model(args, dattn_attention)
    reference = make_model(args, torch_attention).double()
    reference.load_state_dict(model.state_dict())  # the same initial weights, in float64
    losses = train_distributed(args, model)
    ok = True
    if rank == 0:
        ref = train_reference(args, reference)
        n_params = sum(t.numel() for t in model.parameters())
        print(f"train_zigzag: decoder of {args.layers} blocks ({n_params} parameters), "
              f"S={args.seq} B={args.batch} E={args.embed} heads={args.heads}/{args.kv_heads} "
              f"head_dim={args.head_dim} vocab={args.vocab}, sequence zigzag-sharded over {P} "
              f"ranks (dattn ring, float32) vs one process (torch, float64), AdamW lr={args.lr}")
        ok = compare_losses(losses, ref, TOLERANCE)
    return verdict(ok)  # every rank exits with rank 0's verdict


if __name__ == "__main__":
    run(main, "train_zigzag")
