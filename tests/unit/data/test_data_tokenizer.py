"""Tokenizers: round trips, end-of-document ids, training, and helpful errors."""

import json

import pytest
import tokenizers

from data import train_tokenizer
from data.tokenizer import GPT2_EOD_TOKEN, TokenizerError, build_tokenizer, train_sentencepiece

TEXTS = [
    "In the beginning God created the heaven and the earth.",
    "And the earth was without form, and void; and darkness was upon the face of the deep.",
    "And God said, Let there be light: and there was light.\nAnd God saw the light, that it was good.",
    "The quick brown fox jumps over the lazy dog 1234567890 times.",
] * 20
SAMPLE = "And God said, Let there be light:  and there was light.\n\nNumbers 42 & naïve café ☃"


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    return train_sentencepiece(TEXTS, str(tmp_path_factory.mktemp("sp") / "tiny"), vocab_size=320)


def test_sentencepiece_round_trip(sp_model):
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=sp_model)
    assert tok.name == "SentencePieceTokenizer" and tok.vocab_size == 320
    ids = tok.tokenize(SAMPLE)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.detokenize(ids) == SAMPLE  # exact, including double spaces, newlines, unseen characters
    assert len(tok.tokenize("the earth")) < len("the earth")  # learned merges, not bytes
    assert 0 <= tok.eod < tok.vocab_size and tok.eod not in tok.tokenize(" ".join(TEXTS))


def test_train_tokenizer_cli_on_jsonl(tmp_path, capsys):
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"body": t}) + "\n" for t in TEXTS))
    train_tokenizer.main(["--input", str(corpus), "--json-keys", "body", "--vocab-size", "340",
                          "--model-prefix", str(tmp_path / "cli")])
    assert "vocab 340" in capsys.readouterr().out
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(tmp_path / "cli.model"))
    assert tok.detokenize(tok.tokenize(TEXTS[0])) == TEXTS[0]


def test_gpt2_bpe_round_trip(tmp_path):
    trainer = tokenizers.ByteLevelBPETokenizer()
    trainer.train_from_iterator(TEXTS, vocab_size=400, special_tokens=[GPT2_EOD_TOKEN], show_progress=False)
    vocab_file, merge_file = trainer.save_model(str(tmp_path))
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file)
    assert tok.name == "GPT2BPETokenizer"
    assert tok.eod == json.load(open(vocab_file))[GPT2_EOD_TOKEN]
    ids = tok.tokenize(SAMPLE)
    assert tok.detokenize(ids) == SAMPLE
    assert max(ids) < tok.vocab_size and tok.eod not in ids


def test_errors_name_the_flag(tmp_path):
    with pytest.raises(TokenizerError, match="--tokenizer-model.*data.train_tokenizer"):
        build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(tmp_path / "nope.model"))
    with pytest.raises(TokenizerError, match="--tokenizer-model is required"):
        build_tokenizer("SentencePieceTokenizer")
    with pytest.raises(TokenizerError, match="--vocab-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "vocab.json"), merge_file="m.txt")
    (tmp_path / "vocab.json").write_text("{}")
    with pytest.raises(TokenizerError, match="--merge-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(tmp_path / "vocab.json"), merge_file=str(tmp_path / "m.txt"))
    with pytest.raises(TokenizerError, match="SentencePieceTokenizer, GPT2BPETokenizer"):
        build_tokenizer("BertWordPieceLowerCase")


# -- the Hugging Face export's tokenizer.json gives the training ids ---------------------------
@pytest.fixture(scope="module")
def kjv_tokenizer(tmp_path_factory):
    """A sentencepiece model as data.train_tokenizer makes them, trained on a slice of
    the bundled corpus (the whole corpus is the check)."""
    from data.corpus import kjv_chapters
    chapters = kjv_chapters()
    model = train_sentencepiece(chapters[:150], str(tmp_path_factory.mktemp("kjv") / "sp"), vocab_size=1500)
    return build_tokenizer("SentencePieceTokenizer", tokenizer_model=model), chapters


def saved_and_loaded(tok, directory):
    transformers = pytest.importorskip("transformers")
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok.hf_tokenizer(),
                                         **tok.special_tokens()).save_pretrained(str(directory))
    return transformers.AutoTokenizer.from_pretrained(str(directory))


@pytest.mark.slow
def test_sentencepiece_export_encodes_the_whole_corpus_as_training_does(kjv_tokenizer, tmp_path):
    tok, chapters = kjv_tokenizer
    hf = saved_and_loaded(tok, tmp_path)
    for text in chapters + [SAMPLE, "", " ", "  two  spaces\n\n tabs\tand 12345 漢字 🙂"]:
        assert hf(text).input_ids == tok.tokenize(text), text[:60]
        assert hf.decode(hf(text).input_ids) == text
    assert hf.eos_token_id == tok.eod


def test_unexportable_sentencepiece_model_is_refused(tmp_path):
    model = train_sentencepiece(TEXTS, str(tmp_path / "uni"), vocab_size=320, model_type="unigram")
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=model)
    with pytest.raises(TokenizerError, match="cannot be written as an exact tokenizer.json"):
        tok.hf_tokenizer()


def test_gpt2_bpe_export_encodes_as_training_does(tmp_path):
    trainer = tokenizers.ByteLevelBPETokenizer()
    trainer.train_from_iterator(TEXTS, vocab_size=400, special_tokens=[GPT2_EOD_TOKEN], show_progress=False)
    vocab_file, merge_file = trainer.save_model(str(tmp_path))
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab_file, merge_file=merge_file)
    hf = saved_and_loaded(tok, tmp_path / "hf")
    for text in TEXTS[:4] + [SAMPLE, " lead", "  two  spaces\n\n"]:
        assert hf(text).input_ids == tok.tokenize(text), text
    assert hf.eos_token_id == tok.eod
