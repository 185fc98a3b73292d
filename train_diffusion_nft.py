"""Reward post-training with DiffusionNFTMethod (roles student, old, reference): the old policy
samples, the rewards score, the student learns from the scores.

    accelerate launch [--config_file accelerate_configs/<engine>.yaml] train_diffusion_nft.py [--config RECIPE.yaml]
        [--dry-run] [--output_dir DIR] [--resume_from_checkpoint latest|PATH] [--section.key VALUE ...]

Without --config the built-in tiny recipe configs/tiny_nft.yaml is used (its student is the tiny
DMD2 teacher, the run of configs/tiny_dmd2_teacher.yaml).
"""

import sys

from fv_accel.cli import main

if __name__ == "__main__":
    sys.exit(main("diffusion_nft"))
