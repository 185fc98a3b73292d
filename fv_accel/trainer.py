"""The loop: accumulate, backward, clip, step, log, checkpoint, validate.

The trainer knows the loop and Accelerate, never a model's internals or a loss.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import json
import logging
import math
import os
import signal
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from fv_accel.config import micro_batches_per_step
from fv_accel.data.loader import NONFINITE_MARK, describe_samples, flagged_rows

logger = logging.getLogger(__name__)

# A launcher relays a signal it got itself (accelerate launch sends SIGTERM to the trainer on Ctrl-C or
# SIGTERM): a repeat this soon after the first is the same request, not a "stop now".
SIGNAL_REPEAT_GRACE_S = 2.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# When set, the main process writes the checkpoint's path into this file after a signal stopped the
# run (accelerate_configs/slurm_multinode.sh requeues the job when it is there).
STOPPED_FILE_ENV = "FV_ACCEL_STOPPED_FILE"


# Library warnings a skipped step causes, never a bug: torch's LR scheduler says this when it steps
# before its optimizer ever has, which a skipped first step does (the schedule follows the step
# count, skipped steps included, so that a resume finds it where the step count says).
SKIPPED_STEP_WARNINGS = (r"Detected call of `lr_scheduler\.step\(\)` before `optimizer\.step\(\)`",)


@contextlib.contextmanager
def skipped_step_warnings_silenced() -> Iterator[None]:
    """Inside the block, the warnings of SKIPPED_STEP_WARNINGS are not shown (the filters before it
    come back after it)."""
    with warnings.catch_warnings():
        for message in SKIPPED_STEP_WARNINGS:
            warnings.filterwarnings("ignore", message=message, category=UserWarning)
        yield


@contextlib.contextmanager
def stop_signals_blocked_in_new_threads() -> Iterator[None]:
    """Threads started inside this block (the collective library's worker and socket threads, at
    process-group set-up) inherit a signal mask that blocks SIGTERM and SIGINT, so the kernel hands
    those signals to the main thread, whose handler only sets a flag, never to a thread in the
    middle of a socket read. A signal that arrives inside the block is delivered when it ends."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def engine_steps_in_backward(accelerator: Any) -> bool:
    """True under DeepSpeed: Accelerate's `backward` runs `engine.step()` (clip, optimizer step,
    LR schedule step, zero grad) on the last micro-batch, and its optimizer and scheduler `step`
    are no-ops, so nothing after `backward` can keep an update from the weights."""
    from accelerate.utils import DistributedType

    return accelerator is not None and getattr(accelerator, "distributed_type", None) == DistributedType.DEEPSPEED


def resolve_nan_policy(cfg: Any, steps_in_backward: bool, *, log: bool = False) -> str:
    """`training.loop.nan_policy` for the engine (`steps_in_backward`: DeepSpeed, see
    engine_steps_in_backward): "auto" is skip, or stop under DeepSpeed; "skip" under DeepSpeed is a
    ConfigError (a step that the engine already applied cannot be skipped)."""
    policy = cfg.training.loop.nan_policy
    if not steps_in_backward:
        return "skip" if policy == "auto" else policy
    if policy == "skip":
        from fv_accel.config import ConfigError

        raise ConfigError(
            "training.loop.nan_policy: skip is not possible under DeepSpeed (Accelerate's backward runs "
            "engine.step() on the last micro-batch, so a non-finite step cannot be left out): use stop or auto"
        )
    if policy == "auto" and log:
        logger.info(
            "training.loop.nan_policy auto: stop under DeepSpeed (its engine steps inside backward; a "
            "non-finite loss stops the run before backward, with a checkpoint from before the step)"
        )
    return "stop"


def target_grad_norms(targets: list[list]) -> list[torch.Tensor]:
    """The total gradient 2-norm of each target (a list of parameters; 0 for a target without
    gradients), from one fused reduction: one `torch._foreach_norm` per (device, dtype) over the
    gradients of all targets, then each target's per-tensor norms stacked into its total. Bitwise
    what `torch.nn.utils.get_total_norm` gives per target: a tensor's norm does not depend on the
    other tensors of the call, and each total stacks its norms in get_total_norm's order (grouped
    by device and dtype in order of first appearance). Nothing is read on the host."""
    from torch.utils._foreach_utils import _has_foreach_support

    grads = [[p.grad for p in params if p.grad is not None] for params in targets]
    flat = [g for target in grads for g in target]
    groups: dict[tuple, list[int]] = {}
    for i, g in enumerate(flat):
        groups.setdefault((g.device, g.dtype), []).append(i)
    per_tensor: list[Any] = [None] * len(flat)
    with torch.no_grad():
        for (device, _), where in groups.items():
            tensors = [flat[i] for i in where]
            if _has_foreach_support(tensors, device):
                norms = torch._foreach_norm(tensors, 2.0)
            else:
                norms = [torch.linalg.vector_norm(t, 2.0) for t in tensors]
            for i, norm in zip(where, norms):
                per_tensor[i] = norm
        totals, start = [], 0
        for target in grads:
            where = range(start, start + len(target))
            start += len(target)
            if not target:
                totals.append(torch.tensor(0.0))
                continue
            first_seen: dict[tuple, int] = {}
            for i in where:
                first_seen.setdefault((flat[i].device, flat[i].dtype), len(first_seen))
            ordered = sorted(where, key=lambda i: first_seen[(flat[i].device, flat[i].dtype)])
            device = target[0].device
            totals.append(torch.linalg.vector_norm(torch.stack([per_tensor[i].to(device) for i in ordered]), 2.0))
    return totals


def _stderr_fd() -> int:
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both
        return 2


class TrainingStopped(RuntimeError):
    """The run stopped on a numerical fault (training.loop.nan_policy); `checkpoint` holds its state."""

    def __init__(self, message: str, checkpoint: Optional[Path]):
        super().__init__(message)
        self.checkpoint = checkpoint


