"""The entry scripts' body: parse the CLI, build the run, train."""

from __future__ import annotations

import sys
from typing import Optional

from fv_accel.config import ConfigError, parse_cli
from fv_accel.process import exit_without_teardown, is_main_launched_process, needs_exit_without_teardown, report_error


def main(method: str, argv: Optional[list[str]] = None) -> int:
    """Errors in the recipe, data or model are one line (`report_error`: once per launch, no
    traceback unless FV_ACCEL_TRACEBACK=1) and exit status 2."""
    try:
        cfg, flags = parse_cli(sys.argv[1:] if argv is None else argv, method)
    except ConfigError as err:
        report_error(err)
        return 2
    if flags["dry_run"]:
        if not is_main_launched_process():
            return 0  # the launch's main process prints the recipe and estimate
        print(cfg.to_yaml(), end="")
        from fv_accel.memory_estimate import dry_run_lines

        # Comment lines: the printed recipe stays valid YAML.
        print("\n".join(dry_run_lines(cfg)))
        return 0
    from fv_accel.build import build_from_config
    from fv_accel.checkpoint import CheckpointError
    from fv_accel.hub import PUSH_FAILED_EXIT_CODE, HubPushError
    from fv_accel.trainer import Trainer, TrainingStopped

    try:
        run = build_from_config(cfg)
    except (ConfigError, CheckpointError, ValueError, OSError) as err:
        # Building reads the recipe's inputs (data, model, checkpoint): its errors are input
        # errors, each one line naming the file/key (build_from_config from Python keeps the traceback).
        report_error(err)
        if needs_exit_without_teardown():  # refused after the process group was set up
            exit_without_teardown(2)
        return 2
    # Only gloo with several processes can deadlock in the interpreter's teardown: end those runs
    # with os._exit once everything is written. Elsewhere an unexpected error propagates as usual.
    hard_exit = needs_exit_without_teardown(run.accelerator)
    try:
        Trainer(run).run()
        code = 0
    except (TrainingStopped, CheckpointError) as err:
        # A fault policy stop, or a checkpoint that could not be written (a full disk): one line.
        report_error(err)
        code = 1
    except HubPushError as err:
        # Trained and written; only the upload (training.hub) failed: one line, its own exit status.
        report_error(err)
        code = PUSH_FAILED_EXIT_CODE
    except Exception:
        if not hard_exit:
            raise
        import traceback

        traceback.print_exc()
        code = 1
    if hard_exit:
        # `run` stays referenced until the process ends: freeing it here is what can deadlock.
        exit_without_teardown(code)
    return code
