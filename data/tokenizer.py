"""Tokenizers with Megatron's interface: ``vocab_size``, ``eod``, ``tokenize``, ``detokenize``.

Two kinds, chosen by ``--tokenizer-type``:

* ``SentencePieceTokenizer``: a sentencepiece ``.model`` file (``--tokenizer-model``),
  e.g. one made by ``python -m data.train_tokenizer``. End of document = the model's eos.
* ``GPT2BPETokenizer``: GPT-2's byte-level BPE from ``vocab.json`` + ``merges.txt``
  (``--vocab-file``, ``--merge-file``). End of document = ``<|endoftext|>``.
"""

import os

import sentencepiece as spm
import tokenizers

from data.documents import read_documents
from common import ConfigError

TOKENIZER_TYPES = ("SentencePieceTokenizer", "GPT2BPETokenizer")
GPT2_EOD_TOKEN = "<|endoftext|>"


class TokenizerError(ConfigError):
    """A tokenizer flag or file that cannot be used (a user error: train.py reports it in one line)."""


def _require_file(path, flag, how_to_create):
    if path is None or not os.path.isfile(path):
        what = "is required" if path is None else f"points to a missing file {path}"
        raise TokenizerError(f"{flag} {what}; {how_to_create}")
    if not os.access(path, os.R_OK):
        raise TokenizerError(f"{flag} {path} is not readable; check its permissions")


class SentencePieceTokenizer:
    name = "SentencePieceTokenizer"

    def __init__(self, model_file):
        _require_file(model_file, "--tokenizer-model",
                      "train one with `python -m data.train_tokenizer --input DOCS.jsonl --vocab-size 8000 --model-prefix P` (writes P.model)")
        self.model_file = model_file
        try:
            self._sp = spm.SentencePieceProcessor(model_file=model_file)
        except (RuntimeError, OSError):
            raise TokenizerError(f"--tokenizer-model {model_file} is not a sentencepiece .model file; pass the "
                                 f".model written by data.train_tokenizer (not the .vocab)") from None
        self.vocab_size = self._sp.get_piece_size()
        self.eod = self._sp.eos_id()
        if self.eod < 0:
            raise TokenizerError(f"{model_file} has no end-of-sentence piece (eos_id=-1); retrain it with eos_id set, "
                             "e.g. via data.tokenizer.train_sentencepiece")

    def tokenize(self, text):
        return self._sp.encode(text)

    def detokenize(self, ids):
        return self._sp.decode([int(i) for i in ids])

    def special_tokens(self) -> dict[str, str]:
        """Hugging Face's names for the model's unk, bos and eos pieces."""
        sp = self._sp
        return {name: sp.id_to_piece(i) for name, i in
                (("unk_token", sp.unk_id()), ("bos_token", sp.bos_id()), ("eos_token", sp.eos_id())) if i >= 0}

    def hf_tokenizer(self) -> tokenizers.Tokenizer:
        """The same tokenization as a `tokenizers.Tokenizer` (a Hugging Face export's
        tokenizer.json): the model's pieces, its merges, byte fallback and whitespace
        handling. Exact for BPE models with identity normalization, which
        data.train_tokenizer writes (checked on the whole bundled corpus); any other
        sentencepiece model is refused, since `tokenizers` would not reproduce it. One
        difference remains: the literal text of a control piece ("</s>") is read as that
        piece by Hugging Face, as plain text by sentencepiece."""
        from sentencepiece import sentencepiece_model_pb2

        proto = sentencepiece_model_pb2.ModelProto()
        proto.ParseFromString(self._sp.serialized_model_proto())
        norm, trainer = proto.normalizer_spec, proto.trainer_spec
        if (trainer.model_type != trainer.BPE or norm.name != "identity" or norm.remove_extra_whitespaces
                or trainer.treat_whitespace_as_suffix):
            raise TokenizerError(
                f"{self.model_file} is not a byte-fallback BPE model with identity normalization (model type "
                f"{trainer.model_type}, normalization {norm.name!r}): it cannot be written as an exact "
                f"tokenizer.json; tokenize with sentencepiece and this .model file")
        pieces = proto.pieces
        vocab = {p.piece: i for i, p in enumerate(pieces)}
        normal = {p.piece for p in pieces if p.type == p.NORMAL}
        # sentencepiece merges the adjacent pair whose result scores highest; BPE in
        # `tokenizers` applies merges by rank: every split of a piece, ranked by the piece.
        merges = sorted((vocab[p], vocab[p[:k]], vocab[p[k:]], p[:k], p[k:])
                        for p in normal for k in range(1, len(p)) if p[:k] in normal and p[k:] in normal)
        tok = tokenizers.Tokenizer(tokenizers.models.BPE(
            vocab=vocab, merges=[(a, b) for *_, a, b in merges], unk_token=pieces[trainer.unk_id].piece,
            byte_fallback=trainer.byte_fallback, fuse_unk=True))
        spaces = [tokenizers.normalizers.Replace(" ", "\u2581")]
        if norm.add_dummy_prefix:
            spaces.insert(0, tokenizers.normalizers.Prepend("\u2581"))
        tok.normalizer = tokenizers.normalizers.Sequence(spaces)
        tok.decoder = tokenizers.decoders.Sequence([
            tokenizers.decoders.Replace("\u2581", " "), tokenizers.decoders.ByteFallback(),
            tokenizers.decoders.Fuse()] + ([tokenizers.decoders.Strip(" ", 1, 0)] if norm.add_dummy_prefix else []))
        tok.add_special_tokens([tokenizers.AddedToken(p.piece, special=True, normalized=False)
                                for p in pieces if p.type in (p.UNKNOWN, p.CONTROL)])
        return tok