class TrainerCallback:
    """Hooks for validation, EMA and other observers; each gets the trainer."""

    def on_train_start(self, trainer: "Trainer") -> None: ...

    def on_step_end(self, trainer: "Trainer", step: int, logs: dict) -> None: ...

    def on_train_end(self, trainer: "Trainer") -> None: ...

    # Tensors this callback keeps in checkpoints per rank (in the rank's fv_rank_<r>.safetensors).
    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None: ...

    # Files this callback writes into a checkpoint folder itself (called on every rank; the EMA
    # writes one file of full tensors) and reads back on resume.
    def write_checkpoint_files(self, trainer: "Trainer", folder: Path) -> None: ...

    def read_checkpoint_files(self, trainer: "Trainer", folder: Path) -> None: ...

    # Bytes this callback adds to a checkpoint (for the disk-space check before the first one).
    def checkpoint_bytes(self) -> int:
        return 0

    # Figures for the end-of-run summary table (e.g. the best held-out loss).
    def summary(self) -> dict[str, Any]:
        return {}


@dataclasses.dataclass
class LoopSettings:
    """The recipe's loop settings, read once when the loop starts."""

    model: Any  # the student's transformer
    params: list  # its trainable parameters (clipped, checked for a non-finite norm)
    models: list  # the transformers of every trained role (the student's first)
    accumulation: int  # micro-batches per optimizer step (config.micro_batches_per_step)
    max_steps: int
    max_norm: float
    ckpt_every: int
    log_every: int
    nan_policy: str  # resolved for the engine (resolve_nan_policy)
    max_skips: int
    data_parallel: int  # the processes of one context-parallel group train on the same samples

    @classmethod
    def from_run(cls, cfg: Any, accelerator: Any, method: Any, steps_in_backward: bool) -> "LoopSettings":
        student = method.student
        return cls(
            model=student.transformer,
            params=student.trainable_parameters(),
            models=[role.transformer for role in method.trainable_roles().values()],
            accumulation=micro_batches_per_step(cfg),
            max_steps=cfg.training.loop.max_train_steps,
            max_norm=cfg.callbacks.grad_clip.max_grad_norm,
            ckpt_every=cfg.training.checkpoint.training_state_checkpointing_steps,
            log_every=cfg.training.tracker.log_every,
            nan_policy=resolve_nan_policy(cfg, steps_in_backward),
            max_skips=cfg.training.loop.max_consecutive_skips,
            data_parallel=accelerator.num_processes // cfg.training.model.context_parallel.degree,
        )


@dataclasses.dataclass
class StepOutcome:
    """What one optimizer step left: the means of its micro-batches' losses and metrics (device
    tensors, read only on the steps that log), its sizes and timings, and its fault if any."""

    loss_sums: dict = dataclasses.field(default_factory=dict)
    metric_sums: dict = dataclasses.field(default_factory=dict)
    samples: int = 0
    tokens: int = 0
    data_wait: float = 0.0
    step_time: float = 0.0
    grad_norm: Any = None
    grad_norms: dict = dataclasses.field(default_factory=dict)  # per clip target, when the method clips several
    fault: Optional[str] = None
    applied: bool = False  # DeepSpeed: the engine applied this step although its gradient norm is non-finite
    engine_skipped: bool = False  # DeepSpeed: its fp16 loss scaler dropped this step's update (overflow)
    micro_records: list = dataclasses.field(default_factory=list)  # (loss, timesteps) per micro-batch, read only to report a fault
    micro_samples: list = dataclasses.field(default_factory=list)  # the samples' names and NaN/inf flags, read only to report a fault
    last_batch: Any = None
    logs: dict = dataclasses.field(default_factory=dict)


# The end line's loss: the mean over this many logged steps at each end of the run (one step's
# loss is noisy: its timestep is drawn at random).
LOSS_ENDS_WINDOW = 10


