#!/usr/bin/env python
"""ZeRO-3 vs ZeRO++ (and FSDP2, DeepSpeed) over an emulated slow inter-node link.

    sudo .venv/bin/python -m bench.slow_link                    # full sweep, bf16 (~15-20 min on 2 quiet cores)
    sudo .venv/bin/python -m bench.slow_link --dtype fp32 --out bench/results/slow_link_fp32.json
    sudo .venv/bin/python -m bench.slow_link --quick            # smoke test: 2 rates, 2 systems
    sudo .venv/bin/python -m bench.slow_link --rates 200,0 --systems zero3-reuse0,zeropp,auto --steps 8 --profile

Buckets: our rows and DeepSpeed's get stage3_prefetch_bucket_size = reduce_bucket_size =
parameters // --bucket-fraction (default 8) and stage3_max_reuse_distance 0; FSDP2's unit
is one transformer block (fully_shard per block, then the root). Per (system, rate) the
table gives the link time (veth bytes of the busier direction / rate), the bound
max(unthrottled step, link time), step / bound and the exposed communication, and under
it issue 17's goals with PASS/FAIL (bench/slow_link_goals.py). "auto" is resolved by
planner.auto.resolve at every rate (bench/slow_link_auto.py).

Two network namespaces, nodeA and nodeB (two "nodes"), joined by a veth pair
vA <-> vB (192.0.2.1 / 192.0.2.2, a documentation range that exists only inside the
namespaces) rate-limited in both directions with a tc tbf qdisc. In each namespace
torchrun starts 2 ranks (multi-node static rendezvous over the veth addresses,
GLOO_SOCKET_IFNAME = the veth), so LOCAL_WORLD_SIZE=2 gives 2 nodes x 2 ranks: traffic
between the two ranks of a node stays on that namespace's loopback (the fast
"NVLink"), only node-to-node traffic crosses the throttled link.

The sweep makes --repeats passes over the systems (odd passes take the systems and the
rates in reverse order). In each pass, for each system, a fresh pair of torchruns runs
bench/slow_link_worker.py: the ranks build the system once, then for each link rate in
turn (the driver sets the qdisc between them) run bench.zero_systems.timed_loop (warm-up
steps, then timed steps; one step = forward + backward + optimizer step, its time the
slowest rank's): one "segment". Reported per (system, rate), over the pooled timed steps
of its segments: the
median step time, throughput, the bytes that crossed the link per step read from the
veth counters at the start and end of the timed steps (between barriers, by local rank 0
of each node), and the inter-node bytes per step that our Communicator counted (our
rows) and that wrappers on torch.distributed counted (all rows; same ring model), both
summed over ranks (= over the link's two directions).

Needs root and iproute2 (ip, tc); without them it prints a skip line and exits 0. The
namespaces are removed afterwards, also on errors and Ctrl-C, and leftovers of a
crashed run are removed at start.
"""
from __future__ import annotations

import argparse
import atexit
import importlib.util
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import RESULTS, ROOT, cpu_model
from bench.netns import RANKS_PER_NODE, TBF_LATENCY, netns_down, netns_up, tbf_burst
from bench.slow_link_auto import chosen
from bench.slow_link_report import mb, rate_name, render
from bench.slow_link_sweep import run_system, segment, summarize

DEFAULT_RATES = [100, 200, 1000, 0]  # Mbit/s; 0 = no qdisc (the veth's own speed)
DEFAULT_SYSTEMS = ["zero3-reuse0", "zero3", "zeropp-qwz", "zeropp-hpz", "zeropp-qgz", "zeropp", "auto", "fsdp2",
                   "fsdp2-hpz", "deepspeed-z3-reuse0", "deepspeed-z3-hpz"]
QUICK_SYSTEMS = ["zero3-reuse0", "zeropp"]


