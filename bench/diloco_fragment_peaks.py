"""Each rank's largest streaming-DiLoCo fragment (elements, and INT4 bytes on the wire per
exchange; 2 ranks a group, ZeRO-3): the earlier cut by runs of layers (its layer_fragments,
kept here) against the cut by bytes (zeropp/outer/fragments.py). The link passes one
fragment's exchange at a time, so the largest one decides how long it is busy.

    .venv/bin/python -m bench.diloco_fragment_peaks   # bench/results/diloco_fragment_peaks.json
"""
from __future__ import annotations

import json
import re

import torch

from bench import RESULTS
from model import GPTConfig
from planner.trace import shard_layout, trace_model
from zeropp.outer.fragments import fragment_bounds
from zeropp.kernels.format import wire_nbytes

_LAYER = re.compile(r"\.(\d+)\.")
MODELS = {   # the slow-link bench's own, the quickstart's (its default), bench/convergence.py's (kjv: 4096)
    "slow-link bench (4 layers, hidden 192, seq 16)": (dict(num_layers=4, hidden_size=192), 16),
    "quickstart (4 layers, hidden 256, seq 128)": (dict(num_layers=4, hidden_size=256), 128),
    "convergence (2 layers, hidden 128, seq 64)": (dict(num_layers=2, hidden_size=128), 64),
}


def layer_fragments(names: list[str], fragments: int) -> list[int]:
    """The earlier cut: layer i of n in fragment i F // n, the rest with the layer before it."""
    layers = [int(m.group(1)) if (m := _LAYER.search(n)) else None for n in names]
    n = len({i for i in layers if i is not None})
    out, current = [], 0
    for i in layers:
        current = current if i is None else i * fragments // n
        out.append(current)
    return out


def peaks(model: dict, seq: int, fragments: int, group_world: int = 2, threshold: int = 100_000) -> dict:
    cfg = GPTConfig(vocab_size=4096, num_attention_heads=4, max_position_embeddings=seq, **model)
    trace = trace_model(cfg, torch.float32, 1, seq, threshold)
    shards = shard_layout(trace, group_world, 0, 3, threshold, 1)   # rank 0's (every rank's is as large)
    by_layers = [0] * fragments
    for s, f in zip(shards, layer_fragments([s.name for s in shards], fragments)):
        by_layers[f] += s.valid
    b = fragment_bounds(sum(s.valid for s in shards), fragments)
    by_bytes = [y - x for x, y in zip(b, b[1:])]
    return {"fragments": fragments, "elements_by_layers": by_layers, "elements_by_bytes": by_bytes,
            "peak_int4_bytes_by_layers": wire_nbytes(max(by_layers), 4, 128),
            "peak_int4_bytes_by_bytes": wire_nbytes(max(by_bytes), 4, 128)}


def main():
    out = {name: [peaks(model, seq, F) for F in (2, 4)] for name, (model, seq) in MODELS.items()}
    path = RESULTS / "diloco_fragment_peaks.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    for name, rows in out.items():
        for r in rows:
            print(f"{name}, F = {r['fragments']}: largest exchange {r['peak_int4_bytes_by_layers'] / 1e3:.1f} kB "
                  f"(by layers) -> {r['peak_int4_bytes_by_bytes'] / 1e3:.1f} kB (by bytes) per rank")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
