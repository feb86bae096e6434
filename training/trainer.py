"""The training loop: steps, logging windows, evaluation, checkpoints, and when to stop.

    trainer = Trainer(LoopConfig.from_args(args), engine, comm, device, schedule, logger, checkpointer,
                      train_batches, valid_ds, test_ds, flops, progress)
    early_stop = trainer.run()   # None when training reached --train-iters

Each iteration: micro-batches forward and backward, one engine.step(), a log line
every --log-interval iterations (averaged over the window since the last), an
evaluation every --eval-interval and a checkpoint every --save-interval. As in
Megatron, the learning rate follows the applied optimizer steps (a skipped fp16
step does not advance it) and each evaluation reads the next --eval-iters
batches of the validation set, where the last one stopped (also across a resume). A signal
(SIGTERM, SIGINT), --exit-interval, --exit-duration-in-mins or a loss that stays non-finite
stops the loop after saving.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, fields

import torch

from data.sampler import build_data_loader
from parallel.comm import Communicator
from parallel.startup import print_rank0
from training.checkpoint import Progress, iteration_dir
from training.outer import final_sync, global_weights, outer_fields, outer_iteration
from training.signals import StopRequest
from zeropp.memory import memory_report


class TrainingDiverged(RuntimeError):
    """The loss stayed non-finite: training stopped after saving the last good state."""


def params_norm(engine, comm: Communicator, device: torch.device) -> float:
    """--log-params-norm: the 2-norm of the fp32 weights (the masters in 16-bit training), from
    each rank's shard, each unsharded weight counted once."""
    total = 0.0
    for key, state in engine.checkpoint_state().items():
        if key.startswith("model.") and (state.sharded or comm.topology.rank == 0):
            total += float(state.local.detach().float().pow(2).sum())
    t = torch.tensor([total], dtype=torch.float64, device=device)
    comm.all_reduce(t, phase="other")
    return math.sqrt(t.item())


def mean_over_ranks(comm: Communicator, values, device: torch.device):
    """The mean over ranks of a number, or of each number in a list."""
    t = torch.tensor(values if isinstance(values, list) else [values], dtype=torch.float64,
                     device=device)  # NCCL reduces GPU tensors only
    comm.all_reduce(t, phase="other")
    t /= comm.topology.world_size
    return t.tolist() if isinstance(values, list) else t.item()


@dataclass
class Step:
    """One iteration as this rank saw it."""
    lr: float
    loss: float            # mean over the micro-batches
    skipped: bool          # the engine skipped the update (fp16 overflow, non-finite gradients)
    loss_scale: float
    grad_norm: float

    @property
    def bad(self) -> bool:
        return self.skipped or not math.isfinite(self.loss)


@dataclass
class LogWindow:
    """What the next training log line averages over."""
    start: float = field(default_factory=time.time)
    loss_sum: float = 0.0      # of the finite losses
    finite_steps: int = 0
    iterations: int = 0
    skipped: int = 0
    nan_iterations: int = 0

    def add(self, step: Step):
        self.skipped += int(step.skipped)
        if math.isfinite(step.loss):
            self.loss_sum += step.loss
            self.finite_steps += 1
        else:
            self.nan_iterations += 1
        self.iterations += 1

    def mean_loss(self) -> float:
        return self.loss_sum / max(self.finite_steps, 1)


@dataclass
class CrossNodeTraffic:
    """Bytes sent across nodes (means over ranks) summed over the logged iterations, for the summary."""
    iterations: int = 0
    sent_bytes: float = 0.0
    plain_zero3_bytes: float = 0.0   # what ZeRO-3 without ZeRO++ would have sent


class NonFinitePolicy:
    """fp16 skips overflowing steps and backs off its loss scale; in fp32/bf16 one bad step stops.
    --max-nan-iters N stops after N consecutive bad iterations in any precision."""

    def __init__(self, max_nan_iters: int | None, dtype: torch.dtype):
        self.max_nan_iters = max_nan_iters
        self.limit = max_nan_iters or (None if dtype == torch.float16 else 1)
        self.bad_streak = 0

    def record(self, step: Step) -> int:
        """Count `step`; the streak of bad iterations it ends."""
        self.bad_streak = self.bad_streak + 1 if step.bad else 0
        return self.bad_streak

    def must_stop(self, bad_streak: int) -> bool:
        """Whether a streak (the longest over the job's ranks) stops training."""
        return self.limit is not None and bad_streak >= self.limit


