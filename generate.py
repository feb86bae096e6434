"""Generate text from a saved checkpoint.

    python generate.py --load runs/demo/checkpoints --prompt "In the beginning" --max-new-tokens 100

A bad argument or a damaged checkpoint is one line `error: ...` and exit status 2.
"""
from __future__ import annotations

import argparse
import sys

import torch

from common import ConfigError, OneLineParser
from model import GPT, GPTConfig
from tools.export_checkpoint import (add_tokenizer_flags, checkpoint_tokenizer, model_tensors, open_checkpoint,
                                     tokenizer_overrides)
from training.checkpoint import CheckpointError
from training.flags import ranged, real, whole


def load_model(load_dir: str, tokenizer: dict | None = None):
    """The model, its tokenizer (the copy inside the checkpoint unless `tokenizer` names files) and meta."""
    path, meta = open_checkpoint(load_dir)
    tok = checkpoint_tokenizer(meta, path, **(tokenizer or {}))   # before the weights are read
    cfg = GPTConfig(**meta["model_config"])
    with torch.device("meta"):
        model = GPT(cfg)
    model.load_state_dict(dict(model_tensors(path, meta)), assign=True)
    return model.eval(), tok, meta


@torch.no_grad()
def generate(model: GPT, ids: list[int], max_new_tokens: int, temperature: float, top_k: int,
             vocab_size: int) -> list[int]:
    x = torch.tensor([ids])
    for _ in range(max_new_tokens):
        logits = model(x[:, -model.config.max_position_embeddings:])[0, -1, :vocab_size]
        logits = logits / max(temperature, 1e-5)
        if top_k:
            kth = torch.topk(logits, min(top_k, vocab_size)).values[-1]
            logits[logits < kth] = -float("inf")
        x = torch.cat([x, torch.multinomial(torch.softmax(logits, -1), 1)[None]], dim=1)
    return x[0].tolist()


def parse_args(argv=None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", required=True, help="the --save directory of a training run, or one of its iter_* "
                                                 "directories, wherever it was copied")
    add_tokenizer_flags(p)
    p.add_argument("--prompt", default="In the beginning")
    p.add_argument("--max-new-tokens", type=ranged(whole, ">= 0", lambda v: v >= 0), default=100)
    p.add_argument("--temperature", type=ranged(real, ">= 0 (0: the likeliest token)", lambda v: v >= 0),
                   default=0.8)
    p.add_argument("--top-k", type=ranged(whole, ">= 0 (0: no cut)", lambda v: v >= 0), default=40)
    p.add_argument("--seed", type=ranged(whole, "in [0, 2**63)", lambda v: 0 <= v < 2**63), default=1234)
    args = p.parse_args(argv)
    if not args.prompt.strip():
        raise ConfigError("--prompt is empty; give the text to continue")
    return args


def main(argv=None) -> int:
    try:
        args = parse_args(argv)
        torch.manual_seed(args.seed)
        model, tokenizer, meta = load_model(args.load, tokenizer_overrides(args))
    except (CheckpointError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    ids = generate(model, tokenizer.tokenize(args.prompt), args.max_new_tokens, args.temperature,
                   args.top_k, tokenizer.vocab_size)
    print(f"[checkpoint iteration {meta['iteration']}]")
    print(tokenizer.detokenize(ids))
    return 0


if __name__ == "__main__":
    sys.exit(main())
