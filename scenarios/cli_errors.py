"""Bad or unusual inputs run through the real commands (`python -m scenarios.faults inputs`
tabulates what each prints).

Each case is a real process (`python train.py ...`, `python -m data.preprocess ...`)
started from the repository root on the bundled corpus (work_dir/, see the README's
quick start) with a 1-layer model, so an accepted input trains two iterations in
seconds. The table gives the exit status and the line printed: for a user error the
one `error: ...` line (status 2), for an accepted input the last log line's start.
"""
import json
import os
import shutil
import struct
import subprocess
import sys

import numpy as np

from scenarios.harness.results import ROOT
from scenarios.harness.jobs import DATA_PREFIX as DATA
from scenarios.harness.jobs import TOKENIZER as MODEL
from data.indexed_dataset import IndexedDatasetBuilder
from data.tokenizer import train_sentencepiece


def base(tmp):
    return ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "16",
            "--micro-batch-size", "1", "--train-iters", "2", "--lr", "1e-3", "--eval-iters", "0",
            "--log-interval", "1", "--data-path", DATA, "--tokenizer-model", MODEL,
            "--data-cache-path", f"{tmp}/cache"]


def with_value(argv, flag, value):
    argv = list(argv)
    argv[argv.index(flag) + 1] = value
    return argv


def write_dataset(prefix, docs, extra_idx=b"", patch=None):
    builder = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    for doc in docs:
        builder.add_document(doc)
    builder.finalize(prefix + ".idx")
    raw = bytearray(open(prefix + ".idx", "rb").read())
    if patch:
        offset, data = patch
        raw[offset:offset + len(data)] = data
    open(prefix + ".idx", "wb").write(bytes(raw) + extra_idx)
    return prefix


def files(tmp):
    """The bad files the cases point at."""
    count = iter(range(1000))

    def text(name, content):
        path = os.path.join(tmp, name)
        with open(path, "w") as f:
            f.write(content)
        return path
    small = train_sentencepiece([f"word{i} and more words {i * 3}" for i in range(200)], f"{tmp}/small",
                                vocab_size=300)
    return {
        "small_model": small,
        "neg": write_dataset(f"{tmp}/neg", [[1, 2, 3], [4, 5]], patch=(34 + 4, struct.pack("<i", -2))),
        "multimodal": write_dataset(f"{tmp}/mm", [[1, 2, 3], [4, 5]], extra_idx=bytes([0, 0])),
        # two sequences (uint16): lengths at byte 34, pointers at 42
        "pointer": write_dataset(f"{tmp}/ptr", [[1, 2, 3], [4, 5]], patch=(42 + 8, struct.pack("<q", 2))),
        "swapped": write_dataset(f"{tmp}/swap", [[1, 2, 3], [4, 5]], patch=(34, struct.pack("<2i", 2, 3))),
        "garbage": (text("garbage.idx", "not an index"), text("garbage.bin", "x"))[0][:-4],
        "yaml": lambda body: text(f"run{next(count)}.yaml", body),  # one file per case
        "json": lambda body: text(f"ds{next(count)}.json", body),
        "bad_jsonl": text("bad.jsonl", '{"text": "fine"}\nnot json\n'),
        "nokey_jsonl": text("nokey.jsonl", '{"body": "fine"}\n'),
        "vocab_txt": text("small.vocab.txt", "not a model"),
    }


