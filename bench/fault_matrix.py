"""The fault matrix: every ZeRO stage x ZeRO++ switch combination that the config
validator accepts, run through the faults a long job meets.

    python -m bench.fault_matrix                  # the full matrix, table + JSON
    python -m bench.fault_matrix --quick          # the share the default test suite runs

The combinations are generated, never listed: every value of every switch key
(stage, qwZ, hpZ size, qgZ, LoCo, Hadamard, INT4 weight deltas) is crossed and
kept when `DeepSpeedConfig` and `validate_topology` accept it on the layout
(4 ranks as 2 nodes x 2; also 2 x 1 and 1 x 4). Each accepted combination runs,
on a tiny GPT, these faults (one column each):

- overflow: fp16 (static loss scale), an infinite loss on one rank at step K.
  Every rank skips the step and the run continues as if the step never came:
  the final state equals that of a run without it, bit for bit.
- nan: the same with a NaN loss in bf16.
- resume: fp32, save at step K (training/checkpoint.py, real files), go on;
  a fresh engine loads it and goes on: the two end bit-identical.
- reshard: that checkpoint loaded on another node count (1 node x 4 ranks):
  the run continues (finite, applied steps), and every state that is reset
  is named in one line, no other.
- world: the same on half the ranks, one a node, hpZ off there.
- toggle: that checkpoint loaded with each switch flipped that the validator
  accepts flipped: the same.
- auto: the ZeRO++ switches set to "auto", resolved by the planner on a fast
  and on a slow link with the other switches as set: the choice is accepted
  by the validator and trains.
After every step, every rank's replicated state (loss scale, counters, the
carried state's scalars, replicated tensors) must be the same.

Then the two modes beside the engine's switches, a table each (bench/fault_modes.py says
what each column means there):
- streaming DiLoCo (zeropp/outer/diloco.py), 2 groups on 2 nodes x 2 (ZeRO-3 inside) and on 4 nodes
  x 1 (qwZ + qgZ inside), a row per outer setting (exact or INT4, merged at once or a step
  late): overflow and nan (one group skips, the other goes on), resume, reshard (into one
  group and back), toggle (other outer settings), an fp16 resume with groups whose loss scales
  differ, a non-finite fragment in one group; and through train.py (bench/diloco_job.py): a
  SIGTERM to one group, a loss diverging in one group first, an export of a run shorter than H;
  and with each group its own torchrun job (train.py --lighthouse, bench/groups_job.py): a group
  killed mid-exchange and restarted, a Lighthouse restart, a late start and a clean stop, the
  one-job model bit for bit, groups of different models, a 60 s link outage between one of three
  groups on emulated sites and the others;
- FSDP2 + the ZeRO++ plug-in (zeropp/fsdp/engine.py), a row per switch combination FSDP2
  accepts on 2 nodes x 2: overflow, nan, resume, engine (its checkpoint into the engine's
  ZeRO-3 and back).
"""
import argparse
import itertools
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from bench.diloco_job import FAULTS as JOB_FAULTS
from bench.diloco_job import demo_flags, run_cells
from bench.groups_job import FAULTS as GROUP_FAULTS
from bench.groups_job import run_group_cells
from bench.fault_cells import (FAULTS, SHORT, SWITCH_VALUES, accepted, check_auto, check_load_elsewhere,
                               check_resume, check_skip, name, run_cell)
from bench.fault_modes import (DILOCO_FAULTS, DILOCO_LAYOUTS, FSDP2_FAULTS, outer_settings, quick_settings, run_diloco,
                               run_fsdp2)
from parallel.spawn import run_distributed


def combinations(world: int = 4, ranks_per_node: int = 2, sharding: str = "zero") -> list[dict]:
    """Every switch combination the validator (and FSDP2's, for "fsdp2") accepts on `world` ranks
    in nodes of `ranks_per_node`."""
    keys = list(SWITCH_VALUES)
    out = []
    for values in itertools.product(*(SWITCH_VALUES[k] for k in keys)):
        zero = {k: v for k, v in zip(keys, values) if v is not None}
        if accepted(zero, world, ranks_per_node, sharding):
            out.append(zero)
    return out


