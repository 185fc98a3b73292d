"""fv_accel: FastVideo's fine-tuning methods (SFT and diffusion-forcing SFT) on the Hugging Face stack."""

__version__ = "0.1.0"

__all__ = ["build_from_config", "load_config", "Trainer", "main", "__version__"]


def __getattr__(name):  # lazy: `import fv_accel` stays cheap (diffusers costs seconds)
    if name == "build_from_config":
        from fv_accel.build import build_from_config

        return build_from_config
    if name == "load_config":
        from fv_accel.config import load_config

        return load_config
    if name == "Trainer":
        from fv_accel.trainer import Trainer

        return Trainer
    if name == "main":
        from fv_accel.cli import main

        return main
    raise AttributeError(name)
