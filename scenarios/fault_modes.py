"""The fault matrix's rows for the two modes beside the engine's switches (`python -m scenarios.faults`):
streaming DiLoCo (zeropp/outer/diloco.py) and FSDP2 + the ZeRO++ plug-in (zeropp/fsdp/engine.py).
A cell returns "" when it holds, else what went wrong; every rank runs every check, and a
cell's verdict is every rank's (the groups of DiLoCo hold different states).

DiLoCo: 4 ranks in 2 groups (2 nodes x 2, a group a node, ZeRO-3 inside; or 4 nodes x 1,
a group of 2 nodes, qwZ + qgZ inside), H = 2, 2 fragments (an exchange after every inner
step), exact, INT4 or sparse top-k (topk2) outer gradients, merged at once or one step after issue. After every step
the ranks of a group agree on the engine's scalar state (the outer schedule's with it), the
groups' global copies of each shard are identical, and every rank counts the same inner steps.

- overflow / nan: an infinite (fp16) or NaN (bf16) loss on rank 0 at step K: rank 0's group
  skips it, the other group does not; the outer schedule counts it. Reference: a run where
  rank 0's group takes no inner step K at all (its carried parts told "skipped", as the
  engine tells them): equal bit for bit (step counts aside).
- resume: fp32, save at step K (an exchange in flight when merged a step later), load into
  fresh engines, go on: bit-identical to the uninterrupted run and to a run that never saved;
  a same-layout load prints nothing.
- reshard: that checkpoint loaded by one group of 4 (the engine without the mode): one line
  names the regroup and nothing else; the run equals the plain engine started from the global
  parameters tools/export_checkpoint.py reads from the checkpoint (and the saved scalars:
  qwZ's recorded orders decide its bits), bit for bit. The plain engine's checkpoint then
  loads into 2 groups: one line names the outer state's reset, every group starts from it
  and its global copies are its weights.
- toggle: the checkpoint loaded by 2 groups with other outer settings (INT4 flipped, topk2 to INT4, the
  delay flipped, one fragment): one line names the outer state's reset, nothing else; the
  global copies are the mean of the groups' loaded weights (the same in every group), and the
  run goes on (the groups' copies agreeing after every step).

FSDP2: its accepted switch combinations (stage 3; qwZ, hpZ over the node, qgZ, LoCo, Hadamard;
the rest refused in one line) on 2 nodes x 2, through overflow, nan and resume as the
engine's rows (fault_cells.check_skip / check_resume), and
- engine: the resume checkpoint loaded by the engine's own ZeRO-3 with the same switches, and
  the engine's checkpoint back into FSDP2: the evaluation loss right after each load (exact
  weights) equals the saver's bit for bit, a reset is named in one line (only LoCo's error
  may reset: its layout is the reduction's), and each run goes on.
"""
from __future__ import annotations

import hashlib
import json
import tempfile

import torch
import torch.distributed as dist

from scenarios.fault_cells import (FAULT_AT, STEPS, accepted, batch, build, check_resume, check_skip, differences, load,
                               name, nonfinite, rank_entry, run_cell, save, state, train)
from scenarios.harness.spawn import run_distributed
from parallel.topology import topology_from_env
from zeropp.collectives.partition import Partition
from zeropp.outer.diloco import OuterSettings, attach

QUANTIZATIONS, DELAYS = ("none", "int4", "topk2"), (0, 1)
# (ranks per node, nodes per group, the engine inside each group)
DILOCO_LAYOUTS = {"2x2": (2, 1, {"stage": 3}),
                  "4x1": (1, 2, {"stage": 3, "zero_quantized_weights": True, "zero_quantized_gradients": True})}
DILOCO_FAULTS = ("overflow", "nan", "resume", "reshard", "toggle", "fp16-resume", "bad-fragment")
FSDP2_FAULTS = ("overflow", "nan", "resume", "engine")


def outer_settings() -> list[OuterSettings]:
    """H = 2 with 2 fragments: every inner step issues an exchange, so the 5 steps hold several."""
    return [OuterSettings(2, fragments=2, quantization=q, delay=d) for q in QUANTIZATIONS for d in DELAYS]


# The default suite's share: on 2 x 2 INT4 merged a step late (the error carried, an exchange in
# flight at the save); on 4 x 1 (ZeRO++ inside) exact, merged at once.
QUICK = {"2x2": ("int4", 1), "4x1": ("none", 0)}