def smoothed_loss_ends(history: list[dict], window: int = LOSS_ENDS_WINDOW) -> dict:
    """The mean training loss of the first and of the last `window` logged steps (fewer when the
    run logged fewer than 2 x `window`: the two windows never overlap); non-finite losses (skipped
    steps) are left out. Keys first_loss_mean, last_loss_mean, loss_mean_window."""
    losses = [float(h["loss"]) for h in history if "loss" in h and math.isfinite(float(h["loss"]))]
    k = max(1, min(window, len(losses) // 2))
    if not losses:
        return {"first_loss_mean": math.nan, "last_loss_mean": math.nan, "loss_mean_window": 0}
    return {"first_loss_mean": sum(losses[:k]) / k, "last_loss_mean": sum(losses[-k:]) / k, "loss_mean_window": k}


def describe_loss_ends(summary: dict, log_every: int) -> str:
    """The end line's loss, saying how it is smoothed: `loss (mean of the first/last 10 steps) A -> B`."""
    k = summary["loss_mean_window"]
    steps = "step" if k == 1 else f"{k} steps" if log_every == 1 else f"{k} logged steps (every {log_every})"
    how = f"first/last {steps}" if k == 1 else f"mean of the first/last {steps}"
    return f"loss ({how}) {summary['first_loss_mean']:.4f} -> {summary['last_loss_mean']:.4f}"


@dataclasses.dataclass
class RunTally:
    """This run's steps, samples and latent tokens (all data-parallel ranks), for the summary."""

    steps: int = 0
    samples: int = 0
    tokens: int = 0

    def add(self, out: StepOutcome, data_parallel: int) -> None:
        self.steps += 1
        self.samples += out.samples * data_parallel
        self.tokens += out.tokens * data_parallel


class Trainer:
    def __init__(self, run: Any, callbacks: Optional[list[TrainerCallback]] = None):
        self.run_spec = run
        self.accelerator = run.accelerator
        self.config = run.config
        self.method = run.method
        self.dataloader = run.dataloader
        self.start_step = run.start_step
        self.callbacks = list(run.callbacks if callbacks is None else callbacks)
        self.step = run.start_step
        self.history: list[dict] = []
        self.output_dir = Path(self.config.training.checkpoint.output_dir)
        self._metrics_file = None
        # Numerical faults (training.loop.nan_policy); restored on resume.
        resumed = getattr(run, "trainer_state", None) or {}
        self.skipped_steps = int(resumed.get("skipped_steps", 0))
        self.consecutive_skips = int(resumed.get("consecutive_skips", 0))
        # Recipe changes made on resume, with the step from which each took effect.
        self.recipe_changes: list[dict] = list(resumed.get("recipe_changes") or [])
        # The output folder's lock (fv_accel.output_dir), released when the run ends, however it ends.
        self.output_lock = getattr(run, "output_lock", None)
        self._trackers_finished = False
        self._progress: Any = None
        self.last_checkpoint: Optional[Path] = None
        self._stop_signal: Optional[int] = None
        self._stop_signal_time = 0.0
        # A callback's request to stop with a checkpoint (request_stop), with its reason.
        self._stop_reason: Optional[str] = None
        # Set by the per-step check: some rank was asked to stop (several processes).
        self._stop_agreed = False
        # The gradient norm's value (and each clip target's), read by the per-step check.
        self._norm_value = math.nan
        self._norm_values: list[float] = []
        self._dump_registered = False
        # DeepSpeed: the loss is checked before backward, since the engine steps inside it.
        self.steps_in_backward = engine_steps_in_backward(self.accelerator)
        # Video sparse attention: the sparsity of the last step trained (a resumed run's), until the next.
        self._set_vsa_step(self.start_step)

    def _set_vsa_step(self, step: int) -> None:
        """The method's VSA ramp at optimizer step `step` (nothing with dense attention)."""
        set_step = getattr(self.method, "set_vsa_step", None)
        if set_step is not None:
            set_step(step)

    # ---- trainer counters kept in checkpoints (metadata.json) ----
    def state_dict(self) -> dict:
        return {
            "skipped_steps": self.skipped_steps,
            "consecutive_skips": self.consecutive_skips,
            "recipe_changes": self.recipe_changes,
        }

    def save_checkpoint(self) -> Path:
        from fv_accel.checkpoint import save_checkpoint

        if self.last_checkpoint is None or self.last_checkpoint.name != f"checkpoint-{self.step}":
            self.last_checkpoint = save_checkpoint(self, self.step)
        return self.last_checkpoint

    def _checkpoint_due(self, every: int, max_steps: int) -> bool:
        """Checkpointing on (`every` > 0): every `every` steps, and at the last step, so that a finished
        run can be extended (`--max_train_steps M --resume_from_checkpoint latest`)."""
        return every > 0 and (self.step % every == 0 or self.step == max_steps)

    # ---- preemption: SIGTERM/SIGINT stop at the next step boundary with a checkpoint ----
    def _install_signal_handlers(self) -> dict:
        if threading.current_thread() is not threading.main_thread():
            return {}
        previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}
        for sig in STOP_SIGNALS:
            # Restart system calls the signal interrupts (SA_RESTART). The kernel hands a signal to
            # any thread, and the collective library's socket threads (gloo, NCCL's proxy) do not all
            # retry a read or write that fails with EINTR; the handler only sets a flag anyway.
            signal.siginterrupt(sig, False)
        if hasattr(signal, "SIGUSR1") and signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL:
            # `kill -USR1 <pid>` prints every thread's Python stack to stderr, even while the main
            # thread is blocked in a collective: the first thing to look at in a hung run. Written
            # to the process's stderr descriptor (sys.stderr may be a captured stream with none).
            try:
                faulthandler.register(signal.SIGUSR1, file=_stderr_fd(), all_threads=True)
                self._dump_registered = True
            except (OSError, ValueError, RuntimeError) as err:  # a diagnostic aid never stops a run
                logger.debug("no SIGUSR1 stack dump: %s", err)
        return previous

    def _restore_signal_handlers(self, previous: dict) -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if self._dump_registered:
            faulthandler.unregister(signal.SIGUSR1)
            self._dump_registered = False

    def _on_signal(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        now = time.monotonic()
        if self._stop_signal is None:
            self._stop_signal, self._stop_signal_time = signum, now
            # os.write: print() is not safe inside a handler that may interrupt another print.
            os.write(2, f"received {name}: saving a checkpoint after the current step (send it again to exit at once)\n".encode())
            return
        if now - self._stop_signal_time < SIGNAL_REPEAT_GRACE_S:
            return
        os.write(2, f"received {name} again: exiting now without a checkpoint\n".encode())
        os._exit(128 + signum)

    def _stop_requested(self) -> bool:
        """Whether to stop at this step boundary. One process: its own signal flag. Several: the
        flag all ranks agreed on in this step's check (`_find_fault` carries it in the same
        collective), so every rank stops at the same step without a collective of its own."""
        if self.accelerator.num_processes > 1:
            return self._stop_agreed
        return self._stop_signal is not None or self._stop_reason is not None

    def request_stop(self, reason: str) -> None:
        """A callback asks the run to stop at a step boundary with a checkpoint, as a signal would
        (several processes agree on it in the next step's check); `reason` is said when it stops."""
        self._stop_reason = self._stop_reason or reason

    # ---- gradient clipping ----
    def _engine_clips(self) -> bool:
        """Whether clipping goes through Accelerate (clipped where the norm is taken): FSDP2 (its
        DTensor-aware norm), DeepSpeed (the norm its engine step took), other sharded engines and
        fp16 (the loss scaler unscales first). Otherwise the trainer takes the norms itself
        (`target_grad_norms`) and scales afterwards, only where the norm is over the limit."""
        from accelerate.utils import DistributedType

        acc = self.accelerator
        unsharded = (DistributedType.NO, DistributedType.MULTI_GPU, DistributedType.MULTI_CPU)
        return self.steps_in_backward or acc.distributed_type not in unsharded or acc.scaler is not None

    def _grad_norm(self, params: list, max_norm: float) -> tuple[Any, bool]:
        """One clip target's gradient norm, and whether its gradients are already clipped to `max_norm`
        (`_grad_norms` with one target)."""
        norms, clipped = self._grad_norms([params], max_norm)
        return norms[0], clipped

    def _grad_norms(self, targets: list[list], max_norm: float) -> tuple[list, bool]:
        """The global gradient norm of each clip target (a list of parameters), and whether the
        gradients are already clipped to `max_norm`.

        torch's clip_grad_norm_ (under Accelerate's) rescales every gradient every step, by exactly
        1.0 when the norm is under the limit, to spare a host sync: a second pass over all gradients.
        The loop reads the norms anyway, in its one sync per step (the non-finite check), so on
        unsharded runs without a loss scaler the norms of all targets come from one fused reduction
        (`target_grad_norms`) and `_clip_to` rescales afterwards, only a target whose norm is over the
        limit; the gradients are bit-identical either way. FSDP2, DeepSpeed, other sharded engines
        and fp16 keep Accelerate's path (clipped here, per target).
        """
        from accelerate.utils import DistributedType

        acc = self.accelerator
        limit = max_norm if max_norm > 0 else math.inf
        if acc.distributed_type == DistributedType.FSDP and getattr(acc, "is_fsdp2", False):
            return [self._fsdp2_clip(params, limit) for params in targets], True
        if self._engine_clips():
            return [acc.clip_grad_norm_(params, limit) for params in targets], True
        return target_grad_norms(targets), False

    def _fsdp2_clip(self, params: list, limit: float) -> Any:
        """Accelerate's FSDP2 clip (unscale, then its DTensor-aware norm and clip) called directly:
        `accelerator.clip_grad_norm_` first looks for the prepared model the parameters belong to by
        comparing lists with `==`, which fails between the DTensors of two models of one shape."""
        self.accelerator.unscale_gradients()
        return self.accelerator._clip_grad_norm_dtensor_aware(params, limit)

    @staticmethod
    def _clip_to(params: list, max_norm: float, norm: torch.Tensor, norm_value: float) -> None:
        """Scale the gradients down to `max_norm` given their norm (tensor and its value on the host),
        by torch's own rule: when max_norm / (norm + 1e-6) < 1 (a NaN norm is left to the fault check)."""
        if max_norm > 0 and math.isfinite(max_norm) and max_norm / (norm_value + 1e-6) < 1.0:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)

    # ---- numerical faults: checked before the optimizer step ----
    def _find_fault(
        self, loss: torch.Tensor, grad_norm: Any, micro: list, step: int, *, scaler_skipped: bool = False
    ) -> Optional[str]:
        """A message naming the step, loss and timesteps if the loss or gradient norm is non-finite
        on any rank (every rank gets the same answer).

        The step's one host sync and, across processes, its one collective: the flags, the stop
        request (`_stop_agreed`) and the norms (`_norm_values`, one per clip target in `grad_norm`'s
        list) travel in one tensor (max over ranks)."""
        acc = self.accelerator
        loss_bad = ~torch.isfinite(loss.detach().float().reshape(()))
        # Under fp16 the grad scaler owns overflowing gradients (it skips the step and lowers the
        # scale); under DeepSpeed fp16 the engine's own loss scaler does (`scaler_skipped`).
        norm_checked = grad_norm is not None and acc.scaler is None and not scaler_skipped
        # One norm, or one per clip target (a method that clips several roles).
        grad_norms = grad_norm if isinstance(grad_norm, (list, tuple)) else [grad_norm]
        # FSDP2 returns a total norm as a replicated DTensor.
        grad_norms = [n.full_tensor() if hasattr(n, "full_tensor") else n for n in grad_norms]
        norms = torch.stack([
            torch.as_tensor(n if norm_checked else 0.0, dtype=torch.float32, device=loss_bad.device).reshape(())
            for n in grad_norms
        ])
        bad_norms = ~torch.isfinite(norms)
        norm_bad = bad_norms.any()
        stop = torch.tensor(1.0 if self._stop_signal is not None or self._stop_reason else 0.0, device=norms.device)
        # The lowest and highest process whose loss is non-finite, through the same maximum.
        rank, world = acc.process_index if acc.num_processes > 1 else 0, acc.num_processes
        lowest, highest = (loss_bad.float() * (world - rank)).to(norms.device), (loss_bad.float() * (rank + 1)).to(norms.device)
        head_values = torch.stack([loss_bad.float(), norm_bad.float(), stop, lowest, highest])
        packed = torch.cat([head_values, torch.where(bad_norms, 0.0, norms)]).to(acc.device)
        if acc.num_processes > 1:
            import torch.distributed as dist

            dist.all_reduce(packed, op=dist.ReduceOp.MAX)
        loss_flag, norm_flag, stop_flag, lowest_code, highest_code, *self._norm_values = packed.tolist()
        self._norm_value = self._norm_values[0] if len(self._norm_values) == 1 else math.hypot(*self._norm_values)
        norm = norms[0] if len(grad_norms) == 1 else norms.norm()
        self._stop_agreed = self._stop_agreed or stop_flag > 0
        if not (loss_flag > 0 or norm_flag > 0):
            return None
        losses = [float(l) for l, _ in micro]
        timesteps = [None if t is None else [round(v, 2) for v in t.detach().float().flatten().tolist()] for _, t in micro]
        what = "loss" if loss_flag > 0 else "gradient norm"
        head, values = f"non-finite {what} at step {step}", f"loss={float(loss):.6g} (micro-batches {losses})"
        if loss_flag > 0 and world > 1:
            first, last = world - int(lowest_code), int(highest_code) - 1
            if bool(loss_bad):
                head += f" on this process ({rank})"
            else:
                others = f" (and others, up to process {last})" if last != first else ""
                head += f" on process {first}{others}; this process ({rank}) has a finite loss"
        return f"{head}: {values}, grad_norm={float(norm) if norm_checked else None}, timesteps={timesteps}"

    # ---- checkpoint hooks for callbacks ----
    def extra_state_tensors(self) -> dict[str, torch.Tensor]:
        out = {f"method/{k}": v for k, v in self.method.state_tensors().items()}
        for i, cb in enumerate(self.callbacks):
            out.update({f"cb{i}/{k}": v for k, v in cb.state_tensors().items()})
        return out

    def load_extra_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        self.method.load_state_tensors({k[len("method/"):]: v for k, v in tensors.items() if k.startswith("method/")})
        for i, cb in enumerate(self.callbacks):
            prefix = f"cb{i}/"
            cb.load_state_tensors({k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)})

    def write_checkpoint_files(self, folder: Path) -> None:
        for cb in self.callbacks:
            cb.write_checkpoint_files(self, folder)

    def read_checkpoint_files(self, folder: Path) -> None:
        for cb in self.callbacks:
            cb.read_checkpoint_files(self, folder)

    def callback_checkpoint_bytes(self) -> int:
        return sum(cb.checkpoint_bytes() for cb in self.callbacks)

    # ---- the end of a run: trackers finished and the output folder released on every path ----
    def _end_training(self, *, crashed: bool) -> None:
        """Finish the trackers (a W&B run is marked finished, or failed after a crash). A normal end
        (done, stopped by a signal or a fault policy) is Accelerate's `end_training`, which also
        destroys the process group; after a crash only the trackers are finished, since another
        rank may still be inside a collective."""
        if self._trackers_finished or self.accelerator is None:
            return
        self._trackers_finished = True
        if not crashed:
            self.accelerator.end_training()
            return
        for tracker in getattr(self.accelerator, "trackers", []):
            try:
                run = getattr(tracker, "run", None)
                if getattr(tracker, "name", None) == "wandb" and run is not None:
                    run.finish(exit_code=1)
                else:
                    tracker.finish()
            except Exception as err:  # noqa: BLE001 - the crash itself is what must be reported
                logger.warning("could not finish tracker %s: %s: %s", getattr(tracker, "name", tracker), type(err).__name__, err)

    # ---- logging ----
    def log_metrics(self, logs: dict, step: int) -> None:
        """Scalars to the trackers and logs/metrics.jsonl (main process writes); for callbacks."""
        self._log(logs, step)

    def _log(self, logs: dict, step: int) -> None:
        acc = self.accelerator
        acc.log(logs, step=step)
        if acc.is_main_process:
            if self._metrics_file is None:
                path = self.output_dir / "logs" / "metrics.jsonl"
                path.parent.mkdir(parents=True, exist_ok=True)
                self._metrics_file = open(path, "a", encoding="utf-8")
            self._metrics_file.write(json.dumps({"step": step, **logs}) + "\n")
            self._metrics_file.flush()

    def _write_summary(self, summary: dict, *, plots: bool) -> None:
        """logs/summary.json, the summary table on stdout and, if asked, the plots (main process)."""
        from fv_accel.telemetry import format_summary

        path = self.output_dir / "logs" / "summary.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary, indent=2, default=str) + "\n")
        shown = {k: v for k, v in summary.items() if v is not None}
        print("run summary\n" + format_summary(shown), flush=True)
        if plots:
            try:
                from fv_accel.plot import log_png_images, write_plots

                written = write_plots(self.output_dir)
                if written:
                    print(f"plots: {', '.join(str(p) for p in written)}", flush=True)
                    log_png_images(self.accelerator, {f"plots/{Path(p).stem}": p for p in written}, self.step)
            except Exception as err:  # noqa: BLE001 - a plotting problem must not fail a finished run
                logger.warning("could not write the plots: %s: %s", type(err).__name__, err)

    def _write_model_card(self, summary: dict) -> None:
        """`<output_dir>/README.md`, the run's model card (fv_accel/hub.py), once the weights,
        samples, logs and plots are written (main process)."""
        from fv_accel.hub import card_text, write_model_card

        student = self.method.student
        try:
            counter = getattr(self.dataloader, "num_training_rows", None)
            data_size = counter() if counter is not None else None
            text = card_text(
                self.output_dir,
                self.config,
                family=type(student),
                kind=getattr(student, "kind", None),
                task=getattr(student, "task", None),
                shift=student.describe_training_shift() if hasattr(student, "describe_training_shift") else None,
                data_size=data_size,
                steps=self.step,
                repo_id=self.config.training.hub.repo_id if self.config.training.hub.push_to_hub else None,
                summary=summary,
                pipeline=getattr(self.method, "model_source", None),
            )
            print(f"model card: {write_model_card(self.output_dir, text)}", flush=True)
        except Exception as err:  # noqa: BLE001 - a card problem must not fail a finished run
            logger.warning("could not write the model card: %s: %s", type(err).__name__, err)

    def _push_to_hub(self) -> None:
        """Upload the output folder (training.hub), main process only, after the trackers have
        flushed their files; a failure is a HubPushError of one line (the outputs stay on disk)."""
        hub = self.config.training.hub
        if not hub.push_to_hub or not self.accelerator.is_main_process:
            return
        from fv_accel.hub import push_folder

        url = push_folder(
            self.output_dir, hub.repo_id, private=hub.private, revision=hub.revision,
            commit_message=f"fv_accel: {self.config.method.name} run {self.config.training.tracker.run_name}, step {self.step}",
        )
        print(f"pushed {self.output_dir} to the Hub: {url}", flush=True)

    def _write_final_outputs(self, student: Any, save_final: bool) -> None:
        """The callbacks' end of training (the EMA's `ema/` export) and the trained weights
        (transformer/ or the LoRA files); a full disk is said as such."""
        from fv_accel.checkpoint import out_of_space_error

        try:
            for cb in self.callbacks:
                cb.on_train_end(self)
            if save_final:
                student.save_final(self.accelerator, self.output_dir)
                # The method's other roles worth keeping (a distillation critic), each in its subfolder.
                for subfolder, role in self.method.saved_roles().items():
                    role.save_final(self.accelerator, self.output_dir / subfolder)
                if self.accelerator.is_main_process:
                    self.method.write_final_files(self.output_dir)
        except Exception as err:
            needed = sum(p.numel() * p.element_size() for p in student.trainable_parameters())
            space = out_of_space_error(err, self.output_dir, needed, "the trainable weights, per copy", "the final weights")
            if space is not None:
                raise space from err
            raise

    def run(self) -> dict:
        """Train to `max_train_steps`; a SIGTERM/SIGINT stops at the next step boundary with a checkpoint.
        A completed run then uploads its output folder if `training.hub.push_to_hub` (main process;
        a HubPushError of one line if the upload fails, everything still on disk)."""
        previous_handlers = self._install_signal_handlers()
        try:
            try:
                with skipped_step_warnings_silenced():
                    summary = self._train()
            except TrainingStopped:
                self._end_training(crashed=False)
                raise
            except BaseException:
                if self._progress is not None:
                    self._progress.close()  # the error goes on a line of its own
                self._end_training(crashed=True)
                raise
            self._end_training(crashed=False)
            if summary.get("stopped_by") is None:
                self._push_to_hub()  # raises HubPushError (one line) if the upload fails
            return summary
        finally:
            self._restore_signal_handlers(previous_handlers)
            if self._metrics_file is not None:
                self._metrics_file.close()
                self._metrics_file = None
            if self.output_lock is not None:
                self.output_lock.release()

    # ---- the loop ----
    def _train(self) -> dict:
        """Steps until `max_train_steps`, a fault policy stops the run (TrainingStopped) or a signal
        asks for a stop at a step boundary; then the final outputs (or the stop's checkpoint) and the
        run summary."""
        from fv_accel.process import progress_bar
        from fv_accel.telemetry import Telemetry

        acc = self.accelerator
        loop = LoopSettings.from_run(self.config, acc, self.method, self.steps_in_backward)
        telemetry = Telemetry(acc, loop.model, self.config.training.tracker.peak_tflops)
        tally = RunTally()
        for cb in self.callbacks:
            cb.on_train_start(self)
        progress = self._progress = progress_bar(
            loop.max_steps, "train", show=acc.is_local_main_process, unit="step", initial=self.step
        )
        # The method's micro-batches (by default the loader's, read ahead while a step computes).
        batches = self.method.train_batches(self.dataloader, acc.device, self.step)
        t_start = time.perf_counter()
        stopped_by: Optional[str] = None
        for model in loop.models:
            model.train()
        try:
            while self.step < loop.max_steps:
                t0 = time.perf_counter()
                outcome = self._train_step(batches, loop)
                if outcome.fault is not None:
                    batches.close()  # batches drawn ahead may hold rows about to be set aside
                self._set_aside_flagged_rows(outcome)
                self._count_step(outcome)
                self.method.on_step_end(self.step)
                if outcome.fault is not None:
                    # Draw again after the finished step, without the rows set aside.
                    batches = self.method.train_batches(self.dataloader, acc.device, self.step)
                outcome.step_time = time.perf_counter() - t0
                tally.add(outcome, loop.data_parallel)
                self._log_step(outcome, loop, tally, telemetry)
                if outcome.applied:
                    self._stop_after_applied_fault(outcome, loop)
                for cb in self.callbacks:
                    cb.on_step_end(self, self.step, outcome.logs)
                self._checkpoint_if_due(loop)
                self._stop_on_fault_policy(outcome, loop)
                stopped_by = self._requested_stop(loop)
                if stopped_by is not None:
                    break
        finally:
            batches.close()
        progress.close()
        wall = time.perf_counter() - t_start
        return self._end_of_run(stopped_by, wall, tally, telemetry)

    # ---- one step: k micro-batches, then at the sync the fault check, clip, optimizer and LR steps ----
    def _train_step(self, data_iter: Iterator, loop: "LoopSettings") -> "StepOutcome":
        acc = self.accelerator
        out = StepOutcome()
        self._set_vsa_step(self.step + 1)
        for _ in range(loop.accumulation):
            td = time.perf_counter()
            batch = next(data_iter, None)
            if batch is None:
                self._stop_without_data()
            out.data_wait += time.perf_counter() - td
            out.micro_samples.append(
                {"source": batch.get("source"), "nonfinite": batch.get("nonfinite"), "sample_index": batch.get("sample_index")}
            )
            with acc.accumulate(*loop.models):
                self._micro_step(batch, out, loop)
                if acc.sync_gradients and self.steps_in_backward:
                    self._after_engine_step(out, loop)
                elif acc.sync_gradients:
                    self._clip_and_step(out, loop)
        out.last_batch = batch
        return out

    def _micro_step(self, batch: dict, out: "StepOutcome", loop: "LoopSettings") -> None:
        """The method's forward and (unless a fault keeps it out) backward on one micro-batch, and
        its losses and metrics added to the step's means."""
        method = self.method
        k = loop.accumulation
        # The 1-based number of the step being trained (FastVideo's `iteration`).
        loss_map, outputs, metrics = method.single_train_step(batch, self.step + 1)
        tb = outputs.get("training_batch")
        out.micro_records.append((loss_map["total_loss"].detach(), getattr(tb, "timesteps", None)))
        if self.steps_in_backward and out.fault is None:
            # The engine steps inside the last backward: a non-finite loss (on any rank)
            # keeps this and the step's later micro-batches out of backward, so the
            # engine never steps. Their forward still runs (same data and RNG use as
            # on the other engines).
            out.fault = self._find_fault(out.micro_records[-1][0], None, out.micro_records, self.step + 1)
        if out.fault is None:
            method.backward(loss_map, outputs, grad_accum_rounds=k)
        for name, value in loss_map.items():
            out.loss_sums[name] = out.loss_sums.get(name, 0.0) + value.detach().float() / k
        for name, value in metrics.items():
            out.metric_sums[name] = out.metric_sums.get(name, 0.0) + torch.as_tensor(value).detach().float() / k
        out.samples += len(batch["sample_index"])  # (a text-only batch has no vae_latent)
        out.tokens += self.dataloader.batch_tokens(batch)

    def _after_engine_step(self, out: "StepOutcome", loop: "LoopSettings") -> None:
        """DeepSpeed's sync: the engine stepped inside backward (unless a fault kept it out)."""
        method = self.method
        if out.fault is None:
            # The engine has stepped: its norm can only tell that it applied a
            # non-finite gradient, unless its fp16 loss scaler dropped the update.
            out.grad_norm, _ = self._grad_norm(loop.params, loop.max_norm)  # clipped inside the engine's step
            out.engine_skipped = bool(getattr(method.optimizer, "step_was_skipped", False))
            out.fault = self._find_fault(
                out.loss_sums["total_loss"], out.grad_norm, out.micro_records, self.step + 1, scaler_skipped=out.engine_skipped
            )
            out.applied = out.fault is not None
            # The schedule follows the step count. Accelerate hands DeepSpeed only
            # a schedule of its own kinds (WarmupLR...); ours (LambdaLR) stays an
            # AcceleratedScheduler that steps here. An engine-owned one's wrapper
            # (DeepSpeedSchedulerWrapper) does nothing here: the engine stepped it.
            method.lr_scheduler.step()
        else:
            # No backward ran the engine's step, nor its LR schedule step: the
            # schedule follows the step count, as a skipped step does elsewhere.
            getattr(method.lr_scheduler, "scheduler", method.lr_scheduler).step()
        self._name_fault_samples(out)

    def _clip_and_step(self, out: "StepOutcome", loop: "LoopSettings") -> None:
        """Every other engine's sync: the gradient norms of the method's clip targets, the fault
        check, the clips and the method's optimizer steps (left out on a fault); its LR schedules
        step either way."""
        acc = self.accelerator
        method = self.method
        iteration = self.step + 1
        targets = [(name, self._params_of(module)) for name, module in method.get_grad_clip_targets(iteration).items()]
        # The norms are taken even without clipping (max norm inf) to catch a
        # non-finite gradient before it reaches the weights.
        norms, clipped = self._grad_norms([params for _, params in targets], loop.max_norm)
        if len(norms) > 1:  # FSDP2's norms are replicated DTensors: their plain value, for the total
            plain = [n.full_tensor() if hasattr(n, "full_tensor") else n for n in norms]
            out.grad_norm = torch.stack([n.reshape(()).float() for n in plain]).norm()
            out.grad_norms = {name: norm for (name, _), norm in zip(targets, plain)}
        else:
            out.grad_norm = norms[0]
        out.fault = self._find_fault(out.loss_sums["total_loss"], norms, out.micro_records, iteration)
        for (_, params), norm, value in zip(targets, norms, self._norm_values):
            if out.fault is None and not clipped:
                self._clip_to(params, loop.max_norm, norm, value)
        self._name_fault_samples(out)
        if out.fault is None:
            for optimizer in method.get_optimizers(iteration):
                optimizer.step()
        elif acc.scaler is not None:
            acc.scaler.update()  # clip_grad_norm_ unscaled: reset the scaler's step state
        # The schedules follow the step count, skipped steps included (exact resume).
        for lr_scheduler in method.get_lr_schedulers(iteration):
            lr_scheduler.step()
        for optimizer in method.optimizer_dict.values():
            optimizer.zero_grad(set_to_none=True)

    def _params_of(self, module: torch.nn.Module) -> list:
        """A clip target's trainable parameters (listed once per module)."""
        cache = self.__dict__.setdefault("_clip_params", {})
        if id(module) not in cache:
            cache[id(module)] = [p for p in module.parameters() if p.requires_grad]
        return cache[id(module)]

    def _name_fault_samples(self, out: "StepOutcome") -> None:
        """A fault's message also names the step's samples that hold NaN/inf (and this process)."""
        acc = self.accelerator
        if out.fault is not None and describe_samples(out.micro_samples):
            rank = f" (process {acc.process_index})" if acc.num_processes > 1 else ""
            out.fault += f"; {describe_samples(out.micro_samples)}{rank}"

    # ---- fault handling: rows with NaN/inf set aside, the step counted, a skipped step reported, a fault policy's stop ----
    def _set_aside_flagged_rows(self, out: "StepOutcome") -> bool:
        """After a step with a fault: the step's rows whose own data holds NaN/inf, on any rank, are
        set aside for the rest of the run on every rank (`TrainLoader.set_aside`; kept in checkpoints).
        Every rank knows whether the step had a fault (its check is agreed), so all of them take part
        in the one gather of the rows, only on such a step. True when rows were new to the set."""
        acc = self.accelerator
        if out.fault is None:
            return False
        rows = flagged_rows(out.micro_samples)
        if acc.num_processes > 1:
            from accelerate.utils import gather_object

            rows = gather_object(rows)
        return bool(rows) and bool(self.dataloader.set_aside(rows, epoch=int(out.last_batch["epoch"][0]), step=self.step + 1))

    def _stop_without_data(self) -> None:
        """The data ended (the rows set aside leave no step, `TrainLoader.no_step_message`), at a step
        boundary on every rank: a checkpoint, then TrainingStopped."""
        self._progress.close()
        ckpt = self.save_checkpoint()
        raise TrainingStopped(f"stopped: {self.dataloader.no_step_message()}; checkpoint saved in {ckpt}", ckpt)

    def _count_step(self, out: "StepOutcome") -> None:
        acc = self.accelerator
        self.dataloader.mark_step_done(out.last_batch)
        self.step += 1
        if out.fault is None:
            self.consecutive_skips = 0
            if out.engine_skipped:
                # No update, so counted (the EMA leaves it out), but not a fault.
                self.skipped_steps += 1
                if acc.is_main_process:
                    logger.info("step %d: DeepSpeed's loss scaler skipped the update (gradient overflow; %d skipped in all)",
                                self.step, self.skipped_steps)
        elif out.applied:
            pass  # not a skipped step: the update happened (the run stops after this step's logs)
        else:
            self.skipped_steps += 1
            self.consecutive_skips += 1
            # Another process reports it too when its own samples hold the NaN/inf.
            if acc.is_main_process or NONFINITE_MARK in out.fault:
                logger.warning("skipped step %d (%d skipped in all): %s", self.step, self.skipped_steps, out.fault)

    def _stop_after_applied_fault(self, out: "StepOutcome", loop: "LoopSettings") -> None:
        """DeepSpeed applied a non-finite step inside backward: stop without a checkpoint. No
        callback (the EMA) sees these weights and no checkpoint holds them."""
        self._progress.close()
        from fv_accel.checkpoint import latest_checkpoint

        last = latest_checkpoint(self.output_dir)
        raise TrainingStopped(
            f"stopped (training.loop.nan_policy: {loop.nan_policy}): {out.fault}; DeepSpeed applied step {self.step} "
            f"inside backward, so its weights may hold NaN/inf and no checkpoint was saved; "
            f"the last one is {last if last is not None else 'none'}",
            last,
        )

    def _stop_on_fault_policy(self, out: "StepOutcome", loop: "LoopSettings") -> None:
        """nan_policy stop, or more than max_consecutive_skips faults in a row: a checkpoint, then TrainingStopped."""
        stop_reason = None
        if out.fault is not None and loop.nan_policy == "stop":
            stop_reason = f"stopped (training.loop.nan_policy: stop): {out.fault}"
        elif out.fault is not None and self.consecutive_skips > loop.max_skips:
            stop_reason = (
                f"stopped: {self.consecutive_skips} non-finite steps in a row, more than "
                f"training.loop.max_consecutive_skips ({loop.max_skips}); last: {out.fault}"
            )
        if stop_reason is not None:
            self._progress.close()
            ckpt = self.save_checkpoint()
            raise TrainingStopped(f"{stop_reason}; checkpoint saved in {ckpt}", ckpt)

    # ---- the checkpoint cadence and the stop request ----
    def _checkpoint_if_due(self, loop: "LoopSettings") -> None:
        if self._checkpoint_due(loop.ckpt_every, loop.max_steps):
            self.save_checkpoint()

    def _requested_stop(self, loop: "LoopSettings") -> Optional[str]:
        """What asked this run to stop at this step boundary (a signal's name), or None."""
        if self.step < loop.max_steps and self._stop_requested():
            if self._stop_signal:
                return signal.Signals(self._stop_signal).name
            return self._stop_reason or "another rank's signal"
        return None

    # ---- the log cadence ----
    def _log_step(self, out: "StepOutcome", loop: "LoopSettings", tally: "RunTally", telemetry: Any) -> None:
        """The step's logs (`out.logs`, which every callback gets). Losses and metrics are read (a
        host sync, and a collective across processes) only on the steps that log them: every
        log_every-th, the run's first and the last."""
        acc = self.accelerator
        logs: dict[str, Any] = {}
        log_now = self.step % loop.log_every == 0 or self.step == loop.max_steps or tally.steps == 1
        if log_now:
            names = [*out.loss_sums, *out.metric_sums]
            values = torch.stack([v.reshape(()) for v in [*out.loss_sums.values(), *out.metric_sums.values()]]).to(acc.device)
            # Means over data-parallel ranks (FastVideo logged rank 0's alone), in one collective.
            reduced = acc.reduce(values, reduction="mean") if acc.num_processes > 1 else values
            logs.update(zip(names, reduced.tolist()))
            logs["loss"] = logs["total_loss"]
        logs["lr"] = float(self.method.lr_scheduler.get_last_lr()[0])
        for role, lr_scheduler in self.method.lr_scheduler_dict.items():
            if role != "student":  # the other trained roles' (a distillation critic's)
                logs[f"lr_{role}"] = float(lr_scheduler.get_last_lr()[0])
        vsa_sparsity = getattr(self.method, "vsa_sparsity", None)
        if vsa_sparsity is not None:
            logs["vsa_sparsity"] = vsa_sparsity
        if log_now and out.grad_norm is not None:
            logs["grad_norm"] = float(out.grad_norm)
            logs.update({f"grad_norm_{role}": float(norm) for role, norm in out.grad_norms.items()})
        logs["step_time"] = out.step_time
        logs["data_wait"] = out.data_wait
        logs["samples_per_s"] = out.samples * loop.data_parallel / out.step_time
        logs["latent_tokens_per_s"] = out.tokens * loop.data_parallel / out.step_time
        logs["epoch"] = self.dataloader.epoch
        logs["skipped_steps"] = self.skipped_steps
        logs.update(telemetry.step_metrics(step_time=out.step_time, samples=out.samples, tokens=out.tokens))
        if log_now:
            self.history.append({"step": self.step, **logs})
            self._log(logs, self.step)
            self._progress.set_postfix(loss=f"{logs['loss']:.4f}", lr=f"{logs['lr']:.2e}")
        self._progress.update(1)
        out.logs = logs

    # ---- the end of the loop: final outputs or the stop's checkpoint, the summary ----
    def _end_of_run(self, stopped_by: Optional[str], wall: float, tally: "RunTally", telemetry: Any) -> dict:
        acc = self.accelerator
        cfg = self.config
        if stopped_by is not None:
            self._save_on_stop_request(stopped_by)
        else:
            self._write_final_outputs(self.method.student, cfg.training.checkpoint.save_final)
        acc.wait_for_everyone()
        summary = {
            "steps": tally.steps,
            "final_step": self.step,
            "wall_time_s": wall,
            "samples_per_s": tally.samples / wall if wall > 0 else math.nan,
            "first_loss": self.history[0]["loss"] if self.history else math.nan,
            "last_loss": self.history[-1]["loss"] if self.history else math.nan,
            **smoothed_loss_ends(self.history),
            "skipped_steps": self.skipped_steps,
            # Rows set aside for NaN/inf in their own data: file, row, id and the step that found each.
            "skipped_samples": self.dataloader.skipped_samples(),
            "stopped_by": stopped_by,
            "checkpoint": str(self.last_checkpoint) if self.last_checkpoint else None,
        }
        summary["latent_tokens_per_s"] = tally.tokens / wall if wall > 0 else math.nan
        summary["peak_cpu_rss_gb"] = telemetry.peak_rss / 2**30
        if telemetry.on_cuda:
            summary["peak_mem_gb"] = torch.cuda.max_memory_allocated(acc.device) / 2**30
        for cb in self.callbacks:
            summary.update(cb.summary())
        if acc.is_main_process:
            self._write_summary(summary, plots=stopped_by is None and cfg.training.tracker.write_plots)
            if stopped_by is None:
                self._write_model_card(summary)
        if acc.is_main_process and stopped_by is None:
            logger.info("run summary: %s", summary)
            print(f"done: {tally.steps} steps in {wall:.1f}s, {describe_loss_ends(summary, cfg.training.tracker.log_every)}; "
                  f"outputs in {self.output_dir}")
        if self._metrics_file is not None:
            self._metrics_file.close()
            self._metrics_file = None
        return summary

    def _save_on_stop_request(self, stopped_by: str) -> None:
        """Preempted: not the end of training, so no final weights and no end-of-run callbacks;
        a checkpoint, and (main process) where it is."""
        ckpt = self.save_checkpoint()
        if self.accelerator.is_main_process:
            print(
                f"stopped by {stopped_by} after step {self.step}: checkpoint saved in {ckpt}; "
                f"continue with --resume_from_checkpoint latest",
                flush=True,
            )
            stopped_file = os.environ.get(STOPPED_FILE_ENV)
            if stopped_file:
                # For a job script: this run stopped early with a checkpoint (requeue it).
                Path(stopped_file).write_text(f"{ckpt}\n", encoding="utf-8")
