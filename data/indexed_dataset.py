"""Megatron's memory-mapped ``.bin/.idx`` token dataset.

A dataset is a pair of files sharing a prefix, e.g. ``kjv_text_document.bin``
and ``kjv_text_document.idx``. ``.bin`` holds the token arrays back to back,
nothing else. ``.idx`` describes them (all little-endian):

    offset  size      field
    0       9         magic b"MMIDIDX\\x00\\x00"
    9       8         u64 version, always 1
    17      1         u8 dtype code (see DTYPE_CODES)
    18      8         u64 S = number of sequences
    26      8         u64 D = number of entries in document_indices (documents + 1)
    34      4*S       int32 sequence lengths, in tokens
    ..      8*S       int64 byte offset of each sequence inside .bin
    ..      8*D       int64 document indices: document k is sequences
                      [document_indices[k], document_indices[k+1]); starts at 0
                      and gets one entry appended per finished document

A document may hold several sequences (Megatron's sentence splitting); our
preprocessing writes one sequence per document, so "sequence" and "document"
usually coincide. Files written here are byte-identical to Megatron-LM's.
"""

import os
import shutil
import struct

import numpy as np

from common import ConfigError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, S, D -> 34 bytes

DTYPE_CODES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
CODE_OF_DTYPE = {np.dtype(t): code for code, t in DTYPE_CODES.items()}

PREPROCESS_HINT = "run `python -m data.preprocess --input DOCS.jsonl --output-prefix PREFIX ...` to create it"


class DataError(ConfigError):
    """A user error in the data (files, --data-path, --split): train.py reports it in one line."""


class IndexedDatasetError(DataError):
    """A .bin/.idx pair that is missing or cannot be trusted."""


