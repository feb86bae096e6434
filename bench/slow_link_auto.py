"""The slow-link sweep's "auto" row: our ZeRO-3 with the three ZeRO++ switches set to
"auto", resolved on every rank by planner.auto.resolve (it times a few collectives
over the link, then lets the planner pick), at the link rate the row is timed at.

    resolve(ds_config: dict, cfg: model.GPTConfig, comm: parallel.comm.Communicator, device,
            micro_batch: int, seq_length: int, accumulation: int = 1)

returns the resolved config and its log lines: as a tuple (dict, lines), or as planner.auto's
Resolution (.config a zeropp.DeepSpeedConfig, .lines, .predicted); both are taken. If
planner.auto does not import, the row is an error row that says so (no silent fallback).
"""
from __future__ import annotations

import dataclasses

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
    """'qwZ+hpZ', 'none', ... from the resolved switches."""
    if not switches:
        return "-"
    on = [name for name, yes in (("qwZ", switches.get("zero_quantized_weights") is True),
                                 ("hpZ", (switches.get("zero_hpz_partition_size") or 1) > 1),
                                 ("qgZ", switches.get("zero_quantized_gradients") is True)) if yes]
    return "+".join(on) or "none (ZeRO-3)"