def cases(tmp, f):
    b = base(tmp)
    no_iters = b[:10] + b[12:]  # without --train-iters 2
    assert b[10] == "--train-iters"
    yaml, jsn = f["yaml"], f["json"]
    train = ["train.py"]
    out = [
        ("--train-iters 0", train + with_value(b, "--train-iters", "0")),
        ("--micro-batch-size 0", train + b + ["--micro-batch-size", "0"]),
        ("--eval-interval 0", train + b + ["--eval-interval", "0"]),
        ("--log-interval 0", train + with_value(b, "--log-interval", "0")),
        ("--lr -0.0001", train + with_value(b, "--lr", "-0.0001")),
        ("--adam-beta2 1.5", train + b + ["--adam-beta2", "1.5"]),
        ("--hidden-dropout 1.5", train + b + ["--hidden-dropout", "1.5"]),
        ("--min-lr 0.01 (above --lr 1e-3)", train + b + ["--min-lr", "0.01"]),
        ("--weight-decay -0.1", train + b + ["--weight-decay", "-0.1"]),
        ("--lr-warmup-fraction 2", train + b + ["--lr-warmup-fraction", "2"]),
        ("--lr-decay-iters 0", train + b + ["--lr-decay-iters", "0"]),
        ("--lr-warmup-iters 5 --lr-decay-iters 3", train + b + ["--lr-warmup-iters", "5", "--lr-decay-iters", "3"]),
        ("--num-layers four", train + b + ["--num-layers", "four"]),
        ("--hidden-size 100 --num-attention-heads 3", train + b + ["--hidden-size", "100",
                                                                   "--num-attention-heads", "3"]),
        ("--seq-length 2048 --max-position-embeddings 1024", train + b + ["--seq-length", "2048",
                                                                          "--max-position-embeddings", "1024"]),
        ("--initial-loss-scale 1000", train + b + ["--initial-loss-scale", "1000"]),
        ("--seed -1", train + b + ["--seed", "-1"]),
        ("--zero-stage 4", train + b + ["--zero-stage", "4"]),
        ("--fp16 --bf16", train + b + ["--fp16", "--bf16"]),
        ("--num-layer 2 (typo)", train + b + ["--num-layer", "2"]),
        ("--save-interval 5 without --save", train + b + ["--save-interval", "5"]),
        ("--vocab-file with SentencePieceTokenizer", train + b + ["--vocab-file", "v.json"]),
        ("--train-iters and --train-samples", train + b + ["--train-samples", "64"]),
        ("--lr-decay-samples with --train-iters", train + b + ["--lr-decay-samples", "64"]),
        ("--model-parallel-size 2", train + b + ["--model-parallel-size", "2"]),
        ("--tensor-model-parallel-size 2", train + b + ["--tensor-model-parallel-size", "2"]),
        ("--partition-activations", train + b + ["--partition-activations"]),
        ("--cpu-optimizer", train + b + ["--cpu-optimizer"]),
        ("--sequence-parallel", train + b + ["--sequence-parallel"]),
        ("--use-flash-attn", train + b + ["--use-flash-attn"]),
        ("--swiglu", train + b + ["--swiglu"]),
        ("--data-impl lazy", train + b + ["--data-impl", "lazy"]),
        ("--recompute-activations --checkpoint-activations", train + b + ["--recompute-activations",
                                                                          "--checkpoint-activations"]),
        ("YAML `num-layers: four`", train + b + ["--config", yaml("num-layers: four\n")]),
        ('YAML `fp16: "false"`', train + b + ["--config", yaml('fp16: "false"\n')]),
        ("YAML `train-iters: 0`", train + no_iters + ["--config", yaml("train-iters: 0\n")]),
        ("YAML unknown key `hiden-size: 64`", train + b + ["--config", yaml("hiden-size: 64\n")]),
        ("YAML syntax error", train + b + ["--config", yaml("num-layers: 2\n  bad: indent\n")]),
        ("YAML `min-lr: 0.5`", train + b + ["--config", yaml("min-lr: 0.5\n")]),
        ("--config nope.yaml", train + b + ["--config", "nope.yaml"]),
        ("JSON syntax error", train + b + ["--deepspeed_config", jsn("{not json")]),
        ('JSON `"fp16": {"enabled": "false"}`', train + b + ["--deepspeed_config",
                                                             jsn('{"fp16": {"enabled": "false"}}')]),
        ('JSON `"train_batch_size": 0`', train + b + ["--deepspeed_config", jsn('{"train_batch_size": 0}')]),
        ('JSON `"fp16": {"loss_scale_window": 0}`', train + b + ["--deepspeed_config",
                                                                 jsn('{"fp16": {"loss_scale_window": 0}}')]),
        ("JSON typo `zero_optimizaton`", train + b + ["--deepspeed_config", jsn('{"zero_optimizaton": {}}')]),
        ("--deepspeed_config is a directory", train + b + ["--deepspeed_config", tmp]),
        ("--data-path to a missing prefix", train + with_value(b, "--data-path", f"{tmp}/nope")),
        ("--data-path to garbage .bin/.idx", train + with_value(b, "--data-path", f["garbage"])),
        (".idx with a negative sequence length", train + with_value(b, "--data-path", f["neg"])),
        (".idx with sequence_modes (multimodal)", train + with_value(b, "--data-path", f["multimodal"])),
        ("--data-path 0.5 A 0.5 (odd blend)", train + with_value(b, "--data-path", "0.5") + ["--data-path", "0.5",
                                                                                            DATA, "0.5"]),
        ("--split 90,10,x", train + b + ["--split", "90,10,x"]),
        ("--split 0,0,0", train + b + ["--split", "0,0,0"]),
        ("--seq-length 100000 (longer than the valid split)",
         train + b + ["--seq-length", "100000", "--split", "998,1,1", "--eval-iters", "1"]),
        ("tokenizer vocab (300) smaller than the data's ids", train + with_value(b, "--tokenizer-model",
                                                                                 f["small_model"])),
        ("--tokenizer-model nope.model", train + with_value(b, "--tokenizer-model", "nope.model")),
        ("--tokenizer-model pointing at a text file", train + with_value(b, "--tokenizer-model", f["vocab_txt"])),
        ("--ranks-per-node 3 (world size 1)", train + b + ["--ranks-per-node", "3"]),
        ("preprocess: --input missing.jsonl", ["-m", "data.preprocess", "--input", f"{tmp}/missing.jsonl",
                                               "--output-prefix", f"{tmp}/o", "--tokenizer-type",
                                               "SentencePieceTokenizer", "--tokenizer-model", MODEL]),
        ("preprocess: a line that is not JSON", ["-m", "data.preprocess", "--input", f["bad_jsonl"],
                                                 "--output-prefix", f"{tmp}/o", "--tokenizer-type",
                                                 "SentencePieceTokenizer", "--tokenizer-model", MODEL]),
        ("preprocess: missing --json-keys field", ["-m", "data.preprocess", "--input", f["nokey_jsonl"],
                                                   "--output-prefix", f"{tmp}/o", "--tokenizer-type",
                                                   "SentencePieceTokenizer", "--tokenizer-model", MODEL]),
        ("preprocess: --workers 0", ["-m", "data.preprocess", "--input", f["nokey_jsonl"], "--output-prefix",
                                     f"{tmp}/o", "--tokenizer-type", "SentencePieceTokenizer",
                                     "--tokenizer-model", MODEL, "--workers", "0"]),
        ("train_tokenizer: --vocab-size 8000 on a tiny input",
         ["-m", "data.train_tokenizer", "--input", f["nokey_jsonl"], "--json-keys", "body", "--vocab-size",
          "8000", "--model-prefix", f"{tmp}/t"]),
        # Accepted: Megatron spellings with the same meaning.
        ("accepted: --data-impl mmap --no-pipeline-parallel", train + b + ["--data-impl", "mmap",
                                                                           "--no-pipeline-parallel"]),
        ("accepted: --recompute-activations (selective)", train + b + ["--recompute-activations"]),
        ("accepted: --train-samples 4 --lr-warmup-samples 2 (no --train-iters)",
         train + no_iters + ["--train-samples", "4", "--lr-warmup-samples", "2"]),
        ("accepted: YAML `fp16: false`", train + b + ["--config", yaml("fp16: false\n")]),
        # Loss-scaling flags outside fp16, DeepSpeed's gradient scaling keys at ZeRO stages 1-3.
        ("--bf16 --loss-scale 128", train + b + ["--bf16", "--loss-scale", "128"]),
        ("--hysteresis 4 (fp32)", train + b + ["--hysteresis", "4"]),
        ("--bf16 --min-loss-scale 2 --loss-scale-window 100", train + b + ["--bf16", "--min-loss-scale", "2",
                                                                           "--loss-scale-window", "100"]),
        ('JSON `"gradient_predivide_factor": 2` with --zero-stage 3',
         train + b + ["--zero-stage", "3", "--deepspeed_config", jsn('{"gradient_predivide_factor": 2}')]),
        ('JSON `"prescale_gradients": true` with --zero-stage 2',
         train + b + ["--zero-stage", "2", "--deepspeed_config", jsn('{"prescale_gradients": true}')]),
        ('accepted: JSON `"stage3_gather_16bit_weights_on_model_save": true` (pytorch_model.bin at each save)',
         train + b + ["--deepspeed_config", jsn('{"zero_optimization": {"stage": 3, '
                                                '"stage3_gather_16bit_weights_on_model_save": true}}')]),
        ("accepted: JSON `\"wall_clock_breakdown\": true`",
         train + b + ["--deepspeed_config", jsn('{"wall_clock_breakdown": true}')]),
        (".idx whose pointer table disagrees with the lengths", train + with_value(b, "--data-path", f["pointer"])),
        (".idx with two lengths swapped", train + with_value(b, "--data-path", f["swapped"])),
    ]
    return out + careless_cases(tmp, b, f)   # then checkpoint_cases(tmp, base(tmp)): they train first


