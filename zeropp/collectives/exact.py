"""The two collectives ZeRO is made of, each in one place:

- `ShardGather`: all-gather of parameter chunks (one bucket per collective).
- `ShardReduce`: reduce-scatter of gradient rows (sum; member j keeps row j).

ZeRO++ swaps them (a quantized all-gather, a hierarchical quantized
reduction) without touching the engines. Around them:

- `gather_bucketed`: synchronous, bucketed all-gather of many shards (stage
  1/2 weight publication, stage 3's persistent weights, state dicts).
- `GradientReducer`: gradients copied into preallocated bucket buffers the
  moment autograd produces them; buckets fixed before the first step, in the
  same order on every rank, launched strictly in that order (asynchronously
  with overlap_comm) so ranks never disagree on a collective; a parameter that
  got no gradient on some rank contributes zeros.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from parallel.comm import Work
from zeropp.collectives.buffer_pool import BufferPool
from zeropp.collectives.partition import Partition, ShardedParam, bucketize, fill_rows, gradient_buckets
from zeropp.collectives.protocols import PlannedCollective


class ShardGather:
    """All-gather: `inp` [total] is this member's chunks laid end to end; the
    result is [N, total], row j from member j. Also callable in the shape of FSDP2's
    `AllGather` comm (torch.distributed.fsdp, `FSDPModule.set_custom_all_gather`):
    `allocate(size, dtype=, device=)` and `__call__(output, input, group, async_op)`."""

    delivers_rows = False   # True: `start` also takes out=deliver(j, row) (qwZ)
    phase = "other"         # what a call in FSDP2's shape is counted under (parallel/comm.py)

    def __init__(self, comm):
        self.comm = comm

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, async_op: bool = False):
        """Flat `output_tensor` = every member's `input_tensor`, member order."""
        n = output_tensor.numel() // input_tensor.numel()
        work = self.start(input_tensor, Partition(group, n, -1), self.phase, async_op,
                          out=output_tensor.view(n, input_tensor.numel()))
        return _returned(work, async_op)

    def bytes_per_element(self, elem_bytes: int, members: int) -> float:
        """Pool bytes per gathered element while in flight: the [N, total] rows and the input."""
        return elem_bytes * (1 + 1 / members)

    def plan(self, phase: str, total: int, elem_bytes: int, members: int) -> list[PlannedCollective]:
        return [PlannedCollective(phase, "all_gather", "world", total * elem_bytes)]

    def start(self, inp: torch.Tensor, partition: Partition, phase: str, async_op: bool = True,
              out: torch.Tensor | None = None, plain: bool = True, pool: BufferPool | None = None):
        """`out`: where the [N, total] result goes (default: a new tensor).
        `plain=False`: this gather stands in for another, which the caller
        charges as the plain equivalent (parallel/comm.py). `pool`: where a
        gather takes its transient buffers (none here; qwZ's wire buffers)."""
        if out is None:
            out = torch.empty(partition.size, inp.numel(), dtype=inp.dtype, device=inp.device)
        if partition.size == 1:
            out[0].copy_(inp)
            return Work(result=out)
        work = self.comm.all_gather(out.view(-1), inp, group=partition.group, async_op=async_op,
                                    phase=phase, plain=plain)
        return Work(work, out)


