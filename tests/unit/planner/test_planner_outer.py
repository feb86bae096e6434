"""planner/outer.py: the dry run's exchanges across groups (train.py --dry-run --outer-sync-interval)."""
from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from planner.cluster import load_cluster
from tests import REPO

ROOT = REPO
EMULATED = ROOT / "configs" / "clusters" / "emulated_slow_link.yaml"
MODEL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "128",
         "--micro-batch-size", "8", "--lr", "1e-4", "--zero-stage", "3", "--outer-quantization", "int4", "--bf16"]


def cluster_file(tmp_path, gbps: float, burst_kib: float) -> Path:
    """The emulated link's cluster file at another rate and tc tbf burst (0: none, the default)."""
    text = re.sub(r"(?m)^inter_node_gbps: *\S+", f"inter_node_gbps: {gbps}", EMULATED.read_text())
    path = tmp_path / f"link_{gbps}_{burst_kib}.yaml"
    path.write_text(text + (f"\ninter_node_burst_kib: {burst_kib}\n" if burst_kib else ""))
    return path


def plan(capsys, cluster: Path, H: int, F: int, delay: int) -> dict:
    import train
    train.main(["--dry-run", "--cluster", str(cluster), *MODEL, "--outer-sync-interval", str(H),
                "--outer-fragments", str(F), "--outer-sync-delay", str(delay)])
    out = capsys.readouterr().out
    m = re.search(r"per GPU: ([\d.]+) MB .*\n.*per node(?: \(burst [\d.]+ KiB\))?: ([\d., ]+) s; "
                  r"inner step ([\d.]+) s \+ ([\d.]+) s exposed", out)
    assert m, out
    return {"mb": float(m[1]), "exchanges": [float(t) for t in m[2].split(", ")], "step": float(m[3]),
            "exposed": float(m[4])}


def test_each_fragments_exchange_takes_its_own_bytes_and_the_links_burst(tmp_path, capsys):
    gbps, burst_kib, H, F = 0.01, 256, 16, 4
    plain = plan(capsys, cluster_file(tmp_path, gbps, 0), H, F, 1)
    bursty = plan(capsys, cluster_file(tmp_path, gbps, burst_kib), H, F, 1)
    c = load_cluster(str(cluster_file(tmp_path, gbps, 0)))
    latency = c.inter_node_latency_us * 1e-6   # 2 groups: one hop
    # The fragments partition a rank's shard: their exchanges carry what H inner steps send
    # (every rank of a node at once). Printed to 1 ms and 1 kB: that much apart at most.
    carried = sum(t - latency for t in plain["exchanges"]) * c.inter_bw / c.gpus_per_node
    assert carried == pytest.approx(plain["mb"] * 1e6 * H, abs=F * 5e-4 * c.inter_bw / c.gpus_per_node + H * 500)
    # cut by bytes: every fragment's exchange the same (printed to 1 ms), the embedding's no larger
    assert max(plain["exchanges"]) - min(plain["exchanges"]) <= 1e-3
    # Each fragment is larger than the bucket, which refills in the steps between two exchanges:
    # the link passes the bucket's bytes at once, the rest at its rate.
    saved = burst_kib * 1024 * 8 / (gbps * 1e9)
    assert all(t > saved for t in plain["exchanges"])
    for t, b in zip(plain["exchanges"], bursty["exchanges"]):
        assert t - b == pytest.approx(saved, abs=1e-3)


def test_a_link_slower_than_the_steps_bounds_the_inner_step(tmp_path, capsys):
    """Past the H / F inner steps between two issues, a longer --outer-sync-delay hides nothing more:
    the exchanges queue on the link, and an inner step takes the link's time per inner step."""
    H, F = 16, 4
    slow = cluster_file(tmp_path, 1e-4, 0)
    at_spacing, longest = plan(capsys, slow, H, F, H // F), plan(capsys, slow, H, F, H - 1)
    assert min(longest["exchanges"]) > H // F * longest["step"]   # every fragment: the link is the bound
    link_per_step = sum(longest["exchanges"]) / H
    assert longest["step"] + longest["exposed"] == pytest.approx(link_per_step, abs=2e-3)
    assert longest["exposed"] == at_spacing["exposed"]


# -- the dry run plans what training runs -------------------------------------------------------------

CLUSTER = "configs/clusters/v100_4x16_100gbps.yaml"   # 4 nodes x 16
LIGHTHOUSE = ["--zero-stage", "3", "--outer-sync-interval", "64", "--lighthouse", "http://127.0.0.1:1",
              "--group-id", "0", "--num-groups", "2"]
EXACT = MODEL[:MODEL.index("--outer-quantization")] + MODEL[MODEL.index("--outer-quantization") + 2:]   # fp32 outer


def test_with_lighthouse_the_dry_run_plans_num_groups_groups_of_the_clusters_nodes(capsys):
    import train
    train.main(["--dry-run", "--cluster", CLUSTER, *EXACT, *LIGHTHOUSE])
    assert "-- Outer synchronization: 2 groups of 2 node(s)" in capsys.readouterr().out


def verdict(argv: list[str]) -> str | None:
    """What parse_args (training's checks; the dry run's too) says of `argv`: None, or its one line."""
    from common import ConfigError
    from training.args import parse_args
    try:
        parse_args(argv)
    except ConfigError as e:
        return str(e)
    return None


@pytest.mark.skipif(importlib.util.find_spec("torchft") is None, reason="torchft is not installed")
@pytest.mark.parametrize("extra, refused", [
    (["--outer-quantization", "int4"], None),   # None: whatever training says
    (["--outer-quantization", "topk2"], None),
    (["--outer-warmup-iters", "5"], True),
    (["--group-size", "1"], True),
    (["--group-id", "2"], True),
    ([], False),
])
def test_the_dry_run_refuses_what_training_refuses(monkeypatch, extra, refused):
    monkeypatch.setattr("training.outer_args.lighthouse_answers", lambda url, wait: True)   # training's flag checks
    monkeypatch.setenv("WORLD_SIZE", "16")   # one group of the cluster's: torchrun on its 2 nodes
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "16")
    training = verdict([*EXACT, *LIGHTHOUSE, "--data-path", "corpus", "--train-iters", "100", *extra])
    planned = verdict(["--dry-run", "--cluster", CLUSTER, *EXACT, *LIGHTHOUSE, *extra])
    assert planned == training
    assert refused is None or (training is not None) == refused, training