def best_dtype(vocab_size):
    """Smallest token dtype for a vocabulary (Megatron's rule): uint16 halves the disk size."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def data_file_path(prefix):
    return prefix + ".bin"


def index_file_path(prefix):
    return prefix + ".idx"


class IndexedDatasetBuilder:
    """Appends token sequences to ``bin_path``; ``finalize`` writes the ``.idx``.

    Everything goes to ``*.tmp`` files first and is renamed into place by
    ``finalize``, so a crash never leaves a half-written dataset behind.
    """

    def __init__(self, bin_path, dtype=np.int32):
        self.bin_path = bin_path
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise IndexedDatasetError(f"unsupported token dtype {self.dtype}; use one of {sorted(map(str, CODE_OF_DTYPE))}")
        self._tmp_bin_path = bin_path + ".tmp"
        self._bin = open(self._tmp_bin_path, "wb")
        self.sequence_lengths = []
        self.document_indices = [0]

    def add_item(self, token_ids):
        """Append one sequence to the current document."""
        array = np.asarray(token_ids, dtype=self.dtype)
        self._bin.write(array.tobytes(order="C"))
        self.sequence_lengths.append(array.size)

    def end_document(self):
        """Close the current document: everything added since the last call."""
        self.document_indices.append(len(self.sequence_lengths))

    def add_document(self, token_ids, lengths=None):
        """Append a whole document: one sequence, or several if ``lengths`` splits it."""
        if lengths is None:
            self.add_item(token_ids)
        else:
            array = np.asarray(token_ids, dtype=self.dtype)
            for piece in np.split(array, np.cumsum(lengths)[:-1]):
                self.add_item(piece)
        self.end_document()

    def merge(self, other_prefix):
        """Append a finished dataset (e.g. one worker's shard) after what we have."""
        other = IndexedDataset(other_prefix)
        if other.dtype != self.dtype:
            raise IndexedDatasetError(f"cannot merge {other_prefix} ({other.dtype}) into a {self.dtype} dataset")
        offset = len(self.sequence_lengths)
        self.sequence_lengths.extend(other.sequence_lengths.tolist())
        self.document_indices.extend((offset + other.document_indices[1:]).tolist())
        with open(data_file_path(other_prefix), "rb") as f:
            shutil.copyfileobj(f, self._bin)

    def abort(self):
        """Give up: close and delete the temp file, leaving any previous dataset untouched."""
        self._bin.close()
        if os.path.exists(self._tmp_bin_path):
            os.remove(self._tmp_bin_path)

    def finalize(self, idx_path):
        """Write the index and move both files into place (.bin first, .idx last)."""
        self._bin.close()
        lengths = np.asarray(self.sequence_lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        documents = np.asarray(self.document_indices, dtype=np.int64)

        tmp_idx_path = idx_path + ".tmp"
        with open(tmp_idx_path, "wb") as f:
            f.write(HEADER.pack(MAGIC, VERSION, CODE_OF_DTYPE[self.dtype], len(lengths), len(documents)))
            f.write(lengths.tobytes(order="C"))
            f.write(pointers.tobytes(order="C"))
            f.write(documents.tobytes(order="C"))
        # The reader checks .bin's size against .idx, so a crash between these
        # two renames is detected rather than silently read.
        os.replace(self._tmp_bin_path, self.bin_path)
        os.replace(tmp_idx_path, idx_path)


class IndexedDataset:
    """Read-only, memory-mapped view of ``prefix.bin`` / ``prefix.idx``."""

    def __init__(self, prefix):
        self.prefix = prefix
        idx_path, bin_path = index_file_path(prefix), data_file_path(prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                raise IndexedDatasetError(f"no such file {path}; {PREPROCESS_HINT}")

        idx_size = os.path.getsize(idx_path)
        with open(idx_path, "rb") as f:
            header = f.read(HEADER.size)
        if len(header) < HEADER.size or header[:9] != MAGIC:
            raise IndexedDatasetError(
                f"{idx_path} is not a Megatron .idx file (bad magic {header[:9]!r}, expected {MAGIC!r}); "
                f"{PREPROCESS_HINT} again")
        _, version, code, num_sequences, num_doc_entries = HEADER.unpack(header)
        if version != VERSION:
            raise IndexedDatasetError(f"{idx_path} has index version {version}, only version {VERSION} is supported; "
                                      f"{PREPROCESS_HINT} again")
        if code not in DTYPE_CODES:
            raise IndexedDatasetError(f"{idx_path} has unknown dtype code {code} (known: {sorted(DTYPE_CODES)}); "
                                      f"{PREPROCESS_HINT} again")
        expected = HEADER.size + 12 * num_sequences + 8 * num_doc_entries
        if num_sequences and idx_size == expected + num_sequences:
            # Megatron-core's multimodal index appends one int8 mode per sequence.
            raise IndexedDatasetError(f"{idx_path} is a multimodal index (it has sequence_modes); multimodal "
                                      f"indexes are not supported: use a text dataset from data.preprocess")
        if idx_size != expected:
            what = "truncated" if idx_size < expected else "longer than its header says"
            raise IndexedDatasetError(f"{idx_path} is {what}: {idx_size} bytes, header implies {expected}; "
                                      f"{PREPROCESS_HINT} again")

        self.dtype = np.dtype(DTYPE_CODES[code])
        self._idx = np.memmap(idx_path, mode="r", dtype=np.uint8)
        offset = HEADER.size
        self.sequence_lengths = np.frombuffer(self._idx, np.int32, num_sequences, offset)
        offset += self.sequence_lengths.nbytes
        self.sequence_pointers = np.frombuffer(self._idx, np.int64, num_sequences, offset)
        offset += self.sequence_pointers.nbytes
        self.document_indices = np.frombuffer(self._idx, np.int64, num_doc_entries, offset)
        self._check_index(idx_path)

        bin_size = os.path.getsize(bin_path)
        expected_bin = int(self.sequence_pointers[-1] + self.sequence_lengths[-1] * self.dtype.itemsize) if num_sequences else 0
        if bin_size != expected_bin:
            raise IndexedDatasetError(f"{bin_path} is {bin_size} bytes but {idx_path} says {expected_bin}; "
                                      f"the pair is out of sync, {PREPROCESS_HINT} again")
        # np.memmap refuses empty files; an empty dataset gets an empty array.
        self._bin = np.memmap(bin_path, mode="r", dtype=np.uint8) if bin_size else np.zeros(0, np.uint8)

    def _check_index(self, idx_path):
        """Values a corrupt or foreign index gets wrong; one pass over arrays the training reads anyway."""
        if len(self.sequence_lengths) and int(self.sequence_lengths.min()) < 0:
            i = int(np.argmin(self.sequence_lengths))
            raise IndexedDatasetError(f"{idx_path} gives sequence {i} a negative length "
                                      f"({int(self.sequence_lengths[i])}); the index is corrupt, "
                                      f"{PREPROCESS_HINT} again")
        self._check_contiguous(idx_path)
        docs = self.document_indices
        if len(docs) == 0 or docs[0] != 0 or docs[-1] != len(self.sequence_lengths) or np.any(np.diff(docs) < 0):
            raise IndexedDatasetError(f"{idx_path} has document indices that do not run from 0 up to its "
                                      f"{len(self.sequence_lengths)} sequences; the index is corrupt, "
                                      f"{PREPROCESS_HINT} again")

    def _check_contiguous(self, idx_path, chunk=2**20):
        """`.bin` holds the sequences back to back and nothing else, so sequence 0
        starts at byte 0 and each one where the one before ends: pointer[i] =
        sum of lengths[:i] x itemsize. A pointer table that disagrees would train on
        wrong token spans. One vectorized pass over both arrays (12 bytes per
        sequence), `chunk` sequences at a time: a few ms per million sequences."""
        item = self.dtype.itemsize
        start = 0
        for lo in range(0, len(self.sequence_lengths), chunk):
            nbytes = self.sequence_lengths[lo:lo + chunk].astype(np.int64) * item
            ends = start + np.cumsum(nbytes)
            expected = ends - nbytes
            bad = np.flatnonzero(self.sequence_pointers[lo:lo + chunk] != expected)
            if bad.size:
                i = lo + int(bad[0])
                where = "byte 0" if i == 0 else f"byte {int(expected[bad[0]])}, where sequence {i - 1} ends"
                raise IndexedDatasetError(
                    f"{idx_path} says sequence {i} starts at byte {int(self.sequence_pointers[i])} of the .bin, "
                    f"but it must start at {where} (sequences are stored back to back); the index is "
                    f"corrupt, {PREPROCESS_HINT} again")
            start = int(ends[-1])

    def token_range(self, full_scan_bytes=2**30, samples=64, sample_bytes=2**20):
        """(smallest, largest token id, whether every token was read), to check the ids
        against the tokenizer's vocabulary; None for an empty ``.bin``.

        Up to ``full_scan_bytes`` every token is read (about a second per GiB). A bigger
        file is sampled: ``samples`` evenly spaced windows of ``sample_bytes``. A dataset
        made with another tokenizer has out-of-range ids all over, so the sample finds them;
        a single stray id in a huge file can slip through (the embedding then fails on it).
        """
        tokens = np.frombuffer(self._bin, self.dtype, len(self._bin) // self.dtype.itemsize)
        if len(tokens) == 0:
            return None
        if self._bin.nbytes <= full_scan_bytes:
            return int(tokens.min()), int(tokens.max()), True
        window = max(1, sample_bytes // self.dtype.itemsize)
        pieces = [tokens[s:s + window] for s in np.linspace(0, len(tokens) - window, samples).astype(np.int64)]
        return min(int(p.min()) for p in pieces), max(int(p.max()) for p in pieces), False

    def __len__(self):
        return len(self.sequence_lengths)

    def __getitem__(self, i):
        return self.get(i)

    def get(self, i, offset=0, length=None):
        """Tokens ``[offset, offset + length)`` of sequence ``i`` (a view, no copy)."""
        if not -len(self) <= i < len(self):
            raise IndexError(f"sequence {i} out of range for {self.prefix} with {len(self)} sequences")
        if length is None:
            length = int(self.sequence_lengths[i]) - offset
        start = int(self.sequence_pointers[i]) + offset * self.dtype.itemsize
        return np.frombuffer(self._bin, self.dtype, length, start)

    @property
    def num_documents(self):
        return len(self.document_indices) - 1
