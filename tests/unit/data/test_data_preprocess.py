"""Preprocessing into .bin/.idx: worker-count independence, --append-eod, input formats, the KJV corpus."""

import json
import os

import pytest

from data import preprocess as preprocess_module
from data.corpus import write_kjv_jsonl
from data.indexed_dataset import DataError, IndexedDataset
from data.preprocess import preprocess
from data.tokenizer import build_tokenizer, train_sentencepiece

DOCS = [f"Document {i}: and the LORD spake unto Moses, saying {i * 7}.\nVerse two of {i}." for i in range(60)]


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    return train_sentencepiece(DOCS, str(tmp_path_factory.mktemp("sp") / "tiny"), vocab_size=320)


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(DOCS)))
    return str(path)


def run(input, prefix, model, **kwargs):
    return preprocess(input=input, output_prefix=prefix, tokenizer_type="SentencePieceTokenizer",
                      tokenizer_model=model, progress=False, **kwargs)


def read_bytes(prefix):
    return [open(prefix + ext, "rb").read() for ext in (".bin", ".idx")]


def test_workers_do_not_change_output(tmp_path, jsonl, sp_model):
    one = run(jsonl, str(tmp_path / "w1"), sp_model, workers=1, append_eod=True)
    two = run(jsonl, str(tmp_path / "w2"), sp_model, workers=2, append_eod=True)
    assert one["prefixes"] == {"text": str(tmp_path / "w1_text_document")}
    assert read_bytes(one["prefixes"]["text"]) == read_bytes(two["prefixes"]["text"])
    assert one["documents"] == len(DOCS) and one["tokens"] == two["tokens"]


@pytest.mark.parametrize("append_eod", [False, True])
def test_documents_and_eod(tmp_path, jsonl, sp_model, append_eod):
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=sp_model)
    summary = run(jsonl, str(tmp_path / "out"), sp_model, append_eod=append_eod)
    ds = IndexedDataset(summary["prefixes"]["text"])
    assert len(ds) == len(DOCS) and ds.dtype.name == "uint16"
    assert summary["tokens"] == int(ds.sequence_lengths.sum())
    for i, doc in enumerate(DOCS):
        ids = ds[i].tolist()
        assert (ids[-1] == tok.eod) == append_eod
        assert tok.detokenize(ids[:-1] if append_eod else ids) == doc


def test_text_files_glob_and_cli(tmp_path, sp_model):
    # Plain text: blank-line separated blocks are documents; a glob picks up both files in order.
    (tmp_path / "a.txt").write_text("first doc\nstill first\n\n\nsecond doc\n")
    (tmp_path / "b.txt").write_text("third doc\n")
    preprocess_module.main(["--input", str(tmp_path / "*.txt"), "--output-prefix", str(tmp_path / "txt"),
                            "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", sp_model])
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=sp_model)
    ds = IndexedDataset(str(tmp_path / "txt_text_document"))
    assert [tok.detokenize(ds[i]) for i in range(len(ds))] == ["first doc\nstill first", "second doc", "third doc"]


def test_hf_dataset_matches_jsonl(tmp_path, jsonl, sp_model):
    import datasets

    datasets.Dataset.from_dict({"text": DOCS}).save_to_disk(str(tmp_path / "saved"))
    from_hf = run(None, str(tmp_path / "hf"), sp_model, dataset=str(tmp_path / "saved"))
    from_file = run(None, str(tmp_path / "hfjson"), sp_model, dataset=jsonl)  # the `json` builder
    plain = run(jsonl, str(tmp_path / "plain"), sp_model)
    expected = read_bytes(plain["prefixes"]["text"])
    assert read_bytes(from_hf["prefixes"]["text"]) == expected
    assert read_bytes(from_file["prefixes"]["text"]) == expected


def test_missing_json_key_is_explained(tmp_path, jsonl, sp_model):
    with pytest.raises(DataError, match="--json-keys"):
        run(jsonl, str(tmp_path / "x"), sp_model, json_keys=["body"])
    assert not [f for f in os.listdir(tmp_path) if f.startswith("x_")]  # temp files cleaned up


def test_kjv_corpus(tmp_path):
    path = str(tmp_path / "kjv.jsonl")
    docs, size = write_kjv_jsonl(path)
    assert docs == 1189 and size == os.path.getsize(path) > 4_000_000
    lines = open(path, encoding="utf-8").read().splitlines()
    assert len(lines) == 1189
    assert json.loads(lines[0])["text"].startswith("In the beginning God created the heaven and the earth.")
    assert json.loads(lines[-1])["text"].endswith("Amen.")
    mtime = os.stat(path).st_mtime_ns
    assert write_kjv_jsonl(path) == (docs, size) and os.stat(path).st_mtime_ns == mtime  # complete: skipped