class ShardReduce:
    """Reduce-scatter: `rows` [N, total] summed over members, row j to member j
    (into `out` [total]). NCCL: its own ring reduce-scatter. gloo runs
    `reduce_scatter_tensor` as a full all-reduce (twice the ring's bytes), so
    there the rows go by `all_to_all_sum`: each member sends what a ring sends,
    (N-1) rows of `total`. Also callable in the shape of FSDP2's `ReduceScatter` comm
    (`FSDPModule.set_custom_reduce_scatter`), with `op` SUM or AVG."""

    phase = "other"

    def __init__(self, comm, by_all_to_all: bool | None = None):
        """`by_all_to_all`: None, as the process group's backend says (gloo: True); the planner
        says which backend it plans for."""
        self.comm = comm
        self.by_all_to_all = (dist.is_initialized() and dist.get_backend() == "gloo") if by_all_to_all is None \
            else by_all_to_all

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group, op=ReduceOp.SUM,
                 async_op: bool = False):
        """Flat `input_tensor` = N chunks; chunk j summed (or averaged) over members into member j's
        `output_tensor`."""
        if op not in (ReduceOp.SUM, ReduceOp.AVG):
            raise ValueError(f"{type(self).__name__} sums (or averages); got reduce op {op}")
        n = input_tensor.numel() // output_tensor.numel()
        work = self.start(input_tensor.view(n, output_tensor.numel()), output_tensor, Partition(group, n, -1),
                          self.phase, async_op)
        if op == ReduceOp.AVG:
            work = Work(work, then=lambda: output_tensor.div_(n))
        return _returned(work, async_op)

    def inflight_bytes(self, bucket_elems: int, elem_bytes: int = 4) -> int:
        """Pooled bytes of a bucket's reduction while in flight, besides the bucket's
        own rows and result (none here: on gloo the all-to-all's buffers are the
        transport's staging, as its reduce_scatter_tensor's were); `elem_bytes`: the
        communication dtype's."""
        return 0

    def expect(self, bucket_totals: dict[int, int], topology, device):
        """The gradient buckets to come (index -> sum of chunks): a reduction that keeps state
        per bucket lays it out here."""

    def plan(self, total: int, elem_bytes: int) -> list[PlannedCollective]:
        """A reduce-scatter (on gloo sent as the all-to-all of its rows, charged as the ring's bytes)."""
        return [PlannedCollective("grad_reduce", "reduce_scatter", "world", total * elem_bytes,
                                  sent_as="all_to_all" if self.by_all_to_all else "")]

    def carried_parts(self) -> dict:
        """The state this reduction carries from step to step, by scalar-state key (none here)."""
        return {}

    def start(self, rows: torch.Tensor, out: torch.Tensor, partition: Partition, phase: str,
              async_op: bool = True, pool: BufferPool | None = None, key: int = 0):
        """`pool`: where a reduction takes its transient buffers (none here). `key`: which
        bucket (a reduction that keeps state per bucket, qgZ's error feedback, needs it)."""
        if partition.size == 1:
            out.copy_(rows[0])
            return Work(result=out)
        if self.by_all_to_all:
            return all_to_all_sum(self.comm, rows, out, partition.group, phase, async_op,
                                  charge_as="reduce_scatter")
        work = self.comm.reduce_scatter(out, rows.view(-1), group=partition.group, async_op=async_op,
                                        phase=phase)
        return Work(work, out)


def _returned(work: Work, async_op: bool) -> Work | None:
    """FSDP2's comm contract: the handle when asynchronous, else done on return (None)."""
    if async_op:
        return work
    work.wait()
    return None


def all_to_all_sum(comm, rows: torch.Tensor, out: torch.Tensor, group, phase: str, async_op: bool,
                   pool: BufferPool | None = None, plain: bool = True, charge_as: str = "all_to_all") -> Work:
    """Reduce-scatter by an all-to-all plus a local sum: row j of `rows` [n, m] (its
    members' order) goes to member j, which sums the n rows it receives, in order,
    into `out` (m elements, any float dtype; accumulated in fp32 when `out` is
    16-bit). A ring's bytes, (n-1) m per member, without a 16-bit sum on the wire.
    Buffers from `pool`, else fresh (the transport's staging). `plain` / `charge_as`:
    how the communicator charges it (parallel/comm.py)."""
    take = pool.take if pool is not None else (lambda numel, dtype: torch.empty(numel, dtype=dtype,
                                                                                  device=rows.device))
    n = rows.shape[0]
    recv = take(rows.numel(), rows.dtype).view(n, -1)
    work = comm.all_to_all(recv.view(-1), rows.reshape(-1), group=group, async_op=async_op, phase=phase,
                           plain=plain, charge_as=charge_as)

    def finish():
        flat = out.view(-1)
        acc = flat if flat.dtype == torch.float32 else take(flat.numel(), torch.float32)
        acc.copy_(recv[0])
        for part in recv[1:]:
            acc.add_(part)   # (torch.sum(dtype=float32) of 16-bit rows is several times slower on CPU)
        if acc is not flat:
            flat.copy_(acc)
        if pool is not None:
            pool.give(recv.view(-1))
            if acc is not flat:
                pool.give(acc)
        return out
    return Work(work, then=finish)


