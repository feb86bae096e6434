"""GPT-2: learned positions, pre-LayerNorm blocks, tied input/output embedding.

One file, plain PyTorch, nothing about parallelism or sharding: the ZeRO
engine wraps this module from the outside.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass
class GPTConfig:
    vocab_size: int = 50257          # tokenizer's size; padded below for efficient matmuls
    num_layers: int = 12
    hidden_size: int = 768
    num_attention_heads: int = 12
    max_position_embeddings: int = 1024
    ffn_hidden_size: int | None = None   # default 4 * hidden_size
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    layernorm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    init_seed: int = 1234            # with a weight's name, seeds its initial values
    make_vocab_size_divisible_by: int = 128
    checkpoint_activations: bool = False  # recompute each block in backward
    # Megatron's selective recompute: only the attention core (softmax, dropout) is recomputed
    recompute_attention: bool = False

    def __post_init__(self):
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"--num-attention-heads {self.num_attention_heads} must divide "
                f"--hidden-size {self.hidden_size}")
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size

    @property
    def padded_vocab_size(self) -> int:
        m = self.make_vocab_size_divisible_by
        return ((self.vocab_size + m - 1) // m) * m


class SelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.num_attention_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.dropout = cfg.attention_dropout
        self.recompute = cfg.recompute_attention

    def core(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                              dropout_p=self.dropout if self.training else 0.0)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        if self.recompute and self.training and torch.is_grad_enabled():
            y = checkpoint(self.core, q, k, v, use_reentrant=False)  # restores the RNG: same dropout mask
        else:
            y = self.core(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, s, h))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size)
        self.proj = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)
        self.attn = SelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)
        self.mlp = MLP(cfg)
        self.drop = nn.Dropout(cfg.hidden_dropout)

    def forward(self, x):
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.padded_vocab_size, cfg.hidden_size)
        self.wpe = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.drop = nn.Dropout(cfg.hidden_dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden_size, eps=cfg.layernorm_epsilon)
        if not self.wte.weight.is_meta:  # on "meta" the engine initializes each weight later
            self.reset_parameters()

    def reset_parameters(self):
        for name, p in self.named_parameters():
            self.init_parameter(name, p.data)

    @torch.no_grad()
    def init_parameter(self, name: str, tensor: torch.Tensor):
        """GPT-2 init of the parameter called `name`: N(0, 0.02), output
        projections of the residual branches scaled by 1/sqrt(2 * layers), zero
        biases, unit norms. The random values come from a generator seeded by
        (init_seed, name) alone, so a weight gets the same values whatever the
        world size and whether the model is built whole or shard by shard on
        the meta device (the sharding engine calls this one weight at a time)."""
        std = self.config.init_method_std
        if name.endswith("bias"):
            tensor.zero_()
        elif ".ln" in name or name.startswith("ln_f"):
            tensor.fill_(1.0)
        else:
            if name.endswith("proj.weight"):
                std = std / math.sqrt(2 * self.config.num_layers)
            digest = hashlib.sha256(f"{self.config.init_seed}:{name}".encode()).digest()
            g = torch.Generator(device=tensor.device).manual_seed(int.from_bytes(digest[:8], "little"))
            tensor.normal_(0.0, std, generator=g)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None):
        """Returns the mean cross-entropy if `labels` are given, else the logits."""
        s = input_ids.shape[1]
        if s > self.config.max_position_embeddings:
            raise ValueError(f"sequence length {s} exceeds --max-position-embeddings "
                             f"{self.config.max_position_embeddings}")
        pos = torch.arange(s, device=input_ids.device)
        x = self.drop(self.wte(input_ids) + self.wpe(pos))
        for block in self.blocks:
            if self.config.checkpoint_activations and self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        x = self.ln_f(x)
        logits = F.linear(x, self.wte.weight)  # output layer tied to the input embedding
        if labels is None:
            return logits
        # Loss in fp32: 16-bit softmax over a large vocabulary loses precision.
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))


def num_parameters(cfg: GPTConfig) -> int:
    """Closed form, counting the tied embedding once (GPT-2 124M config -> 124,475,904
    with the vocab padded to 50304)."""
    h, f, L = cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_layers
    per_layer = 2 * 2 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h)
    embeddings = cfg.padded_vocab_size * h + cfg.max_position_embeddings * h
    return embeddings + L * per_layer + 2 * h


def flops_per_iteration(cfg: GPTConfig, batch_size: int, seq_length: int, recompute: bool) -> float:
    """Megatron's estimate: 72 B s L h^2 (1 + s/(6h) + V/(12 L h)) without recomputation,
    96 B s L h^2 (1 + s/(6h) + V/(16 L h)) with full recomputation (one extra forward)."""
    B, s, L, h, V = batch_size, seq_length, cfg.num_layers, cfg.hidden_size, cfg.padded_vocab_size
    if recompute:
        return 96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    return 72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h))
