"""Documents from files: JSON lines (one object per line, text in `--json-keys`
fields) or plain text (documents separated by blank lines). Shared by
tokenizer training and preprocessing so both read inputs the same way."""

import glob
import json
import os
import re

from data.indexed_dataset import DataError


def expand_inputs(inputs):
    """Paths and glob patterns -> sorted list of existing files."""
    if isinstance(inputs, str):
        inputs = [inputs]
    paths = []
    for pattern in inputs:
        matches = sorted(glob.glob(pattern))
        if not matches:
            raise DataError(f"--input {pattern}: no such file")
        paths.extend(matches)
    return paths


def read_documents(paths, json_keys):
    """Yield one ``{key: text}`` dict per document from JSON-lines or plain-text files."""
    for path in paths:
        if os.path.isdir(path):
            raise DataError(f"--input {path} is a directory; pass the files (a glob such as {path}/*.jsonl works)")
        try:
            with open(path, encoding="utf-8") as f:
                if path.endswith((".jsonl", ".json")):
                    yield from _json_lines(f, path, json_keys)
                else:
                    if len(json_keys) != 1:
                        raise DataError(f"{path} is plain text, which has a single field; pass one --json-keys")
                    for block in re.split(r"\n\s*\n", f.read()):
                        if block.strip():
                            yield {json_keys[0]: block.strip("\n")}
        except UnicodeDecodeError as e:
            raise DataError(f"--input {path} is not UTF-8 text (byte {e.start}); convert it to UTF-8") from None
        except OSError as e:
            raise DataError(f"--input {path} cannot be read: {e.strerror}") from None


def _json_lines(f, path, json_keys):
    for line_number, line in enumerate(f, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{line_number} is not a JSON object ({e.msg}); JSON-lines input "
                            f"has one object per line, or name the file .txt for plain text") from None
        if not isinstance(record, dict):
            raise DataError(f"{path}:{line_number} is not a JSON object; JSON-lines input has one object per line")
        missing = [k for k in json_keys if k not in record]
        if missing:
            raise DataError(f"{path}:{line_number} has no field {missing[0]!r}; "
                            f"choose the text fields with --json-keys (found {sorted(record)})")
        yield {k: record[k] for k in json_keys}
