"""Counting at the torch.distributed API, for systems whose collectives do not go
through our Communicator (FSDP2, DeepSpeed) and as a cross-check of it: every
collective call and the bytes it puts on the wire, charged with the same ring
model as parallel/comm.py (wire_bytes): all-gather / reduce-scatter (n-1) x S,
all-reduce 2 (n-1) S / n, broadcast S except the last of the chain, all-to-all
(n-1) S / n. Also the seconds spent inside each outermost call (a synchronous
collective: the time blocked in it). `COUNTER.install()` wraps torch.distributed's
functions (before DeepSpeed binds them)."""
from __future__ import annotations

import threading
import time

import torch.distributed as dist

_OP_OF = {"all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather",
          "_all_gather_base": "all_gather", "all_gather": "all_gather",
          "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_single": "reduce_scatter",
          "_reduce_scatter_base": "reduce_scatter", "reduce_scatter": "reduce_scatter",
          "all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce", "broadcast": "broadcast",
          "all_to_all_single": "all_to_all"}


class DistCounter:
    def __init__(self):
        self.enabled = False
        # node of a global rank; everything on one node unless a multi-node harness sets it
        # (bench/slow_link/__init__.py: lambda r: r // ranks_per_node)
        self.node_of = lambda r: 0
        self._local = threading.local()
        self._orig = {}
        self.reset()

    def reset(self):
        self.bytes = 0
        self.inter_bytes = 0   # the part of `bytes` charged to links that leave the node
        self.calls = 0
        self.by_op: dict[str, int] = {}        # torch.distributed function -> bytes
        self.calls_by_op: dict[str, int] = {}  # torch.distributed function -> calls
        self.seconds_by_op: dict[str, float] = {}  # torch.distributed function -> seconds inside it

    @staticmethod
    def _nb(t):
        return t.numel() * t.element_size()

    def _charge(self, name, group, nbytes, src=None):
        from parallel.comm import wire_bytes
        ranks = list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
        if len(ranks) <= 1:
            return  # a group of one issues no collective (as our Communicator counts)
        intra, inter = wire_bytes(_OP_OF[name], ranks, dist.get_rank(), nbytes, self.node_of, src=src)
        self.bytes += intra + inter
        self.inter_bytes += inter
        self.calls += 1
        self.by_op[name] = self.by_op.get(name, 0) + intra + inter
        self.calls_by_op[name] = self.calls_by_op.get(name, 0) + 1

    def _cost(self, name, args, kw):
        """(group, S, src) of one call; S as parallel.comm.wire_bytes defines it."""
        def arg(i, key):
            return args[i] if len(args) > i else kw.get(key)
        group_pos = {"reduce_scatter_tensor": 3, "reduce_scatter_single": 3, "_reduce_scatter_base": 3,
                     "reduce_scatter": 3, "all_to_all_single": 4}.get(name, 2)
        group = arg(group_pos, "group")
        if name in ("all_gather_into_tensor", "all_gather_single", "_all_gather_base"):
            inp = arg(1, "input_tensor")
            return group, self._nb(inp if inp is not None else arg(1, "input")), None
        if name == "all_gather":
            return group, self._nb(arg(1, "tensor")), None
        if name.startswith("reduce_scatter") or name == "_reduce_scatter_base":
            return group, self._nb(arg(0, "output")), None
        if name == "all_reduce":
            return group, self._nb(arg(0, "tensor")), None
        if name == "all_reduce_coalesced":
            return group, sum(self._nb(t) for t in arg(0, "tensors")), None
        if name == "broadcast":
            src = arg(1, "src")
            if src is None and kw.get("group_src") is not None:
                src = dist.get_global_rank(group, kw["group_src"]) if group is not None else kw["group_src"]
            return group, self._nb(arg(0, "tensor")), src
        if name == "all_to_all_single":
            return group, self._nb(arg(1, "input")), None
        return group, 0, None

    def install(self):
        for name in _OP_OF:
            fn = getattr(dist, name, None)
            if fn is None or name in self._orig:
                continue
            self._orig[name] = fn
            setattr(dist, name, self._wrap(name, fn))

    def _wrap(self, name, fn):
        counter = self

        def wrapped(*args, **kw):
            depth = getattr(counter._local, "depth", 0)
            if counter.enabled and depth == 0:  # only the outermost call: wrappers calling wrappers
                try:
                    counter._charge(name, *counter._cost(name, args, kw))
                except Exception:  # never let accounting break the run
                    pass
            counter._local.depth = depth + 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                counter._local.depth = depth
                if counter.enabled and depth == 0:
                    counter.seconds_by_op[name] = counter.seconds_by_op.get(name, 0.0) + time.perf_counter() - t0
        wrapped.__wrapped__ = fn
        return wrapped


COUNTER = DistCounter()
