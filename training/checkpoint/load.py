"""Loading a checkpoint (collective), on any number of ranks and any ZeRO stage: every file verified
first (split over the ranks), the model checked against the one saved, each rank reading the parts
of the DCP files that overlap its new slices; what the checkpoint lacks or this run resets said in
one line each."""
from __future__ import annotations

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from common import ConfigError
from parallel.startup import print_rank0, rank
from training.checkpoint.files import CheckpointError, iteration_of, read_meta, resolve_checkpoint, verify_on_all_ranks
from training.checkpoint.state import engine_device, set_rng_state, single_process_quiet
from zeropp.collectives.partition import as_dcp
from zeropp.outer.diloco import GLOBAL

# GPTConfig fields that must match to load weights (dropout, recomputation may change)
ARCHITECTURE = ("vocab_size", "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                "max_position_embeddings", "make_vocab_size_divisible_by")


def load_checkpoint(load: str, engine, load_optim: bool = True, load_rng: bool = True,
                    model_config: dict | None = None) -> dict | None:
    """Restore the checkpoint `load` names into `engine`, on any world size and
    ZeRO stage (collective). Returns its meta (and "loaded_from": the checkpoint's
    directory), or None if there is none yet."""
    this_rank = rank()
    path = resolve_checkpoint(load)
    if path is None:
        return None
    print_rank0(f"> loading checkpoint from {load} at iteration {iteration_of(path)}")   # Megatron's line
    verify_on_all_ranks(path)   # every file, meta.json included, before anything is read from them
    meta = read_meta(path)
    if model_config is not None:
        diff = [f"{k} {meta['model_config'].get(k)} (checkpoint) vs {model_config[k]} (now)"
                for k in ARCHITECTURE if meta["model_config"].get(k) != model_config[k]]
        if diff:
            raise ConfigError(f"--load {path} holds a different model: {'; '.join(diff)}; "
                              f"pass the model flags it was trained with")

    if load_optim and meta.get("optimizer_saved") is False:
        load_optim = False
        print_rank0(f"> {path} was saved without its optimizer state (--no-save-optim): a new optimizer starts")
    topology = engine.comm.topology
    groups, saved_groups = topology.groups, meta.get("groups", 1)
    grouped = saved_groups == groups > 1   # each group's own state end to end (zeropp/outer/diloco.py)
    # Saved by another number of groups: start from the global parameters they shared, optimizers anew.
    regroup = saved_groups > 1 and saved_groups != groups
    scalars = meta["engine"]   # a group's own (loss scale, skipped steps, ...) where it saved them
    if grouped and len(meta.get("engine_groups", [])) == groups:
        scalars = meta["engine_groups"][topology.offset // topology.world_size]
    state = engine.checkpoint_state(for_load=True, optimizer=load_optim and not regroup)
    for key in engine.uncarried_state(scalars) if load_optim and not regroup else []:
        del state[key]   # saved in another layout (or not at all): reset, and load_scalar_state says so
    if regroup:
        state = {GLOBAL + k[len("model."):] if k.startswith("model.") and v.sharded else k: v
                 for k, v in state.items()}
    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    for key, entry in state.items():
        if key not in stored:
            what = ("optimizer state of another optimizer type; pass --no-load-optim to start a new optimizer"
                    if key.startswith("optim.") else "this model's parameter; check the model flags")
            raise CheckpointError(f"--load {path} has no {key}: {what}")
        if stored[key].size.numel() != entry.numel * (groups if grouped and entry.sharded and entry.per_group else 1):
            raise CheckpointError(f"--load {path}: {key} has {stored[key].size.numel()} elements there and "
                                  f"{entry.numel} in this model; pass the model flags it was trained with")
    with single_process_quiet():
        dcp.load(as_dcp(state, engine_device(state), None if grouped else topology.world_group,
                        topology if grouped else None), storage_reader=dcp.FileSystemReader(path),
                 no_dist=not dist.is_initialized())
    engine.checkpoint_loaded(state)
    if regroup and this_rank == 0:
        print(f"> {path} was saved by {saved_groups} groups of nodes and this run has {groups}: it starts from "
              f"the global parameters they shared; the optimizer state (inner and outer) starts anew; every group "
              f"takes group 0's loss scale, hysteresis and skipped-step count (its learning rate)", flush=True)
    if load_optim:
        for note in engine.load_scalar_state(scalars):
            if this_rank == 0:
                print(f"> {path}: {note}", flush=True)
    if load_rng:
        if not meta["rng"]:
            print_rank0(f"> {path} was saved without random-number states (--no-save-rng): fresh ones")
        elif this_rank < len(meta["rng"]):
            set_rng_state(meta["rng"][this_rank])
        elif this_rank == len(meta["rng"]):
            print(f"> {path} was saved by {len(meta['rng'])} ranks: ranks from {len(meta['rng'])} on "
                  f"keep their fresh RNG states", flush=True)
    return dict(meta, loaded_from=path)
