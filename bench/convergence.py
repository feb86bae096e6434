#!/usr/bin/env python
"""Convergence benchmark (issue 7): ZeRO-3 against ZeRO++ (qwZ + hpZ + qgZ) on the bundled corpus.

    .venv/bin/python -m bench.convergence                 # 600 iterations per run, a few minutes each on 2 cores
    .venv/bin/python -m bench.convergence --iters 1000
    .venv/bin/python -m bench.convergence --quick         # ~30 iterations: a smoke test of the harness

Both runs are `train.py --config configs/demo.yaml` (less its ZeRO++ switches) under
torchrun with 4 ranks as 2 emulated nodes x 2 (`--ranks-per-node 2`), the same seed,
the same data order and the same tiny GPT (flags below override demo.yaml); the only
difference is the ZeRO flags:

    ZeRO-3          --zero-stage 3
    ZeRO++          --zero-stage 3 --zero-quantized-weights --zero-hpz-size 2 --zero-quantized-gradients
    ZeRO++ + LoCo   the same and --zero-loco (with --with-loco: qgZ's error feedback)
    ZeRO++ + deltas, ZeRO++ + LoCo + deltas
                    the same and --zero-quantized-weight-deltas (with --with-deltas)
    ... resumed     with --resume-nproc N: ZeRO++ + LoCo + deltas trained to the last
                    evaluation before half way on 4 ranks, saved, and resumed from that
                    checkpoint on N ranks (--resume-ranks-per-node) to the end

The harness parses train.py's Megatron-style stdout: the training lines
("iteration N/ M | ... | lm loss: X | ... | inter-node MB: Y |") and the
"validation loss at iteration N | lm loss value: X" lines. Criterion (issue 7):
ZeRO++'s final validation loss within 1% of ZeRO-3's, |ZeRO++/ZeRO-3 - 1| <= 0.01.

Writes bench/results/convergence.{json,png,md} (with --quick: a temporary
directory unless --out-dir is given). Each run is a subprocess with a time
limit; its process group is killed when the limit passes.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import RESULTS, ROOT, checkout_name
from bench.convergence_plot import notes, plot, table
from bench.megatron_log import parse_log

DATA_PREFIX = "work_dir/kjv_text_document"
TOKENIZER = "work_dir/kjv_sp.model"

ZERO3_FLAGS = ["--zero-stage", "3"]
ZEROPP_FLAGS = ["--zero-stage", "3", "--zero-quantized-weights", "--zero-hpz-size", "2",
                "--zero-quantized-gradients"]

TOLERANCE = 0.01
NAMES = ("ZeRO-3", "ZeRO++")
FSDP2_NAMES = ("FSDP2", "FSDP2 + ZeRO++")


def check_data():
    missing = [p for p in (DATA_PREFIX + ".bin", DATA_PREFIX + ".idx", TOKENIZER) if not (ROOT / p).is_file()]
    if missing:
        sys.exit(f"error: missing {', '.join(missing)}.\n"
                 f"Build the bundled corpus first: `bash scripts/quickstart.sh --train-iters 1` (sets up "
                 f".venv, builds the corpus, tokenizer and .bin/.idx, then trains briefly), or run just its "
                 f"data commands (python -m data.corpus, data.train_tokenizer, data.preprocess).")


def model_flags(a) -> list[str]:
    return ["--num-layers", str(a.num_layers), "--hidden-size", str(a.hidden_size),
            "--num-attention-heads", str(a.heads), "--seq-length", str(a.seq_length),
            "--max-position-embeddings", str(a.seq_length),
            "--micro-batch-size", str(a.micro_batch), "--global-batch-size", str(a.micro_batch * a.nproc),
            "--train-iters", str(a.iters), "--lr-warmup-iters", str(a.warmup),
            "--eval-interval", str(a.eval_interval), "--eval-iters", str(a.eval_iters),
            "--log-interval", str(a.log_interval), "--seed", str(a.seed),
            "--ranks-per-node", str(a.ranks_per_node)]


ZEROPP_YAML_KEYS = ("zero-quantized-weights", "zero-hpz-size", "zero-quantized-gradients")


def base_config(scratch: Path) -> Path:
    """configs/demo.yaml without its ZeRO++ switches (the demo runs ZeRO++, and a YAML switch
    cannot be turned off by a flag): each run's flags say which techniques it uses."""
    import yaml
    cfg = {k: v for k, v in yaml.safe_load((ROOT / "configs/demo.yaml").read_text()).items()
           if k not in ZEROPP_YAML_KEYS}
    path = scratch / "base.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def command(a, zero_flags: list[str], scratch: Path, root: Path = ROOT) -> list[str]:
    """train.py of the checkout `root` (the baseline may run another one: --baseline-root)."""
    ds = []
    zero = {k: v for k, v in (("stage3_param_persistence_threshold", a.persistence_threshold),
                              ("stage3_max_reuse_distance", a.reuse_distance)) if v is not None}
    if zero:   # every run the same stage-3 layout and reuse
        path = scratch.parent / "ds_config.json"
        path.write_text(json.dumps({"zero_optimization": zero}))
        ds = ["--deepspeed_config", str(path)]
    return ([str(ROOT / ".venv/bin/torchrun"), "--standalone", "--nproc-per-node", str(a.nproc), str(root / "train.py"),
             "--config", str(scratch.parent / "base.yaml")] + ds + model_flags(a) + zero_flags +
            ["--save", str(scratch / "checkpoints"), "--save-interval", str(a.iters),   # at the end only
             "--tensorboard-dir", str(scratch / "tensorboard")])


