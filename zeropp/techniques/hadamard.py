"""qgZ's Hadamard smoothing (`zero_hadamard_gradients`; SDP4Bit, arXiv 2410.15526): each gradient
row is rotated block by block by a Walsh-Hadamard transform before its INT4 quantization, and the
sum rotated back (zeropp/techniques/qgz.py, loco.py). The transform itself, its backends and its
checks live in zeropp/kernels/hadamard.py; the technique's part is the block the rows are rotated
in."""
from __future__ import annotations

from dataclasses import dataclass

from common import ConfigError
from zeropp.techniques.technique import Technique, key


@dataclass
class Keys:
    """Hadamard's key in zero_optimization (qgZ's blocks rotated: their size is qgZ's block)."""
    zero_hadamard_gradients: bool = key(False, flag="zero_hadamard_gradients")


def validate(zero, where: str):
    if zero.zero_hadamard_gradients is True and zero.zero_quantized_gradients is not True:
        raise ConfigError(f"{where}.zero_hadamard_gradients (--zero-hadamard-gradients) smooths qgZ's INT4 "
                          f"gradient blocks: set zero_quantized_gradients true (--zero-quantized-gradients), "
                          f"got {zero.zero_quantized_gradients!r}")


def build(ctx) -> int:
    """The technique's part: the block qgZ's rows are rotated in, its quantization block."""
    return ctx.zero.zero_quantized_gradients_block_size


TECHNIQUE = Technique("Hadamard", "rotation", Keys, "zero_hadamard_gradients", build, validate)
