"""The one registry of the systems the benchmarks compare, by name: engine, ZeRO stage,
label, zero_optimization section, and the model, data and optimizer every system shares.
bench/slow_link/ranks.py builds them on a rank. "auto" rows are resolved by planner.auto (make_prepare)."""
from __future__ import annotations

import dataclasses
import os

import torch

# Ours with ZeRO++ switches: qwZ, hpZ (partition = ranks per node), qgZ, LoCo (qgZ's error feedback),
# INT4 weight deltas, INT2 gradients ("int2") and INT2 deltas ("deltas2"); "auto": planner.auto decides.
ZEROPP = {"zeropp-qwz": ("qwz",), "zeropp-hpz": ("hpz",), "zeropp-qgz": ("qgz",),
          "zeropp": ("qwz", "hpz", "qgz"), "deepspeed-z3-hpz": ("hpz",), "auto": ("auto",),
          "zeropp-loco": ("qwz", "hpz", "qgz", "loco"), "zeropp-deltas": ("qwz", "hpz", "qgz", "deltas"),
          "zeropp-loco-deltas": ("qwz", "hpz", "qgz", "loco", "deltas"),
          "zeropp-loco-deltas-int2": ("qwz", "hpz", "qgz", "loco", "deltas", "int2"),
          "zeropp-loco-deltas-int2-all": ("qwz", "hpz", "qgz", "loco", "deltas", "int2", "deltas2")}
# Streaming DiLoCo "diloco-h<H>": a group per node running the "zero3" row's engine, exchanging every
# H inner steps, built as train.py builds it (training/outer.py).
DILOCO = ("diloco-h16", "diloco-h64")
OURS = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "zero3-reuse0": 3,
        **{s: 3 for s in ZEROPP if not s.startswith("deepspeed")}, **dict.fromkeys(DILOCO, 3)}
DEEPSPEED = {"deepspeed-z1": 1, "deepspeed-z2": 2, "deepspeed-z3": 3, "deepspeed-z3-reuse0": 3,
             "deepspeed-z3-hpz": 3}
FSDP2_PLAIN = ("fsdp2", "fsdp2-hpz")
# FSDP2 + our plug-in (zeropp.fsdp.apply_zeropp): its switches per row.
_OFF = dict(quantized_weights=False, hpz=False, quantized_gradients=False, loco=False)
FSDP2_PLUGIN = {"fsdp2+overlap": dict(_OFF), "fsdp2+qwz": {**_OFF, "quantized_weights": True},
                "fsdp2+hpz": {**_OFF, "hpz": True}, "fsdp2+qgz": {**_OFF, "quantized_gradients": True},
                "fsdp2+loco": {**_OFF, "quantized_gradients": True, "loco": True},
                "fsdp2+zeropp": dict(quantized_weights=True, hpz=True, quantized_gradients=True, loco=True)}
# HSDP: FSDP2 on a (nodes, ranks per node) mesh, the weights gathered inside the node and the gradients
# all-reduced across it: plain, and with the plug-in compressing that all-reduce (qgZ + LoCo).
HSDP = ("hsdp", "hsdp+zeropp")
FSDP2_PLUGIN["hsdp+zeropp"] = {**_OFF, "quantized_gradients": True, "loco": True}
FSDP2 = FSDP2_PLAIN + ("hsdp",) + tuple(FSDP2_PLUGIN)
# Rows whose reduce-scatter is torch's reduce_scatter_tensor, which gloo runs as a full all-reduce
# (twice a ring's bytes); ours send an all-to-all on gloo (zeropp/collectives/exact.py). HSDP's stays
# inside the node.
GLOO_ALL_REDUCE_PEERS = (FSDP2_PLAIN + tuple(k for k, v in FSDP2_PLUGIN.items() if not v["quantized_gradients"])
                         + tuple(DEEPSPEED))
# One node, no link (`bench.slow_link local`); the ZeRO++ rows need nodes: SLOW_LINK_SYSTEMS.
ALL_SYSTEMS = ["ddp", "zero1", "zero2", "zero3", "zero3-reuse0", "fsdp2", "deepspeed-z1", "deepspeed-z2",
               "deepspeed-z3", "deepspeed-z3-reuse0"]
DEFAULT_SYSTEMS = ["ddp", "zero1", "zero2", "zero3", "zero3-reuse0", "fsdp2", "deepspeed-z3"]
WORLD1_SYSTEMS = ["plain", "ddp", "zero3"]
SLOW_LINK_SYSTEMS = ["zero3-reuse0", "zero3", *(s for s in ZEROPP if not s.startswith("deepspeed")), "fsdp2",
                     "fsdp2-hpz", "deepspeed-z3-reuse0", "deepspeed-z3-hpz", "hsdp", *FSDP2_PLUGIN, *DILOCO]
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
          "fsdp2+overlap": "FSDP2 + plug-in, no technique (its CPU overlap)", "fsdp2+qwz": "FSDP2 + plug-in qwZ",
          "fsdp2+hpz": "FSDP2 + plug-in hpZ", "fsdp2+qgz": "FSDP2 + plug-in qgZ",
          "fsdp2+loco": "FSDP2 + plug-in qgZ+LoCo", "fsdp2+zeropp": "FSDP2 + plug-in qwZ+hpZ+qgZ+LoCo",
          "hsdp": "PyTorch HSDP (FSDP2, replicate x node)", "hsdp+zeropp": "HSDP + plug-in qgZ+LoCo",
          **{s: f"ours streaming DiLoCo H={s.rsplit('-h', 1)[1]}" for s in DILOCO}}
