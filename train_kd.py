"""Regress a student onto its teacher's ODE trajectories (knowledge distillation, CausVid's ODE
initialisation): KDMethod (`method.name: kd`, bidirectional) or KDCausalMethod (`kd_causal`, a
block-causal student with per-block steps), roles student and teacher. The teacher's trajectories
are a dataset of their own, generated on first use (or by `python -m fv_accel.kd_cache RECIPE`).

    accelerate launch [--config_file accelerate_configs/<engine>.yaml] train_kd.py [--config RECIPE.yaml]
        [--dry-run] [--output_dir DIR] [--resume_from_checkpoint latest|PATH] [--section.key VALUE ...]

Without --config the built-in tiny recipe configs/tiny_kd.yaml is used (docs/distillation.md gives the chain).
"""

import sys

from fv_accel.cli import main

if __name__ == "__main__":
    sys.exit(main("kd"))