class GPT2BPETokenizer:
    name = "GPT2BPETokenizer"

    def __init__(self, vocab_file, merge_file):
        how = "use GPT-2's vocab.json/merges.txt, or train them with tokenizers.ByteLevelBPETokenizer(...).save_model(dir)"
        _require_file(vocab_file, "--vocab-file", how)
        _require_file(merge_file, "--merge-file", how)
        try:
            self._tok = tokenizers.ByteLevelBPETokenizer(vocab_file, merge_file)
        except Exception as e:  # the tokenizers library raises plain Exception on a bad file
            raise TokenizerError(f"--vocab-file {vocab_file} / --merge-file {merge_file} are not GPT-2 BPE files "
                                 f"(vocab.json and merges.txt): {str(e).splitlines()[0]}") from None
        self.vocab_size = self._tok.get_vocab_size()
        eod = self._tok.token_to_id(GPT2_EOD_TOKEN)
        if eod is None:
            raise TokenizerError(f"{vocab_file} has no {GPT2_EOD_TOKEN} token, which GPT-2 uses as end of document")
        self.eod = eod

    def tokenize(self, text):
        return self._tok.encode(text).ids

    def detokenize(self, ids):
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def special_tokens(self) -> dict[str, str]:
        return {"unk_token": GPT2_EOD_TOKEN, "bos_token": GPT2_EOD_TOKEN, "eos_token": GPT2_EOD_TOKEN}

    def hf_tokenizer(self) -> tokenizers.Tokenizer:
        """The very `tokenizers.Tokenizer` this class encodes with (a Hugging Face
        export's tokenizer.json), <|endoftext|> marked special (so the literal text
        "<|endoftext|>" is that token there, plain text here, as in GPT-2's own files)."""
        tok = tokenizers.Tokenizer.from_str(self._tok._tokenizer.to_str())
        tok.add_special_tokens([tokenizers.AddedToken(GPT2_EOD_TOKEN, special=True, normalized=False)])
        return tok


def build_tokenizer(tokenizer_type, tokenizer_model=None, vocab_file=None, merge_file=None):
    if tokenizer_type == "SentencePieceTokenizer":
        return SentencePieceTokenizer(tokenizer_model)
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    raise TokenizerError(f"unknown --tokenizer-type {tokenizer_type!r}; valid types: {', '.join(TOKENIZER_TYPES)}")


def train_sentencepiece(inputs, model_prefix, vocab_size, json_keys=("text",), input_sentence_size=300_000,
                        num_threads=None, **options):
    """Train a byte-fallback BPE sentencepiece model; writes ``model_prefix.model`` / ``.vocab``.

    ``inputs`` is a list of .jsonl/.txt paths (or one path), or an iterable of strings.
    Text is fed line by line: sentencepiece drops "sentences" longer than
    ``max_sentence_length`` bytes, and whole documents often are.
    Returns the path of the ``.model`` file.
    """
    if isinstance(inputs, str):
        inputs = [inputs]
    if all(isinstance(p, str) and os.path.isfile(p) for p in inputs):
        texts = (text for doc in read_documents(inputs, list(json_keys)) for text in doc.values())
    else:
        texts = inputs
    lines = (line for text in texts for line in text.split("\n") if line.strip())
    os.makedirs(os.path.dirname(os.path.abspath(model_prefix)), exist_ok=True)
    settings = dict(
        model_type="bpe",
        vocab_size=vocab_size,
        byte_fallback=True,  # any byte is encodable, so there is never an <unk>
        # Keep text exactly as is (no NFKC, no whitespace squeezing) so
        # detokenize(tokenize(s)) == s.
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        split_digits=True,
        unk_id=0, bos_id=1, eos_id=2, pad_id=-1,  # eos is our end-of-document token
        # Sample at most this many lines: trains in seconds, and BPE merges barely change beyond it.
        input_sentence_size=input_sentence_size,
        shuffle_input_sentence=True,
        max_sentence_length=16384,
        num_threads=num_threads or os.cpu_count() or 1,
        minloglevel=2,  # quiet
    )
    settings.update(options)
    try:
        spm.SentencePieceTrainer.train(sentence_iterator=lines, model_prefix=model_prefix, **settings)
    except RuntimeError as e:  # e.g. "Vocabulary size too high (8000). Please set it to a value <= 1203."
        message = str(e).strip().splitlines()[-1].split("] ", 1)[-1] if str(e).strip() else "sentencepiece failed"
        raise TokenizerError(f"--vocab-size {vocab_size}: sentencepiece could not train on this input: "
                             f"{message}") from None
    return model_prefix + ".model"
