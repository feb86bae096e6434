"""Train a sentencepiece BPE tokenizer on JSON-lines or text files.

    python -m data.train_tokenizer --input /tmp/kjv.jsonl --vocab-size 8000 --model-prefix /tmp/kjv_sp

writes /tmp/kjv_sp.model (pass it as --tokenizer-model) and /tmp/kjv_sp.vocab.
"""

import argparse
import sys
import time

from data.cli import at_least, run
from data.documents import expand_inputs
from data.tokenizer import SentencePieceTokenizer, train_sentencepiece


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", nargs="+", required=True, help=".jsonl or .txt files")
    parser.add_argument("--json-keys", nargs="+", default=["text"], help="JSON fields holding text")
    parser.add_argument("--vocab-size", type=at_least(4), default=8000)
    parser.add_argument("--model-prefix", required=True, help="writes PREFIX.model and PREFIX.vocab")
    parser.add_argument("--input-sentence-size", type=at_least(1), default=300_000,
                        help="max lines sampled for training")
    args = parser.parse_args(argv)

    start = time.time()
    model = train_sentencepiece(expand_inputs(args.input), args.model_prefix, args.vocab_size, json_keys=args.json_keys,
                                input_sentence_size=args.input_sentence_size)
    tokenizer = SentencePieceTokenizer(model)
    print(f"wrote {model}: vocab {tokenizer.vocab_size}, eod id {tokenizer.eod}, {time.time() - start:.1f} s")


if __name__ == "__main__":
    sys.exit(run(main))
