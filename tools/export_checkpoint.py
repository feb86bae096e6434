"""Turn a sharded checkpoint into one file, or into a Hugging Face GPT-2.

    python -m tools.export_checkpoint --load runs/demo/checkpoints --format torch --output model.pt [--dtype bf16]
    python -m tools.export_checkpoint --load runs/demo/checkpoints --format hf --output hf_gpt2/

No process group and no particular world size: each tensor is read on its own
from the torch.distributed.checkpoint files (whatever ranks wrote it) and
reshaped. `torch` writes the model's state dict (its parameter names);
`hf` writes a `transformers` GPT2LMHeadModel directory: config.json and
safetensors files of at most --max-shard-size each (with an index when there
are several), plus the tokenizer (GPT-2 BPE as tokenizer.json; a
sentencepiece model is copied as tokenizer.model). Memory: the output (torch)
or one safetensors shard (hf), plus the tensor being read.
"""
from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed.checkpoint as dcp

from common import ConfigError, OneLineParser, check_writable_dir, parse_number
from data.tokenizer import build_tokenizer
from training.checkpoint import (CheckpointError, check_load_path, damaged, read_meta, resolve_checkpoint,
                                 single_process_quiet, verify_checksums)
from zeropp.outer.diloco import GLOBAL

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def open_checkpoint(load: str) -> tuple[str, dict]:
    """The checkpoint directory `load` names (a save directory or an iter_* one) and its meta."""
    check_load_path(load)
    path = resolve_checkpoint(load)
    if path is None:
        raise CheckpointError(f"--load {load}: no checkpoint there (no {os.path.join(load, 'meta.json')} "
                              f"and no latest_checkpointed_iteration.txt)")
    problems = verify_checksums(path)   # every file, meta.json included, before reading any
    if problems:
        raise damaged(path, problems[0])
    return path, read_meta(path)


def model_tensors(path: str, meta: dict, dtype: torch.dtype = torch.float32, average_groups: bool = False):
    """(name, tensor) for every model weight, one at a time, in the model's shapes. Saved by
    several groups (zeropp/outer/diloco.py): the global parameters they share (what training
    validated), or with `average_groups` the mean of the groups' own parameters, which hold their
    steps since each fragment's last exchange (what the final synchronization makes of them)."""
    groups = meta.get("groups", 1)
    if average_groups and groups == 1:   # before anything is read or written
        raise ConfigError(f"--average-groups: {path} was saved by one group (no --outer-sync-interval); drop it")
    return _read(path, meta, dtype, GLOBAL if groups > 1 and not average_groups else "model.",
                 groups if average_groups else 1)


def _read(path: str, meta: dict, dtype: torch.dtype, prefix: str, copies: int):
    """`copies`: the groups' own values saved end to end (zeropp/collectives/partition.py as_dcp), averaged."""
    reader = dcp.FileSystemReader(path)
    for name, shape in meta["param_shapes"].items():
        flat = torch.empty(copies * torch.Size(shape).numel(), dtype=torch.float32)
        with single_process_quiet():
            dcp.load({prefix + name: flat}, storage_reader=reader, no_dist=True)
        yield name, flat.view(copies, -1).mean(0).view(shape).to(dtype)


def consolidated_state_dict(load: str, dtype: torch.dtype = torch.float32,
                            average_groups: bool = False) -> tuple[dict, dict]:
    """The whole model state dict (on CPU) and the checkpoint's meta."""
    path, meta = open_checkpoint(load)
    return dict(model_tensors(path, meta, dtype, average_groups)), meta


TOKENIZER_KEYS = ("tokenizer_model", "vocab_file", "merge_file")


def checkpoint_tokenizer(meta: dict, checkpoint: str, tokenizer_model: str | None = None,
                         vocab_file: str | None = None, merge_file: str | None = None):
    """The tokenizer training used: the files given here (a sentencepiece model, or GPT-2's vocab
    and merges), else its copy inside the checkpoint (`checkpoint`, an iter_* directory), else
    where training read it. Older checkpoints kept that path as given, relative to where training
    ran: tried from here, then from each directory above `checkpoint`."""
    given = {"tokenizer_model": tokenizer_model, "vocab_file": vocab_file, "merge_file": merge_file}
    for key, path in given.items():
        if path and not os.path.isfile(path):
            raise ConfigError(f"--{key.replace('_', '-')} {path} does not exist; pass the tokenizer training used "
                              f"(without the flag, the checkpoint's own copy is used)")
    kind = ("SentencePieceTokenizer" if tokenizer_model else "GPT2BPETokenizer" if vocab_file or merge_file
            else meta.get("tokenizer_type"))
    copies = meta.get("tokenizer_copies", {})
    files = {key: given[key] or (os.path.join(checkpoint, copies[key]) if key in copies else
                                 _found_above(meta.get(key), checkpoint)) for key in TOKENIZER_KEYS}
    needed = ("tokenizer_model",) if kind == "SentencePieceTokenizer" else ("vocab_file", "merge_file")
    missing = [files[key] for key in needed if not given[key] and files[key] and not os.path.isfile(files[key])]
    if missing:   # a checkpoint from before the copies, whose tokenizer was moved: not a new one's job
        flags = "--tokenizer-model" if kind == "SentencePieceTokenizer" else "--vocab-file and --merge-file"
        raise ConfigError(f"the tokenizer of checkpoint {checkpoint} is gone ({' and '.join(missing)} missing); "
                          f"pass the one training used with {flags}")
    return build_tokenizer(kind, **files)


