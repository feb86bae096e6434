"""Checkpoints: sharded, reshardable on load, and never half-written.

Layout (one directory per saved iteration, Megatron's tracker file on top):

    SAVE/latest_checkpointed_iteration.txt   "100"
    SAVE/iter_0000100/.metadata              torch.distributed.checkpoint (DCP): where each slice lives
    SAVE/iter_0000100/__3_0.distcp           rank 3's slices: its fp32 masters and optimizer moments
    SAVE/iter_0000100/meta.json              iteration, consumed samples, model config, the run,
                                             the tokenizer, arguments, loss scaler, every rank's RNG states
    SAVE/iter_0000100/tokenizer/...          rank 0: the tokenizer's files   (rank0_files.py)
    SAVE/iter_0000100/pytorch_model.bin      rank 0, if asked: the whole model in 16 bits (DeepSpeed's)
    SAVE/iter_0000100/checksums.json         size and CRC-32 of every file above

Every rank writes only what it owns: each tensor of `engine.checkpoint_state()`
is saved as one flat global tensor (`model.<name>`, `optim.<moment>.<name>`),
of which each rank holds the slice its ZeRO partition gives it (a DTensor
sharded on dim 0). DCP records the slices, so a checkpoint loads on any number
of ranks and any stage: each rank reads the parts of the files that overlap
its new slices, never the whole model. 16-bit weights (stage 3's shards,
stages 1-2's full copies) and hpZ's secondary partition are not saved; they
are rebuilt from the fp32 masters.

Atomicity: everything is written into `iter_0000100.tmp` (DCP fsyncs its
files); after every rank has finished, rank 0 writes the checksums and meta,
renames the directory, and only then rewrites the tracker (write, fsync,
rename). A crash, kill or full disk at any point leaves the previous
checkpoint as the latest; a stale `.tmp` directory is removed by the next save.
Loading verifies every checksum first (the files are split over the ranks).

Whose checkpoints: meta.json names the run ("run", kept across resumes); --keep-last removes only
this run's, and a save that would replace another run's checkpoint or move the tracker back is
refused unless `overwrite` (preflight.py refuses such a --save at start).

The modules, each importing only those above it here and nothing else of training/:
    files.py         the files on disk: names, atomic writes, the tracker, which iterations are
                     complete, pruning, meta.json, checksums, the line naming a damaged checkpoint
    state.py         the engine's state as DCP sees it, every RNG's state as JSON
    rank0_files.py   what rank 0 writes beside the shards: the tokenizer, DeepSpeed's 16-bit model
    save.py          save_checkpoint (and in the background), its refusals, a failed save's line
    load.py          load_checkpoint, on any world size and stage, saying what reset
    checkpointer.py  train.py's: where a run stands (Progress), the resume from --load, the
                     Checkpointer that saves into --save
    preflight.py     train.py's checks of --load and --save before any work

Callers import the names below from `training.checkpoint`.
"""

from training.checkpoint.checkpointer import Checkpointer, Progress, make_checkpointer, resume
from training.checkpoint.files import (CHECKSUMS, META, TRACKER, CheckpointError, checksums_json, complete_iterations,
                                       damaged, file_crc32, iteration_dir, latest_iteration, read_meta,
                                       resolve_checkpoint, verify_checksums)
from training.checkpoint.load import load_checkpoint
from training.checkpoint.preflight import check_checkpoint_dirs, check_load_path, preflight_save_dir
from training.checkpoint.rank0_files import CONSOLIDATED_16BIT, TOKENIZER_COPIES
from training.checkpoint.save import checkpoint_bytes, optimizer_moments, save_checkpoint
from training.checkpoint.state import single_process_quiet

__all__ = ["CHECKSUMS", "CONSOLIDATED_16BIT", "META", "TOKENIZER_COPIES", "TRACKER", "CheckpointError", "Checkpointer",
           "Progress", "check_checkpoint_dirs", "check_load_path", "checkpoint_bytes", "checksums_json",
           "complete_iterations", "damaged", "file_crc32", "iteration_dir", "latest_iteration", "load_checkpoint",
           "make_checkpointer", "optimizer_moments", "preflight_save_dir", "read_meta", "resolve_checkpoint", "resume",
           "save_checkpoint", "single_process_quiet", "verify_checksums"]
