"""The .bin/.idx format: round trips, byte-exact compatibility, and corrupt-file errors."""

import os
import struct

import numpy as np
import pytest

from data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder, IndexedDatasetError, best_dtype

DOCS = [[1, 2, 3], [4, 5], [60000, 7, 8, 9]]


def write(prefix, docs, dtype):
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype)
    for doc in docs:
        builder.add_document(doc)
    builder.finalize(prefix + ".idx")
    return prefix


def hand_written(prefix, docs):
    """uint16 dataset written from the format description alone, one sequence per document."""
    lengths = [len(d) for d in docs]
    pointers = np.cumsum([0] + lengths[:-1]) * 2
    with open(prefix + ".bin", "wb") as f:
        for doc in docs:
            f.write(struct.pack(f"<{len(doc)}H", *doc))
    with open(prefix + ".idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00")
        f.write(struct.pack("<Q", 1))  # version
        f.write(struct.pack("<B", 8))  # uint16
        f.write(struct.pack("<Q", len(docs)))  # sequences
        f.write(struct.pack("<Q", len(docs) + 1))  # document index entries
        f.write(struct.pack(f"<{len(docs)}i", *lengths))
        f.write(struct.pack(f"<{len(docs)}q", *pointers))
        f.write(struct.pack(f"<{len(docs) + 1}q", *range(len(docs) + 1)))
    return prefix


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_round_trip(tmp_path, dtype):
    docs = DOCS + [[70000, 1]] if dtype == np.int32 else DOCS
    ds = IndexedDataset(write(str(tmp_path / "d"), docs, dtype))
    assert ds.dtype == dtype and len(ds) == len(docs)
    for i, doc in enumerate(docs):
        assert ds[i].tolist() == doc and ds[i].dtype == dtype
    assert ds.sequence_lengths.tolist() == [len(d) for d in docs]
    assert ds.document_indices.tolist() == list(range(len(docs) + 1))
    assert ds.get(2, offset=1, length=2).tolist() == [7, 8]
    assert ds.get(2, offset=2).tolist() == [8, 9]


def test_several_sequences_per_document(tmp_path):
    prefix = str(tmp_path / "d")
    builder = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    builder.add_item([1, 2])
    builder.add_item([3])
    builder.end_document()
    builder.add_document([4, 5, 6], lengths=[1, 2])
    builder.finalize(prefix + ".idx")
    ds = IndexedDataset(prefix)
    assert [ds[i].tolist() for i in range(len(ds))] == [[1, 2], [3], [4], [5, 6]]
    assert ds.document_indices.tolist() == [0, 2, 4]
    assert ds.num_documents == 2


def test_hand_written_file_is_read_and_builder_matches_bytes(tmp_path):
    hand = hand_written(str(tmp_path / "hand"), DOCS)
    ds = IndexedDataset(hand)
    assert [ds[i].tolist() for i in range(len(ds))] == DOCS
    ours = write(str(tmp_path / "ours"), DOCS, np.uint16)
    for ext in (".bin", ".idx"):
        assert open(ours + ext, "rb").read() == open(hand + ext, "rb").read()


def test_merge_equals_single_build(tmp_path):
    a = write(str(tmp_path / "a"), DOCS[:2], np.uint16)
    b = write(str(tmp_path / "b"), DOCS[2:], np.uint16)
    merged = str(tmp_path / "merged")
    builder = IndexedDatasetBuilder(merged + ".bin", np.uint16)
    builder.merge(a)
    builder.merge(b)
    builder.finalize(merged + ".idx")
    single = write(str(tmp_path / "single"), DOCS, np.uint16)
    for ext in (".bin", ".idx"):
        assert open(merged + ext, "rb").read() == open(single + ext, "rb").read()


def test_nothing_visible_until_finalize(tmp_path):
    prefix = str(tmp_path / "d")
    builder = IndexedDatasetBuilder(prefix + ".bin", np.uint16)
    builder.add_document([1, 2])
    assert not os.path.exists(prefix + ".bin") and not os.path.exists(prefix + ".idx")
    builder.finalize(prefix + ".idx")
    assert sorted(os.listdir(tmp_path)) == ["d.bin", "d.idx"]  # no temp files left


def test_best_dtype():
    assert best_dtype(8000) == np.uint16
    assert best_dtype(50257) == np.uint16
    assert best_dtype(65500) == np.int32
    assert best_dtype(128000) == np.int32


def corrupt(prefix, offset=None, data=None, truncate=None):
    path = prefix + ".idx"
    raw = bytearray(open(path, "rb").read())
    if data is not None:
        raw[offset:offset + len(data)] = data
    if truncate is not None:
        raw = raw[:truncate]
    open(path, "wb").write(raw)


@pytest.mark.parametrize("damage, message", [
    (lambda p: corrupt(p, 0, b"NOTANIDX\x00"), "bad magic"),
    (lambda p: corrupt(p, 9, struct.pack("<Q", 2)), "version 2"),
    (lambda p: corrupt(p, 17, bytes([9])), "unknown dtype code 9"),
    (lambda p: corrupt(p, truncate=-8), "truncated"),
    (lambda p: corrupt(p, truncate=20), "bad magic"),  # shorter than the header itself
    (lambda p: open(p + ".bin", "ab").write(b"\x00\x00"), "out of sync"),
    # The tables disagree with each other while every size still adds up (DOCS, uint16:
    # lengths at byte 34, pointers at 46): each would train on wrong token spans.
    (lambda p: corrupt(p, 46 + 8, struct.pack("<q", 2)), "sequence 1 starts at byte 2 of the .bin, but it "
                                                         "must start at byte 6, where sequence 0 ends"),
    (lambda p: corrupt(p, 34, struct.pack("<2i", 2, 3)), "sequence 1 starts at byte 6 of the .bin, but it "
                                                         "must start at byte 4"),
    (lambda p: corrupt(p, 46, struct.pack("<q", 2)), "sequence 0 starts at byte 2 of the .bin, but it must "
                                                     "start at byte 0"),
])
def test_corrupt_index_is_rejected(tmp_path, damage, message):
    prefix = write(str(tmp_path / "d"), DOCS, np.uint16)
    damage(prefix)
    with pytest.raises(IndexedDatasetError, match=message) as error:
        IndexedDataset(prefix)
    assert prefix in str(error.value)


@pytest.mark.parametrize("missing", [".idx", ".bin"])
def test_missing_file(tmp_path, missing):
    prefix = write(str(tmp_path / "d"), DOCS, np.uint16)
    os.remove(prefix + missing)
    with pytest.raises(IndexedDatasetError, match="data.preprocess") as error:
        IndexedDataset(prefix)
    assert prefix + missing in str(error.value)
    assert isinstance(error.value, ValueError)