def _found_above(path: str | None, checkpoint: str) -> str | None:
    if path and not os.path.isabs(path) and not os.path.exists(path):
        above = os.path.abspath(checkpoint)
        while os.path.dirname(above) != above:
            above = os.path.dirname(above)
            if os.path.exists(os.path.join(above, path)):
                return os.path.join(above, path)
    return path


def add_tokenizer_flags(parser):
    """--tokenizer-model, --vocab-file, --merge-file: the tokenizer to use instead of the checkpoint's."""
    parser.add_argument("--tokenizer-model", default=None,
                        help="a sentencepiece model to use instead of the checkpoint's tokenizer")
    parser.add_argument("--vocab-file", default=None, help="GPT-2 BPE vocab.json (with --merge-file) instead")
    parser.add_argument("--merge-file", default=None, help="GPT-2 BPE merges.txt (with --vocab-file) instead")


def tokenizer_overrides(args) -> dict:
    return {key: getattr(args, key) for key in TOKENIZER_KEYS}


# -- Hugging Face -------------------------------------------------------------------------
def hf_config(model_config: dict, eod: int | None):
    from transformers import GPT2Config
    padded = -(-model_config["vocab_size"] // model_config["make_vocab_size_divisible_by"]) \
        * model_config["make_vocab_size_divisible_by"]
    return GPT2Config(
        vocab_size=padded, n_positions=model_config["max_position_embeddings"],
        n_embd=model_config["hidden_size"], n_layer=model_config["num_layers"],
        n_head=model_config["num_attention_heads"], n_inner=model_config["ffn_hidden_size"],
        activation_function="gelu_new",   # GPT-2's tanh approximation, as model/gpt.py
        layer_norm_epsilon=model_config["layernorm_epsilon"],
        resid_pdrop=model_config["hidden_dropout"], embd_pdrop=model_config["hidden_dropout"],
        attn_pdrop=model_config["attention_dropout"], initializer_range=model_config["init_method_std"],
        tie_word_embeddings=True, bos_token_id=eod, eos_token_id=eod,
        architectures=["GPT2LMHeadModel"])


def hf_name(name: str) -> tuple[str, bool]:
    """Our parameter name -> (GPT2LMHeadModel's name, transposed?). GPT-2's
    Conv1D stores [in, out], the transpose of nn.Linear's weight."""
    parts = name.split(".")
    if parts[0] in ("wte", "wpe", "ln_f"):
        return "transformer." + name, False
    assert parts[0] == "blocks", name
    layer, rest = parts[1], ".".join(parts[2:])
    table = {"ln1": "ln_1", "ln2": "ln_2", "attn.qkv": "attn.c_attn", "attn.proj": "attn.c_proj",
             "mlp.fc": "mlp.c_fc", "mlp.proj": "mlp.c_proj"}
    module, kind = rest.rsplit(".", 1)
    return f"transformer.h.{layer}.{table[module]}.{kind}", kind == "weight" and module not in ("ln1", "ln2")


def export_hf(load: str, output: str, dtype: torch.dtype = torch.float32, max_shard_bytes: int = 5 * 2**30,
              average_groups: bool = False, tokenizer: dict | None = None):
    from safetensors.torch import save_file
    path, meta = open_checkpoint(load)
    given = tokenizer or {}
    # before any tensor: a tokenizer that cannot be read is one line and exit status 2
    tok = checkpoint_tokenizer(meta, path, **given) if meta.get("tokenizer_type") or any(given.values()) else None
    tensors = model_tensors(path, meta, dtype, average_groups)
    os.makedirs(output, exist_ok=True)
    itemsize = torch.tensor([], dtype=dtype).element_size()
    # Shards planned from the shapes, so file names are known before any tensor is read.
    shards, size = [[]], 0
    for name, shape in meta["param_shapes"].items():
        nbytes = torch.Size(shape).numel() * itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    shard_of = {name: i for i, names in enumerate(shards) for name in names}
    weight_map, current, index = {}, {}, 0
    for name, tensor in tensors:
        if shard_of[name] != index:
            save_file(current, os.path.join(output, files[index]), metadata={"format": "pt"})
            current, index = {}, shard_of[name]
        key, transpose = hf_name(name)
        current[key] = tensor.t().contiguous() if transpose else tensor
        weight_map[key] = files[index]
    save_file(current, os.path.join(output, files[index]), metadata={"format": "pt"})
    if len(files) > 1:
        total = sum(torch.Size(s).numel() for s in meta["param_shapes"].values()) * itemsize
        with open(os.path.join(output, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    eod = _export_tokenizer(tok, output)
    config = hf_config(meta["model_config"], eod)
    config.torch_dtype = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}[dtype]
    config.save_pretrained(output)
    return files, meta


def _export_tokenizer(tok, output: str) -> int | None:
    """Write the tokenizer next to the weights, as a tokenizer.json that
    `AutoTokenizer.from_pretrained(output)` loads and that gives the training ids
    (data.tokenizer's hf_tokenizer); returns the end-of-document id."""
    from transformers import PreTrainedTokenizerFast

    if tok is None:
        print("> tokenizer not exported (the checkpoint names none)", file=sys.stderr)
        return None
    try:
        hf = tok.hf_tokenizer()
    except (OSError, ValueError) as e:   # a sentencepiece model of another kind than BPE
        print(f"> tokenizer not exported ({e})", file=sys.stderr)
        return None
    # Training adds no bos/eos inside a document (the end of one is data, not a template).
    PreTrainedTokenizerFast(tokenizer_object=hf, **tok.special_tokens()).save_pretrained(output)
    return tok.eod


def main(argv=None):
    p = OneLineParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--load", required=True, help="a --save directory (its latest checkpoint) or an iter_* directory")
    p.add_argument("--format", choices=["torch", "hf"], required=True)
    p.add_argument("--output", required=True, help="a file (torch) or a directory (hf)")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    p.add_argument("--max-shard-size", default="5", help="GiB per safetensors file (hf)")
    add_tokenizer_flags(p)
    p.add_argument("--average-groups", action="store_true",
                   help="a checkpoint of several groups (--outer-sync-interval) saved before the end of training: "
                        "export the mean of the groups' own parameters (what the final synchronization gives) "
                        "instead of the global parameters of their last exchanges (what training validated)")
    try:
        args = p.parse_args(argv)
        shard_gib = parse_number(args.max_shard_size, "--max-shard-size")
        if shard_gib <= 0:
            raise ConfigError(f"--max-shard-size must be > 0 (GiB per safetensors file), got {args.max_shard_size}")
        check_output(args.output, args.format)
        if args.format == "torch" and any(tokenizer_overrides(args).values()):
            raise ConfigError("--tokenizer-model, --vocab-file and --merge-file go with --format hf (a torch state "
                              "dict holds no tokenizer); drop them")
        if args.format == "torch":
            sd, meta = consolidated_state_dict(args.load, DTYPES[args.dtype], args.average_groups)
            try:
                torch.save(sd, args.output)
            except RuntimeError as e:   # torch.save's own write errors (a full disk) are not OSErrors
                raise OSError(str(e).splitlines()[0]) from None
            print(f"> wrote {len(sd)} tensors of iteration {meta['iteration']} to {args.output}")
        else:
            files, meta = export_hf(args.load, args.output, DTYPES[args.dtype], max(1, int(shard_gib * 2**30)),
                                    args.average_groups, tokenizer_overrides(args))
            print(f"> wrote a GPT2LMHeadModel to {args.output} ({len(files)} safetensors file(s))")
        if meta.get("groups", 1) > 1:
            print(f"> saved by {meta['groups']} groups: " + (
                "the mean of the groups' own parameters" if args.average_groups else
                "their global parameters (at the end of training, after the final synchronization, every group's; "
                "before it, those of each fragment's last exchange: --average-groups takes the groups' mean)"))
    except (CheckpointError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except OSError as e:   # the disk filled up or went away while writing
        print(f"error: writing --output {args.output} failed ({e.strerror or e})", file=sys.stderr)
        sys.exit(1)


def check_output(output: str, fmt: str):
    """--output can be written, before any tensor is read: a file (torch) in an existing
    directory, or a directory (hf)."""
    if fmt == "hf":
        if os.path.exists(output) and not os.path.isdir(output):
            raise ConfigError(f"--output {output} is a file; --format hf writes a directory, pass a new or "
                              f"existing directory")
        check_writable_dir(output, "--output")
        return
    if os.path.isdir(output):
        raise ConfigError(f"--output {output} is a directory; --format torch writes one file, e.g. "
                          f"{os.path.join(output, 'model.pt')}")
    parent = os.path.dirname(os.path.abspath(output))
    if not os.path.isdir(parent):
        raise ConfigError(f"--output {output}: the directory {parent} does not exist; create it or pick another")
    if not os.access(parent, os.W_OK):
        raise ConfigError(f"--output {output}: the directory {parent} is not writable; pick another")


if __name__ == "__main__":
    main()
