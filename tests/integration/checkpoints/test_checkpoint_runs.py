"""Whose checkpoints a save directory holds, and what a checkpoint carries: a mistyped --load is an
error (Megatron's auto-resume, --load = --save with nothing there yet, starts fresh), a --save of
another run is refused unless --overwrite-checkpoints, --keep-last prunes only this run's
checkpoints, the tracker never moves back silently; the tokenizer travels inside each checkpoint
(generate.py samples from a copy whose original tokenizer is gone); DeepSpeed's
stage3_gather_16bit_weights_on_model_save writes pytorch_model.bin beside each checkpoint.
Every count of checkpoints is taken before and after."""
import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

import generate
import train
from tests.distributed import run_distributed, train_ranks
from tests.integration.train.test_train import corpus, flags  # noqa: F401  (corpus is a fixture)
from tools import export_checkpoint
from training.checkpoint import (CheckpointError, checksums_json, complete_iterations, file_crc32, latest_iteration,
                                 save_checkpoint)
from tests import REPO

ROOT = str(REPO)


def run(corpus, out, iters, *extra, save=None):  # noqa: F811
    """train.run() (the command's exit status) of a tiny run saving every iteration into `save`."""
    argv = flags(corpus, out, iters, ["--save-interval", "1", *extra])
    if save is not None:
        argv[argv.index("--save") + 1] = str(save)
    return train.run(argv)


def one_error_line(capsys, *names) -> str:
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "lm loss" not in out, out   # refused before training
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def other_run(corpus, tmp_path_factory):  # noqa: F811
    """A save directory holding iterations 10, 20, 30 and 40 of another run."""
    out = tmp_path_factory.mktemp("other")
    assert run(corpus, out, 40, "--save-interval", "10") == 0
    assert complete_iterations(str(out / "ckpt")) == [10, 20, 30, 40]
    return out / "ckpt"


def copy_of(path, tmp_path):
    shutil.copytree(path, tmp_path / "ckpt")
    return tmp_path / "ckpt"


# -- --load -----------------------------------------------------------------------------------
@pytest.mark.parametrize("make", ["absent", "empty", "no checkpoint"])
def test_load_without_a_checkpoint_is_an_error(corpus, tmp_path, capsys, make):  # noqa: F811
    load = tmp_path / "typo"
    if make != "absent":
        load.mkdir()
    if make == "no checkpoint":
        (load / "notes.txt").write_text("x")
    assert run(corpus, tmp_path, 2, "--load", str(load)) == 2
    one_error_line(capsys, f"--load {load}", "does not exist" if make == "absent" else "holds no checkpoint")
    assert not (tmp_path / "ckpt").exists()   # nothing saved


@pytest.mark.parametrize("make", ["absent", "empty"])
def test_load_is_save_with_nothing_there_starts_fresh(corpus, tmp_path, capsys, make):  # noqa: F811
    """Megatron's auto-resume idiom: the same command starts the run, and resumes it when restarted."""
    if make == "empty":
        (tmp_path / "ckpt").mkdir()
    assert run(corpus, tmp_path, 2, "--load", str(tmp_path / "ckpt")) == 0
    out = capsys.readouterr().out
    assert out.count(f"> note: no checkpoint in --load {tmp_path / 'ckpt'} yet (it is --save): starting from "
                     f"scratch") == 1, out
    assert complete_iterations(str(tmp_path / "ckpt")) == [1, 2]
    assert run(corpus, tmp_path, 4, "--load", str(tmp_path / "ckpt")) == 0   # restarted: resumes
    out = capsys.readouterr().out
    # Megatron's lines before a save or load that may take long, their time and size after
    assert out.index(f"> loading checkpoint from {tmp_path / 'ckpt'} at iteration 2\n") < out.index("MB loaded in")
    assert (out.index(f"> saving checkpoint at iteration       3 to {tmp_path / 'ckpt'}\n")
            < out.index("> saved checkpoint at iteration 3 to"))
    assert f"> resumed from {tmp_path / 'ckpt'} at iteration 2" in out
    assert complete_iterations(str(tmp_path / "ckpt")) == [1, 2, 3, 4]