def gather_bucketed(gather: ShardGather, shards: list[ShardedParam], chunk_of, consume,
                    partition: Partition, dtype: torch.dtype, device, bucket_elems: int, phase: str):
    """All-gather whole parameters bucket by bucket: `chunk_of(s)` is this
    member's valid slice (any dtype), `consume(s, full_flat)` receives the
    parameter's `numel` elements (a view into the bucket's buffer)."""
    for bucket in bucketize(list(shards), lambda s: s.chunk * partition.size, bucket_elems):
        inp = torch.zeros(sum(s.chunk for s in bucket), dtype=dtype, device=device)
        off = 0
        for s in bucket:
            if s.valid:
                inp[off:off + s.valid].copy_(chunk_of(s))
            off += s.chunk
        rows = gather.start(inp, partition, phase, async_op=False).wait()
        off = 0
        for s in bucket:
            consume(s, rows[:, off:off + s.chunk].reshape(-1)[:s.numel])
            off += s.chunk


MAX_INFLIGHT = 2   # GradientReducer's reductions in flight with overlap_comm


def reducer_buffers_bound(totals: list[int], members: int, elem_bytes: int, overlap: bool,
                          inflight_bytes=lambda elems, elem_bytes: 0) -> int:
    """The most bytes GradientReducer's pool holds, from its buckets' `totals` (sum of chunks,
    so capped by the model): the bucket being filled plus those in flight (MAX_INFLIGHT with
    overlap_comm), the largest ones, each its [N, total] rows and [total] result in the
    communication dtype and the reduction's own buffers (`ShardReduce.inflight_bytes`)."""
    per = sorted((t * (members + 1) * elem_bytes + inflight_bytes(t * members, elem_bytes) for t in totals),
                 reverse=True)
    return int(sum(per[:(MAX_INFLIGHT if overlap else 0) + 1]))


class _Bucket:
    def __init__(self, index: int, shards: list[ShardedParam]):
        self.index = index
        self.shards = shards
        self.total = sum(s.chunk for s in shards)
        self.offset = {}
        off = 0
        for s in shards:
            self.offset[s.index] = off
            off += s.chunk
        self.filled: set[int] = set()
        self.rows: torch.Tensor | None = None
        self.borrowed = False   # rows is the gradient tensor itself, not a pooled buffer
        self.out: torch.Tensor | None = None
        self.work = None


