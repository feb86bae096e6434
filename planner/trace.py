"""The real model on the meta device, and the real engine's view of it.

`trace_model` builds `model.GPT(GPTConfig)` on "meta" (no memory), runs one
training forward pass there under the stage 3 engine's own hooks
(zeropp/stages/stage3/hooks.py) over a recorder that gathers nothing, and records with the engine's own `TraceRecorder`
(zeropp/stages/schedule.py) what the engine records in a step:
- `events`: the first use of each partitioned weight, one list per module
  request, in forward order (the engine's trace, from which its forward
  gather schedule is cut);
- `touch`: for each partitioned weight that backward needs, (checkpoint region
  or None, forward event count) as the engine's saved-tensor pack hook and
  module pre-hook note it (zeropp.stages.schedule.checkpoint_region decides regions);
- `outside`: weights read outside their own module's forward (GPT's tied
  `wte.weight` in the output layer), as the engine's `GatherOnRead` notes them;
- activation bytes: the tensors autograd saves (what backward keeps alive),
  in the compute dtype, inside each block and outside.

`shard_layout` asks the engine's own classes how the weights split:
zeropp.collectives.partition.ShardedParam / zeropp.stages.stage3.param.Stage3Param built on a
`Partition(group=None, size=N, rank=r)` (no process group), then
`Stage3Param.place()` for persistence and hpZ's secondary slice.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from model import GPT, GPTConfig
from zeropp.collectives.partition import Partition, ShardedParam
from zeropp.stages.schedule import TraceRecorder
from zeropp.stages.stage3.hooks import Stage3Hooks
from zeropp.stages.stage3.param import Stage3Param
from zeropp.techniques.hpz import group_size


@dataclass
class ModelTrace:
    cfg: GPTConfig
    names: list[str]                   # trained parameters, in the engine's order
    numels: list[int]
    events: list[list[int]]            # forward first uses (parameter indices), persistent ones left out
    touch: dict = field(default_factory=dict)     # index -> (region | None, event count)
    outside: set = field(default_factory=set)     # read outside their module
    saved_block_bytes: list[int] = field(default_factory=list)   # autograd-saved bytes per block
    saved_other_bytes: int = 0         # saved outside the blocks (embeddings, output layer, loss)
    block_input_bytes: int = 0         # one block's input: what a checkpointed block keeps

    @property
    def num_parameters(self) -> int:
        return sum(self.numels)

    def activation_bytes(self, checkpointing: bool) -> int:
        """Saved activations of one micro-batch. Without checkpointing: everything
        autograd saves. With it: each block keeps only its input, and backward
        recomputes one block at a time: other + L x input + the largest block."""
        if not checkpointing:
            return self.saved_other_bytes + sum(self.saved_block_bytes)
        return (self.saved_other_bytes + len(self.saved_block_bytes) * self.block_input_bytes
                + max(self.saved_block_bytes, default=0))


def build_meta_model(cfg: GPTConfig, dtype: torch.dtype) -> GPT:
    with torch.device("meta"):
        return GPT(cfg).to(dtype)


class _Recording:
    """Stands in for the engine's `WeightGathers` under the engine's own stage-3 hooks
    (zeropp/stages/stage3/hooks.py): it records what the engine records in a training forward
    and gathers nothing. A weight counts as live while a module that owns it runs; every saved
    tensor passes `owner()`, where the ones that are not weights add to the activation bytes."""
    phase: str | None = None

    def __init__(self, weights: list[Stage3Param], trace: ModelTrace):
        self.recorder = TraceRecorder()
        self.gathered = self
        self.trace = trace
        self.block: int | None = None       # the transformer block running now
        self._by_id = {id(s.param): s for s in weights}
        self._running: list[list[Stage3Param]] = []
        self._saved_ids: set[int] = set()

    def owner(self, x: torch.Tensor) -> Stage3Param | None:
        for cand in (x, x._base):
            s = self._by_id.get(id(cand)) if cand is not None else None
            if s is not None:   # a weight (or a view of one): the engine's pack notes partitioned ones
                return None if s.persistent else s
        base = x._base if x._base is not None else x
        if id(base) not in self._saved_ids:
            self._saved_ids.add(id(base))
            nbytes = base.numel() * base.element_size()
            if self.block is None:
                self.trace.saved_other_bytes += nbytes
            else:
                self.trace.saved_block_bytes[self.block] += nbytes
        return None

    def request(self, weights: list[Stage3Param]):
        self.recorder.first_uses([s.index for s in weights if not s.persistent])
        self._running.append(weights)

    def forward_done(self, weights: list[Stage3Param]):
        self._running.pop()

    def read(self, s: Stage3Param):
        if not any(s in ws for ws in self._running):
            self.recorder.read_outside(s.index)

    def begin(self, phase: str):
        self.phase = phase

    def end(self):
        self.phase = None


def trace_model(cfg: GPTConfig, dtype: torch.dtype, micro_batch: int, seq_length: int,
                persist_threshold: int) -> ModelTrace:
    """One forward of the real model on "meta" under the engine's hooks (see the module
    docstring); weights of at most `persist_threshold` elements are persistent and leave no
    event."""
    model = build_meta_model(cfg, dtype)
    model.train()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    weights = [Stage3Param(i, n, p, Partition(group=None, size=1, rank=0)) for i, (n, p) in enumerate(named)]
    for s in weights:
        s.place(persist_threshold, None)
    trace = ModelTrace(cfg=cfg, names=[n for n, _ in named], numels=[p.numel() for _, p in named], events=[])
    trace.saved_block_bytes = [0] * cfg.num_layers
    rec = _Recording(weights, trace)
    trace.events, trace.touch, trace.outside = rec.recorder.events, rec.recorder.touch, rec.recorder.outside
    hooks = Stage3Hooks(model, {id(s.param): s for s in weights}, rec)
    for b, block in enumerate(model.blocks):
        block.register_forward_pre_hook(lambda m, a, b=b: setattr(rec, "block", b))
        block.register_forward_hook(lambda m, a, o: setattr(rec, "block", None))
    tokens = torch.zeros(micro_batch, seq_length, dtype=torch.long, device="meta")
    hooks.forward(model, tokens, tokens)
    item = torch.empty((), dtype=dtype).element_size()
    trace.block_input_bytes = micro_batch * seq_length * cfg.hidden_size * item
    if cfg.checkpoint_activations:   # what each block saves, from a run without checkpointing
        plain = trace_model(dataclasses.replace(cfg, checkpoint_activations=False), dtype, micro_batch,
                            seq_length, persist_threshold)
        trace.saved_block_bytes = plain.saved_block_bytes
        trace.saved_other_bytes = plain.saved_other_bytes
    return trace


def shard_layout(trace: ModelTrace, world: int, rank: int, stage: int, persist_threshold: int,
                 hpz: int) -> list[ShardedParam]:
    """Rank `rank`'s shards, built by the engine's classes on a meta stand-in of
    each weight: chunk, valid slice, persistence, hpZ secondary chunk."""
    primary = Partition(group=None, size=world, rank=rank)
    h = group_size(stage, hpz, world)   # hpZ's group, 0 when it keeps none
    secondary = Partition(group=None, size=h, rank=rank % h) if h else None
    cls = Stage3Param if stage == 3 else ShardedParam
    shards = []
    for i, (name, numel) in enumerate(zip(trace.names, trace.numels)):
        stand_in = torch.nn.Parameter(torch.empty(numel, device="meta"))
        s = cls(i, name, stand_in, primary)
        if stage == 3:
            s.place(persist_threshold, secondary)
        shards.append(s)
    return shards
