"""Sharded checkpoints through the engine (tests/integration/train/test_train_faults.py drives
train.py): reshard on load (world size and stage), faults during a save, a
damaged shard, --keep-last, and export to one state dict and to Hugging Face."""
import errno
import os
import signal

import pytest
import torch
import torch.distributed.checkpoint as dcp

import zeropp
from model import GPT, GPTConfig
from parallel.comm import Communicator
from parallel.topology import topology_from_env
from tests.distributed import run_distributed
from tools.export_checkpoint import consolidated_state_dict, export_hf
from training.checkpoint import (TRACKER, CheckpointError, complete_iterations, latest_iteration, load_checkpoint,
                                 save_checkpoint)

CFG = dict(vocab_size=96, num_layers=2, hidden_size=32, num_attention_heads=4, max_position_embeddings=16,
           hidden_dropout=0.0, attention_dropout=0.0, make_vocab_size_divisible_by=8)
GLOBAL_BATCH = 8
META = {"model_config": dict(GPTConfig(**CFG).__dict__),
        "param_shapes": {n: list(p.shape) for n, p in GPT(GPTConfig(**CFG)).named_parameters()},
        "tokenizer_type": None}


def make_engine(world, stage, zeropp_on=False, ranks_per_node=2, seed=0):
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if zeropp_on:
        zero.update(zero_quantized_weights=True, zero_hpz_partition_size=2, zero_quantized_gradients=True)
    cfg = zeropp.DeepSpeedConfig.from_dict({"zero_optimization": zero})
    topo = topology_from_env(min(ranks_per_node, world))
    with torch.device("meta"):
        model = GPT(GPTConfig(**CFG, init_seed=seed))
    optim = zeropp.OptimizerSettings(type="adamw", lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    accum = GLOBAL_BATCH // (2 * world) if world <= 4 else 1
    return zeropp.initialize(model, cfg, Communicator(topo), torch.device("cpu"), optim, accum,
                             param_init=model.init_parameter)


def batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, CFG["vocab_size"], (GLOBAL_BATCH, 9), generator=g)


def train_steps(engine, rank, world, steps):
    """Each step sees the same global batch whatever the world size; returns the mean loss per step."""
    losses = []
    micro = GLOBAL_BATCH // (world * engine.gradient_accumulation_steps)
    for step in steps:
        x = batch(step)
        total = 0.0
        for a in range(engine.gradient_accumulation_steps):
            lo = (a * world + rank) * micro
            part = x[lo:lo + micro]
            loss = engine(part[:, :-1], part[:, 1:])
            engine.backward(loss)
            total += loss.item()
        engine.step()
        t = torch.tensor([total / engine.gradient_accumulation_steps])
        torch.distributed.all_reduce(t)
        losses.append(t.item() / world)
    return losses


def save_run(rank, world, path, stage, zeropp_on):
    engine = make_engine(world, stage, zeropp_on)
    train_steps(engine, rank, world, range(3))
    save_checkpoint(path, 3, engine, 3 * GLOBAL_BATCH, META)
    weights = engine.module_state_dict()
    return weights, train_steps(engine, rank, world, range(3, 6))


def load_run(rank, world, path, stage, zeropp_on):
    engine = make_engine(world, stage, zeropp_on, seed=1)  # another init: everything comes from the files
    meta = load_checkpoint(path, engine)
    return meta["iteration"], engine.module_state_dict(), train_steps(engine, rank, world, range(3, 6))


@pytest.fixture(scope="module")
def saved_4_ranks_stage3(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ckpt") / "save")
    results = run_distributed(save_run, 4, (path, 3, False))
    return path, results[0]


@pytest.mark.slow
@pytest.mark.parametrize("world, stage, zeropp_on", [(2, 3, False), (8, 3, True), (2, 1, False), (4, 2, False),
                                                     (1, 3, False)])
@pytest.mark.slow
def test_reshard_on_load(saved_4_ranks_stage3, world, stage, zeropp_on):
    """Saved by 4 ranks at stage 3; loaded on 1, 2, 4 and 8 ranks at stages 1-3 (8: with ZeRO++): the
    same weights bit for bit, and the next 3 losses match the uninterrupted run's to a relative 1e-5
    (only the reduction order changes with the world size), 2e-3 with ZeRO++'s quantized collectives."""
    path, (weights, uninterrupted) = saved_4_ranks_stage3
    if world == 1:
        it, loaded, losses = load_run_single(path, stage)
    else:
        it, loaded, losses = run_distributed(load_run, world, (path, stage, zeropp_on))[0]
    assert it == 3
    assert set(loaded) == set(weights)
    for k in weights:
        assert torch.equal(loaded[k], weights[k]), k
    rtol = 2e-3 if zeropp_on else 1e-5
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(uninterrupted), rtol=rtol, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2])
def test_reshard_from_stage_1_and_2_to_stage_3(tmp_path, stage):
    """The reverse direction: saved by 2 ranks at stage 1 or 2, loaded by 4 ranks at stage 3."""
    path = str(tmp_path / "save")
    weights, uninterrupted = run_distributed(save_run, 2, (path, stage, False))[0]
    it, loaded, losses = run_distributed(load_run, 4, (path, 3, False))[0]
    assert it == 3 and all(torch.equal(loaded[k], weights[k]) for k in weights)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(uninterrupted), rtol=1e-5, atol=0)


