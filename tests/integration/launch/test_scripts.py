"""The launch scripts (scripts/pretrain_gpt_*.sh) as users run them.

- SMOKE=1: each script's own flags and zero_optimization, the model shrunk, 4 CPU
  ranks as 2 emulated nodes x 2, a few iterations on the bundled corpus (~15 s each);
  nothing left in the temporary folder.
- DRY_RUN=1: the planner's plan, without torchrun, of the cluster the environment describes
  (NNODES, GPUS_PER_NODE, GPU_MEMORY_GB over CLUSTER's values), every missing input in one line.
- A run without NODE_RANK / MASTER_ADDR (several nodes) or DATA_PATH is one clear line, exit 2.
- --help, the SLURM scripts' log folder, the quick start's earlier run kept.
"""
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from tests import REPO

ROOT = REPO
SCRIPTS = {
    "pretrain_gpt_18b.sh": "ZeRO-3 + ZeRO++ (qwZ, hpZ, qgZ)",
    "pretrain_gpt_18b_zero3.sh": "ZeRO stage 3",
    "pretrain_gpt_1.5b_zero1.sh": "ZeRO stage 1",
    "pretrain_gpt_10b_zero2.sh": "ZeRO stage 2",
}


def run(script, env, *args, timeout=180):
    full = {**os.environ, **env}
    for key in ("NNODES", "GPUS_PER_NODE", "NODE_RANK", "MASTER_ADDR", "RDZV_ID", "DRY_RUN", "SMOKE", "DATA_PATH",
                "SAVE", "LOAD", "GPU_MEMORY_GB", "TOKENIZER_TYPE", "VOCAB_FILE", "MERGE_FILE", "CLUSTER"):
        if key not in env:
            full.pop(key, None)
    return subprocess.run(["bash", f"scripts/{script}", *args], cwd=ROOT, env=full, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.parametrize("script", list(SCRIPTS))
def test_smoke_run(script, tmp_path):
    r = run(script, {"SMOKE": "1", "TMPDIR": str(tmp_path)})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # nothing left per run in the temporary folder (torch's own cache folder is one per user)
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith("torchinductor_")] == []
    assert "> SMOKE=1: 2 layers, hidden 64" in r.stdout
    assert f"4 ranks on 2 node(s) x 2, {SCRIPTS[script]}, torch.float32" in r.stdout
    assert "iteration        4/       4" in r.stdout
    if script == "pretrain_gpt_18b.sh":   # ZeRO++ cuts what crosses the emulated nodes
        assert "ZeRO-3 without ZeRO++ would send" in r.stdout