PERSISTENCE_THRESHOLD = 100_000  # DeepSpeed's default stage3_param_persistence_threshold
# "reuse 0": weights released after forward, gathered again in backward; prefetch bucket
# 1/REUSE0_PREFETCH_FRACTION of the model unless a["bucket_fraction"] sets prefetch and reduce buckets.
REUSE0 = ("zero3-reuse0", "deepspeed-z3-reuse0", *ZEROPP)
REUSE0_PREFETCH_FRACTION = 4
OPTIM = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
SWITCHES = ("zero_quantized_weights", "zero_hpz_partition_size", "zero_quantized_gradients")
_KEYS = {"qwz": ("zero_quantized_weights", True), "qgz": ("zero_quantized_gradients", True),
         "loco": ("zeropp_loco_param", {}), "deltas": ("zero_quantized_weight_deltas", True),
         "int2": ("zero_quantized_gradients_bits", 2), "deltas2": ("zero_quantized_weight_deltas_bits", 2)}


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
    return a.get("dtype", "fp32") == "bf16"


def zero_section(system: str, a) -> dict:
    """The zero_optimization section our engine and DeepSpeed get for `system`."""
    stage = stage_of(system)
    zero = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = PERSISTENCE_THRESHOLD
    fraction = a.get("bucket_fraction")
    if system in REUSE0:
        zero["stage3_max_reuse_distance"] = 0
        if fraction != 0:   # 0: no sizes, the system's default
            zero["stage3_prefetch_bucket_size"] = num_params(a) // (fraction or REUSE0_PREFETCH_FRACTION)
        if fraction:
            zero["reduce_bucket_size"] = num_params(a) // fraction
    elif stage == 3 and system in OURS and fraction:   # held weights, the same buckets
        zero.update(dict.fromkeys(("stage3_prefetch_bucket_size", "reduce_bucket_size"), num_params(a) // fraction))
    switches = ZEROPP.get(system, ())
    if "auto" in switches:
        zero.update(dict.fromkeys(SWITCHES, "auto"))
    if "hpz" in switches:
        zero["zero_hpz_partition_size"] = ranks_per_node(a)
    zero.update((k, dict(v) if isinstance(v, dict) else v) for k, v in (_KEYS[s] for s in switches if s in _KEYS))
    return zero


# The "auto" row: planner.auto.resolve(ds_config, cfg, comm, device, micro_batch, seq, accumulation) on
# every rank at the rate it is timed at; returns (dict, lines) or a Resolution (.config, .lines, .predicted).
class AutoUnavailable(RuntimeError):
    pass


def make_prepare(a: dict, cfg, info: dict):
    """A build_system(prepare=...) callable resolving the "auto" switches; fills `info`."""
    def prepare(raw: dict, comm):
        try:
            from planner.auto import resolve
        except Exception as e:  # noqa: BLE001 (any failure to import is the row's error)
            raise AutoUnavailable(f"auto: planner.auto does not import ({type(e).__name__}: {e})") from e
        res = resolve(raw, cfg, comm, torch.device("cpu"), a["micro_batch"], a["seq"], 1)
        resolved, lines = res if isinstance(res, tuple) else (res.config, res.lines)
        zero = (resolved["zero_optimization"] if isinstance(resolved, dict)
                else dataclasses.asdict(resolved.zero_optimization))
        left = [k for k in SWITCHES if zero.get(k) == "auto"]
        if left:
            raise AutoUnavailable(f"auto: planner.auto.resolve left {', '.join(left)} = auto")
        info.update(log=[str(x) for x in lines], switches={k: zero.get(k) for k in SWITCHES},
                    zero_optimization=zero, predicted_s=getattr(res, "predicted", None))
        return resolved
    return prepare


def chosen(switches: dict | None) -> str:
    """'qwZ+hpZ', 'none (ZeRO-3)', ... from resolved switches."""
    if not switches:
        return "-"
    on = [name for name, yes in (("qwZ", switches.get("zero_quantized_weights") is True),
                                 ("hpZ", (switches.get("zero_hpz_partition_size") or 1) > 1),
                                 ("qgZ", switches.get("zero_quantized_gradients") is True)) if yes]
    return "+".join(on) or "none (ZeRO-3)"


# Model, data, optimizer: identical for every system. Every weight's initial values come from
# (init_seed, its name) alone, so whole or meta-built and materialized shard by shard, all start the same.
def model_config(a):
    from model import GPTConfig
    return GPTConfig(vocab_size=a["vocab"], num_layers=a["num_layers"], hidden_size=a["hidden"],
                     num_attention_heads=a["heads"], max_position_embeddings=a["seq"],
                     hidden_dropout=0.0, attention_dropout=0.0, init_seed=a["seed"])


def make_model(a, meta: bool = False):
    from model import GPT
    with torch.device("meta" if meta else "cpu"):
        return GPT(model_config(a))


def num_params(a) -> int:
    return sum(p.numel() for p in make_model(a, meta=True).parameters())


def block_params(a) -> int:
    return sum(p.numel() for p in make_model(a, meta=True).blocks[0].parameters())


def make_batches(a, world):
    """Step i: world*micro sequences; rank r takes rows [r*micro, (r+1)*micro)."""
    g = torch.Generator().manual_seed(a["seed"] + 1)
    return [torch.randint(0, a["vocab"], (world * a["micro_batch"], a["seq"] + 1), generator=g)
            for _ in range(a["warmup"] + a["steps"])]