@dataclass
class EarlyStop:
    """Why training stopped before --train-iters, and where the last good state went."""
    iteration: int
    checkpoint: str | None            # None without --save
    save_dir: str | None
    signal_name: str | None = None    # SIGTERM, SIGINT or --exit-interval; None: the loss diverged
    bad_streak: int = 0
    max_nan_iters: int | None = None

    def report(self):
        """The signal's line, or TrainingDiverged."""
        path = self.checkpoint
        if self.signal_name:
            why = "reached" if self.signal_name.startswith("--") else "received"
            print_rank0(f"> {self.signal_name} {why}: stopped after iteration {self.iteration}; " + (
                f"checkpoint {path}; resume with --load {self.save_dir}" if path else "nothing saved (no --save)"))
            return
        raise TrainingDiverged(
            f"the loss or gradient was not finite for {self.bad_streak} consecutive iteration(s), the last at "
            f"iteration {self.iteration}; those steps were skipped, so the weights are the last good ones" +
            (f", saved to {path}" if path else " (not saved: no --save)") +
            "; lower --lr, check the data" + (", or raise --max-nan-iters" if self.max_nan_iters else ""))


@dataclass(frozen=True)
class LoopConfig:
    """What the loop reads of the command line, typed at the edge (train.py: `LoopConfig.from_args`)."""
    train_iters: int
    global_batch_size: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    seq_length: int
    log_interval: int
    log_params_norm: bool
    eval_interval: int | None
    eval_iters: int
    save: str | None                     # --save (None: no checkpoints)
    save_interval: int | None
    exit_interval: int | None
    exit_duration_in_mins: float | None
    start_time: float                    # when the job started (parse_args), for --exit-duration-in-mins
    max_nan_iters: int | None

    @classmethod
    def from_args(cls, args) -> LoopConfig:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