@pytest.mark.slow
@pytest.mark.parametrize("script", list(SCRIPTS))
def test_dry_run_prints_the_plan(script):
    r = run(script, {"DRY_RUN": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    for text in ("== Plan (--dry-run)", "-- Memory per GPU", "-- Communication per iteration per GPU",
                 "iteration time", "TFLOPs per GPU"):
        assert text in r.stdout, text
    if "18b" in script:
        assert "predicted speedup of ZeRO++ over ZeRO-3" in r.stdout


def test_multi_node_without_node_rank_is_a_clear_error():
    r = run("pretrain_gpt_18b.sh", {"NNODES": "4"})
    assert r.returncode == 2
    assert r.stderr.startswith("error: a 4-node run needs NODE_RANK") and len(r.stderr.splitlines()) == 1


@pytest.mark.slow
def test_dry_run_plans_the_cluster_it_is_given():
    """GPUS_PER_NODE=8: 4 nodes x 8 with hpZ over a node's 8 GPUs (the ZeRO++ paper's choice), GPT-2's
    vocabulary, the whole run's time and tokens, TensorBoard on, the command each node runs."""
    r = run("pretrain_gpt_18b.sh", {"DRY_RUN": "1", "GPUS_PER_NODE": "8"})
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    for text in ("4 nodes x 8 GPUs = 32, 32 GiB each", "ZeRO++ = ZeRO-3 + qwZ, hpZ 8, qgZ",
                 "> hpZ: groups of 8 GPUs (the GPUs of a node, as the ZeRO++ paper sets it",
                 "vocab 50257 (padded 50304, GPT-2's BPE vocabulary", "> not set: DATA_PATH VOCAB_FILE MERGE_FILE",
                 "> each of the 4 nodes runs (NODE_RANK 0..3",
                 "-m parallel.launch --nnodes 4 --nproc-per-node 8 --node-rank $NODE_RANK --master-addr $MASTER_ADDR",
                 "--tensorboard-dir runs/gpt_18b/tensorboard"):
        assert text in out, text
    days = re.search(r"training: 500,000 iterations x global batch 32 x seq 512 = 8\.2 B tokens; "
                     r"ZeRO-3 ([\d.]+) days, ZeRO\+\+ ([\d.]+) days", out)
    assert days and float(days[1]) > float(days[2]) > 1, out[-2000:]
    r = run("pretrain_gpt_18b.sh", {"DRY_RUN": "1", "NNODES": "2", "GPU_MEMORY_GB": "80", "SAVE": "/ckpt/x"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "2 nodes x 16 GPUs = 32, 80 GiB each" in r.stdout and "--tensorboard-dir /ckpt/x/tensorboard" in r.stdout


@pytest.mark.slow
def test_dry_run_names_every_missing_input_in_one_line(tmp_path):
    env = {"DRY_RUN": "1", "DATA_PATH": str(tmp_path / "corpus"), "VOCAB_FILE": str(tmp_path / "vocab.json"),
           "MERGE_FILE": str(tmp_path / "merges.txt"), "LOAD": str(tmp_path / "ckpt"),
           "CLUSTER": "configs/clusters/v100_4x16_100gbps.yaml"}
    r = run("pretrain_gpt_18b.sh", env)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    for name in ("--data-path", "corpus.bin", "corpus.idx", "vocab.json", "merges.txt", f"--load {tmp_path / 'ckpt'}"):
        assert name in r.stderr, name
    r = run("pretrain_gpt_18b.sh", {"DRY_RUN": "1", "CLUSTER": str(tmp_path / "nope.yaml")})
    assert r.returncode == 2 and r.stderr.startswith("error: --cluster: no such file"), r.stderr


def test_a_real_run_without_data_path_refuses():
    """Not the bundled corpus without a word: one line naming DATA_PATH (and the tokenizer files), exit 2."""
    env = {"NNODES": "1", "GPUS_PER_NODE": "1", "NUM_LAYERS": "1", "HIDDEN_SIZE": "32", "NUM_HEADS": "4",
           "SEQ_LENGTH": "32", "TRAIN_ITERS": "1", "PRECISION": ""}
    r = run("pretrain_gpt_18b.sh", env, "--distributed-backend", "gloo")
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith("error: DATA_PATH is not set"), r.stderr
    assert "VOCAB_FILE MERGE_FILE not set" in r.stderr and "> torchrun" not in r.stdout


def test_help_prints_the_settings():
    r = run("pretrain_gpt_18b.sh", {}, "--help")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    for text in ("The ZeRO++ paper's 18B GPT-2", "DATA_PATH", "GPUS_PER_NODE", "DRY_RUN=1", "SMOKE=1",
                 "python train.py --help"):
        assert text in r.stdout, text


def test_slurm_logs_go_to_a_folder_the_repository_holds():
    """SLURM opens --output before the script runs: its folder must be there in a fresh clone."""
    for sbatch in sorted((ROOT / "scripts" / "slurm").glob("*.sbatch")):
        out = re.search(r"(?m)^#SBATCH --output=(\S+)", sbatch.read_text())[1]
        folder = os.path.dirname(out)
        tracked = subprocess.run(["git", "ls-files", folder], cwd=ROOT, capture_output=True, text=True).stdout
        assert folder == "" or tracked.strip(), f"{sbatch.name}: --output={out}: {folder}/ is not in the repository"


QUICKSTART_STUBS = {   # what scripts/quickstart.sh runs besides its own lines: recorded, not run
    "scripts/setup.sh": "", "scripts/prepare_demo_data.sh": "",
    ".venv/bin/python": 'echo "python $*" >> "$(dirname "$0")/../../calls"\n'
                        'case "$*" in *parallel.launch*) mkdir -p runs/demo && echo new > runs/demo/marker;; esac\n',
}


def test_quickstart_moves_an_earlier_run_aside(tmp_path):
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "quickstart.sh").write_text((ROOT / "scripts" / "quickstart.sh").read_text())
    for path, body in QUICKSTART_STUBS.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("#!/usr/bin/env bash\n" + body)
        (tmp_path / path).chmod(0o755)
    for n, text in ((0, "first"), (1, "second")):
        (tmp_path / "runs" / "demo").mkdir(parents=True)
        (tmp_path / "runs" / "demo" / "marker").write_text(text)
        r = subprocess.run(["bash", "scripts/quickstart.sh", "--train-iters", "5"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert f"> runs/demo (an earlier quick start) moved to runs/demo.{n + 1}" in r.stdout, r.stdout
        assert (tmp_path / "runs" / f"demo.{n + 1}" / "marker").read_text() == text
        shutil.rmtree(tmp_path / "runs" / "demo")
    assert "parallel.launch --standalone --nproc-per-node 4 train.py --config configs/demo.yaml --train-iters 5" \
        in (tmp_path / "calls").read_text()
