"""DeepSpeed-style config parsing and fp16 loss-scale dynamics (no processes)."""
import pytest

from zeropp.config import ConfigError, DeepSpeedConfig, FP16Config, ZeroConfig
from zeropp.stages.loss_scaler import LossScaler


def test_deepspeed_defaults_and_sizes():
    cfg = DeepSpeedConfig.from_dict({"zero_optimization": {"stage": 3, "reduce_bucket_size": "5e8",
                                                           "stage3_prefetch_bucket_size": 5e7}})
    z = cfg.zero_optimization
    assert z.reduce_bucket_size == 500_000_000 and z.stage3_prefetch_bucket_size == 50_000_000
    assert z.stage3_param_persistence_threshold == 100_000 and z.overlap  # stage 3 overlaps by default
    assert not DeepSpeedConfig.from_dict({"zero_optimization": {"stage": 2}}).zero_optimization.overlap


@pytest.mark.parametrize("raw, message", [
    ({"zero_optimisation": {}}, "unknown key 'zero_optimisation'; did you mean 'zero_optimization'"),
    ({"fp16": {"enabled": True, "loss_scale_windw": 10}}, "did you mean 'loss_scale_window'"),
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu"}}},
     "offload_optimizer is not supported: optimizer offload"),
    ({"zero_optimization": {"reduce_bucket_size": 1.5}}, "must be a whole number"),
    ({"zero_optimization": {"contiguous_gradients": "yes"}}, "must be true or false"),
    ({"zero_optimization": {"stage": 2, "zero_quantized_weights": True}}, "need stage 3"),
    ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "pick one"),
])
def test_bad_config_names_the_key(raw, message):
    with pytest.raises(ConfigError, match=message):
        DeepSpeedConfig.from_dict(raw)


def test_dynamic_scale_hysteresis_min_and_growth():
    s = LossScaler(FP16Config(enabled=True, initial_scale_power=4, hysteresis=2, loss_scale_window=3,
                              min_loss_scale=4))
    assert s.scale == 16
    s.update(overflow=True)
    assert s.scale == 16           # the first overflow only uses up hysteresis
    s.update(overflow=True)
    assert s.scale == 8
    s.update(overflow=True)
    assert s.scale == 4
    s.update(overflow=True)
    assert s.scale == 4            # never below min_loss_scale
    for _ in range(3):
        s.update(overflow=False)
    assert s.scale == 8            # `window` clean steps in a row double it
    state = s.state_dict()
    t = LossScaler(FP16Config(enabled=True))
    t.load_state_dict(state)
    assert t.scale == 8 and t.state_dict() == state


def test_static_and_disabled_scales_never_move():
    static = LossScaler(FP16Config(enabled=True, loss_scale=128))
    off = LossScaler(FP16Config(enabled=False))
    for overflow in (True, False, True):
        static.update(overflow)
        off.update(overflow)
    assert static.scale == 128 and off.scale == 1.0