# -- --save of another run --------------------------------------------------------------------
def test_fresh_run_into_another_runs_save_dir_is_refused(corpus, other_run, tmp_path, capsys):  # noqa: F811
    """The issue's case: --save holds iterations 10..40 of another run; a fresh run with --keep-last 2
    deleted 10 and 20 and moved the tracker to 3. Now: refused, nothing touched."""
    save = copy_of(other_run, tmp_path)
    before = sorted(os.listdir(save))
    assert run(corpus, tmp_path, 3, "--keep-last", "2", save=save) == 2
    one_error_line(capsys, f"--save {save}", "another run", "10, 20, 30, 40", "--overwrite-checkpoints")
    assert sorted(os.listdir(save)) == before and complete_iterations(str(save)) == [10, 20, 30, 40]
    assert latest_iteration(str(save)) == 40


def test_overwrite_prunes_only_this_runs_checkpoints(corpus, other_run, tmp_path, capsys):  # noqa: F811
    save = copy_of(other_run, tmp_path)
    assert run(corpus, tmp_path, 3, "--keep-last", "2", "--overwrite-checkpoints", save=save) == 0
    out = capsys.readouterr().out
    assert "> note: --overwrite-checkpoints" in out and f"moves back from 40 to 1" in out, out
    assert complete_iterations(str(save)) == [2, 3, 10, 20, 30, 40]   # the other run's four are all kept
    assert latest_iteration(str(save)) == 3


def test_resuming_an_older_checkpoint_into_newer_ones_is_refused(corpus, other_run, tmp_path, capsys):  # noqa: F811
    """--load DIR/iter_0000020 with --save DIR (holding 30 and 40): the tracker would move back from 40."""
    save = copy_of(other_run, tmp_path)
    assert run(corpus, tmp_path, 40, "--load", str(save / "iter_0000020"), save=save) == 2
    one_error_line(capsys, "iterations 30, 40", "resumes at iteration 20")
    assert complete_iterations(str(save)) == [10, 20, 30, 40] and latest_iteration(str(save)) == 40


def test_keep_last_prunes_this_runs_older_checkpoints_across_a_resume(corpus, tmp_path, capsys):  # noqa: F811
    """A run stopped and resumed (torchrun --max-restarts) is the same run: its older checkpoints go."""
    save = tmp_path / "ckpt"
    assert run(corpus, tmp_path, 2, "--keep-last", "2") == 0
    assert run(corpus, tmp_path, 4, "--keep-last", "2", "--load", str(save)) == 0
    assert complete_iterations(str(save)) == [3, 4] and latest_iteration(str(save)) == 4
    runs = {json.loads((save / f"iter_000000{it}" / "meta.json").read_text())["run"] for it in (3, 4)}
    assert len(runs) == 1


def save_then_save_older(rank, world, path):
    from tests.unit.training.test_checkpoint import META, make_engine
    engine = make_engine(world, 3)
    save_checkpoint(path, 5, engine, 0, dict(META, run="a"))
    try:
        save_checkpoint(path, 3, engine, 0, dict(META, run="b"))
    except CheckpointError as e:
        return str(e)


def test_a_save_never_moves_the_tracker_back(tmp_path):
    """A job that wrote into --save after this one checked it at start: found at the save itself."""
    messages = run_distributed(save_then_save_older, 2, (str(tmp_path / "save"),))
    assert messages[0] == messages[1] and "iteration 5, newer than this one" in messages[0], messages
    assert latest_iteration(str(tmp_path / "save")) == 5 and complete_iterations(str(tmp_path / "save")) == [5]


