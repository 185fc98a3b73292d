"""Process lifecycle helpers shared by the entry scripts and preprocessing (imports nothing of fv_accel)."""

from __future__ import annotations

import sys


def exit_without_teardown(code: int) -> None:
    """End a finished multi-process run without the interpreter's teardown.

    With torch 2.13 and gloo the teardown can deadlock: the main thread frees DDP's Reducer, whose
    process group's destructor joins gloo's worker threads while holding the GIL, and a worker
    thread that is still freeing the last collective's work (the final barrier) waits for the GIL
    to release its tensors. Seen in about 1 of 10 two-process CPU runs stopped by a signal (py-spy:
    `~ProcessGroupGloo -> std::thread::join` in the main thread, `~AsyncBarrierWork -> gil_scoped_acquire`
    in `pt_gloo_runloop`). Everything a run writes is closed and synced by now (checkpoints, final
    weights, trackers finished by `end_training`); streams and logging are flushed here.
    """
    import logging
    import os

    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)