CLUSTER = ("nodes: 2\ngpus_per_node: 4\ngpu_memory_gb: 32\npeak_flops: 125e12\nintra_node_gbps: 1200\n"
           "intra_node_latency_us: 5\ninter_node_gbps: 100\ninter_node_latency_us: 10\n")


def careless_cases(tmp, b, f):
    """Numbers that are not finite, switches that would do nothing, paths that are not what they should
    be, and the planner's --cluster file (tests/integration/inputs/test_careless_inputs.py has their tests)."""
    train, yaml, jsn = ["train.py"], f["yaml"], f["json"]
    afile = f["yaml"]("not: a directory\n")
    dry = ["train.py", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "2", "--seq-length", "16",
           "--lr", "1e-3", "--zero-stage", "3", "--tokenizer-type", "GPT2BPETokenizer", "--dry-run"]
    cluster = lambda old, new: ["--cluster", yaml(CLUSTER.replace(old, new))]  # noqa: E731
    zero3 = lambda **z: jsn(json.dumps({"zero_optimization": {"stage": 3, **z}}))  # noqa: E731
    return [
        ("--zero-hpz-size inf", train + b + ["--zero-hpz-size", "inf"]),
        ("--global-batch-size 1e999", train + b + ["--global-batch-size", "1e999"]),
        ("YAML `zero-hpz-size: .inf`", train + b + ["--config", yaml("zero-hpz-size: .inf\n")]),
        ('JSON `"reset_T": Infinity` (with --zero-quantized-gradients)',
         train + b + ["--zero-quantized-gradients", "--deepspeed_config", zero3(zeropp_loco_param={"reset_T": 1e400})]),
        ('JSON `"gradient_clipping": NaN`', train + b + ["--deepspeed_config", jsn('{"gradient_clipping": NaN}')]),
        ("--data-path nan A 1 A (blend weight)", train + [a for a in b if a not in ("--data-path", DATA)]
         + ["--data-path", "nan", DATA, "1", DATA]),
        ("accepted: JSON zeropp_loco_param + --zero-quantized-gradients",
         train + b + ["--zero-stage", "3", "--zero-quantized-gradients", "--deepspeed_config", zero3(zeropp_loco_param={})]),
        ("JSON zero_quantized_gradients_block_size 4",
         train + b + ["--deepspeed_config", zero3(zero_quantized_gradients=True, zero_quantized_gradients_block_size=4)]),
        ("JSON zero_quantized_weights_block_size 2",
         train + b + ["--deepspeed_config", zero3(zero_quantized_weights=True, zero_quantized_weights_block_size=2)]),
        ("JSON refresh interval without deltas",
         train + b + ["--deepspeed_config", zero3(zero_quantized_weight_deltas_refresh_interval=10)]),
        ("ZEROPP_QUANT_BACKEND=fast", ["ENV:ZEROPP_QUANT_BACKEND=fast"] + train + b),
        ("--distributed-backend nccl without a GPU", train + b + ["--distributed-backend", "nccl"]),
        ("accepted: --zero-stage 3 --zero-hpz-size 2 deltas on one process (the label says unsharded)",
         train + b + ["--zero-stage", "3", "--zero-hpz-size", "2", "--zero-quantized-weight-deltas"]),
        ("--tensorboard-dir is a file", train + b + ["--tensorboard-dir", afile]),
        ("--tensorboard-dir below a file", train + b + ["--tensorboard-dir", afile + "/tb"]),
        ("--data-cache-path is a file", with_value(train + b, "--data-cache-path", afile)),
        ("--save is a file", train + b + ["--save", afile]),
        ("--load is a file", train + b + ["--load", afile]),
        ("--config /dev/null", train + b + ["--config", "/dev/null"]),
        ("dry-run: --cluster is a directory", dry + ["--cluster", tmp]),
        ("dry-run: --cluster `nodes: 2.5`", dry + cluster("nodes: 2", "nodes: 2.5")),
        ("dry-run: --cluster `nodes: .nan`", dry + cluster("nodes: 2", "nodes: .nan")),
        ("accepted: dry-run: --cluster `nodes: 1e1`", dry + cluster("nodes: 2", "nodes: 1e1")),
        ("dry-run: --cluster `inter_node_latency_us: -5`", dry + cluster("inter_node_latency_us: 10",
                                                                          "inter_node_latency_us: -5")),
        ("dry-run: --cluster `inter_node_gbps: .inf`", dry + cluster("inter_node_gbps: 100", "inter_node_gbps: .inf")),
        ("dry-run: --cluster `peak_flops: .nan`", dry + cluster("peak_flops: 125e12", "peak_flops: .nan")),
        ("dry-run: deltas with hpZ = the whole node, 1 node", dry + ["--zero-hpz-size", "4",
                                                                    "--zero-quantized-weight-deltas"]
         + cluster("nodes: 2", "nodes: 1")),
        ("dry-run: --zeropp auto with deltas, 1 node", dry + ["--zeropp", "auto", "--zero-quantized-weight-deltas"]
         + cluster("nodes: 2", "nodes: 1")),
    ]


