"""The systems the benchmarks compare, by name: which engine and ZeRO stage each is, its
label, its zero_optimization section, and the model, data and optimizer settings every
system shares (bench/zero_systems.py builds ours, bench/peer_systems.py the peers)."""
from __future__ import annotations

import os

import torch

# ZeRO++ rows (bench/slow_link.py): our reuse-0 ZeRO-3 plus one or all of qwZ, hpZ, qgZ, and
# beyond: ZeRO++ with INT4 weight deltas, and with qgZ's error feedback (LoCo) too, and with INT2
# gradients across nodes under LoCo ("-int2"), and INT2 weight deltas too ("-int2-all").
# hpZ's partition size is the number of ranks per node (a["ranks_per_node"]).
# "auto": all three "auto", resolved by build_system(prepare=...) (bench/slow_link_auto.py).
ZEROPP = {"zeropp-qwz": ("qwz",), "zeropp-hpz": ("hpz",), "zeropp-qgz": ("qgz",),
          "zeropp": ("qwz", "hpz", "qgz"), "deepspeed-z3-hpz": ("hpz",), "auto": ("auto",),
          "zeropp-loco": ("qwz", "hpz", "qgz", "loco"), "zeropp-deltas": ("qwz", "hpz", "qgz", "deltas"),
          "zeropp-loco-deltas": ("qwz", "hpz", "qgz", "loco", "deltas"),
          "zeropp-loco-deltas-int2": ("qwz", "hpz", "qgz", "loco", "deltas", "int2"),
          "zeropp-loco-deltas-int2-all": ("qwz", "hpz", "qgz", "loco", "deltas", "int2", "deltas2")}
# Streaming DiLoCo rows (zeropp/outer/diloco.py), "diloco-h<H>": a group per node, each running the "zero3"
# row's engine, exchanging every H inner steps; fragments and quantization from a["outer_fragments"]
# (default 1), a["outer_quantization"] (default int4) and a["outer_sync_delay"] (default 1). Built as
# train.py builds it (training/outer.py).
DILOCO = ("diloco-h16", "diloco-h64")
OURS = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "zero3-reuse0": 3,
        "zeropp-qwz": 3, "zeropp-hpz": 3, "zeropp-qgz": 3, "zeropp": 3, "auto": 3, "zeropp-loco": 3,
        "zeropp-deltas": 3, "zeropp-loco-deltas": 3, "zeropp-loco-deltas-int2": 3, "zeropp-loco-deltas-int2-all": 3,
        **dict.fromkeys(DILOCO, 3)}
DEEPSPEED = {"deepspeed-z1": 1, "deepspeed-z2": 2, "deepspeed-z3": 3, "deepspeed-z3-reuse0": 3,
             "deepspeed-z3-hpz": 3}
FSDP2_PLAIN = ("fsdp2", "fsdp2-hpz")
# FSDP2 + our plug-in (zeropp/fsdp/apply.py apply_zeropp): its switches per row; each row's
# MixedPrecisionPolicy in bf16 is FSDP2_PLUGIN_REDUCE_DTYPE's (bench/peer_systems.py).
_OFF = dict(quantized_weights=False, hpz=False, quantized_gradients=False, loco=False)
FSDP2_PLUGIN = {"fsdp2+overlap": dict(_OFF), "fsdp2+qwz": {**_OFF, "quantized_weights": True}, "fsdp2+hpz": {**_OFF, "hpz": True},
                "fsdp2+qgz": {**_OFF, "quantized_gradients": True},
                "fsdp2+loco": {**_OFF, "quantized_gradients": True, "loco": True},
                "fsdp2+zeropp": dict(quantized_weights=True, hpz=True, quantized_gradients=True, loco=True)}
FSDP2 = FSDP2_PLAIN + tuple(FSDP2_PLUGIN)
# Rows whose gradient reduce-scatter is torch's reduce_scatter_tensor, which ProcessGroupGloo runs
# as a full all-reduce (twice a ring's bytes): the peers, and the plug-in's rows without qgZ (it
# leaves FSDP2's reduce-scatter); ours send an all-to-all on gloo (zeropp/collectives/exact.py).
GLOO_ALL_REDUCE_PEERS = (FSDP2_PLAIN + tuple(k for k, v in FSDP2_PLUGIN.items() if not v["quantized_gradients"])
                         + tuple(DEEPSPEED))
