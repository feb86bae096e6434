"""Streaming DiLoCo's faults as a user meets them: train.py under torchrun, 4 gloo ranks as 2
groups of one 2-rank node (`--ranks-per-node 2 --group-size 1`), ZeRO-3 inside each group.
A cell returns "" when it holds, else what went wrong (`python -m scenarios.faults` prints them as
the "DiLoCo job" table; tests/integration/groups/test_diloco_job.py asserts each on a tiny corpus).

- signal-one-group: SIGTERM to group 1's ranks only (a node's preemption) after a few
  iterations. Every rank stops after the same iteration, within 90 s, and saves it; the job
  exits 0 and the checkpoint the tracker names is complete and loadable.
- diverge-one-group: fp32 SGD at a learning rate that diverges, one group first. Every rank
  stops after the same iteration and saves the last good weights there; what every rank says
  it saved is the tracker's latest, complete and loadable. diverge-one-group-topk2: the same with
  sparse outer gradients (`--outer-quantization topk2`).
- short-export: a run shorter than H (H = 100, 6 iterations, saved at 3 and 6): the run says
  the final synchronization is its only one, and the exported model of the last checkpoint is
  not the one of iteration 3 (no exchange before the end: then, the initialization).
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import torch

from scenarios.harness.results import ROOT
from scenarios.harness.jobs import DATA_PREFIX, TOKENIZER, check_data, child_pids, finish, launch, problem, worker_ranks  # noqa: F401

GROUPS = ["--global-batch-size", "8", "--zero-stage", "3", "--ranks-per-node", "2", "--group-size", "1"]
FAULTS = ("signal-one-group", "diverge-one-group", "diverge-one-group-topk2", "short-export")
TOPK2 = ["--outer-quantization", "topk2"]


def loadable(save: Path) -> tuple[int | None, str]:
    """The iteration the tracker names and "" when its checkpoint is complete (every file's
    checksum, no .tmp left) and exports finite weights; else what is wrong."""
    from tools.export_checkpoint import consolidated_state_dict
    from training.checkpoint import iteration_dir, latest_iteration, resolve_checkpoint, verify_checksums
    it = latest_iteration(str(save))
    path = resolve_checkpoint(str(save))
    if it is None or path != iteration_dir(str(save), it):
        return it, f"the tracker names {it}, the checkpoint found is {path}"
    problems = verify_checksums(path)
    left = [p for p in os.listdir(save) if p.endswith(".tmp")]
    if problems or left:
        return it, f"iteration {it}: {problems[:1] or left}"
    weights, meta = consolidated_state_dict(path)
    if meta["iteration"] != it or not all(torch.isfinite(w).all() for w in weights.values()):
        return it, f"iteration {it}: meta says {meta['iteration']}, or a weight is not finite"
    return it, ""


# -- the cells -----------------------------------------------------------------------------------------

def signal_one_group(base: list[str], save: Path) -> str:
    """`base`: train.py's flags for the data and the model, --save `save` among them."""
    proc = launch(4, [*base, *GROUPS, "--train-iters", "100000", "--outer-sync-interval", "4", "--log-interval", "1",
                      "--save-interval", "100000", "--eval-interval", "100000"])
    seen = []
    while sum("lm loss:" in line for line in seen) < 3:
        line = proc.stdout.readline()
        if not line:
            return problem("".join(seen), "the job ended before its third iteration")
        seen.append(line)
    workers = worker_ranks(proc)
    if sorted(workers) != [0, 1, 2, 3]:
        finish(proc, 0)
        return f"found the workers {workers}"
    for r in (2, 3):   # group 1
        os.kill(workers[r], signal.SIGTERM)
    out, hung = finish(proc, 90)
    if hung or proc.returncode != 0:
        return problem(out, "the job hung" if hung else f"exit status {proc.returncode}")
    it, bad = loadable(save)
    said = f"SIGTERM received: stopped after iteration {it}; checkpoint {save / f'iter_{it:07d}'}"
    return bad or ("" if said in out else problem(out, f"no line '{said}'"))