def quick_settings(layout: str) -> list[OuterSettings]:
    return [s for s in outer_settings() if (s.quantization, s.delay) == QUICK[layout]]


def settings_name(s: OuterSettings) -> str:
    return f"H{s.interval}F{s.fragments}+{s.quantization}+delay{s.delay}"


def everyone(problem: str) -> str:
    """Every rank's verdict, each different one once with the ranks that gave it."""
    all_ = [None] * dist.get_world_size()
    dist.all_gather_object(all_, problem)
    said = {p: [r for r, q in enumerate(all_) if q == p] for p in all_ if p}
    return "; ".join(f"ranks {r}: {p}" for p, r in said.items())


# -- DiLoCo ---------------------------------------------------------------------------------------

class Grouped:
    """An engine over my group, with the outer synchronization attached (as tests/unit/outer/test_diloco.py)."""

    def __init__(self, inner: dict, precision: str, per_node: int, nodes: int, settings: OuterSettings):
        self.engine = build(inner, precision, per_node,
                            topology=lambda: topology_from_env(per_node).group_topology(nodes).build_groups())
        topo = self.engine.comm.topology
        self.group, self.size = topo.offset // topo.world_size, topo.world_size
        self.sync = attach(self.engine, Partition(group=topo.across_group, size=topo.groups, rank=self.group),
                           settings)

    def agree(self, after: int):
        """The ranks of my group agree on the scalar state; the groups on the global copies."""
        scalars = json.dumps(self.engine.scalar_state(), sort_keys=True, default=str)
        glob = hashlib.sha256(b"".join(g.numpy().tobytes() for g in self.sync.glob)).hexdigest()
        mine = (self.group, dist.get_rank() % self.size, scalars, glob, self.sync.steps)
        all_ = [None] * dist.get_world_size()
        dist.all_gather_object(all_, mine)
        if len({a[4] for a in all_}) != 1:
            raise AssertionError(f"the ranks count different inner steps after step {after}: {[a[4] for a in all_]}")
        for g, i, s, h, _ in all_:
            if any(a[0] == g and a[2] != s for a in all_):
                raise AssertionError(f"the ranks of group {g} disagree on their scalar state after step {after}")
            if any(a[1] == i and a[3] != h for a in all_):
                raise AssertionError(f"the groups' global copies of shard {i} differ after step {after}")

    def train(self, steps: list[int], fault: dict[int, float] | None = None, absent: int | None = None) -> list[bool]:
        """`fault[i]` multiplies step i's loss on rank 0; at step `absent` group 0 takes no inner
        step (its carried parts told the step was skipped). Returns which steps were skipped."""
        skipped = []
        for i, b in enumerate(steps):
            if absent == b and self.group == 0:
                for part in self.engine.parts.carried.values():
                    part.end_step(False)
                skipped.append(True)
            else:
                x = batch(b)
                loss = self.engine(x[:, :-1], x[:, 1:])
                if fault and b in fault and dist.get_rank() == 0:
                    loss = loss * fault[b]
                self.engine.backward(loss)
                skipped.append(self.engine.step().skipped)
            self.agree(b)
        return skipped

    def state(self) -> tuple[dict, dict]:
        """The whole state (the exchanges in flight stepped, as a checkpoint takes them)."""
        out = state(self.engine)
        self.sync.drain()
        return out


def check_group_skip(inner: dict, precision: str, value: float, per_node: int, nodes: int,
                     settings: OuterSettings) -> str:
    ref = Grouped(inner, precision, per_node, nodes, settings)
    ref.train(list(range(STEPS)), absent=FAULT_AT)
    want = ref.state()
    run = Grouped(inner, precision, per_node, nodes, settings)
    skipped = run.train(list(range(STEPS)), fault={FAULT_AT: value})
    bad, got = nonfinite(run.engine), run.state()   # every rank, before any verdict: both collective
    expect = [run.group == 0 and i == FAULT_AT for i in range(STEPS)]
    if skipped != expect:
        return (f"group {run.group} skipped steps {[i for i, s in enumerate(skipped) if s]}, "
                f"not {FAULT_AT if run.group == 0 else 'none'}")
    if run.sync.steps != STEPS:
        return f"the outer schedule counted {run.sync.steps} of {STEPS} steps"
    if bad:
        return f"non-finite state after the skip: {bad[:3]}"
    diff = differences(want, got, ignore=("loss_scaler", "global_step", "skipped_steps"))
    return f"ends unlike the group that never took the step: {diff[:3]}" if diff else ""