# bench/zero_bench.py's systems (one node); the ZeRO++ rows need several nodes: SLOW_LINK_SYSTEMS.
ALL_SYSTEMS = ["ddp", "zero1", "zero2", "zero3", "zero3-reuse0", "fsdp2", "deepspeed-z1", "deepspeed-z2",
               "deepspeed-z3", "deepspeed-z3-reuse0"]
SLOW_LINK_SYSTEMS = ["zero3-reuse0", "zero3", "zeropp-qwz", "zeropp-hpz", "zeropp-qgz", "zeropp", "auto",
                     "zeropp-loco", "zeropp-deltas", "zeropp-loco-deltas", "zeropp-loco-deltas-int2",
                     "zeropp-loco-deltas-int2-all", "fsdp2",
                     "fsdp2-hpz", "deepspeed-z3-reuse0", "deepspeed-z3-hpz", *FSDP2_PLUGIN, *DILOCO]
DEFAULT_SYSTEMS = ["ddp", "zero1", "zero2", "zero3", "zero3-reuse0", "fsdp2", "deepspeed-z3"]
WORLD1_SYSTEMS = ["plain", "ddp", "zero3"]
LABELS = {"ddp": "ours stage 0 (DDPEngine)", "zero1": "ours ZeRO-1", "zero2": "ours ZeRO-2",
          "zero3": "ours ZeRO-3", "zero3-reuse0": "ours ZeRO-3 (reuse 0)",
          "fsdp2": "PyTorch FSDP2 (reshard)", "deepspeed-z1": "DeepSpeed ZeRO-1",
          "deepspeed-z2": "DeepSpeed ZeRO-2", "deepspeed-z3": "DeepSpeed ZeRO-3",
          "deepspeed-z3-reuse0": "DeepSpeed ZeRO-3 (reuse 0)", "plain": "plain PyTorch loop",
          "zeropp-qwz": "ours ZeRO-3 + qwZ", "zeropp-hpz": "ours ZeRO-3 + hpZ",
          "zeropp-qgz": "ours ZeRO-3 + qgZ", "zeropp": "ours ZeRO++ (qwZ+hpZ+qgZ)",
          "auto": "ours ZeRO++ auto (planner.auto)", "fsdp2-hpz": "PyTorch FSDP2 (reshard to node)",
          "deepspeed-z3-hpz": "DeepSpeed ZeRO-3 + hpZ (reuse 0)",
          "zeropp-loco": "ours ZeRO++ + LoCo", "zeropp-deltas": "ours ZeRO++ + INT4 weight deltas",
          "zeropp-loco-deltas": "ours ZeRO++ + LoCo + deltas",
          "zeropp-loco-deltas-int2": "ours ZeRO++ + LoCo + deltas, INT2 gradients",
          "zeropp-loco-deltas-int2-all": "ours ZeRO++ + LoCo + INT2 deltas, INT2 gradients",
          "fsdp2+overlap": "FSDP2 + plug-in, no technique (its CPU overlap)", "fsdp2+qwz": "FSDP2 + plug-in qwZ", "fsdp2+hpz": "FSDP2 + plug-in hpZ", "fsdp2+qgz": "FSDP2 + plug-in qgZ",
          "fsdp2+loco": "FSDP2 + plug-in qgZ+LoCo", "fsdp2+zeropp": "FSDP2 + plug-in qwZ+hpZ+qgZ+LoCo",
          **{s: f"ours streaming DiLoCo H={s.rsplit('-h', 1)[1]}" for s in DILOCO}}
PERSISTENCE_THRESHOLD = 100_000  # DeepSpeed's default stage3_param_persistence_threshold (1e5)
# The "reuse 0" rows: weights released after forward, gathered again in backward (reuse distance 0),
# prefetch bucket 1/REUSE0_PREFETCH_FRACTION of the model; a["bucket_fraction"] (bench/slow_link.py):
# prefetch and reduce buckets 1/that, also for ours with held weights ("zero3").
REUSE0 = ("zero3-reuse0", "deepspeed-z3-reuse0", "zeropp-qwz", "zeropp-hpz", "zeropp-qgz", "zeropp",
          "deepspeed-z3-hpz", "auto", "zeropp-loco", "zeropp-deltas", "zeropp-loco-deltas", "zeropp-loco-deltas-int2",
          "zeropp-loco-deltas-int2-all")
