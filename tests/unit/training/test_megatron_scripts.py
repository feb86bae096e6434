"""Megatron-LM's and Megatron-DeepSpeed's GPT pretraining command lines, and the DeepSpeed configs
they come with, through parse_args unchanged: each flag list below is written from the script
named (its flags, with the values the script gives them); each either parses, or fails in one run
that names every flag or key this product refuses, each with why."""
import json
import re

import pytest

from common import forget_notes
from training.args import parse_args
from zeropp.config import ConfigError

DATA = "--data-path my-gpt2_text_document --vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt".split()

# DeepSpeedExamples, megatron/Megatron-LM-v1.1.5-ZeRO3/examples/ds_pretrain_gpt2-zero3.sh (the DeepSpeed
# ZeRO-3 tutorial's script; MP_SIZE=1, its DEBUG model), with ds_zero_stage_3_config.json.
V115_ZERO3 = """--model-parallel-size 1 --num-layers 5 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024
--max-position-embeddings 1024 --batch-size 4 --train-iters 320000 --lr-decay-iters 320000
--save checkpoints/gpt2_345m_ds --load checkpoints/gpt2_345m_ds --data-impl mmap --split 949,50,1
--distributed-backend nccl --lr 1.5e-4 --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 1e-2 --clip-grad 1.0
--warmup 0.01 --checkpoint-activations --log-interval 1 --save-interval 10000 --eval-interval 2000 --eval-iters 10
--fp16 --scattered-embeddings --split-transformers --deepspeed --zero-stage 3 --zero-reduce-bucket-size 50000000
--zero-allgather-bucket-size 5000000000 --zero-contigious-gradients --zero-reduce-scatter
--deepspeed-activation-checkpointing --checkpoint-num-layers 1 --partition-activations --checkpoint-in-cpu
--synchronize-each-layer --contigious-checkpointing""".split() + DATA
V115_ZERO3_JSON = {
    "train_batch_size": 64, "gradient_accumulation_steps": 1, "steps_per_print": 1,
    "zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                          "stage3_prefetch_bucket_size": 1e7, "stage3_param_persitence_threshold": 1e5,
                          "reduce_bucket_size": 1e7, "contiguous_gradients": True},
    "gradient_clipping": 1.0,
    "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
    "wall_clock_breakdown": True, "zero_allow_untested_optimizer": False}
# The same folder's ds_zero_stage_2_config.json (ds_pretrain_gpt2-zero2.sh and ds_pretrain_gpt2.sh use it).
V115_ZERO2_JSON = {
    "train_batch_size": 2048, "gradient_accumulation_steps": 1, "steps_per_print": 1,
    "zero_optimization": {"stage": 2, "allgather_partitions": True, "reduce_scatter": True,
                          "allgather_bucket_size": 50000000, "reduce_bucket_size": 50000000, "overlap_comm": True},
    "optimizer": {"type": "Adam", "params": {"lr": 0.00015, "max_grad_norm": 1.0, "betas": [0.9, 0.95]}},
    "gradient_clipping": 1.0,
    "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
    "wall_clock_breakdown": True, "zero_allow_untested_optimizer": False}
# ds_pretrain_gpt2.sh there: model parallel 4, ZeRO stage 0, no CPU checkpointing.
V115_MP4 = [a for a in V115_ZERO3 if a not in ("--checkpoint-in-cpu", "--scattered-embeddings",
                                               "--split-transformers", "--deepspeed-activation-checkpointing")]
V115_MP4 = " ".join(V115_MP4).replace("--model-parallel-size 1", "--model-parallel-size 4").replace(
    "--num-layers 5", "--num-layers 24").replace("--batch-size 4", "--batch-size 9").replace(
    "--zero-stage 3", "--zero-stage 0").replace("--log-interval 1", "--log-interval 100").split() + [
    "--tensorboard-dir", "tensorboard_data/24l_1024h_1n_8g_4mp_9b_ds4"]

