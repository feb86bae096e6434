"""The fault matrix of the engine's switches (`python -m scenarios.faults` runs and prints it): every
ZeRO stage x ZeRO++ switch combination that the config validator accepts, generated, never
listed (every value of every switch key of fault_cells.SWITCH_VALUES crossed, kept when
`DeepSpeedConfig` and `validate_topology` accept it on the layout), each through the faults a
long job meets, on a tiny GPT (one column each):

- overflow: fp16 (static loss scale), an infinite loss on one rank at step K. Every rank skips
  the step and the run ends where a run without it ends, bit for bit.
- nan: the same with a NaN loss in bf16.
- resume: fp32, save at step K (training/checkpoint/, real files), go on; a fresh engine loads
  it and goes on: the two end bit-identical.
- reshard: that checkpoint loaded on another node count: the run continues (finite, applied
  steps), and every state that is reset is named in one line, no other.
- world: the same on half the ranks, one a node, hpZ off there.
- toggle: that checkpoint loaded with each switch flipped that the validator accepts flipped.
- auto: the ZeRO++ switches "auto", resolved by the planner on a fast and on a slow link with the
  other switches as set: the choice is accepted by the validator and trains.
After every step, every rank's replicated state (loss scale, counters, the carried state's
scalars, replicated tensors) must be the same.
"""
import itertools
import os
import tempfile

import torch

from scenarios.fault_cells import (FAULTS, SHORT, SWITCH_VALUES, accepted, check_auto, check_load_elsewhere,
                               check_resume, check_skip, name, rank_entry, run_cell)
from scenarios.harness.spawn import run_distributed


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


@rank_entry
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


@rank_entry
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
               timeout: float = 3000, pool: bool = False) -> dict:
    """{combination name: {fault: {"ok", "why", "seconds"}}} for `combos` on this layout; with
    "world" among the faults, each checkpoint is loaded on half the ranks too. `pool`: on kept
    rank processes (scenarios/harness/spawn.py; the tests'), else fresh ones."""
    with tempfile.TemporaryDirectory() as tmp:
        table = run_distributed(rank_main, world, args=(combos, tuple(faults), ranks_per_node, tmp),
                                timeout=timeout, pool=pool)[0]
        if "world" in faults and "resume" in faults and world > 1:
            fewer = run_distributed(on_fewer_ranks, world // 2, args=(combos, tmp, (world, world // ranks_per_node)),
                                    timeout=timeout, pool=pool)[0]
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