def check_group_resume(inner: dict, per_node: int, nodes: int, settings: OuterSettings, path: str,
                       precision: str = "fp32", fault: dict | None = None) -> str:
    run = Grouped(inner, precision, per_node, nodes, settings)
    run.train(list(range(FAULT_AT)), fault)
    if settings.delay and not run.sync.pending:
        return "no exchange in flight at the save"
    if fault:   # the groups' scalar states differ at the save: each must come back to its own group
        every = [None] * dist.get_world_size()
        scalars = run.engine.scalar_state()
        dist.all_gather_object(every, json.dumps([scalars["loss_scaler"], scalars["skipped_steps"]]))
        if len(set(every)) < 2:
            return f"the groups' loss scalers and skipped steps do not differ at the save: {every}"
    save(run.engine, path)
    run.train(list(range(FAULT_AT, STEPS)))
    want = run.state()
    straight = Grouped(inner, precision, per_node, nodes, settings)
    straight.train(list(range(STEPS)), fault)
    never = straight.state()
    again = Grouped(inner, precision, per_node, nodes, settings)
    notes = load(again.engine, path)
    if notes:
        return f"a same-layout load printed {notes}"
    if any(again.train(list(range(FAULT_AT, STEPS)))):
        return "a step after the load was skipped"
    got = again.state()
    diff, saved = differences(never, got, ignore=()), differences(never, want, ignore=())
    return (f"the resumed run differs from one that never saved: {diff[:3]}" if diff else
            f"saving changed the run: {saved[:3]}" if saved else "")


def check_bad_fragment(inner: dict, per_node: int, nodes: int, settings: OuterSettings) -> str:
    """A NaN in group 0's copy of fragment 0 after step FAULT_AT: that exchange's outer step is
    skipped in both groups, group 0 takes the global values (and says so), and the fragment's
    next exchange is both groups' again (the global copies agree after every step)."""
    import warnings
    run = Grouped(inner, "fp32", per_node, nodes, settings)
    run.train(list(range(FAULT_AT)))
    if dist.get_rank() == 0:
        run.sync.owned[0].master.view(-1)[0] = float("nan")
    before, in_flight = run.sync.outer_steps, len(run.sync.pending)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run.train(list(range(FAULT_AT, FAULT_AT + 2 * settings.interval + 2)))
    said = [str(w.message) for w in caught]
    skipped = [m for m in said if "outer step of fragment 0 skipped" in m]
    reseeded = [m for m in said if "group 0's copy is not: it takes the global values" in m]
    # (nonfinite reads the checkpoint state, which steps the exchanges still in flight)
    bad = nonfinite(run.engine) + [f"global {f}" for f, g in enumerate(run.sync.glob) if not torch.isfinite(g).all()]
    # every exchange in flight at the fault or issued since is stepped, but the skipped one
    issued = sum(len(run.sync.due(s)) for s in range(FAULT_AT + 1, run.sync.steps + 1))
    stepped, expected = run.sync.outer_steps - before, in_flight + issued - 1
    run.sync.drain()
    if len(skipped) != 1 or bool(reseeded) != (run.group == 0):
        return f"expected one skipped outer step, named as group 0's re-seed there: {said}"
    if bad:
        return f"non-finite state after the recovery: {bad[:3]}"
    return f"{stepped} outer steps after the fault, not {expected}" if stepped != expected else ""


def one_line(notes: list[str], says: str) -> str:
    return "" if len(notes) == 1 and says in notes[0] else f"expected one line saying {says!r}, got {notes}"