# Megatron-DeepSpeed, examples_deepspeed/curriculum_learning/ds_pretrain_gpt2.sh with ds_train.sh's baseline
# values (1558M model, batch 512 over 128 GPUs, MP_SIZE=1, PP_SIZE=1) and ds_zero_stage_1_config_baseline.json.
MDS_GPT2 = """--tensor-model-parallel-size 1 --num-layers 48 --hidden-size 1600 --num-attention-heads 25
--seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 4 --global-batch-size 512 --train-iters 600000
--train-tokens 157286400000 --lr-decay-tokens 157286400000 --save ckpt --load ckpt --data-impl mmap --split 949,50,1
--distributed-backend nccl --override-opt_param-scheduler --lr 1.5e-4 --lr-decay-style cosine --min-lr 1.0e-5
--weight-decay 1e-2 --clip-grad 1.0 --lr-warmup-iters 3000 --checkpoint-activations --log-interval 100
--save-interval 5000 --eval-interval 100 --eval-iters 10 --fp16 --seed 1234 --tensorboard-queue-size 1
--log-timers-to-tensorboard --log-batch-size-to-tensorboard --log-validation-ppl-to-tensorboard
--no-masked-softmax-fusion --tensorboard-dir tb --deepspeed --zero-stage 1 --pipeline-model-parallel-size 1
--deepspeed-activation-checkpointing""".split() + DATA
MDS_GPT2_JSON = {
    "train_batch_size": 512, "gradient_accumulation_steps": 1, "steps_per_print": 1, "zero_optimization": {"stage": 1},
    "optimizer": {"type": "Adam", "params": {"lr": 0.00015, "max_grad_norm": 1.0, "betas": [0.9, 0.95]}},
    "gradient_clipping": 1.0,
    "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
    "wall_clock_breakdown": False, "zero_allow_untested_optimizer": False}

# Megatron-DeepSpeed, examples_deepspeed/rebase/ds_pretrain_gpt_125M.sh (mp_size=2, pp_size=2 as shipped) and its
# ds_config_gpt_TEMPLATE.json filled in as the script fills it.
MDS_125M = """--override-opt_param-scheduler --adam-beta1 0.9 --adam-beta2 0.95 --tensor-model-parallel-size 2
--init-method-std 0.02 --lr-decay-tokens 300000000000 --lr-warmup-tokens 3000000000 --micro-batch-size 2
--exit-duration-in-mins 30000000 --global-batch-size 256 --num-layers 12 --hidden-size 768 --num-attention-heads 12
--seq-length 2048 --max-position-embeddings 2048 --train-tokens 300000000000 --train-samples 292968750 --lr 6.0e-4
--min-lr 1.0e-6 --lr-decay-style cosine --split 949,50,1 --log-interval 10 --eval-interval 100 --eval-iters 10
--save-interval 100 --weight-decay 0.1 --clip-grad 1.0 --hysteresis 2 --num-workers 0 --fp16 --seed 1234 --load ckpt
--save ckpt --no-async-tensor-model-parallel-allreduce --tensorboard-queue-size 1 --log-timers-to-tensorboard
--log-batch-size-to-tensorboard --log-validation-ppl-to-tensorboard --tensorboard-dir tb --checkpoint-activations
--log-optimizer-states-to-tensorboard --data-impl mmap --deepspeed --zero-stage 1
--pipeline-model-parallel-size 2 --deepspeed-activation-checkpointing""".split() + DATA
MDS_125M_JSON = {"train_batch_size": 256, "train_micro_batch_size_per_gpu": 2, "steps_per_print": 10,
                 "zero_optimization": {"stage": 1}, "gradient_clipping": 1.0, "prescale_gradients": False,
                 "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 500, "hysteresis": 2,
                          "min_loss_scale": 1, "initial_scale_power": 11},
                 "wall_clock_breakdown": False}

