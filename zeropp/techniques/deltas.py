"""INT4 (or INT2) weight deltas (`zero_quantized_weight_deltas`, needs hpZ): the
cross-node part of stage 3's forward gather carries only what changed since the
weights every node already holds.

With hpZ, each node keeps in its secondary partition (zeropp/techniques/hpz.py) the weights
of the last gather from the primary partition, spread over the node's ranks.
Each rank keeps `recon`: its own primary chunk as every rank reconstructed it
at that gather. After each optimizer step (`prepare`), each rank quantizes
delta = new chunk - recon to INT4 (blocks of 128 aligned to the chunk, one fp32
scale each: 0.53 bytes per element, against qwZ's 1.02 and bf16's 2), or with
`zero_quantized_weight_deltas_bits` 2 to INT2 (ternary, the same blocks: 0.28 bytes).
The next primary gather of a weight then
  1. all-gathers the deltas across nodes, among the ranks at my index in
     their hpZ group (one per node when h = ranks per node): each delta crosses
     to each other node once, (N-1) S bytes per rank, where a ring over the
     world sends N (W-1) S / W on average (S: one rank's deltas; ~2x for two nodes),
  2. all-gathers inside my hpZ group what each member received and its slice
     of the previous weights from the secondary partition (one collective),
  3. adds each dequantized delta (fp32) to the previous weights and rounds to
     the compute dtype.
Both hops have process groups of their own, and every rank starts second hops
in the order the gathers were issued (the same on every rank), so they never
interleave differently with other collectives of a group.
Every rank computes the same values, the sender included, and the arrival sets
`recon` to this rank's chunk of them: the next delta is taken against what the
receivers hold, so quantization errors never pile up.

Error bound. INT4 rounds each element to within half a step, step = max|delta|/7
over its block. A weight is sent as a delta only while, in every block, that
step is at most the INT8 step of its new values (max|w|/127, qwZ's), so a
gathered weight is within max|w|/254 of the exact one plus half an ulp of the
compute dtype (the rounding of the sum): qwZ's bound, whatever the history.
INT2 deltas (step = max|delta|/2, an error of up to a step: they clip) are held
to a step of max|w|/14: a gathered weight is within max|w|/14 of the exact one
plus half an ulp, the bound of INT4 weights. Every delta is taken against what the receivers
hold, so what one step did not send goes with the next (error feedback without
a buffer of its own; the convergence of every switch with INT2 deltas and INT2 gradients
against ZeRO-3 is in docs/results.md, "Convergence").

Refresh: a full gather (qwZ's INT8, or exact) instead of the delta, for a weight
  - without a base: its first gather, and every gather after a load (`forget`);
  - every `refresh_interval` optimizer steps (all weights);
  - whose delta is not small: in some block its step exceeds the step allowed
    above (BOUND_BITS, delta_codec.py), or is not finite. Each owner checks its chunk and one
    all-reduce (MAX) of a flag per weight after the step makes it agreed.
Evaluation gathers the exact weights; they arrive here like any full gather (`keep`), so they
are the next base, and the next training forward reads them from hpZ's copy (zeropp/techniques/hpz.py).

Carried state (ARCHITECTURE.md): `prepare` runs only after an applied step
(`end_step`); a skipped step leaves the deltas, `recon` and the count alone.
Checkpoints hold `recon` per weight (sharded as the masters are, so DCP reshards
it) and the step count and based weights; a load rebuilds the nodes' copies from
`recon` (one exact gather) and prepares the same deltas again, so a resume on the
same layout continues bit for bit. Saved without deltas, or in another dtype:
every weight's first gather after the load is a full one, and the load says so.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass

import torch

from common import ConfigError
from parallel.comm import Work
from zeropp.collectives.buffer_pool import BufferPool
from zeropp.collectives.exact import ShardGather, gather_bucketed
from zeropp.collectives.protocols import MemoryLine, PlannedCollective
from zeropp.collectives.two_hop import TwoHops
from zeropp.collectives.partition import FlatState
from zeropp.techniques import hpz
from zeropp.techniques.hpz import SecondaryPartition
from zeropp.techniques.technique import AUTO, Technique, check_bits, key
from zeropp.collectives.partition import Partition
from zeropp.kernels.quant import wire_nbytes
from zeropp.techniques import delta_codec
from zeropp.techniques.delta_codec import (BLOCK_SIZE, add_deltas, copy_previous, dequant_elements,
                                           small_delta)

KEY = "weight_deltas.recon."   # checkpoint keys: KEY + weight name
MEMORY_KEY = "weight_deltas_bytes"
LABEL = "weight deltas (recon + INT{}, 1/N)"   # its memory line in the plan
REFRESH_INTERVAL = 100   # optimizer steps between full gathers, by default


@dataclass
class Keys:
    """The weight deltas' keys in zero_optimization (they need hpZ)."""
    zero_quantized_weight_deltas: bool = key(False, flag="zero_quantized_weight_deltas")
    zero_quantized_weight_deltas_refresh_interval: int = REFRESH_INTERVAL
    zero_quantized_weight_deltas_bits: int = key(4, flag="zero_quantized_weight_deltas_bits")   # 4, or 2


