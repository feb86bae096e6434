"""One rank of bench/slow_link.py, started by torchrun inside a network namespace.

    torchrun --nnodes 2 --node-rank K --nproc-per-node L ... bench/slow_link_worker.py \
        --system zero3-reuse0 --config '{...}' --rates 100,200 --out-dir DIR --ifname vA

Builds one system (bench.zero_systems.build_system) once, then for each link rate in
turn: asks the driver to set the rate (rank 0 writes DIR/want<i> and waits for
DIR/set<i>; the driver owns the qdisc), runs bench.zero_systems.timed_loop (warm-up +
timed steps) and writes DIR/rate<i>_rank<R>.json. Local rank 0 of each node reads its
veth's byte counters (/proc/net/dev, which is per network namespace) when the timed steps
start and end, each time between two barriers, so that no rank is sending while the
counters are read. After each rate it measures what one barrier and an idle half second
put on the link, so the driver can take them out.

"auto" (bench/slow_link_auto.py) is built again at every rate, after the rate is set:
its probe must see the link it is timed on. With a["profile"], our rows record per
phase the seconds each rank's main thread spent blocked in Work.wait() over the timed
steps (Communicator.wait_seconds, where the engine has it; None where not).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path



def read_dev(ifname: str) -> dict:
    """rx/tx bytes and packets of `ifname` in this process's network namespace."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == ifname:
                v = [int(x) for x in rest.split()]
                return {"rx_bytes": v[0], "rx_packets": v[1], "tx_bytes": v[8], "tx_packets": v[9],
                        "t": time.monotonic()}
    raise RuntimeError(f"no interface {ifname!r} in /proc/net/dev")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--system", required=True)
    p.add_argument("--config", required=True, help="JSON of the run_rank settings")
    p.add_argument("--rates", required=True, help="comma list; only its length and order matter here")
    p.add_argument("--out-dir", required=True)
    p.add_argument("--ifname", required=True)
    p.add_argument("--handshake-timeout", type=float, default=120)
    args = p.parse_args()
    a = json.loads(args.config)
    rates = [int(r) for r in args.rates.split(",")]
    out_dir = Path(args.out_dir)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    os.environ["OMP_NUM_THREADS"] = "1"
    import warnings
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    from bench.slow_link_auto import make_prepare
    from bench.system_catalog import DEEPSPEED, model_config
    from bench.zero_systems import COUNTER, build_system, timed_loop
    idx = -1
    try:
        COUNTER.install()  # before DeepSpeed binds torch.distributed functions
        COUNTER.node_of = lambda r: r // local_world
        if args.system in DEEPSPEED:
            os.environ["DS_ACCELERATOR"] = "cpu"
        else:  # DeepSpeed joins through deepspeed.init_distributed
            dist.init_process_group("gloo")
        per_rate = args.system == "auto"
        auto_info, sysd = {}, None

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
                        raise TimeoutError(f"the driver did not set rate {rate} within "
                                           f"{args.handshake_timeout:.0f} s")
                    time.sleep(0.05)
            dist.barrier()
            if per_rate:
                sysd = None
                gc.collect()
                sysd, t_build = build()
            link, waits = {}, {}
            comm = sysd.get("comm")

            def hook(event, link=link, waits=waits, comm=comm):
                dist.barrier()
                if local_rank == 0:
                    link[event] = read_dev(args.ifname)
                if a.get("profile") and comm is not None:
                    waits[event] = dict(getattr(comm, "wait_seconds", None) or {})
                dist.barrier()

            steps = (a.get("steps_at") or {}).get(str(rate), a["steps"])   # fewer where a step is slow
            res = timed_loop(rank, world, sysd, {**a, "steps": steps}, hook=hook)
            # Calibration: bytes one barrier puts on the link, and the idle rate.
            calib = {}
            if local_rank == 0:
                c0 = read_dev(args.ifname)
            nb = 20
            for _ in range(nb):
                dist.barrier()
            if local_rank == 0:
                c1 = read_dev(args.ifname)
                time.sleep(0.5)
                c2 = read_dev(args.ifname)
                calib = {"barrier_bytes": (c1["tx_bytes"] + c1["rx_bytes"] - c0["tx_bytes"] - c0["rx_bytes"]) / nb,
                         "idle_bytes_per_s": (c2["tx_bytes"] + c2["rx_bytes"] - c1["tx_bytes"] - c1["rx_bytes"])
                         / (c2["t"] - c1["t"])}
            if a.get("profile") and comm is not None and hasattr(comm, "wait_seconds"):
                res["wait_seconds"] = {k: v - waits["start"].get(k, 0.0) for k, v in waits["end"].items()}
            res.update(ok=True, rank=rank, local_rank=local_rank, ifname=args.ifname, rate_mbit=rate,
                       link=link, calib=calib, build_s=t_build, loadavg=os.getloadavg()[0],
                       auto=dict(auto_info) if per_rate else None)
            (out_dir / f"rate{idx}_rank{rank}.json").write_text(json.dumps(res, default=str))
        dist.barrier()
        ok = True
    except BaseException:
        err = traceback.format_exc()
        print(err, file=sys.stderr, flush=True)
        (out_dir / f"rate{max(idx, 0)}_rank{rank}.json").write_text(
            json.dumps({"ok": False, "rank": rank, "error": err}))
        ok = False
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:
        pass
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
