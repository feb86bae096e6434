"""qgZ's Hadamard smoothing (`zero_hadamard_gradients`; SDP4Bit, arXiv 2410.15526): each gradient
row is rotated block by block by a Walsh-Hadamard transform before its INT4 quantization, and the
sum rotated back (zeropp/techniques/qgz.py, loco.py). The transform itself, its backends and its
checks live in zeropp/kernels/hadamard.py; the technique's part is the block the rows are rotated
in."""
from __future__ import annotations


def build(ctx) -> int:
    """The technique's part: the block qgZ's rows are rotated in, its quantization block."""
    return ctx.zero.zero_quantized_gradients_block_size
