"""The bits of what crosses nodes below ZeRO++'s defaults: qgZ's gradients
(`zero_quantized_gradients_bits`) and the weight deltas (`zero_quantized_weight_deltas_bits`),
each 4 (the default) or 2. Each 2 is refused in one line where it has nothing to act on or
does not train (the measurements are named beside each check)."""
from __future__ import annotations

from common import ConfigError


def _check_choice(bits, key: str, flag: str, what: str):
    if bits not in (4, 2) or isinstance(bits, bool):
        raise ConfigError(f"{key} ({flag}) must be 4 (the default) or 2 ({what}), got {bits!r}")


def validate_bits(zero, where: str):
    """`zero`: a ZeroConfig; `where`: its place in the config, for the messages."""
    _validate_gradient_bits(zero, where)
    bits, key, flag = (zero.zero_quantized_weight_deltas_bits, f"{where}.zero_quantized_weight_deltas_bits",
                       "--zero-quantized-weight-deltas-bits")
    _check_choice(bits, key, flag, "INT2 weight deltas across nodes")
    if bits == 2 and zero.zero_quantized_weight_deltas is not True:
        raise ConfigError(f"{key} ({flag}) 2 sets the bits of the weight deltas: set zero_quantized_weight_deltas "
                          f"true (--zero-quantized-weight-deltas), got {zero.zero_quantized_weight_deltas!r}")


def _validate_gradient_bits(zero, where: str):
    bits, key, flag = (zero.zero_quantized_gradients_bits, f"{where}.zero_quantized_gradients_bits",
                       "--zero-quantized-gradients-bits")
    _check_choice(bits, key, flag, "INT2 across nodes")
    if bits == 4:
        return
    if zero.zero_quantized_gradients is not True:
        raise ConfigError(f"{key} ({flag}) {bits} sets the bits of qgZ's gradients across nodes: set "
                          f"zero_quantized_gradients true (--zero-quantized-gradients), "
                          f"got {zero.zero_quantized_gradients!r}")
    if zero.zeropp_loco_param is None:   # measured: bench/results/convergence_int2_without_loco_1234.json
        raise ConfigError(f"{key} ({flag}) 2 without error feedback does not train as ZeRO-3 does (ternary "
                          f"gradients lose what they do not send): add zeropp_loco_param (--zero-loco)")
    if zero.zero_quantized_gradients_block_size < 16:   # a block's INT2 data: whole 4-byte words
        raise ConfigError(f"{key} ({flag}) 2 needs zero_quantized_gradients_block_size >= 16 (the scales stay "
                          f"4-byte aligned on the wire), got {zero.zero_quantized_gradients_block_size}")
