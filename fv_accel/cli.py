"""The entry scripts' body: parse the CLI, build the run, train."""

from __future__ import annotations

import sys
from typing import Optional

from fv_accel.config import ConfigError, parse_cli


def main(method: str, argv: Optional[list[str]] = None) -> int:
    try:
        cfg, flags = parse_cli(sys.argv[1:] if argv is None else argv, method)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if flags["dry_run"]:
        print(cfg.to_yaml(), end="")
        return 0
    from fv_accel.build import build_from_config
    from fv_accel.checkpoint import CheckpointError
    from fv_accel.trainer import Trainer, TrainingStopped

    try:
        run = build_from_config(cfg)
    except (ConfigError, CheckpointError, ValueError, OSError) as err:
        # Building reads the recipe's inputs (data, model, checkpoint): its errors are input
        # errors, each one line naming the file/key (build_from_config from Python keeps the traceback).
        print(f"error: {err}", file=sys.stderr)
        return 2
    distributed = run.accelerator.num_processes > 1
    try:
        Trainer(run).run()
        code = 0
    except TrainingStopped as err:
        print(f"error: {err}", file=sys.stderr)
        code = 1
    except Exception:
        if not distributed:
            raise
        import traceback

        traceback.print_exc()
        code = 1
    if distributed:
        # `run` stays referenced until the process ends: freeing it here is what can deadlock.
        exit_without_teardown(code)
    return code


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
