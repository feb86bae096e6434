"""Megatron-style log lines and TensorBoard scalars (rank 0 writes both; the tags are
training/tensorboard_tags.py's)."""
from __future__ import annotations

import math
import sys
import threading
from datetime import datetime

from parallel.startup import print_rank0, rank
from training.tensorboard_tags import (Point, TensorBoardOptions, evaluation_points, peak_memory_mb,
                                       training_points, wall_clock_points)

__all__ = ["TensorBoardOptions", "TrainingLogger", "peak_memory_mb"]


def _mb(num_bytes: float) -> str:
    return f"{num_bytes / 2**20:.1f} MB"


def _outer_fields(s: dict) -> str:
    """The outer synchronization's fields (training/outer.py outer_fields), when it is on."""
    if "outer_steps" not in s:
        return ""
    drift = s["outer_drift"]   # NaN until an exchange is merged (a run's or a resume's first lines)
    return (f" outer steps: {s['outer_steps']} | cross-group MB: {s['cross_group_mb']:.3f} "
            f"| outer drift: {'n/a' if math.isnan(drift) else f'{drift:.3e}'} |"
            + (f" quorum: {s['quorum']} groups |" if "quorum" in s else "")
            + f" lm loss of: {s['loss_of']} |")


class TrainingLogger:
    """TensorBoard is a side output: when it cannot be written (a full disk, a directory gone
    read-only) the logger says so once and stops writing it; training and saving go on."""

    def __init__(self, tensorboard_dir: str | None, options: TensorBoardOptions | None = None):
        self.writer, self.tensorboard_dir = None, tensorboard_dir
        self.options = options or TensorBoardOptions()
        if tensorboard_dir and rank() == 0:
            from torch.utils.tensorboard import SummaryWriter

            _quiet_tensorboard_thread()
            try:
                self.writer = SummaryWriter(log_dir=tensorboard_dir, max_queue=self.options.queue_size)
            except OSError as e:   # its first write (the file's header event) failed
                self._give_up(e)

    def scalars(self, iteration: int, values: dict):
        self.points({name: (value, iteration) for name, value in values.items()})

    def points(self, points: dict[str, Point]):
        if self.writer is None:
            return
        try:
            for name, (value, step) in points.items():
                if value is not None and math.isfinite(value):
                    self.writer.add_scalar(name, value, step)
            self.writer.flush()   # once per log line: a write error shows here, not at exit
        except OSError as e:   # raised here by the writer's background thread, or by the writer
            self._give_up(e)

    def _give_up(self, error: OSError):
        writer, self.writer = self.writer, None
        print(f"> warning: TensorBoard stopped at --tensorboard-dir {self.tensorboard_dir} "
              f"({error.strerror or error}); training goes on without it", file=sys.stderr, flush=True)
        try:
            if writer is not None:
                writer.close()
        except OSError:
            pass

    def training_line(self, it: int, train_iters: int, s: dict):
        """Megatron's line (training.py, training_log): a timestamp, then its fields in its order,
        with skipped and nan iterations counted over this log interval and no grad norm when
        the last step was skipped; then ours (throughput and bytes sent)."""
        grad_norm = "" if s["grad_norm"] is None else f"| grad norm: {s['grad_norm']:.3f} "
        if s.get("params_norm") is not None:   # --log-params-norm
            grad_norm += f"| params norm: {s['params_norm']:.3f} "
        print_rank0(
            f" [{datetime.now().strftime('%Y-%m-%d %H:%M:%S')}]"
            f" iteration {it:8d}/{train_iters:8d} | consumed samples: {s['consumed']:12d} "
            f"| elapsed time per iteration (ms): {s['iter_ms']:.1f} | learning rate: {s['lr']:.6E} "
            f"| global batch size: {s['global_batch']:5d} | lm loss: {s['loss']:.6E} "
            f"| loss scale: {s['loss_scale']:.1f} {grad_norm}"
            f"| number of skipped iterations: {s['skipped']:3d} | number of nan iterations: {s['nan']:3d} "
            f"| samples per second: {s['samples_per_s']:.1f} | tokens per second: {s['tokens_per_s']:.0f} "
            f"| TFLOPs: {s['tflops']:.3f} | intra-node MB: {s['intra_mb']:.1f} "
            f"| inter-node MB: {s['inter_mb']:.1f} |" + _outer_fields(s))
        if it % self.options.log_interval == 0:   # --tensorboard-log-interval
            self.points(training_points(it, s, self.options))

    def wall_clock_line(self, it: int, ms: dict, samples: int = 0):
        """wall_clock_breakdown: DeepSpeed's per-phase line (this rank's times, ms per
        iteration over the log interval); TensorBoard gets time/<phase>."""
        print_rank0(" time (ms) | " + " | ".join(f"{name}: {value:.2f}" for name, value in ms.items()))
        if it % self.options.log_interval == 0:
            self.points(wall_clock_points(it, samples, ms, self.options))

    def memory_line(self, report: dict):
        m, p = report["measured_bytes"], report["predicted_bytes"]
        print_rank0(f"> model states per rank (ZeRO stage {report['stage']}, {report['world_size']} ranks, "
                    f"{report['dtype']}): parameters {_mb(m['parameters'])}, gradients {_mb(m['gradients'])}, "
                    f"optimizer {_mb(m['optimizer'])}, total {_mb(m['total'])}; ZeRO formula "
                    f"{_mb(p['total'])} (measured/formula {report['ratio']['total']:.3f})")
        peaks = report.get("peaks") or {}
        if peaks:
            names = [k[:-len("_peak")] for k in peaks if k.endswith("_peak") and k[:-5] + "_bound" in peaks]
            parts = [f"{name} {_mb(peaks[name + '_peak'])} (bound {_mb(peaks[name + '_bound'])})"
                     for name in names]
            print_rank0(f"> peak during the step: {', '.join(parts).replace('_', ' ')}")

    def validation_line(self, it: int, name: str, loss: float, end_of_training: bool = False,
                        drift: float | None = None, samples: int = 0):
        """Megatron's evaluation block: ` validation loss at iteration N | ...` during training,
        `... at iteration N on validation set | ...` / `... on test set | ...` at the end. With
        the outer synchronization the loss is the global parameters', and `drift` the groups'
        RMS distance from them. `samples`: the training samples consumed (the x axis of the
        `vs samples` tags)."""
        ppl = math.exp(min(20.0, loss))
        where = f"iteration {it}" + (f" on {name} set" if end_of_training or name == "test" else "")
        text = f" validation loss at {where} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} | "
        if drift is not None:
            text += f"of: the global parameters | groups' drift from them: {drift:.3e} | "
        print_rank0("-" * (len(text) + 1) + "\n" + text + "\n" + "-" * (len(text) + 1))
        self.points(evaluation_points(it, samples, name, loss, drift, self.options))

    def close(self):
        if self.writer is not None:
            try:
                self.writer.close()
            except OSError as e:
                self._give_up(e)


def _quiet_tensorboard_thread():
    """TensorBoard's writer thread re-raises a write error after handing it to the writer,
    which re-raises it in scalars(); without this Python would also print its traceback."""
    previous = threading.excepthook
    if getattr(previous, "tensorboard_quiet", False):
        return

    def hook(args):
        if not (issubclass(args.exc_type, OSError) and type(args.thread).__name__ == "_AsyncWriterThread"):
            previous(args)
    hook.tensorboard_quiet = True
    threading.excepthook = hook
