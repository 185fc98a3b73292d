"""Loading diffusers components from a Hub id or a local folder in the Hub layout.

One way to find every component of a model repo (transformer, VAE, text encoder, tokenizer):
`revision`, `subfolder`, `variant` and `torch_dtype` from the recipe, `HF_HUB_OFFLINE` and the
local cache honoured (by huggingface_hub itself). Failures become a `ModelLoadError` that names the
model id and says what to do, instead of a stack trace from deep inside huggingface_hub.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch

from fv_accel.config import StudentConfig
from fv_accel.hub_access import error_first_line, hub_offline, offline_unless_hub_answers, unreachable_reason

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Accelerate mixed_precision -> the low-precision compute dtype it autocasts to.
LOW_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16}


class ModelLoadError(OSError):
    pass


def explain_load_error(
    model_id: str, what: str, err: Exception, *, revision: Optional[str] = None
) -> ModelLoadError:
    """A `ModelLoadError` naming `model_id` (and revision) with the likely cause and the fix."""
    from huggingface_hub import errors as hf_errors

    rev = f" at revision '{revision}'" if revision else ""
    if Path(model_id).exists():
        hint = f"the folder exists but has no loadable {what}: check its layout ({error_first_line(err)})"
    elif isinstance(err, hf_errors.RevisionNotFoundError):
        hint = f"the revision '{revision}' does not exist in that repo: check models.student.revision"
    elif isinstance(err, hf_errors.GatedRepoError):
        hint = "the repo is gated: accept its licence on the Hub, then log in (`hf auth login`)"
    elif isinstance(err, hf_errors.RepositoryNotFoundError):
        hint = "no such repo on the Hub (or it is private): check the id, or log in (`hf auth login`)"
    elif "does not appear to have a file named" in str(err):
        hint = f"{error_first_line(err)}; check models.student.variant/subfolder, and that those files are downloaded"
    elif isinstance(err, hf_errors.LocalEntryNotFoundError) or hub_offline():
        why = unreachable_reason() or "HF_HUB_OFFLINE is set"
        hint = (
            f"it is not in the local Hugging Face cache and {why}; download it first on a "
            f"machine with network (`hf download {model_id}{' --revision ' + revision if revision else ''}`; "
            "HF_HOME/HF_HUB_CACHE say where the cache is), or point the recipe at a local folder"
        )
    elif isinstance(err, hf_errors.EntryNotFoundError):
        hint = f"the repo has no {what}: is it a diffusers-layout repo (a '-Diffusers' id)? ({error_first_line(err)})"
    else:
        hint = (
            "it could not be fetched from the Hub or the local cache: check the network, the id and revision, "
            f"or point the recipe at a local folder ({error_first_line(err)})"
        )
    return ModelLoadError(f"could not load {what} of model '{model_id}'{rev}: {hint}")


def fetch_config(
    model_id: str,
    subfolder: Optional[str] = None,
    *,
    revision: Optional[str] = None,
    required: bool = True,
    filename: str = "config.json",
) -> Optional[dict[str, Any]]:
    """`<subfolder>/<filename>` (a component's config.json, or the repo's model_index.json) of a Hub
    id (cache honoured) or local folder; None if absent and not required. Fetching this small file
    first turns a missing model into a clear error early."""
    local = Path(model_id)
    where = subfolder or "."
    if local.exists():
        path = local / (subfolder or "") / filename
        if not path.is_file():
            if required:
                raise ModelLoadError(f"model folder '{model_id}' has no {where}/{filename} (diffusers layout expected)")
            return None
    else:
        from huggingface_hub import hf_hub_download
        from huggingface_hub import errors as hf_errors

        local_only = offline_unless_hub_answers()
        try:
            path = Path(
                hf_hub_download(model_id, filename, subfolder=subfolder or None, revision=revision, local_files_only=local_only)
            )
        except (hf_errors.HFValidationError, ValueError) as err:
            raise ModelLoadError(
                f"model '{model_id}' is neither an existing local folder nor a valid Hub id ({error_first_line(err)})"
            ) from None
        except Exception as err:  # huggingface_hub raises several unrelated types here
            missing_file = isinstance(err, hf_errors.EntryNotFoundError) and not isinstance(
                err, hf_errors.LocalEntryNotFoundError
            )
            if not required and missing_file:
                return None
            if not required and isinstance(err, hf_errors.LocalEntryNotFoundError):
                return None
            raise explain_load_error(model_id, f"{where}/{filename}", err, revision=revision) from None
    with open(path, encoding="utf-8") as fh:
        try:
            return json.load(fh)
        except json.JSONDecodeError as err:
            raise ModelLoadError(f"model '{model_id}': {where}/{filename} is not valid JSON ({err})") from None


def load_component_config(cfg: StudentConfig, subfolder: Optional[str], required: bool = False) -> Optional[dict[str, Any]]:
    """The `config.json` of one component (e.g. "vae") of the student's repo, or None if absent."""
    return fetch_config(cfg.init_from, subfolder, revision=cfg.revision, required=required)


