"""Tokenize documents into Megatron ``.bin/.idx`` datasets (Megatron's preprocess_data.py).

    python -m data.preprocess --input /tmp/kjv.jsonl --output-prefix /tmp/kjv \\
        --tokenizer-type SentencePieceTokenizer --tokenizer-model /tmp/kjv_sp.model \\
        --append-eod --workers 2

writes ``/tmp/kjv_text_document.bin/.idx``; train with ``--data-path /tmp/kjv_text_document``.

Inputs (``--input``, one or more paths or glob patterns):
  * ``.jsonl`` / ``.json``: one JSON object per line; each ``--json-keys`` field is a document.
  * anything else is plain text: documents are separated by one or more blank
    lines (a paragraph block is a document; single newlines stay inside it).
Or ``--dataset NAME_OR_PATH [--dataset-split train]``: a Hugging Face ``datasets``
dataset: a directory saved with ``save_to_disk``, a local .json/.jsonl/.txt/.csv/.parquet
file, or a hub name (needs internet). Documents come from the ``--json-keys`` columns.

Each key gets its own dataset ``{output_prefix}_{key}_document``, one
sequence per document; documents that tokenize to nothing are skipped.
"""

import argparse
import multiprocessing
import os
import sys
import time

import numpy as np
from tqdm import tqdm

from data.cli import at_least, run
from data.documents import expand_inputs, read_documents
from data.indexed_dataset import DataError, IndexedDatasetBuilder, best_dtype
from data.tokenizer import TOKENIZER_TYPES, build_tokenizer


def read_hf_dataset(name_or_path, split, json_keys):
    """Yield ``{key: text}`` dicts from a Hugging Face ``datasets`` dataset."""
    import datasets

    if os.path.isdir(name_or_path) and any(
            os.path.exists(os.path.join(name_or_path, f)) for f in ("dataset_info.json", "state.json", "dataset_dict.json")):
        dataset = datasets.load_from_disk(name_or_path)
        if isinstance(dataset, datasets.DatasetDict):
            dataset = dataset[split]
    elif os.path.isfile(name_or_path):
        extension = name_or_path.rsplit(".", 1)[-1]
        builder = {"jsonl": "json", "json": "json", "txt": "text", "csv": "csv", "parquet": "parquet"}.get(extension)
        if builder is None:
            raise DataError(f"--dataset {name_or_path}: unsupported file type .{extension}")
        dataset = datasets.load_dataset(builder, data_files=name_or_path, split=split)
    else:
        dataset = datasets.load_dataset(name_or_path, split=split)
    missing = [k for k in json_keys if k not in dataset.column_names]
    if missing:
        raise DataError(f"--dataset {name_or_path} has no column {missing[0]!r}; columns: {dataset.column_names}; "
                       "choose them with --json-keys")
    for row in dataset.select_columns(list(json_keys)):
        yield row


class Encoder:
    """Tokenizes one document; each worker process builds its own tokenizer once."""

    tokenizer = None  # per process, set by initializer()

    def __init__(self, tokenizer_args, append_eod, dtype):
        self.tokenizer_args = tokenizer_args
        self.append_eod = append_eod
        self.dtype = dtype

    def initializer(self):
        # A class attribute (as in Megatron): the pool pickles `self` with every
        # task, so an instance attribute set here would not reach `encode`.
        Encoder.tokenizer = build_tokenizer(**self.tokenizer_args)

    def encode(self, document):
        """{key: text} -> ({key: token array}, number of UTF-8 bytes read)."""
        tokens, num_bytes = {}, 0
        for key, text in document.items():
            ids = self.tokenizer.tokenize(text)
            if ids and self.append_eod:
                ids.append(self.tokenizer.eod)
            tokens[key] = np.asarray(ids, dtype=self.dtype)  # compact to send between processes
            num_bytes += len(text.encode("utf-8"))
        return tokens, num_bytes


