"""What `apply_zeropp` (zeropp/fsdp/apply.py) installed: the communicator and its byte counts, the
reduction and its carried state (LoCo's error), the reductions in flight, the commit of the
carried state with the optimizer step, and its checkpoint."""
from __future__ import annotations

import json
import warnings

import torch
import torch.distributed as dist

from common.errors import ConfigError
from common.torch_private import in_backward, queue_backward_callback
from parallel.comm import Communicator
from parallel.topology import Topology
from zeropp import techniques
from zeropp.collectives.exact import ShardGather
from zeropp.collectives.partition import Partition, as_dcp
from zeropp.collectives.two_hop import TwoHops
from zeropp.config import ZeroConfig


class PluginError(ConfigError):
    """The plug-in cannot be applied as asked (one line naming the culprit and the fix)."""


class ZeroPP:
    """What `apply_zeropp` installed: the communicator (its `stats`), the reduction and its
    carried state, the reductions in flight."""

    def __init__(self, topology: Topology, zero: ZeroConfig, device, overlap: bool, max_inflight: int,
                 comm: Communicator | None = None):
        self.topology, self.zero, self.overlap, self.max_inflight = topology, zero, overlap, max_inflight
        self.comm = comm or Communicator(topology)
        self.root = None                # the model (a weak reference), once installed
        self.hpz = False                # whether the plug-in keeps weights over the node after forward
        self.partition = Partition(topology.gradient_group, topology.world_size, topology.rank)
        ctx = techniques.BuildContext(zero, self.comm, None, None, device, weights=[], flat=None)
        techniques.fill_slots(ctx)
        self.gather = ctx.weight_gather or ShardGather(self.comm)
        self.reduction = ctx.gradient_reduction   # None: FSDP2's reduce-scatter (counted)
        self.carried = self.reduction.carried_parts() if self.reduction else {}
        self.committed = not self.carried   # whether something commits the carried state each step
        self.units: list = []           # the installed reductions, one per FSDP unit (comms.UnitReduce)
        self.shards = topology.world_size   # ranks a unit's reduce-scatter spans (HSDP: the shard group's)
        self.replicas = None            # HSDP: the reduction across replicas (zeropp/fsdp/replicate.py)
        self.reducing = None            # (output, LoCo key) of the last reduce-scatter, for the all-reduce after it
        self.inflight: list = []        # (work, output, divisor)
        self._callback_queued = False
        self._inside: dict = {}

    @property
    def exact_gathers(self) -> bool:
        """Every gather is exact while the model is in eval() (evaluation, as the engine's), an
        explicit `unshard()` outside forward too."""
        root = self.root() if self.root is not None else None
        return root is not None and not root.training

    @property
    def stats(self):
        return self.comm.stats

    def inside_node(self, group) -> bool:
        key = id(group)
        if key not in self._inside:
            nodes = {self.topology.node_of(r) for r in self.comm.group_ranks(group)}
            self._inside[key] = len(nodes) == 1
        return self._inside[key]

    def overlap_label(self) -> str:
        """Which units' reductions completed while backward went on at their last reduction, and
        why the others completed at once."""
        reduced = [u for u in self.units if u.reads is not None]
        later = [u.key for u in reduced if self.overlap and not u.reads]
        why = sorted({r for u in reduced for r in u.reads})
        line = f"reductions overlap backward in {len(later)} of {len(reduced)} units"
        if not self.overlap:
            return line + " (overlap is off)"
        return line + (f" (the rest complete at once: {', '.join(why)} reads them)" if why else "")

    # -- reductions in flight ----------------------------------------------------------------
    def issued(self, work, output: torch.Tensor, divisor: float, later: bool):
        self.inflight.append((work, output, divisor))
        if not later:
            self.finish()
            return
        while len(self.inflight) > self.max_inflight:
            self._complete(self.inflight.pop(0))
        if not self._callback_queued and in_backward():
            queue_backward_callback(self.finish)   # complete the rest before backward returns
            self._callback_queued = True

    def chain(self, output: torch.Tensor, start_next, divisor: float) -> bool:
        """The reduction in flight into `output` goes on with `start_next()` once it is done (HSDP:
        the all-reduce across replicas after the reduce-scatter inside the node), its result
        divided by `divisor` besides; False if none is in flight."""
        for i, (work, out, d) in enumerate(self.inflight):
            if out is output:
                self.inflight[i] = (TwoHops(work, start_next), out, d * divisor)
                return True
        return False

    def progress(self):
        """Let the reductions in flight go on (qgZ starts its second hop), in issue order and
        stopping at the first still busy: every rank issues each group's collectives in one order."""
        for work, _, _ in self.inflight:
            if not work.progress():
                break

    def finish(self):
        """Complete every reduction in flight (FSDP2's gradients are views of their results)."""
        self._callback_queued = False
        while self.inflight:
            self._complete(self.inflight.pop(0))

    @staticmethod
    def _complete(entry):
        work, output, divisor = entry
        work.wait()
        if divisor != 1:
            output.div_(divisor)

    # -- carried state -----------------------------------------------------------------------
    def check_committed(self):
        if not self.committed:
            raise PluginError("apply_zeropp(loco=True) needs its error committed when a step is applied: call "
                              "zeropp.attach(optimizer) after apply_zeropp (or commit_by_end_step() and end_step())")

    def end_step(self, applied: bool = True) -> list[str]:
        """The optimizer step ended (applied, or skipped by a loss scaler): commit or drop what
        the carried state (LoCo's error) took from this step's reductions."""
        self.finish()
        return [note for part in self.carried.values() if (note := part.end_step(applied))]

    def commit_by_end_step(self):
        """The caller calls `end_step(applied)` after every optimizer step (train.py's engine does)."""
        self.committed = True
        return self

    def attach(self, optimizer: torch.optim.Optimizer):
        """Commit after every `optimizer.step()` (a step a scaler skips never calls it: call
        `end_step(applied=False)` then)."""
        optimizer.register_step_pre_hook(lambda *_: self.finish())
        optimizer.register_step_post_hook(lambda *_: self.end_step(True))
        self.committed = True
        return self

    def new_error(self, key: str, total: int, note: str):
        """A unit reduced a set of parameters it had not: LoCo starts an error of its own for it
        (said once), so one set's leftover error never lands on another's gradients."""
        shapes = self.replicas.error_shapes(key, total) if self.replicas else {key: (self.topology.num_nodes, total)}
        for part in self.carried.values():
            for name, shape in shapes.items():
                part.add(name, shape)
        warnings.warn(note, stacklevel=2)

    def state_dict(self) -> dict:
        """For DCP, beside the model's and optimizer's: the carried errors as DTensors sharded
        over the ranks, the layout and counts as JSON. Reads only: saving changes nothing."""
        self.finish()
        out = {}
        for name, part in self.carried.items():
            for key, flat in part.checkpoint_state(self.topology.world_size).items():
                out[key] = flat
            scalars = part.scalar_state()
            out[f"{name}.scalars"] = json.dumps({k: scalars[k] for k in scalars})
        tensors = {k: v for k, v in out.items() if not isinstance(v, str)}
        return {**{k: v for k, v in out.items() if isinstance(v, str)}, **as_dcp(tensors, _device(tensors))}

    def load(self, checkpoint_id: str) -> list[str]:
        """Restore the state `state_dict` saved under "zeropp" in the DCP checkpoint
        `checkpoint_id`; on another layout the state starts from zero and each returned line
        says what was reset."""
        import torch.distributed.checkpoint as dcp
        self.finish()
        notes = []
        for name, part in self.carried.items():
            scalars = {"zeropp": {f"{name}.scalars": ""}}
            stored = dcp.FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata
            saved = None
            if f"zeropp.{name}.scalars" in stored:
                dcp.load(scalars, checkpoint_id=checkpoint_id)
                saved = json.loads(scalars["zeropp"][f"{name}.scalars"])
            if part.carried(saved):
                part.adopt(saved)   # the errors of parameter sets the saving run had met
                flats = part.checkpoint_state(self.topology.world_size)
                if hasattr(part, "stage_load"):   # saved in an older format: read as saved, converted
                    part.stage_load(saved)
                dcp.load({"zeropp": as_dcp(flats, _device(flats))}, checkpoint_id=checkpoint_id)
            if note := part.load_scalar_state(saved):
                notes.append(note)
        return notes


def _device(flats: dict) -> torch.device:
    return next((v.local.device for v in flats.values()), torch.device("cpu"))


class Issued(dist.Work):
    """Our collective's handle as FSDP2 waits on it: FSDP2 waits only on a c10d `Work`."""

    def __init__(self, work):
        super().__init__()
        self.work = work

    def wait(self, timeout=None) -> bool:
        self.work.wait()
        return True
