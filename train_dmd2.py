"""Distil a teacher into a few-step student with DMD2Method (roles student, teacher, critic).

    accelerate launch [--config_file accelerate_configs/<engine>.yaml] train_dmd2.py [--config RECIPE.yaml]
        [--dry-run] [--output_dir DIR] [--resume_from_checkpoint latest|PATH] [--section.key VALUE ...]

Without --config the built-in tiny recipe configs/tiny_dmd2.yaml is used (its teacher is the run of
configs/tiny_dmd2_teacher.yaml).
"""

import sys

from fv_accel.cli import main

if __name__ == "__main__":
    sys.exit(main("dmd2"))
