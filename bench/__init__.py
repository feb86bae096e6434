"""Benchmarks: each prints a table and writes JSON under bench/results/; run
from the repository root as `python -m bench.NAME` (see bench/README.md)."""
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent   # the repository
RESULTS = ROOT / "bench" / "results"


def cpu_model() -> str:
    """The processor, for every benchmark's header: /proc/cpuinfo's model name, family and
    model, and the flags that change CPU results most (bf16 compute: avx512_bf16, amx_bf16)."""
    import platform
    info = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
    except OSError:
        return platform.processor() or platform.machine()
    flags = set(info.get("flags", "").split())
    fast = [f for f in ("avx512_bf16", "amx_bf16") if f in flags] or ["no avx512_bf16/amx"]
    return (f"{info.get('model name', platform.processor())} (family {info.get('cpu family', '?')} model "
            f"{info.get('model', '?')}; {', '.join(fast)})")
