"""The stock DeepSpeed configs of the DeepSpeed tutorials (ZeRO, ZeRO++, monitor, config-json
reference) and of DeepSpeedExamples' Megatron GPT-2 scripts, written here from their documentation:
each loads unchanged through parse_args, or fails in one run that names every key refused."""
import json

import pytest

from common import forget_notes
from training.args import parse_args
from zeropp.config import ConfigError

REQUIRED = ["--train-iters", "10", "--lr", "1e-4", "--data-path", "corpus_text_document"]
FP16 = {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}
GPT2_ADAM = {"type": "Adam", "params": {"lr": 0.00015, "max_grad_norm": 1.0, "betas": [0.9, 0.95]}}
MAX_GRAD_NORM = "optimizer.params.max_grad_norm is not supported (nor by DeepSpeed)"

CONFIGS = [
    # deepspeed.ai/tutorials/zero: the 1.5B stage-1 config, the 10B stage-2 config, ZeRO-Infinity's stage 3
    ("ZeRO tutorial, stage 1", {"zero_optimization": {"stage": 1, "reduce_bucket_size": 5e8}}, []),
    ("ZeRO tutorial, stage 2", {"zero_optimization": {
        "stage": 2, "contiguous_gradients": True, "overlap_comm": True, "reduce_scatter": True,
        "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8}}, []),
    ("ZeRO tutorial, ZeRO-Infinity", {"zero_optimization": {
        "stage": 3, "contiguous_gradients": True, "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
        "stage3_prefetch_bucket_size": 1e7, "stage3_param_persistence_threshold": 1e5, "reduce_bucket_size": 1e7,
        "sub_group_size": 1e9, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}},
     ["offload_optimizer is not supported", "offload_param is not supported"]),
    # deepspeed.ai/tutorials/zeropp
    ("ZeRO++ tutorial", {"zero_optimization": {
        "stage": 3, "reduce_bucket_size": 10000000, "reduce_scatter": True, "zero_quantized_weights": True,
        "zero_hpz_partition_size": 16, "zero_quantized_gradients": True, "contiguous_gradients": True,
        "overlap_comm": True}}, []),
    # deepspeed.ai/tutorials/monitor (its tensorboard and csv_monitor; wandb and comet are refused apart)
    ("monitor tutorial, tensorboard", {"tensorboard": {"enabled": True, "output_path": "output/ds_logs/",
                                                       "job_name": "train_bert"}}, []),
    # deepspeed.ai/docs/config-json: activation_checkpointing as documented, every value its default
    ("config-json, activation_checkpointing", {"zero_optimization": {"stage": 3}, "activation_checkpointing": {
        "partition_activations": False, "cpu_checkpointing": False, "contiguous_memory_optimization": False,
        "number_checkpoints": None, "synchronize_checkpoint_boundary": False, "profile": False}}, []),
    # DeepSpeedExamples, megatron/Megatron-LM-v1.1.5-ZeRO3/examples/
    ("v1.1.5 ds_zero_stage_2_config.json", {
        "train_batch_size": 2048, "gradient_accumulation_steps": 1, "steps_per_print": 1,
        "zero_optimization": {"stage": 2, "allgather_partitions": True, "reduce_scatter": True,
                              "allgather_bucket_size": 50000000, "reduce_bucket_size": 50000000, "overlap_comm": True},
        "optimizer": GPT2_ADAM, "gradient_clipping": 1.0, "fp16": FP16, "wall_clock_breakdown": True,
        "zero_allow_untested_optimizer": False}, [MAX_GRAD_NORM]),
    ("v1.1.5 ds_zero_stage_3_config.json", {
        "train_batch_size": 64, "gradient_accumulation_steps": 1, "steps_per_print": 1,
        "zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                              "stage3_prefetch_bucket_size": 1e7, "stage3_param_persitence_threshold": 1e5,
                              "reduce_bucket_size": 1e7, "contiguous_gradients": True},
        "gradient_clipping": 1.0, "fp16": FP16, "wall_clock_breakdown": True, "zero_allow_untested_optimizer": False},
     ["unknown key 'stage3_param_persitence_threshold'; did you mean 'stage3_param_persistence_threshold'"]),
    ("v1.1.5 ds_zero_stage_3_config_release.json", {
        "train_batch_size": 64, "gradient_accumulation_steps": 1, "steps_per_print": 1,
        "zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e8,
                              "stage3_param_persitance_threshold": 1e5, "stage3_prefetch_bucket_size": 5e7,
                              "contiguous_gradients": True, "cpu_offload": True, "cpu_offload_params": True,
                              "cpu_offload_use_pin_memory": True, "overlap_comm": True,
                              "reduce_bucket_size": 90000000, "sub_group_size": 4e8},
        "gradient_clipping": 1.0, "fp16": FP16, "wall_clock_breakdown": True, "zero_allow_untested_optimizer": False},
     ["unknown key 'stage3_param_persitance_threshold'", "cpu_offload is not supported",
      "unknown key 'cpu_offload_params'", "cpu_offload_use_pin_memory is not supported", "sub_group_size"]),
    # DeepSpeedExamples, megatron/Megatron-LM/scripts/ds_zero2_config.json (the first ZeRO tutorial's)
    ("Megatron-LM ds_zero2_config.json", {
        "train_batch_size": 16, "gradient_accumulation_steps": 1, "steps_per_print": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 0.00015, "weight_decay": 1e-2}},
        "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True, "gradient_clipping": 1.0,
        "fp16": FP16, "activation_checkpointing": {"partition_activations": True,
                                                   "contiguous_memory_optimization": False},
        "wall_clock_breakdown": False}, []),
    # DeepSpeedExamples, megatron/Megatron-LM-v1.1.5-3D_parallelism/examples/ds_config.json
    ("3D parallelism ds_config.json", {"train_batch_size": 256, "train_micro_batch_size_per_gpu": 4,
                                       "steps_per_print": 10, "gradient_clipping": 1.0, "fp16": FP16,
                                       "wall_clock_breakdown": True, "zero_allow_untested_optimizer": False}, []),
]