# Keys DeepSpeed has that this engine does not implement (or implements one way only).
REFUSED = [
    ({"sparse_gradients": True}, "sparse_gradients"),
    ({"elasticity": {"enabled": True, "max_train_batch_size": 64}}, "elasticity"),
    ({"flops_profiler": {"enabled": True}}, "flops_profiler"),
    ({"comms_logger": {"enabled": True}}, "comms_logger"),
    ({"compression_training": {"weight_quantization": {}}}, "compression_training"),
    ({"autotuning": {"enabled": True}}, "autotuning"),
    ({"checkpoint": {"tag_validation": "Warn"}}, "checkpoint"),
    ({"aio": {"block_size": 1048576}}, "aio"),
    ({"zero_force_ds_cpu_optimizer": False}, "zero_force_ds_cpu_optimizer"),
    ({"dump_state": True}, "dump_state"),
    ({"amp": {"enabled": True}}, "amp"),
    ({"pipeline": {"stages": 2}}, "pipeline"),
    ({"bfloat16": {"enabled": True}}, "bfloat16"),
    ({"fp16": {"enabled": True, "auto_cast": True}}, "fp16.auto_cast"),
    ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}}, "fp16_master_weights_and_grads"),
    ({"data_types": {"grad_accum_dtype": "bf16"}}, "data_types.grad_accum_dtype"),
    ({"zero_optimization": {"offload_param": {"device": "nvme"}}}, "offload_param"),
    ({"zero_optimization": {"mics_shard_size": 8}}, "mics_shard_size"),
    ({"zero_optimization": {"zero_quantized_nontrainable_weights": True}}, "zero_quantized_nontrainable_weights"),
    ({"zero_optimization": {"memory_efficient_linear": True}}, "memory_efficient_linear"),
    ({"zero_optimization": {"stage3_module_granularity_threshold": 100}}, "stage3_module_granularity_threshold"),
    ({"zero_optimization": {"contiguous_gradients": False}}, "contiguous_gradients"),
    ({"zero_optimization": {"reduce_scatter": False}}, "reduce_scatter"),
    ({"zero_optimization": {"allgather_partitions": False}}, "allgather_partitions"),
    ({"zero_optimization": {"round_robin_gradients": True}}, "round_robin_gradients"),
    ({"zero_optimization": {"sub_group_size": 1e8}}, "sub_group_size"),
    ({"optimizer": {"type": "Lamb", "params": {"lr": 1e-3}}}, "optimizer.type"),
    ({"optimizer": {"type": "OneBitAdam"}}, "optimizer.type"),
    ({"optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}}, "max_grad_norm"),
    ({"optimizer": {"type": "Adam", "params": {"fused": True}}}, "optimizer.params.fused"),
    ({"optimizer": {"type": "AdamW", "params": {"adam_w_mode": False}}}, "adam_w_mode"),
    ({"optimizer": {"type": "SGD", "params": {"nesterov": True}}}, "optimizer.params.nesterov"),
    ({"scheduler": {"type": "OneCycle", "params": {}}}, "scheduler.type"),
    ({"scheduler": {"type": "WarmupLR", "params": {"last_batch_iteration": 5}}}, "last_batch_iteration"),
]


@pytest.mark.parametrize("raw, key", REFUSED, ids=[k for _, k in REFUSED])
def test_deepspeed_keys_we_lack_say_not_supported(raw, key):
    with pytest.raises(ConfigError) as e:
        DeepSpeedConfig.from_dict(raw)
    assert "not supported" in str(e.value) and key in str(e.value)
    assert "did you mean" not in str(e.value)


def test_off_values_of_unsupported_keys_are_accepted():
    DeepSpeedConfig.from_dict({
        "sparse_gradients": False, "flops_profiler": {"enabled": False, "profile_step": 1},
        "wall_clock_breakdown": False, "activation_checkpointing": {}, "zero_allow_untested_optimizer": True,
        "fp16": {"enabled": True, "auto_cast": False}, "data_types": {"grad_accum_dtype": "fp32"},
        "zero_optimization": {"offload_optimizer": {"device": "none"}, "mics_shard_size": -1,
                              "contiguous_gradients": True, "reduce_scatter": True, "sub_group_size": 1e9,
                              "round_robin_gradients": False, "allgather_partitions": True}})


def test_tutorial_config_loads_unchanged():
    cfg = DeepSpeedConfig.from_file("configs/ds_zeropp_config.json")
    z = cfg.zero_optimization
    assert z.stage == 3 and z.zero_hpz_partition_size == 16 and z.reduce_bucket_size == 10_000_000
    assert cfg.fp16.enabled and cfg.train_micro_batch_size_per_gpu == 1 and cfg.steps_per_print == 10


@pytest.mark.parametrize("spelling, name", [("fp32", "fp32"), ("float32", "fp32"), ("FP16", "fp16"),
                                            ("half", "fp16"), ("bfloat16", "bf16"), (None, None)])
def test_communication_data_type(spelling, name):
    assert DeepSpeedConfig.from_dict({"communication_data_type": spelling}).communication_data_type == name


def test_communication_data_type_rejects_others():
    with pytest.raises(ConfigError, match="communication_data_type 'int8' must be fp32, fp16 or bf16"):
        DeepSpeedConfig.from_dict({"communication_data_type": "int8"})


def test_gradient_averaging_factors():
    # DeepSpeed's default (postscale): divide by the factor before the sum, by world/factor after.
    cfg = DeepSpeedConfig.from_dict({"gradient_predivide_factor": 4})
    assert cfg.gradient_predivide_factor == 4.0
    assert cfg.gradient_scale_factors(8) == (0.25, 0.5)
    assert DeepSpeedConfig().gradient_scale_factors(8) == (1.0, 0.125)
    assert DeepSpeedConfig.from_dict({"prescale_gradients": True}).gradient_scale_factors(8) == (0.125, 1.0)
    with pytest.raises(ConfigError, match="gradient_predivide_factor 2.0 has no effect with prescale"):
        DeepSpeedConfig.from_dict({"prescale_gradients": True, "gradient_predivide_factor": 2})
    with pytest.raises(ConfigError, match="gradient_predivide_factor must be > 0"):
        DeepSpeedConfig.from_dict({"gradient_predivide_factor": 0})


def test_new_fields_parse():
    cfg = DeepSpeedConfig.from_dict({"data_types": {"grad_accum_dtype": "float32"},
                                     "zero_optimization": {"ignore_unused_parameters": False}})
    assert cfg.data_types.grad_accum_dtype == "fp32"
    assert cfg.zero_optimization.ignore_unused_parameters is False


@pytest.mark.parametrize("section, expected", [
    ({"type": "Adam"}, dict(type="adamw", lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)),
    ({"type": "adam", "params": {"adam_w_mode": False, "weight_decay": 0.1}}, dict(type="adam", weight_decay=0.1)),
    ({"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95]}}, dict(type="adamw", lr=3e-4, betas=(0.9, 0.95))),
    ({"type": "AdamW", "params": {"torch_adam": True}}, dict(type="adamw", weight_decay=0.01)),  # torch's default
    ({"type": "sgd", "params": {"lr": 0.1, "momentum": 0.9}}, dict(type="sgd", lr=0.1, momentum=0.9, weight_decay=0.0)),
])
def test_optimizer_types_map_to_settings(section, expected):
    settings = DeepSpeedConfig.from_dict({"optimizer": section}).optimizer.settings()
    for name, value in expected.items():
        assert getattr(settings, name) == value, name


def test_scheduler_defaults_and_checks():
    cfg = DeepSpeedConfig.from_dict({"scheduler": {"type": "warmuplr", "params": {"warmup_num_steps": "1e2"}}})
    assert cfg.scheduler.type == "WarmupLR"
    assert cfg.scheduler.params == {"warmup_min_lr": 0.0, "warmup_max_lr": 0.001, "warmup_num_steps": 100,
                                    "warmup_type": "log"}
    cos = DeepSpeedConfig.from_dict({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 5000}}})
    assert cos.scheduler.params["cos_min_ratio"] == 0.0001 and cos.scheduler.params["warmup_min_ratio"] == 0.0
    for params, message in [({}, "total_num_steps is required for WarmupDecayLR"),
                            ({"total_num_steps": 10, "warmup_type": "exp"}, "must be 'log' or 'linear'"),
                            ({"total_num_steps": 10, "warmup_max_lr": [1e-3]}, "warmup_max_lr must be a number")]:
        with pytest.raises(ConfigError, match=message):
            DeepSpeedConfig.from_dict({"scheduler": {"type": "WarmupDecayLR", "params": params}})
    with pytest.raises(ConfigError, match="total_num_steps 100 must exceed warmup_num_steps"):
        DeepSpeedConfig.from_dict({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 100}}})