REUSE0_PREFETCH_FRACTION = 4
OPTIM = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)


def outer_interval(system: str) -> int | None:
    """H of a DiLoCo row, else None."""
    return int(system.rsplit("-h", 1)[1]) if system in DILOCO else None


def outer_argv(system: str, a) -> list[str] | None:
    """train.py's outer-synchronization flags of a DiLoCo row (None for the others)."""
    if system not in DILOCO:
        return None
    return ["--outer-sync-interval", str(outer_interval(system)), "--outer-fragments",
            str(a.get("outer_fragments", 1)), "--outer-quantization", a.get("outer_quantization", "int4"),
            "--outer-sync-delay", str(a.get("outer_sync_delay", 1))]


def stage_of(system: str) -> int:
    return OURS.get(system, DEEPSPEED.get(system, 3 if system in FSDP2 else 0))


def ranks_per_node(a) -> int:
    """Ranks per node for hpZ: a["ranks_per_node"], else torchrun's LOCAL_WORLD_SIZE."""
    return int(a.get("ranks_per_node") or os.environ.get("LOCAL_WORLD_SIZE", "1"))


def bf16(a) -> bool:
    """a["dtype"] == "bf16": 16-bit weights/gradients (all systems); default fp32."""
    return a.get("dtype", "fp32") == "bf16"


def zero_section(system: str, a) -> dict:
    """The zero_optimization section our engine and DeepSpeed get for `system`."""
    stage = stage_of(system)
    zero = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = PERSISTENCE_THRESHOLD
    if system in REUSE0:
        zero["stage3_max_reuse_distance"] = 0
        fraction = a.get("bucket_fraction")
        if fraction != 0:   # 0: no sizes, the system's default (bench/slow_link.py --bucket-fraction 0)
            zero["stage3_prefetch_bucket_size"] = num_params(a) // (fraction or REUSE0_PREFETCH_FRACTION)
        if fraction:
            zero["reduce_bucket_size"] = num_params(a) // fraction
    elif stage == 3 and system in OURS and a.get("bucket_fraction"):   # held weights, the same buckets
        zero.update(dict.fromkeys(("stage3_prefetch_bucket_size", "reduce_bucket_size"),
                                  num_params(a) // a["bucket_fraction"]))
    switches = ZEROPP.get(system, ())
    if "auto" in switches:
        zero.update(zero_quantized_weights="auto", zero_hpz_partition_size="auto", zero_quantized_gradients="auto")
    if "qwz" in switches:
        zero["zero_quantized_weights"] = True
    if "hpz" in switches:
        zero["zero_hpz_partition_size"] = ranks_per_node(a)
    if "qgz" in switches:
        zero["zero_quantized_gradients"] = True
    if "loco" in switches:
        zero["zeropp_loco_param"] = {}
    if "deltas" in switches:
        zero["zero_quantized_weight_deltas"] = True
    if "int2" in switches:
        zero["zero_quantized_gradients_bits"] = 2
    if "deltas2" in switches:
        zero["zero_quantized_weight_deltas_bits"] = 2
    return zero


# --------------------------------------------------------------------------------------
# Model, data, optimizer: identical for every system.
# --------------------------------------------------------------------------------------
def model_config(a):
    from model import GPTConfig
    # Every weight's initial values come from (init_seed, its name) alone, so every system,
    # whole or built on the meta device and materialized shard by shard, starts the same.
    return GPTConfig(vocab_size=a["vocab"], num_layers=a["num_layers"], hidden_size=a["hidden"],
                     num_attention_heads=a["heads"], max_position_embeddings=a["seq"],
                     hidden_dropout=0.0, attention_dropout=0.0, init_seed=a["seed"])


def make_model(a, meta: bool = False):
    from model import GPT
    if meta:
        with torch.device("meta"):
            return GPT(model_config(a))
    return GPT(model_config(a))


def num_params(a) -> int:
    return sum(p.numel() for p in make_model(a, meta=True).parameters())


def make_batches(a, world):
    """Step i: world*micro sequences; rank r takes rows [r*micro, (r+1)*micro)."""
    g = torch.Generator().manual_seed(a["seed"] + 1)
    n = a["warmup"] + a["steps"]
    return [torch.randint(0, a["vocab"], (world * a["micro_batch"], a["seq"] + 1), generator=g)
            for _ in range(n)]
