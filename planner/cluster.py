"""A cluster description (configs/clusters/*.yaml) as a dataclass.

    nodes: 4
    gpus_per_node: 16
    gpu_memory_gb: 32                 # GiB of memory per GPU
    peak_flops: 125e12                # peak 16-bit FLOP/s per GPU (V100 tensor cores)
    compute_efficiency: 0.4           # fraction of peak the model's matmuls reach
    intra_node_gbps: 1200             # per-GPU bandwidth inside a node (NVLink/NVSwitch), Gbit/s
    intra_node_latency_us: 5
    inter_node_gbps: 100              # per-NODE bandwidth to the network (all its NICs), Gbit/s
    inter_node_latency_us: 10
    link_efficiency: 0.95             # payload / wire bytes (headers); inter-node only

Optional keys (defaults in `Cluster`): peak_flops_fp32 (for fp32 runs),
memory_gbps (GPU memory bandwidth in Gbit/s; the optimizer step is bound by it),
int8_quantize_gelems / int4_quantize_gelems (billions of elements per second
through one (de)quantization kernel), overlap (whether communication runs under compute, as NCCL streams do),
backend (nccl, or gloo: the engine then sends the plain reduce-scatter as an all-to-all of its
rows, zeropp/collectives/exact.py, and the plan follows), step_overhead_ms (host work per
iteration the time model does not itemize: Python hooks, bucket copies; hidden
under GPU kernels, measurable on CPU ranks), inter_node_burst_kib (KiB a node's link
passes at once after idling: an emulated link's tc tbf bucket; 0 on a real link;
planner/outer.py's exchanges, which idle between them, get it), reserved_gb (memory the
framework and allocator keep, per GPU), description.

Every key is checked: a typo or a missing key is one ConfigError naming the
file, the key and the fix. `--cluster FILE,key=value,...` plans the file's cluster with those
keys changed (the launch scripts pass NNODES, GPUS_PER_NODE and GPU_MEMORY_GB this way:
`v100_4x16_100gbps.yaml,gpus_per_node=8` is the same cluster with nodes of 8 GPUs).
"""
from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass

import yaml

from common import ConfigError, parse_int, parse_number


BACKENDS = ("nccl", "gloo")


@dataclass
class Cluster:
    nodes: int
    gpus_per_node: int
    gpu_memory_gb: float
    peak_flops: float
    intra_node_gbps: float
    intra_node_latency_us: float
    inter_node_gbps: float
    inter_node_latency_us: float
    compute_efficiency: float = 0.4
    peak_flops_fp32: float | None = None   # used when training in fp32; default peak_flops / 8
    link_efficiency: float = 1.0
    memory_gbps: float = 7200.0          # 900 GB/s (V100 HBM2)
    int8_quantize_gelems: float = 200.0  # billions of elements/s through one INT8 (de)quantize kernel
    int4_quantize_gelems: float = 200.0  # the same for INT4
    overlap: bool = True
    backend: str = "nccl"                # the process groups' (gloo: CPU ranks)
    step_overhead_ms: float = 0.0        # host time per iteration the model does not itemize
    inter_node_burst_kib: float = 0.0    # a token bucket's burst (tc tbf); 0: a real link has none
    reserved_gb: float = 1.0
    name: str = ""
    description: str = ""

    @property
    def fp32_flops(self) -> float:
        return self.peak_flops_fp32 if self.peak_flops_fp32 is not None else self.peak_flops / 8

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    # Bytes per second and seconds, for the time model.
    @property
    def intra_bw(self) -> float:
        return self.intra_node_gbps * 1e9 / 8

    @property
    def inter_bw(self) -> float:
        return self.inter_node_gbps * 1e9 / 8 * self.link_efficiency

    @property
    def memory_bw(self) -> float:
        return self.memory_gbps * 1e9 / 8

    def quantize_rate(self, bits: int) -> float:
        """Elements per second through one quantize or dequantize kernel."""
        return (self.int8_quantize_gelems if bits == 8 else self.int4_quantize_gelems) * 1e9

    @property
    def gpu_memory_bytes(self) -> float:
        return self.gpu_memory_gb * 2**30

    @property
    def reserved_bytes(self) -> float:
        return self.reserved_gb * 2**30


