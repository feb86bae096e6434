"""The model's configuration from the command line's arguments (train.py and
the planner build the same GPTConfig from the same flags)."""
from __future__ import annotations

from model import GPTConfig


def model_config(args, vocab_size: int, seed: int) -> GPTConfig:
    return GPTConfig(init_seed=seed,
        vocab_size=vocab_size, num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, ffn_hidden_size=args.ffn_hidden_size,
        max_position_embeddings=args.max_position_embeddings, hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout, init_method_std=args.init_method_std,
        layernorm_epsilon=args.layernorm_epsilon,
        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
        checkpoint_activations=args.checkpoint_activations,
        recompute_attention=args.recompute_granularity == "selective")