class Trainer:
    """Runs training from `iteration` (and `consumed_samples`, where `train_batches`
    starts) to --train-iters; `cross_node` holds the bytes sent across nodes for the summary.
    `comm` is the engine's (a group's with --outer-sync-interval), `job_comm` the whole job's
    (default `comm`): stops and evaluations are agreed over the job."""

    def __init__(self, cfg: LoopConfig, engine, comm: Communicator, device: torch.device, schedule, logger,
                 checkpointer, train_batches, valid_ds, test_ds, flops_per_iteration: float, progress: Progress,
                 job_comm: Communicator | None = None):
        self.cfg, self.engine, self.comm, self.device = cfg, engine, comm, device
        self.job = job_comm or comm
        self.schedule, self.logger = schedule, logger
        self.checkpointer = checkpointer  # None without --save
        self.train_batches, self.valid_ds, self.test_ds = train_batches, valid_ds, test_ds
        self.flops_per_iteration = flops_per_iteration
        self.iteration, self.consumed_samples = progress.iteration, progress.consumed_train_samples
        self.consumed_valid_samples = progress.consumed_valid_samples
        self._valid_batches = None   # the validation loader, built at the first evaluation
        self.nonfinite = NonFinitePolicy(cfg.max_nan_iters, engine.dtype)
        self.window: LogWindow | None = None   # the iterations since the last log line, while running
        self.cross_node = CrossNodeTraffic()
        self.saved_at: int | None = None   # the iteration of the last save (a stop saves unless it is this one)

    # -- the loop ------------------------------------------------------------------------------
    def run(self) -> EarlyStop | None:
        """Train to --train-iters, then evaluate and save; an EarlyStop if a signal or a
        diverging loss stopped it first (its checkpoint written)."""
        stop = StopRequest()
        self.window = LogWindow()  # the first log line's time starts here
        self.comm.reset_stats()
        self.engine.train()
        first_iteration = self.iteration
        diverged = signalled = exiting = False
        exit_interval = self.cfg.exit_interval
        while self.iteration < self.cfg.train_iters:
            step = self.train_step(log_memory=self.iteration == first_iteration + 1)
            self.window.add(step)
            # Agreed over the job: a group that stopped alone would leave the others in a collective.
            signalled, bad_streak = stop.agreed(self.job, self.device, self.nonfinite.record(step))
            diverged = self.nonfinite.must_stop(bad_streak)
            self.nonfinite.bad_streak = max(self.nonfinite.bad_streak, bad_streak)
            if self.iteration % self.cfg.log_interval == 0 or self.iteration == self.cfg.train_iters:
                self.log_window(step)
            if diverged or signalled:
                break
            if self.iteration == self.cfg.train_iters:
                final_sync(self.engine)   # the outer mode: the global parameters take the last steps
            self.evaluate_and_save_on_interval()
            if self.iteration < self.cfg.train_iters:
                exiting = ("--exit-interval" if exit_interval and self.iteration % exit_interval == 0 else
                           "--exit-duration-in-mins" if self.out_of_time() else False)
            if exiting:
                break
        stop.restore()
        if diverged or signalled or exiting:
            return self.stop_early(stop.name if signalled else exiting or None)
        self.finish()
        return None

    def out_of_time(self) -> bool:
        """--exit-duration-in-mins: whether any rank has run that long since start-up (agreed over the
        job, as Megatron: one all-reduce an iteration, only with the flag)."""
        limit = self.cfg.exit_duration_in_mins
        if not limit:
            return False
        up = torch.tensor([time.time() - self.cfg.start_time >= 60 * limit], dtype=torch.int32, device=self.device)
        self.job.all_reduce(up, op=torch.distributed.ReduceOp.MAX, phase="other")
        return bool(up.item())

    def train_step(self, log_memory: bool = False) -> Step:
        """One iteration: forward and backward over the micro-batches, then the optimizer step."""
        cfg = self.cfg
        # Skipped updates do not advance the schedule (Megatron: `if update_successful`).
        lr = self.schedule(self.iteration - self.engine.skipped_steps)
        self.engine.set_lr(lr)
        loss = 0.0
        for _ in range(cfg.gradient_accumulation_steps):
            batch = next(self.train_batches).to(self.device)
            micro_loss = self.engine(batch[:, :-1], batch[:, 1:])
            self.engine.backward(micro_loss)
            loss += micro_loss.item() / cfg.gradient_accumulation_steps
        if log_memory:  # Adam's state exists after one step; gradients until step()
            self.logger.memory_line(memory_report(self.engine))
        result = self.engine.step()
        self.iteration = outer_iteration(self.engine, self.iteration + 1)   # --lighthouse: a heal may move it
        self.consumed_samples += cfg.global_batch_size
        return Step(lr, loss, result.skipped, result.loss_scale, result.grad_norm)

    def log_window(self, last: Step):
        """The training line for the iterations since the last one (means over ranks)."""
        cfg, window = self.cfg, self.window
        elapsed = (time.time() - window.start) / window.iterations
        stats = self.comm.reset_stats()
        # Bytes: the mean over ranks (in a ring some ranks send across nodes, others do not).
        loss, intra, inter, plain_inter = mean_over_ranks(
            self.comm, [window.mean_loss(), stats.intra_node_bytes, stats.inter_node_bytes,
                        stats.plain_inter_node_bytes], self.device)
        self.cross_node.iterations += window.iterations
        self.cross_node.sent_bytes += inter
        self.cross_node.plain_zero3_bytes += plain_inter
        samples_per_s = cfg.global_batch_size / elapsed
        self.logger.training_line(self.iteration, cfg.train_iters, {
            "consumed": self.consumed_samples, "iter_ms": elapsed * 1000, "lr": last.lr,
            "global_batch": cfg.global_batch_size, "loss": loss,
            "loss_scale": last.loss_scale, "grad_norm": None if last.skipped else last.grad_norm,
            "skipped": window.skipped, "nan": window.nan_iterations, "samples_per_s": samples_per_s,
            "tokens_per_s": samples_per_s * cfg.seq_length,
            "tflops": self.flops_per_iteration / elapsed / (self.comm.topology.world_size * self.comm.topology.groups) / 1e12,
            "intra_mb": intra / window.iterations / 2**20,
            "inter_mb": inter / window.iterations / 2**20, **outer_fields(self.engine, stats, window.iterations),
            "params_norm": params_norm(self.engine, self.comm, self.device) if cfg.log_params_norm else None})
        if self.engine.clock.enabled:   # wall_clock_breakdown
            seconds = self.engine.clock.read_and_reset()
            self.logger.wall_clock_line(self.iteration, {name: 1000 * s / window.iterations
                                                         for name, s in seconds.items()}, self.consumed_samples)
        self.window = LogWindow()

    def evaluate_and_save_on_interval(self):
        cfg, iteration = self.cfg, self.iteration
        if self.valid_ds is not None and cfg.eval_interval and iteration % cfg.eval_interval == 0:
            loss, drift = self.validate()
            self.logger.validation_line(iteration, "validation", loss, drift=drift, samples=self.consumed_samples)
        if self.save_due():
            self.save()
        if self.window.iterations == 0:
            self.window.start = time.time()  # evaluation and saving are not training time

    # -- the end ---------------------------------------------------------------------------------
    def stop_early(self, signal_name: str | None) -> EarlyStop:
        """Save the last good state (waiting for the files) on a signal, --exit-interval or a
        diverging loss (unless --save-interval just saved this iteration)."""
        path = None
        if self.checkpointer is not None and self.saved_at == self.iteration:   # --save-interval saved it
            self.checkpointer.finish()
            path = iteration_dir(self.cfg.save, self.iteration)
        elif self.checkpointer is not None:
            path = self.save(wait=True)
        return EarlyStop(self.iteration, path, self.cfg.save, signal_name, self.nonfinite.bad_streak,
                         self.cfg.max_nan_iters)

    def finish(self):
        """After the last iteration: the final validation (unless just run), the test set, the last save."""
        cfg, iteration = self.cfg, self.iteration
        if self.valid_ds is not None and iteration % cfg.eval_interval != 0:
            loss, drift = self.validate()
            self.logger.validation_line(iteration, "validation", loss, end_of_training=True, drift=drift,
                                        samples=self.consumed_samples)
        if self.test_ds is not None:
            test_batches = iter(self._loader(self.test_ds, 0))
            loss, drift = self.evaluate(test_batches)
            self.logger.validation_line(iteration, "test", loss, drift=drift, samples=self.consumed_samples)
        if self.checkpointer is not None:
            if not self.save_due():  # unless --save-interval just saved it
                self.save()
            self.checkpointer.finish()

    # -- evaluation and checkpoints --------------------------------------------------------------
    def _loader(self, dataset, consumed: int):
        topology = self.job.topology   # the job's ranks: the samples a run without groups reads
        return build_data_loader(dataset, consumed, self.cfg.micro_batch_size, topology.rank, topology.world_size)

    def validate(self) -> tuple[float, float | None]:
        """The validation loss over the next --eval-iters global batches (Megatron's
        iterator: each evaluation continues where the last stopped; it starts over
        at the end of the set)."""
        if self._valid_batches is None:
            self._valid_batches = self._cycle(self.valid_ds, self.consumed_valid_samples % len(self.valid_ds))
        out = self.evaluate(self._valid_batches)
        self.consumed_valid_samples += self.cfg.eval_iters * self.cfg.global_batch_size
        return out

    def _cycle(self, dataset, consumed: int):
        """`dataset`'s batches from `consumed` samples on, starting over at its end."""
        while True:
            yield from self._loader(dataset, consumed)
            consumed = 0

    def evaluate(self, batches) -> tuple[float, float | None]:
        """Mean loss over --eval-iters global batches drawn from `batches` (the
        engine computes with the exact weights: those a checkpoint saves; with the outer
        synchronization the global parameters, which an export takes), and the groups' drift
        from them (None without the outer synchronization)."""
        cfg = self.cfg
        self.engine.eval()
        total, count = 0.0, 0
        with torch.no_grad(), self.engine.clock.paused(), global_weights(self.engine) as drift:
            # every sample of --eval-iters global batches over this job's ranks (with --lighthouse, one group's)
            for _ in range(cfg.eval_iters * cfg.global_batch_size // (cfg.micro_batch_size * self.job.topology.world_size)):
                batch = next(batches, None)
                if batch is None:
                    break
                batch = batch.to(self.device)
                total += self.engine(batch[:, :-1], batch[:, 1:]).item()
                count += 1
        self.engine.train()
        return mean_over_ranks(self.job, total / max(count, 1), self.device), drift

    def save_due(self) -> bool:
        """Whether --save-interval saves this iteration."""
        interval = self.cfg.save_interval
        return self.checkpointer is not None and bool(interval) and self.iteration % interval == 0

    def save(self, wait: bool = False) -> str:
        self.saved_at = self.iteration
        return self.checkpointer.save(Progress(self.iteration, self.consumed_samples, self.consumed_valid_samples),
                                      wait=wait)
