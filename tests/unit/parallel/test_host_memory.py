"""train.py on CPU returns freed blocks of 64 KiB or more to the kernel (parallel/startup.py
`unmap_freed_blocks`), unless the user set glibc's MALLOC_MMAP_THRESHOLD_. Each case in a fresh
process (the setting is the process's): after a 16 MiB block is freed (as a step frees gathered
weights), 200 tensors of 1 MiB, written, then all freed but the last, which in a heap pins
everything below it."""
import os
import subprocess
import sys

import pytest

from bench import ROOT

PROBE = """
import torch
from parallel.startup import init_distributed


def rss_mb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


init_distributed("gloo")   # no torchrun variables: one process on the CPU
torch.ones(2**22)   # 16 MiB, freed at once: as a step frees its gathered weights (glibc's threshold climbs)
before = rss_mb()
blocks = [torch.ones(2**18) for _ in range(200)]   # 1 MiB each
del blocks[:-1]
print(rss_mb() - before)
"""


def kept_mb(env: dict) -> float:
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return float(out.stdout.split()[-1])


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_freed_blocks_go_back_to_the_kernel_unless_the_user_set_the_threshold():
    env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "WORLD_SIZE")}
    assert kept_mb(env) < 20   # the last 1 MiB block and a little
    assert kept_mb({**env, "MALLOC_MMAP_THRESHOLD_": str(32 * 2**20)}) > 150   # the heap keeps them