def validate(zero, where: str):
    bits, key_, flag = (zero.zero_quantized_weight_deltas_bits, f"{where}.zero_quantized_weight_deltas_bits",
                        "--zero-quantized-weight-deltas-bits")
    check_bits(bits, key_, flag, "INT2 weight deltas across nodes")
    if bits == 2 and zero.zero_quantized_weight_deltas is not True:
        raise ConfigError(f"{key_} ({flag}) 2 sets the bits of the weight deltas: set zero_quantized_weight_deltas "
                          f"true (--zero-quantized-weight-deltas), got {zero.zero_quantized_weight_deltas!r}")
    refresh = zero.zero_quantized_weight_deltas_refresh_interval
    if zero.zero_quantized_weight_deltas is True:
        h = zero.zero_hpz_partition_size
        if h != AUTO and h <= 1:
            raise ConfigError(f"{where}.zero_quantized_weight_deltas (--zero-quantized-weight-deltas) sends "
                              f"weights as differences from the copy hpZ keeps in each node: set "
                              f"zero_hpz_partition_size (--zero-hpz-size) to the ranks per node")
    elif refresh != REFRESH_INTERVAL:
        raise ConfigError(f"{where}.zero_quantized_weight_deltas_refresh_interval has no effect without "
                          f"zero_quantized_weight_deltas (--zero-quantized-weight-deltas); remove it or turn "
                          f"the deltas on")
    if refresh < 1:
        raise ConfigError(f"{where}.zero_quantized_weight_deltas_refresh_interval must be >= 1 (optimizer "
                          f"steps between full gathers), got {refresh}")


def validate_topology(zero, ranks_per_node: int, world_size: int):
    """Deltas replace the gather from the primary partition; an hpZ group of the whole world
    (auto's only hpZ on one node) gathers everything from its secondary copy: nothing is sent."""
    h = zero.zero_hpz_partition_size
    if not zero.zero_quantized_weight_deltas:
        return
    if h != AUTO and h <= 1:   # auto picked no hpZ
        raise ConfigError("zero_quantized_weight_deltas (--zero-quantized-weight-deltas) needs hpZ, but "
                          "zero_hpz_partition_size is 1: set it (--zero-hpz-size) to the ranks per node")
    group = ranks_per_node if h == AUTO else h
    if zero.stage == 3 and not hpz.group_size(zero.stage, group, world_size):
        raise ConfigError(f"zero_quantized_weight_deltas (--zero-quantized-weight-deltas) does nothing here: "
                          f"hpZ's group ({group} ranks{', auto' if h == AUTO else ''}) is the whole world "
                          f"of {world_size}, so no weight crosses a node; drop it, or run on more than one node")


