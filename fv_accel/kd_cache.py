"""Write a KD run's teacher-trajectory cache without training: the recipe and overrides of
train_kd.py, the same cache the run would write on first use (fv_accel/methods/knowledge_distillation/
cache.py), sharded over the launch's processes, resumable after a kill.

    python -m fv_accel.kd_cache RECIPE.yaml [--section.key VALUE ...]
    accelerate launch [--num_processes N ...] -m fv_accel.kd_cache RECIPE.yaml [--section.key VALUE ...]

Nothing is written to the run's output folder.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Optional

from fv_accel.config import ConfigError, RunConfig, parse_cli
from fv_accel.process import report_error

KD_METHODS = ("kd", "kd_causal")


def write_cache(cfg: RunConfig) -> Any:
    """Build the run's teacher, student, data and loader (no engine prepare, no output folder) and
    write its cache; returns the cache's spec."""
    from fv_accel.build import _build_loader, _build_student_and_method, _prepare_data_source, build_accelerator

    if cfg.method.name not in KD_METHODS:
        raise ConfigError(f"method.name {cfg.method.name!r}: python -m fv_accel.kd_cache writes the cache of kd or kd_causal runs")
    acc = build_accelerator(cfg)
    logging.basicConfig(level=logging.INFO if acc.is_main_process else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    data_path = _prepare_data_source(cfg, acc)
    student, method = _build_student_and_method(cfg, acc)
    _build_loader(cfg, acc, data_path, student, method)  # the method's check_data writes the cache
    return method._cache_dataset.spec


def main(argv: Optional[list[str]] = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m fv_accel.kd_cache", description=__doc__.splitlines()[0])
    parser.add_argument("recipe", help="the KD run's recipe (a YAML file, as train_kd.py --config takes)")
    parser.add_argument("overrides", nargs=argparse.REMAINDER, help="dotted overrides, as train_kd.py takes them")
    args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    try:
        cfg, flags = parse_cli(["--config", args.recipe, *args.overrides], "kd")
        if flags["dry_run"]:
            raise ConfigError("python -m fv_accel.kd_cache takes no --dry-run: train_kd.py --dry-run counts the cache")
        spec = write_cache(cfg)
    except (ConfigError, ValueError, OSError) as err:
        report_error(err)
        return 2
    print(f"KD cache {spec.folder}: {spec.num_samples} samples, teacher timesteps {spec.stored}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