def quick(combos: list[dict]) -> list[dict]:
    """The default suite's share: each stage plain, each switch alone, and every switch at once
    (chosen by rule from the generated list)."""
    def on(z):
        return [k for k in SHORT if z.get(k) not in (None, False)] + (["hpz"] if z["zero_hpz_partition_size"] > 1 else [])
    most = max(len(on(z)) for z in combos)
    out = [z for z in combos if len(on(z)) == 0 or len(on(z)) == most]
    for switch in list(SHORT) + ["hpz"]:   # the fewest switches that include this one
        with_it = [z for z in combos if switch in on(z)]
        if with_it:
            out.append(min(with_it, key=lambda z: len(on(z))))
    unique = {name(z): z for z in out}
    return list(unique.values())


def toggles(zero: dict, world: int, ranks_per_node: int) -> list[dict]:
    """`zero` with one switch flipped, each that the validator accepts flipped."""
    out = []
    for key, values in SWITCH_VALUES.items():
        if key == "stage":
            continue
        for v in values:
            other = {k: x for k, x in {**zero, key: v}.items() if x is not None}
            if v != zero.get(key) and accepted(other, world, ranks_per_node) and other not in out:
                out.append(other)
    return out


def rank_main(rank, world_size, combos: list[dict], faults: tuple[str, ...], ranks_per_node: int, tmp: str):
    """Every cell of the matrix for `combos` on this layout (collective: every rank runs it)."""
    torch.use_deterministic_algorithms(False)
    table = {}
    for i, zero in enumerate(combos):
        row = {}
        path = os.path.join(tmp, f"c{i}")
        if "overflow" in faults:
            row["overflow"] = run_cell(check_skip, zero, "fp16", float("inf"), ranks_per_node)
        if "nan" in faults:
            row["nan"] = run_cell(check_skip, zero, "bf16", float("nan"), ranks_per_node)
        if "resume" in faults or "reshard" in faults or "toggle" in faults:
            row["resume"] = run_cell(check_resume, zero, path, ranks_per_node)
        layout = (world_size, world_size // ranks_per_node)
        if "reshard" in faults:   # another node count: all ranks in one node, or one rank a node
            rpn = world_size if layout[1] > 1 else 1
            row["reshard"] = (run_cell(check_load_elsewhere, zero, layout, zero, path, rpn)
                              if accepted(zero, world_size, rpn) else {"ok": True, "why": "n/a", "seconds": 0})
        if "toggle" in faults:
            cells = [run_cell(check_load_elsewhere, zero, layout, other, path, ranks_per_node)
                     for other in toggles(zero, world_size, ranks_per_node)]
            row["toggle"] = {"ok": all(c["ok"] for c in cells), "why": "; ".join(c["why"] for c in cells if c["why"]),
                             "seconds": sum(c["seconds"] for c in cells), "count": len(cells)}
        if "auto" in faults and zero["stage"] == 3:
            row["auto"] = run_cell(check_auto, zero, ranks_per_node)
        table[name(zero)] = row
    return table


def on_fewer_ranks(rank, world_size, combos: list[dict], tmp: str, saved_layout: tuple[int, int]) -> dict:
    """Each combination's checkpoint (saved by rank_main on `saved_layout`) loaded on this smaller
    world, one rank a node, with hpZ off there (and the deltas with it, where the validator says
    they need it): the "world" column."""
    table = {}
    for i, zero in enumerate(combos):
        there = {**zero, "zero_hpz_partition_size": 1}
        if not accepted(there, world_size, 1):   # the deltas' bits go with them
            there.pop("zero_quantized_weight_deltas")
            there.pop("zero_quantized_weight_deltas_bits", None)
        table[name(zero)] = {"world": run_cell(check_load_elsewhere, zero, saved_layout, there,
                                               os.path.join(tmp, f"c{i}"), 1)}
    return table


def run_matrix(combos: list[dict], faults=FAULTS, world: int = 4, ranks_per_node: int = 2,
               timeout: float = 3000) -> dict:
    """{combination name: {fault: {"ok", "why", "seconds"}}} for `combos` on this layout; with
    "world" among the faults, each checkpoint is loaded on half the ranks too."""
    with tempfile.TemporaryDirectory() as tmp:
        table = run_distributed(rank_main, world, args=(combos, tuple(faults), ranks_per_node, tmp),
                                timeout=timeout)[0]
        if "world" in faults and "resume" in faults and world > 1:
            fewer = run_distributed(on_fewer_ranks, world // 2, args=(combos, tmp, (world, world // ranks_per_node)),
                                    timeout=timeout)[0]
            for combo, row in fewer.items():
                table[combo].update(row)
    return table


def layouts() -> list[tuple[int, int]]:
    """(world, ranks per node): the main layout and a few others."""
    return [(4, 2), (2, 1), (4, 4)]


def print_table(title: str, table: dict, faults=FAULTS):
    print(f"\n{title}")
    print(f"{'combination':<34}" + "".join(f"{f:>11}" for f in faults) + f"{'seconds':>9}")
    for combo, row in table.items():
        cells = "".join(f"{('pass' if row[f]['ok'] else 'FAIL') if f in row else '-':>11}" for f in faults)
        print(f"{combo:<34}{cells}{sum(c['seconds'] for c in row.values()):9.1f}")
    for combo, row in table.items():
        for f, c in row.items():
            if not c["ok"]:
                print(f"  {combo} / {f}: {c['why']}")


def modes(quick_share: bool) -> dict:
    """The rows of streaming DiLoCo (per layout) and FSDP2 + the plug-in (bench/fault_modes.py), printed."""
    out = {"diloco": {}, "fsdp2": {}}
    out["diloco"] = run_diloco([(layout, s) for layout in DILOCO_LAYOUTS
                                for s in (quick_settings(layout) if quick_share else outer_settings())])
    for layout, table in out["diloco"].items():
        per_node, nodes, inner = DILOCO_LAYOUTS[layout]
        seconds = sum(c["seconds"] for row in table.values() for c in row.values())
        print_table(f"streaming DiLoCo, 4 ranks as {layout} in 2 groups of {nodes} node(s), {name(inner)} inside: "
                    f"{len(table)} outer settings ({seconds:.0f} s)", table, DILOCO_FAULTS)
    with tempfile.TemporaryDirectory() as tmp:   # train.py under torchrun, as a user runs it
        start = time.perf_counter()
        out["diloco"]["train.py 2x2"] = table = {"H 4, exact": run_cells(demo_flags, Path(tmp))}
    print_table(f"streaming DiLoCo through train.py, 4 ranks as 2 groups of a 2-rank node: a fault in one group "
                f"({time.perf_counter() - start:.0f} s)", table, JOB_FAULTS)
    with tempfile.TemporaryDirectory() as tmp:   # each group its own torchrun job (--lighthouse)
        start = time.perf_counter()
        out["diloco"]["groups as jobs"] = table = {"H 4, F 2, exact": run_group_cells(demo_flags, Path(tmp))}
    print_table(f"groups that survive each other (--lighthouse), 2 groups of 2 ranks, each its own torchrun job "
                f"({time.perf_counter() - start:.0f} s)", table, GROUP_FAULTS)
    combos = combinations(4, 2, "fsdp2")
    combos = quick(combos) if quick_share else combos
    start = time.perf_counter()
    out["fsdp2"]["2x2"] = table = run_fsdp2(combos)
    print_table(f"FSDP2 + the ZeRO++ plug-in, 4 ranks as 2 nodes x 2: {len(combos)} combinations FSDP2 accepts "
                f"({time.perf_counter() - start:.0f} s)", table, FSDP2_FAULTS)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the default test suite's share")
    p.add_argument("--out", default="bench/results/fault_matrix.json")
    a = p.parse_args(argv)
    from bench import cpu_model
    print(f"CPU: {cpu_model()}, torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}")
    report = {"cpu": cpu_model(), "capability": torch.backends.cpu.get_cpu_capability(), "layouts": {}}
    for world, rpn in layouts():
        combos = combinations(world, rpn)
        if a.quick or (world, rpn) != (4, 2):
            combos = quick(combos)
        start = time.perf_counter()
        table = run_matrix(combos, world=world, ranks_per_node=rpn)
        title = (f"{world} ranks as {world // rpn} node(s) x {rpn}: {len(combos)} combinations the validator "
                 f"accepts ({time.perf_counter() - start:.0f} s)")
        print_table(title, table)
        report["layouts"][f"{world // rpn}x{rpn}"] = table
    report["modes"] = modes(a.quick)
    tables = list(report["layouts"].values()) + [t for mode in report["modes"].values() for t in mode.values()]
    cells = [c for t in tables for row in t.values() for c in row.values()]
    print(f"\n{sum(c['ok'] for c in cells)} of {len(cells)} cells pass")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {a.out}")
    return 0 if all(c["ok"] for c in cells) else 1


if __name__ == "__main__":
    raise SystemExit(main())