@pytest.mark.parametrize("raw, message", [
    ({"zero_optimization": {"gradient_predivide_factor": 2}}, "'gradient_predivide_factor' belongs at the top level"),
    ({"stage3_max_live_parameters": 10}, "'stage3_max_live_parameters' belongs in zero_optimization"),
])
def test_misplaced_key_says_where_it_belongs(raw, message):
    with pytest.raises(ConfigError, match=message):
        DeepSpeedConfig.from_dict(raw)


@pytest.mark.parametrize("key", ["stage3_gather_16bit_weights_on_model_save",
                                 "stage3_gather_fp16_weights_on_model_save"])
def test_gathered_save_keys_are_honoured(key):
    """DeepSpeed's key (and its old name) turns on the consolidated 16-bit file at each save
    (tests/integration/checkpoints/test_checkpoint_runs.py checks the file)."""
    cfg = DeepSpeedConfig.from_dict({"zero_optimization": {"stage": 3, key: True}})
    assert cfg.zero_optimization.stage3_gather_16bit_weights_on_model_save is True
    assert DeepSpeedConfig.from_dict({}).zero_optimization.stage3_gather_16bit_weights_on_model_save is False


# -- bucket sizes from the model where the config sets none (zeropp/bucket_sizing.py) ----------

BUCKET_KEYS = ("reduce_bucket_size", "allgather_bucket_size", "stage3_prefetch_bucket_size")


