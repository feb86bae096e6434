#!/usr/bin/env python
"""The systems (bench/slow_link/systems.py: ours per ZeRO stage and technique, FSDP2, FSDP2 + our plug-in,
DeepSpeed when installed, a plain PyTorch loop) side by side on emulated nodes: one entry point.

    sudo .venv/bin/python -m bench.slow_link [sweep] [--quick] [--dtype fp32] [--profile]
    sudo .venv/bin/python -m bench.slow_link diloco
    .venv/bin/python -m bench.slow_link local | split | calibrate | planner | gpu
    .venv/bin/python -m bench.slow_link COMMAND --help      # what it measures, its limit, sizes, duration

The link: two network namespaces joined by a veth rate-limited both ways by tc tbf (scenarios/harness/netns.py),
2 torchrun ranks in each; traffic inside a node stays on its loopback. Commands that need the link
print a SKIPPED line and exit 0 without root and iproute2; they remove their namespaces on exit.
"""
from __future__ import annotations

import argparse
import sys

from bench.slow_link import calibrate, diloco, gpu, local, sweep

COMMANDS = {
    "sweep": (sweep, "step time against link rate (default 100, 200, 1000 Mbit/s, unlimited) "
              "for ZeRO-3, each ZeRO++ technique, all three, auto, FSDP2 (and reshard to node), DeepSpeed ZeRO-3 "
              "(and hpZ); per row the veth bytes next to the counted ones, and the limit max(unthrottled step, "
              "link time) beside the step with step / limit and the exposed communication. Default model GPT 4 "
              "layers, hidden 192, seq 16, bf16; 2 passes x (2 warm-up + 6 steps): ~20 min on 2 quiet cores; "
              "--quick ~1 min. Needs root. Writes results/slow_link.{json,md,png}"),
    "diloco": (diloco, "streaming DiLoCo (a group per node, INT4 outer gradients) against "
               "ZeRO-3 and ZeRO++ + LoCo at 10-100 Mbit/s and unlimited; DiLoCo's throughput over whole "
               "windows of cycles x H inner steps (exchanges included), the best F of --fragments first; the "
               "planner's inner step (compute rate measured here) beside the measured one, and the bytes "
               "across groups against ZeRO-3's. GPT 4 layers, hidden 256, seq 128, micro-batch 8: ~25 min. "
               "Needs root. Writes results/slow_link_diloco.{json,md}"),
    "local": (local, "the systems on gloo ranks of one machine, no link (stages 0-3, "
              "FSDP2, DeepSpeed): step time, peak RSS, model-state bytes, bytes per step counted and "
              "intercepted beside the ring model's (the limit), first losses equal; then world size 1 "
              "against a plain loop. GPT 4 layers, hidden 256, seq 128, 4 ranks: ~5 min. "
              "Writes results/zero_bench.json"),
    "split": (local, "where a step's time goes unthrottled (4 ranks as 2 x 2 over "
              "loopback): per system ms per step inside each torch.distributed call and blocked in "
              "Work.wait() by phase, the rest compute; then gloo's reduce-scatter against all-reduce, "
              "all-to-all and all-gather on one block's gradient. ~3 min. Writes results/fsdp2_time_split.json"),
    "calibrate": (calibrate, "this machine's rates for the planner's emulated cluster: "
                  "forward+backward FLOP/s (bf16, fp32) and AdamW, block (de)quantization elements/s, gloo "
                  "loopback bandwidth and ring-hop latency, the sweep's systems' step over loopback. ~3 min. "
                  "Writes results/calibrate_compute.json"),
    "planner": (calibrate, "the planner (train.py --dry-run's model) against the sweep's "
                "stored step times: predicted vs measured per system and rate, |error| against a tolerance. "
                "Seconds; no network. Writes results/planner_calibration.{json,md}"),
    "gpu": (gpu, "several ranks of the engine on ONE GPU over gloo: the CUDA paths of ZeRO-3, "
            "ZeRO++ and FSDP2 (+ plug-in) in a real multi-rank step, step time, losses, bytes across the "
            "emulated nodes (a check of paths and numerics, not a multi-GPU speed). ~3 min on a GPU. "
            "Writes results/gpu_ranks.json"),
}


SUFFIX = {"planner": "_planner", "split": "_split"}   # two commands of one module: add_args_X, run_X


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.slow_link", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, text) in COMMANDS.items():
        sp = sub.add_parser(name, help=text.split(";")[0].split(":")[0], description=text)
        getattr(module, "add_args" + SUFFIX.get(name, ""))(sp)
    return p


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0] not in COMMANDS and argv[0] not in ("-h", "--help")):
        argv.insert(0, "sweep")   # `python -m bench.slow_link --quick` is the sweep
    args = parser().parse_args(argv)
    module = COMMANDS[args.command][0]
    return getattr(module, "run" + SUFFIX.get(args.command, ""))(args) or 0