def check_regroup(inner: dict, per_node: int, nodes: int, settings: OuterSettings, path: str) -> str:
    """The 2 groups' checkpoint into one group of every rank, and that one's back into 2 groups."""
    from tools.export_checkpoint import consolidated_state_dict
    plain = build(inner, "fp32", per_node)
    problem = one_line(load(plain, path), "saved by 2 groups of nodes and this run has 1")
    if problem:
        return problem
    ref = build(inner, "fp32", per_node)   # the export's weights; the scalars as saved (qwZ's recorded orders)
    weights, meta = consolidated_state_dict(path)
    ref.load_module_state_dict(weights)
    ref.load_scalar_state(meta["engine"])
    if any(train(plain, list(range(FAULT_AT, STEPS)))) or nonfinite(plain):
        return "the regrouped run does not go on"
    train(ref, list(range(FAULT_AT, STEPS)))
    diff = differences(state(ref), state(plain), ignore=("loss_scaler", "global_step", "skipped_steps"))
    if diff:
        return f"unlike the plain engine from the global parameters: {diff[:3]}"
    save(plain, path + "-plain")
    back = Grouped(inner, "fp32", per_node, nodes, settings)
    problem = one_line(load(back.engine, path + "-plain"), "outer state")
    return problem or globals_are_the_mean(back) or goes_on(back)


def globals_are_the_mean(run: Grouped) -> str:
    """After a load that resets the outer state: each global copy is the mean over the groups of
    their loaded weights (2 groups: their sum halved, one rounding whatever the order)."""
    for f in range(run.sync.s.fragments):
        local = run.sync.local(f)
        every = [torch.empty_like(local) for _ in range(run.sync.cross.size)]
        dist.all_gather(every, local, group=run.sync.cross.group)
        if not torch.equal(run.sync.glob[f], torch.stack(every).sum(0) / len(every)):
            return f"the global copy of fragment {f} is not the mean of the groups' loaded weights"
    return ""


def goes_on(run: Grouped) -> str:
    if any(run.train(list(range(FAULT_AT, STEPS)))) or nonfinite(run.engine):
        return "the loaded run does not go on (skipped steps or non-finite state)"
    run.sync.drain()
    return ""


def other_settings(s: OuterSettings) -> list[OuterSettings]:
    """`s` with the outer gradients' code changed, with the delay flipped, with one fragment."""
    flip = {"none": "int4", "int4": "none", "topk2": "int4"}[s.quantization]
    return [OuterSettings(s.interval, fragments=s.fragments, quantization=flip, delay=s.delay),
            OuterSettings(s.interval, fragments=s.fragments, quantization=s.quantization, delay=1 - s.delay),
            OuterSettings(s.interval, fragments=1, quantization=s.quantization, delay=s.delay)]


def check_outer_toggle(inner: dict, per_node: int, nodes: int, settings: OuterSettings, path: str) -> str:
    problems = []
    for other in other_settings(settings):
        run = Grouped(inner, "fp32", per_node, nodes, other)
        problem = one_line(load(run.engine, path), "outer state")
        try:
            problem = problem or globals_are_the_mean(run) or goes_on(run)
        except AssertionError as e:   # agree(): the groups' copies differ, or their schedules
            run.sync.drain()
            problem = str(e)
        if problem:
            problems.append(f"{settings_name(other)}: {problem}")
    return "; ".join(problems)


@rank_entry
def diloco_rows(rank, world_size, rows: list[tuple[str, OuterSettings]], faults: tuple[str, ...], tmp: str):
    """{layout: {row name: {fault: cell}}} for each (layout of DILOCO_LAYOUTS, outer settings)
    (collective: every rank runs it)."""
    torch.use_deterministic_algorithms(False)
    tables = {}
    cell = lambda fn, *a: gathered(run_cell(fn, *a))   # noqa: E731
    for i, (layout, s) in enumerate(rows):
        per_node, nodes, inner = DILOCO_LAYOUTS[layout]
        row, path, args = {}, f"{tmp}/d{i}", (per_node, nodes, s)
        if "overflow" in faults:
            row["overflow"] = cell(check_group_skip, inner, "fp16", float("inf"), *args)
        if "nan" in faults:
            row["nan"] = cell(check_group_skip, inner, "bf16", float("nan"), *args)
        if {"resume", "reshard", "toggle"} & set(faults):
            row["resume"] = cell(check_group_resume, inner, *args, path)
        if "reshard" in faults:
            row["reshard"] = cell(check_regroup, inner, *args, path)
        if "toggle" in faults:
            row["toggle"] = cell(check_outer_toggle, inner, *args, path)
        if "fp16-resume" in faults:   # group 0 overflows before the save, group 1 does not
            row["fp16-resume"] = cell(check_group_resume, inner, *args, path + "-fp16", "fp16",
                                      {FAULT_AT - 1: float("inf")})
        if "bad-fragment" in faults:
            row["bad-fragment"] = cell(check_bad_fragment, inner, *args)
        tables.setdefault(layout, {})[f"{name(inner)}+{settings_name(s)}"] = row
    return tables


