#!/usr/bin/env python3
"""A tiny attention layer (Wq, Wk, Wv, Wo; GQA) trained for a few SGD steps on random data, its
attention distributed over the MPI ranks by dattn. Rank 0 then trains the same layer in one
process with plain float64 torch attention and checks that the losses agree.

    PYTHONPATH=build/python bash launch/mpirun.sh -n 3 /usr/bin/python3 examples/python/train_tiny.py

Every rank builds the same weights and data (fixed seeds) and takes its shard of the sequence
under a zigzag layout. Projections act token by token, so each rank applies them to its own
tokens; attention is collective. The loss is the mean squared error over the whole output: each
rank's share is summed over the ranks with dattn.allreduce_sum, and so are the weights' gradients
(the distributed backward already routes every query's gradient to the rank holding its keys, so
each rank's local chain rule gives its share of the full gradient). Exits 1 when the two runs'
losses differ by more than TOLERANCE (relative).
"""

import argparse

import torch

import dattn
from example_main import compare_losses, run, verdict

TOLERANCE = 1e-5  # relative, fp32 distributed run vs float64 single process


def init_weights(E, H, Hkv, D, dtype):
    """Wq [E, H*D], Wk and Wv [E, Hkv*D], Wo [H*D, E], the same on every rank."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(E, H * D), (E, Hkv * D), (E, Hkv * D), (H * D, E)]
    return [(torch.randn(*s, generator=gen, dtype=torch.float64) / s[0] ** 0.5).to(dtype)
            .requires_grad_() for s in shapes]


def make_data(B, S, E):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(B, S, E, generator=gen, dtype=torch.float64)
    y = torch.randn(B, S, E, generator=gen, dtype=torch.float64)
    return x, y


def layer(x, weights, H, Hkv, D, attend):
    """The attention layer on tokens x [B, n, E] with an attention function on bshd tensors."""
    Wq, Wk, Wv, Wo = weights
    B, n, _ = x.shape
    q = (x @ Wq).view(B, n, H, D)
    k = (x @ Wk).view(B, n, Hkv, D)
    v = (x @ Wv).view(B, n, Hkv, D)
    return attend(q, k, v).reshape(B, n, H * D) @ Wo


def torch_causal_attention(q, k, v):
    """Plain softmax attention (torch 1.13 has no scaled_dot_product_attention), GQA by repeating
    K/V heads, causal."""
    S, D = q.shape[1], q.shape[3]
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / D ** 0.5
    s = s.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1), v)


def train_distributed(args):
    """SGD with dattn ring attention over this rank's zigzag shard; returns the loss per step."""
    B, S, E, H, Hkv, D = args.batch, args.seq, args.embed, args.heads, args.kv_heads, args.head_dim
    x, y = make_data(B, S, E)
    pos = torch.from_numpy(dattn.layout_positions("zigzag", S))
    xs, ys = x[:, pos].float(), y[:, pos].float()
    weights = init_weights(E, H, Hkv, D, torch.float32)

    def attend(q, k, v):
        return dattn.attention(q.contiguous(), k.contiguous(), v.contiguous(), causal=True,
                               layout="zigzag", strategy="ring")

    losses = []
    for _ in range(args.steps):
        out = layer(xs, weights, H, Hkv, D, attend)
        local = ((out - ys) ** 2).sum() / (B * S * E)  # this rank's share of the mean
        local.backward()
        losses.append(dattn.allreduce_sum(local.item()))
        with torch.no_grad():
            for w in weights:
                w -= args.lr * dattn.allreduce_sum(w.grad)
                w.grad = None
    return losses


def train_reference(args):
    """The same training in one process, float64, plain torch attention."""
    B, S, E, H, Hkv, D = args.batch, args.seq, args.embed, args.heads, args.kv_heads, args.head_dim
    x, y = make_data(B, S, E)
    weights = init_weights(E, H, Hkv, D, torch.float64)
    losses = []
    for _ in range(args.steps):
        loss = ((layer(x, weights, H, Hkv, D, torch_causal_attention) - y) ** 2).mean()
        loss.backward()
        losses.append(loss.item())
        with torch.no_grad():
            for w in weights:
                w -= args.lr * w.grad
                w.grad = None
    return losses


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("-s", "--seq", type=int, default=96, help="global sequence length (96)")
    p.add_argument("-b", "--batch", type=int, default=2, help="batch (2)")
    p.add_argument("-e", "--embed", type=int, default=32, help="model width (32)")
    p.add_argument("--heads", type=int, default=4, help="query heads (4)")
    p.add_argument("--kv-heads", type=int, default=2, help="key/value heads, GQA (2)")
    p.add_argument("-d", "--head-dim", type=int, default=16, help="head dimension (16)")
    p.add_argument("-n", "--steps", type=int, default=8, help="SGD steps (8)")
    p.add_argument("--lr", type=float, default=0.5, help="learning rate (0.5)")
    args = p.parse_args()
    torch.set_num_threads(1)

    rank, P = dattn.rank(), dattn.world_size()
    losses = train_distributed(args)
    ok = True
    if rank == 0:
        ref = train_reference(args)
        print(f"train_tiny: S={args.seq} B={args.batch} E={args.embed} heads={args.heads}/"
              f"{args.kv_heads} head_dim={args.head_dim}, causal attention over {P} ranks "
              f"(zigzag, ring), SGD lr={args.lr}")
        ok = compare_losses(losses, ref, TOLERANCE)
    return verdict(ok)  # every rank exits with rank 0's verdict


if __name__ == "__main__":
    run(main, "train_tiny")
