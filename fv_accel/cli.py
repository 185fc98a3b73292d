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
    try:
        Trainer(run).run()
    except TrainingStopped as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0
