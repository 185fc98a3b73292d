"""Process lifecycle helpers shared by the entry scripts, preprocessing and export (imports nothing
of fv_accel): their exit, their error line, their --help, the libraries' log lines a run did not
ask for, and progress that stays plain lines in a log file."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Any


def needs_exit_without_teardown(accelerator: Any = None) -> bool:
    """Whether this run must end through `exit_without_teardown`: more than one process on the
    gloo backend, where the teardown deadlock below exists. Asked of the run's Accelerator before
    training (the process group is gone after `end_training`), or without one, of the process
    group itself."""
    if accelerator is not None:
        return accelerator.num_processes > 1 and getattr(accelerator.state, "backend", None) == "gloo"
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() == "gloo"


def exit_without_teardown(code: int) -> None:
    """End a finished multi-process run without the interpreter's teardown.

    With torch 2.13 and gloo the teardown can deadlock: the main thread frees DDP's Reducer, whose
    process group's destructor joins gloo's worker threads while holding the GIL, and a worker
    thread that is still freeing the last collective's work (the final barrier) waits for the GIL
    to release its tensors. Seen in about 1 of 10 two-process CPU runs stopped by a signal (py-spy:
    `~ProcessGroupGloo -> std::thread::join` in the main thread, `~AsyncBarrierWork -> gil_scoped_acquire`
    in `pt_gloo_runloop`). Everything a run writes is closed and synced by now (checkpoints, final
    weights, trackers finished by the trainer on every path, crash included, and the output
    folder's lock released); streams and logging are flushed here.
    """
    import logging
    import os

    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


# ---- the libraries' own log lines ----
class _DropMessages(logging.Filter):
    """A logger filter that drops the records whose message contains one of `parts`."""

    def __init__(self, *parts: str):
        super().__init__()
        self.parts = parts

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(part in message for part in self.parts)


# logger name -> the messages dropped there; each one said on every run, none caused by the recipe.
UNASKED_MESSAGES = {
    # DeepSpeed names the accelerator it detected when it is imported, which Accelerate does under
    # every engine once DeepSpeed is installed (to unwrap a model); the run's own engine line says
    # which engine and device train.
    "DeepSpeed": ("Setting accelerator to CPU", "Setting ds_accelerator to"),
    # torchvision is not a dependency: the PIL image processor transformers falls back to is the one used.
    "transformers.utils.import_utils": ("requires torchvision (not installed)",),
}
_quieted = False


def quiet_libraries() -> None:
    """Silence the libraries' lines that no recipe causes (idempotent; imports none of them):
    - peft imports bitsandbytes whenever it is installed, and bitsandbytes then warns, on a CPU with
      AVX512-BF16, that the `kernels` package of its 4-bit CPU matmul is missing; fv_accel runs no
      4-bit matmul (its 8-bit optimizer warns nothing), so that logger shows errors only;
    - Accelerate's per-file lines when it saves or loads a checkpoint;
    - the messages of UNASKED_MESSAGES;
    - where stderr is not a terminal (a log file, a pipe), the download and weight-loading bars of
      huggingface_hub and transformers, whose carriage returns would fill the log."""
    global _quieted
    if _quieted:
        return
    _quieted = True
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    # Accelerate's info lines on saving and loading state (five a checkpoint, one per file): the
    # trainer's own line names the checkpoint.
    for name in ("accelerate.checkpointing", "accelerate.accelerator"):
        logging.getLogger(name).setLevel(logging.WARNING)
    for name, parts in UNASKED_MESSAGES.items():
        logging.getLogger(name).addFilter(_DropMessages(*parts))
    if not stderr_is_terminal():
        # Read by huggingface_hub when imported, and by transformers from it; already imported
        # ones are switched off directly.
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        if "huggingface_hub" in sys.modules:
            from huggingface_hub.utils import disable_progress_bars

            disable_progress_bars()
        if "transformers" in sys.modules:
            from transformers.utils import logging as transformers_logging

            transformers_logging.disable_progress_bar()


# ---- progress ----
def stderr_is_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stream
        return False


class LineProgress:
    """tqdm's counting interface (`update`, `set_postfix`, `set_postfix_str`, `close`) for a log
    that is not a terminal: one plain line (no carriage return, no escape code) each time another
    tenth of the total is done, and at `close` when the last line is not already the end."""

    def __init__(self, total: int, desc: str, unit: str = "it", initial: int = 0, stream: Any = None, parts: int = 10):
        self.total, self.desc, self.unit = total, desc, unit
        self.n = self._written = initial
        self.stream = stream
        self.every = max(1, -(-total // parts)) if total else 1
        self.postfix = ""
        self._start, self._start_n = time.perf_counter(), initial

    def set_postfix(self, refresh: bool = True, **values: Any) -> None:
        self.postfix = ", ".join(f"{k}={v}" for k, v in values.items())

    def set_postfix_str(self, text: str = "", refresh: bool = True) -> None:
        self.postfix = text

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.n - self._written >= self.every or self.n == self.total:
            self._write()

    def _write(self) -> None:
        self._written = self.n
        elapsed = time.perf_counter() - self._start
        rate = (self.n - self._start_n) / elapsed if elapsed > 0 else 0.0
        share = f" ({100 * self.n // self.total}%)" if self.total else ""
        postfix = f", {self.postfix}" if self.postfix else ""
        stream = self.stream or sys.stderr
        stream.write(f"{self.desc}: {self.n}/{self.total} {self.unit}{share}, {rate:.3g} {self.unit}/s{postfix}\n")
        stream.flush()

    def close(self) -> None:
        if self.n != self._written:
            self._write()


def progress_bar(total: int, desc: str, *, show: bool = True, unit: str = "it", initial: int = 0) -> Any:
    """A tqdm bar on stderr when it is a terminal; plain lines (LineProgress) when stderr goes to a
    log file or a pipe; nothing shown where `show` is false (another process's share)."""
    from tqdm.auto import tqdm

    if show and not stderr_is_terminal():
        return LineProgress(total, desc, unit=unit, initial=initial)
    return tqdm(total=total, initial=initial, desc=desc, unit=unit, disable=not show, dynamic_ncols=True)


# Set to 1 to see the traceback of an input error (a recipe, data or model problem), on every process.
TRACEBACK_ENV = "FV_ACCEL_TRACEBACK"


def traceback_wanted() -> bool:
    return os.environ.get(TRACEBACK_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def is_main_launched_process() -> bool:
    """Whether this process is the launch's main one (rank 0 of `accelerate launch`/torchrun, or a
    process started on its own), from the launcher's environment: known before any process group."""
    return os.environ.get("RANK", "0") in ("", "0")


def report_error(err: BaseException) -> None:
    """Write `error: <message>` to stderr, once per launch: the processes of one launcher (one node)
    that fail with the same line write it once; a line only some of them have is written by each.
    With FV_ACCEL_TRACEBACK=1 every process writes its traceback too."""
    import traceback

    line = f"error: {err}\n"
    if traceback_wanted():
        sys.stderr.write("".join(traceback.format_exception(err)) + line)
        sys.stderr.flush()
    elif _first_to_say(line):
        sys.stderr.write(line)  # one write: lines of several processes stay whole
        sys.stderr.flush()
        _remove_old_markers()


def _first_to_say(line: str) -> bool:
    """Whether no other process of this launch has written `line`: the first one to create its
    marker file (keyed by the launcher process, its start time and the line) in the temporary
    folder says it. A process started on its own always says it."""
    import hashlib

    if "LOCAL_RANK" not in os.environ:
        return True
    try:
        import psutil

        launcher = psutil.Process(os.getppid())
        key = f"{launcher.pid}-{launcher.create_time():.3f}-{hashlib.sha1(line.encode()).hexdigest()[:16]}"
        folder = _marker_folder()
        os.makedirs(folder, exist_ok=True)
        os.close(os.open(os.path.join(folder, key), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
    except FileExistsError:
        return False
    except Exception:  # noqa: BLE001 - no marker to share: every process says its line
        return True
    return True


def _marker_folder() -> str:
    import tempfile

    return os.path.join(tempfile.gettempdir(), f"fv_accel-errors-{os.getuid()}")


def _remove_old_markers(max_age_s: float = 86400.0) -> None:
    """Marker files of launches that ended more than a day ago."""
    folder = _marker_folder()
    if not os.path.isdir(folder):
        return
    now = time.time()
    for name in os.listdir(folder):
        path = os.path.join(folder, name)
        try:
            if now - os.stat(path).st_mtime > max_age_s:
                os.unlink(path)
        except OSError:
            pass


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """--help that shows each option's default (`(default: 81)`), except where there is none to show
    (None, a flag's False) or the help text already says it; the description is kept as written."""

    @staticmethod
    def _has_default(action: argparse.Action) -> bool:
        return bool(action.option_strings) and all(action.default is not v for v in (None, False, argparse.SUPPRESS))

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not self._has_default(action) or "default" in text:
            return text
        return super()._get_help_string(action)

    def _format_action(self, action: argparse.Action) -> str:
        if not action.help and self._has_default(action):  # an option without help text still shows its default
            import copy

            action = copy.copy(action)
            action.help = "(default: %(default)s)"
        return super()._format_action(action)
