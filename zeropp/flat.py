"""What the sharded stages (1, 2, 3) share: the partition layout, the fp32
master shards and their optimizer, bucketed gradient reduce-scatter and
bucketed all-gather of shards.

Partition layout (the same for all three stages, DeepSpeed stage 3's): every
parameter is flattened and padded to a multiple of the group size N; with
chunk c = ceil(numel / N), rank r owns elements [r*c, (r+1)*c) of it. The
*valid* part of that range (clipped to numel) is what the rank's fp32 master,
Adam state and gradient partition hold; the padding only exists inside
communication buffers (and, for stage 3, in the 16-bit shard buffer, whose
slices must all be c long to be all-gathered).

Because every parameter is split at the same fractions, any set of
parameters can be reduce-scattered in one collective: the bucket buffer is an
[N, sum c] matrix whose row j holds chunk j of each parameter, and a
reduce_scatter_tensor hands row j (summed over ranks) to rank j.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from zeropp.engine import Engine, compute_dtype


class ParamShard:
    """One parameter's place in the partition."""

    def __init__(self, index: int, param: nn.Parameter, world: int, rank: int):
        self.index = index
        self.param = param
        self.shape = param.shape
        self.numel = n = param.numel()
        self.chunk = c = max(1, -(-n // world))
        self.lo, self.hi = min(rank * c, n), min((rank + 1) * c, n)
        self.valid = self.hi - self.lo
        self.decay = param.ndim >= 2          # same rule as engine.split_decay
        self.master: torch.Tensor | None = None     # fp32, `valid` elements
        self.grad_view: torch.Tensor | None = None  # compute dtype, `valid` elements
        self.persistent = True                # stage 3 turns this off for partitioned params

    def fill_rows(self, rows: torch.Tensor, flat: torch.Tensor):
        """Write the full flat tensor `flat` (numel elements) into `rows` [N, c],
        chunk j into row j, zero padding at the end."""
        c, n = self.chunk, self.numel
        full = n // c
        if full:
            rows[:full].copy_(flat[:full * c].view(full, c))
        rest = n - full * c
        if rest:
            rows[full, :rest].copy_(flat[full * c:])
            rows[full, rest:].zero_()
            full += 1
        if full < rows.shape[0]:
            rows[full:].zero_()


class GradReducer:
    """Buckets full-size gradients and reduce-scatters them (averaged over the
    group) into each shard's `grad_view`, which accumulates across micro-steps.
    With `overlap`, a bucket's reduce-scatter runs asynchronously while
    backward goes on; one bucket is in flight at a time."""

    def __init__(self, engine: "ShardedEngineBase", bucket_elems: int, overlap: bool):
        self.engine = engine
        self.bucket_elems = bucket_elems
        self.overlap = overlap
        self.pending: list[tuple[ParamShard, torch.Tensor]] = []
        self.pending_elems = 0
        self.inflight = None

    def add(self, shard: ParamShard, grad: torch.Tensor):
        self.pending.append((shard, grad))
        self.pending_elems += shard.chunk * self.engine.world
        if self.pending_elems >= self.bucket_elems:
            self.flush()

    def flush(self):
        """Launch the pending bucket (waits for the previous one first)."""
        self.finish()
        if not self.pending:
            return
        eng = self.engine
        items, self.pending, self.pending_elems = self.pending, [], 0
        total = sum(s.chunk for s, _ in items)
        dtype = items[0][1].dtype
        buf = torch.empty(eng.world, total, dtype=dtype, device=eng.device)
        off = 0
        for s, g in items:
            s.fill_rows(buf[:, off:off + s.chunk], g.reshape(-1))
            off += s.chunk
        if eng.world > 1:
            buf.div_(eng.world)
        out = torch.empty(total, dtype=dtype, device=eng.device)
        work = eng.comm.reduce_scatter(out, buf.view(-1), group=eng.group, async_op=self.overlap,
                                       tag="reduce_scatter_grads")
        self.inflight = (work, out, [s for s, _ in items], buf)
        if not self.overlap:
            self.finish()

    def finish(self):
        if self.inflight is None:
            return
        work, out, shards, _ = self.inflight
        self.inflight = None
        work.wait()
        off = 0
        for s in shards:
            if s.valid:
                s.grad_view.add_(out[off:off + s.valid].to(s.grad_view.dtype))
            off += s.chunk

    def drain(self):
        self.flush()
        self.finish()


class ShardedEngineBase(Engine):
    """fp32 master weights, Adam state and the gradient partition sharded over
    the data-parallel group; subclasses decide where the 16-bit weights live
    and when gradients are reduced."""

    def __init__(self, module, config, comm, device, optim, gradient_accumulation_steps=1):
        module = module.to(device=device, dtype=compute_dtype(config))
        super().__init__(module, config, comm, device, optim, gradient_accumulation_steps)
        self.zero = config.zero_optimization
        self.group = None  # the whole world is the data-parallel group
        self.world = comm.topology.world_size
        self.rank = comm.topology.rank
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.shards = [ParamShard(i, p, self.world, self.rank) for i, p in enumerate(self.params)]
        self.shard_of = {id(p): s for p, s in zip(self.params, self.shards)}
        self.reducer = GradReducer(self, self.zero.reduce_bucket_size, self.zero.overlap)
        self.grad_flat: torch.Tensor | None = None

    # -- setup helpers ------------------------------------------------------
    def _build_masters(self, source):
        """`source(shard)` -> this rank's valid slice of the weight in compute
        dtype. In fp32 that slice *is* the master (no extra copy, K = 8);
        in 16-bit one flat fp32 buffer holds all master slices."""
        if self.dtype == torch.float32:
            for s in self.shards:
                s.master = source(s)
        else:
            self.master_flat = torch.empty(sum(s.valid for s in self.shards), dtype=torch.float32,
                                           device=self.device)
            off = 0
            for s in self.shards:
                s.master = self.master_flat[off:off + s.valid]
                s.master.copy_(source(s))
                off += s.valid
        owned = [s for s in self.shards if s.valid]
        self.optimizer = self._make_optimizer([s.master for s in owned if s.decay],
                                              [s.master for s in owned if not s.decay])

    def _alloc_grad_partition(self):
        self.grad_flat = torch.zeros(sum(s.valid for s in self.shards), dtype=self.dtype,
                                     device=self.device)
        off = 0
        for s in self.shards:
            s.grad_view = self.grad_flat[off:off + s.valid]
            off += s.valid

    # -- collectives over shards ----------------------------------------------
    def gather_shards(self, shards, chunk_of, dtype, consume, tag):
        """Bucketed all-gather: `chunk_of(s)` is this rank's valid slice (any
        dtype); `consume(s, full_flat)` receives the whole flat tensor."""
        limit = self.zero.allgather_bucket_size
        bucket, elems = [], 0
        for s in list(shards) + [None]:
            if s is not None:
                bucket.append(s)
                elems += s.chunk * self.world
                if elems < limit:
                    continue
            if not bucket:
                break
            total = sum(b.chunk for b in bucket)
            inp = torch.zeros(total, dtype=dtype, device=self.device)
            off = 0
            for b in bucket:
                if b.valid:
                    inp[off:off + b.valid].copy_(chunk_of(b))
                off += b.chunk
            out = torch.empty(self.world * total, dtype=dtype, device=self.device)
            self.comm.all_gather(out, inp, group=self.group, tag=tag)
            rows = out.view(self.world, total)
            off = 0
            for b in bucket:
                consume(b, rows[:, off:off + b.chunk].reshape(-1)[:b.numel])
                off += b.chunk
            bucket, elems = [], 0

    # -- Engine hooks -----------------------------------------------------------
    def _grad_norm_sq(self) -> float:
        local = (self.grad_flat.float().pow(2).sum() if self.grad_flat.numel()
                 else torch.zeros((), device=self.device))
        t = local.to(torch.float64).reshape(1)
        self.comm.all_reduce(t, group=self.group, tag="grad_norm")  # SUM: inf/nan reach every rank
        return t.item()

    def _apply_update(self, coef: float):
        for s in self.shards:
            if s.valid:
                s.master.grad = s.grad_view.float().mul(coef)
        self.optimizer.step()
        for s in self.shards:
            s.master.grad = None
        self._publish_weights()

    def _publish_weights(self):
        raise NotImplementedError

    # -- checkpoint state --------------------------------------------------------
    def module_state_dict(self) -> dict:
        """Full fp32 weights on every rank (collective)."""
        full = {}
        self.gather_shards(self.shards, lambda s: s.master, torch.float32,
                           lambda s, t: full.__setitem__(s.index, t.view(s.shape).clone()),
                           tag="state_dict_gather")
        out = {}
        for k, v in self.module.state_dict(keep_vars=True).items():
            s = self.shard_of.get(id(v))
            out[k] = full[s.index] if s is not None else v.detach().cpu().clone()
        return out

    def load_module_state_dict(self, sd: dict):
        """Full fp32 (or any float) weights, keys as module.state_dict(); every
        rank passes the whole dict and keeps its slices (no communication)."""
        named = dict(self.module.named_parameters(remove_duplicate=False))
        by_id = {id(p): sd[k] for k, p in named.items() if k in sd}
        missing = [k for k, p in named.items() if id(p) not in by_id]
        if missing:
            raise KeyError(f"load_module_state_dict: missing keys {missing}")
        with torch.no_grad():
            for s in self.shards:
                full = by_id[id(s.param)].reshape(-1).to(device=self.device, dtype=torch.float32)
                if full.numel() != s.numel:
                    raise ValueError(f"load_module_state_dict: {s.numel} elements expected, "
                                     f"got {full.numel()} (shape {tuple(s.shape)})")
                s.master.copy_(full[s.lo:s.hi])
                self._load_weight(s, full)
            for n, b in self.module.named_buffers():
                if n in sd:
                    b.copy_(sd[n])

    def _load_weight(self, shard: ParamShard, full_fp32: torch.Tensor):
        raise NotImplementedError

    def optimizer_state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "loss_scaler": self.loss_scaler.state_dict(),
                "global_step": self.global_step, "rank": self.rank, "world_size": self.world}

    def load_optimizer_state_dict(self, sd: dict):
        if sd.get("world_size", self.world) != self.world:
            raise ValueError(f"optimizer shard saved with {sd['world_size']} ranks, loading on "
                             f"{self.world}: ZeRO shards are per rank")
        self.optimizer.load_state_dict(sd["optimizer"])
        self.loss_scaler.load_state_dict(sd["loss_scaler"])
        self.global_step = sd["global_step"]

    def _optimizer_tensors(self) -> list[torch.Tensor]:
        opt = [t for st in self.optimizer.state.values() for t in st.values() if torch.is_tensor(t)]
        return opt + [s.master for s in self.shards if s.valid]
