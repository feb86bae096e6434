"""train.py end to end on a tiny corpus: it learns, logs, saves, and resumes exactly."""
import json
import os

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import train
from data.preprocess import preprocess
from data.tokenizer import train_sentencepiece
from tools.export_checkpoint import consolidated_state_dict


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    d = tmp_path_factory.mktemp("corpus")
    lines = [f"the {a} {b} went to the {c} and saw {n} {b}s."
             for n, (a, b, c) in enumerate([(a, b, c) for a in ("red", "old", "tall", "quiet")
                                            for b in ("cat", "dog", "king", "bird")
                                            for c in ("river", "hill", "city")])]
    with open(d / "docs.jsonl", "w") as f:
        for i in range(0, len(lines), 3):
            f.write(json.dumps({"text": " ".join(lines[i:i + 3])}) + "\n")
    train_sentencepiece([str(d / "docs.jsonl")], str(d / "sp"), vocab_size=320)
    preprocess(input=[str(d / "docs.jsonl")], output_prefix=str(d / "docs"), tokenizer_model=str(d / "sp.model"),
               append_eod=True, progress=False)
    return d


def flags(corpus, out, iters, extra=()):
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--hidden-dropout", "0.1", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--train-iters", str(iters), "--lr", "3e-3", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2",
            "--data-path", str(corpus / "docs_text_document"), "--split", "90,10,0",
            "--tokenizer-model", str(corpus / "sp.model"), "--data-cache-path", str(out / "cache"),
            "--log-interval", "2", "--eval-interval", "4", "--eval-iters", "2",
            "--save", str(out / "ckpt"), "--tensorboard-dir", str(out / "tb"), *extra]


def final_weights(save_dir):
    return consolidated_state_dict(str(save_dir))[0]


def test_train_logs_and_learns(corpus, tmp_path, capsys):
    train.main(flags(corpus, tmp_path, 12))
    out = capsys.readouterr().out
    losses = [float(line.split("lm loss:")[1].split("|")[0]) for line in out.splitlines() if "lm loss:" in line]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.5
    assert "validation loss at iteration 12" in out and "consumed samples:           48" in out
    assert "model states per rank (ZeRO stage 0, 1 ranks, float32)" in out
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"lm loss", "learning-rate", "loss-scale", "grad-norm", "lm loss validation",
            "throughput/tokens-per-second", "memory/peak-MB"} <= tags
    assert len(events.Scalars("lm loss")) == 6