def load_run_single(path, stage):
    import torch.distributed as dist
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        return load_run(0, 1, path, stage, False)
    finally:
        dist.destroy_process_group()


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_each_rank_writes_only_its_slices(saved_4_ranks_stage3):
    """No rank's file holds the whole model: each holds a quarter of every tensor (masters and
    Adam's two moments), read from DCP's own record of which slice went to which file."""
    path, _ = saved_4_ranks_stage3
    ckpt = os.path.join(path, "iter_0000003")
    md = dcp.FileSystemReader(ckpt).read_metadata()
    elements = {}
    for index, where in md.storage_data.items():
        if index.fqn.startswith(("model.", "optim.exp_avg")):
            chunk = md.state_dict_metadata[index.fqn].chunks[index.index]
            elements[where.relative_path] = elements.get(where.relative_path, 0) + chunk.sizes.numel()
    model = sum(torch.Size(s).numel() for s in META["param_shapes"].values())
    assert sorted(elements) == [f"__{r}_0.distcp" for r in range(4)]
    for n in elements.values():
        assert 3 * model / 4 * 0.95 < n < 3 * model / 4 * 1.05, (n, model)
    assert "model.pt" not in os.listdir(ckpt)


# -- faults during a save ------------------------------------------------------------------------------
class FailingWriter(dcp.FileSystemWriter):
    """Writes like DCP's FileSystemWriter, except on `rank`: a full disk, or a kill -9 mid-write."""

    def __init__(self, path, rank, fault):
        super().__init__(path, sync_files=True)
        self.fault_rank, self.fault = rank, fault

    def write_data(self, plan, planner):
        if torch.distributed.get_rank() == self.fault_rank:
            if self.fault == "kill":
                with open(os.path.join(self.path, f"__{self.fault_rank}_0.distcp"), "wb") as f:
                    f.write(b"partial")   # half a file, then the process dies
                os.kill(os.getpid(), signal.SIGKILL)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
        return super().write_data(plan, planner)


def fault_run(rank, world, path, fault):
    engine = make_engine(world, 3)
    train_steps(engine, rank, world, range(2))
    save_checkpoint(path, 2, engine, 16, META)
    train_steps(engine, rank, world, range(2, 3))
    before = engine.module_state_dict()
    try:
        save_checkpoint(path, 3, engine, 24, META, storage_writer=lambda p: FailingWriter(p, 1, fault))
    except CheckpointError as e:
        message = str(e)
    else:
        message = None
    after = engine.module_state_dict()
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    # training goes on from the same state, and the next save succeeds
    losses = train_steps(engine, rank, world, range(3, 4))
    save_checkpoint(path, 4, engine, 32, META)
    return message, unchanged, losses


def test_disk_full_during_save_keeps_previous_checkpoint(tmp_path):
    path = str(tmp_path / "save")
    results = run_distributed(fault_run, 2, (path, "enospc"))
    for message, unchanged, _ in results:
        assert message is not None and "No space left on device" in message and path in message
        assert "previous checkpoint (iteration 2) is intact" in message
        assert unchanged
    assert latest_iteration(path) == 4 and complete_iterations(path) == [2, 4]
    assert not [d for d in os.listdir(path) if d.endswith(".tmp")]


def kill_run(rank, world, path):
    return fault_run(rank, world, path, "kill")


def resume_run(rank, world, path):
    engine = make_engine(world, 3, seed=1)
    meta = load_checkpoint(path, engine)
    save_checkpoint(path, meta["iteration"] + 1, engine, 0, META)  # cleans the stale .tmp
    return meta["iteration"]