# -- self-contained checkpoints ---------------------------------------------------------------
@pytest.fixture(scope="module")
def moved(corpus, tmp_path_factory):  # noqa: F811
    """A run trained with a tokenizer that is then deleted, its save directory moved elsewhere."""
    out = tmp_path_factory.mktemp("moved")
    shutil.copy(corpus / "sp.model", out / "tok.model")
    argv = flags(corpus, out, 2, ["--save-interval", "1"])
    argv[argv.index("--tokenizer-model") + 1] = str(out / "tok.model")
    assert train.run(argv) == 0
    os.remove(out / "tok.model")
    shutil.move(out / "ckpt", out / "elsewhere")
    return out / "elsewhere"


@pytest.mark.parametrize("load", ["save dir", "iter dir"])
def test_generate_from_a_copied_checkpoint_whose_tokenizer_is_gone(moved, tmp_path, load):
    path = moved if load == "save dir" else moved / "iter_0000002"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "generate.py"), "--load", str(path),
                           "--prompt", "the red cat", "--max-new-tokens", "3"], cwd=str(tmp_path),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("[checkpoint iteration 2]\nthe red cat")
    meta = json.loads((moved / "iter_0000002" / "meta.json").read_text())
    assert meta["tokenizer_copies"] == {"tokenizer_model": "tokenizer/tokenizer.model"}
    checksums = json.loads((moved / "iter_0000002" / "checksums.json").read_text())
    assert "tokenizer/tokenizer.model" in checksums   # damage to the copy is found like any other


def test_export_hf_takes_the_copied_tokenizer(corpus, moved, tmp_path):  # noqa: F811
    from transformers import AutoTokenizer
    from data.tokenizer import build_tokenizer
    export_checkpoint.main(["--load", str(moved), "--format", "hf", "--output", str(tmp_path / "hf")])
    text = "the red cat went to the hill and saw 3 dogs."
    sp = build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(corpus / "sp.model"))
    assert AutoTokenizer.from_pretrained(str(tmp_path / "hf"))(text)["input_ids"] == sp.tokenize(text)


def test_tokenizer_flag_overrides_the_copy(corpus, moved, tmp_path, capsys):  # noqa: F811
    """--tokenizer-model wins; a missing one is one line naming it."""
    assert generate.main(["--load", str(moved), "--prompt", "the red cat", "--max-new-tokens", "2",
                          "--tokenizer-model", str(corpus / "sp.model")]) == 0
    assert capsys.readouterr().out.startswith("[checkpoint iteration 2]\nthe red cat")
    assert generate.main(["--load", str(moved), "--tokenizer-model", str(tmp_path / "nope.model")]) == 2
    err = capsys.readouterr().err
    assert f"--tokenizer-model {tmp_path / 'nope.model'} does not exist" in err and "train one" not in err, err


def as_before_the_copies(moved, tmp_path, tokenizer_model=None):
    """A copy of `moved` as checkpoints were before the tokenizer travelled inside them: meta.json
    names the tokenizer by its absolute path only (`tokenizer_model`, or the deleted original)."""
    old = copy_of(moved, tmp_path)
    it = old / "iter_0000002"
    meta = json.loads((it / "meta.json").read_text())
    del meta["tokenizer_copies"]
    meta["tokenizer_model"] = str(tokenizer_model or meta["tokenizer_model"])
    (it / "meta.json").write_text(json.dumps(meta))
    shutil.rmtree(it / "tokenizer")
    files = [p for p in it.rglob("*") if p.is_file() and p.name != "checksums.json"]
    table = {str(p.relative_to(it)): [p.stat().st_size, file_crc32(str(p))] for p in files}
    (it / "checksums.json").write_text(checksums_json(table))
    return old


def test_old_checkpoint_reads_the_tokenizer_where_training_did(corpus, moved, tmp_path, capsys):  # noqa: F811
    old = as_before_the_copies(moved, tmp_path, corpus / "sp.model")
    assert generate.main(["--load", str(old), "--prompt", "the red cat", "--max-new-tokens", "2"]) == 0
    assert capsys.readouterr().out.startswith("[checkpoint iteration 2]\nthe red cat")


