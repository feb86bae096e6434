"""The real model on the meta device, and the real engine's view of it.

`trace_model` builds `model.GPT(GPTConfig)` on "meta" (no memory), runs one
training forward pass there with hooks like the stage 3 engine's
(zeropp/stages/stage3.py), and records with the engine's own `TraceRecorder`
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
zeropp.collectives.partition.ShardedParam / zeropp.stages.stage3.Stage3Param built on a
`Partition(group=None, size=N, rank=r)` (no process group), then
`Stage3Param.place()` for persistence and hpZ's secondary slice.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from model import GPT, GPTConfig
from zeropp.collectives.partition import Partition, ShardedParam
from zeropp.stages.schedule import TraceRecorder, checkpoint_region
from zeropp.stages.stage3 import Stage3Param


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


def trace_model(cfg: GPTConfig, dtype: torch.dtype, micro_batch: int, seq_length: int,
                persist_threshold: int) -> ModelTrace:
    """One forward of the real model on "meta" under the engine's bookkeeping
    (see the module docstring); weights of at most `persist_threshold`
    elements are persistent and leave no event."""
    model = build_meta_model(cfg, dtype)
    model.train()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    index = {id(p): i for i, (_, p) in enumerate(named)}
    partitioned = {i for i, (_, p) in enumerate(named) if p.numel() > persist_threshold}
    recorder = TraceRecorder()
    trace = ModelTrace(cfg=cfg, names=[n for n, _ in named], numels=[p.numel() for _, p in named],
                       events=recorder.events, touch=recorder.touch, outside=recorder.outside)
    regions = []          # keeps region objects alive (their identity is the key)
    where = {"block": None}
    saved_ids: set[int] = set()
    trace.saved_block_bytes = [0] * cfg.num_layers

    def pack(x):
        if not isinstance(x, torch.Tensor):
            return x
        for cand in (x, x._base):
            if cand is not None and id(cand) in index:   # a weight (or a view of one)
                i = index[id(cand)]
                if i in partitioned:
                    recorder.saved(i)
                return x
        base = x._base if x._base is not None else x
        if id(base) not in saved_ids:
            saved_ids.add(id(base))
            nbytes = base.numel() * base.element_size()
            if where["block"] is None:
                trace.saved_other_bytes += nbytes
            else:
                trace.saved_block_bytes[where["block"]] += nbytes
        return x

    running: list[list[int]] = []     # the direct weights of each module in forward now

    class NoteOutside(dict):   # a module's `_parameters`, as the engine's GatherOnRead
        def __getitem__(self, key):
            p = dict.__getitem__(self, key)
            i = index.get(id(p))
            if running and i in partitioned and not any(i in ws for ws in running):
                recorder.read_outside(i)
            return p

    def pre_forward(module, args):
        direct = [index[id(p)] for p in module.parameters(recurse=False) if id(p) in index]
        direct = [i for i in direct if i in partitioned]
        running.append(direct)
        recorder.first_uses(direct)
        region = checkpoint_region(pack)
        if region is not None and direct:
            regions.append(region)
            recorder.recomputed(direct, region)

    hooks = [m.register_forward_pre_hook(pre_forward) for m in model.modules()]
    def post_forward(module, args, output):
        running.pop()

    hooks += [m.register_forward_hook(post_forward, always_call=True) for m in model.modules()]
    for m in model.modules():
        m._parameters = NoteOutside(m._parameters)
    for b, block in enumerate(model.blocks):
        hooks.append(block.register_forward_pre_hook(lambda m, a, b=b: where.__setitem__("block", b)))
        hooks.append(block.register_forward_hook(lambda m, a, o: where.__setitem__("block", None)))
    tokens = torch.zeros(micro_batch, seq_length, dtype=torch.long, device="meta")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        model(tokens, tokens)
    for h in hooks:
        h.remove()
    item = torch.empty((), dtype=dtype).element_size()
    trace.block_input_bytes = micro_batch * seq_length * cfg.hidden_size * item
    if cfg.checkpoint_activations:   # what each block saves, from a run without checkpointing
        plain = trace_model(dataclasses.replace(cfg, checkpoint_activations=False), dtype, micro_batch,
                            seq_length, persist_threshold)
        trace.saved_block_bytes = plain.saved_block_bytes
        trace.saved_other_bytes = plain.saved_other_bytes
    trace.regions = regions
    return trace


def shard_layout(trace: ModelTrace, world: int, rank: int, stage: int, persist_threshold: int,
                 hpz: int) -> list[ShardedParam]:
    """Rank `rank`'s shards, built by the engine's classes on a meta stand-in of
    each weight: chunk, valid slice, persistence, hpZ secondary chunk."""
    primary = Partition(group=None, size=world, rank=rank)
    secondary = Partition(group=None, size=hpz, rank=rank % hpz) if stage == 3 and 1 < hpz < world else None
    cls = Stage3Param if stage == 3 else ShardedParam
    shards = []
    for i, (name, numel) in enumerate(zip(trace.names, trace.numels)):
        stand_in = torch.nn.Parameter(torch.empty(numel, device="meta"))
        s = cls(i, name, stand_in, primary)
        if stage == 3:
            s.place(persist_threshold, secondary)
        shards.append(s)
    return shards