@pytest.mark.slow
def test_kill_9_during_save_leaves_previous_checkpoint_latest(tmp_path):
    path = str(tmp_path / "save")
    with pytest.raises(RuntimeError, match="distributed run failed"):
        run_distributed(kill_run, 2, (path,), timeout=60)
    assert latest_iteration(path) == 2
    assert os.path.isdir(os.path.join(path, "iter_0000003.tmp"))  # what the killed save left
    assert run_distributed(resume_run, 2, (path,)) == [2, 2]
    assert sorted(os.listdir(path)) == ["iter_0000002", "iter_0000003", TRACKER]


def test_real_full_disk(tmp_path):
    """A tmpfs too small for the second checkpoint (needs root; skipped where mount is not allowed)."""
    mount = tmp_path / "small"
    mount.mkdir()
    if os.system(f"mount -t tmpfs -o size=1m tmpfs {mount} 2>/dev/null") != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        results = run_distributed(full_disk_run, 2, (str(mount / "save"),))
    finally:
        os.system(f"umount {mount}")
    message, latest, loaded = results[0]
    assert "No space left on device" in message and f"previous checkpoint (iteration {latest})" in message
    assert latest >= 1 and loaded == latest


def full_disk_run(rank, world, path):
    """Checkpoints of ~0.45 MB into 1 MB: one of the first three fails."""
    engine = make_engine(world, 3)
    message = None
    for it in range(1, 4):
        try:
            save_checkpoint(path, it, engine, 0, META)
        except CheckpointError as e:
            message = str(e)
            break
    fresh = make_engine(world, 3, seed=1)
    return message, latest_iteration(path), load_checkpoint(path, fresh)["iteration"]


def keep_last_run(rank, world, path):
    engine = make_engine(world, 2)
    for it in (1, 2, 3, 4):
        save_checkpoint(path, it, engine, 0, META, keep_last=2)
    return True


@pytest.mark.slow
def test_keep_last_prunes_only_complete_older_checkpoints(tmp_path):
    path = str(tmp_path / "save")
    run_distributed(keep_last_run, 2, (path,))
    assert complete_iterations(path) == [3, 4] and latest_iteration(path) == 4


def damaged_load_run(rank, world, path):
    engine = make_engine(world, 3)
    try:
        load_checkpoint(path, engine)
    except CheckpointError as e:
        return str(e)


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_shard_is_found_by_checksum(tmp_path, damage):
    path = str(tmp_path / "save")
    run_distributed(keep_last_run, 2, (path,))
    victim = os.path.join(path, "iter_0000004", "__1_0.distcp")
    data = bytearray(open(victim, "rb").read())
    if damage == "truncate":
        data = data[:len(data) // 2]
    else:
        data[len(data) // 2] ^= 0xFF
    open(victim, "wb").write(bytes(data))
    messages = run_distributed(damaged_load_run, 2, (path,))
    assert messages[0] == messages[1]
    assert victim in messages[0] and ("truncated" if damage == "truncate" else "checksum") in messages[0]
    assert f"--load {os.path.join(path, 'iter_0000003')}" in messages[0]


# -- export -------------------------------------------------------------------------------------------
def test_export_consolidated_without_process_group(saved_4_ranks_stage3):
    path, (weights, _) = saved_4_ranks_stage3
    sd, meta = consolidated_state_dict(path)
    assert meta["iteration"] == 3 and set(sd) == set(weights)
    for k in weights:
        assert torch.equal(sd[k], weights[k]), k
    half, _ = consolidated_state_dict(path, torch.bfloat16)
    assert all(v.dtype == torch.bfloat16 for v in half.values())


@pytest.mark.parametrize("max_shard", [1 << 30, 40_000])
def test_export_hf_gives_the_same_logits(saved_4_ranks_stage3, tmp_path, max_shard):
    transformers = pytest.importorskip("transformers")
    path, (weights, _) = saved_4_ranks_stage3
    files, _ = export_hf(path, str(tmp_path / "hf"), max_shard_bytes=max_shard)
    assert (len(files) > 1) == (max_shard < 1 << 30)
    hf = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "hf")).eval()
    ours = GPT(GPTConfig(**CFG)).eval()
    ours.load_state_dict(weights)
    tokens = batch(99)[:, :16]
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, ours(tokens), rtol=1e-4, atol=1e-5)