# Megatron-LM, examples/pretrain_gpt.sh (345M) and examples/gpt3/train_gpt3_175b_distributed.sh.
MLM_345M = """--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024
--max-position-embeddings 1024 --micro-batch-size 4 --global-batch-size 8 --lr 0.00015 --train-iters
500000 --lr-decay-iters 320000 --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 1e-2
--lr-warmup-fraction .01 --clip-grad 1.0 --fp16 --data-impl mmap --split 949,50,1 --log-interval 100
--save-interval 10000 --eval-interval 1000 --eval-iters 10 --distributed-backend nccl --save ckpt
--load ckpt""".split() + DATA
MLM_175B = """--num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048
--max-position-embeddings 2048 --attention-backend auto --micro-batch-size 1 --global-batch-size
1536 --step-batch-size-schedule 0:16_2.4B:320_4.8B:624_7.2B:928_9.6B:1232_12B:1536 --train-iters
500000 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.006 --clip-grad 1.0
--fp16 --lr 6.0e-5 --lr-decay-style cosine --min-lr 6.0e-6 --lr-warmup-fraction .001
--lr-decay-iters 430000 --tensor-model-parallel-size 8 --pipeline-model-parallel-size 16 --split
949,50,1 --log-interval 100 --save-interval 10000 --eval-interval 1000 --save ckpt --load ckpt
--eval-iters 10 --tensorboard-dir tb""".split() + DATA
MLM_175B = [a.replace("_", " ") if a.startswith("0:16") else a for a in MLM_175B]   # one quoted argument there
# Megatron's functional test tests/functional_tests/test_scripts/gpt3/pretrain_gpt3_distributed_test.sh
# (TP_SIZE=1, PP_SIZE=1, local transformer, fp16).
MLM_TEST = """--num-layers 12 --hidden-size 512 --num-attention-heads 8 --log-params-norm --log-num-zeros-in-grad
--log-validation-ppl-to-tensorboard --log-timers-to-tensorboard --tensorboard-dir tb --micro-batch-size 4
--global-batch-size 32 --seq-length 1024 --max-position-embeddings 1024 --train-iters 100 --timing-log-level 2
--lr-decay-iters 320000 --save ckpt --load ckpt --data-impl mmap --split 949,50,1 --distributed-backend nccl
--lr 0.00015 --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 1e-2 --clip-grad 1.0 --lr-warmup-fraction .01
--log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10 --transformer-impl local
--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --no-gradient-accumulation-fusion
--fp16""".split() + DATA
# The rest of Megatron's flags for what this product does its own way, with the values Megatron's
# documentation gives (megatron/training/arguments.py; detxoify_lm/finetune_gpt_distributed-1.3b.sh for
# --DDP-impl local --finetune).
MLM_REST = """--tensorboard-log-interval 1 --log-memory-to-tensorboard --no-bias-gelu-fusion --no-bias-dropout-fusion
--use-cpu-initialization --DDP-impl local --no-save-optim --no-save-rng --finetune --use-checkpoint-args
--override-lr-scheduler --exit-duration-in-mins 230 --exit-signal-handler --attention-softmax-in-fp32
--accumulate-allreduce-grads-in-fp32 --no-query-key-layer-scaling""".split()
# DeepSpeedExamples, megatron/Megatron-LM/scripts/ds_zero2_pretrain_gpt2_model_parallel.sh (the first ZeRO tutorial:
# Megatron-LM's loose-JSON data, model parallel 4) with ds_zero2_config.json.
OLD_ZERO2 = """--model-parallel-size 4 --num-layers 24 --hidden-size 1024 --num-attention-heads 16 --batch-size 8
--seq-length 1024 --max-position-embeddings 1024 --train-iters 100000 --resume-dataloader --train-data webtext
--lazy-loader --tokenizer-type GPT2BPETokenizer --split 949,50,1 --distributed-backend nccl --lr 0.00015
--no-load-optim --lr-decay-style cosine --weight-decay 1e-2 --clip-grad 1.0 --warmup .01 --checkpoint-activations
--deepspeed-activation-checkpointing --fp16 --deepspeed""".split()
OLD_ZERO2_JSON = {
    "train_batch_size": 16, "gradient_accumulation_steps": 1, "steps_per_print": 1,
    "optimizer": {"type": "Adam", "params": {"lr": 0.00015, "weight_decay": 1e-2}},
    "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True, "gradient_clipping": 1.0,
    "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
    "activation_checkpointing": {"partition_activations": True, "contiguous_memory_optimization": False},
    "wall_clock_breakdown": False}

MAX_GRAD_NORM = "optimizer.params.max_grad_norm is not supported"
# (name, flags, JSON or None, what fails: every problem, as a fragment of its message; [] = it parses)
SCRIPTS = [
    ("v1.1.5 ZeRO-3", V115_ZERO3, V115_ZERO3_JSON,
     ["unknown key 'stage3_param_persitence_threshold'; did you mean 'stage3_param_persistence_threshold'"]),
    ("v1.1.5 ZeRO-2", " ".join(V115_ZERO3).replace("--zero-stage 3", "--zero-stage 2").replace(
        "--num-layers 5", "--num-layers 24").split(), V115_ZERO2_JSON,
     [MAX_GRAD_NORM]),
    ("v1.1.5 model parallel 4", V115_MP4, V115_ZERO2_JSON, ["--model-parallel-size 4 is not supported", MAX_GRAD_NORM]),
    ("Megatron-DeepSpeed GPT-2", MDS_GPT2, MDS_GPT2_JSON, [MAX_GRAD_NORM]),
    ("Megatron-DeepSpeed GPT-2, the JSON without max_grad_norm", MDS_GPT2,
     {**MDS_GPT2_JSON, "optimizer": {"type": "Adam", "params": {"lr": 0.00015, "betas": [0.9, 0.95]}}}, []),
    ("Megatron-DeepSpeed 125M", MDS_125M, MDS_125M_JSON,
     ["--tensor-model-parallel-size 2 is not supported", "--pipeline-model-parallel-size 2 is not supported"]),
    ("Megatron-DeepSpeed 125M, mp_size=1 pp_size=1 no_pp=true",
     " ".join(MDS_125M).replace("-parallel-size 2", "-parallel-size 1").split() + ["--no-pipeline-parallel"],
     MDS_125M_JSON, []),
    ("Megatron-LM 345M", MLM_345M, None, []),
    ("Megatron-LM 175B", MLM_175B, None,
     ["--step-batch-size-schedule is not supported", "--tensor-model-parallel-size 8 is not supported",
      "--pipeline-model-parallel-size 16 is not supported"]),
    ("Megatron-LM functional test", MLM_TEST, None, []),
    ("Megatron-LM's other flags", MLM_345M + MLM_REST, None, []),
    ("the first ZeRO tutorial", OLD_ZERO2, OLD_ZERO2_JSON,
     ["--model-parallel-size 4 is not supported", "--train-data is not supported", "--data-path is required"]),
]


