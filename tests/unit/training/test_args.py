"""Command-line parsing: Megatron flags, YAML, DeepSpeed JSON, and bad input."""
import functools
import json
import re
import warnings

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


def test_flag_wins_over_json_and_conflict_is_reported(tmp_path, capsys):
    ds = tmp_path / "ds.config"  # the tutorial's extension works too
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2, "reduce_bucket_size": "5e8"},
                              "train_micro_batch_size_per_gpu": 4}))
    args = parse_args(REQUIRED + ["--deepspeed_config", str(ds), "--zero-stage", "3"])
    assert "> note: --zero-stage 3 conflicts with zero_optimization.stage=2" in capsys.readouterr().out
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


def test_unknown_flag_is_an_error():
    with pytest.raises(ConfigError, match="unrecognized arguments: --num-layer 4; did you mean --num-layers"):
        parse_args(REQUIRED + ["--num-layer", "4"])


def test_unknown_yaml_key_names_it(tmp_path):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("hiden-size: 64\n")
    with pytest.raises(ConfigError, match="unknown key 'hiden-size'; did you mean 'hidden-size'"):
        parse_args(REQUIRED + ["--config", str(cfg)])


@pytest.mark.parametrize("flags, message", [
    (["--tensor-model-parallel-size", "2"], "--tensor-model-parallel-size 2 is not supported"),
    (["--pipeline-model-parallel-size", "4"], "--pipeline-model-parallel-size 4 is not supported"),
    (["--hidden-size", "100", "--num-attention-heads", "12"], "--num-attention-heads 12 must divide"),
    (["--fp16", "--bf16"], "pick one"),
    (["--recompute-granularity", "selective", "--checkpoint-activations"], "pick one"),
    (["--recompute-method", "block"], "--recompute-method block and --recompute-num-layers above 1 are not"),
    (["--recompute-num-layers", "4"], "--recompute-num-layers above 1 are not supported"),
    (["--seq-length", "2048", "--max-position-embeddings", "1024"], "exceeds --max-position-embeddings"),
])
def test_unsupported_values_fail_early(flags, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(REQUIRED + flags)


def test_missing_required_flag():
    with pytest.raises(ConfigError, match="--data-path is required"):
        parse_args(["--train-iters", "10", "--lr", "1e-4"])
    with pytest.raises(ConfigError, match="--train-iters \\(or --train-samples\\) is required"):
        parse_args(["--lr", "1e-4", "--data-path", "x"])
    args = parse_args(["--lr", "1e-4", "--dry-run"])   # the planner needs neither
    assert args.dry_run and args.data_path is None and args.train_iters is None


def test_missing_deepspeed_config_file():
    with pytest.raises(ConfigError, match="no such file nope.json"):
        parse_args(REQUIRED + ["--deepspeed_config", "nope.json"])


def write_ds(tmp_path, config: dict) -> str:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    return str(path)


ADAM = {"type": "Adam", "params": {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0}}
SGD = {"type": "SGD", "params": {"lr": 1e-4, "momentum": 0.9}}
Z3 = {"stage": 3}
# Every flag that has a DeepSpeed JSON twin: flags, JSON, the warning, and where the flag's value lands
# (loss-scaling flags with fp16 enabled in the JSON: without fp16 they are refused).
CONFLICTS = [
    (["--zero-stage", "2"], {"zero_optimization": {"stage": 1}},
     "--zero-stage 2 conflicts with zero_optimization.stage=1", "ds_config.zero_optimization.stage", 2),
    (["--zero-hpz-size", "2"], {"zero_optimization": {**Z3, "zero_hpz_partition_size": 4}},
     "--zero-hpz-size 2 conflicts with zero_optimization.zero_hpz_partition_size=4",
     "ds_config.zero_optimization.zero_hpz_partition_size", 2),
    (["--zero-quantized-weights"], {"zero_optimization": {**Z3, "zero_quantized_weights": False}},
     "--zero-quantized-weights True conflicts", "ds_config.zero_optimization.zero_quantized_weights", True),
    (["--zero-quantized-gradients"], {"zero_optimization": {**Z3, "zero_quantized_gradients": False}},
     "--zero-quantized-gradients True conflicts", "ds_config.zero_optimization.zero_quantized_gradients", True),
    (["--zero-reduce-bucket-size", "1e6"], {"zero_optimization": {"reduce_bucket_size": 2e6}},
     "--zero-reduce-bucket-size 1000000 conflicts with zero_optimization.reduce_bucket_size=2000000",
     "ds_config.zero_optimization.reduce_bucket_size", 1_000_000),
    (["--fp16"], {"fp16": {"enabled": False}}, "--fp16 True conflicts with fp16.enabled=False", "fp16", True),
    (["--bf16"], {"bf16": {"enabled": False}}, "--bf16 True conflicts with bf16.enabled=False", "bf16", True),
    (["--loss-scale", "128"], {"fp16": {"enabled": True, "loss_scale": 0}}, "--loss-scale 128.0 conflicts with fp16.loss_scale=0.0",
     "ds_config.fp16.loss_scale", 128),
    (["--initial-loss-scale", "1024"], {"fp16": {"enabled": True, "initial_scale_power": 16}},
     "--initial-loss-scale 1024.0 conflicts with fp16.initial_scale_power=16",
     "ds_config.fp16.initial_scale_power", 10),
    (["--min-loss-scale", "2"], {"fp16": {"enabled": True, "min_loss_scale": 1}}, "--min-loss-scale 2.0 conflicts",
     "ds_config.fp16.min_loss_scale", 2),
    (["--loss-scale-window", "500"], {"fp16": {"enabled": True, "loss_scale_window": 1000}}, "--loss-scale-window 500 conflicts",
     "ds_config.fp16.loss_scale_window", 500),
    (["--hysteresis", "4"], {"fp16": {"enabled": True, "hysteresis": 2}}, "--hysteresis 4 conflicts with fp16.hysteresis=2",
     "ds_config.fp16.hysteresis", 4),
    (["--clip-grad", "0.5"], {"gradient_clipping": 1.0}, "--clip-grad 0.5 conflicts with gradient_clipping=1.0",
     "ds_config.gradient_clipping", 0.5),
    (["--micro-batch-size", "2"], {"train_micro_batch_size_per_gpu": 4},
     "--micro-batch-size 2 conflicts with train_micro_batch_size_per_gpu=4", "micro_batch_size", 2),
    (["--global-batch-size", "64"], {"train_batch_size": 32},
     "--global-batch-size 64 conflicts with train_batch_size=32", "global_batch_size", 64),
    (["--log-interval", "5"], {"steps_per_print": 10}, "--log-interval 5 conflicts with steps_per_print=10",
     "ds_config.steps_per_print", 5),
    (["--lr", "3e-4"], {"optimizer": ADAM}, "--lr 0.0003 conflicts with optimizer.params.lr=0.0001",
     "optimizer_settings.lr", 3e-4),
    (["--weight-decay", "0.1"], {"optimizer": ADAM},
     "--weight-decay 0.1 conflicts with optimizer.params.weight_decay=0.0",
     "optimizer_settings.weight_decay", 0.1),
    (["--adam-eps", "1e-6"], {"optimizer": ADAM}, "--adam-eps 1e-06 conflicts with optimizer.params.eps=1e-08",
     "optimizer_settings.eps", 1e-6),
    (["--adam-beta1", "0.8"], {"optimizer": ADAM},
     r"--adam-beta1 0.8 conflicts with optimizer.params.betas\[0\]=0.9", "optimizer_settings.betas", (0.8, 0.95)),
    (["--adam-beta2", "0.99"], {"optimizer": ADAM},
     r"--adam-beta2 0.99 conflicts with optimizer.params.betas\[1\]=0.95", "optimizer_settings.betas", (0.9, 0.99)),
    (["--sgd-momentum", "0.5"], {"optimizer": SGD},
     "--sgd-momentum 0.5 conflicts with optimizer.params.momentum=0.9", "optimizer_settings.momentum", 0.5),
    (["--optimizer", "sgd"], {"optimizer": {"type": "Adam"}},
     r"--optimizer sgd \(sgd\) conflicts with optimizer.type=Adam \(adamw\)", "optimizer_settings.type", "sgd"),
]


@pytest.mark.parametrize("flags, config, message, where, value", CONFLICTS, ids=[c[0][0] for c in CONFLICTS])
def test_every_flag_json_conflict_notes_and_the_flag_wins(tmp_path, capsys, flags, config, message, where, value):
    args = parse_args(REQUIRED + ["--deepspeed_config", write_ds(tmp_path, config)] + flags)
    assert re.search("> note: " + message, capsys.readouterr().out)
    assert functools.reduce(getattr, where.split("."), args) == value


def test_yaml_against_json_conflict_notes(tmp_path, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("micro-batch-size: 2\nfp16: false\n")
    ds = write_ds(tmp_path, {"train_micro_batch_size_per_gpu": 4, "fp16": {"enabled": True}})
    args = parse_args(REQUIRED + ["--config", str(cfg), "--deepspeed_config", ds])
    messages = capsys.readouterr().out
    assert "--micro-batch-size 2 conflicts" in messages and "--fp16 False conflicts" in messages
    assert args.micro_batch_size == 2 and not args.fp16 and not args.ds_config.fp16.enabled


def test_agreeing_flags_and_json_are_quiet(tmp_path, capsys):
    ds = write_ds(tmp_path, {"optimizer": ADAM, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 7})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        args = parse_args(REQUIRED + ["--deepspeed_config", ds, "--micro-batch-size", "2", "--adam-beta2", "0.95"])
    assert "note" not in capsys.readouterr().out
    assert args.log_interval == 7          # steps_per_print is --log-interval's default


def test_log_interval_defaults():
    assert parse_args(REQUIRED).log_interval == 100
    assert parse_args(REQUIRED + ["--log-interval", "3"]).ds_config.steps_per_print == 3


@pytest.mark.parametrize("flags, config, expected", [
    (["--optimizer", "adam"], None, dict(type="adamw", lr=1e-4, betas=(0.9, 0.999), weight_decay=0.01)),
    (["--optimizer", "adamw", "--adam-beta2", "0.95"], None, dict(type="adamw", betas=(0.9, 0.95))),
    (["--optimizer", "sgd"], None, dict(type="sgd", momentum=0.9)),          # Megatron's --sgd-momentum
    ([], {"type": "Adam", "params": {"adam_w_mode": False}}, dict(type="adam", weight_decay=0.0, lr=1e-4)),
    ([], {"type": "SGD", "params": {"lr": 1e-4}}, dict(type="sgd", momentum=0.0, weight_decay=0.0)),
    (["--weight-decay", "0.1"], {"type": "AdamW"}, dict(type="adamw", weight_decay=0.1)),
])
def test_optimizer_settings(tmp_path, flags, config, expected):
    extra = ["--deepspeed_config", write_ds(tmp_path, {"optimizer": config})] if config else []
    settings = parse_args(REQUIRED + flags + extra).optimizer_settings
    for name, value in expected.items():
        assert getattr(settings, name) == value, name


def test_json_optimizer_gives_lr_and_refuses_lamb(tmp_path):
    args = parse_args(["--train-iters", "10", "--data-path", "x", "--deepspeed_config",
                       write_ds(tmp_path, {"optimizer": {"type": "AdamW", "params": {"lr": 6e-4}}})])
    assert args.lr == args.optimizer_settings.lr == 6e-4
    with pytest.raises(ConfigError, match="optimizer.type 'Lamb' is not supported"):
        parse_args(REQUIRED + ["--deepspeed_config", write_ds(tmp_path, {"optimizer": {"type": "Lamb"}})])


@pytest.mark.parametrize("flags, config, world, expected", [
    (["--micro-batch-size", "2", "--global-batch-size", "16"], {}, 4, (2, 16, 2)),
    ([], {"train_batch_size": 32}, 4, (8, 32, 1)),                                 # accumulation 1
    ([], {"train_batch_size": 32, "gradient_accumulation_steps": 2}, 4, (4, 32, 2)),
    (["--micro-batch-size", "2"], {"gradient_accumulation_steps": 3}, 4, (2, 24, 3)),
    (["--micro-batch-size", "2"], {}, 4, (2, 8, 1)),
    ([], {}, 4, (1, 4, 1)),                                                         # micro batch 1
    ([], {"gradient_accumulation_steps": 2}, 4, (1, 8, 2)),
    ([], {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2}, 4,
     (2, 16, 2)),
])
def test_batch_arithmetic(tmp_path, flags, config, world, expected):
    args = parse_args(REQUIRED + flags + ["--deepspeed_config", write_ds(tmp_path, config)])
    resolve_batch(args, data_parallel_size=world)
    assert (args.micro_batch_size, args.global_batch_size, args.gradient_accumulation_steps) == expected
    ds = args.ds_config
    assert (ds.train_micro_batch_size_per_gpu, ds.train_batch_size, ds.gradient_accumulation_steps) == expected


@pytest.mark.parametrize("flags, config, message", [
    (["--micro-batch-size", "2", "--global-batch-size", "16"], {"gradient_accumulation_steps": 4},
     "--global-batch-size 16 != --micro-batch-size 2 x gradient_accumulation_steps 4 x data-parallel size 4 = 32"),
    ([], {"train_batch_size": 30}, "train_batch_size 30 must be a multiple of gradient_accumulation_steps 1 x"),
    ([], {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 4}, "train_batch_size 8 must be a multiple of "
                                                                       "train_micro_batch_size_per_gpu 4"),
])
def test_batch_arithmetic_errors(tmp_path, flags, config, message):
    args = parse_args(REQUIRED + flags + ["--deepspeed_config", write_ds(tmp_path, config)])
    with pytest.raises(ConfigError, match=message):
        resolve_batch(args, data_parallel_size=4)


@pytest.mark.parametrize("flags, message", [
    (["--optimizer", "sgd", "--adam-beta2", "0.95"], "--adam-beta2 has no effect with optimizer sgd"),
    (["--sgd-momentum", "0.8"], "--sgd-momentum has no effect with optimizer adamw"),
])
def test_flags_of_the_other_optimizer_are_refused(flags, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(REQUIRED + flags)


@pytest.mark.parametrize("precision", [[], ["--bf16"]])
@pytest.mark.parametrize("extra", [["--loss-scale", "128"], ["--hysteresis", "4"], ["--initial-loss-scale", "1024"],
                                   ["--min-loss-scale", "2", "--loss-scale-window", "100"]])
def test_fp16_only_flags_without_fp16_are_refused(precision, extra):
    with pytest.raises(ConfigError, match=r"act\(s\) on fp16 loss scaling only, and this run is "
                                          + ("bf16" if precision else "fp32")) as error:
        parse_args(REQUIRED + precision + extra)
    assert extra[0] in str(error.value) and "\n" not in str(error.value)
    parse_args(REQUIRED + ["--fp16"] + extra)   # with --fp16 they act


def test_every_flag_has_help_and_help_shows_defaults(capsys):
    from training.flags import build_parser
    from training.megatron_compat import Refused
    parser = build_parser()
    bare = [a.option_strings[0] for a in parser._actions
            if a.option_strings and not isinstance(a, Refused) and not (a.help or "").strip()]
    assert not bare, f"flags without help: {bare}"
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    shown = " ".join(capsys.readouterr().out.split())
    assert "--num-layers NUM_LAYERS transformer blocks (default: 12)" in shown
    assert "--lr-decay-style {constant,linear,cosine} shape of the decay after warmup (default: linear)" in shown
    assert "--DDP-impl {local,torch} no effect here" in shown


def test_an_empty_value_unsets_what_the_yaml_set(tmp_path):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("tokenizer-model: sp.model\nmicro-batch-size: 2\nnum-layers: 3\n")
    ds = write_ds(tmp_path, {"train_micro_batch_size_per_gpu": 4})
    args = parse_args(REQUIRED + ["--config", str(cfg), "--tokenizer-model", "", "--micro-batch-size=",
                                  "--num-layers", "", "--deepspeed_config", ds])
    assert args.tokenizer_model is None and args.num_layers == 12   # the flags' defaults
    assert args.micro_batch_size == 4                                # unset: the JSON's, as if never given
    assert parse_args(REQUIRED + ["--config", str(cfg)]).tokenizer_model == "sp.model"


def test_fp16_on_cpu_says_it_is_slow(capsys, monkeypatch):
    import torch
    from common import forget_notes
    forget_notes()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    parse_args(REQUIRED + ["--fp16"])
    assert capsys.readouterr().out.count("> note: --fp16 on CPU is slower than fp32") == 1
    parse_args(REQUIRED + ["--bf16"])
    assert "--fp16" not in capsys.readouterr().out


def test_the_outer_mode_is_typed_at_the_edge(monkeypatch):
    """parse_args makes the outer mode's GroupsJob from the flags; the wiring reads it, not args."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    args = parse_args(["--zero-stage", "3", "--outer-sync-interval", "8", "--outer-lr", "0.5", "--outer-fragments", "2",
                       "--outer-quantization", "int4", "--outer-sync-delay", "2", "--outer-warmup-iters", "3",
                       "--clip-grad", "0.5", *REQUIRED])
    job, s = args.groups, args.groups.settings
    assert (s.interval, s.lr, s.fragments, s.quantization, s.delay, s.warmup) == (8, 0.5, 2, "int4", 2, 3)
    assert not s.asynchronous and not job.fault_tolerant
    assert (job.group_size, job.train_iters, job.clip_grad) == (1, 10, 0.5)
    assert parse_args(REQUIRED).groups is None
