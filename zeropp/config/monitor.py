"""DeepSpeed's `tensorboard` and `activation_checkpointing` sections (deepspeed/monitor/config.py,
deepspeed/runtime/activation_checkpointing/config.py), with DeepSpeed's key names and defaults."""
from __future__ import annotations

import os
from dataclasses import dataclass



@dataclass
class TensorBoardConfig:
    """TensorBoard events in `output_path/job_name`, where DeepSpeed's TensorBoardMonitor writes
    them (an empty or null output_path: job_name under the directory the job starts in).
    training/deepspeed_args.py turns it into --tensorboard-dir; the flag wins."""
    enabled: bool = False
    output_path: str | None = ""
    job_name: str = "DeepSpeedJobName"

    def log_dir(self) -> str | None:
        return os.path.join(self.output_path or "", self.job_name) if self.enabled else None


@dataclass
class ActivationCheckpointingConfig:
    """How DeepSpeed's checkpointing stores what Megatron recomputes (--checkpoint-activations
    turns recompute on; this section only tunes it). Partitioning splits each saved activation
    over the tensor-parallel ranks, of which there is one here; the rest tunes where DeepSpeed
    keeps the pieces. Every value is accepted; `no_ops` says which do nothing here."""
    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = None
    synchronize_checkpoint_boundary: bool = False
    profile: bool = False

    def validate(self, where: str):
        """Every value is accepted (the section is read like the others)."""

    def no_ops(self, where: str) -> list[str]:
        """The keys set to a value that does something in DeepSpeed and nothing here."""
        why = {"partition_activations": "the tensor-parallel size is 1: nothing to partition",
               "cpu_checkpointing": "recomputed blocks' inputs stay on the device (the same training; --dry-run "
                                    "plans the device memory it takes)",
               "contiguous_memory_optimization": "saved activations stay where torch allocates them",
               "number_checkpoints": "sizes the contiguous buffer, which is not used",
               "synchronize_checkpoint_boundary": "a device synchronization for debugging",
               "profile": "DeepSpeed's checkpointing timers"}
        return [f"{where}.{key} ({reason})" for key, reason in why.items() if getattr(self, key) not in (False, None)]
