"""Every rank calls `apply_zeropp` before its first collective, or the ranks that did say, within a
bounded time, which did not: a call on only some ranks would otherwise wait in the first
process group it makes, on every rank that called, with no word. Through the default process
group's key-value store (no collective; gloo's `monitored_barrier` names ranks only on rank 0
and not under NCCL)."""
from __future__ import annotations

import itertools
from datetime import timedelta

import torch.distributed as dist

from common.torch_private import default_store
from zeropp.fsdp.plugin import PluginError

_CALLS = itertools.count()   # this rank's calls so far: the n-th call of every rank meets under one key


def all_ranks_arrive(what: str, timeout_s: float):
    """Wait until every rank of the default group has called `what` (its n-th time on each); after
    `timeout_s` seconds raise one line naming the ranks that have not."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    store = dist.PrefixStore(f"zeropp/{what}/{next(_CALLS)}/", default_store())
    store.set(f"rank{rank}", b"1")
    if store.add("arrived", 1) == world:
        store.set("all", b"1")
    try:
        store.wait(["all"], timedelta(seconds=timeout_s))
    except dist.DistStoreError:
        absent = [r for r in range(world) if not store.check([f"rank{r}"])]
        raise PluginError(f"{what} is collective: ranks {', '.join(map(str, absent))} of {world} did not call it "
                          f"within {timeout_s:g} s of rank {rank}: call it on every rank") from None