def run(tmp_path, flags, config):
    forget_notes()
    extra = []
    if config is not None:
        (tmp_path / "ds.json").write_text(json.dumps(config))
        extra = ["--deepspeed_config", str(tmp_path / "ds.json")]
    return parse_args(flags + extra)


@pytest.mark.parametrize("name, flags, config, refused", SCRIPTS, ids=[s[0] for s in SCRIPTS])
def test_scripts_run_unchanged_or_name_every_refusal_at_once(tmp_path, capsys, name, flags, config, refused):
    if not refused:
        run(tmp_path, flags, config)
        return
    with pytest.raises(ConfigError) as error:
        run(tmp_path, flags, config)
    message = str(error.value)
    assert "\n" not in message
    assert error.value.problems == [p for p in error.value.problems if any(r in p for r in refused)], message
    assert len(error.value.problems) == len(refused), message
    for fragment in refused:
        assert fragment in message
    if len(refused) > 1:
        assert message.startswith(f"{len(refused)} problems: (1) ")


def test_what_the_old_names_and_the_no_ops_become(tmp_path, capsys):
    args = run(tmp_path, V115_ZERO3, {**V115_ZERO3_JSON, "zero_optimization": {"stage": 3}})
    zero = args.ds_config.zero_optimization
    assert args.tensor_model_parallel_size == 1 and args.micro_batch_size == 4
    assert args.lr_warmup_fraction == 0.01 and args.lr_warmup_iters == 3200          # --warmup: of the decay
    assert args.recompute_num_layers == 1 and args.recompute_granularity == "full"   # --checkpoint-num-layers
    assert (zero.reduce_bucket_size, zero.allgather_bucket_size) == (50_000_000, 5_000_000_000)
    assert zero.contiguous_gradients and zero.reduce_scatter
    assert args.tokenizer_type == "GPT2BPETokenizer"       # Megatron's pretrain_gpt default, with a vocab file
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("> note: no effect here")]
    assert len(notes) == 1
    for flag in ("--scattered-embeddings", "--split-transformers", "--partition-activations",
                 "--synchronize-each-layer", "--contigious-checkpointing", "--checkpoint-in-cpu"):
        assert flag in notes[0]


def test_flags_that_change_nothing_in_training_are_accepted(tmp_path, capsys):
    """Flash attention and host-side checkpointing change memory and speed, not what is trained: noted;
    Megatron's overlap switches are overlap_comm."""
    args = run(tmp_path, MLM_345M + ["--use-flash-attn-v2", "--checkpoint-in-cpu", "--overlap-grad-reduce",
                                     "--overlap-param-gather", "--zero-stage", "2"], None)
    assert args.ds_config.zero_optimization.overlap_comm is True   # stage 2's default is off
    note = [line for line in capsys.readouterr().out.splitlines() if "no effect here" in line]
    assert len(note) == 1 and "--use-flash-attn-v2" in note[0] and "--checkpoint-in-cpu" in note[0]
    assert run(tmp_path, MLM_345M + ["--zero-stage", "2"], None).ds_config.zero_optimization.overlap_comm is None


def test_tokens_become_iterations(tmp_path):
    from training.args import resolve_batch
    args = run(tmp_path, " ".join(MDS_125M).replace("-parallel-size 2", "-parallel-size 1").split(), MDS_125M_JSON)
    resolve_batch(args, data_parallel_size=128)
    tokens = 256 * 2048                                    # an iteration's, global batch x sequence
    assert args.train_iters == min(292968750 // 256, -(-300_000_000_000 // tokens))
    assert args.lr_decay_iters == 300_000_000_000 // tokens
    assert args.lr_warmup_iters == 3_000_000_000 // tokens


def test_flags_that_map_are_honoured(tmp_path, capsys):
    args = run(tmp_path, MLM_345M + MLM_REST, None)
    assert args.no_load_optim and args.no_load_rng and args.finetune                # --finetune
    assert args.ds_config.communication_data_type == "fp32"                          # all-reduce in fp32
    assert (args.exit_duration_in_mins, args.tensorboard_queue_size) == (230, 1000)
    out = capsys.readouterr().out
    assert re.search(r"> note: --use-checkpoint-args: no checkpoint in ckpt yet", out)
    note = [line for line in out.splitlines() if "no effect here" in line]
    assert len(note) == 1 and "--DDP-impl local" in note[0] and "--use-cpu-initialization" in note[0]