def preprocess(input=None, output_prefix=None, tokenizer_type="SentencePieceTokenizer", tokenizer_model=None,
               vocab_file=None, merge_file=None, json_keys=("text",), append_eod=False, workers=1,
               log_interval=1000, dataset=None, dataset_split="train", progress=True):
    """Tokenize ``input`` (paths/globs) or ``dataset`` into ``{output_prefix}_{key}_document``.

    Returns a summary dict: output prefixes per key, documents, tokens, bytes, seconds.
    """
    if (input is None) == (dataset is None):
        raise DataError("give exactly one of --input or --dataset")
    if output_prefix is None:
        raise DataError("--output-prefix is required")
    json_keys = list(json_keys)
    tokenizer_args = dict(tokenizer_type=tokenizer_type, tokenizer_model=tokenizer_model,
                          vocab_file=vocab_file, merge_file=merge_file)
    tokenizer = build_tokenizer(**tokenizer_args)  # fail fast on a bad tokenizer, before forking
    dtype = best_dtype(tokenizer.vocab_size)
    documents = read_hf_dataset(dataset, dataset_split, json_keys) if dataset else read_documents(expand_inputs(input), json_keys)

    encoder = Encoder(tokenizer_args, append_eod, dtype)
    if workers > 1:
        pool = multiprocessing.Pool(workers, initializer=encoder.initializer)
        # imap keeps document order, so the output does not depend on --workers.
        encoded = pool.imap(encoder.encode, documents, chunksize=32)
    else:
        pool = None
        encoder.initializer()
        encoded = map(encoder.encode, documents)

    os.makedirs(os.path.dirname(os.path.abspath(output_prefix)), exist_ok=True)
    prefixes = {key: f"{output_prefix}_{key}_document" for key in json_keys}
    builders = {key: IndexedDatasetBuilder(prefix + ".bin", dtype) for key, prefix in prefixes.items()}
    start = time.time()
    num_docs = num_tokens = num_bytes = 0
    try:
        with tqdm(encoded, unit="doc", miniters=log_interval, disable=not progress) as bar:
            for tokens, doc_bytes in bar:
                num_docs += 1
                num_bytes += doc_bytes
                for key, ids in tokens.items():
                    if len(ids):
                        builders[key].add_document(ids)
                        num_tokens += len(ids)
                if num_docs % log_interval == 0:
                    bar.set_postfix(MB_per_s=f"{num_bytes / 1e6 / (time.time() - start):.2f}")
    except BaseException:
        for builder in builders.values():
            builder.abort()
        raise
    finally:
        if pool is not None:
            pool.close()
            pool.join()
    for key, builder in builders.items():
        builder.finalize(prefixes[key] + ".idx")

    seconds = time.time() - start
    summary = dict(prefixes=prefixes, documents=num_docs, tokens=num_tokens, bytes=num_bytes, seconds=seconds)
    if progress:
        print(f"processed {num_docs} documents, {num_tokens} tokens, {num_bytes / 1e6:.2f} MB in {seconds:.1f} s "
              f"({num_bytes / 1e6 / max(seconds, 1e-9):.2f} MB/s) -> {', '.join(p + '.bin/.idx' for p in prefixes.values())}")
    return summary


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    group = parser.add_argument_group("input")
    group.add_argument("--input", nargs="+", help="JSON-lines or text files, or glob patterns")
    group.add_argument("--dataset", help="Hugging Face dataset: saved directory, local file or hub name")
    group.add_argument("--dataset-split", default="train")
    group.add_argument("--json-keys", nargs="+", default=["text"], help="fields/columns holding document text")
    group = parser.add_argument_group("tokenizer")
    group.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    group.add_argument("--tokenizer-model", help="sentencepiece .model file")
    group.add_argument("--vocab-file", help="GPT-2 vocab.json")
    group.add_argument("--merge-file", help="GPT-2 merges.txt")
    group.add_argument("--append-eod", action="store_true", help="append the end-of-document token to every document")
    group = parser.add_argument_group("output")
    group.add_argument("--output-prefix", required=True, help="writes PREFIX_{key}_document.bin/.idx")
    group = parser.add_argument_group("runtime")
    group.add_argument("--workers", type=at_least(1), default=1, help="tokenizer processes")
    group.add_argument("--log-interval", type=at_least(1), default=1000, help="progress update every N documents")
    args = parser.parse_args(argv)
    if (args.input is None) == (args.dataset is None):
        parser.error("give exactly one of --input or --dataset")

    preprocess(input=args.input, output_prefix=args.output_prefix, tokenizer_type=args.tokenizer_type,
               tokenizer_model=args.tokenizer_model, vocab_file=args.vocab_file, merge_file=args.merge_file,
               json_keys=args.json_keys, append_eod=args.append_eod, workers=args.workers,
               log_interval=args.log_interval, dataset=args.dataset, dataset_split=args.dataset_split)


if __name__ == "__main__":
    sys.exit(run(main))