def diverge_one_group(base: list[str], save: Path, outer: tuple = ()) -> str:
    """`outer`: more outer flags (the topk2 cell: sparse outer gradients, the unsent rest in the weights)."""
    proc = launch(4, [*base, *GROUPS, *outer, "--train-iters", "30", "--outer-sync-interval", "4", "--optimizer", "sgd",
                      "--lr", "6", "--lr-decay-style", "constant", "--lr-warmup-iters", "0", "--clip-grad", "0",
                      "--log-interval", "1", "--save-interval", "2", "--eval-interval", "1000"])
    out, hung = finish(proc, 300)   # its start included, on 2 busy cores
    if hung or proc.returncode != 1:
        return problem(out, "the job hung" if hung else f"exit status {proc.returncode}, not 1 (diverged)")
    saved = {line.split("saved to ")[1].split(";")[0] for line in out.splitlines() if "not finite" in line}
    it, bad = loadable(save)
    if bad:
        return bad
    expected = str(save / f"iter_{it:07d}")
    return "" if saved == {expected} else problem(out, f"the ranks said they saved {saved}; the latest is {expected}")


SHORT = ["--train-iters", "6", "--outer-sync-interval", "100", "--eval-interval", "3", "--eval-iters", "2",
         "--save-interval", "3", "--log-interval", "3"]


def short_run(base: list[str]) -> tuple[list[str], str, int]:
    """6 iterations with H = 100, evaluated and saved at 3 and 6: (argv, output, exit status)."""
    argv = [*base, *GROUPS, *SHORT]
    proc = launch(4, argv)
    out, hung = finish(proc, 180)
    return argv, out, -1 if hung else proc.returncode


def short_export(out: str, rc: int, save: Path) -> str:
    """The checks of short-export on short_run's output and checkpoints."""
    from tools.export_checkpoint import consolidated_state_dict
    from training.checkpoint import iteration_dir
    if rc != 0:
        return problem(out, f"exit status {rc}")
    start = consolidated_state_dict(iteration_dir(str(save), 3))[0]
    end = consolidated_state_dict(str(save))[0]
    if all(torch.equal(end[k], v) for k, v in start.items()):
        return "the last checkpoint exports the weights of iteration 3"
    for said in ("--outer-sync-interval 100 >= --train-iters 6: the final synchronization at the end of training "
                 "is the only one", "final exchange of all 1 fragment(s) after iteration 6"):
        if said not in out:
            return problem(out, f"no line '{said}'")
    return ""


def run_cells(base, tmp: Path, faults=FAULTS) -> dict:
    """{fault: {"ok", "why", "seconds"}}; `base(out_dir)`: train.py's flags for data and model,
    saving to out_dir / "ckpt"."""
    row = {}
    for fault in faults:
        out_dir = tmp / fault
        out_dir.mkdir(parents=True)
        start = time.perf_counter()
        if fault == "short-export":
            _, out, rc = short_run(base(out_dir))
            why = short_export(out, rc, out_dir / "ckpt")
        else:
            why = {"signal-one-group": signal_one_group, "diverge-one-group": diverge_one_group,
                   "diverge-one-group-topk2": lambda b, c: diverge_one_group(b, c, TOPK2)}[fault](
                base(out_dir), out_dir / "ckpt")
        row[fault] = {"ok": not why, "why": why, "seconds": time.perf_counter() - start}
    return row


def demo_flags(out: Path) -> list[str]:
    """A tiny GPT on the bundled corpus."""
    check_data()
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--max-position-embeddings", "16", "--micro-batch-size", "2", "--lr", "3e-3", "--lr-decay-style",
            "cosine", "--lr-warmup-iters", "2", "--data-path", str(ROOT / DATA_PREFIX), "--split", "90,10,0",
            "--tokenizer-model", str(ROOT / TOKENIZER), "--data-cache-path", str(out / "cache"),
            "--eval-iters", "2", "--save", str(out / "ckpt"), "--tensorboard-dir", str(out / "tb")]
