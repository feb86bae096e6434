"""DeepSpeed's key names that zeropp/config/__init__.py checks against, as data.

- UNSUPPORTED: keys DeepSpeed reads that this engine does not implement, by
  section, each with a test for its "off" value (accepted: it asks for what
  the engine does anyway) and the advice given for any other value. Taken
  from DeepSpeed's runtime/config.py, runtime/constants.py and zero/config.py.
- OPTIMIZER_*, SCHEDULERS: the optimizer and schedule parameters accepted,
  with DeepSpeed's defaults.
- BUCKET_DEFAULTS: DeepSpeed's bucket sizes (elements), the caps of those derived
  from the model when the configuration sets none (zeropp/bucket_sizing.py).
"""
from __future__ import annotations

from typing import Callable

BUCKET_DEFAULTS = {"reduce_bucket_size": 500_000_000, "allgather_bucket_size": 500_000_000,
                   "stage3_prefetch_bucket_size": 50_000_000}

# Optimizer types the engine implements (lower case: DeepSpeed matches its own names
# case-insensitively) and the parameters each accepts.
_ADAM_PARAMS = ("lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam", "bias_correction", "amsgrad")
# torch_adam picks DeepSpeed's kernel (torch's Adam or FusedAdam: the same update) and with
# it the default weight_decay (AdamW 0.01, FusedAdam 0): honoured in OptimizerConfig.settings.
OPTIMIZER_PARAMS = {"adam": _ADAM_PARAMS, "adamw": _ADAM_PARAMS, "sgd": ("lr", "momentum", "weight_decay")}

# DeepSpeed's schedules (deepspeed/runtime/lr_schedules.py): parameters and defaults, None = required.
_WARMUP = {"warmup_min_lr": 0.0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000, "warmup_type": "log"}
SCHEDULERS = {
    "WarmupLR": _WARMUP,
    "WarmupDecayLR": {"total_num_steps": None, **_WARMUP},
    "WarmupCosineLR": {"total_num_steps": None, "warmup_min_ratio": 0.0, "warmup_num_steps": 1000,
                       "cos_min_ratio": 0.0001, "warmup_type": "log"},
}


def _never(value) -> bool:
    return False


def _only(*off):
    """Accepts exactly these JSON values (true is not 1)."""
    return lambda value: any(value is o or (type(value) is type(o) and value == o) for o in off)


def _disabled(value) -> bool:
    """A section that DeepSpeed leaves off: "enabled" false or absent."""
    return isinstance(value, dict) and value.get("enabled", False) is False


def _no_device(value) -> bool:
    return value is None or (isinstance(value, dict) and str(value.get("device", "none")).lower() == "none")


