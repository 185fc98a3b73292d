"""Kills `python -m fv_accel.export` with SIGKILL at a chosen point, deterministically.

`run_case` forks the test process (everything already imported) and runs the export's `main` in the
child, which first goes to one torch thread, as DataLoader's forked workers do (a fork does not carry
the parent's thread pool), and sends itself SIGKILL at the case's point:

- `stage:K`: on entering the export's K-th stage (1-based: the stages its progress bar counts);
- `write`: in the middle of writing the weights: after `config.json` of a transformer folder is
  written and before its weights (diffusers' `save_config`), or after half of a copied or converted
  LoRA file / of the first file of a copied folder;
- `publish:before` / `publish:after`: just before / just after the finished export is renamed into
  its folder.

A case is `{"args": [export CLI arguments], "kill": POINT or None, "watch": [folders]}`; its result
is "killed" (SIGKILL arrived) or the exit status, stderr's text, and what each watched folder held
right after it (relative path -> sha256; None: no folder).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
from pathlib import Path

def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def half_then_die(path: str) -> None:
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[: len(data) // 2])
    die()


def arm(point: str) -> None:
    """Install the kill at `point` (in the child)."""
    import contextlib
    import shutil

    import fv_accel.export as export
    import fv_accel.models.lora as lora

    if point.startswith("stage:"):
        wanted, seen = int(point.split(":")[1]), {"n": 0}
        real_stage = export.ExportProgress.stage

        @contextlib.contextmanager
        def stage(self, name):
            seen["n"] += 1
            if seen["n"] == wanted:
                die()
            with real_stage(self, name):
                yield

        export.ExportProgress.stage = stage
    elif point == "write":
        from diffusers.configuration_utils import ConfigMixin

        real_save_config, real_copyfile, real_save_file = ConfigMixin.save_config, shutil.copyfile, lora.save_file

        def save_config(self, save_directory, *args, **kwargs):
            real_save_config(self, save_directory, *args, **kwargs)
            die()

        def copyfile(src, dst, *args, **kwargs):
            real_copyfile(src, dst, *args, **kwargs)
            half_then_die(dst)

        def save_file(tensors, filename, *args, **kwargs):
            real_save_file(tensors, filename, *args, **kwargs)
            half_then_die(filename)

        ConfigMixin.save_config = save_config
        shutil.copyfile = copyfile
        lora.save_file = save_file
    elif point in ("publish:before", "publish:after"):
        real_publish = export.publish_export

        def publish(*args, **kwargs):
            if point == "publish:before":
                die()
            result = real_publish(*args, **kwargs)
            die()
            return result

        export.publish_export = publish
    else:
        raise ValueError(f"unknown kill point {point!r}")


def run_case(case: dict) -> dict:
    import time

    t0 = time.perf_counter()
    err = tempfile.TemporaryFile()
    pid = os.fork()
    if pid == 0:
        os.dup2(err.fileno(), 2)
        sys.stderr = open(2, "w", closefd=False)  # not the test runner's captured stream
        code = 0
        try:
            import torch

            torch.set_num_threads(1)
            from fv_accel.export import main

            if case.get("kill"):
                arm(case["kill"])
            main(case["args"])
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
            if not isinstance(exit_.code, int) and exit_.code is not None:
                sys.stderr.write(f"{exit_.code}\n")
        except BaseException:  # noqa: BLE001 - reported through the status
            import traceback

            traceback.print_exc()
            code = 1
        finally:
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    err.seek(0)
    text = err.read().decode(errors="replace")
    killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    listings = {folder: listing(Path(folder)) for folder in case.get("watch", [])}
    return {"status": "killed" if killed else os.waitstatus_to_exitcode(status), "stderr": text, "listings": listings,
            "seconds": time.perf_counter() - t0}


def listing(folder: Path):
    import hashlib

    if not folder.exists():
        return None
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()
    }