class WeightDeltas:
    """A weight source for `zeropp.stages.stage3.param.BucketGather` (the primary partition's
    weights, sent as INT4 or INT2 deltas: `bits`), and the state it needs: `recon`, the deltas
    prepared after each step, and which weights may go as deltas."""

    writes_weights = True   # BucketGather: start() writes the gathered values into the weights
    delivers_rows = False

    def __init__(self, partition: Partition, comm, weights: list, param_flat: torch.Tensor, secondary: SecondaryPartition,
                 refresh_interval: int, across: Partition, within: Partition, bits: int = 4):
        """`weights`: the partitioned Stage3Params, bound to `param_flat`. `across`: the ranks at my
        index in their hpZ groups (the first hop); `within`: my hpZ group (the second), groups
        of their own."""
        self.partition, self.comm, self.secondary, self.bits = partition, comm, secondary, bits
        self.across, self.within = across, within
        self.refresh_interval = refresh_interval
        self.weights = weights
        self.recon = torch.zeros_like(param_flat)
        self._recon: dict[int, torch.Tensor] = {}
        self._wire_bytes = {s.index: wire_nbytes(s.chunk, bits, BLOCK_SIZE) for s in weights}
        self.flat = torch.zeros(sum(self._wire_bytes.values()), dtype=torch.uint8, device=param_flat.device)
        self._wire: dict[int, torch.Tensor] = {}
        off = 0
        for s in weights:
            start = s.shard.data_ptr() - param_flat.data_ptr()
            self._recon[s.index] = self.recon[start // param_flat.element_size():][:s.chunk]
            self._wire[s.index] = self.flat[off:off + self._wire_bytes[s.index]]
            off += self._wire_bytes[s.index]
        self._based: set[int] = set()     # weights whose recon (and the nodes' copies) are a base
        self._refresh: set[int] = set()   # weights to gather in full this step
        self._queue: collections.deque[TwoHops] = collections.deque()   # second hops not started
        self.steps = 0
        self.arrivals = self.sent = 0     # weights gathered from the primary partition / as deltas

    # -- after the optimizer step, before the next gathers ---------------------------
    def end_step(self, applied: bool) -> str | None:
        """The optimizer step ended: after an applied one, the next deltas (a skipped one changed
        no weight, so the prepared deltas still hold)."""
        if applied:
            self.prepare()
        return None

    def prepare(self, advance: bool = True):
        """Quantize every based weight's delta; agree on which weights go in full (one
        all-reduce, one device-to-host copy). `advance`: count an optimizer step."""
        self.steps += int(advance)
        if not self.weights:   # every weight persistent: nothing is gathered
            return
        everything = self.steps % self.refresh_interval == 0
        full = torch.ones((), dtype=torch.bool, device=self.flat.device)
        flags = torch.stack([full if everything or s.index not in self._based
                             else ~small_delta(s.shard, self._recon[s.index], self._wire[s.index], self.bits)
                             for s in self.weights]).to(torch.int32)
        if not everything and self._based:
            self.comm.all_reduce(flags, op=torch.distributed.ReduceOp.MAX, phase="optimizer")
        self._refresh = {s.index for s, f in zip(self.weights, flags.tolist()) if f}

    def forget(self):
        """The weights were loaded: no base anywhere, every weight's next gather is full."""
        self._based.clear()
        self._refresh.clear()

    def holds(self, s) -> bool:
        """`s` can be gathered as a delta (the same answer on every rank)."""
        return s.index in self._based and s.index not in self._refresh

    def keep(self, s, full: torch.Tensor, exact: bool = False):
        """`s` arrived whole from the primary partition (in full, `exact` or not, or as a delta): the
        node keeps it as hpZ does, and my chunk of it is what the next delta is taken against."""
        self.secondary.keep(s, full, exact)
        self.arrivals += 1
        self._recon[s.index][:s.valid].copy_(full.view(-1)[s.lo:s.hi])
        self._based.add(s.index)

    # -- checkpoints -------------------------------------------------------------------
    def checkpoint_state(self, world: int) -> dict[str, FlatState]:
        """Each weight's reconstruction, this rank's chunk of it (the masters' layout)."""
        return {KEY + s.name: FlatState(self._recon[s.index][:s.valid], s.numel, sharded=True) for s in self.weights}

    def scalar_state(self) -> dict:
        return {"steps": self.steps, "dtype": str(self.recon.dtype),
                "based": sorted(s.name for s in self.weights if s.index in self._based)}

    def carried(self, saved: dict | None) -> bool:
        return bool(saved) and saved.get("dtype") == str(self.recon.dtype)

    def load_scalar_state(self, saved: dict | None) -> str | None:
        """After `recon` was loaded (if carried): the nodes' copies rebuilt from it and the deltas
        prepared again, as they were after the saved step; else say that gathers start in full."""
        if not self.carried(saved):
            self.forget()
            why = (f"saved in {saved.get('dtype')}, now {self.recon.dtype}" if saved
                   else "saved without zero_quantized_weight_deltas")
            return (f"INT{self.bits} weight deltas start without reference weights ({why}): each weight's first "
                    f"gather after the load is a full one")
        self.steps = saved["steps"]
        names = set(saved["based"])
        based = [s for s in self.weights if s.name in names]
        gather_bucketed(ShardGather(self.comm), based, lambda s: self._recon[s.index][:s.valid],
                        self.secondary.keep, self.partition, self.recon.dtype, self.recon.device,
                        delta_codec.DEQUANT_ELEMENTS, "other")
        self.secondary.invalidate()   # as after a step: the copies are the base, not the weights
        self._based = {s.index for s in based}
        self.prepare(advance=False)
        return None

    # -- a weight source ---------------------------------------------------------------
    def chunk(self, s) -> int:
        return self._wire_bytes[s.index]

    def slice(self, s) -> torch.Tensor:
        return self._wire[s.index]

    def start(self, weights: list, inp: torch.Tensor, phase: str, out, pool: BufferPool) -> Work:
        """`inp`: my deltas of `weights`, end to end. Hop 1 gathers them over `across`; hop 2,
        over my hpZ group, what hop 1 brought with my slices of the previous weights beside it."""
        sec, h, w = self.secondary, self.within.size, self.across.size
        base = [sec.slice(s) for s in weights]   # my slices of the previous weights: hop 2 carries them
        base_bytes = sum(b.numel() for b in base) * sec.flat.element_size()
        first = w * inp.numel()   # bytes (a multiple of 4: whole wires)
        width = first + -(-base_bytes // 4) * 4   # rows stay 4-byte aligned
        send = pool.take(width, torch.uint8)
        torch.cat([b.view(torch.uint8) for b in base], out=send[first:first + base_bytes])
        rows = pool.take(h * width, torch.uint8).view(h, width)
        hop1 = self.comm.all_gather(send[:first], inp, group=self.across.group, async_op=True, phase=phase,
                                    plain=False)
        hops = TwoHops(hop1, lambda: self.comm.all_gather(rows.view(-1), send, group=self.within.group,
                                                          async_op=True, phase=phase, plain=False))
        self._queue.append(hops)
        self.comm.charge_plain("all_gather", self.partition.group,
                               sum(s.chunk for s in weights) * sec.flat.element_size())
        self.sent += len(weights)

        def finish():
            while self._queue[0] is not hops:   # second hops in issue order, the same on every rank
                self._queue.popleft().start_second()
            self._queue.popleft()
            hops.wait()
            deltas = rows[:, :first].view(h, w, inp.numel())   # the row of rank j = g h + i is [i, g]
            copy_previous(weights, [b.numel() for b in base], rows[:, first:first + base_bytes].view(sec.flat.dtype))
            row = pool.take(dequant_elements(weights, self.partition.size), torch.float32)   # scratch off the CPU path
            off = 0
            for s in weights:
                add_deltas(s, deltas[..., off:off + self._wire_bytes[s.index]], row, h, self.partition.size, self.bits)
                off += self._wire_bytes[s.index]
            pool.give(row)
            pool.give(send)
            pool.give(rows)
            return None
        return Work(hop1, then=finish)

    def fixed_bytes(self) -> int:
        """The fp32 buffer a gather dequantizes into (one gather finishes at a time)."""
        return 4 * dequant_elements(self.weights, self.partition.size) if self.weights else 0

    def arrived(self, s, full: torch.Tensor):   # as a delta: a reconstruction
        self.keep(s, full)

    def carried_parts(self) -> dict:
        return {"weight_deltas": self}

    def peak_buffers(self) -> dict:
        return {}   # its references are model state (memory())

    def summary(self) -> str | None:
        if not self.arrivals:
            return None
        return (f"INT{self.bits} weight deltas: {self.sent} of {self.arrivals} weight gathers from the primary partition went "
                f"as deltas ({100 * self.sent / self.arrivals:.1f}%); the others in full (first gathers, "
                f"evaluations, every {self.refresh_interval} steps, after a load, large deltas)")

    def plan(self, weights: list, phase: str) -> list[PlannedCollective]:
        """The deltas across the ranks at my index in their hpZ groups, then those rows and the
        previous weights' secondary slices inside the group (rows padded to 4 bytes)."""
        wire = sum(self._wire_bytes[s.index] for s in weights)
        world, h = self.partition.size, self.secondary.size
        base = sum(s.secondary_slice.chunk for s in weights) * self.secondary.flat.element_size()
        return [PlannedCollective(phase, "all_gather", "strided", wire,
                                  quant_elements=world * sum(s.chunk for s in weights), quant_bits=self.bits),
                PlannedCollective(phase, "all_gather", "secondary", wire * world // h + -(-base // 4) * 4)]

    def plan_step(self) -> list[PlannedCollective]:
        """After a step each owner quantizes its deltas; one int32 flag per weight says which go in full."""
        return [PlannedCollective("optimizer", "all_reduce", "world", 4 * len(self.weights),
                                  quant_elements=sum(s.chunk for s in self.weights), quant_bits=self.bits)]

    def memory(self) -> MemoryLine:
        """`recon` (w/N bytes a parameter) and the deltas (about 0.53/N in INT4, 0.28/N in INT2)."""
        per = (self.recon.element_size() + wire_nbytes(1 << 20, self.bits, BLOCK_SIZE) / (1 << 20)) / self.partition.size
        return MemoryLine(MEMORY_KEY, "parameters", [self.recon, self.flat], per, label=LABEL.format(self.bits))

    def bytes_per_element(self, elem_bytes: int) -> float:
        """Gather-pool bytes per gathered element: the previous weights sent (b/h) and received
        (b), the deltas' wire (per element: the most of any weight, a small chunk pads to a whole
        block) sent (1/W), received by the first hop (1/h) and the second (1), and copied a
        group of members at a time (at most 1), besides `fixed_bytes` (and up to 3
        bytes of padding a row, in the bound's constant)."""
        w, h = self.partition.size, self.secondary.size
        wire = max((self._wire_bytes[s.index] / s.chunk for s in self.weights), default=0)
        return elem_bytes * (1 + 1 / h) + wire * (2 + 1 / h + 1 / w)


def build(ctx) -> WeightDeltas | None:
    """The deltas keep what arrives in hpZ's partition: nothing to build without it."""
    if ctx.secondary is None:
        return None
    return WeightDeltas(ctx.groups.world, ctx.comm, ctx.weights, ctx.flat, ctx.secondary,
                        ctx.zero.zero_quantized_weight_deltas_refresh_interval, ctx.groups.deltas_across,
                        ctx.groups.deltas_within, ctx.zero.zero_quantized_weight_deltas_bits)


TECHNIQUE = Technique("weight deltas", "weight_deltas", Keys, "zero_quantized_weight_deltas", build, validate,
                      validate_topology, carries={"weight_deltas": "INT4 weight deltas' reference weights "
                                                                   "(zero_quantized_weight_deltas)"},
                      memory_key=MEMORY_KEY, bits=lambda z: z.zero_quantized_weight_deltas_bits)
