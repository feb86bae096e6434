"""The slow-link sweep's "auto" row: our ZeRO-3 with the three ZeRO++ switches set to
"auto", resolved on every rank by planner.auto.resolve (it times a few collectives
over the link, then lets the planner pick), at the link rate the row is timed at.

Agreed signature (planner/auto.py, issue 17):
    resolve(ds_config: dict, cfg: model.GPTConfig, comm: parallel.comm.Communicator, device,
            micro_batch: int, seq_length: int, accumulation: int = 1) -> tuple[dict, list[str]]
returning the resolved ds_config dict and its log lines. If planner.auto does not
import, the row is an error row that says so (no silent fallback to fixed switches).
"""
from __future__ import annotations

SWITCHES = ("zero_quantized_weights", "zero_hpz_partition_size", "zero_quantized_gradients")


class AutoUnavailable(RuntimeError):
    pass


def make_prepare(a: dict, cfg, info: dict):
    """A build_system(prepare=...) callable: resolves the "auto" switches of the raw
    config and fills `info` with the log lines and the switches chosen."""
    def prepare(raw: dict, comm) -> dict:
        import torch
        try:
            from planner.auto import resolve
        except Exception as e:  # noqa: BLE001 (any failure to import is the row's error)
            raise AutoUnavailable(f"auto: planner.auto does not import ({type(e).__name__}: {e})") from e
        res = resolve(raw, cfg, comm, torch.device("cpu"), a["micro_batch"], a["seq"], 1)
        resolved, lines = res if isinstance(res, tuple) else (res.config, list(getattr(res, "log", [])))
        if not isinstance(resolved, dict):  # a DeepSpeedConfig-like object: back to its dict
            resolved = resolved.to_dict() if hasattr(resolved, "to_dict") else vars(resolved)
        zero = resolved.get("zero_optimization", {})
        left = [k for k in SWITCHES if zero.get(k) == "auto"]
        if left:
            raise AutoUnavailable(f"auto: planner.auto.resolve left {', '.join(left)} = auto")
        info.update(log=[str(x) for x in lines], switches={k: zero.get(k) for k in SWITCHES},
                    zero_optimization=zero)
        return resolved
    return prepare


def chosen(switches: dict | None) -> str:
    """'qwZ+hpZ', 'none', ... from the resolved switches."""
    if not switches:
        return "-"
    on = [name for name, yes in (("qwZ", switches.get("zero_quantized_weights") is True),
                                 ("hpZ", (switches.get("zero_hpz_partition_size") or 1) > 1),
                                 ("qgZ", switches.get("zero_quantized_gradients") is True)) if yes]
    return "+".join(on) or "none (ZeRO-3)"
