"""Where a result came from and where it goes: every JSON a benchmark or a scenario writes is
stamped with its provenance (the command as typed, the commit, the machine) and lands under
bench/results/, where bench.report renders the pages from it."""
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]   # the repository
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


def checkout_name(root: Path) -> str:
    """A checkout of this repository and its commit (git's, or the COMMIT file of an exported tree)."""
    import subprocess
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
        if subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no", "--", ".",
                           ":!bench/results", ":!docs/results.md", ":!README.md"],
                          capture_output=True, text=True, check=True).stdout.strip():
            commit += " with uncommitted changes"   # the result is not that commit's (results aside)
    except (OSError, subprocess.CalledProcessError):
        commit = (root / "COMMIT").read_text().strip() if (root / "COMMIT").is_file() else ""
    return f"{root} ({commit})" if commit else str(root)


def provenance() -> dict:
    """Where a result came from, stamped into every JSON a benchmark writes: the command as typed
    (`python -m bench.NAME ...`), the commit, and the machine (CPU, torch's CPU capability, the
    1-minute load average when it was written)."""
    import os
    import shlex
    import sys

    import torch
    spec = getattr(sys.modules["__main__"], "__spec__", None)
    program = ["-m", spec.name.removesuffix(".__main__")] if spec else [sys.argv[0]]   # a family: its folder
    return {"command": shlex.join(["python", *program, *sys.argv[1:]]),
            "commit": checkout_name(ROOT).rpartition("(")[2].rstrip(")"),
            "machine": {"cpu": cpu_model(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
                        "torch": torch.__version__, "loadavg_1min": round(os.getloadavg()[0], 2)}}


def write_result(path, payload: dict) -> Path:
    """Write a benchmark's JSON with its provenance() (bench.report renders pages from these)."""
    import json
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**payload, "provenance": provenance()}, indent=1, default=str) + "\n")
    return path
