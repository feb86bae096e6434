"""Memory: what a rank holds, measured (peak RSS, Linux VmHWM) against what it should hold.

    python -m bench.memory [large]      # a model larger than a rank may hold, built shard by shard and trained
                                        # (--sharding fsdp2: on torch's FSDP2 with the plug-in)
    python -m bench.memory bound        # peak RSS rise per rank against its budget, ZeRO-3 and ZeRO++
    python -m bench.memory matrix       # the same in every precision x optimizer x budget
    python -m bench.memory train        # train.py's own peak under torchrun, pool by pool (needs the corpus)

- large: each of --world gloo ranks builds the GPT on the meta device, lets ZeRO-3 create it
  one weight at a time (zeropp/stages/init.py) and trains --steps steps on random tokens; per
  rank the peak RSS after construction and after training beside what an unsharded build
  would need (weights, gradients, optimizer state in full). Default: the 18B run's widths
  with 2 layers (hidden 6144, vocab 50257: over a billion parameters) on 4 ranks, bf16, SGD,
  minutes on 2 cores. --checkpoint DIR adds a sharded save (DCP: each rank its fp32 master
  slices and moments) and a load into a fresh engine: RSS before, peak increase during each,
  seconds, bytes written against 4 x (1 + moments) x params / N, a CRC round trip (exact),
  `du` of DIR (left in place). --sharding fsdp2 runs the same on the FSDP2 engine (its checkpoint
  writes FSDP2's row shards as flat chunks: views where a rank's rows are its chunk, the rest
  moved in bounded all_to_alls; the save's and load's peaks are the measure of that).
- bound, matrix: what is measured is below; limit: rise <= RSS_LIMIT (115%) of (model
  states + buffer bounds + activations + gloo staging), every pool's peak within its bound,
  ZeRO++'s excess over ZeRO-3 within hpZ's copy + 10% of ZeRO-3's rise. Default: 417 M
  parameters (GPT 12 x 1536, vocab 50257, seq 32) on 8 ranks as 2 nodes of 4, buckets 3e7
  (1/14 of the model), max live 1.5e8, 3 steps, bf16 SGD (10 bytes a parameter / N, so
  buffers are a larger share of the budget); minutes a system. matrix: --dtypes x
  --optimizers x --budgets (small: bucket and live 3e7; default: 3e7 and 1.5e8) x --systems.
- train: train.py under torchrun (8 ranks on one node, 411 M parameters: 8 layers, hidden
  2048, fp32 AdamW, stage 3, buckets and live parameters 3e7, reuse distance 0) against a tiny
  run of the same flags: the rise against the fp32 model (limit: 95% of it), placed pool by pool
  (bench/memory/train.py); a row per allocator setting (--variants).
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import gc
import subprocess
import time
import zlib

import torch

import zeropp
from bench import RESULTS, write_result
from bench.memory import bound as memory_bound
from bench.memory.bound import PeakRSS, ds_config, model_config, rss_mb, rss_split
from model import GPT, num_parameters
from parallel.comm import Communicator
from scenarios.harness.spawn import run_distributed
from parallel.topology import topology_from_env
from zeropp.memory import memory_report

MODEL = ("num_layers", "hidden", "heads", "vocab", "seq", "micro_batch", "world", "ranks_per_node", "steps", "dtype",
         "optimizer", "bucket", "max_live")
DEFAULTS = {
    "large": dict(zip(MODEL, (2, 6144, 32, 50257, 16, 1, 4, None, 2, "bf16", "sgd", 5e7, 3e8))),
    "bound": dict(zip(MODEL, (12, 1536, 16, 50257, 32, 1, 8, 4, 3, "bf16", "sgd", 3e7, 1.5e8)),
                  systems="zero3,zeropp", budgets="flags"),
    "matrix": dict(zip(MODEL, (12, 1536, 16, 50257, 32, 1, 8, 4, 3, "bf16", "sgd", 3e7, 1.5e8)),
                   systems="zero3,zeropp", dtypes="fp32,bf16,fp16", optimizers="adamw,sgd", budgets="small,default"),
    "train": dict(num_layers=8, hidden=2048, heads=16, seq=32, world=8, steps=3, bucket=3e7, max_live=3e7),
}
OUT = {"large": "large_model.json", "bound": "large_model_bound.json", "matrix": "large_model_bound_matrix.json",
       "train": "train_memory.json"}


def state_crcs(engine) -> dict:
    """CRC-32 of every tensor this rank holds in a checkpoint (its slices)."""
    return {k: zlib.crc32(v.local.detach().contiguous().view(torch.uint8).numpy())
            for k, v in engine.checkpoint_state().items()}


def checkpoint_phase(a, cfg, ds, comm, optim, trained: dict, param_shapes, steps):
    """Save trained["engine"] to a.checkpoint, drop it (the caller holds no other
    reference), build a fresh engine (another init seed) and load the checkpoint into it."""
    import torch.distributed as dist
    from training.checkpoint import load_checkpoint, save_checkpoint
    meta = {"model_config": dataclasses.asdict(cfg), "param_shapes": param_shapes, "tokenizer_type": None}
    engine = trained.pop("engine")
    trained.clear()
    saved = state_crcs(engine)
    dist.barrier()
    split = {"before_save": rss_split()}
    rss_before_save = rss_mb("VmRSS")
    probe = PeakRSS().start()
    res = save_checkpoint(a.checkpoint, steps, engine, 0, meta)
    save_peak = probe.stop()
    split["after_save"] = rss_split()
    dist.barrier()

    del engine  # only the fresh engine is alive during load
    gc.collect()
    rss_after_drop = rss_mb("VmRSS")
    cfg2 = dataclasses.replace(cfg, init_seed=cfg.init_seed + 1)
    with torch.device("meta"):
        model2 = GPT(cfg2)
    engine2 = zeropp.initialize(model2, ds, comm, torch.device("cpu"), optim, param_init=model2.init_parameter,
                                sharding=a.sharding)
    fresh = state_crcs(engine2)
    gc.collect()
    dist.barrier()
    split["before_load"] = rss_split()
    rss_before_load = rss_mb("VmRSS")
    probe = PeakRSS().start()
    t = time.time()
    load_checkpoint(a.checkpoint, engine2)
    load_s = time.time() - t
    load_peak = probe.stop()
    split["after_load"] = rss_split()
    rss_after_load = rss_mb("VmRSS")
    loaded = state_crcs(engine2)
    dist.barrier()
    same_keys = sorted(saved) == sorted(loaded)
    return {"rss_before_save_mb": rss_before_save, "save_peak_rss_mb": save_peak,
            "save_peak_increase_mb": save_peak - rss_before_save, "save_s": res.seconds,
            "bytes_this_rank": res.bytes_this_rank, "bytes_max_rank": res.bytes_max_rank,
            "bytes_total": res.bytes_total, "path": res.path,
            "rss_after_dropping_trained_engine_mb": rss_after_drop, "rss_before_load_mb": rss_before_load,
            "load_peak_rss_mb": load_peak,
            "load_peak_increase_mb": load_peak - rss_before_load,
            "load_retained_increase_mb": rss_after_load - rss_before_load, "load_s": load_s,
            "peak_method": probe.method, "rss_anon_file_shmem_mb": split, "tensors": len(saved),
            "fresh_differs_before_load": sum(fresh.get(k) != v for k, v in saved.items()),
            "round_trip_exact": same_keys and all(saved[k] == loaded[k] for k in saved)}


def rank_main(rank, world, a):
    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # return freed blocks to the kernel (see tests)
    cfg = model_config(a)
    ds = ds_config(a, a.zeropp)
    comm = Communicator(topology_from_env(a.ranks_per_node))
    start_rss = rss_mb("VmRSS")
    t0 = time.time()
    with torch.device("meta"):
        model = GPT(cfg)
    param_shapes = {n: list(p.shape) for n, p in model.named_parameters()}
    optim = zeropp.OptimizerSettings(type=a.optimizer, lr=1e-4, momentum=0.0)
    engine = zeropp.initialize(model, ds, comm, torch.device("cpu"), optim, param_init=model.init_parameter,
                               sharding=a.sharding)
    construct_s = time.time() - t0
    after_construct = rss_mb("VmHWM")
    g = torch.Generator().manual_seed(rank)
    losses, step_s, loss = [], [], None
    swap = rss_mb("VmSwap")
    for _ in range(a.steps):
        x = torch.randint(0, a.vocab, (a.micro_batch, a.seq + 1), generator=g)
        t = time.time()
        loss = engine(x[:, :-1], x[:, 1:])
        engine.backward(loss)
        engine.step()
        step_s.append(time.time() - t)
        losses.append(loss.item())
        swap = max(swap, rss_mb("VmSwap"))
    peaks = engine.peak_buffers()
    peaks["hpz_secondary_bytes"] = memory_report(engine)["hpz_secondary_bytes"]   # stage 3 with hpZ
    out = {"rank": rank, "start_rss_mb": start_rss, "peak_rss_after_construction_mb": after_construct,
           "peak_rss_mb": rss_mb("VmHWM"), "swap_after_steps_mb": swap, "construct_s": construct_s, "step_s": step_s,
           "losses": losses, "peaks": peaks, "num_parameters": num_parameters(cfg)}
    if a.checkpoint:
        trained = {"engine": engine, "model": model}
        del engine, model, loss
        out["checkpoint"] = checkpoint_phase(a, cfg, ds, comm, optim, trained, param_shapes, a.steps)
    return out


def report_checkpoint(a, results, psi) -> dict:
    """Print the checkpoint table; the summary for the JSON."""
    cks = [r.pop("checkpoint") for r in results]  # kept once, under the JSON's "checkpoint" key
    moments = 2 if a.optimizer == "adamw" else 0
    full_fp32 = 4 * psi
    expected_rank = 4 * psi * (1 + moments) / a.world
    total = cks[0]["bytes_total"]
    du = {}
    for flag, key in (("-sb", "apparent_bytes"), ("-sB1", "disk_bytes")):
        try:
            du[key] = int(subprocess.run(["du", flag, a.checkpoint], capture_output=True, text=True,
                                         check=True).stdout.split()[0])
        except (OSError, subprocess.CalledProcessError, ValueError, IndexError):
            du[key] = None
    mb = 2**20
    print(f"\ncheckpoint to {cks[0]['path']} and back into a fresh engine (peak RSS: {cks[0]['peak_method']})")
    print(f"{'rank':>4} {'RSS before save MB':>18} {'save peak +MB':>13} {'save s':>7} {'written MB':>10} "
          f"{'written / expected':>18} {'load peak +MB':>13} {'load kept +MB':>13} {'load s':>7} {'exact':>5}")
    for r, c in zip(results, cks):
        print(f"{r['rank']:>4} {c['rss_before_save_mb']:>18.0f} {c['save_peak_increase_mb']:>13.0f} "
              f"{c['save_s']:>7.1f} {c['bytes_this_rank'] / mb:>10.0f} "
              f"{c['bytes_this_rank'] / expected_rank:>18.3f} {c['load_peak_increase_mb']:>13.0f} "
              f"{c['load_retained_increase_mb']:>13.0f} {c['load_s']:>7.1f} {str(c['round_trip_exact']):>5}")
    worst_save = max(c["save_peak_increase_mb"] for c in cks) * mb
    worst_load = max(c["load_peak_increase_mb"] for c in cks) * mb
    print(f"full model fp32 (4 x {psi:,}): {full_fp32 / mb:.0f} MB (what one rank gathering model.pt would "
          f"hold); with {moments} fp32 moments: {full_fp32 * (1 + moments) / mb:.0f} MB")
    print(f"expected per rank (4 x (1 + {moments}) x params / {a.world}): {expected_rank / mb:.0f} MB; "
          f"written in all {total / mb:.0f} MB; du {du['apparent_bytes'] or 0:,} B apparent, "
          f"{du['disk_bytes'] or 0:,} B on disk ({(du['apparent_bytes'] or 0) / total:.4f} x written)")
    created = 4 * moments * psi / a.world
    print(f"largest peak RSS increase: save {worst_save / full_fp32:.3f} x, load {worst_load / full_fp32:.3f} x "
          f"the full fp32 model; load kept = the fresh engine's optimizer moments, which the load creates "
          f"(4 x {moments} x params / {a.world} = {created / mb:.0f} MB)")
    return {"dir": a.checkpoint, "full_model_fp32_bytes": full_fp32,
            "full_model_and_moments_fp32_bytes": full_fp32 * (1 + moments),
            "expected_bytes_per_rank": expected_rank, "moments_created_by_load_bytes_per_rank": created,
            "bytes_total": total, "du": du,
            "max_save_peak_increase_over_full_fp32": worst_save / full_fp32,
            "max_load_peak_increase_over_full_fp32": worst_load / full_fp32,
            "round_trip_exact_all_ranks": all(c["round_trip_exact"] for c in cks), "ranks": cks}


def large(a) -> dict:
    results = run_distributed(rank_main, world_size=a.world, args=(a,), timeout=a.timeout,
                              env={"OMP_NUM_THREADS": "1"})
    psi = results[0]["num_parameters"]
    k = (0 if a.dtype == "fp32" else 4) + (8 if a.optimizer == "adamw" else 0)   # fp32 master, moments
    whole = psi * ((4 if a.dtype == "fp32" else 2) + 4 + k)   # weights + fp32 gradient + optimizer
    print(f"GPT {a.num_layers} layers, hidden {a.hidden}, vocab {a.vocab}: {psi:,} parameters "
          f"({psi * 4 / 2**30:.2f} GiB in fp32); {a.world} ranks, {'FSDP2' if a.sharding == 'fsdp2' else 'ZeRO-3'}"
          f"{' + ZeRO++' if a.zeropp else ''}, "
          f"{a.dtype}, {a.optimizer}")
    print(f"model states per rank: unsharded {whole / 2**30:.2f} GiB, ZeRO-3 {whole / a.world / 2**30:.2f} GiB")
    print(f"{'rank':>4} {'construct s':>11} {'RSS after build MB':>18} {'peak RSS MB':>11} "
          f"{'step s':>8} {'loss':>8} {'peak gathered MB':>16} {'peak grad bufs MB':>17} {'hpZ MB':>6} "
          f"{'swap MB':>7}")
    for r in results:
        print(f"{r['rank']:>4} {r['construct_s']:>11.1f} {r['peak_rss_after_construction_mb']:>18.0f} "
              f"{r['peak_rss_mb']:>11.0f} {r['step_s'][-1]:>8.1f} {r['losses'][-1]:>8.4f} "
              f"{r['peaks'].get('gathered_weights_peak', 0) / 2**20:>16.0f} "
              f"{r['peaks'].get('gradient_buckets_peak', 0) / 2**20:>17.0f} "
              f"{r['peaks']['hpz_secondary_bytes'] / 2**20:>6.0f} {r['swap_after_steps_mb']:>7.0f}")
    out = {"args": vars(a), "num_parameters": psi, "unsharded_model_states_gib_per_rank": whole / 2**30,
           "zero3_model_states_gib_per_rank": whole / a.world / 2**30, "ranks": results}
    if a.checkpoint:
        out["checkpoint"] = report_checkpoint(a, results, psi)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__ + "\n" + memory_bound.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", nargs="?", choices=list(OUT), default="large")
    for flag, kind in (("--num-layers", int), ("--hidden", int), ("--heads", int), ("--vocab", int), ("--seq", int),
                       ("--micro-batch", int), ("--world", int), ("--steps", int)):
        p.add_argument(flag, type=kind, help="default: the mode's (above)")
    p.add_argument("--ranks-per-node", type=int, help="emulated node size (default: --world; 4 with bound, matrix)")
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--optimizer", choices=["sgd", "adamw"])
    p.add_argument("--bucket", type=float, help="reduce and prefetch bucket (elements)")
    p.add_argument("--max-live", type=float, help="stage3_max_live_parameters")
    p.add_argument("--checkpoint-activations", action="store_true",
                   help="recompute blocks in backward (gathers a whole block at once)")
    p.add_argument("--overlap", action="store_true", help="overlap_comm: keeps up to 3 gradient buckets alive")
    p.add_argument("--zeropp", action="store_true", help="large: ZeRO++ (qwZ, hpZ over --ranks-per-node, qgZ)")
    p.add_argument("--checkpoint", metavar="DIR", help="large: then save a sharded checkpoint to DIR and load it")
    p.add_argument("--sharding", choices=["zero", "fsdp2"], default="zero",
                   help="large: our ZeRO-3 engine or torch's FSDP2 with the plug-in")
    p.add_argument("--systems", help="bound, matrix: zero3,zeropp[,zeropp-deltas,zeropp-all] (the last two add "
                                     "INT4 weight deltas, and LoCo: their limit adds their state)")
    p.add_argument("--dtypes", help="matrix: fp32,bf16,fp16")
    p.add_argument("--optimizers", help="matrix: adamw,sgd")
    p.add_argument("--budgets", help="matrix: small,default (and flags: --bucket, --max-live)")
    p.add_argument("--trace-allocations", action="store_true",
                   help="bound, matrix: rank 0's tensors alive at its last step's peak, by site")
    p.add_argument("--variants", default="train.py,glibc-32m", help="train: the allocator settings")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per spawned set of ranks")
    p.add_argument("--out", help="the JSON (default bench/results/ large_model.json, large_model_bound.json, "
                                 "large_model_bound_matrix.json, train_memory.json)")
    a = p.parse_args(argv)
    if a.sharding == "fsdp2" and (a.what != "large" or a.bucket or a.max_live or a.overlap):
        p.error("--sharding fsdp2 goes with `large` and without --bucket, --max-live, --overlap "
                "(FSDP2 gathers and reduces one block at a time)")
    for k, v in DEFAULTS[a.what].items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    a.ranks_per_node = a.ranks_per_node or a.world
    a.bucket, a.max_live = int(a.bucket), int(a.max_live)
    a.dtypes, a.optimizers = a.dtypes or a.dtype, a.optimizers or a.optimizer
    if a.what == "train":
        from bench.memory.train import run as train
        out = train(a)
    elif a.what in ("bound", "matrix"):
        from bench.memory.bound import run
        out = run(a, detail=a.what == "bound")
    else:
        out = large(a)
    print(f"wrote {write_result(a.out or RESULTS / OUT[a.what], out)}")
    return 0 if out.get("pass", True) else 1
