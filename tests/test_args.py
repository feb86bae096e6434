"""Command-line parsing: Megatron flags, YAML, DeepSpeed JSON, and bad input."""
import json

import pytest

from training.args import parse_args, resolve_batch
from zeropp.config import ConfigError

REQUIRED = ["--train-iters", "10", "--lr", "1e-4", "--data-path", "corpus_text_document"]

# The 18B tutorial's command line, verbatim (REFERENCE.md section 3).
TUTORIAL_18B = ("--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --num-layers 40 "
                "--hidden-size 6144 --seq-length 512 --num-attention-heads 32 --batch-size 1 "
                "--zero-stage 3 --deepspeed_config configs/ds_zeropp_config.json "
                "--deepspeed-activation-checkpointing --fp16 --checkpoint-activations").split()


def test_18b_tutorial_command_line():
    args = parse_args(TUTORIAL_18B + REQUIRED)
    zero = args.ds_config.zero_optimization
    assert (args.num_layers, args.hidden_size, args.num_attention_heads) == (40, 6144, 32)
    assert args.seq_length == args.max_position_embeddings == 512
    assert args.micro_batch_size == 1
    assert args.checkpoint_activations and args.fp16 and args.ds_config.fp16.enabled
    assert zero.stage == 3 and zero.reduce_bucket_size == 10_000_000
    assert zero.zero_hpz_partition_size == 16
    assert zero.zero_quantized_weights and zero.zero_quantized_gradients


def test_yaml_values_and_flag_override(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("num-layers: 3\nhidden_size: 64\nnum-attention-heads: 4\nlr: 3.0e-4\n"
                   "train-iters: 7\ndata-path: [a, b]\nsplit: '90,10,0'\n")
    args = parse_args(["--config", str(cfg), "--num-layers", "5", "--data-path", "x"])
    assert args.num_layers == 5          # the flag wins
    assert args.hidden_size == 64 and args.lr == 3e-4 and args.train_iters == 7
    assert args.data_path == ["x"] and args.split == "90,10,0"


def test_flag_wins_over_json_and_conflict_is_reported(tmp_path):
    ds = tmp_path / "ds.config"  # the tutorial's extension works too
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2, "reduce_bucket_size": "5e8"},
                              "train_micro_batch_size_per_gpu": 4}))
    with pytest.warns(UserWarning, match="--zero-stage 3 conflicts with zero_optimization.stage=2"):
        args = parse_args(REQUIRED + ["--deepspeed_config", str(ds), "--zero-stage", "3"])
    assert args.ds_config.zero_optimization.stage == 3
    assert args.ds_config.zero_optimization.reduce_bucket_size == 500_000_000
    assert args.micro_batch_size == 4    # taken from the JSON when no flag says otherwise


def test_global_batch_gives_accumulation():
    args = parse_args(REQUIRED + ["--micro-batch-size", "2", "--global-batch-size", "16"])
    resolve_batch(args, data_parallel_size=4)
    assert args.gradient_accumulation_steps == 2
    args = parse_args(REQUIRED + ["--micro-batch-size", "2", "--global-batch-size", "12"])
    with pytest.raises(ConfigError, match="--global-batch-size 12 must be a multiple"):
        resolve_batch(args, data_parallel_size=4)


def test_unknown_flag_is_an_error(capsys):
    with pytest.raises(SystemExit):
        parse_args(REQUIRED + ["--num-layer", "4"])
    assert "--num-layer" in capsys.readouterr().err


def test_unknown_yaml_key_names_it(tmp_path, capsys):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("hiden-size: 64\n")
    with pytest.raises(SystemExit):
        parse_args(REQUIRED + ["--config", str(cfg)])
    err = capsys.readouterr().err
    assert "hiden-size" in err and "hidden-size" in err


@pytest.mark.parametrize("flags, message", [
    (["--tensor-model-parallel-size", "2"], "--tensor-model-parallel-size 2 is not supported"),
    (["--pipeline-model-parallel-size", "4"], "--pipeline-model-parallel-size 4 is not supported"),
    (["--hidden-size", "100", "--num-attention-heads", "12"], "--num-attention-heads 12 must divide"),
    (["--fp16", "--bf16"], "pick one"),
    (["--recompute-granularity", "selective"], "selective is not supported"),
    (["--seq-length", "2048", "--max-position-embeddings", "1024"], "exceeds --max-position-embeddings"),
])
def test_unsupported_values_fail_early(flags, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(REQUIRED + flags)


def test_missing_required_flag():
    with pytest.raises(ConfigError, match="--data-path is required"):
        parse_args(["--train-iters", "10", "--lr", "1e-4"])


def test_missing_deepspeed_config_file():
    with pytest.raises(ConfigError, match="no such file nope.json"):
        parse_args(REQUIRED + ["--deepspeed_config", "nope.json"])
