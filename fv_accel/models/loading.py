"""Loading diffusers components from a Hub id or a local folder in the Hub layout.

Errors name the model id and say what to do, instead of surfacing a stack trace from deep inside
huggingface_hub. `HF_HUB_OFFLINE` and the local cache are honoured by diffusers itself.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional

import torch

from fv_accel.config import StudentConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelLoadError(OSError):
    pass


def _explain(model_id: str, what: str, err: Exception) -> ModelLoadError:
    local = Path(model_id)
    if local.exists():
        hint = f"the folder exists but has no loadable {what}: check its layout ({err.__class__.__name__}: {err})"
    elif os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        hint = (
            "it is not in the local Hugging Face cache and HF_HUB_OFFLINE is set; download it first "
            f"(`hf download {model_id}`) on a machine with network, or point init_from at a local folder"
        )
    else:
        hint = (
            "it could not be found on the Hub or in the local cache; check the id/revision, log in "
            f"for gated repos (`hf auth login`), or point init_from at a local folder ({err.__class__.__name__})"
        )
    return ModelLoadError(f"could not load {what} of model '{model_id}': {hint}")


def load_transformer(cfg: StudentConfig, classes: dict[str, type], class_to_kind: dict[str, str]) -> torch.nn.Module:
    kwargs = dict(
        subfolder=cfg.subfolder or None,
        revision=cfg.revision,
        variant=cfg.variant,
        torch_dtype=DTYPES[cfg.torch_dtype],
    )
    kind = cfg.model_class
    if kind == "auto":
        config = load_component_config(cfg, cfg.subfolder or None, required=True)
        class_name = config.get("_class_name")
        if class_name not in class_to_kind:
            raise ModelLoadError(
                f"model '{cfg.init_from}': transformer class {class_name!r} is not supported; "
                f"supported: {', '.join(sorted(class_to_kind))}"
            )
        kind = class_to_kind[class_name]
    try:
        return classes[kind].from_pretrained(cfg.init_from, **kwargs)
    except (OSError, ValueError) as err:
        raise _explain(cfg.init_from, f"transformer (subfolder {cfg.subfolder!r})", err) from None


def load_component_config(cfg: StudentConfig, subfolder: Optional[str], required: bool = False) -> Optional[dict[str, Any]]:
    """The `config.json` of one component (e.g. "vae") of the same repo, or None if absent."""
    model_id = cfg.init_from
    local = Path(model_id)
    if local.exists():
        path = local / (subfolder or "") / "config.json"
        if not path.is_file():
            if required:
                raise ModelLoadError(f"model folder '{model_id}' has no {subfolder or '.'}/config.json")
            return None
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    from huggingface_hub import hf_hub_download

    try:
        path = hf_hub_download(
            model_id, "config.json", subfolder=subfolder or None, revision=cfg.revision
        )
    except Exception as err:  # huggingface_hub raises several unrelated types here
        if required:
            raise _explain(model_id, f"{subfolder or 'root'} config", err) from None
        return None
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)
