"""Faults: what a long job meets (overflow, NaN, resume, reshard, a killed or cut-off group, a
careless input), run through the engine, its modes and train.py; a cell passes or says what
went wrong. Three commands:

    python -m scenarios.faults [--quick]        # the fault matrix: a table per part, bench/results/fault_matrix.json
    python -m scenarios.faults groups [--cells kill-one-group,punisher]   # groups as jobs: groups_job.json
    python -m scenarios.faults inputs           # careless inputs through the real commands: cli_errors.json

The matrix's parts (--parts):
- engine: every ZeRO stage x ZeRO++ switch combination the validator accepts on 4 ranks as
  2 nodes x 2 (also 2 x 1 and 1 x 4, their --quick share), through overflow, nan, resume,
  reshard, world, toggle and auto (scenarios/fault_matrix.py says what each checks);
- diloco: streaming DiLoCo, 2 groups on 2 nodes x 2 (ZeRO-3 inside) and on 4 nodes x 1 (qwZ +
  qgZ inside), a row per outer setting (scenarios/fault_modes.py);
- job: streaming DiLoCo through train.py under torchrun (scenarios/diloco_job.py);
- groups: each group its own torchrun job (train.py --lighthouse, scenarios/groups_job.py);
- fsdp2: FSDP2 + the ZeRO++ plug-in, each switch combination FSDP2 accepts on 2 nodes x 2.
The limit is exactness: a cell passes when its run ends bit for bit where the reference ends
(or says one line naming what was reset), else it prints why. Duration: the whole matrix takes
hours on 2 cores, --quick tens of minutes; `groups` minutes a cell (the punisher a 10-minute
job); `inputs` a few seconds a case. job, groups and inputs need the bundled corpus
(scripts/quickstart.sh); link-outage and heal-interrupted need root (network namespaces).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
import time
from pathlib import Path

from scenarios.harness.results import RESULTS, provenance, write_result
from scenarios.harness.jobs import check_data, listed, usage_error

PARTS = ("engine", "diloco", "job", "groups", "fsdp2")


def pick(faults: tuple, wanted: list | None) -> tuple:
    return faults if wanted is None else tuple(f for f in faults if f in wanted)


def timed(title: str, run, faults) -> dict:
    from scenarios.fault_matrix import print_table
    start = time.perf_counter()
    table = run()
    print_table(f"{title} ({time.perf_counter() - start:.0f} s)", table, faults)
    return table


def matrix(a) -> tuple[dict, list]:
    from scenarios.diloco_job import FAULTS as JOB_FAULTS
    from scenarios.diloco_job import demo_flags, run_cells
    from scenarios.fault_cells import FAULTS, name
    from scenarios.fault_matrix import combinations, layouts, quick, run_matrix
    from scenarios.fault_modes import (DILOCO_FAULTS, DILOCO_LAYOUTS, FSDP2_FAULTS, outer_settings, quick_settings,
                                   run_diloco, run_fsdp2)
    from scenarios.groups_job import FAULTS as GROUP_FAULTS
    from scenarios.groups_job import run_group_cells
    parts, wanted = listed(a.parts, PARTS, "--parts"), a.faults and a.faults.split(",")
    report, tables = {"layouts": {}, "modes": {"diloco": {}, "fsdp2": {}}}, []
    for world, rpn in layouts() if "engine" in parts else []:
        if a.layouts and f"{world // rpn}x{rpn}" not in a.layouts.split(","):
            continue
        combos = combinations(world, rpn)
        combos = (quick(combos) if a.quick or (world, rpn) != (4, 2) else combos)[:a.limit]
        faults = pick(FAULTS, wanted)
        report["layouts"][f"{world // rpn}x{rpn}"] = timed(
            f"{world} ranks as {world // rpn} node(s) x {rpn}: {len(combos)} combinations the validator accepts",
            lambda: run_matrix(combos, faults, world=world, ranks_per_node=rpn), faults)
    modes = report["modes"]
    if "diloco" in parts:
        faults = pick(DILOCO_FAULTS, wanted)
        rows = [(lay, s) for lay in DILOCO_LAYOUTS for s in (quick_settings(lay) if a.quick else outer_settings())]
        modes["diloco"] = run_diloco(rows[:a.limit], faults)
        for layout, table in modes["diloco"].items():
            per_node, nodes, inner = DILOCO_LAYOUTS[layout]
            timed(f"streaming DiLoCo, 4 ranks as {layout} in 2 groups of {nodes} node(s), {name(inner)} inside",
                  lambda: table, faults)
    for part, key, faults, cells, title in (
            ("job", "train.py 2x2", JOB_FAULTS, lambda f, tmp: {"H 4, exact": run_cells(demo_flags, tmp, f)},
             "streaming DiLoCo through train.py, 4 ranks as 2 groups of a 2-rank node: a fault in one group"),
            ("groups", "groups as jobs", GROUP_FAULTS,
             lambda f, tmp: {"H 4, F 2, exact": run_group_cells(demo_flags, tmp, f)},
             "groups that survive each other (--lighthouse), 2 groups of 2 ranks, each its own torchrun job")):
        if part in parts:
            with tempfile.TemporaryDirectory() as tmp:   # train.py under torchrun, as a user runs it
                faults = pick(faults, wanted)
                modes["diloco"][key] = timed(title, lambda: cells(faults, Path(tmp)), faults)
    if "fsdp2" in parts:
        combos = combinations(4, 2, "fsdp2")
        combos = (quick(combos) if a.quick else combos)[:a.limit]
        faults = pick(FSDP2_FAULTS, wanted)
        modes["fsdp2"]["2x2"] = timed(f"FSDP2 + the ZeRO++ plug-in, 4 ranks as 2 nodes x 2: {len(combos)} "
                                      f"combinations FSDP2 accepts", lambda: run_fsdp2(combos, faults), faults)
    tables = list(report["layouts"].values()) + [t for mode in modes.values() for t in mode.values()]
    return report, [c for t in tables for row in t.values() for c in row.values()]


def groups(a) -> tuple[dict, list]:
    from scenarios.diloco_job import demo_flags
    from scenarios.harness.jobs import FIGURES
    from scenarios.groups_job import CELLS, MORE
    cells = {**CELLS, **MORE}
    rows = {}
    names = listed(a.cells or ",".join([*CELLS, "three-groups-two-kills"]), cells, "--cells")
    if a.workdir is not None and (there := [c for c in names if (Path(a.workdir) / c).exists()]):
        usage_error(f"--workdir {a.workdir}: {', '.join(there)} is there from an earlier run; pass a new folder")
    check_data()
    with tempfile.TemporaryDirectory() if a.workdir is None else contextlib.nullcontext(a.workdir) as tmp:
        for cell in names:
            (Path(tmp) / cell).mkdir(parents=True)
            start = time.perf_counter()
            why = cells[cell](demo_flags, Path(tmp) / cell)
            rows[cell] = {"ok": not why, "why": why, "seconds": round(time.perf_counter() - start, 1),
                          **FIGURES.get(cell, {}), "provenance": provenance()}
            print(f"{cell:24s} {'ok' if not why else 'FAILED'} ({rows[cell]['seconds']:.0f} s)"
                  + (f"\n{why}" if why else ""), flush=True)
    old = Path(a.out)   # cells run before by another command stay, each with its own provenance
    kept = json.loads(old.read_text()).get("cells", {}) if old.exists() else {}
    return {"cells": {**kept, **rows}}, list(rows.values())


def inputs(a) -> tuple[dict, list]:
    from scenarios.cli_errors import base, cases, checkpoint_cases, files, run
    check_data()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        todo = cases(tmp, files(tmp))
        if a.start_at or a.limit is None or a.limit > len(todo):   # these train a checkpoint first
            todo += checkpoint_cases(tmp, base(tmp))
        if a.start_at:
            todo = todo[next(i for i, (n, _) in enumerate(todo) if n.startswith(a.start_at)):]
        for name, argv in todo[:a.limit]:
            status, message = run(argv)
            rows.append({"input": name, "status": status, "message": message.replace(tmp, "$TMP")})
            print(f"{status:3d}  {name}: {rows[-1]['message']}", flush=True)
    if a.markdown:
        esc = lambda s: s.replace("|", "\\|")   # noqa: E731
        Path(a.markdown).write_text("\n".join(["| input | exit status | message printed |", "|---|---|---|"] + [
            f"| {esc(r['input'])} | {r['status']} | {esc(r['message'])} |" for r in rows]) + "\n")
    # a careless input passes when it ends in one `error:` line or is accepted ("trains"/"exit 0"), never a traceback
    return {"rows": rows}, [{"ok": not r["message"].startswith("TRACEBACK")} for r in rows]


OUT = {"matrix": "fault_matrix.json", "groups": "groups_job.json", "inputs": "cli_errors.json"}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m scenarios.faults", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", nargs="?", choices=list(OUT), default="matrix")
    p.add_argument("--quick", action="store_true", help="matrix: the default test suite's share")
    p.add_argument("--parts", help=f"matrix: some of {','.join(PARTS)} (default: all)")
    p.add_argument("--layouts", help="matrix, engine: some of 2x2,2x1,1x4 (nodes x ranks per node; default: all)")
    p.add_argument("--faults", help="matrix: only these columns, e.g. overflow,resume (default: every part's all)")
    p.add_argument("--limit", type=int, help="matrix: the first N combinations or outer settings a table; "
                                             "inputs: the first N cases (a smoke test)")
    p.add_argument("--cells", help="groups: the cells, comma-separated (default: the suite's and three-groups-two-kills)")
    p.add_argument("--workdir", help="groups: keep the groups' logs and checkpoints here (default: a temporary folder)")
    p.add_argument("--start-at", help="inputs: from the first case whose name starts so")
    p.add_argument("--markdown", help="inputs: also write the table to this file")
    p.add_argument("--out", help="the JSON (default bench/results/ fault_matrix.json, groups_job.json, cli_errors.json)")
    a = p.parse_args(argv)
    a.out = a.out or str(RESULTS / OUT[a.what])
    report, cells = {"matrix": matrix, "groups": groups, "inputs": inputs}[a.what](a)
    print(f"\n{sum(c['ok'] for c in cells)} of {len(cells)} cells pass")
    print(f"wrote {write_result(a.out, report)}")
    return 0 if all(c["ok"] for c in cells) else 1


if __name__ == "__main__":
    raise SystemExit(main())
