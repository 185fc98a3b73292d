"""Distil a bidirectional teacher into a block-causal few-step student that streams, with
SelfForcingMethod (roles student, teacher, critic).

    accelerate launch [--config_file accelerate_configs/<engine>.yaml] train_self_forcing.py [--config RECIPE.yaml]
        [--dry-run] [--output_dir DIR] [--resume_from_checkpoint latest|PATH] [--section.key VALUE ...]

Without --config the built-in tiny recipe configs/tiny_self_forcing.yaml is used: its teacher is the
run of configs/tiny_dmd2_teacher.yaml, its student the causal DFSFT run of
configs/tiny_dfsft_causal_multimodal.yaml (docs/distillation.md gives the chain).
"""

import sys

from fv_accel.cli import main

if __name__ == "__main__":
    sys.exit(main("self_forcing"))
