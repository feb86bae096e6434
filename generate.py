"""Generate text from a saved checkpoint.

    python generate.py --load runs/demo/checkpoints --prompt "In the beginning" --max-new-tokens 100
"""
from __future__ import annotations

import argparse

import torch

from data.tokenizer import build_tokenizer
from model import GPT, GPTConfig
from tools.export_checkpoint import consolidated_state_dict
from training.checkpoint_files import CheckpointError


def load_model(load_dir: str):
    sd, meta = consolidated_state_dict(load_dir)
    cfg = GPTConfig(**meta["model_config"])
    with torch.device("meta"):
        model = GPT(cfg)
    model.load_state_dict(sd, assign=True)
    tokenizer = build_tokenizer(meta["tokenizer_type"], tokenizer_model=meta["tokenizer_model"],
                                vocab_file=meta["vocab_file"], merge_file=meta["merge_file"])
    return model.eval(), tokenizer, meta


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


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--load", required=True, help="the --save directory of a training run")
    p.add_argument("--prompt", default="In the beginning")
    p.add_argument("--max-new-tokens", type=int, default=100)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args()
    torch.manual_seed(args.seed)
    try:
        model, tokenizer, meta = load_model(args.load)
    except CheckpointError as e:
        p.error(str(e))
    ids = generate(model, tokenizer.tokenize(args.prompt), args.max_new_tokens, args.temperature,
                   args.top_k, tokenizer.vocab_size)
    print(f"[checkpoint iteration {meta['iteration']}]")
    print(tokenizer.detokenize(ids))


if __name__ == "__main__":
    main()
