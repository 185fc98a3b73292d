"""Process lifecycle helpers shared by the entry scripts and preprocessing: their exit, their error
line, their --help (imports nothing of fv_accel)."""

from __future__ import annotations

import argparse
import sys
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


# Set to 1 to see the traceback of an input error (a recipe, data or model problem), on every process.
TRACEBACK_ENV = "FV_ACCEL_TRACEBACK"


def traceback_wanted() -> bool:
    import os

    return os.environ.get(TRACEBACK_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def is_main_launched_process() -> bool:
    """Whether this process is the launch's main one (rank 0 of `accelerate launch`/torchrun, or a
    process started on its own), from the launcher's environment: known before any process group."""
    import os

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
    import os

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
    import os
    import tempfile

    return os.path.join(tempfile.gettempdir(), f"fv_accel-errors-{os.getuid()}")


def _remove_old_markers(max_age_s: float = 86400.0) -> None:
    """Marker files of launches that ended more than a day ago."""
    import os
    import time

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
