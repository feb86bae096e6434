"""One system on the emulated link, both sides of the handshake. The driver (`run_system`) starts a
torchrun per namespace (2 nodes x RANKS_PER_NODE ranks, static rendezvous over the veth,
GLOO_SOCKET_IFNAME = the veth) running this module as the worker. The ranks build the system once,
then per link rate: rank 0 writes DIR/want<i>, the driver sets the qdisc and writes DIR/set<i>, the
ranks run bench.slow_link.ranks.timed_loop and write DIR/rate<i>_rank<R>.json. Local rank 0 of each node reads
its veth's counters (/proc/net/dev, per namespace) between barriers at the timed steps' start and
end, then measures what a barrier and an idle half second put on the link, for the driver to take
out. "auto" is built again at every rate, after the rate is set: its probe must see that link."""
from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from bench import ROOT
from scenarios.harness.netns import ADDR, IF, NS, RANKS_PER_NODE, link_counters, qdisc_stats, set_rate, start_tracked, stop


def run_system(system: str, rates: list[int], a: dict, port: int, setup_timeout: float, rate_timeout: float,
               logdir: Path, on_rate=None) -> list[dict]:
    """One dict per rate: the ranks' results ("per_rank"), or "error"."""
    from bench.slow_link.systems import DEEPSPEED
    out_dir = Path(tempfile.mkdtemp(prefix=f"{system}_", dir=logdir))
    procs, logs, runs, world = [], [], [], 2 * RANKS_PER_NODE
    set_rate(rates[0])
    for node, (ns, ifname) in enumerate(zip(NS, IF)):
        env = ["env", f"GLOO_SOCKET_IFNAME={ifname}", "OMP_NUM_THREADS=1", f"PYTHONPATH={ROOT}", "PYTHONUNBUFFERED=1",
               *(["DS_ACCELERATOR=cpu"] if system in DEEPSPEED else [])]
        cmd = ["ip", "netns", "exec", ns, *env, sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
               "--node-rank", str(node), "--nproc-per-node", str(RANKS_PER_NODE), "--master-addr", ADDR[0],
               "--master-port", str(port), "--max-restarts", "0", "--module", "bench.slow_link.run",
               "--system", system, "--config", json.dumps(a), "--rates", ",".join(map(str, rates)),
               "--out-dir", str(out_dir), "--ifname", ifname, "--handshake-timeout", str(rate_timeout)]
        logs.append(open(out_dir / f"{ns}.log", "w"))
        procs.append(start_tracked(cmd, stdout=logs[-1], stderr=subprocess.STDOUT, cwd=ROOT))

    def wait_for(done, until, what):
        while not done():
            if any(p.poll() is not None for p in procs):
                time.sleep(0.5)   # let the other ranks' files land
                return None if done() else f"a torchrun exited (codes {[p.poll() for p in procs]}) {what}"
            if time.monotonic() > until:
                return f"timed out {what}"
            time.sleep(0.05)

    try:
        deadline = time.monotonic() + setup_timeout
        for idx, rate in enumerate(rates):
            t_rate = time.monotonic()
            error = wait_for(lambda: (out_dir / f"want{idx}").exists(), deadline,  # noqa: B023
                             f"before rate {rate} (waiting for the ranks)")
            if error is None:
                set_rate(rate)
                before = link_counters()
                (out_dir / f"set{idx}").write_text("")
                files = [out_dir / f"rate{idx}_rank{r}.json" for r in range(world)]
                error = wait_for(lambda: all(f.exists() for f in files), time.monotonic() + rate_timeout,  # noqa: B023
                                 f"at {rate} Mbit/s")
                after = link_counters()
                per_rank = [json.loads(f.read_text()) if f.exists() else None for f in files]
                bad = [r for r, x in enumerate(per_rank) if x is None or not x.get("ok")]
                if error is None and bad:
                    x = per_rank[bad[0]]
                    error = f"rank {bad[0]}: " + (x["error"] if x else "wrote no result")
            runs.append({"error": error, "wall_s": time.monotonic() - t_rate} if error else
                        {"per_rank": per_rank, "wall_s": time.monotonic() - t_rate, "qdisc": qdisc_stats(),
                         "whole_rate_link_bytes": sum(after[i]["tx_bytes"] - before[i]["tx_bytes"] for i in IF)})
            if on_rate:
                on_rate(rate, runs[-1])
            if error:
                break
            deadline = time.monotonic() + rate_timeout  # for the next want<i>
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
    finally:
        for p in procs:
            stop(p)
        for log in logs:
            log.close()
    if any("error" in r for r in runs):
        tail = [l for ns in NS for l in [f"--- {ns} log (last 15 lines) ---",
                                         *(out_dir / f"{ns}.log").read_text(errors="replace").splitlines()[-15:]]]
        for r in runs:
            r.update({"log_tail": "\n".join(tail), "logs": str(out_dir)} if "error" in r else {})
    while len(runs) < len(rates):  # rates not reached after an error
        runs.append({"error": "not run (an earlier rate of this system failed)", "wall_s": 0.0})
        if on_rate:
            on_rate(rates[len(runs) - 1], runs[-1])
    return runs