def run_resumed(name: str, a, flags: list[str], scratch: Path, timeout: float) -> dict:
    """`flags` trained on a.nproc ranks to the last evaluation before half way (so the resumed run
    sees the validation batches the others see) and stopped there by --exit-interval (which saves;
    --train-iters stays, and with it the data order), then resumed from that checkpoint on
    a.resume_nproc ranks (a.resume_ranks_per_node per node, the same global batch) to the end."""
    half = a.iters // 2 // a.eval_interval * a.eval_interval
    r1 = run_one(name + " (1st half)", command(a, flags, scratch) + ["--exit-interval", str(half)],
                 scratch.parent / (scratch.name + "_1.log"), timeout)
    second = argparse.Namespace(**{**vars(a), "nproc": a.resume_nproc, "ranks_per_node": a.resume_ranks_per_node,
                                   "micro_batch": a.micro_batch * a.nproc // a.resume_nproc})
    hpz = ["--zero-hpz-size", str(a.resume_ranks_per_node)]
    r2 = run_one(name + " (2nd half)", command(second, flags + hpz, scratch) + ["--load", str(scratch / "checkpoints")],
                 scratch.parent / (scratch.name + "_2.log"), timeout)
    r2["train"] = r1["train"] + [t for t in r2["train"] if t["iteration"] >= half + a.log_interval]   # whole windows
    r2["validation"] = [v for v in r1["validation"] if v["iteration"] <= half] + r2["validation"]
    r2.update(error=r1["error"] or r2["error"], wall_s=r1["wall_s"] + r2["wall_s"], resumed_at=half,
              command=r1["command"] + " ; " + r2["command"])
    return r2


def run_one(name: str, cmd: list[str], log_path: Path, timeout: float, root: Path = ROOT) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONPATH=str(root))
    print(f"[{name}] {shlex.join(cmd)}", flush=True)
    print(f"[{name}] log: {log_path} (time limit {timeout:.0f} s)", flush=True)
    start = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # its own process group: killable as a whole
        try:
            rc = proc.wait(timeout=timeout)
            error = None if rc == 0 else f"exit status {rc}"
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            error = f"timed out after {timeout:.0f} s"
    wall = time.time() - start
    text = log_path.read_text(errors="replace")
    result = {"name": name, "command": shlex.join(cmd), "wall_s": round(wall, 1), "error": error}
    result.update(parse_log(text))
    if error is None and not result["validation"]:
        result["error"] = "no validation loss in the log"
    if result["error"]:
        tail = "\n".join(text.splitlines()[-25:])
        result["log_tail"] = tail
        print(f"[{name}] FAILED ({result['error']}); last lines of the log:\n{tail}", flush=True)
    else:
        print(f"[{name}] done in {wall:.0f} s: final validation loss {result['validation'][-1]['loss']:.4f}",
              flush=True)
    return result


def summarize(r: dict, skip_first: bool = True) -> dict:
    train = r["train"]
    steady = train[1:] if skip_first and len(train) > 1 else train  # the first window holds start-up
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    return {
        "final_validation_loss": r["validation"][-1]["loss"] if r["validation"] else None,
        "final_validation_iteration": r["validation"][-1]["iteration"] if r["validation"] else None,
        "final_train_loss": train[-1]["loss"] if train else None,
        "test_loss": r["test"]["loss"] if r["test"] else None,
        "inter_node_mb_per_iter": round(mean([t["inter_mb"] for t in steady]), 3),
        "intra_node_mb_per_iter": round(mean([t["intra_mb"] for t in steady]), 3),
        "ms_per_iter": round(mean([t["iter_ms"] for t in steady]), 1),
        "wall_s": r["wall_s"],
    }


def report(runs: dict, setup: dict, out_dir: Path) -> dict:
    """Summary, verdict, convergence.{json,png,md} in out_dir, and the printed table."""
    B, C = setup.get("names", NAMES)
    tol = setup.get("tolerance", TOLERANCE)
    summary = {name: summarize(r) for name, r in runs.items()}

    base, cand = summary[B], summary.get(C)
    verdict = {"criterion": f"|{C} final validation loss / {B} final validation loss - 1| <= {tol}"}
    if cand is None:
        verdict.update(ratio=None, result="NOT RUN", reason=f"--baseline-only: {C} was not run")
    elif runs[B]["error"] or runs[C]["error"]:
        verdict.update(ratio=None, result="FAIL", reason="a run failed")
    else:
        ratio = cand["final_validation_loss"] / base["final_validation_loss"]
        verdict.update(ratio=round(ratio, 6), relative_difference_pct=round(100 * (ratio - 1), 3),
                       result="PASS" if abs(ratio - 1) <= tol else "FAIL",
                       inter_node_bytes_ratio=(round(cand["inter_node_mb_per_iter"] / base["inter_node_mb_per_iter"], 4)
                                               if base["inter_node_mb_per_iter"] else None))
        if f"{B} (seed+1)" in summary and not runs[f"{B} (seed+1)"]["error"]:
            verdict["seed_control_ratio"] = round(summary[f"{B} (seed+1)"]["final_validation_loss"] /
                                                  base["final_validation_loss"], 6)

    result = {"setup": setup, "verdict": verdict, "summary": summary, "runs": runs}
    (out_dir / "convergence.json").write_text(json.dumps(result, indent=1) + "\n")

    tbl = table(runs, summary)
    if verdict["ratio"] is not None:
        line = (f"{C} / {B} final validation loss: {verdict['ratio']:.4f} "
                f"({verdict['relative_difference_pct']:+.2f}%), criterion within {100 * tol:g}%: {verdict['result']}")
        if verdict.get("inter_node_bytes_ratio") is not None:
            line += f"; inter-node bytes per iteration: {verdict['inter_node_bytes_ratio']:.3f}x {B}'s"
        if "seed_control_ratio" in verdict:
            line += (f"; seed control ({B}, seed+1 / {B}): "
                     f"{verdict['seed_control_ratio']:.4f} ({100 * (verdict['seed_control_ratio'] - 1):+.2f}%)")
    else:
        line = f"criterion within {100 * tol:g}%: {verdict['result']} ({verdict['reason']})"
    m, nodes = setup["model"], setup["ranks"] // setup["ranks_per_node"]
    title = (f"GPT {m['num_layers']}L/{m['hidden_size']}h, seq {m['seq_length']}, batch {setup['global_batch']}, "
             f"{setup['ranks']} ranks = {nodes} nodes x {setup['ranks_per_node']}, {setup['iters']} iters\n"
             + (f"final val loss {C}/{B} = {verdict['ratio']:.4f} ({verdict['result']})"
                if verdict["ratio"] is not None else verdict["reason"]))
    try:
        plot(runs, verdict, out_dir / "convergence.png", title, tol, (B, C))
    except Exception as e:  # the numbers matter more than the figure
        print(f"warning: no plot ({e!r})")
    for name, c in summary.items():   # every other candidate against ZeRO-3 and ZeRO++
        if name in (B, C) or "seed" in name or runs[name]["error"] or cand is None:
            continue
        r3, rpp = (c["final_validation_loss"] / x["final_validation_loss"] for x in (base, cand))
        verdict.setdefault("candidates", {})[name] = {"vs_zero3": round(r3, 6), "vs_zeropp": round(rpp, 6)}
        line += (f"\n{name} / {B} final validation loss: {r3:.4f} ({100 * (r3 - 1):+.2f}%), / {C}: "
                 f"{rpp:.4f} ({100 * (rpp - 1):+.2f}%); inter-node bytes {c['inter_node_mb_per_iter']:.2f} MB/iter")
    md = [f"Convergence, {B} vs {C} (`{setup['zeropp_flags']}`): {m['num_layers']}-layer GPT, "
          f"hidden {m['hidden_size']}, seq {m['seq_length']}, global batch {setup['global_batch']}, "
          f"{setup['iters']} iterations, {setup['ranks']} CPU ranks as {nodes} emulated nodes x "
          f"{setup['ranks_per_node']}, seed {setup['seed']}, `{setup.get('invocation', 'python -m bench.convergence')}`:",
          "", tbl, "", line, ""] + notes(runs, summary, verdict, setup)
    (out_dir / "convergence.md").write_text("\n".join(md))

    print()
    print(tbl)
    print()
    print(line)
    print(f"results: {out_dir / 'convergence.json'}, {out_dir / 'convergence.png'}, {out_dir / 'convergence.md'}")
    return verdict


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=None, help="training iterations per run (default 600; 30 with --quick)")
    p.add_argument("--quick", action="store_true",
                   help="~30 iterations, results to a temporary directory unless --out-dir: a smoke test")
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=8, help="per rank; global batch = micro x ranks")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--warmup", type=int, default=None, help="lr warmup iterations (default: iters/20)")
    p.add_argument("--eval-interval", type=int, default=None, help="default: iters/12")
    p.add_argument("--eval-iters", type=int, default=None, help="global batches per evaluation (default 8)")
    p.add_argument("--log-interval", type=int, default=None, help="default: 10 (5 with --quick)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--seed-control", action="store_true",
                   help="also run ZeRO-3 with --seed + 1: the seed-to-seed spread of the final loss, "
                        "to put the 1%% criterion in context")
    p.add_argument("--baseline-only", action="store_true",
                   help="run ZeRO-3 only (no comparison; for a build without ZeRO++)")
    p.add_argument("--with-loco", action="store_true",
                   help="also run ZeRO++ with qgZ's error feedback (--zero-loco, zeropp/techniques/loco.py)")
    p.add_argument("--with-deltas", action="store_true",
                   help="also run ZeRO++ with INT4 weight deltas, and with deltas and LoCo")
    p.add_argument("--resume-nproc", type=int, default=None,
                   help="also run ZeRO++ + LoCo + deltas resumed half way on this many ranks")
    p.add_argument("--resume-ranks-per-node", type=int, default=4)
    p.add_argument("--persistence-threshold", type=int, default=None,
                   help="stage3_param_persistence_threshold of every run (default 1e5: only the embedding is partitioned)")
    p.add_argument("--reuse-distance", type=int, default=None,
                   help="stage3_max_reuse_distance of every run (0: re-gather every weight in backward)")
    p.add_argument("--zeropp-flags", default=shlex.join(ZEROPP_FLAGS),
                   help="the candidate's ZeRO flags (default: %(default)s)")
    p.add_argument("--sharding", choices=["zero", "fsdp2"], default="zero",
                   help="fsdp2: both runs on torch's FSDP2 (train.py --sharding fsdp2), the candidate with the "
                        "ZeRO++ plug-in; runs named FSDP2 and FSDP2 + ZeRO++")
    p.add_argument("--baseline-flags", default=shlex.join(ZERO3_FLAGS),
                   help="the baseline's ZeRO flags (default: %(default)s), e.g. the candidate's flags but one")
    p.add_argument("--baseline-root", default=None,
                   help="a checkout of this repository to run the baseline from (default: this one), e.g. "
                        "the commit before a change, to compare the change with what it replaced")
    p.add_argument("--names", default=None, help="the two runs' names, baseline first: e.g. 'ZeRO-3,DiLoCo H=16'")
    p.add_argument("--tolerance", type=float, default=TOLERANCE,
                   help="the criterion: |candidate / baseline final validation loss - 1| (default %(default)s)")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds per run (default: 180 + 3 s per iteration)")
    p.add_argument("--out-dir", default=None, help="default: bench/results (a temporary directory with --quick)")
    p.add_argument("--keep-logs", action="store_true", help="keep the runs' logs and checkpoints")
    p.add_argument("--replot", metavar="JSON",
                   help="no runs: redo the table, figure and markdown from a convergence.json")
    a = p.parse_args(argv)
    if a.replot:
        data = json.loads(Path(a.replot).read_text())
        out_dir = Path(a.out_dir) if a.out_dir else Path(a.replot).parent
        out_dir.mkdir(parents=True, exist_ok=True)
        verdict = report(data["runs"], data["setup"], out_dir)
        return 0 if verdict["result"] in ("PASS", "NOT RUN") else 1
    a.iters = a.iters or (30 if a.quick else 600)
    a.warmup = a.warmup if a.warmup is not None else max(1, a.iters // 20)
    a.eval_interval = a.eval_interval or max(1, a.iters // (3 if a.quick else 12))
    a.eval_iters = a.eval_iters or (2 if a.quick else 8)
    a.log_interval = a.log_interval or (5 if a.quick else 10)
    timeout = a.timeout or 180 + 3.0 * a.iters

    check_data()
    scratch = Path(tempfile.mkdtemp(prefix="convergence-"))
    out_dir = Path(a.out_dir) if a.out_dir else (scratch / "results" if a.quick else RESULTS)
    out_dir.mkdir(parents=True, exist_ok=True)

    base_config(scratch)
    B, C = a.names.split(",") if a.names else FSDP2_NAMES if a.sharding == "fsdp2" else NAMES
    sharding = ["--sharding", a.sharding] if a.sharding != "zero" else []
    base_root = Path(a.baseline_root).resolve() if a.baseline_root else ROOT
    variants = [(B, shlex.split(a.baseline_flags) + sharding, a.seed)]
    if not a.baseline_only:
        variants.append((C, shlex.split(a.zeropp_flags) + sharding, a.seed))
    if a.with_loco:
        variants.append(("ZeRO++ + LoCo", shlex.split(a.zeropp_flags) + ["--zero-loco"], a.seed))
    deltas = ["--zero-quantized-weight-deltas"]
    if a.with_deltas:
        variants.append(("ZeRO++ + deltas", shlex.split(a.zeropp_flags) + deltas, a.seed))
        variants.append(("ZeRO++ + LoCo + deltas", shlex.split(a.zeropp_flags) + ["--zero-loco"] + deltas, a.seed))
    if a.resume_nproc:
        name = f"ZeRO++ + LoCo + deltas, resumed on {a.resume_nproc // a.resume_ranks_per_node}x{a.resume_ranks_per_node}"
        variants.append((name, shlex.split(a.zeropp_flags) + ["--zero-loco"] + deltas, a.seed))
    if a.seed_control:
        variants.append((f"{B} (seed+1)", ZERO3_FLAGS + sharding, a.seed + 1))
    runs = {}
    try:
        for name, flags, seed in variants:
            tag = re.sub(r"\W+", "_", name.replace("++", "pp")).strip("_")
            (scratch / tag).mkdir()
            sub = argparse.Namespace(**{**vars(a), "seed": seed})
            if "resumed" in name:
                runs[name] = run_resumed(name, sub, flags, scratch / tag, timeout)
            else:
                root = base_root if name == B else ROOT
                runs[name] = run_one(name, command(sub, flags, scratch / tag, root), scratch / f"{tag}.log", timeout,
                                     root)
    finally:
        if not a.keep_logs:
            for child in scratch.iterdir():
                if child != out_dir:
                    shutil.rmtree(child) if child.is_dir() else child.unlink()
    import torch
    invocation = ("python -m bench.convergence" + (f" --iters {a.iters}" if a.iters != 600 and not a.quick else "")
                  + (" --quick" if a.quick else "") + (" --seed-control" if a.seed_control else "")
                  + (" --baseline-only" if a.baseline_only else "") + (" --with-loco" if a.with_loco else "")
                  + (" --with-deltas" if a.with_deltas else "")
                  + (f" --resume-nproc {a.resume_nproc} --resume-ranks-per-node {a.resume_ranks_per_node}"
                     if a.resume_nproc else "")
                  + (f" --seed {a.seed}" if a.seed != 1234 else "")
                  + (f" --sharding {a.sharding} --zeropp-flags {shlex.quote(a.zeropp_flags)}" if a.sharding != "zero" else "")
                  + (f" --tolerance {a.tolerance}" if a.tolerance != TOLERANCE else "")
                  + (f" --names {shlex.quote(a.names)} --zeropp-flags {shlex.quote(a.zeropp_flags)}" if a.names else "")
                  + (f" --baseline-flags {shlex.quote(a.baseline_flags)}" if a.baseline_flags != shlex.join(ZERO3_FLAGS)
                     else "")
                  + (f" --baseline-root {a.baseline_root}" if a.baseline_root else "")
                  + (f" --persistence-threshold {a.persistence_threshold}" if a.persistence_threshold is not None
                     else "") + (f" --reuse-distance {a.reuse_distance}" if a.reuse_distance is not None else ""))
    setup = {"invocation": invocation, "names": [B, C], "tolerance": a.tolerance, "sharding": a.sharding,
             "model": {"num_layers": a.num_layers, "hidden_size": a.hidden_size, "heads": a.heads,
                       "seq_length": a.seq_length},
             "ranks": a.nproc, "ranks_per_node": a.ranks_per_node, "micro_batch": a.micro_batch,
             "global_batch": a.micro_batch * a.nproc, "iters": a.iters, "warmup": a.warmup,
             "eval_interval": a.eval_interval, "eval_iters": a.eval_iters, "log_interval": a.log_interval,
             "seed": a.seed, "persistence_threshold": a.persistence_threshold, "reuse_distance": a.reuse_distance,
             "config": "configs/demo.yaml (lr 1e-3 cosine to 1e-4, AdamW, wd 0.1, clip 1.0, fp32)",
             "zero3_flags": a.baseline_flags, "zeropp_flags": a.zeropp_flags,
             "baseline_root": checkout_name(base_root), "candidate_root": checkout_name(ROOT),
             "inter_node_mb_note": "mean over ranks of the bytes sent across emulated nodes per iteration, "
                                   "averaged over the log windows after the first",
             "host": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__,
             "python": platform.python_version(),
             "date": datetime.datetime.now().isoformat(timespec="seconds")}
    verdict = report(runs, setup, out_dir)
    if a.keep_logs:
        print(f"logs and checkpoints: {scratch}")
    elif not any(scratch.iterdir()):
        scratch.rmdir()
    return 0 if verdict["result"] in ("PASS", "NOT RUN") and not any(r["error"] for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
