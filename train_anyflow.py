"""On-policy flow-map distillation of an any-step student: AnyFlowMethod (`method.name: anyflow`,
DMD2 over the flow map), roles student, teacher and critic. The output samples at any step count
in diffusers' own AnyFlowPipeline.

    accelerate launch [--config_file accelerate_configs/<engine>.yaml] train_anyflow.py [--config RECIPE.yaml]
        [--dry-run] [--output_dir DIR] [--resume_from_checkpoint latest|PATH] [--section.key VALUE ...]

Without --config the built-in tiny recipe configs/tiny_anyflow.yaml is used (docs/distillation.md).
"""

import sys

from fv_accel.cli import main

if __name__ == "__main__":
    sys.exit(main("anyflow"))
