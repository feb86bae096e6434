"""Checkpoints that are never half-written.

Layout (one directory per saved iteration, Megatron's tracker file on top):

    SAVE/latest_checkpointed_iteration.txt     "100"
    SAVE/iter_0000100/meta.json                iteration, consumed samples, world size, config
    SAVE/iter_0000100/model.pt                 full fp32 weights (module.state_dict() keys)
    SAVE/iter_0000100/rank_00003.pt            rank 3's optimizer shard, loss scaler, RNG states

Every rank writes into `iter_0000100.tmp`; after a barrier rank 0 renames the
directory and only then rewrites the tracker (write + fsync + os.replace). A
crash, kill or full disk at any point leaves the previous checkpoint as the
latest one; a stale `.tmp` directory is removed by the next save.
"""
from __future__ import annotations

import json
import os
import random
import shutil

import numpy as np
import torch
import torch.distributed as dist

TRACKER = "latest_checkpointed_iteration.txt"


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def _fsynced_save(obj, path: str):
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict):
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(save_dir: str, iteration: int, engine, consumed_train_samples: int, meta: dict):
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    final = os.path.join(save_dir, f"iter_{iteration:07d}")
    tmp = final + ".tmp"
    if rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    model_state = engine.module_state_dict()  # collective under stage 3
    if rank == 0:
        _fsynced_save(model_state, os.path.join(tmp, "model.pt"))
    _fsynced_save({"engine": engine.optimizer_state_dict(), "rng": _rng_state()},
                  os.path.join(tmp, f"rank_{rank:05d}.pt"))
    _barrier()
    if rank == 0:
        info = dict(meta, iteration=iteration, consumed_train_samples=consumed_train_samples,
                    world_size=world)
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(info, f, indent=2, default=str)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        tracker_tmp = os.path.join(save_dir, TRACKER + ".tmp")
        with open(tracker_tmp, "w") as f:
            f.write(str(iteration))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tracker_tmp, os.path.join(save_dir, TRACKER))
    _barrier()


def load_checkpoint(load_dir: str, engine, load_optim: bool = True, load_rng: bool = True) -> dict | None:
    """Restore the latest checkpoint in `load_dir`; returns its meta (None if there is none)."""
    tracker = os.path.join(load_dir, TRACKER)
    if not os.path.exists(tracker):
        return None
    with open(tracker) as f:
        text = f.read().strip()
    if not text.isdigit():
        raise ValueError(f"--load {load_dir}: {tracker} should hold an iteration number, got {text!r}")
    path = os.path.join(load_dir, f"iter_{int(text):07d}")
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    engine.load_module_state_dict(torch.load(os.path.join(path, "model.pt"), map_location="cpu"))
    if load_optim or load_rng:
        if meta["world_size"] != world:
            raise ValueError(
                f"--load {path} was saved by {meta['world_size']} ranks and this job has {world}: "
                f"optimizer shards cannot be re-partitioned yet; resume with {meta['world_size']} "
                f"ranks, or pass --no-load-optim --no-load-rng to start a new optimizer from the weights")
        shard = torch.load(os.path.join(path, f"rank_{rank:05d}.pt"), map_location="cpu", weights_only=False)
        if load_optim:
            engine.load_optimizer_state_dict(shard["engine"])
        if load_rng:
            _set_rng_state(shard["rng"])
    return meta