def parse(tmp_path, config: dict, *flags: str):
    forget_notes()
    (tmp_path / "ds.json").write_text(json.dumps(config))
    return parse_args(REQUIRED + ["--deepspeed_config", str(tmp_path / "ds.json"), *flags])


@pytest.mark.parametrize("name, config, refused", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_stock_configs_load_or_name_every_refusal_at_once(tmp_path, capsys, name, config, refused):
    if not refused:
        parse(tmp_path, config)
        return
    with pytest.raises(ConfigError) as error:
        parse(tmp_path, config)
    assert len(error.value.problems) == len(refused), str(error.value)
    for fragment in refused:
        assert fragment in str(error.value)


def test_tensorboard_section_drives_tensorboard(tmp_path, capsys, monkeypatch):
    monitor = {"tensorboard": {"enabled": True, "output_path": "output/ds_logs/", "job_name": "train_bert"}}
    args = parse(tmp_path, monitor)
    assert args.tensorboard_dir == "output/ds_logs/train_bert" and args.deepspeed_tensorboard
    assert parse(tmp_path, {"tensorboard": {"enabled": True}}).tensorboard_dir == "DeepSpeedJobName"  # DeepSpeed's
    assert parse(tmp_path, {"tensorboard": {"enabled": False, "job_name": "x"}}).tensorboard_dir is None
    capsys.readouterr()
    args = parse(tmp_path, monitor, "--tensorboard-dir", "tb")
    assert args.tensorboard_dir == "tb"   # the flag wins, and says so
    assert ("> note: --tensorboard-dir tb conflicts with tensorboard.output_path/job_name=output/ds_logs/train_bert"
            in capsys.readouterr().out)


def test_activation_checkpointing_no_ops_are_noted(tmp_path, capsys):
    parse(tmp_path, {"activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True,
                                                  "synchronize_checkpoint_boundary": True}})
    note = [line for line in capsys.readouterr().out.splitlines() if "no effect here" in line]
    assert len(note) == 1 and "activation_checkpointing.partition_activations" in note[0]
    assert "synchronize_checkpoint_boundary" in note[0] and "cpu_checkpointing" in note[0]
