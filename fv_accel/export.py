"""Export trained weights from a run's output folder or one of its checkpoints.

    python -m fv_accel.export <checkpoint or output dir> --to diffusers|comfyui|merged [--out DIR] [--base MODEL]
        [--push_to_hub REPO [--private] [--revision BRANCH]]

- `diffusers`: a LoRA run -> `pytorch_lora_weights.safetensors` (with adapter metadata) for
  `WanPipeline.load_lora_weights(DIR)`; a full run -> `DIR/transformer/` for
  `WanTransformer3DModel.from_pretrained(DIR, subfolder="transformer")`.
- `comfyui`: a LoRA run -> `pytorch_lora_weights_comfyui.safetensors` (`diffusion_model.` keys, in
  the family's original layout: Wan, HunyuanVideo, LTX-Video, Cosmos-Predict2).
- `merged`: a LoRA run folded into its base -> `DIR/transformer/` (base from `--base`, else the
  run's `base_model.json` or checkpoint config).
- A Wan 2.2 A14B run of both experts (`models.student.expert: both`) exports each expert:
  `pytorch_lora_weights.safetensors` and `..._transformer_2.safetensors` (diffusers),
  `pytorch_lora_weights_comfyui_high_noise.safetensors` and `..._low_noise.safetensors`, and the
  merged `transformer/` (high noise) and `transformer_2/` (low noise), the repo's layout.

Sources, in the order they are looked for: a LoRA file; a folder with
`pytorch_lora_weights.safetensors` (a LoRA run's output or checkpoint); a folder with
`transformer/` (a full run's output); an Accelerate checkpoint of a full run (`model.safetensors`
+ `metadata.json`); an output folder with `checkpoint-<step>/` folders (the latest is used).
Everything is read and written with safetensors. The export's stages (reading, loading the base,
merging, saving) show as a progress bar on stderr, on the main process only (`RANK` / `LOCAL_RANK`
unset or 0).

`--push_to_hub REPO` then writes a model card (`README.md`) into the export folder and uploads the
folder (fv_accel/hub.py); a failed upload is one line and exit status 3, the export kept.

Without `--out` the export goes to the run's output folder, never into a checkpoint (which
`checkpoints_total_limit` deletes with everything in it): `<output_dir>/exports/<checkpoint-N>_<to>`
for a checkpoint, `<output_dir>/exports/final_<to>` for a run's final weights, and
`<folder>/exports/<file name>_<to>` for a LoRA file elsewhere.

Every target writes into `<out>.partial/` and what it wrote is renamed into `<out>` once complete
(the whole folder when `<out>` does not exist yet, else each entry, replacing the one of an earlier
export), so an export killed at any point leaves no folder that looks complete. A failed export
removes its partial folder; a killed one leaves it, and the next export to the same `<out>` names
it and removes it (unless the export that writes it still runs).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from fv_accel.hub import PUSH_FAILED_EXIT_CODE
from fv_accel.models.lora import BASE_MODEL_FILE, COMFYUI_LORA_FILE, DIFFUSERS_LORA_FILE

TARGETS = ("diffusers", "comfyui", "merged")
# Wrappers' prefixes on parameter names in an Accelerate checkpoint (DDP, torch.compile).
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


class ExportError(ValueError):
    pass


def is_main_process() -> bool:
    """Rank 0 of a launcher (torchrun / accelerate set RANK and LOCAL_RANK), or no launcher."""
    return all(os.environ.get(name, "0") == "0" for name in ("RANK", "LOCAL_RANK"))


# A stage of an export: `with stage("saving"): ...` names it on the bar while it runs.
Stage = Callable[[str], contextlib.AbstractContextManager]


class ExportProgress:
    """A bar over an export's stages (stderr, main process only; plain lines in a log file); the
    current stage is its postfix."""

    def __init__(self, to: str, total: int):
        from fv_accel.process import progress_bar

        self.bar = progress_bar(total, f"export --to {to}", show=is_main_process(), unit="stage")

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        self.bar.set_postfix_str(name)
        yield
        if self.bar.n + 1 == self.bar.total:
            self.bar.set_postfix_str("done", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def stage_count(src: "ExportSource", to: str) -> int:
    """Stages of an export of `src` to `to` (the bar's total); see the `stage(...)` calls below."""
    if to == "merged":
        # reading the LoRA, then per expert: loading the base, merging, saving
        return 1 + 3 * (2 if src.base.get("expert") == "both" else 1)
    if to == "diffusers" and src.kind == "full" and src.transformer_dir is None:
        return 3  # reading the checkpoint, loading the weights, saving
    return 1  # one copy or conversion


@dataclass
class ExportSource:
    path: Path  # the folder (or file) the weights come from
    kind: str  # "lora" or "full"
    lora_file: Optional[Path] = None
    transformer_dir: Optional[Path] = None
    checkpoint_weights: Optional[Path] = None
    base: dict[str, Any] = field(default_factory=dict)  # base_model.json fields, possibly empty


def _base_from_folder(folder: Path) -> dict[str, Any]:
    """The base-model description next to the weights: base_model.json, else a checkpoint's config."""
    for candidate in (folder, folder.parent):
        info = candidate / BASE_MODEL_FILE
        if info.is_file():
            return json.loads(info.read_text())
        meta = candidate / "metadata.json"
        if meta.is_file():
            run_config = json.loads(meta.read_text()).get("config", {})
            student = run_config.get("models", {}).get("student", {})
            if student:
                return {
                    "attention": _attention_from_config(student, run_config.get("method", {})),
                    "init_from": student.get("init_from"),
                    "revision": student.get("revision"),
                    "subfolder": student.get("subfolder", "transformer"),
                    "variant": student.get("variant"),
                    "torch_dtype": student.get("torch_dtype", "float32"),
                    "model_class": student.get("model_class", "auto"),
                    "transformer_config": student.get("transformer_config"),
                    "expert": student.get("expert"),
                    "vsa": _vsa_from_config(run_config.get("training", {}).get("vsa") or {}),
                    # An AnyFlow student made from a Wan transformer (fv_accel/models/anyflow.py).
                    **({k: student.get(k) for k in ANYFLOW_BASE_KEYS} if student.get("anyflow_from_wan") else {}),
                }
    return {}


# The recipe keys that rebuild an AnyFlow student made from Wan (`models.student.anyflow_from_wan`).
ANYFLOW_BASE_KEYS = ("anyflow_from_wan", "causal", "r_embedder_gate_value", "r_embedder_deltatime_type")


def _vsa_from_config(vsa: dict[str, Any]) -> Optional[dict[str, Any]]:
    """A checkpoint recipe's `training.vsa` as base_model.json records it (None: dense)."""
    if not vsa.get("sparsity"):
        return None
    return {k: vsa.get(k) for k in ("sparsity", "decay_rate", "decay_interval_steps")}


def vsa_sparsity_of(base: dict[str, Any]) -> float:
    """The sparsity a run trained with video sparse attention reached (0: dense)."""
    return float((base.get("vsa") or {}).get("sparsity") or 0.0)


def _attention_from_config(student: dict[str, Any], method: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The saved-attention record of a checkpoint's run config (None: full attention)."""
    from fv_accel.config import parse_chunk_size
    from fv_accel.models.attention import CausalSpec, attention_record

    if not student.get("causal"):
        return None
    spec = CausalSpec(
        parse_chunk_size(method.get("chunk_size")), student.get("local_attn_size", -1), student.get("sink_size", 0)
    )
    return attention_record(spec)


def find_source(path: str | Path) -> ExportSource:
    from fv_accel.checkpoint import list_checkpoints

    path = Path(path)
    if path.is_file():
        if path.suffix != ".safetensors":
            raise ExportError(f"{path}: expected a .safetensors LoRA file or a folder")
        return ExportSource(path=path, kind="lora", lora_file=path, base=_base_from_folder(path.parent))
    if not path.is_dir():
        raise ExportError(f"{path}: no such file or folder")
    if (path / DIFFUSERS_LORA_FILE).is_file():
        return ExportSource(path=path, kind="lora", lora_file=path / DIFFUSERS_LORA_FILE, base=_base_from_folder(path))
    if (path / "transformer" / "config.json").is_file():
        return ExportSource(path=path, kind="full", transformer_dir=path / "transformer", base=_base_from_folder(path))
    if (path / "model.safetensors").is_file() and (path / "metadata.json").is_file():
        return ExportSource(
            path=path, kind="full", checkpoint_weights=path / "model.safetensors", base=_base_from_folder(path)
        )
    found = list_checkpoints(path)
    if found:
        return find_source(found[-1])
    raise ExportError(
        f"{path}: found no weights to export (looked for {DIFFUSERS_LORA_FILE}, transformer/, "
        f"model.safetensors + metadata.json, checkpoint-<step>/)"
    )


def _student_config(base: dict[str, Any], override: Optional[str], dtype: Optional[str]):
    from fv_accel.config import StudentConfig

    fields = {k: v for k, v in base.items() if k in StudentConfig.__dataclass_fields__}
    if override:
        # A different base: only its id is known; the recipe's subfolder/revision no longer apply.
        fields.update(init_from=override, revision=None, variant=None, model_class="auto", subfolder="transformer")
    if dtype:
        fields["torch_dtype"] = dtype
    return StudentConfig(**fields)


def _transformer_class(st) -> tuple[type, dict]:
    """(class, config) of the base transformer without loading its weights."""
    from fv_accel.models.loading import fetch_config

    if getattr(st, "anyflow_from_wan", False):  # the AnyFlow transformer made from the run's Wan base
        import dataclasses

        from fv_accel.models.anyflow import transformer_class_of_wan

        return transformer_class_of_wan(_transformer_class(dataclasses.replace(st, anyflow_from_wan=False))[1], st)

    if st.init_from is None:
        if not st.transformer_config:
            raise ExportError("the run's base is unknown: pass --base MODEL (Hub id or folder)")
        family = _family({"model_class": None if st.model_class == "auto" else st.model_class})
        kind = next(iter(family.transformer_classes)) if st.model_class == "auto" else st.model_class
        return family.transformer_classes[kind], dict(st.transformer_config)
    config = fetch_config(st.init_from, st.subfolder or None, revision=st.revision)
    if st.model_class != "auto":
        return _family({"model_class": st.model_class}).transformer_classes[st.model_class], config
    from fv_accel.models import family_for_class_name

    family = family_for_class_name(config.get("_class_name"))
    if family is None:
        raise ExportError(f"model '{st.init_from}': unsupported transformer class {config.get('_class_name')!r}")
    return next(c for c in family.transformer_classes.values() if c.__name__ == config.get("_class_name")), config


def _save_transformer(transformer, out: Path, attention: Optional[dict[str, Any]] = None, folder: str = "transformer") -> Path:
    from fv_accel.models.attention import mark_saved_attention

    target = out / folder
    transformer.save_pretrained(target, safe_serialization=True)
    mark_saved_attention(target / "config.json", attention)  # a causal student stays marked
    return target


def export_diffusers(src: ExportSource, out: Path, stage: Stage = contextlib.nullcontext) -> list[Path]:
    from fv_accel.models.lora import read_lora_file

    out.mkdir(parents=True, exist_ok=True)
    if src.kind == "lora" and src.base.get("expert") == "both":
        return _export_expert_loras(src, out, stage)
    if src.kind == "lora":
        with stage("copying the LoRA"):
            _, metadata = read_lora_file(src.lora_file)  # validates layout and metadata
            if metadata is None:
                raise ExportError(f"{src.lora_file}: no adapter metadata (alpha unknown)")
            target = out / DIFFUSERS_LORA_FILE
            if target.resolve() != src.lora_file.resolve():
                shutil.copyfile(src.lora_file, target)
        return [target]
    if src.transformer_dir is not None:
        with stage("copying the transformer"):
            written = []
            # A few-step student's scheduler (DMD2) goes with it: the stock pipeline samples with it.
            run = src.transformer_dir.parent
            parts = [("transformer", src.transformer_dir), ("scheduler", run / "scheduler")]
            if (run / "model_index.json").is_file():  # a run folder that is a pipeline folder (AnyFlow)
                parts += [(sub, run / sub) for sub in ("vae", "text_encoder", "tokenizer")]
            for sub, folder in parts:
                target = out / sub
                if folder.is_dir() and target.resolve() != folder.resolve():
                    shutil.copytree(folder, target, dirs_exist_ok=True)
                if folder.is_dir():
                    written.append(target)
            if (run / "model_index.json").is_file():
                shutil.copyfile(run / "model_index.json", out / "model_index.json")
                written.append(out / "model_index.json")
        return written
    # A full run's Accelerate checkpoint: rebuild the module from the config, load, save_pretrained.
    from safetensors.torch import load_file

    with stage("reading the checkpoint"):
        cls, config = _transformer_class(_student_config(src.base, None, None))
        transformer = cls.from_config(config)
        state = load_file(str(src.checkpoint_weights))
    with stage("loading the weights"):
        for prefix in WRAPPER_PREFIXES:
            if all(k.startswith(prefix) for k in state):
                state = {k[len(prefix):]: v for k, v in state.items()}
        dtypes = {v.dtype for v in state.values() if v.is_floating_point()}
        from fv_accel.vsa import enable_vsa, is_gate_key

        if any(is_gate_key(k) for k in state):  # trained with VSA: the gates are part of the weights
            enable_vsa(transformer, vsa_sparsity_of(src.base))
        transformer.load_state_dict(state, strict=True)
        if len(dtypes) == 1:
            transformer.to(dtypes.pop())
    with stage("saving the transformer"):
        return [_save_transformer(transformer, out, src.base.get("attention"))]


def expert_loras(src: ExportSource) -> dict[Optional[str], tuple[dict, Optional[dict]]]:
    """(state, metadata) of the LoRA of each trained transformer, keyed by the Wan 2.2 expert it
    belongs to (None: the run's one transformer). A run of both experts keeps them in two files
    (`pytorch_lora_weights.safetensors` and `..._transformer_2.safetensors`), its checkpoints in one
    whose keys start with the expert's name."""
    from fv_accel.models.lora import read_lora_file

    state, metadata = read_lora_file(src.lora_file)
    expert = src.base.get("expert")
    if expert != "both":
        return {expert: (state, metadata)}
    from fv_accel.models.wan import EXPERT_SUBFOLDERS, LORA_FILE_SUFFIX

    parts = {name: {k[len(name) + 1:]: v for k, v in state.items() if k.startswith(name + ".")} for name in EXPERT_SUBFOLDERS}
    if all(parts.values()):
        return {name: (part, metadata) for name, part in parts.items()}
    loras = {}
    for name, suffix in LORA_FILE_SUFFIX.items():
        path = src.lora_file.with_name(DIFFUSERS_LORA_FILE.replace(".safetensors", f"{suffix}.safetensors"))
        if not path.is_file():
            raise ExportError(
                f"{src.path}: a run of both Wan 2.2 experts (models.student.expert: both) keeps the {name} expert's "
                f"LoRA in {path.name}, which is missing"
            )
        loras[name] = read_lora_file(path)
    return loras


def _export_expert_loras(src: ExportSource, out: Path, stage: Stage) -> list[Path]:
    """Both Wan 2.2 experts' LoRA files, as a run of both writes them (the low-noise one with the
    `_transformer_2` suffix), from the run's files or a checkpoint's one file."""
    from fv_accel.models.lora import save_diffusers_lora
    from fv_accel.models.wan import LORA_FILE_SUFFIX

    family = _family(src.base)
    with stage("writing each expert's LoRA"):
        written = []
        for expert, (state, metadata) in expert_loras(src).items():
            if metadata is None:
                raise ExportError(f"{src.lora_file}: no adapter metadata (alpha unknown)")
            name = DIFFUSERS_LORA_FILE.replace(".safetensors", f"{LORA_FILE_SUFFIX[expert]}.safetensors")
            pipeline_cls = family.lora_pipeline_class(src.base.get("model_class") or "wan")
            written.append(save_diffusers_lora(out, state, metadata, pipeline_cls=pipeline_cls, weight_name=name))
        return written


def export_comfyui(src: ExportSource, out: Path, stage: Stage = contextlib.nullcontext) -> list[Path]:
    from fv_accel.models.lora import save_comfyui_file

    if src.kind != "lora":
        raise ExportError(
            f"{src.path}: the ComfyUI export is for LoRA runs; a full fine-tune exports with --to diffusers"
        )
    family = _family(src.base)
    with stage("converting the LoRA"):
        loras = expert_loras(src)
        written = []
        for expert, (state, metadata) in loras.items():
            comfy = family.comfyui_lora_state(state, metadata, lambda: _transformer_class(_student_config(src.base, None, None))[1])
            if comfy is None:
                raise ExportError(
                    f"{src.path}: ComfyUI has no LoRA layout for the {family.family} family; use --to diffusers or merged"
                )
            # One expert of a run of both is named after it; a single expert keeps the run's file name.
            name = COMFYUI_LORA_FILE if len(loras) == 1 else COMFYUI_LORA_FILE.replace(".safetensors", f"_{expert}.safetensors")
            written.append(save_comfyui_file(out / name, comfy))
        return written


def _family(base: dict[str, Any]) -> type:
    """The model family of a run's base: its `family` (base_model.json), else its `model_class`
    (a checkpoint's recipe), else the class its transformer config names; an inline config with
    `model_class: auto` is a Wan transformer."""
    from fv_accel.models import FAMILIES, WanStudent, family_of_repo

    if base.get("family") in FAMILIES:
        return FAMILIES[base["family"]]
    kind = base.get("model_class")
    if kind not in (None, "auto"):
        for family in FAMILIES.values():
            if kind in family.transformer_classes:
                return family
        raise ExportError(f"model_class {kind!r} of the run's base belongs to no known model family")
    if base.get("init_from"):
        return family_of_repo(base["init_from"], base.get("revision"))
    return WanStudent


def export_merged(
    src: ExportSource, out: Path, *, base: Optional[str] = None, dtype: Optional[str] = None, stage: Stage = contextlib.nullcontext
) -> list[Path]:
    """Each trained transformer's LoRA folded into its base, saved as `transformer/` (a Wan 2.2
    expert: the repo's subfolder of that expert, `transformer/` high noise, `transformer_2/` low)."""
    from fv_accel.models.lora import merge_lora
    from fv_accel.models.loading import load_transformer

    if src.kind != "lora":
        raise ExportError(f"{src.path}: a full fine-tune is already a whole transformer; use --to diffusers")
    st = _student_config(src.base, base, dtype)
    if st.init_from is None:
        raise ExportError(
            f"{src.path}: the run's base was built from models.student.transformer_config (random "
            "init, not saved); pass --base MODEL (Hub id or folder of the base it was trained on)"
        )
    with stage("reading the LoRA"):
        cls, _ = _transformer_class(st)
        loras = expert_loras(src)
    from fv_accel.models.wan import EXPERT_SUBFOLDERS

    classes = _family(src.base).transformer_classes
    written = []
    for expert, (state, metadata) in loras.items():
        subfolder = EXPERT_SUBFOLDERS[expert] if expert in EXPERT_SUBFOLDERS else st.subfolder
        with stage(f"loading the base {st.init_from} ({subfolder})"):
            transformer = load_transformer(st, classes, {c.__name__: kind for kind, c in classes.items()}, subfolder=subfolder)
            if not isinstance(transformer, cls):
                raise ExportError(
                    f"model '{st.init_from}': its transformer is a {type(transformer).__name__}, not the run's {cls.__name__}"
                )
        with stage("merging"):
            merge_lora(transformer, state, metadata, vsa_sparsity_of(src.base))
        with stage("saving the transformer"):
            folder = subfolder if expert in EXPERT_SUBFOLDERS else "transformer"
            written.append(_save_transformer(transformer, out, src.base.get("attention"), folder=folder))
    return written


def _enclosing_checkpoint(path: Path) -> Optional[Path]:
    """The `checkpoint-<step>` folder `path` is in (or is), if any."""
    from fv_accel.checkpoint import checkpoint_step

    path = path.resolve()
    return next((p for p in (path, *path.parents) if checkpoint_step(p) is not None), None)


def default_export_dir(src: ExportSource, to: str) -> Path:
    """Where an export goes without --out: outside any checkpoint, under the run's `exports/`."""
    ckpt = _enclosing_checkpoint(src.path)
    if ckpt is not None:
        return ckpt.parent / "exports" / f"{ckpt.name}_{to}"
    if src.path.is_file():
        return src.path.parent / "exports" / f"{src.path.stem}_{to}"
    return src.path / "exports" / f"final_{to}"


PARTIAL_SUFFIX = ".partial"
# In a partial export folder: the process writing it (fv_accel.output_dir.process_record).
PARTIAL_OWNER = ".fv_export_owner.json"


def partial_export_dir(out: Path) -> Path:
    return out.with_name(out.name + PARTIAL_SUFFIX)


def remove_partial_export(partial: Path) -> None:
    """Remove what an interrupted export to the same folder left, naming it on stderr; refuse if the
    export writing it still runs."""
    import sys

    from fv_accel.output_dir import process_ended

    if not partial.exists():
        return
    try:
        owner = json.loads((partial / PARTIAL_OWNER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        owner = {}
    if owner and process_ended(owner) is None:
        raise ExportError(
            f"{partial} is being written by another export (pid {owner.get('pid')} on {owner.get('hostname')}, started "
            f"{owner.get('started')}); wait for it to end, or export to another --out"
        )
    sys.stderr.write(f"removing {partial}: the partial export an interrupted export left\n")
    shutil.rmtree(partial) if partial.is_dir() else partial.unlink()


def publish_export(partial: Path, out: Path, written: list[Path]) -> list[Path]:
    """Move a finished export from `partial` into `out`: one rename of the folder when `out` does not
    exist, else one rename per entry (an earlier export's entry of the same name is replaced)."""
    from fv_accel.checkpoint import fsync_dir

    moved = [out / p.relative_to(partial) for p in written]
    if not out.exists():
        partial.rename(out)
    else:
        for entry in sorted(partial.iterdir()):
            target = out / entry.name
            old = out / f".{entry.name}.old"
            if old.exists():
                shutil.rmtree(old) if old.is_dir() else old.unlink()
            if target.exists() or target.is_symlink():
                target.rename(old)
            entry.rename(target)
            if old.exists():
                shutil.rmtree(old) if old.is_dir() else old.unlink()
        partial.rmdir()
    fsync_dir(out.parent)
    return moved


def write_export_atomically(out: Path, write: Callable[[Path], list[Path]]) -> list[Path]:
    """Run one export target (`write(folder) -> written paths`) into `<out>.partial/` and publish it."""
    from fv_accel.checkpoint import fsync_tree
    from fv_accel.output_dir import process_record

    partial = partial_export_dir(out)
    remove_partial_export(partial)
    try:
        partial.mkdir(parents=True)
        (partial / PARTIAL_OWNER).write_text(json.dumps(process_record()) + "\n", encoding="utf-8")
    except OSError as err:
        raise ExportError(f"cannot write the export {out}: {partial}: {err.strerror or err}") from None
    try:
        written = write(partial)
        (partial / PARTIAL_OWNER).unlink()
        fsync_tree(partial)
        return publish_export(partial, out, written)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise


def _unreadable_source(src: ExportSource, err: Exception) -> ExportError:
    from fv_accel.checkpoint import first_line

    weights = src.lora_file or src.checkpoint_weights or src.path
    return ExportError(f"{weights}: not a readable safetensors file ({type(err).__name__}{first_line(err, ': ')})")


def export(path: str | Path, to: str, out: Optional[str | Path] = None, *, base: Optional[str] = None, dtype: Optional[str] = None) -> list[Path]:
    if to not in TARGETS:
        raise ExportError(f"--to {to!r}: expected one of {', '.join(TARGETS)}")
    src = find_source(path)
    if out is not None and _enclosing_checkpoint(Path(out)) is not None:
        raise ExportError(
            f"--out {out} is inside the checkpoint {_enclosing_checkpoint(Path(out))}, which "
            f"training.checkpoint.checkpoints_total_limit deletes with everything in it; choose a folder "
            f"outside it (the default is {default_export_dir(src, to)})"
        )
    out_dir = Path(out) if out is not None else default_export_dir(src, to)
    progress = ExportProgress(to, stage_count(src, to))

    def write(folder: Path) -> list[Path]:
        if to == "diffusers":
            return export_diffusers(src, folder, progress.stage)
        if to == "comfyui":
            return export_comfyui(src, folder, progress.stage)
        return export_merged(src, folder, base=base, dtype=dtype, stage=progress.stage)

    from safetensors import SafetensorError

    try:
        return write_export_atomically(out_dir, write)
    except SafetensorError as err:  # a source whose header lies about its tensors
        raise _unreadable_source(src, err) from None
    finally:
        progress.close()


def main(argv: Optional[list[str]] = None) -> None:
    from fv_accel.process import DefaultsHelpFormatter

    parser = argparse.ArgumentParser(
        prog="python -m fv_accel.export", description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter
    )
    parser.add_argument("source", help="a run's output folder, one of its checkpoint-<step> folders, or a LoRA file")
    parser.add_argument("--to", required=True, choices=TARGETS, help="what to write (docs/export-targets.md)")
    parser.add_argument(
        "--out", default=None, help="output folder (default: <output_dir>/exports/<checkpoint-N or final>_<to>)"
    )
    parser.add_argument("--base", default=None, help="base model for --to merged (default: the run's own)")
    parser.add_argument(
        "--dtype", default=None, choices=["float32", "bfloat16", "float16"],
        help="dtype of a merged export (default: the run's models.student.torch_dtype)",
    )
    parser.add_argument(
        "--push_to_hub", default=None, metavar="REPO",
        help="then upload the export folder (with a model card, README.md) to the Hub model repo REPO; "
        f"a failed upload is one line and exit status {PUSH_FAILED_EXIT_CODE}, the export kept",
    )
    parser.add_argument("--private", action="store_true", help="with --push_to_hub: create the repo private")
    parser.add_argument("--revision", default=None, help="with --push_to_hub: the branch to upload to (created if absent; default: main)")
    args = parser.parse_args(argv)
    from fv_accel.models.loading import ModelLoadError

    try:
        written = export(args.source, args.to, args.out, base=args.base, dtype=args.dtype)
    except (ExportError, ModelLoadError, OSError, ValueError) as err:
        raise SystemExit(f"export failed: {err}") from None
    for path in written:
        print(f"wrote {path}")
    if args.push_to_hub:
        push_export(args.source, args.to, written[0].parent, args.push_to_hub, private=args.private, revision=args.revision)


def push_export(source: str | Path, to: str, out_dir: Path, repo_id: str, *, private: bool = False, revision: Optional[str] = None) -> None:
    """Write the export's model card into `out_dir` and upload the folder to `repo_id`; a failed
    upload exits with PUSH_FAILED_EXIT_CODE after one line on stderr (the export stays)."""
    import sys

    from fv_accel.hub import HubPushError, export_card_text, push_folder, write_model_card

    src = find_source(source)
    try:
        family = _family(src.base)
    except Exception:  # noqa: BLE001 - the card then names the generic pipeline
        family = None
    text = export_card_text(out_dir, source=src.path, to=to, base=src.base, family=family, repo_id=repo_id)
    print(f"model card: {write_model_card(out_dir, text)}")
    try:
        url = push_folder(out_dir, repo_id, private=private, revision=revision, commit_message=f"fv_accel export --to {to}")
    except HubPushError as err:
        sys.stderr.write(f"error: {err}\n")
        raise SystemExit(PUSH_FAILED_EXIT_CODE) from None
    print(f"pushed {out_dir} to the Hub: {url}")


if __name__ == "__main__":
    main()
