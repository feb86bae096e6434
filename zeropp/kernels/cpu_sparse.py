"""Compiled CPU kernels for zeropp.kernels.sparse (placeholder until csrc/sparse_cpu.c lands)."""


def available() -> bool:
    return False


def why_not() -> str:
    return "the CPU top-k kernels are not built"
