"""Convergence: a baseline against a candidate (default ZeRO-3 against ZeRO++: qwZ + hpZ + qgZ)
trained by train.py on the bundled corpus from the same seed, data order and tiny GPT; the
loss curves, the final validation loss, the bytes each sends across emulated nodes.

    python -m bench.convergence                  # 600 iterations per run: minutes a run on 2 cores
    python -m bench.convergence --quick          # 30 iterations to a temporary folder: a smoke run
    python -m bench.convergence --with-loco --with-deltas --resume-nproc 8 --seed-control
    python -m bench.convergence --from bench/results/convergence.json        # redo table, plot, notes
    python -m bench.convergence --wallclock 20 --slow-link LINK.json --run 'ZeRO-3=zero3' \\
        --run 'DiLoCo H=16=diloco-h16' A.json B.json --out bench/results/convergence_wallclock

Every run is `train.py --config configs/demo.yaml` (less its ZeRO++ switches, so each run's
flags say which techniques it uses) under torchrun on 4 ranks as 2 emulated nodes x 2
(default: 2 layers, hidden 128, seq 64, micro-batch 8); the runs differ only in their ZeRO flags:

    ZeRO-3          --zero-stage 3           (--baseline-flags)
    ZeRO++          --zero-stage 3 --zero-quantized-weights --zero-hpz-size 2 --zero-quantized-gradients
    ZeRO++ + LoCo   the same and --zero-loco (--with-loco: qgZ's error feedback)
    ZeRO++ + deltas, ZeRO++ + LoCo + deltas: --zero-quantized-weight-deltas too (--with-deltas)
    ... resumed     (--resume-nproc N) ZeRO++ + LoCo + deltas trained to the last evaluation
                    before half way, saved, and resumed on N ranks to the end

The limit: |candidate / baseline final validation loss - 1| <= --tolerance (default 0.01); each
run has a time limit (its process group killed past it). Writes convergence.{json,png,md} to
--out-dir (default bench/results). --wallclock RATE: loss against tokens and against hours on
a link of RATE Mbit/s, from convergence JSON files and the slow-link bench's step times
(iterations x that system's step there), to --out.{json,md,png}.
"""
from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
import tempfile
import time
from pathlib import Path

from bench import RESULTS, ROOT, checkout_name
from bench.convergence.report import parse_log, report, wallclock
from scenarios.harness.jobs import check_data, run_logged

ZERO3_FLAGS = ["--zero-stage", "3"]
ZEROPP_FLAGS = ["--zero-stage", "3", "--zero-quantized-weights", "--zero-hpz-size", "2", "--zero-quantized-gradients"]
ZEROPP_YAML_KEYS = ("zero-quantized-weights", "zero-hpz-size", "zero-quantized-gradients")
TOLERANCE = 0.01
NAMES = ("ZeRO-3", "ZeRO++")
FSDP2_NAMES = ("FSDP2", "FSDP2 + ZeRO++")


def model_flags(a) -> list[str]:
    return ["--num-layers", str(a.num_layers), "--hidden-size", str(a.hidden_size),
            "--num-attention-heads", str(a.heads), "--seq-length", str(a.seq_length),
            "--max-position-embeddings", str(a.seq_length),
            "--micro-batch-size", str(a.micro_batch), "--global-batch-size", str(a.micro_batch * a.nproc),
            "--train-iters", str(a.iters), "--lr-warmup-iters", str(a.warmup),
            "--eval-interval", str(a.eval_interval), "--eval-iters", str(a.eval_iters),
            "--log-interval", str(a.log_interval), "--seed", str(a.seed), "--ranks-per-node", str(a.ranks_per_node)]


def base_config(scratch: Path):
    """configs/demo.yaml without its ZeRO++ switches (a YAML switch cannot be turned off by a flag)."""
    import yaml
    cfg = yaml.safe_load((ROOT / "configs/demo.yaml").read_text())
    (scratch / "base.yaml").write_text(yaml.safe_dump({k: v for k, v in cfg.items() if k not in ZEROPP_YAML_KEYS}))


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


def run_one(name: str, cmd: list[str], log: Path, timeout: float, root: Path = ROOT) -> dict:
    print(f"[{name}] {shlex.join(cmd)}\n[{name}] log: {log} (time limit {timeout:.0f} s)", flush=True)
    start = time.time()
    error, text = run_logged(cmd, log, timeout, root)
    result = {"name": name, "command": shlex.join(cmd), "wall_s": round(time.time() - start, 1), "error": error,
              **parse_log(text)}
    if error is None and not result["validation"]:
        result["error"] = "no validation loss in the log"
    if result["error"]:
        result["log_tail"] = "\n".join(text.splitlines()[-25:])
        print(f"[{name}] FAILED ({result['error']}); last lines of the log:\n{result['log_tail']}", flush=True)
    else:
        print(f"[{name}] done in {result['wall_s']:.0f} s: final validation loss {result['validation'][-1]['loss']:.4f}",
              flush=True)
    return result


