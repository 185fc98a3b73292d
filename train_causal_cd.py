"""Causal consistency distillation (Causal Forcing++): CausalConsistencyDistillationMethod
(`method.name: causal_cd`), roles student, teacher and ema, all three from one teacher-forcing run
(the output of train_dfsft.py with `method.name: tfsft`).

    accelerate launch [--config_file accelerate_configs/<engine>.yaml] train_causal_cd.py [--config RECIPE.yaml]
        [--dry-run] [--output_dir DIR] [--resume_from_checkpoint latest|PATH] [--section.key VALUE ...]

Without --config the built-in tiny recipe configs/tiny_causal_cd.yaml is used (docs/distillation.md gives the chain).
"""

import sys

from fv_accel.cli import main

if __name__ == "__main__":
    sys.exit(main("causal_cd"))
