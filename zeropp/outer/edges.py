"""The outer loop's edges (zeropp/outer/diloco.py): the evaluation on the global parameters, the
final synchronization at the end of training, and, with a fault-tolerant membership
(parallel/membership.py TorchftGroups), the join at the start and the heal of a group that is
behind from a healthy peer's outer state."""
from __future__ import annotations

import contextlib

import torch

from parallel.membership import JOINING
from zeropp.outer.diloco import DRIFT, PHASE, OuterSync, group_check

@contextlib.contextmanager
def with_global_weights(sync: OuterSync):
    """The engine computes with the global parameters (those a checkpoint exports) inside, with
    its own masters again after, bit for bit (collective over the job; an evaluation, in
    training/outer.py). Yields the RMS distance of the groups' masters from the global ones."""
    for x in sync.pending:   # as a save does: the exchanges in flight stepped, merged at their step
        sync._outer_step(x)
    own = sync.layout.local_all()
    g = sync.global_values() if sync.s.asynchronous else sync.flat["global"]   # (the thread's: a copy)
    sums = torch.stack([(own - g).double().square().sum(), torch.tensor(float(own.numel()), dtype=torch.float64)])
    sync.comm.all_reduce(sums, phase=DRIFT)
    if sync.cross.size > 1 and not sync.cross.fault_tolerant:   # (torchft: my group's drift)
        sync.cross.all_reduce(sums, DRIFT, async_op=False)
    sync.layout.set_all(g)
    sync.engine.masters_changed()
    try:
        yield (sums[0] / sums[1].clamp(min=1)).sqrt().item()
    finally:
        sync.layout.set_all(own)
        sync.engine.masters_changed()


def final_sync(sync: OuterSync) -> str | None:
    """The end of training: the exchanges in flight merged now, then every fragment averaged
    over the groups present exactly (fp32, once: no quantization, no outer step) and the masters
    and the global values set to the mean, so the global parameters (what a checkpoint exports)
    are every group's trained model. What `tools/export_checkpoint.py --average-groups`
    computes from a checkpoint saved before the end."""
    if sync.s.asynchronous:
        return sync.final()
    notes = [sync._merge(x) for x in sync.pending]
    sync.pending = []
    F = sync.s.fragments
    opened = sync.cross.open(sync.steps, F, 1)   # "fragment F": every fragment, equal weights
    if opened.fragment != F:
        if opened.quorum:
            sync.cross.commit()
        return "; ".join(n for n in notes + ["no other group present at the end: this group's own model"] if n)
    layout, g = sync.layout, sync.flat["global"]
    mean = layout.local_all()
    if opened.scale is not None:
        mean.mul_(opened.scale)
    for part in layout.views(mean):   # a fragment at a time, as it always was: the same sums, bit for bit
        sync.cross.all_reduce(part, PHASE).wait()
    if opened.scale is None and opened.size > 1:
        mean.div_(opened.size)
    if not sync.cross.commit():
        return "; ".join(n for n in notes + ["final synchronization not committed (a group failed during it)"] if n)
    sync.counted_through = sync.steps
    local = layout.local_all()
    finite, reseed = fragment_checks(sync, g - mean, g - local)
    took = layout.elementwise(finite)
    g.copy_(torch.where(took, mean, g))
    if sync.err is not None:   # nothing of the groups' drift is left unsent
        sync.flat["error"].masked_fill_(took, 0.0)
    layout.set_all(torch.where(layout.elementwise(finite | reseed), g, local))
    for f in (~finite).nonzero().flatten().tolist():
        notes.append(f"final synchronization of fragment {f} skipped: a group's values are not finite"
                     + (f"; group {sync.cross.rank} takes the global values" if reseed[f] else ""))
    sync.engine.masters_changed()
    return "; ".join(n for n in notes if n) or None


def fragment_checks(sync: OuterSync, outer: torch.Tensor, mine: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """group_check for every fragment at once (over my whole shard): per fragment [F], whether
    `outer` is finite on every shard of my group, and whether my group's own `mine` is not."""
    bad = torch.stack([~torch.isfinite(outer), ~torch.isfinite(mine)], 1).float()
    counts = sync.layout.per_fragment(bad)
    sync.cross.group_sum(counts)
    return counts[:, 0] == 0, counts[:, 1] > 0


# -- a fault-tolerant membership: join and heal ---------------------------------------------------
def outer_state(sync: OuterSync) -> dict:
    """What a group that is behind takes from a peer (copies: torchft sends them while this
    group goes on)."""
    if sync.s.asynchronous:
        return sync.rounds.outer_state()
    return {"steps": sync.steps, "outer_steps": sync.outer_steps, "fingerprint": sync.cross.fingerprint,
            **{k: v.clone() for k, v in sync.flat.items() if k != "error"}}


def heal(sync: OuterSync, state: dict):
    """A peer's outer state into mine (parallel/membership.py loads it once every rank of my
    group has fetched its part; collective over my group). A group that has not exchanged since
    it (re)started takes the global parameters as its masters too; one that trained on alone
    keeps its own and merges them at its next exchanges."""
    if sync.s.asynchronous:
        return sync.rounds.heal(state)
    if state.get("fingerprint") != sync.cross.fingerprint:   # nothing copied: the quorum's header says why
        return                                              # to every group (parallel/torchft_groups.py)
    for k, v in state.items():
        if k in sync.flat:
            sync.flat[k].copy_(v)
    if "error" in sync.flat:   # what this group has not sent of its own steps, kept with its masters
        kept = sync.joined
        if not kept:
            sync.flat["error"].zero_()
        sync.cross.events.append("its error feedback " + ("kept: this group keeps its masters" if kept else
                                                          "zeroed: this group takes the global values"))
    sync.steps, sync.outer_steps = state["steps"], state["outer_steps"]
    sync.since.reset()
    if not sync.joined:
        sync.layout.set_all(sync.flat["global"])
        sync.engine.masters_changed()


def join(sync: OuterSync) -> str:
    """Before the first inner step: meet the groups present (torchft's quorum), heal from them if
    this group is behind, and when they are at an exchange take part in it with no weight. The
    inner step to continue from is then `sync.steps`."""
    if sync.s.asynchronous:
        return sync.join()
    before = sync.steps
    opened = sync.cross.at_start(lambda: sync.cross.open(sync.steps, JOINING, 0))
    if not opened.quorum:
        return "no quorum at the start: this group trains alone until one forms"
    x = sync.start(opened)
    if x is not None:
        sync._merge(x)
        sync.joined = True
    if opened.failed:
        return (f"met a quorum of {opened.size} group(s), but it failed (a member, or the heal from one, did not "
                f"finish in time): this group trains alone until its next exchange")
    return (f"joined a quorum of {opened.size} group(s)" + (" and healed from a peer" if opened.healed else "")
            + (f"; continuing at their inner step {sync.steps} (was {before})" if sync.steps != before else ""))
