"""Every tiny model `python -m fv_accel.tiny_model` can write: the Wan variants of
`fv_accel.tiny.model` and those of each other family's tiny module (`fv_accel/tiny/<family>.py`,
declaring `TINY_MODEL_ENTRIES: dict[str, fv_accel.tiny.model.TinyModel]`). Every module of this package is looked at,
so a family's tiny model needs no other edit."""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

from fv_accel.tiny.model import TinyModel


def all_tiny_models() -> dict[str, TinyModel]:
    """name -> TinyModel, the Wan variants first."""
    from fv_accel.tiny.model import wan_tiny_models

    # This package's modules, found in its folder (the package itself, fv_accel.tiny, is the door
    # that calls this function).
    package = __name__.rpartition(".")[0]
    out: dict[str, TinyModel] = dict(wan_tiny_models())
    for info in sorted(pkgutil.iter_modules([str(Path(__file__).resolve().parent)]), key=lambda m: m.name):
        module = importlib.import_module(f"{package}.{info.name}")
        for name, model in getattr(module, "TINY_MODEL_ENTRIES", {}).items():
            if name in out:
                raise ValueError(f"tiny model {name!r} declared twice (fv_accel/tiny/{info.name}.py)")
            out[name] = model
    return out