def read_dev(ifname: str) -> dict:
    """rx/tx bytes and packets of `ifname` in this process's network namespace."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == ifname:
                v = [int(x) for x in rest.split()]
                return {"rx_bytes": v[0], "rx_packets": v[1], "tx_bytes": v[8], "tx_packets": v[9], "t": time.monotonic()}
    raise RuntimeError(f"no interface {ifname!r} in /proc/net/dev")


def worker():
    p = argparse.ArgumentParser()
    for k in ("system", "config", "rates", "out-dir", "ifname"):
        p.add_argument(f"--{k}", required=True)
    p.add_argument("--handshake-timeout", type=float, default=120)
    args = p.parse_args()
    a, rates, out_dir = json.loads(args.config), [int(r) for r in args.rates.split(",")], Path(args.out_dir)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    import warnings
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    from bench.slow_link.ranks import COUNTER, build_system, timed_loop
    from bench.slow_link.systems import DEEPSPEED, make_prepare, model_config
    idx, ok = -1, False
    try:
        COUNTER.install()  # before DeepSpeed binds torch.distributed functions
        COUNTER.node_of = lambda r: r // local_world
        if args.system not in DEEPSPEED:   # DeepSpeed joins through deepspeed.init_distributed
            dist.init_process_group("gloo")
        per_rate, auto_info, sysd = args.system == "auto", {}, None

        def build():
            t = time.monotonic()
            prepare = make_prepare(a, model_config(a), auto_info) if per_rate else None
            return build_system(rank, world, args.system, a, prepare=prepare), time.monotonic() - t

        if not per_rate:
            sysd, t_build = build()
        for idx, rate in enumerate(rates):
            dist.barrier()
            if rank == 0:  # the driver sets the link's rate while every rank waits here
                (out_dir / f"want{idx}").write_text(str(rate))
                deadline = time.monotonic() + args.handshake_timeout
                while not (out_dir / f"set{idx}").exists():
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"the driver did not set rate {rate} in {args.handshake_timeout:.0f} s")
                    time.sleep(0.05)
            dist.barrier()
            if per_rate:
                sysd = None
                gc.collect()
                sysd, t_build = build()
            link, waits, comm = {}, {}, sysd.get("comm")

            def hook(event, link=link, waits=waits, comm=comm):
                dist.barrier()
                if local_rank == 0:
                    link[event] = read_dev(args.ifname)
                if a.get("profile") and comm is not None:
                    waits[event] = dict(getattr(comm, "wait_seconds", None) or {})
                dist.barrier()

            steps = (a.get("steps_at") or {}).get(str(rate), a["steps"])   # fewer where a step is slow
            res = timed_loop(rank, world, sysd, {**a, "steps": steps}, hook=hook)
            calib, nb = {}, 20   # what one barrier and idle time put on the link
            c0 = read_dev(args.ifname) if local_rank == 0 else None
            for _ in range(nb):
                dist.barrier()
            if local_rank == 0:
                c1 = read_dev(args.ifname)
                time.sleep(0.5)
                c2 = read_dev(args.ifname)
                both = lambda c: c["tx_bytes"] + c["rx_bytes"]  # noqa: E731
                calib = {"barrier_bytes": (both(c1) - both(c0)) / nb,
                         "idle_bytes_per_s": (both(c2) - both(c1)) / (c2["t"] - c1["t"])}
            if a.get("profile") and comm is not None and hasattr(comm, "wait_seconds"):
                res["wait_seconds"] = {k: v - waits["start"].get(k, 0.0) for k, v in waits["end"].items()}
            res.update(ok=True, rank=rank, local_rank=local_rank, ifname=args.ifname, rate_mbit=rate, link=link,
                       calib=calib, build_s=t_build, loadavg=os.getloadavg()[0],
                       auto=dict(auto_info) if per_rate else None)
            (out_dir / f"rate{idx}_rank{rank}.json").write_text(json.dumps(res, default=str))
        dist.barrier()
        ok = True
    except BaseException:
        err = traceback.format_exc()
        print(err, file=sys.stderr, flush=True)
        (out_dir / f"rate{max(idx, 0)}_rank{rank}.json").write_text(json.dumps({"ok": False, "rank": rank, "error": err}))
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    worker()
