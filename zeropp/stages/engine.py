"""The training engine: it owns the model's precision, backward, gradient
communication and the optimizer step, so the training loop stays plain:

    engine = zeropp.initialize(model, ds_config, comm, device, optim, grad_accum,
                               param_init=...)   # param_init: for a model built on "meta"
    for micro_batch in range(grad_accum):
        loss = engine(tokens, labels)
        engine.backward(loss)
    result = engine.step()          # StepResult(skipped, grad_norm, loss_scale)

`Engine` holds what every ZeRO stage shares (loss scaling, accumulation,
clipping, learning rate). Stage 0 (`DDPEngine`, also every stage's short path at
world size 1) is zeropp/stages/stage0.py; the sharded stages are zeropp/stages/sharded.py,
stage12.py, stage3*.py, composed by zeropp/build.py.

Gradients of 16-bit training accumulate across micro-steps in fp32
(DeepSpeed's data_types.grad_accum_dtype = fp32).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from parallel.comm import Communicator
from zeropp.collectives.partition import FlatState
from zeropp import techniques
from zeropp.config import DeepSpeedConfig, OptimizerSettings
from zeropp.stages.loss_scaler import LossScaler
from zeropp.stages.wall_clock import WallClock


@dataclass
class StepResult:
    skipped: bool          # an fp16 overflow was found on some rank: no update anywhere
    grad_norm: float       # global norm of the unscaled gradient before clipping (nan if skipped)
    loss_scale: float      # the scale the step's gradients were computed with


def split_decay(module: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """Weight decay applies to matrices; biases and norm gains are exempt.
    Tied parameters appear once."""
    decay, no_decay = [], []
    for p in module.parameters():  # parameters() already de-duplicates shared tensors
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return decay, no_decay


def compute_dtype(config: DeepSpeedConfig) -> torch.dtype:
    if config.fp16.enabled:
        return torch.float16
    if config.bf16.enabled:
        return torch.bfloat16
    return torch.float32


_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def communication_dtype(config: DeepSpeedConfig) -> torch.dtype:
    """Gradients are reduced in `communication_data_type` (default: the compute dtype)."""
    name = config.communication_data_type
    return _DTYPES[name] if name else compute_dtype(config)


def make_optimizer(s: OptimizerSettings, device, decay: list[torch.Tensor], no_decay: list[torch.Tensor]):
    """torch's optimizer for `s` over two groups: with weight decay (matrices) and without."""
    groups = [{"params": decay, "weight_decay": s.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    if not groups:  # a rank that owns no element (more ranks than elements)
        groups = [{"params": [torch.zeros(0, device=device, requires_grad=True)]}]
    # foreach=True: one fused pass over all tensors, also on CPU.
    if s.type == "sgd":
        return torch.optim.SGD(groups, lr=s.lr, momentum=s.momentum, foreach=True)
    cls = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam}[s.type]
    return cls(groups, lr=s.lr, betas=s.betas, eps=s.eps, foreach=True)


class Engine:
    """Shared machinery; subclasses implement `_grad_norm_sq`, `_apply_update`,
    `_zero_grad` and the state-dict methods."""

    def __init__(self, module: nn.Module, config: DeepSpeedConfig, comm: Communicator,
                 device: torch.device, optim: OptimizerSettings, gradient_accumulation_steps: int = 1):
        self.module = module
        self.config = config
        self.comm = comm
        self.device = device
        self.optim_settings = optim
        self.dtype = compute_dtype(config)
        self.loss_scaler = LossScaler(config.fp16)
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.clip = config.gradient_clipping
        self.micro_step = 0        # micro-batches seen since the last optimizer step
        self.global_step = 0       # optimizer steps taken (skipped ones included)
        self.skipped_steps = 0     # of those, skipped on an fp16 overflow (DeepSpeed's name)
        self.lr = optim.lr
        self.clock = WallClock(config.wall_clock_breakdown, device)
        # The synchronization across groups (streaming DiLoCo) when zeropp.outer's attach gave this
        # engine one (zeropp/outer/diloco.py OuterSync, its face the trainer reads); None otherwise.
        self.outer = None

    # -- training loop interface -----------------------------------------
    def __call__(self, *args, **kwargs):
        with self.clock.phase("forward"):
            return self.forward(*args, **kwargs)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def is_gradient_accumulation_boundary(self) -> bool:
        """True while running the last micro-batch before an optimizer step."""
        return self.micro_step + 1 == self.gradient_accumulation_steps

    def backward(self, loss: torch.Tensor):
        with self.clock.phase("backward"):
            self._backward(loss)

    def _backward(self, loss: torch.Tensor):
        """Subclasses add what they do around autograd (gradient reduction)."""
        with self.clock.phase("backward_inner"):
            # Average over micro-batches and apply the fp16 loss scale in one multiply.
            (loss * (self.loss_scaler.scale / self.gradient_accumulation_steps)).backward()
        self.micro_step += 1

    def step(self) -> StepResult:
        with self.clock.phase("step"):
            return self._step()

    def _step(self) -> StepResult:
        if self.micro_step != self.gradient_accumulation_steps:
            raise RuntimeError(f"step() after {self.micro_step} backward() calls; expected "
                               f"{self.gradient_accumulation_steps} (gradient accumulation steps)")
        scale = self.loss_scaler.scale
        self._gradients_reduced()
        norm_sq = self._grad_norm_sq()  # of the scaled gradient; inf/nan on overflow
        norm = math.sqrt(norm_sq) / scale if math.isfinite(norm_sq) else float("nan")
        overflow = not math.isfinite(norm)
        if not overflow:
            coef = 1.0 / scale
            if self.clip > 0 and norm > self.clip:
                coef *= self.clip / (norm + 1e-6)
            self._apply_update(coef)
        self._end_step(applied=not overflow)
        self._zero_grad()
        self.loss_scaler.update(overflow)
        self.micro_step = 0
        self.global_step += 1
        self.skipped_steps += int(overflow)
        return StepResult(skipped=overflow, grad_norm=norm, loss_scale=scale)

    def _gradients_reduced(self):
        """Hook: the step's gradients are reduced; nothing has read them yet."""

    def _end_step(self, applied: bool):
        """Hook: commit the state carried from step to step (qgZ's error feedback) when the
        step was applied; leave it as it was when it was skipped (ARCHITECTURE.md)."""

    def set_lr(self, lr: float):
        self.lr = lr
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def train(self, mode: bool = True):
        self.module.train(mode)
        return self

    def eval(self):
        return self.train(False)

    # -- helpers for subclasses -------------------------------------------
    def summary(self) -> list[str]:
        """Lines for the end of a run, from the parts that have one (train.py prints them)."""
        return []

    def memory_lines(self) -> list:
        """What techniques keep besides the model states (zeropp/collectives/protocols.py MemoryLine)."""
        return []

    def num_trained_parameters(self) -> int:
        return sum(p.numel() for p in self.module.parameters() if p.requires_grad)

    def _make_optimizer(self, decay: list[torch.Tensor], no_decay: list[torch.Tensor]):
        return make_optimizer(self.optim_settings, self.device, decay, no_decay)

    def _optimizer_tensors(self) -> list[torch.Tensor]:
        return [t for st in self.optimizer.state.values() for t in st.values() if torch.is_tensor(t)]


    # -- checkpoint state: what every engine shares --------------------------
    # checkpoint_state() lists what this rank saves or loads as flat tensors
    # (training/checkpoint/ writes them with torch.distributed.checkpoint):
    #   model.<name>            the fp32 weight (the master in 16-bit training)
    #   optim.<moment>.<name>   the optimizer's per-element state (Adam: exp_avg, exp_avg_sq)
    #   optim.step              the optimizer's step count
    # The stage-3 16-bit weights and hpZ's secondary partition are never saved:
    # they are rebuilt from the masters by checkpoint_loaded().
    def checkpoint_state(self, for_load: bool = False, optimizer: bool = True) -> dict[str, FlatState]:
        """`for_load`: the tensors are the engine's own storage, to be filled in
        place (optimizer state is created if it does not exist yet); then call
        checkpoint_loaded(). Otherwise they are views to write out (no copy)."""
        raise NotImplementedError

    def checkpoint_loaded(self, state: dict[str, FlatState]):
        """The tensors of checkpoint_state(for_load=True) were filled: rebuild the rest."""
        raise NotImplementedError

    def scalar_state(self) -> dict:
        """Small state every rank holds the same copy of (goes to the checkpoint's metadata)."""
        steps = {float(st["step"]) for st in self.optimizer.state.values() if "step" in st}
        return {"loss_scaler": self.loss_scaler.state_dict(), "global_step": self.global_step,
                "skipped_steps": self.skipped_steps,
                # also optim.step's tensor, but that is one for the job: groups of nodes count their own
                "optimizer_step": steps.pop() if len(steps) == 1 else None}

    def load_scalar_state(self, sd: dict) -> list[str]:
        """Restore scalar_state(); returns lines to report (state that could not be carried)."""
        self.loss_scaler.load_state_dict(sd["loss_scaler"])
        self.global_step = sd["global_step"]
        self.skipped_steps = sd.get("skipped_steps", 0)   # absent from checkpoints before it was kept
        if sd.get("optimizer_step") is not None:
            for st in self.optimizer.state.values():
                if "step" in st:
                    st["step"] = torch.tensor(sd["optimizer_step"], dtype=torch.float32)
        mine = self.scalar_state()
        return [f"{what} in the checkpoint is dropped: this job runs without it"
                for key, what in techniques.carried_names().items()   # the techniques' carried state
                if key in sd and key not in mine and sd[key].get("holds", True)]

    def uncarried_state(self, saved_scalar_state: dict) -> list[str]:
        """Keys of checkpoint_state(for_load=True) that a checkpoint saved with `saved_scalar_state`
        cannot fill on this job (its layout differs): left out of the load, reset instead."""
        return []

    def _moment_names(self) -> tuple[str, ...]:
        """The optimizer's per-element state tensors, by torch's names."""
        s = self.optim_settings
        if s.type == "sgd":
            return ("momentum_buffer",) if s.momentum else ()
        return ("exp_avg", "exp_avg_sq")

    def _moment(self, master: torch.Tensor, key: str, create: bool) -> torch.Tensor:
        """The optimizer's `key` state of `master`; zeros before the first step
        (what a fresh Adam or momentum SGD is equivalent to)."""
        state = self.optimizer.state[master] if create else self.optimizer.state.get(master, {})
        if key in state:
            return state[key]
        zeros = torch.zeros_like(master, memory_format=torch.contiguous_format)
        if create:
            state[key] = zeros
        return zeros

    def _step_entry(self, masters: list[torch.Tensor]) -> FlatState:
        steps = {float(self.optimizer.state[m]["step"]) for m in masters
                 if "step" in self.optimizer.state.get(m, {})}
        if len(steps) > 1:
            raise RuntimeError(f"optimizer step counts differ between parameters: {sorted(steps)}")
        return FlatState(torch.tensor([steps.pop() if steps else 0.0]), 1, sharded=False)

    def _set_optimizer_step(self, state: dict[str, FlatState], masters: list[torch.Tensor]):
        if "optim.step" not in state or self.optim_settings.type == "sgd":
            return  # torch's SGD keeps no step count
        step = state["optim.step"].local.item()
        for m in masters:
            if m.numel():
                self.optimizer.state[m]["step"] = torch.tensor(step, dtype=torch.float32)

    def _replicated_module_state(self) -> dict[str, FlatState]:
        """Buffers and frozen parameters: whole, the same on every rank."""
        trained = {id(p) for p in self.params}
        out = {}
        for n, t in self.module.state_dict(keep_vars=True).items():
            if id(t) not in trained and t.is_floating_point():
                out["model." + n] = FlatState(t.detach().view(-1), t.numel(), sharded=False)
        return out
