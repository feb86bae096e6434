"""Documents from files: JSON lines (one object per line, text in `--json-keys`
fields) or plain text (documents separated by blank lines). Shared by
tokenizer training and preprocessing so both read inputs the same way."""

import glob
import json
import re


def expand_inputs(inputs):
    """Paths and glob patterns -> sorted list of existing files."""
    if isinstance(inputs, str):
        inputs = [inputs]
    paths = []
    for pattern in inputs:
        matches = sorted(glob.glob(pattern))
        if not matches:
            raise FileNotFoundError(f"--input {pattern}: no such file")
        paths.extend(matches)
    return paths


def read_documents(paths, json_keys):
    """Yield one ``{key: text}`` dict per document from JSON-lines or plain-text files."""
    for path in paths:
        with open(path, encoding="utf-8") as f:
            if path.endswith((".jsonl", ".json")):
                for line_number, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    record = json.loads(line)
                    missing = [k for k in json_keys if k not in record]
                    if missing:
                        raise KeyError(f"{path}:{line_number} has no field {missing[0]!r}; "
                                       f"choose the text fields with --json-keys (found {sorted(record)})")
                    yield {k: record[k] for k in json_keys}
            else:
                if len(json_keys) != 1:
                    raise ValueError(f"{path} is plain text, which has a single field; pass one --json-keys")
                for block in re.split(r"\n\s*\n", f.read()):
                    if block.strip():
                        yield {json_keys[0]: block.strip("\n")}
