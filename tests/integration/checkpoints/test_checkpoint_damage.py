"""Every file of a checkpoint, damaged every way: one CheckpointError line naming
the file and the newest intact checkpoint, from train.py's loader and from the
exporter alike, never a traceback from the JSON or file layer.

Single process (world size 1, no process group): the files and their checks are
the same at any world size."""
import dataclasses
import os
import shutil

import pytest
import torch

import zeropp
from model import GPT, GPTConfig
from parallel.comm import Communicator
from parallel.topology import Topology
from tools.export_checkpoint import consolidated_state_dict
from training.checkpoint import (CHECKSUMS, CONSOLIDATED_16BIT, META, TOKENIZER_COPIES, TRACKER, CheckpointError,
                                 iteration_dir, load_checkpoint, save_checkpoint)

CFG = GPTConfig(vocab_size=96, num_layers=1, hidden_size=32, num_attention_heads=4, max_position_embeddings=16)


def engine():
    model = GPT(CFG)
    return zeropp.initialize(model, zeropp.DeepSpeedConfig.from_dict({}), Communicator(Topology(1, 0, 1)),
                             torch.device("cpu"), zeropp.OptimizerSettings(lr=1e-3))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """A save directory with checkpoints at iterations 2 and 3 (the latest), each with a tokenizer copy
    and the consolidated 16-bit model beside the sharded files."""
    save = str(tmp_path_factory.mktemp("ckpt") / "save")
    eng = engine()
    meta = {"model_config": dataclasses.asdict(CFG),
            "param_shapes": {n: list(p.shape) for n, p in eng.module.named_parameters()}}
    for it in (2, 3):
        x = torch.randint(0, 96, (2, 9))
        eng.backward(eng(x[:, :-1], x[:, 1:]))
        eng.step()
        save_checkpoint(save, it, eng, it * 2, meta, files={TOKENIZER_COPIES["tokenizer_model"]: b"sp" * 100},
                        consolidated_16bit=True)
    return save


def damage(path: str, how: str):
    if how == "missing":
        os.remove(path)
        return
    data = bytearray(open(path, "rb").read())
    if how == "empty":
        data = bytearray()
    elif how == "truncated":
        data = data[:len(data) // 2]
    elif how == "flipped":          # one byte changed: still the same size
        data[len(data) // 2] ^= 0x01
    open(path, "wb").write(bytes(data))


FILES = [META, CHECKSUMS, ".metadata", "__0_0.distcp", TOKENIZER_COPIES["tokenizer_model"], CONSOLIDATED_16BIT]
HOWS = ["missing", "empty", "truncated", "flipped"]


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("name", FILES)
def test_damaged_file_is_one_line_naming_it_and_the_intact_checkpoint(pristine, tmp_path, name, how):
    save = str(tmp_path / "save")
    shutil.copytree(pristine, save)
    damage(os.path.join(iteration_dir(save, 3), name), how)
    for load in (lambda: load_checkpoint(save, engine()), lambda: consolidated_state_dict(save),
                 lambda: load_checkpoint(iteration_dir(save, 3), engine())):
        with pytest.raises(CheckpointError) as error:
            load()
        message = str(error.value)
        assert "\n" not in message
        assert os.path.join(iteration_dir(save, 3), name) in message, message
        assert f"--load {iteration_dir(save, 2)}" in message, message
    assert load_checkpoint(iteration_dir(save, 2), engine())["iteration"] == 2   # the hint works


@pytest.mark.parametrize("text, expect", [("", "should hold an iteration number"),
                                          ("x3", "should hold an iteration number"),
                                          ("9", "names iteration 9 but")])
def test_damaged_tracker_is_one_line_naming_the_intact_checkpoint(pristine, tmp_path, text, expect):
    save = str(tmp_path / "save")
    shutil.copytree(pristine, save)
    with open(os.path.join(save, TRACKER), "w") as f:
        f.write(text)
    with pytest.raises(CheckpointError, match=expect) as error:
        load_checkpoint(save, engine())
    assert f"--load {iteration_dir(save, 3)}" in str(error.value) and "\n" not in str(error.value)


def test_missing_tracker_loads_the_newest_complete_checkpoint(pristine, tmp_path, capsys):
    save = str(tmp_path / "save")
    shutil.copytree(pristine, save)
    os.remove(os.path.join(save, TRACKER))
    assert load_checkpoint(save, engine())["iteration"] == 3
    assert "is missing: loading the newest complete checkpoint, iteration 3" in capsys.readouterr().out


def test_no_intact_checkpoint_left_says_so(pristine, tmp_path):
    save = str(tmp_path / "save")
    shutil.copytree(pristine, save)
    for it in (2, 3):
        damage(os.path.join(iteration_dir(save, it), META), "truncated")
    with pytest.raises(CheckpointError, match="no other intact checkpoint was found there"):
        load_checkpoint(save, engine())