def run_resumed(name: str, a, flags: list[str], scratch: Path, timeout: float) -> dict:
    """`flags` trained on a.nproc ranks to the last evaluation before half way (the resumed run sees
    the validation batches the others see), stopped there by --exit-interval (which saves), then
    resumed on a.resume_nproc ranks (a.resume_ranks_per_node a node, the same global batch)."""
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


def variants(a) -> list[tuple[str, list[str], int]]:
    B, C = a.names
    sharding = ["--sharding", a.sharding] if a.sharding != "zero" else []
    zpp, loco, deltas = shlex.split(a.zeropp_flags), ["--zero-loco"], ["--zero-quantized-weight-deltas"]
    out = [(B, shlex.split(a.baseline_flags) + sharding, a.seed)]
    out += [] if a.baseline_only else [(C, zpp + sharding, a.seed)]
    out += [("ZeRO++ + LoCo", zpp + loco, a.seed)] if a.with_loco else []
    out += [("ZeRO++ + deltas", zpp + deltas, a.seed), ("ZeRO++ + LoCo + deltas", zpp + loco + deltas, a.seed)
            ] if a.with_deltas else []
    if a.resume_nproc:
        out.append((f"ZeRO++ + LoCo + deltas, resumed on {a.resume_nproc // a.resume_ranks_per_node}x"
                    f"{a.resume_ranks_per_node}", zpp + loco + deltas, a.seed))
    return out + ([(f"{B} (seed+1)", ZERO3_FLAGS + sharding, a.seed + 1)] if a.seed_control else [])


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.convergence", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add = p.add_argument
    add("--iters", type=int, help="training iterations per run (default 600; 30 with --quick)")
    add("--quick", action="store_true", help="30 iterations, results to a temporary folder unless --out-dir")
    for flag, default in (("--num-layers", 2), ("--hidden-size", 128), ("--heads", 4), ("--seq-length", 64),
                          ("--micro-batch", 8), ("--nproc", 4), ("--ranks-per-node", 2), ("--seed", 1234),
                          ("--resume-ranks-per-node", 4)):
        add(flag, type=int, default=default, help="default %(default)s")
    add("--warmup", type=int, help="lr warmup iterations (default: iters/20)")
    add("--eval-interval", type=int, help="default: iters/12 (iters/3 with --quick)")
    add("--eval-iters", type=int, help="global batches per evaluation (default 8; 2 with --quick)")
    add("--log-interval", type=int, help="default: 10 (5 with --quick)")
    add("--seed-control", action="store_true", help="also the baseline with --seed + 1: the seed-to-seed spread")
    add("--baseline-only", action="store_true", help="the baseline only (no comparison)")
    add("--with-loco", action="store_true", help="also ZeRO++ with qgZ's error feedback (--zero-loco)")
    add("--with-deltas", action="store_true", help="also ZeRO++ with INT4 weight deltas, and with deltas and LoCo")
    add("--resume-nproc", type=int, help="also ZeRO++ + LoCo + deltas resumed half way on this many ranks")
    add("--persistence-threshold", type=int, help="stage3_param_persistence_threshold of every run")
    add("--reuse-distance", type=int, help="stage3_max_reuse_distance of every run")
    add("--zeropp-flags", default=shlex.join(ZEROPP_FLAGS), help="the candidate's flags (default: %(default)s)")
    add("--baseline-flags", default=shlex.join(ZERO3_FLAGS), help="the baseline's flags (default: %(default)s)")
    add("--sharding", choices=["zero", "fsdp2"], default="zero",
        help="fsdp2: both runs on FSDP2 (train.py --sharding fsdp2), the candidate with the ZeRO++ plug-in")
    add("--baseline-root", help="a checkout to run the baseline from (default: this one)")
    add("--names", help="the two runs' names, baseline first: e.g. 'ZeRO-3,DiLoCo H=16'")
    add("--tolerance", type=float, default=TOLERANCE, help="the limit on |candidate / baseline - 1| (%(default)s)")
    add("--timeout", type=float, help="seconds per run (default: 180 + 3 s per iteration)")
    add("--out-dir", help="default: bench/results (a temporary folder with --quick)")
    add("--keep-logs", action="store_true", help="keep the runs' logs and checkpoints")
    add("--from", dest="replot", metavar="JSON", help="no runs: the table, plot and notes again from a convergence JSON")
    add("--wallclock", type=int, metavar="RATE", help="no runs: loss against hours at RATE Mbit/s (see above)")
    add("--slow-link", help="with --wallclock: the slow-link bench's JSON for the same model")
    add("--run", action="append", metavar="NAME=SYSTEM", help="with --wallclock: a run and its slow-link system")
    add("--out", help="with --wallclock: the output path without suffix")
    add("files", nargs="*", help="with --wallclock: convergence JSON files (one per seed)")
    a = p.parse_args(argv)
    if a.wallclock:
        if not (a.slow_link and a.run and a.out and a.files):
            p.error("--wallclock needs --slow-link, --run, --out and convergence JSON files")
        wallclock(a.files, a.slow_link, a.wallclock, dict(r.rsplit("=", 1) for r in a.run), Path(a.out))
        return 0
    if a.replot:
        data = json.loads(Path(a.replot).read_text())
        out_dir = Path(a.out_dir or Path(a.replot).parent)
        out_dir.mkdir(parents=True, exist_ok=True)
        return 0 if report(data["runs"], data["setup"], out_dir)["result"] in ("PASS", "NOT RUN") else 1
    a.iters = a.iters or (30 if a.quick else 600)
    a.warmup = a.warmup if a.warmup is not None else max(1, a.iters // 20)
    a.eval_interval = a.eval_interval or max(1, a.iters // (3 if a.quick else 12))
    a.eval_iters = a.eval_iters or (2 if a.quick else 8)
    a.log_interval = a.log_interval or (5 if a.quick else 10)
    a.names = a.names.split(",") if a.names else FSDP2_NAMES if a.sharding == "fsdp2" else NAMES
    timeout = a.timeout or 180 + 3.0 * a.iters
    check_data()
    scratch = Path(tempfile.mkdtemp(prefix="convergence-"))
    out_dir = Path(a.out_dir) if a.out_dir else (scratch / "results" if a.quick else RESULTS)
    out_dir.mkdir(parents=True, exist_ok=True)
    base_config(scratch)
    base_root = Path(a.baseline_root).resolve() if a.baseline_root else ROOT
    runs = {}
    try:
        for name, flags, seed in variants(a):
            tag = re.sub(r"\W+", "_", name.replace("++", "pp")).strip("_")
            (scratch / tag).mkdir()
            sub = argparse.Namespace(**{**vars(a), "seed": seed})
            root = base_root if name == a.names[0] else ROOT
            runs[name] = (run_resumed(name, sub, flags, scratch / tag, timeout) if "resumed" in name else
                          run_one(name, command(sub, flags, scratch / tag, root), scratch / f"{tag}.log", timeout, root))
    finally:
        if not a.keep_logs:
            for child in scratch.iterdir():
                if child != out_dir:
                    shutil.rmtree(child) if child.is_dir() else child.unlink()
    setup = {"names": list(a.names), "tolerance": a.tolerance, "sharding": a.sharding, "iters": a.iters,
             "model": {"num_layers": a.num_layers, "hidden_size": a.hidden_size, "heads": a.heads,
                       "seq_length": a.seq_length},
             "ranks": a.nproc, "ranks_per_node": a.ranks_per_node, "micro_batch": a.micro_batch,
             "global_batch": a.micro_batch * a.nproc, "warmup": a.warmup, "eval_interval": a.eval_interval,
             "eval_iters": a.eval_iters, "log_interval": a.log_interval, "seed": a.seed,
             "persistence_threshold": a.persistence_threshold, "reuse_distance": a.reuse_distance,
             "config": "configs/demo.yaml (lr 1e-3 cosine to 1e-4, AdamW, wd 0.1, clip 1.0, fp32)",
             "baseline_flags": a.baseline_flags, "candidate_flags": a.zeropp_flags,
             "baseline_root": checkout_name(base_root), "candidate_root": checkout_name(ROOT),
             "inter_node_mb_note": "mean over ranks of the bytes sent across emulated nodes per iteration, "
                                   "averaged over the log windows after the first"}
    verdict = report(runs, setup, out_dir)
    if a.keep_logs:
        print(f"logs and checkpoints: {scratch}")
    elif not any(scratch.iterdir()):
        scratch.rmdir()
    return 0 if verdict["result"] in ("PASS", "NOT RUN") and not any(r["error"] for r in runs.values()) else 1
