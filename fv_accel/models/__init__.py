"""Roles (ModelBase) and the model families: one file per family, each registering itself
(`@register_family`); every module of this package is imported here so that adding a family
touches only its own file."""

import importlib
import pkgutil

from fv_accel.process import quiet_libraries

# Before diffusers (and through it peft, bitsandbytes, transformers) is imported below.
quiet_libraries()

from fv_accel.models.base import (  # noqa: E402
    FAMILIES,
    Capabilities,
    Conditioning,
    ModelBase,
    TrainingBatch,
    family_for_class_name,
    register_family,
)

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

from fv_accel.models.wan import WanStudent  # noqa: E402 (the default family)

__all__ = [
    "FAMILIES",
    "Capabilities",
    "Conditioning",
    "ModelBase",
    "TrainingBatch",
    "WanStudent",
    "build_student",
    "family_of",
    "family_of_repo",
    "register_family",
]


def family_of(cfg) -> type:
    """The family class of a recipe's student: by `model_class`, else by the transformer's
    `_class_name` (read from its config.json), else the Wan family for an inline config."""
    from fv_accel.models.loading import ModelLoadError, fetch_config

    st = cfg.models.student
    if getattr(st, "anyflow_from_wan", False):  # a Wan transformer made into an AnyFlow flow map
        return FAMILIES["anyflow_far" if st.causal and "anyflow_far" in FAMILIES else "anyflow"]
    if st.model_class != "auto":
        for family in FAMILIES.values():
            if st.model_class in family.transformer_classes:
                return family
        raise ValueError(f"models.student.model_class {st.model_class!r} belongs to no registered family")
    if st.init_from is None:
        return _family_of_inline_config(st.transformer_config or {})
    config = fetch_config(st.init_from, st.subfolder or None, revision=st.revision, required=True)
    class_name = config.get("_class_name")
    family = family_for_class_name(class_name)
    if family is None:
        supported = sorted(n for f in FAMILIES.values() for n in f.transformer_class_names())
        raise ModelLoadError(
            f"model '{st.init_from}': {st.subfolder or '.'}/config.json names transformer class {class_name!r} "
            f"(_class_name), which is not supported; supported: {', '.join(supported)} (or set models.student.model_class)"
        )
    return family


def _family_of_inline_config(config: dict) -> type:
    """The family an inline `transformer_config` belongs to: the one whose class its `_class_name`
    names (a pasted config.json), else the Wan family."""
    class_name = config.get("_class_name")
    if class_name is None:
        return WanStudent
    family = family_for_class_name(class_name)
    if family is None:
        from fv_accel.config import ConfigError

        supported = sorted(n for f in FAMILIES.values() for n in f.transformer_class_names())
        raise ConfigError(
            f"models.student.transformer_config._class_name: {class_name!r} is not a transformer class fv_accel "
            f"trains; supported: {', '.join(supported)} (or remove the key: an inline config builds a Wan transformer)"
        )
    return family


def build_student(cfg) -> ModelBase:
    """The student role for a recipe: an instance of its model family."""
    return family_of(cfg)(cfg)


def family_of_repo(model: str, revision=None) -> type:
    """The family of a model repo (Hub id or folder): by its model_index.json pipeline class, else by
    its transformer's `_class_name`; a repo with neither file is taken for a Wan repo (its encoders
    say so when they load)."""
    from fv_accel.models.loading import ModelLoadError, fetch_config

    index = fetch_config(model, None, revision=revision, required=False, filename="model_index.json") or {}
    pipeline = index.get("_class_name")
    for family in FAMILIES.values():
        if pipeline in family.pipeline_class_names:
            return family
    config = (
        fetch_config(model, "transformer", revision=revision, required=False)
        or fetch_config(model, "transformer_2", revision=revision, required=False)
        or {}
    )
    family = family_for_class_name(config.get("_class_name"))
    if family is not None:
        return family
    if not index and not config:
        return WanStudent
    known = sorted(n for f in FAMILIES.values() for n in f.pipeline_class_names)
    raise ModelLoadError(
        f"model '{model}': pipeline {pipeline!r} / transformer {config.get('_class_name')!r} belongs to no supported "
        f"model family; supported pipelines: {', '.join(known)}"
    )