def sizes(zero):
    return [getattr(zero, k) for k in BUCKET_KEYS]


def test_unset_bucket_sizes_come_from_the_model_and_set_ones_are_kept():
    from zeropp.bucket_sizing import bucket_sizes, describe
    unset = DeepSpeedConfig.from_dict({"zero_optimization": {"stage": 3}}).zero_optimization
    assert sizes(unset) == [None] * 3
    assert sizes(bucket_sizes(unset, 3_400_000)) == [425_000] * 3             # 1/8 of the model
    assert sizes(bucket_sizes(unset, 10**10)) == [500_000_000, 500_000_000, 50_000_000]   # DeepSpeed's defaults
    auto = DeepSpeedConfig.from_dict({"zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                                                            "stage3_prefetch_bucket_size": "auto"}})
    assert sizes(bucket_sizes(auto.zero_optimization, 800)) == [100] * 3      # "auto" (HF's spelling) = unset
    some = DeepSpeedConfig.from_dict({"zero_optimization": {"stage": 3, "reduce_bucket_size": 1e6}}).zero_optimization
    used = bucket_sizes(some, 3_400_000)
    assert sizes(used) == [1_000_000, 425_000, 425_000]
    assert describe(some, used, 3_400_000) == (
        "> buckets sized from the model (3,400,000 parameters / 8, at most DeepSpeed's defaults): "
        "allgather_bucket_size 425,000, stage3_prefetch_bucket_size 425,000 elements; set them in "
        "zero_optimization to choose")
    every = DeepSpeedConfig.from_dict({"zero_optimization": {"stage": 3, **dict.fromkeys(BUCKET_KEYS, 5e6)}})
    assert bucket_sizes(every.zero_optimization, 10) is every.zero_optimization
    assert describe(every.zero_optimization, every.zero_optimization, 10) is None
    assert describe(ZeroConfig(stage=0), bucket_sizes(ZeroConfig(stage=0), 80), 80) is None   # DDP's own buckets
    with pytest.raises(ConfigError, match="reduce_bucket_size must be a positive"):
        DeepSpeedConfig.from_dict({"zero_optimization": {"stage": 3, "reduce_bucket_size": 0}})


def test_engine_and_dry_run_size_the_buckets_alike():
    """zeropp.initialize sizes from the module's parameters, the planner from its trace: the same sizes."""
    import torch

    import zeropp
    from model import GPT, GPTConfig
    from parallel.comm import Communicator
    from parallel.topology import Topology
    from planner.plan import Job, plan_config
    from planner.trace import trace_model
    from zeropp.config import OptimizerSettings
    cfg = GPTConfig(vocab_size=320, num_layers=2, hidden_size=32, num_attention_heads=4, max_position_embeddings=16)
    ds = DeepSpeedConfig.from_dict({"zero_optimization": {"stage": 3, "reduce_bucket_size": 5000}})
    model = GPT(cfg)
    engine = zeropp.initialize(model, ds, Communicator(Topology(1, 0, 1)), torch.device("cpu"), OptimizerSettings())
    numel = sum(p.numel() for p in model.parameters())
    assert sizes(engine.config.zero_optimization) == [5000, numel // 8, numel // 8]
    assert sizes(ds.zero_optimization) == [5000, None, None]   # the caller's config is left as given
    trace = trace_model(cfg, torch.float32, 1, 16, 0)
    job = Job(cfg=cfg, ds=ds, optimizer=OptimizerSettings(), world=4, ranks_per_node=2, micro_batch=1,
              seq_length=16, accumulation=1)
    assert sizes(plan_config(job, ds.zero_optimization, trace, None).zero) == sizes(engine.config.zero_optimization)
