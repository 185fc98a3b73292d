"""The entry scripts' body: parse the CLI, build the run, train."""

from __future__ import annotations

import sys
from typing import Optional

from fv_accel.config import ConfigError, parse_cli
from fv_accel.process import exit_without_teardown


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
