"""What stages 1-3 shard besides the weights: each parameter's fp32 master slice, its fp32
gradient partition (filled by the `GradientReducer`) and the optimizer over the masters.

One flat buffer each, a view per shard (zeropp/collectives/partition.py's layout). In fp32
training the master is this rank's slice of the weight itself (no copy). The optimizer steps
one gradient bucket's masters at a time (`step`): torch's foreach implementations allocate
temporaries the size of what one call steps, so the scratch is a bucket's share, not the
shard's.
"""
from __future__ import annotations

import torch

from zeropp.collectives.partition import ShardedParam


class Masters:
    """The fp32 masters, the fp32 gradient partition and the optimizer of one rank."""

    def __init__(self, shards: list[ShardedParam], dtype: torch.dtype, device):
        self.shards = shards
        n = sum(s.valid for s in shards)
        self.grad_flat = torch.zeros(n, dtype=torch.float32, device=device)
        self.flat = torch.empty(n, dtype=torch.float32, device=device) if dtype != torch.float32 else None
        off = 0
        for s in shards:
            s.grad = self.grad_flat[off:off + s.valid]
            if self.flat is not None:
                s.master = self.flat[off:off + s.valid]
            off += s.valid
        self.optimizer = None
        self.scratch_peak = 0   # the optimizer step's temporaries (step)

    @property
    def owned(self) -> list[ShardedParam]:
        return [s for s in self.shards if s.valid]

    def adopt(self, s: ShardedParam, full_fp32: torch.Tensor, weight_slice: torch.Tensor):
        """At construction, the values of `s` (flat fp32, whole): my slice into the master, or in
        fp32 training the master becomes `weight_slice`, my slice of the weight itself."""
        if self.flat is None:
            s.master = weight_slice
        else:
            s.master.copy_(full_fp32[s.lo:s.hi])

    def load(self, s: ShardedParam, full_fp32: torch.Tensor):
        """New values of `s` from outside: my slice into the master (fp32: the master is the weight,
        already set by the store)."""
        if self.flat is not None:
            s.master.copy_(full_fp32[s.lo:s.hi])

    def grad_norm_sq(self, comm, group) -> float:
        # vector_norm reduces without a temporary copy of the (large) partition
        t = torch.linalg.vector_norm(self.grad_flat).to(torch.float64).square().reshape(1)
        comm.all_reduce(t, group=group, phase="optimizer")  # inf/nan reach every rank
        return t.item()

    def step(self, coef: float, buckets, scratch_per_element: int):
        """Gradients x `coef` into the masters' .grad, one optimizer step per gradient bucket (each
        element updated by the same operations as in one call; the optimizer's state stays keyed
        by the same masters, so checkpoints are unchanged)."""
        for s in self.owned:
            s.master.grad = s.grad.mul_(coef)
        groups = self.optimizer.param_groups
        whole = [g["params"] for g in groups]
        member = [{id(p) for p in ps} for ps in whole]
        try:
            for b in buckets:
                masters = [s.master for s in b.shards if s.valid]
                parts = [[m for m in masters if id(m) in ids] for ids in member]
                if not any(parts):
                    continue
                for g, part in zip(groups, parts):
                    g["params"] = part
                self.optimizer.step()
                stepped = sum(m.numel() for m in masters)
                self.scratch_peak = max(self.scratch_peak, stepped * scratch_per_element)
        finally:
            for g, ps in zip(groups, whole):
                g["params"] = ps
        for s in self.shards:
            s.master.grad = None

    def scratch_bound(self, bucket_elems: int, world: int, scratch_per_element: int) -> int:
        """A bucket's share of this rank's elements (or its largest weight's), x bytes per element."""
        owned = sum(s.valid for s in self.shards)
        largest = max((s.valid for s in self.shards), default=0)
        share = -(-bucket_elems // world)
        return min(owned, max(share, largest)) * scratch_per_element
