"""Careless inputs that used to pass the checks and fail later (a traceback, a wrong exit status,
a switch that does nothing): numbers that are not finite, block sizes the wire cannot carry, JSON
sections whose prerequisite a flag turns on, switches with no effect, paths, generate.py and the
exporter. Each is one line `error: ...` and exit status 2 before any work, or now works.

Most go through train.run(argv) in this process (what `python train.py` exits with); the tools
through their own main(argv); a few through the real command."""
import errno
import json
import os
import subprocess
import sys

import pytest
import torch

import generate
import train
from common import ConfigError
from planner.auto import choose, resolve
from parallel.comm import Communicator
from parallel.topology import Topology
from tests.distributed import run_distributed
from tests.integration.inputs.test_cli_errors import corpus, fails, good  # noqa: F401 - corpus is a fixture
from tests.unit.zeropp.test_zeropp import gpt, make_engine, tokens
from tests.unit.zeropp.test_zeropp_auto import AUTO_ZERO, TINY, pick, synthetic
from tools import export_checkpoint
from training.logger import TrainingLogger
from zeropp.kernels.format import Quantized, wire_nbytes

ROOT = os.path.dirname(os.path.abspath(train.__file__))


def json_file(tmp_path, config: dict) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    return str(path)


def stage3(**zero):
    return {"zero_optimization": {"stage": 3, **zero}}


# -- numbers ----------------------------------------------------------------------------------
@pytest.mark.parametrize("flag, value", [("--zero-hpz-size", "inf"), ("--zero-hpz-size", "1e400"),
                                         ("--train-iters", "nan"), ("--global-batch-size", "1e999")])
def test_flag_not_finite(corpus, capsys, flag, value):
    fails(good(corpus, flag, value), capsys, flag)


@pytest.mark.parametrize("text", ["zero-hpz-size: .inf\n", "train-iters: .nan\n", "seed: 1.0e400\n"])
def test_yaml_not_finite(corpus, tmp_path, capsys, text):
    (tmp_path / "run.yaml").write_text(text)
    fails(good(corpus, "--config", str(tmp_path / "run.yaml")), capsys, text.split(":")[0], "run.yaml")


@pytest.mark.parametrize("text, key", [
    ('{"zero_optimization": {"stage": 3, "zero_quantized_gradients": true, "zeropp_loco_param": '
     '{"reset_T": Infinity}}}', "reset_T"),
    ('{"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2, "zero_quantized_weight_deltas": true, '
     '"zero_quantized_weight_deltas_refresh_interval": NaN}}', "refresh_interval"),
    ('{"gradient_clipping": NaN}', "gradient_clipping"),
    ('{"train_batch_size": 1e400}', "train_batch_size"),
    ('{"optimizer": {"type": "AdamW", "params": {"lr": -Infinity}}}', "lr"),
])
def test_json_not_finite(corpus, tmp_path, capsys, text, key):
    (tmp_path / "ds.json").write_text(text)
    fails(good(corpus, "--deepspeed_config", str(tmp_path / "ds.json")), capsys, key, "finite")