DAMAGES = [("meta.json", "missing"), ("meta.json", "empty"), ("meta.json", "truncated"), ("meta.json", "flipped"),
           ("checksums.json", "missing"), ("checksums.json", "truncated"), ("checksums.json", "flipped"),
           (".metadata", "truncated"), (".metadata", "flipped"), ("__0_0.distcp", "missing"),
           ("__0_0.distcp", "truncated")]


def checkpoint_cases(tmp, b):
    """--load (and the exporter) on a checkpoint whose files were damaged: iterations 1 and 2
    saved, iteration 2's file damaged, so the line should point at iteration 1."""
    pristine = f"{tmp}/ckpt"
    subprocess.run([sys.executable, "train.py", *b, "--save", pristine, "--save-interval", "1"],
                   capture_output=True, cwd=str(ROOT), timeout=300, check=True)
    out, count = [], iter(range(100))

    def copy(damage=None):
        path = f"{tmp}/ckpt{next(count)}"
        shutil.copytree(pristine, path)
        if damage:
            damage(path)
        return path

    def resume(path):
        return ["train.py"] + with_value(b, "--train-iters", "3") + ["--load", path]

    for name, how in DAMAGES:
        path = copy(lambda p, name=name, how=how: _damage(os.path.join(p, "iter_0000002", name), how))
        out.append((f"--load: {name} {how}", resume(path)))
    generate = ["generate.py", "--load", pristine, "--max-new-tokens", "2"]
    export = ["-m", "tools.export_checkpoint", "--load", pristine]
    out += [
        ("generate.py --top-k -3", generate + ["--top-k", "-3"]),
        ("generate.py --temperature nan", generate + ["--temperature", "nan"]),
        ('generate.py --prompt ""', generate + ["--prompt", ""]),
        ("accepted: generate.py from another directory", ["CWD:/"] + generate),
        ("generate.py --load a file", ["generate.py", "--load", f"{pristine}/latest_checkpointed_iteration.txt"]),
        ("export --format torch --output a directory", export + ["--format", "torch", "--output", tmp]),
        ("export --format torch --output in a missing directory", export + ["--format", "torch", "--output",
                                                                            f"{tmp}/missing/model.pt"]),
        ("export --format hf --output a file", export + ["--format", "hf", "--output",
                                                         f"{pristine}/latest_checkpointed_iteration.txt"]),
        ("export --max-shard-size nan", export + ["--format", "hf", "--output", f"{tmp}/hf2", "--max-shard-size",
                                                  "nan"]),
        ("export --dtype fp8", export + ["--format", "torch", "--output", f"{tmp}/m.pt", "--dtype", "fp8"]),
        ("--load: tracker holds `x2`", resume(copy(lambda p: _write(f"{p}/latest_checkpointed_iteration.txt", "x2")))),
        ("--load: tracker names a missing iteration 7",
         resume(copy(lambda p: _write(f"{p}/latest_checkpointed_iteration.txt", "7")))),
        ("--load iter_0000002 without its meta.json",
         resume(copy(lambda p: os.remove(f"{p}/iter_0000002/meta.json")) + "/iter_0000002")),
        ("accepted: --load without a tracker (loads the newest complete)",
         resume(copy(lambda p: os.remove(f"{p}/latest_checkpointed_iteration.txt")))),
        ("export --format hf: meta.json truncated",
         ["-m", "tools.export_checkpoint", "--load", copy(lambda p: _damage(f"{p}/iter_0000002/meta.json",
                                                                             "truncated")),
          "--format", "hf", "--output", f"{tmp}/hf"]),
    ]
    return out