def load_cluster(spec: str | None) -> Cluster:
    """Read and check a cluster YAML, with the `key=value` changes after it (`FILE,key=value,...`);
    every problem is a ConfigError naming the fix."""
    if not spec:
        raise ConfigError("--dry-run needs --cluster FILE, the machine to plan for: one of configs/clusters/*.yaml "
                          "(v100_4x16_100gbps.yaml: the 18B run's 4 nodes x 16 V100s; emulated_slow_link.yaml: "
                          "2 emulated nodes x 2 CPU ranks, configs/demo.yaml's world)")
    path, *changes = spec.split(",")
    raw = _read(path)
    for change in changes:
        key, sep, value = change.partition("=")
        if not sep:
            raise ConfigError(f"--cluster {spec}: '{change}' is not key=value; pass FILE,key=value,...")
        raw[key.strip()] = yaml.safe_load(value)
    fields = {f.name: f for f in dataclasses.fields(Cluster)}
    if "reduce_scatter_factor" in raw:   # the planner's gloo model before it followed what the engine sends
        raise ConfigError(f"--cluster {spec}: reduce_scatter_factor is gone: the plan follows what the engine sends "
                          f"on each backend; replace it with backend: gloo (its 2.0) or remove it (1.0: nccl)")
    for key in raw:
        if key not in fields or key == "name":
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"known keys: {', '.join(fields)}"
            raise ConfigError(f"--cluster {spec}: unknown key '{key}'; {hint}")
    required = [f.name for f in fields.values()
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [k for k in required if k not in raw]
    if missing:
        raise ConfigError(f"--cluster {path}: missing key(s) {', '.join(missing)}; add them "
                          f"(see planner/cluster.py)")
    values = {key: _value(spec, key, str(fields[key].type), value) for key, value in raw.items()}
    cluster = Cluster(**values, name=spec)
    if cluster.backend not in BACKENDS:
        raise ConfigError(f"--cluster {spec}: backend must be one of {', '.join(BACKENDS)}, got {cluster.backend!r}")
    if not 0 < cluster.compute_efficiency <= 1 or not 0 < cluster.link_efficiency <= 1:
        raise ConfigError(f"--cluster {spec}: compute_efficiency and link_efficiency are fractions in (0, 1]")
    return cluster


def _read(path: str) -> dict:
    """The cluster file's mapping of keys to values."""
    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except FileNotFoundError:
        raise ConfigError(f"--cluster: no such file {path}; pick one of configs/clusters/*.yaml") from None
    except (OSError, UnicodeDecodeError) as e:   # a directory, no permission, a binary file
        raise ConfigError(f"--cluster {path} cannot be read as a YAML file "
                          f"({getattr(e, 'strerror', None) or type(e).__name__}); pick one of "
                          f"configs/clusters/*.yaml") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--cluster {path} is not valid YAML: {e}".replace("\n", " ")) from None
    if not isinstance(raw, dict):
        raise ConfigError(f"--cluster {path} must be a mapping of keys to values (see configs/clusters/)")
    return raw


# Keys that may be 0 (a latency, a reserve, an overhead); every other number must be > 0.
_MAY_BE_ZERO = ("intra_node_latency_us", "inter_node_latency_us", "reserved_gb", "step_overhead_ms",
                "inter_node_burst_kib")


def _value(path: str, key: str, typ: str, value):
    """One key's value, checked: numbers finite (common's parsing, so "125e12" too), counts whole."""
    where = f"--cluster {path}: {key}"
    if typ.startswith("str"):
        return str(value)
    if typ.startswith("bool"):
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {value!r}")
        return value
    if value is None and "None" in typ:
        return None
    number = parse_int(value, where) if typ.startswith("int") else parse_number(value, where)
    if number < 0 or (number == 0 and key not in _MAY_BE_ZERO):
        raise ConfigError(f"{where} must be {'>= 0' if key in _MAY_BE_ZERO else '> 0'}, got {value!r}")
    return number
