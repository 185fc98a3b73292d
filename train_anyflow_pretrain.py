"""Flow-map pretraining of an any-step student from data: AnyFlowPretrainMethod
(`method.name: anyflow_pretrain`), the student an AnyFlow transformer (diffusers'
AnyFlowTransformer3DModel, or its block-causal FAR variant) made from a Wan 2.1 model or loaded
from an AnyFlow checkpoint.

    accelerate launch [--config_file accelerate_configs/<engine>.yaml] train_anyflow_pretrain.py [--config RECIPE.yaml]
        [--dry-run] [--output_dir DIR] [--resume_from_checkpoint latest|PATH] [--section.key VALUE ...]

Without --config the built-in tiny recipe configs/tiny_anyflow_pretrain.yaml is used (docs/distillation.md).
"""

import sys

from fv_accel.cli import main

if __name__ == "__main__":
    sys.exit(main("anyflow_pretrain"))
