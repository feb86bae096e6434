"""What a checkpoint holds beside the sharded files, written by rank 0: the tokenizer's files, and
with DeepSpeed's `stage3_gather_16bit_weights_on_model_save` the whole model in 16 bits.

    SAVE/iter_0000100/tokenizer/tokenizer.model   the tokenizer training used (Megatron-LM's names:
                                                  tokenizer.model, or vocab.json and merges.txt)
    SAVE/iter_0000100/pytorch_model.bin           torch.save of the model's state dict in its compute
                                                  dtype, as DeepSpeed's save_16bit_model writes it

Both are written inside the checkpoint's `.tmp` directory and listed in its checksums.json, so
they appear with the checkpoint or not at all, and damage to them is found like damage to any
other file (training/checkpoint/files.py).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from zeropp.collectives.partition import FlatState
from zeropp.outer.diloco import GLOBAL

CONSOLIDATED_16BIT = "pytorch_model.bin"   # DeepSpeed's save_16bit_model default file name
# The tokenizer's files, copied into every checkpoint under Megatron-LM's names (its
# save_tokenizer_assets), so a checkpoint samples and exports wherever it is copied.
TOKENIZER_COPIES = {"tokenizer_model": "tokenizer/tokenizer.model", "vocab_file": "tokenizer/vocab.json",
                    "merge_file": "tokenizer/merges.txt"}


def tokenizer_files(tokenizer_model: str | None, vocab_file: str | None, merge_file: str | None) -> dict[str, bytes]:
    """The tokenizer files as they are now (read once, at start: the copies are what training used
    even if the originals change later), under their names in a checkpoint."""
    out = {}
    for key, path in (("tokenizer_model", tokenizer_model), ("vocab_file", vocab_file), ("merge_file", merge_file)):
        if path:
            with open(path, "rb") as f:
                out[TOKENIZER_COPIES[key]] = f.read()
    return out


def gather_16bit(state: dict[str, FlatState], shapes: dict[str, list[int]], dtype: torch.dtype,
                 topology) -> dict[str, torch.Tensor] | None:
    """The model's state dict in `dtype` on rank 0's CPU (None on the other ranks), gathered one
    parameter at a time (collective): besides the dict, rank 0 holds one parameter in `dtype` on
    its device, every other rank its own slice. With groups of nodes (--outer-sync-interval),
    group 0 gathers the global parameters they share, as the exporter takes them."""
    grouped = topology.groups > 1
    if grouped and topology.offset != 0:
        return None
    prefix, group = (GLOBAL, topology.world_group) if grouped else ("model.", None)
    distributed = dist.is_initialized() and dist.get_world_size(group) > 1
    writer = not distributed or dist.get_rank(group) == 0
    out = {} if writer else None
    for name, shape in shapes.items():
        entry = state[prefix + name]
        local = entry.local.detach()
        if distributed and entry.sharded:   # cast first: 16-bit slices cross the links
            world = dist.get_world_size(group)
            chunk = -(-entry.numel // world)
            mine = torch.zeros(chunk, dtype=dtype, device=local.device)
            mine[:local.numel()] = local
            flat = torch.empty(world * chunk, dtype=dtype, device=local.device) if writer else None
            dist.gather(mine, list(flat.split(chunk)) if writer else None, dst=topology.offset, group=group)
            local = flat[:entry.numel] if writer else None
        if writer:
            out[name] = local.to(dtype).view(shape).to("cpu", copy=True)
    return out


def write_rank0_files(directory: str, files: dict[str, bytes], state_dict: dict | None):
    """Rank 0's files of a checkpoint into its (temporary) directory, each fsynced."""
    for name, data in files.items():
        _write(os.path.join(directory, name), lambda f, data=data: f.write(data))
    if state_dict is not None:
        _write(os.path.join(directory, CONSOLIDATED_16BIT), lambda f: torch.save(state_dict, f))


def _write(path: str, fill):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        with open(path, "wb") as f:
            fill(f)
            f.flush()
            os.fsync(f.fileno())
    except RuntimeError as e:   # torch.save's own write errors (a full disk) are not OSErrors
        raise OSError(f"writing {path} failed: {str(e).splitlines()[0]}") from None


def rank0_file_names(files: dict[str, bytes], state_dict: dict | None) -> list[str]:
    return [*files, *([CONSOLIDATED_16BIT] if state_dict is not None else [])]
