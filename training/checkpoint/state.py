"""What a checkpoint holds besides the files' layout: the engine's state as
torch.distributed.checkpoint (DCP) sees it, and every RNG's state as JSON
(see training/checkpoint/__init__.py)."""
from __future__ import annotations

import base64
import contextlib
import random
import warnings

import numpy as np
import torch

from zeropp.collectives.partition import FlatState


# -- RNG states as JSON -------------------------------------------------------------------
def rng_state() -> dict:
    py = random.getstate()
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": [py[0], list(py[1]), py[2]],
             "numpy": [kind, keys.tolist(), pos, has_gauss, gauss],
             "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if torch.cuda.is_available():
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return state


def _bytes_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def set_rng_state(state: dict):
    version, keys, gauss = state["python"]
    random.setstate((version, tuple(keys), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_bytes_tensor(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(_bytes_tensor(state["cuda"]))


# -- engine state <-> DCP ------------------------------------------------------------------
@contextlib.contextmanager
def single_process_quiet():
    """DCP warns that it assumes a single process when there is no process group: we know."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def engine_device(state: dict[str, FlatState]) -> torch.device:
    return next((v.local.device for v in state.values() if v.sharded), torch.device("cpu"))
