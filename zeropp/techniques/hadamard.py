"""qgZ's Hadamard smoothing (`zero_hadamard_gradients`): the transform itself, its backends
and its checks live in zeropp/kernels/hadamard.py."""