def gathered(cell: dict) -> dict:
    why = everyone(cell["why"])
    return {**cell, "ok": not why, "why": why}


# -- FSDP2 ------------------------------------------------------------------------------------------

def eval_loss(engine) -> torch.Tensor:
    """The loss of a fixed batch in evaluation (exact weights in both engines)."""
    engine.eval()
    with torch.no_grad():
        x = batch(99)
        loss = engine(x[:, :-1], x[:, 1:]).detach().clone()
    engine.train()
    return loss


def check_crossload(zero: dict, path: str, ranks_per_node: int) -> str:
    """FSDP2's checkpoint (the resume cell's) into the engine's ZeRO-3 with the same switches, and
    the engine's back into FSDP2."""
    problems = []
    saver = build(zero, "fp32", ranks_per_node, "fsdp2")
    load(saver, path)   # same layout: exact (the resume cell)
    want = eval_loss(saver)
    for there, source in (("zero", path), ("fsdp2", path + "-engine")):
        run = build(zero, "fp32", ranks_per_node, there)
        notes = load(run, source)
        resets = [n for n in notes if "error feedback" in n]
        if notes != resets or len(resets) > 1:
            problems.append(f"{there}: the load printed {notes}")
        got = eval_loss(run)
        if not torch.equal(got, want):
            problems.append(f"{there}: evaluation loss {got.item()!r} after the load, {want.item()!r} before the save")
        if there == "zero":
            save(run, path + "-engine")
            want = eval_loss(run)
        if any(train(run, list(range(FAULT_AT, STEPS)))) or nonfinite(run):
            problems.append(f"{there}: the loaded run does not go on")
    return "; ".join(problems)


@rank_entry
def fsdp2_rows(rank, world_size, combos: list[dict], faults: tuple[str, ...], ranks_per_node: int, tmp: str):
    torch.use_deterministic_algorithms(False)
    table = {}
    cell = lambda fn, *a: gathered(run_cell(fn, *a))   # noqa: E731
    for i, zero in enumerate(combos):
        row, path = {}, f"{tmp}/f{i}"
        if "overflow" in faults:
            row["overflow"] = cell(check_skip, zero, "fp16", float("inf"), ranks_per_node, "fsdp2")
        if "nan" in faults:
            row["nan"] = cell(check_skip, zero, "bf16", float("nan"), ranks_per_node, "fsdp2")
        if "resume" in faults or "engine" in faults:
            row["resume"] = cell(check_resume, zero, path, ranks_per_node, "fsdp2")
        if "engine" in faults:
            taken = accepted(zero, world_size, ranks_per_node)   # by the engine too
            row["engine"] = (cell(check_crossload, zero, path, ranks_per_node) if taken
                             else {"ok": True, "why": "n/a", "seconds": 0})
        table[name(zero)] = row
    return table


def run_diloco(rows: list[tuple[str, OuterSettings]], faults=DILOCO_FAULTS, timeout: float = 3000,
               pool: bool = False) -> dict:
    """{layout: {row name: {fault: {"ok", "why", "seconds"}}}} for DiLoCo on 4 ranks, a row per
    (layout, outer settings), all in one set of processes."""
    with tempfile.TemporaryDirectory() as tmp:
        return run_distributed(diloco_rows, 4, args=(rows, tuple(faults), tmp), timeout=timeout, pool=pool)[0]


def run_fsdp2(combos: list[dict], faults=FSDP2_FAULTS, world: int = 4, ranks_per_node: int = 2,
              timeout: float = 3000, pool: bool = False) -> dict:
    """{combination name: {fault: cell}} for FSDP2 + the plug-in (`pool`: as run_matrix's)."""
    with tempfile.TemporaryDirectory() as tmp:
        return run_distributed(fsdp2_rows, world, args=(combos, tuple(faults), ranks_per_node, tmp), timeout=timeout,
                               pool=pool)[0]
