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
    own = [sync.local(f) for f in range(sync.s.fragments)]
    sums = torch.zeros(2, dtype=torch.float64, device=sync.engine.device)
    for o, g in zip(own, sync.glob):
        sums += torch.stack([(o - g).double().square().sum(), sums.new_tensor(float(o.numel()))])
    sync.comm.all_reduce(sums, phase=DRIFT)
    if sync.cross.size > 1 and not sync.cross.fault_tolerant:   # (torchft: my group's drift)
        sync.cross.all_reduce(sums, DRIFT, async_op=False)
    for f in range(sync.s.fragments):
        sync._set_masters(f, 0.0, sync.glob[f])
    sync.engine.masters_changed()
    try:
        yield (sums[0] / sums[1].clamp(min=1)).sqrt().item()
    finally:
        for f in range(sync.s.fragments):
            sync._set_masters(f, 0.0, own[f])
        sync.engine.masters_changed()


def final_sync(sync: OuterSync) -> str | None:
    """The end of training: the exchanges in flight merged now, then every fragment averaged
    over the groups present exactly (fp32, once: no quantization, no outer step) and the masters
    and the global values set to the mean, so the global parameters (what a checkpoint exports)
    are every group's trained model. What `tools/export_checkpoint.py --average-groups`
    computes from a checkpoint saved before the end."""
    notes = [sync._merge(x) for x in sync.pending]
    sync.pending = []
    F = sync.s.fragments
    opened = sync.cross.open(sync.steps, F, 1)   # "fragment F": every fragment, equal weights
    if opened.fragment != F:
        if opened.quorum:
            sync.cross.commit()
        return "; ".join(n for n in notes + ["no other group present at the end: this group's own model"] if n)
    means = []
    for f in range(F):
        mean = sync.local(f)
        sync.cross.all_reduce(mean if opened.scale is None else mean.mul_(opened.scale), PHASE).wait()
        means.append(mean.div_(opened.size) if opened.scale is None and opened.size > 1 else mean)
    if not sync.cross.commit():
        return "; ".join(n for n in notes + ["final synchronization not committed (a group failed during it)"] if n)
    for f, mean in enumerate(means):
        local, g = sync.local(f), sync.glob[f]
        finite, reseed, _ = group_check(sync.comm, g - mean, g - local)
        if finite:
            g.copy_(mean)
            if sync.err is not None:   # nothing of the groups' drift is left unsent
                sync.err[f].zero_()
        else:
            notes.append(f"final synchronization of fragment {f} skipped: a group's values are not finite"
                         + (f"; group {sync.cross.rank} takes the global values" if reseed else ""))
        if finite or reseed:
            sync._set_masters(f, 0.0, g)
    sync.engine.masters_changed()
    return "; ".join(n for n in notes if n) or None


# -- a fault-tolerant membership: join and heal ---------------------------------------------------
def outer_state(sync: OuterSync) -> dict:
    """What a group that is behind takes from a peer (copies: torchft sends them while this
    group goes on)."""
    return {"steps": sync.steps, "outer_steps": sync.outer_steps, "fingerprint": sync.cross.fingerprint,
            **{k: v.clone() for k, v in sync.flat.items() if k != "error"}}


def heal(sync: OuterSync, state: dict):
    """A peer's outer state into mine (parallel/membership.py loads it once every rank of my
    group has fetched its part; collective over my group). A group that has not exchanged since
    it (re)started takes the global parameters as its masters too; one that trained on alone
    keeps its own and merges them at its next exchanges."""
    if state.get("fingerprint") != sync.cross.fingerprint:   # nothing copied: the quorum's header says why
        return                                              # to every group (parallel/membership.py)
    for k, v in state.items():
        if k in sync.flat:
            sync.flat[k].copy_(v)
    if "error" in sync.flat:
        sync.flat["error"].zero_()
    sync.steps, sync.outer_steps = state["steps"], state["outer_steps"]
    sync.since = [0] * sync.s.fragments
    if not sync.joined:
        for f in range(sync.s.fragments):
            sync._set_masters(f, 0.0, sync.glob[f])
        sync.engine.masters_changed()


def join(sync: OuterSync) -> str:
    """Before the first inner step: meet the groups present (torchft's quorum), heal from them if
    this group is behind, and when they are at an exchange take part in it with no weight. The
    inner step to continue from is then `sync.steps`."""
    before = sync.steps
    opened = sync.cross.open(sync.steps, JOINING, 0)
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
