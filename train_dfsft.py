"""Train with DiffusionForcingSFTMethod (diffusion-forcing SFT).

    accelerate launch [--config_file accelerate_configs/<engine>.yaml] train_dfsft.py [--config RECIPE.yaml]
        [--dry-run] [--output_dir DIR] [--resume_from_checkpoint latest|PATH] [--section.key VALUE ...]

Without --config the built-in tiny recipe configs/tiny_dfsft.yaml is used.
"""

import sys

from fv_accel.cli import main

if __name__ == "__main__":
    sys.exit(main("dfsft"))
