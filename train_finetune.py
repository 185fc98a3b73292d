"""Train with FineTuneMethod (flow-matching SFT).

    accelerate launch [--config_file accelerate_configs/<engine>.yaml] train_finetune.py [--config RECIPE.yaml]
        [--dry-run] [--output_dir DIR] [--resume_from_checkpoint latest|PATH] [--section.key VALUE ...]

Without --config the built-in tiny recipe configs/tiny_finetune.yaml is used.
"""

import sys

from fv_accel.cli import main

if __name__ == "__main__":
    sys.exit(main("finetune"))