def load_transformer(
    cfg: StudentConfig, classes: dict[str, type], class_to_kind: dict[str, str], subfolder: Optional[str] = None
) -> torch.nn.Module:
    """The student's transformer from `cfg.init_from` (Hub id or folder), class from its config;
    `subfolder` overrides the recipe's (a Wan 2.2 expert's weights are in `transformer_2`)."""
    subfolder = (subfolder or cfg.subfolder) or None
    config = fetch_config(cfg.init_from, subfolder, revision=cfg.revision, required=True)
    kind = cfg.model_class
    if kind == "auto":
        class_name = config.get("_class_name")
        if class_name not in class_to_kind:
            raise ModelLoadError(
                f"model '{cfg.init_from}': {subfolder or '.'}/config.json names transformer class {class_name!r} "
                f"(_class_name), which is not supported; supported: {', '.join(sorted(class_to_kind))} (or set "
                "models.student.model_class)"
            )
        kind = class_to_kind[class_name]
    try:
        return classes[kind].from_pretrained(
            cfg.init_from,
            subfolder=subfolder,
            revision=cfg.revision,
            variant=cfg.variant,
            torch_dtype=DTYPES[cfg.torch_dtype],
            use_safetensors=True,  # never fall back to pickled .bin weights
        )
    except (OSError, ValueError) as err:
        what = f"transformer weights (subfolder {subfolder!r}{', variant ' + repr(cfg.variant) if cfg.variant else ''})"
        raise explain_load_error(cfg.init_from, what, err, revision=cfg.revision) from None


def load_vae(
    model_id: str, *, revision: Optional[str] = None, torch_dtype: torch.dtype = torch.float32, subfolder: str = "vae"
):
    """The repo's `AutoencoderKLWan` (the Wan 2.1 VAE of Wan 2.1, Wan 2.2 A14B and SkyReels-V2, or the
    Wan 2.2 VAE of Wan2.2-TI2V-5B: one class, told apart by its config), found like the transformer."""
    from diffusers import AutoencoderKLWan

    fetch_config(model_id, subfolder, revision=revision, required=True)
    try:
        return AutoencoderKLWan.from_pretrained(
            model_id, subfolder=subfolder, revision=revision, torch_dtype=torch_dtype, use_safetensors=True
        )
    except (OSError, ValueError) as err:
        raise explain_load_error(model_id, f"VAE (subfolder '{subfolder}')", err, revision=revision) from None


def load_text_encoder(
    model_id: str,
    *,
    revision: Optional[str] = None,
    torch_dtype: torch.dtype = torch.float32,
    subfolder: str = "text_encoder",
    tokenizer_subfolder: str = "tokenizer",
    encoder_class: Optional[type] = None,
):
    """(tokenizer, text encoder) of the repo, found like the transformer; the encoder is a
    `encoder_class` (default UMT5EncoderModel, Wan's; T5EncoderModel for LTX-Video and Cosmos)."""
    from transformers import AutoTokenizer, UMT5EncoderModel

    fetch_config(model_id, subfolder, revision=revision, required=True)
    try:
        text_encoder = (encoder_class or UMT5EncoderModel).from_pretrained(
            model_id, subfolder=subfolder, revision=revision, dtype=torch_dtype, use_safetensors=True
        )
    except (OSError, ValueError) as err:
        raise explain_load_error(model_id, f"text encoder (subfolder '{subfolder}')", err, revision=revision) from None
    try:
        # Passing the encoder's config spares AutoTokenizer a lookup of `tokenizer/config.json`,
        # a file diffusers-layout repos do not have, which fails offline from the cache.
        tokenizer = AutoTokenizer.from_pretrained(
            model_id, subfolder=tokenizer_subfolder, revision=revision, config=text_encoder.config
        )
    except (OSError, ValueError) as err:
        raise explain_load_error(model_id, f"tokenizer (subfolder '{tokenizer_subfolder}')", err, revision=revision) from None
    return tokenizer, text_encoder


def load_image_encoder(
    model_id: str,
    *,
    revision: Optional[str] = None,
    torch_dtype: torch.dtype = torch.float32,
    subfolder: str = "image_encoder",
    processor_subfolder: str = "image_processor",
):
    """(image processor, CLIP vision tower) of an image-to-video repo (Wan 2.1 I2V), found like the
    transformer. `CLIPVisionModel` also loads the tower of a `CLIPVisionModelWithProjection` checkpoint
    (the projection, which Wan does not use, is left out)."""
    from transformers import CLIPImageProcessor, CLIPVisionModel

    fetch_config(model_id, subfolder, revision=revision, required=True)
    try:
        image_encoder = CLIPVisionModel.from_pretrained(
            model_id, subfolder=subfolder, revision=revision, dtype=torch_dtype, use_safetensors=True
        )
    except (OSError, ValueError) as err:
        raise explain_load_error(model_id, f"image encoder (subfolder '{subfolder}')", err, revision=revision) from None
    try:
        processor = CLIPImageProcessor.from_pretrained(model_id, subfolder=processor_subfolder, revision=revision)
    except (OSError, ValueError) as err:
        raise explain_load_error(
            model_id, f"image processor (subfolder '{processor_subfolder}')", err, revision=revision
        ) from None
    return processor, image_encoder