_REMOVE = "remove the key"
_OFF = "remove the section or set \"enabled\": false"
# Keys DeepSpeed reads that this engine does not implement, by section: (accepts the "off"
# value, advice). Anything else in these sections is a typo and gets "did you mean".
UNSUPPORTED: dict[str, dict[str, tuple[Callable, str]]] = {
    "DeepSpeedConfig": {
        "sparse_gradients": (_only(False), f"sparse embedding gradients are not implemented; {_REMOVE}"),
        "amp": (_disabled, "NVIDIA apex AMP is not implemented; use fp16 or bf16"),
        "pipeline": (_never, "pipeline parallelism is not implemented; remove the section"),
        "flops_profiler": (_disabled, f"the log line already reports TFLOPs; {_OFF}"),
        "comms_logger": (_disabled, f"the log line already reports bytes sent within and across nodes; {_OFF}"),
        "autotuning": (_disabled, f"autotuning is not implemented; {_OFF}"),
        "elasticity": (_disabled, f"elastic training is not implemented; {_OFF}"),
        "compression_training": (_never, "compression (quantization-aware training, pruning, layer "
                                         "reduction) is not implemented; remove the section"),
        "checkpoint": (_never, "DeepSpeed's checkpoint options are not implemented; checkpoints are "
                               "written and read with --save/--load; remove the section"),
        "aio": (_never, "async NVMe I/O serves offload, which is not implemented; remove the section"),
        "nebula": (_disabled, f"Nebula checkpointing is not implemented; {_OFF}"),
        "zero_force_ds_cpu_optimizer": (_never, f"it only matters with CPU offload, which is not "
                                                f"implemented; {_REMOVE}"),
        "dump_state": (_only(False), f"state dumps are not implemented; {_REMOVE}"),
        "disable_allgather": (_only(False), f"the all-gather of updated shards cannot be disabled; {_REMOVE}"),
        "memory_breakdown": (_only(False), f"the log already prints a model-state memory report; {_REMOVE}"),
        "graph_harvesting": (_only(False), f"CUDA graphs are not implemented; {_REMOVE}"),
        "seq_parallel_comm_data_type": (_never, f"sequence parallelism is not implemented; {_REMOVE}"),
        "wandb": (_disabled, f"Weights & Biases logging is not implemented; use --tensorboard-dir; {_OFF}"),
        "csv_monitor": (_disabled, f"CSV logging is not implemented; use --tensorboard-dir; {_OFF}"),
        "comet": (_disabled, f"Comet logging is not implemented; use --tensorboard-dir; {_OFF}"),
        "eigenvalue": (_disabled, f"eigenvalue computation is not implemented; {_OFF}"),
        "progressive_layer_drop": (_disabled, f"progressive layer drop is not implemented; {_OFF}"),
        "curriculum_learning": (_disabled, f"curriculum learning is not implemented; {_OFF}"),
        "data_efficiency": (_disabled, f"DeepSpeed's data-efficiency library is not implemented; {_OFF}"),
        "hybrid_engine": (_disabled, f"the RLHF hybrid engine is not implemented; {_OFF}"),
        "quantize_training": (_disabled, f"quantized training is not implemented; {_OFF}"),
        "torch_autocast": (_disabled, f"autocast is not implemented: fp16/bf16 run the model in 16 bits; {_OFF}"),
        "sparse_attention": (_never, "sparse attention is not implemented; remove the section"),
        "weight_quantization": (_never, "weight quantization for inference is not implemented; remove "
                                        "the section (ZeRO++ qwZ is zero_optimization.zero_quantized_weights)"),
        "tensor_parallel": (_never, "tensor parallelism is not implemented; remove the section"),
        "compile": (_never, "DeepSpeed's compile options are not implemented; remove the section"),
        "timers": (_never, "DeepSpeed's timers are not implemented (the log line times each "
                           "iteration); remove the section"),
        "dataloader_drop_last": (_never, f"the data loader is Megatron's sampler in train.py; {_REMOVE}"),
        "use_data_before_expert_parallelism": (_only(False), f"mixture of experts is not implemented; {_REMOVE}"),
        "vocabulary_size": (_never, f"the vocabulary size comes from the tokenizer; {_REMOVE}"),
        "bfloat16": (_never, "this is the old name of the bf16 section; rename it to bf16"),
    },
    "ZeroConfig": {
        "offload_optimizer": (_no_device, "optimizer offload to CPU/NVMe is not implemented; remove "
                                          "the section or set \"device\": \"none\""),
        "offload_param": (_no_device, "parameter offload to CPU/NVMe is not implemented; remove the "
                                      "section or set \"device\": \"none\""),
        "cpu_offload": (_only(False), f"optimizer offload to CPU is not implemented; {_REMOVE}"),
        "cpu_offload_param": (_only(False), f"parameter offload to CPU is not implemented; {_REMOVE}"),
        "cpu_offload_use_pin_memory": (_only(False), f"CPU offload is not implemented; {_REMOVE}"),
        "mics_shard_size": (_only(-1), "MiCS sharding is not implemented; to keep a copy of the weights "
                                       "inside each node use zero_hpz_partition_size (hpZ)"),
        "mics_hierarchical_params_gather": (_only(False), f"MiCS is not implemented; {_REMOVE}"),
        "zero_quantized_nontrainable_weights": (_only(False), "every weight here is trainable: use "
                                                              "zero_quantized_weights (qwZ)"),
        "memory_efficient_linear": (_only(False), f"the model's own linear layers run unchanged "
                                                  f"(DeepSpeed's replacement is not used); {_REMOVE}"),
        "stage3_module_granularity_threshold": (_only(0), f"modules are never fused into coarser "
                                                          f"fetch units; {_REMOVE}"),
        "stage3_model_persistence_threshold": (_never, f"only the per-parameter "
                                                       f"stage3_param_persistence_threshold exists; {_REMOVE}"),
        "stage3_use_all_reduce_for_fetch_params": (_only(False), f"weights are always all-gathered; {_REMOVE}"),
        "stage3_gather_fp16_weights_on_model_save": (_only(False), "checkpoints hold each rank's fp32 "
                                                                   "slices, never a gathered copy; run "
                                                                   "`python -m tools.export_checkpoint "
                                                                   "--load DIR --format torch --dtype fp16 "
                                                                   "--output "
                                                                   "model.pt` for the whole model"),
        "use_multi_rank_bucket_allreduce": (_never, f"a DeepSpeed all-reduce detail; {_REMOVE}"),
        "load_from_fp32_weights": (_never, f"loading always restores the checkpoint's fp32 state; {_REMOVE}"),
        "elastic_checkpoint": (_only(False), f"elastic checkpoints are not implemented; {_REMOVE}"),
        "legacy_stage1": (_only(False), f"there is one stage-1 implementation; {_REMOVE}"),
        "pipeline_loading_checkpoint": (_only(False), f"pipeline parallelism is not implemented; {_REMOVE}"),
        "override_module_apply": (_only(False), f"the engine never patches nn.Module.apply; {_REMOVE}"),
        "log_trace_cache_warnings": (_only(False), f"there is no trace cache to warn about; {_REMOVE}"),
    },
    "FP16Config": {
        "consecutive_hysteresis": (_only(False), f"hysteresis counts every overflow; {_REMOVE}"),
        "fp16_master_weights_and_grads": (_only(False), "master weights are always fp32; remove the key"),
    },
    "BF16Config": {
        "immediate_grad_update": (_only(False), f"gradients are applied at the optimizer step; {_REMOVE}"),
    },
    "OptimizerConfig": {
        "legacy_fusion": (_only(False), f"DeepSpeed's legacy fused optimizer is not used; {_REMOVE}"),
    },
}