def _write(path, text):
    with open(path, "w") as f:
        f.write(text)


def _damage(path, how):
    if how == "missing":
        os.remove(path)
        return
    data = bytearray(open(path, "rb").read())
    data = {"empty": bytearray(), "truncated": data[:len(data) // 2]}.get(how, data)
    if how == "flipped":
        data[len(data) // 2] ^= 0x01
    open(path, "wb").write(bytes(data))


def run(argv):
    """`ENV:K=V` and `CWD:DIR` at the start of argv set the environment and the directory."""
    env, cwd = dict(os.environ), str(ROOT)
    while argv and argv[0].split(":")[0] in ("ENV", "CWD"):
        kind, value = argv[0].split(":", 1)
        if kind == "ENV":
            env[value.split("=")[0]] = value.split("=", 1)[1]
        else:
            cwd = value
        argv = argv[1:]
    if cwd != str(ROOT) and argv[0].endswith(".py"):
        argv = [str(ROOT / argv[0]), *argv[1:]]
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=cwd, env=env, timeout=300)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    if "Traceback" in proc.stderr:
        message = "TRACEBACK: " + proc.stderr.strip().splitlines()[-1]
    elif errors:
        message = errors[-1]
    elif proc.returncode:
        message = proc.stderr.strip().splitlines()[-1]  # argparse's own "usage ... error:" of a data tool
    else:
        logged = [line for line in proc.stdout.splitlines() if " iteration " in line and "lm loss" in line]
        message = ("trains; last log line: `" + logged[-1].split("| elapsed")[0].strip() + " ...`"
                   if logged else "exit 0; last line: `" + (proc.stdout.strip().splitlines() or [""])[-1][:80] + "`")
    return proc.returncode, message