def test_tensorboard_has_megatrons_and_deepspeeds_tags(corpus, tmp_path):
    """Megatron's tag names and switches, each tag with its `vs samples` twin (x: samples consumed),
    DeepSpeed's Train/Samples/ tags from the JSON's tensorboard section, ours under their prefixes."""
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"tensorboard": {"enabled": True, "output_path": str(tmp_path / "ds_logs"),
                                              "job_name": "train_gpt"}, "wall_clock_breakdown": True}))
    argv = [a for a in flags(corpus, tmp_path, 8, ["--deepspeed_config", str(ds), "--log-timers-to-tensorboard",
                                                   "--log-validation-ppl-to-tensorboard", "--log-params-norm",
                                                   "--log-world-size-to-tensorboard", "--split", "80,10,10"])]
    del argv[argv.index("--tensorboard-dir"):argv.index("--tensorboard-dir") + 2]   # the JSON's directory
    train.main(argv)
    events = EventAccumulator(str(tmp_path / "ds_logs" / "train_gpt"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    megatron = ["learning-rate", "batch-size", "lm loss", "loss-scale", "grad-norm", "params-norm", "world-size",
                "lm loss validation", "lm loss validation ppl", "lm loss test", "lm loss test ppl"]
    assert {*megatron, *(f"{t} vs samples" for t in megatron), "iteration-time"} <= tags
    assert {"Train/Samples/train_loss", "Train/Samples/lr", "Train/Samples/elapsed_time_ms_forward"} <= tags
    assert {"throughput/samples-per-second", "comm/inter-node-MB-per-iteration", "memory/peak-MB", "time/step"} <= tags
    assert [e.step for e in events.Scalars("lm loss")] == [2, 4, 6, 8]
    assert [e.step for e in events.Scalars("lm loss vs samples")] == [8, 16, 24, 32]   # global batch 4
    assert [e.value for e in events.Scalars("world-size")] == [1] * 4
    assert not {t for t in tags if "/" not in t} - {*megatron, *(f"{t} vs samples" for t in megatron),
                                                     "iteration-time"}   # ours are all prefixed


def test_tensorboard_switches_off_and_interval(corpus, tmp_path):
    """Without Megatron's switches their tags are absent; --tensorboard-log-interval 4 keeps every other log line."""
    train.main(flags(corpus, tmp_path, 8, ["--tensorboard-log-interval", "4", "--no-log-loss-scale-to-tensorboard",
                                           "--tensorboard-queue-size", "1"]))
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert not tags & {"loss-scale", "iteration-time", "lm loss validation ppl", "params-norm", "world-size",
                       "Train/Samples/train_loss"}
    assert [e.step for e in events.Scalars("lm loss")] == [4, 8]


def test_megatrons_checkpoint_and_stop_flags(corpus, tmp_path, capsys):
    """--exit-duration-in-mins stops after the first iteration past it and saves; --no-save-optim
    and --no-save-rng leave those out, and a load says so; --finetune takes the weights only and
    starts at iteration 0."""
    import torch.distributed.checkpoint as dcp
    first = tmp_path / "first"
    train.main(flags(corpus, first, 6, ["--exit-duration-in-mins", "1e-9", "--no-save-optim", "--no-save-rng"]))
    out = capsys.readouterr().out
    assert "> --exit-duration-in-mins reached: stopped after iteration 1;" in out
    saved = first / "ckpt" / "iter_0000001"
    meta = json.loads((saved / "meta.json").read_text())
    assert meta["optimizer_saved"] is False and meta["rng"] == []
    assert not [k for k in dcp.FileSystemReader(str(saved)).read_metadata().state_dict_metadata if "optim" in k]
    from training.args import parse_args
    args = parse_args(flags(corpus, tmp_path, 2, ["--load", str(first / "ckpt"), "--use-checkpoint-args",
                                                  "--num-layers", "5", "--hidden-size", "64"]))
    assert (args.num_layers, args.hidden_size) == (2, 32)   # the checkpoint's, over the flags
    assert f"--use-checkpoint-args: --num-layers 2, --hidden-size 32 from {saved}" in capsys.readouterr().out
    second = tmp_path / "second"
    train.main(flags(corpus, second, 2, ["--load", str(first / "ckpt"), "--finetune"]))
    out = capsys.readouterr().out
    assert f"--finetune: weights from {first / 'ckpt'}; training starts at iteration 0" in out
    assert "consumed samples:            8" in out and sorted(os.listdir(second / "ckpt"))[0] == "iter_0000002"
    train.main(flags(corpus, tmp_path / "third", 2, ["--load", str(first / "ckpt")]))
    out = capsys.readouterr().out
    assert "saved without its optimizer state (--no-save-optim): a new optimizer starts" in out
    assert "saved without random-number states (--no-save-rng)" in out


def test_resume_continues_exactly(corpus, tmp_path):
    """6 iterations in one go == 3 iterations, stop, resume for 3 more (dropout on)."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    train.main(flags(corpus, straight, 6))
    train.main(flags(corpus, split, 3))
    train.main(flags(corpus, split, 6, ["--load", str(split / "ckpt")]))
    a, b = final_weights(straight / "ckpt"), final_weights(split / "ckpt")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)


def test_exit_interval_stops_saves_and_resumes_exactly(corpus, tmp_path, capsys):
    """Megatron's --exit-interval: stop after iteration 4 of 8 with a checkpoint (no --save-interval),
    the same data order as a run to 8 (--train-iters unchanged); resuming ends where 8 straight does."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    train.main(flags(corpus, straight, 8))
    capsys.readouterr()
    train.main(flags(corpus, split, 8, ["--exit-interval", "4"]))
    out = capsys.readouterr().out
    assert "--exit-interval reached: stopped after iteration 4; checkpoint" in out, out
    assert "iteration        6/" not in out
    train.main(flags(corpus, split, 8, ["--load", str(split / "ckpt")]))
    a, b = final_weights(straight / "ckpt"), final_weights(split / "ckpt")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)


@pytest.mark.parametrize("precision, scale", [(["--fp16", "--initial-loss-scale", "1024"], "loss scale: 1024.0"),
                                              (["--bf16"], "loss scale: 1.0")])
def test_16bit_training(corpus, tmp_path, capsys, precision, scale):
    train.main(flags(corpus, tmp_path, 8, precision))
    out = capsys.readouterr().out
    losses = [float(line.split("lm loss:")[1].split("|")[0]) for line in out.splitlines() if "lm loss:" in line]
    assert scale in out and "number of skipped iterations:   0" in out
    assert losses[-1] < losses[0] - 0.3


def test_missing_data_path_names_the_file(corpus, tmp_path):
    args = flags(corpus, tmp_path, 2)
    args[args.index("--data-path") + 1] = str(tmp_path / "nope_text_document")
    with pytest.raises(ValueError, match="nope_text_document"):
        train.main(args)


@pytest.mark.slow
def test_topology_error_is_one_line_and_exit_2(corpus, tmp_path):
    """--ranks-per-node that does not divide the job: a clear message, exit status 2."""
    import subprocess
    import sys
    cmd = [sys.executable, "train.py", *flags(corpus, tmp_path, 2), "--ranks-per-node", "3"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.abspath(train.__file__)))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: --ranks-per-node 3 emulates nodes of 3 ranks, and this is one process: launch with torchrun "
        "--nproc-per-node 6 (2 nodes of 3), or drop --ranks-per-node"]