class GradientReducer:
    """Static gradient buckets, reduce-scattered into each shard's fp32 `grad`.

    `shards` are every parameter's, in parameter order (`shards[i].index == i`);
    buckets follow zeropp.stages.schedule.gradient_buckets (reverse parameter order, as
    backward usually produces gradients); that order only affects overlap, never
    correctness. A bucket is launched once all its gradients are in and every
    earlier bucket has been launched; `finish()` launches the rest (zeros for
    gradients that never came) and accumulates the results. With `overlap`,
    at most MAX_INFLIGHT buckets are in flight while backward goes on, and
    each gradient that comes in lets the in-flight reductions progress (qgZ
    starts its second hop as soon as the first is done, in bucket order).
    Bucket buffers, and the reduction's own (qgZ's), come from `pool`.

    Scaling (DeepSpeed's semantics): gradients are multiplied by `pre` before
    the sum and the reduced shard by `post` (pre * post = 1 / N).
    """

    def __init__(self, reduce: ShardReduce, shards: list[ShardedParam], partition: Partition,
                 bucket_elems: int, comm_dtype: torch.dtype, device, overlap: bool,
                 pre: float, post: float):
        self.reduce = reduce
        self.partition = partition
        self.comm_dtype = comm_dtype
        self.device = device
        self.overlap = overlap
        self.pre, self.post = pre, post
        buckets = gradient_buckets([s.chunk for s in shards], partition.size, bucket_elems)
        self.buckets = [_Bucket(k, [shards[i] for i in b]) for k, b in enumerate(buckets)]
        self.bucket_of = {s.index: b for b in self.buckets for s in b.shards}
        self.next_launch = 0
        self.inflight: list[_Bucket] = []
        self.pool = BufferPool(device)

    # -- buffers ------------------------------------------------------------------
    def _take(self, numel: int) -> torch.Tensor:
        return self.pool.take(numel, self.comm_dtype)

    def _give(self, buf: torch.Tensor):
        self.pool.give(buf)

    # -- the backward side ------------------------------------------------------
    def add(self, s: ShardedParam, grad: torch.Tensor):
        """Take this micro-step's full gradient of `s` (the caller drops it)."""
        b = self.bucket_of[s.index]
        if s.index in b.filled:
            raise RuntimeError(f"{s.name}: a second gradient in one backward (reentrant backward "
                               f"or a parameter used by two graphs) is not supported")
        n = self.partition.size
        if (len(b.shards) == 1 and s.numel == s.chunk * n and grad.dtype == self.comm_dtype
                and grad.is_contiguous()):
            # A bucket of one unpadded gradient: reduce from the gradient itself, no copy.
            b.rows, b.borrowed = grad.view(n, s.chunk), True
            if self.pre != 1.0:
                b.rows.mul_(self.pre)
            b.filled.add(s.index)
            self._launch_ready()
            self._progress()
            return
        if b.rows is None:
            b.rows = self._take(n * b.total).view(n, b.total)
        off = b.offset[s.index]
        cols = b.rows[:, off:off + s.chunk]
        fill_rows(cols, grad.reshape(-1), s.chunk)
        if self.pre != 1.0:
            cols.mul_(self.pre)
        b.filled.add(s.index)
        self._launch_ready()
        self._progress()

    def _progress(self):
        """Let the reductions in flight advance, oldest first, without waiting."""
        for b in self.inflight:
            if not b.work.progress():
                return

    def _launch_ready(self):
        while self.next_launch < len(self.buckets):
            b = self.buckets[self.next_launch]
            if len(b.filled) < len(b.shards):
                return
            self._launch(b)

    def _launch(self, b: _Bucket):
        if b.rows is None:  # no gradient at all on this rank
            b.rows = self._take(self.partition.size * b.total).view(self.partition.size, b.total)
            b.rows.zero_()
        else:
            for s in b.shards:
                if s.index not in b.filled:
                    off = b.offset[s.index]
                    b.rows[:, off:off + s.chunk].zero_()
        b.out = self._take(b.total)
        b.work = self.reduce.start(b.rows, b.out, self.partition, "grad_reduce", async_op=self.overlap,
                                   pool=self.pool, key=b.index)
        self.next_launch += 1
        self.inflight.append(b)
        while len(self.inflight) > (MAX_INFLIGHT if self.overlap else 0):
            self._complete(self.inflight.pop(0))

    def _complete(self, b: _Bucket):
        out = b.work.wait()
        for s in b.shards:
            if s.valid:
                off = b.offset[s.index]
                s.grad.add_(out[off:off + s.valid], alpha=self.post)
        if not b.borrowed:
            self._give(b.rows.view(-1))
        self._give(b.out)
        b.rows = b.out = b.work = None
        b.borrowed = False
        b.filled = set()

    def buffers_bound(self) -> int:
        """The most bytes `pool` holds (reducer_buffers_bound over this reducer's buckets)."""
        return reducer_buffers_bound([b.total for b in self.buckets], self.partition.size,
                                     torch.finfo(self.comm_dtype).bits // 8, self.overlap, self.reduce.inflight_bytes)

    def missing(self) -> list[ShardedParam]:
        """Shards whose gradient has not come in this backward (before finish())."""
        return [s for b in self.buckets[self.next_launch:] for s in b.shards if s.index not in b.filled]

    def finish(self):
        """End of backward: launch what is left in bucket order, wait for all."""
        while self.next_launch < len(self.buckets):
            self._launch(self.buckets[self.next_launch])
        while self.inflight:
            self._complete(self.inflight.pop(0))
        self.next_launch = 0
