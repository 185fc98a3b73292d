"""Process lifecycle helpers shared by the entry scripts and preprocessing (imports nothing of fv_accel)."""

from __future__ import annotations

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
