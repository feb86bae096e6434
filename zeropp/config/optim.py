"""DeepSpeed JSON's optimizer and scheduler sections (zeropp/config/__init__.py builds
them), and `OptimizerSettings`, what the engine builds its optimizer from.
The schedule formulas live in training/lr_schedule.py."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from common import ConfigError, parse_int, parse_number, refuse_value
from zeropp.config.keys import OPTIMIZER_PARAMS, SCHEDULERS


@dataclass
class OptimizerSettings:
    """What the engine builds its optimizer from (args.optimizer_settings)."""
    # "adamw" (decoupled weight decay), "adam" (L2 added to the gradient, torch.optim.Adam), "sgd"
    type: str = "adamw"
    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.01
    momentum: float = 0.0        # sgd only


@dataclass
class OptimizerConfig:
    type: str = ""
    params: dict = field(default_factory=dict)

    def validate(self, where: str = "optimizer"):
        kind = str(self.type).lower()
        if not self.type:
            raise ConfigError(f"{where}.type is required: Adam, AdamW or SGD")
        if kind not in OPTIMIZER_PARAMS:
            raise ConfigError(f"{where}.type '{self.type}' is not supported: this engine implements "
                              f"Adam, AdamW and SGD; use one of those")
        self.type = {"adam": "Adam", "adamw": "AdamW", "sgd": "SGD"}[kind]
        for key, value in self.params.items():
            self.params[key] = _check_optimizer_param(kind, key, value, f"{where}.params.{key}")

    def settings(self) -> OptimizerSettings:
        """The optimizer DeepSpeed would build; what the JSON leaves out takes that class's defaults."""
        p = self.params
        if self.type == "SGD":  # torch.optim.SGD
            return OptimizerSettings(type="sgd", lr=p.get("lr", 1e-3), momentum=p.get("momentum", 0.0),
                                     weight_decay=p.get("weight_decay", 0.0))
        # Type Adam means AdamW unless adam_w_mode is false (DeepSpeed's default is true).
        decoupled = self.type == "AdamW" or p.get("adam_w_mode", True)
        # DeepSpeed builds FusedAdam (weight_decay 0) unless torch_adam picks torch.optim.AdamW (0.01).
        decay = 0.01 if p.get("torch_adam", False) and decoupled else 0.0
        return OptimizerSettings(type="adamw" if decoupled else "adam", lr=p.get("lr", 1e-3),
                                 betas=tuple(p.get("betas", (0.9, 0.999))), eps=p.get("eps", 1e-8),
                                 weight_decay=p.get("weight_decay", decay), momentum=0.0)


def _check_optimizer_param(kind: str, key: str, value: Any, where: str):
    allowed = OPTIMIZER_PARAMS[kind]
    if key == "max_grad_norm":
        raise ConfigError(f"{where} is not supported (nor by DeepSpeed); use the top-level "
                          f"gradient_clipping or --clip-grad")
    if key not in allowed:
        raise ConfigError(f"{where} is not supported for this optimizer; its parameters are "
                          f"{', '.join(allowed)}")
    if key in ("adam_w_mode", "torch_adam", "bias_correction", "amsgrad"):
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {value!r}")
        if key == "bias_correction" and not value:
            refuse_value(where, value, True, "Adam always corrects the bias of its moments")
        if key == "amsgrad" and value:
            refuse_value(where, value, False, "AMSGrad is not implemented (DeepSpeed's FusedAdam lacks it too)")
        if key == "adam_w_mode" and kind == "adamw" and not value:
            refuse_value(where, value, True, "AdamW always decouples weight decay (DeepSpeed ignores "
                                        "false here); for L2 weight decay use type Adam")
        return value
    if key == "betas":
        if not (isinstance(value, (list, tuple)) and len(value) == 2):
            raise ConfigError(f"{where} must be a list of two numbers, got {value!r}")
        betas = tuple(parse_number(b, where) for b in value)
        if not all(0 <= b < 1 for b in betas):
            raise ConfigError(f"{where} must be in [0, 1), got {list(betas)}")
        return betas
    number = parse_number(value, where)
    if number < 0 or (key == "eps" and number == 0):
        raise ConfigError(f"{where} must be {'> 0' if key == 'eps' else '>= 0'}, got {value!r}")
    return number


@dataclass
class SchedulerConfig:
    type: str = ""
    params: dict = field(default_factory=dict)   # after validate(): every parameter, defaults filled in

    def validate(self, where: str = "scheduler"):
        names = {name.lower(): name for name in SCHEDULERS}
        name = names.get(str(self.type).lower())
        if not self.type:
            raise ConfigError(f"{where}.type is required: WarmupLR, WarmupDecayLR or WarmupCosineLR")
        if name is None:
            raise ConfigError(f"{where}.type '{self.type}' is not supported: use WarmupLR, WarmupDecayLR "
                              f"or WarmupCosineLR, or Megatron's --lr-decay-style/--lr-warmup-iters flags")
        self.type, defaults = name, SCHEDULERS[name]
        for key in self.params:
            if key == "last_batch_iteration":
                raise ConfigError(f"{where}.params.{key} is not supported: the schedule follows the "
                                  f"training iteration, also after --load; remove the key")
            if key not in defaults:
                raise ConfigError(f"{where}.params.{key} is not supported for {name}; its parameters "
                                  f"are {', '.join(defaults)}")
        params = {**defaults, **self.params}
        for key, value in params.items():
            at = f"{where}.params.{key}"
            if value is None:
                raise ConfigError(f"{at} is required for {name}")
            if key == "warmup_type":
                if value not in ("log", "linear"):
                    raise ConfigError(f"{at} must be 'log' or 'linear', got {value!r}")
            elif key.endswith("_steps"):
                params[key] = parse_int(value, at)
                if params[key] < 0:
                    raise ConfigError(f"{at} must be >= 0, got {value!r}")
            else:
                params[key] = parse_number(value, at)
        warmup = max(2, params["warmup_num_steps"])  # DeepSpeed's floor (log(1) would divide by 0)
        if name == "WarmupCosineLR" and params["total_num_steps"] <= warmup:
            raise ConfigError(f"{where}.params.total_num_steps {params['total_num_steps']} must exceed "
                              f"warmup_num_steps ({warmup}) for the cosine to have steps to decay over")
        self.params = params