@pytest.mark.slow
def test_not_finite_through_the_real_command(corpus):
    proc = subprocess.run([sys.executable, "train.py", *good(corpus, "--zero-hpz-size", "inf")],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines() == ["error: argument --zero-hpz-size: expected a whole number, got 'inf'"]


# -- JSON sections checked after the flags are merged -----------------------------------------
@pytest.mark.parametrize("zero, flag", [
    ({"zeropp_loco_param": {"err_beta": 0.5}}, "--zero-quantized-gradients"),
    ({"zero_hadamard_gradients": True}, "--zero-quantized-gradients"),
])
def test_json_option_whose_prerequisite_is_a_flag(corpus, tmp_path, zero, flag):
    from training.args import parse_args
    args = parse_args(good(corpus, "--deepspeed_config", json_file(tmp_path, stage3(**zero)), flag))
    assert args.ds_config.zero_optimization.zero_quantized_gradients is True


def test_json_deltas_with_hpz_from_the_flag(corpus, tmp_path, monkeypatch):
    from training.args import parse_args
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    config = stage3(zero_quantized_weight_deltas=True, zero_quantized_weight_deltas_refresh_interval=10)
    args = parse_args(good(corpus, "--deepspeed_config", json_file(tmp_path, config), "--zero-hpz-size", "2"))
    assert args.ds_config.zero_optimization.zero_quantized_weight_deltas_refresh_interval == 10


def test_json_still_refused_when_no_flag_helps(corpus, tmp_path, capsys):
    fails(good(corpus, "--deepspeed_config", json_file(tmp_path, stage3(zeropp_loco_param={}))), capsys,
          "zeropp_loco_param", "set zero_quantized_gradients true", "ds.json")


# -- block sizes: what the wire can carry -----------------------------------------------------
def unaligned(bits: int, block_size: int) -> bool:
    """Whether the second row of a two-row wire buffer (qwZ's gather, qgZ's hops) misplaces its
    fp32 scales for some tensor size: what the config's minimum block sizes rule out."""
    for numel in range(1, 4 * block_size):
        buf = torch.zeros(2, wire_nbytes(numel, bits, block_size), dtype=torch.uint8)
        try:
            Quantized.from_bytes(buf[1], numel, bits, block_size)
        except RuntimeError:
            return True
    return False


@pytest.mark.parametrize("key, bits, value", [("zero_quantized_weights_block_size", 8, 2),
                                              ("zero_quantized_gradients_block_size", 4, 2),
                                              ("zero_quantized_gradients_block_size", 4, 4),
                                              ("zero_quantized_gradients_block_size", 4, 24)])
def test_block_size_refused(corpus, tmp_path, capsys, key, bits, value):
    switch = "zero_quantized_weights" if bits == 8 else "zero_quantized_gradients"
    config = stage3(**{switch: True, key: value})
    line = fails(good(corpus, "--deepspeed_config", json_file(tmp_path, config)), capsys, key, f"got {value}")
    assert "power of two >= " + ("4" if bits == 8 else "8") in line
    assert value & (value - 1) or unaligned(bits, value)   # the refused size does break the wire


def train_steps(rank, world_size, zero):
    engine = make_engine(gpt(vocab_size=97, hidden_size=36, num_attention_heads=4), world_size, zero=zero)
    losses = []
    for step in range(2):
        x = tokens(rank, step)
        loss = engine(x[:, :-1], x[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


@pytest.mark.slow
def test_smallest_block_sizes_run():
    """The smallest accepted sizes on 4 ranks as 2 nodes x 2, with odd tensor sizes (vocabulary 97,
    hidden 36) so that rows end mid-way through words: every switch that quantizes."""
    assert not unaligned(8, 4) and not unaligned(4, 8)
    zero = {"zero_quantized_weights": True, "zero_quantized_weights_block_size": 4, "zero_hpz_partition_size": 2,
            "zero_quantized_gradients": True, "zero_quantized_gradients_block_size": 8,
            "zero_hadamard_gradients": True, "zeropp_loco_param": {}, "zero_quantized_weight_deltas": True}
    results = run_distributed(train_steps, 4, (zero,))
    assert all(torch.isfinite(torch.tensor(r)).all() for r in results)


# -- switches that would do nothing -----------------------------------------------------------
@pytest.mark.parametrize("env, extra, names", [
    ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"},
     ["--zero-hpz-size", "4", "--zero-quantized-weight-deltas"], ["does nothing here", "whole world of 4"]),
    ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"},
     ["--zeropp", "auto", "--zero-quantized-weight-deltas"], ["does nothing here", "(4 ranks, auto)"]),
])
def test_deltas_without_a_node_to_cross(corpus, capsys, monkeypatch, env, extra, names):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    fails(good(corpus, "--zero-stage", "3", *extra), capsys, "zero_quantized_weight_deltas", *names)


def test_refresh_interval_without_deltas(corpus, tmp_path, capsys):
    config = stage3(zero_quantized_weight_deltas_refresh_interval=10)
    fails(good(corpus, "--deepspeed_config", json_file(tmp_path, config)), capsys,
          "refresh_interval has no effect without zero_quantized_weight_deltas")


def test_auto_with_deltas_keeps_hpz_on_a_fast_link():
    """A fast link makes hpZ not worth it, but the deltas need it: auto only weighs candidates
    with hpZ, and so never starts a run that fails at the engine's check."""
    chosen, predicted, lines = pick({**AUTO_ZERO, "stage3_max_reuse_distance": 0,
                                     "zero_quantized_weight_deltas": True}, synthetic(400, 2, 20))
    assert chosen.zero_hpz_partition_size == 2, lines
    assert len(predicted) == 4 and all("hpZ 2" in name for name in predicted), predicted
    chosen.validate_topology(2, 4)


def test_auto_with_deltas_at_world_size_1_is_one_line():
    comm = Communicator(Topology(world_size=1, rank=0, ranks_per_node=1))
    config = {"zero_optimization": {**AUTO_ZERO, "zero_quantized_weight_deltas": True}}
    from model import GPTConfig
    with pytest.raises(ConfigError, match=r"needs hpZ across nodes, and --zeropp auto turns hpZ off here "
                                          r"\(world size 1"):
        resolve(config, GPTConfig(**TINY), comm, torch.device("cpu"), 2, 16)


def test_auto_candidates_all_pass_the_config_checks():
    from planner.auto import candidates
    import zeropp
    ds = zeropp.DeepSpeedConfig.from_dict({"zero_optimization": {**AUTO_ZERO, "zero_quantized_weight_deltas": True}})
    for c in candidates(ds.zero_optimization, 2, 4):
        c.validate()
        c.validate_topology(2, 4)
    with pytest.raises(ConfigError, match="--zeropp auto: no choice of qwZ, hpZ, qgZ works"):
        candidates(ds.zero_optimization, 4, 4)   # one node


def test_junk_quant_backend_at_world_size_1(corpus, capsys, monkeypatch):
    monkeypatch.setenv("ZEROPP_QUANT_BACKEND", "fast")
    fails(good(corpus), capsys, "ZEROPP_QUANT_BACKEND='fast'", "use torch, cpu or triton")


def test_triton_backend_without_a_gpu(corpus, capsys, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    monkeypatch.setenv("ZEROPP_QUANT_BACKEND", "triton")
    fails(good(corpus), capsys, "ZEROPP_QUANT_BACKEND=triton needs CUDA GPUs")


# -- paths ------------------------------------------------------------------------------------
def test_tensorboard_dir_is_a_file(corpus, tmp_path, capsys):
    (tmp_path / "tb").write_text("x")
    fails(good(corpus, "--tensorboard-dir", str(tmp_path / "tb")), capsys, "--tensorboard-dir", "is a file")


def test_tensorboard_dir_cannot_be_made(corpus, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    fails(good(corpus, "--tensorboard-dir", str(tmp_path / "file" / "tb")), capsys, "--tensorboard-dir",
          "is not writable")


def fail_tensorboard_writes(monkeypatch):
    """The disk under --tensorboard-dir fills up: every event write fails, in the writer's thread."""
    from tensorboard.summary.writer import record_writer

    def full(self, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(record_writer.RecordWriter, "write", full)


def test_tensorboard_failure_keeps_training_and_saving(corpus, tmp_path, capsys, monkeypatch):
    fail_tensorboard_writes(monkeypatch)
    argv = good(corpus, "--tensorboard-dir", str(tmp_path / "tb"), "--save", str(tmp_path / "ckpt"),
                "--train-iters", "4", "--log-interval", "1", "--save-interval", "2")
    assert train.run(argv) == 0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and "Exception in thread" not in captured.err, captured.err
    warnings = [line for line in captured.err.splitlines() if "TensorBoard stopped" in line]
    assert len(warnings) == 1 and "No space left on device" in warnings[0], captured.err
    assert captured.out.count("lm loss:") == 4
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["iter_0000002", "iter_0000004",
                                                     "latest_checkpointed_iteration.txt"]


def test_tensorboard_logger_gives_up_once(tmp_path, capsys, monkeypatch):
    logger = TrainingLogger(str(tmp_path / "tb"))
    logger.scalars(1, {"a": 1.0})
    fail_tensorboard_writes(monkeypatch)
    for it in range(2, 5):
        logger.scalars(it, {"a": float(it)})
    logger.close()
    err = capsys.readouterr().err
    assert logger.writer is None and err.count("TensorBoard stopped") == 1, err
    assert "Exception in thread" not in err, err


@pytest.fixture(scope="module")
def checkpoint(corpus):  # noqa: F811
    """A run of 2 iterations saved at 1 and 2, trained in the corpus directory with a relative
    tokenizer path and a relative --save (as the README's quick start does from the repository)."""
    argv = [a if not a.endswith("sp.model") else "sp.model" for a in good(corpus)]
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *argv, "--save", "careless/ckpt",
                           "--save-interval", "1"], cwd=str(corpus), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return corpus / "careless" / "ckpt"


def exits(main, argv, capsys, *names):
    """`main(argv)` exits 2 (a return value or SystemExit) with one `error: ...` line naming `names`."""
    try:
        status = main(argv)
    except SystemExit as e:
        status = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(err) == 1 and err[0].startswith("error: "), (status, err)
    for name in names:
        assert name in err[0], (name, err[0])
    return err[0]


@pytest.mark.parametrize("fmt, make, names", [
    ("torch", lambda t: t.mkdir() or t, ["is a directory", "--format torch writes one file"]),
    ("torch", lambda t: t / "missing" / "model.pt", ["does not exist"]),
    ("hf", lambda t: (t.write_text("x"), t)[1], ["is a file", "--format hf writes a directory"]),
])
@pytest.mark.slow
def test_export_output(checkpoint, tmp_path, capsys, fmt, make, names):
    output = make(tmp_path / "out")
    exits(export_checkpoint.main, ["--load", str(checkpoint), "--format", fmt, "--output", str(output)], capsys,
          "--output", *names)


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_export_shard_size(checkpoint, tmp_path, capsys, value):
    exits(export_checkpoint.main, ["--load", str(checkpoint), "--format", "hf", "--output", str(tmp_path / "hf"),
                                   "--max-shard-size", value], capsys, "--max-shard-size")


@pytest.mark.parametrize("argv, names", [
    (["--top-k", "-3"], ["--top-k", "must be >= 0"]),
    (["--temperature", "nan"], ["--temperature", "expected a number, got 'nan'"]),
    (["--temperature", "-1"], ["--temperature", "must be >= 0"]),
    (["--max-new-tokens", "-5"], ["--max-new-tokens"]),
    (["--prompt", ""], ["--prompt is empty"]),
    (["--prompt", "   "], ["--prompt is empty"]),
])
def test_generate_arguments(checkpoint, capsys, argv, names):
    exits(generate.main, ["--load", str(checkpoint), *argv], capsys, *names)


def test_load_a_file(corpus, checkpoint, capsys):
    meta = str(checkpoint / "iter_0000002" / "meta.json")
    fails(good(corpus, "--load", meta), capsys, f"--load {meta} is a file")
    exits(generate.main, ["--load", meta], capsys, "is a file")
    exits(export_checkpoint.main, ["--load", meta, "--format", "torch", "--output", "x.pt"], capsys, "is a file")


def test_damaged_checkpoint_exits_2_everywhere(corpus, checkpoint, tmp_path, capsys):
    import shutil
    damaged = tmp_path / "ckpt"
    shutil.copytree(checkpoint, damaged)
    (damaged / "iter_0000002" / "meta.json").write_text("{")
    assert train.run(good(corpus, "--load", str(damaged), "--train-iters", "3")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is damaged" in err[0] and "iter_0000001" in err[0], err   # names the intact one
    exits(generate.main, ["--load", str(damaged)], capsys, "is damaged", "iter_0000001")
    exits(export_checkpoint.main, ["--load", str(damaged), "--format", "torch", "--output",
                                   str(tmp_path / "m.pt")], capsys, "is damaged")


@pytest.mark.slow
def test_generate_from_another_directory(checkpoint, tmp_path):
    """The checkpoint's tokenizer path was relative to where training ran; generate.py runs
    from elsewhere (the real command)."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "generate.py"), "--load", str(checkpoint),
                           "--prompt", "the red cat", "--max-new-tokens", "3"], cwd=str(tmp_path),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("[checkpoint iteration 2]\nthe red cat")


def test_old_checkpoint_with_a_relative_tokenizer(checkpoint, tmp_path):
    """Checkpoints saved before paths were made absolute: the path is found from the directories
    above the checkpoint (the --save directory lay below where training ran)."""
    meta = json.loads((checkpoint / "iter_0000002" / "meta.json").read_text())
    assert os.path.isabs(meta["tokenizer_model"])
    del meta["tokenizer_copies"]   # from before the tokenizer travelled inside the checkpoint
    meta["tokenizer_model"] = "sp.model"
    tok = export_checkpoint.checkpoint_tokenizer(meta, str(checkpoint))
    assert os.path.samefile(tok.model_file, checkpoint.parent.parent / "sp.model")


# -- found by trying more careless inputs (scenarios/cli_errors.py lists them all) -----------------
@pytest.mark.parametrize("make, flag, says", [
    (lambda t: (t.write_text("x"), str(t))[1], "--data-cache-path", "is a file"),
    (lambda t: "/dev/null", "--config", "is not a regular file"),
    (lambda t: "/dev/null", "--deepspeed_config", "is not a regular file"),
])
def test_paths_that_are_not_what_they_should_be(corpus, tmp_path, capsys, make, flag, says):
    fails(good(corpus, flag, make(tmp_path / "f")), capsys, flag, says)


def test_nccl_without_a_gpu(corpus, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    fails(good(corpus, "--distributed-backend", "nccl"), capsys, "--distributed-backend nccl needs CUDA GPUs")


@pytest.mark.parametrize("weight", ["nan", "inf"])
def test_blend_weight_not_finite(corpus, capsys, weight):
    argv = good(corpus)
    i = argv.index("--data-path")
    argv[i + 1:i + 2] = [weight, argv[i + 1], "1", argv[i + 1]]
    fails(argv, capsys, "--data-path weights must be finite")


def test_one_process_says_it_runs_unsharded(corpus, capsys):
    assert train.run(good(corpus, "--zero-stage", "3", "--zero-hpz-size", "2", "--zero-quantized-weight-deltas")) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert "unsharded (one process; ZeRO-3 + ZeRO++ (hpZ, INT4 weight deltas) acts from 2 ranks on)" in first


def test_export_dtype_is_one_line(checkpoint, tmp_path, capsys):
    exits(export_checkpoint.main, ["--load", str(checkpoint), "--format", "torch", "--output", str(tmp_path / "m"),
                                   "--dtype", "fp8"], capsys, "--dtype", "invalid choice")