def versions():
    v = {"python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
         "kernel": platform.release(), "cpu_model": cpu_model()}
    try:
        import torch
        v["torch"] = torch.__version__
        v["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    except Exception:
        pass
    try:
        from importlib.metadata import version
        v["deepspeed"] = version("deepspeed")
    except Exception:
        v["deepspeed"] = None
    return v


def deepspeed_importable() -> bool:
    r = subprocess.run([sys.executable, "-c", "import deepspeed"], capture_output=True, timeout=120,
                       env={**os.environ, "DS_ACCELERATOR": "cpu"})
    return r.returncode == 0


def zeropp_in_build() -> bool:
    """False while zeropp.initialize still refuses the ZeRO++ keys."""
    src = (ROOT / "zeropp" / "__init__.py").read_text()
    return "is not in this build yet" not in src


# --------------------------------------------------------------------------------------
def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default=",".join(map(str, DEFAULT_RATES)),
                   help="link rates in Mbit/s, comma separated; 0 = unlimited (no qdisc)")
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS))
    p.add_argument("--steps", type=int, default=6, help="timed steps per segment, after its warm-up")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps at the start of each segment")
    p.add_argument("--repeats", type=int, default=2,
                   help="passes over the systems (odd passes in reverse order, rates too); each "
                        "(system, rate) row pools one segment per pass")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=192)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--bucket-fraction", type=int, default=8,
                   help="prefetch and reduce buckets = parameters // this (ours, DeepSpeed); 0: no bucket "
                        "sizes set (each system's default; ours: zeropp/bucket_sizing.py); FSDP2: one block")
    p.add_argument("--profile", action="store_true",
                   help="ours: per phase, ms per step each rank was blocked in Work.wait() "
                        "(Communicator.wait_seconds, where the engine has it)")
    p.add_argument("--timeout", type=float, default=240, help="seconds per (system, rate) before it is an error")
    p.add_argument("--setup-timeout", type=float, default=240,
                   help="seconds for a system's ranks to start and build it")
    p.add_argument("--quick", action="store_true",
                   help="smoke test: rates 200,0, ZeRO-3 and ZeRO++, 1 warm-up + 3 steps, 1 pass")
    p.add_argument("--out", default=None, help=f"results JSON (also .md, .png beside it); default "
                   f"{RESULTS / 'slow_link.json'}, with --quick a temporary file")
    p.add_argument("--plot", default=None, help="default: --out with .png")
    p.add_argument("--from-json", default=None,
                   help="run nothing: re-render the tables, --out (.json/.md) and the plot from this results file")
    args = p.parse_args(argv)
    if args.out is None:
        args.out = (str(Path(tempfile.gettempdir()) / "slow_link_quick.json") if args.quick
                    else str(RESULTS / "slow_link.json"))
    if args.from_json:
        render(json.loads(Path(args.from_json).read_text()), Path(args.out), Path(args.plot) if args.plot else None)
        return 0

    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if os.geteuid() != 0 or missing:
        why = "not root" if os.geteuid() != 0 else f"{' and '.join(missing)} not found"
        print(f"slow_link: SKIPPED ({why}): the emulated link needs root and iproute2 (ip, tc) "
              f"to create network namespaces and a tc qdisc")
        return 0

    from bench.system_catalog import (
        DEEPSPEED,
        LABELS,
        SLOW_LINK_SYSTEMS,
        ZEROPP,
        make_model,
        num_params,
        zero_section,
    )
    block_params = lambda a: sum(p.numel() for p in make_model(a, meta=True).blocks[0].parameters())
    rates = [int(r) for r in args.rates.split(",") if r.strip()]
    systems = [s for s in args.systems.split(",") if s]
    if args.quick:
        rates, systems = [200, 0], QUICK_SYSTEMS
        args.steps, args.warmup, args.repeats = 3, 1, 1
    for s in systems:
        if s not in SLOW_LINK_SYSTEMS:
            p.error(f"unknown system {s!r}; choose from {', '.join(SLOW_LINK_SYSTEMS)}")
    notes = []
    if any(s in DEEPSPEED for s in systems) and not deepspeed_importable():
        notes.append("DeepSpeed rows skipped: `import deepspeed` fails in this environment")
        systems = [s for s in systems if s not in DEEPSPEED]
    if any(s in DEEPSPEED for s in systems):
        notes.append("DeepSpeed's qwZ and qgZ need CUDA (its quantizer kernels); only its hpZ runs on CPU")
    if "auto" in systems and importlib.util.find_spec("planner.auto") is None:
        notes.append("auto: planner.auto is not in this tree; its rows are errors")
    if not zeropp_in_build():
        dropped = [s for s in systems if s in ZEROPP and not s.startswith("deepspeed")]
        if dropped:
            notes.append(f"ZeRO++ rows skipped (zeropp.initialize: not in this build yet): {', '.join(dropped)}")
            systems = [s for s in systems if s not in dropped]

    a = {"num_layers": args.num_layers, "hidden": args.hidden, "heads": args.heads, "vocab": args.vocab,
         "seq": args.seq, "micro_batch": args.micro_batch, "warmup": args.warmup, "steps": args.steps,
         "seed": args.seed, "dtype": args.dtype, "ranks_per_node": RANKS_PER_NODE, "repeats": args.repeats,
         "bucket_fraction": args.bucket_fraction, "profile": args.profile}
    psi = num_params(a)
    elt = 2 if args.dtype == "bf16" else 4
    block = block_params(a)
    ver = versions()
    head = (f"GPT {a['num_layers']} layers, hidden {a['hidden']}, {a['heads']} heads, vocab {a['vocab']}, seq "
            f"{a['seq']}: {psi:,} parameters ({psi * elt / 1e6:.2f} MB in {args.dtype}); micro-batch "
            f"{a['micro_batch']} per rank, 2 nodes x {RANKS_PER_NODE} ranks (global batch "
            f"{2 * RANKS_PER_NODE * a['micro_batch']}); {a['repeats']} pass(es) over the systems (then in reverse "
            f"order), each (system, rate) {a['warmup']} warm-up + {a['steps']} timed steps per pass, median over "
            f"the pooled timed steps; "
            f"{args.dtype}, AdamW; gloo on CPU, 1 thread per rank, {os.cpu_count()} cores ({ver.get('cpu_model')}, "
            f"torch CPU capability {ver.get('cpu_capability')}). Buckets: ours and DeepSpeed prefetch = reduce = "
            + (f"{psi // args.bucket_fraction:,} elements (1/{args.bucket_fraction} of the model)"
               if args.bucket_fraction else "not set (each system's default)") + ", reuse distance 0; "
            f"FSDP2: one transformer block ({block:,} parameters, 1/{psi / block:.1f} of the model)")
    print(head, flush=True)
    for n in notes:
        print("NOTE: " + n, flush=True)

    logdir = Path(tempfile.mkdtemp(prefix="slow_link_logs_"))
    atexit.register(netns_down)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rows, t_start = [], time.monotonic()
    # `repeats` passes over the systems, each system freshly launched in every pass: odd
    # passes take the systems and the rates in reverse order (ABBA), and each row pools its
    # segments, so that a burst of load from elsewhere on the machine hits one segment of
    # several, and every system and rate is measured both early and late.
    schedule = []  # (pass, system, rates in order)
    for i in range(args.repeats):
        fwd = i % 2 == 0
        schedule += [(i, s, rates if fwd else rates[::-1]) for s in (systems if fwd else systems[::-1])]
    segs = {}  # (system, rate) -> [run, ...]
    load_before = os.getloadavg()
    port = 29500
    try:
        netns_up()
        for i, s, order in schedule:
            port += 1
            print(f"pass {i + 1}/{args.repeats}: {LABELS.get(s, s)} ({s}):", flush=True)

            def on_rate(rate, run):
                segs.setdefault((s, rate), []).append(run)  # noqa: B023 (called before the loop moves on)
                if run.get("error"):
                    print(f"  [{rate_name(rate)}] ERROR ({run['wall_s']:.0f} s): "
                          f"{run['error'].strip().splitlines()[-1][:200]}", flush=True)
                else:
                    sg = segment(run, a)
                    auto = f", auto -> {chosen(sg['auto'].get('switches'))}" if sg["auto"] else ""
                    print(f"  [{rate_name(rate)}] {1000 * statistics.median(sg['times']):.0f} ms/step; link "
                          f"{mb((sg['tx_a'] + sg['tx_b'] - sg['overhead']) / sg['n'])} MB/step "
                          f"({run['wall_s']:.0f} s, load {sg['loadavg']:.1f}{auto})", flush=True)

            t_sys = time.monotonic()
            run_system(s, order, a, port, args.setup_timeout, args.timeout, logdir, on_rate=on_rate)
            print(f"  ({time.monotonic() - t_sys:.0f} s)", flush=True)
        print(flush=True)
        for s in systems:
            for rate in rates:
                rows.append(summarize(s, rate, segs.get((s, rate), []), a))
    except KeyboardInterrupt:
        print("\ninterrupted: ranks stopped, namespaces removed; nothing written", flush=True)
        return 130
    finally:
        netns_down()
    load_after = os.getloadavg()
    report = {"config": {**a, "params": psi, "rates_mbit": rates, "systems": systems,
                         "schedule": [[i, sname, order] for i, sname, order in schedule],
                         "head": head,
                         "tbf": {"latency": TBF_LATENCY, "burst_bytes": {r: tbf_burst(r) for r in rates if r}},
                         "buckets": {"ours_and_deepspeed_elements": (psi // args.bucket_fraction
                                                                     if args.bucket_fraction else None),
                                     "fsdp2": f"one transformer block ({block} parameters), then the root"},
                         "zero_optimization": {s: zero_section(s, a) for s in systems
                                               if not s.startswith("fsdp")},
                         "labels": {s: LABELS.get(s, s) for s in systems}},
              "versions": ver, "notes": notes,
              "command": " ".join([sys.executable, "-m", "bench.slow_link"] + (argv or sys.argv[1:])),
              "loadavg_1min_before_after": [load_before[0], load_after[0]],
              "results": rows, "logs": str(logdir), "wall_s": time.monotonic() - t_start}
    render(report, Path(args.out), Path(args.plot) if args.plot else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