def test_old_checkpoint_whose_tokenizer_is_gone_says_which_flag(moved, tmp_path, capsys):
    """Its tokenizer moved: generate.py names the flag, not "train a new tokenizer" (which would not
    match the weights)."""
    assert generate.main(["--load", str(as_before_the_copies(moved, tmp_path))]) == 2
    err = capsys.readouterr().err
    assert "tok.model missing" in err and "pass the one training used with --tokenizer-model" in err, err


# -- DeepSpeed's consolidated 16-bit model ----------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("key, extra", [("stage3_gather_16bit_weights_on_model_save", ()),
                                        ("stage3_gather_fp16_weights_on_model_save", ()),
                                        ("stage3_gather_16bit_weights_on_model_save", ("--sharding", "fsdp2")),
                                        ("stage3_gather_16bit_weights_on_model_save", ("--async-save",))])
def test_gather_16bit_weights_on_model_save(corpus, tmp_path, key, extra):  # noqa: F811
    """Stage 3 (the engine's, or FSDP2's; saving in the background too) on 3 ranks (uneven slices:
    the gather pads and cuts them), bf16, with the key in the DeepSpeed JSON: each checkpoint also
    holds pytorch_model.bin, the model's state dict in bf16, equal to the exporter's --dtype bf16 output."""
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3, key: True}, "bf16": {"enabled": True}}))
    rc, log = train_ranks(3, flags(corpus, tmp_path, 4, ["--save-interval", "2", "--deepspeed_config", str(ds),
                                                         "--micro-batch-size", "1", "--global-batch-size", "6",
                                                         *extra]))
    assert rc == 0, log
    for it in (2, 4):
        path = tmp_path / "ckpt" / f"iter_{it:07d}"
        saved = torch.load(path / "pytorch_model.bin", weights_only=True)
        exported = export_checkpoint.consolidated_state_dict(str(path), torch.bfloat16)[0]
        assert list(saved) == list(exported)
        for name in saved:
            assert saved[name].dtype == torch.bfloat16 and torch.equal(saved[name], exported[name]), name
        assert "pytorch_model.bin" in json.loads((path / "checksums.json").read_text())


def test_a_failed_16bit_write_leaves_the_previous_checkpoint_latest(tmp_path, monkeypatch):
    """The 16-bit file is written inside the checkpoint's .tmp directory: a full disk while torch.save
    writes it is one line, and the previous checkpoint stays the latest, whole."""
    from tests.integration.checkpoints.test_checkpoint_damage import CFG, engine
    from training.checkpoint import rank0_files
    eng, save = engine(), str(tmp_path / "save")
    meta = {"model_config": dataclasses.asdict(CFG),
            "param_shapes": {n: list(p.shape) for n, p in eng.module.named_parameters()}}
    save_checkpoint(save, 2, eng, 0, meta, consolidated_16bit=True)

    class FullDisk:   # torch, whose save fails as it does on a full disk (only where the 16-bit file is written)
        def __getattr__(self, name):
            return getattr(torch, name)

        def save(self, *args, **kwargs):
            raise RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 64 vs 598")
    monkeypatch.setattr(rank0_files, "torch", FullDisk())
    with pytest.raises(CheckpointError) as error:
        save_checkpoint(save, 3, eng, 0, meta, consolidated_16bit=True)
    assert "\n" not in str(error.value) and "pytorch_model.bin" in str(error.value)
    assert "the previous checkpoint (iteration 2) is intact and still the latest" in str(error.value)
    assert complete_iterations(save) == [2] and latest_iteration(save) == 2
    assert export_checkpoint.open_checkpoint(save)[1]["iteration"] == 2   # every checksum holds


def test_a_save_dir_without_its_tracker_is_still_another_runs(corpus, other_run, tmp_path, capsys):  # noqa: F811
    save = copy_of(other_run, tmp_path)
    os.remove(save / "latest_checkpointed_iteration.txt")
    assert run(corpus, tmp_path, 3, save=save) == 2
    one_error_line(capsys, "iterations 10, 20, 30, 40)")
    assert complete_iterations(str(save)) == [10, 20, 30, 40]