def test_log_lines_are_megatrons(capsys):
    """Timestamp prefix, per-interval skipped/nan counts, no grad norm after a skipped step,
    Megatron's evaluation wording; our throughput and byte fields come after Megatron's."""
    import re
    from training.logger import TrainingLogger
    logger = TrainingLogger(None)
    stats = {"consumed": 8, "iter_ms": 12.0, "lr": 1e-3, "global_batch": 4, "loss": 5.0, "loss_scale": 1024.0,
             "grad_norm": None, "skipped": 1, "nan": 0, "samples_per_s": 3.0, "tokens_per_s": 48.0,
             "tflops": 0.0, "intra_mb": 0.0, "inter_mb": 0.0}
    logger.training_line(2, 10, stats)
    logger.training_line(4, 10, {**stats, "grad_norm": 0.5, "skipped": 0})
    logger.validation_line(4, "validation", 4.0)
    logger.validation_line(10, "validation", 3.0, end_of_training=True)
    logger.validation_line(10, "test", 3.5)
    lines = capsys.readouterr().out.splitlines()
    assert re.match(r"^ \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] iteration        2/      10 \| consumed samples: ", lines[0])
    assert "grad norm" not in lines[0] and "| number of skipped iterations:   1 |" in lines[0]
    assert "| loss scale: 1024.0 | grad norm: 0.500 | number of skipped iterations:   0 |" in lines[1]
    assert lines[1].index("number of nan iterations") < lines[1].index("tokens per second")
    assert any(line.startswith(" validation loss at iteration 4 | lm loss value: 4.000000E+00 | lm loss PPL: ")
               for line in lines)
    assert any(line.startswith(" validation loss at iteration 10 on validation set | lm loss value: ")
               for line in lines)
    assert any(line.startswith(" validation loss at iteration 10 on test set | ") for line in lines)


def validation_losses(out: str) -> list[float]:
    return [float(line.split("lm loss value:")[1].split("|")[0]) for line in out.splitlines()
            if "lm loss value:" in line and "test set" not in line]


def test_validation_continues_where_it_stopped_also_after_resume(corpus, tmp_path, capsys):
    """Megatron's validation iterator: each evaluation reads the next --eval-iters batches
    (with the LR this small the weights barely move, so equal losses would mean the same
    batches), and a resumed run evaluates the batches the uninterrupted run would have."""
    still = ["--lr", "1e-9", "--min-lr", "0", "--eval-interval", "2", "--eval-iters", "1", "--split", "60,40,0"]
    train.main(flags(corpus, tmp_path / "straight", 6, still))
    straight = validation_losses(capsys.readouterr().out)
    assert len(straight) == 3 and len(set(straight)) == 3, straight
    train.main(flags(corpus, tmp_path / "split", 4, still + ["--save-interval", "2"]))
    # back to iteration 2 in the same --save (which holds 4): the user says so
    train.main(flags(corpus, tmp_path / "split", 6, still + ["--load", str(tmp_path / "split" / "ckpt" / "iter_0000002"),
                                                          "--overwrite-checkpoints"]))
    split = validation_losses(capsys.readouterr().out)
    assert split[0] == straight[0] and split[-1] == straight[-1], (split, straight)


def test_wall_clock_breakdown_logs_each_phase(corpus, tmp_path, capsys):
    """DeepSpeed's wall_clock_breakdown: a per-phase line at every log line, nested
    phases no longer than what holds them, and TensorBoard scalars."""
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"wall_clock_breakdown": True}))
    train.main(flags(corpus, tmp_path, 4, ["--deepspeed_config", str(ds)]))
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith(" time (ms) |")]
    assert len(lines) == 2
    for line in lines:
        ms = {k.strip(): float(v) for k, v in (part.split(":") for part in line.split("|")[1:])}
        assert set(ms) == {"forward", "backward", "backward_inner", "backward_allreduce", "step"}
        assert ms["forward"] > 0 and ms["step"] > 0
        assert ms["backward_inner"] + ms["backward_allreduce"] <= ms["backward"]
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert {"time/forward", "time/backward", "time/step"} <= set(events.Tags()["scalars"])
