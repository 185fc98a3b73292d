"""A run's model card (`<output_dir>/README.md`) and its upload to the Hugging Face Hub.

The card is written by the main process at the end of every completed run (fv_accel/trainer.py),
after the weights, samples, logs and plots are on disk; `huggingface_hub.ModelCard.load` parses it.
With `training.hub.push_to_hub` the output folder is then uploaded (`create_repo` + `upload_folder`,
main process only). A failed upload is one line naming the repo and the folder the outputs stay in;
the entry scripts then exit with PUSH_FAILED_EXIT_CODE (fv_accel/cli.py).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any, Optional

logger = logging.getLogger(__name__)

CARD_NAME = "README.md"
# Exit status of a run (or an export) that finished and wrote its outputs but could not push them:
# distinct from 1 (training stopped) and 2 (input error), so a job script can retry the push alone
# (`python -m fv_accel.export <output_dir> --to diffusers --push_to_hub REPO`).
PUSH_FAILED_EXIT_CODE = 3
# Never uploaded: resumable training state (large, DeepSpeed's are pickles), the run's lock, exports.
PUSH_IGNORE = ["checkpoint-*", "checkpoint-*/**", ".fv_accel.lock", "exports/**", "**/__pycache__/**"]

METHOD_TEXT = {
    "finetune": "full-sequence flow-matching fine-tuning (FastVideo's finetune method)",
    "dfsft": "diffusion-forcing SFT (FastVideo's DiffusionForcingSFTMethod): one noise level per chunk of latent frames",
    "tfsft": "teacher-forcing SFT: clean context chunks, one noised chunk",
}
METHOD_TAGS = {"finetune": ["fine-tuning"], "dfsft": ["diffusion-forcing"], "tfsft": ["teacher-forcing"]}
PIPELINE_TAGS = {"t2v": "text-to-video", "i2v": "image-to-video"}


class HubPushError(RuntimeError):
    """A push that did not happen; the message is one line naming the repo and the kept outputs."""


def _is_hub_id(name: Optional[str]) -> bool:
    """A Hub repo id ("org/name"), not a local folder."""
    return bool(name) and not Path(name).exists() and re.fullmatch(r"[\w.-]+/[\w.-]+", name) is not None


def _last_samples(output_dir: Path) -> tuple[Optional[int], list[Path]]:
    folders = []
    for p in (output_dir / "samples").glob("step-*"):
        if p.is_dir() and p.name[5:].isdigit():
            folders.append((int(p.name[5:]), p))
    if not folders:
        return None, []
    step, folder = max(folders)
    return step, sorted(f for f in folder.iterdir() if f.suffix in (".mp4", ".gif", ".png", ".webp"))


def card_text(
    output_dir: Path,
    cfg: Any,
    *,
    family: Any = None,
    kind: Optional[str] = None,
    task: Optional[str] = None,
    shift: Any = None,
    data_size: Optional[int] = None,
    steps: Optional[int] = None,
    repo_id: Optional[str] = None,
    summary: Optional[dict] = None,
    pipeline: Optional[str] = None,
) -> str:
    """The model card of the run in `output_dir` (front matter + body), from its recipe `cfg`.

    `family` is the student's family class (its pipeline and ComfyUI support), `kind` its
    model_class, `task` "t2v"/"i2v", `shift` the training shift it used, `data_size` the number of
    training clips (held-out ones left out), `steps` the final step; `repo_id` is what the loading
    snippets load (else the folder); `pipeline` the model folder or Hub id the run's VAE, text
    encoder and scheduler came from (`fv_accel.validation.sampling_model_source`), which the
    snippets load the pipeline from.
    """
    output_dir = Path(output_dir)
    st = cfg.models.student
    lora = bool(st.lora.enable)
    task = task if task in PIPELINE_TAGS else "t2v"
    base = st.init_from if _is_hub_id(st.init_from) else None
    front = _front_matter(cfg, family, task, base, lora)
    where = repo_id or str(output_dir.resolve())
    title = repo_id or cfg.training.tracker.run_name
    lines = [f"---\n{front}\n---", "", f"# {title}", ""]
    lines += _training_lines(cfg, lora, shift, data_size, steps, summary)
    lines += ["", "## Use it with diffusers", ""]
    vsa = cfg.training.vsa.sparsity if cfg.training.vsa.enabled else None
    lines += _diffusers_snippet(output_dir, where, family, kind, lora, st.init_from, vsa, pipeline)
    lines += _few_step_lines(output_dir, where, cfg)
    lines += _usage_notes(output_dir, cfg)
    lines += _sample_lines(output_dir, cfg)
    return "\n".join(lines) + "\n"


def _front_matter(cfg: Any, family: Any, task: str, base: Optional[str], lora: bool) -> str:
    """The card's YAML front matter: base model, library, pipeline tag and tags."""
    import yaml

    method = cfg.method.name
    tags = ["fv_accel", "diffusers", "video-generation", PIPELINE_TAGS[task], method, *METHOD_TAGS.get(method, [])]
    if lora:
        tags.append("lora")
    if family is not None and getattr(family, "family", ""):
        tags.append(family.family)
    meta: dict[str, Any] = {}
    if base:
        meta["base_model"] = base
    meta.update(library_name="diffusers", pipeline_tag=PIPELINE_TAGS[task], tags=tags)
    return yaml.safe_dump(meta, sort_keys=False).strip()


def _training_lines(
    cfg: Any, lora: bool, shift: Any, data_size: Optional[int], steps: Optional[int], summary: Optional[dict]
) -> list[str]:
    """The card's first paragraph and its Training section: the recipe's method, schedule, data and the run's losses."""
    st = cfg.models.student
    method = cfg.method.name
    base_text = f"`{st.init_from}`" if st.init_from else "a transformer built from the recipe's inline `transformer_config` (randomly initialised, fv_accel's tiny model)"
    lines = [
        f"A {'LoRA' if lora else 'full'} fine-tune of {base_text} trained with "
        "fv_accel (FastVideo's training methods on diffusers + Accelerate).",
        "",
        "## Training",
        "",
        f"- method: `{method}`, {METHOD_TEXT.get(method, method)}",
    ]
    if method in ("dfsft", "tfsft"):
        lines.append(f"- chunk size: {cfg.method.chunk_size} latent frames")
    if method != "self_forcing":  # its score timesteps span the whole schedule, whatever the window keys say
        lines.append(f"- timestep range: {cfg.method.min_timestep_ratio} to {cfg.method.max_timestep_ratio} of the schedule")
    shift_text = shift if shift is not None else (st.flow_shift if st.flow_shift is not None else "the family's default")
    lines.append(f"- training shift: {json.dumps(shift_text) if isinstance(shift_text, dict) else shift_text}")
    if st.causal:
        lines.append(f"- block-causal self-attention (local window {st.local_attn_size}, sink {st.sink_size}); recorded in the transformer's config.json")
    if lora:
        lines.append(f"- LoRA: rank {st.lora.rank}, alpha {st.lora.alpha}, init `{st.lora.init}`")
    vsa = cfg.training.vsa
    if vsa.enabled:
        ramp = f", ramped by {vsa.decay_rate:g} every {vsa.decay_interval_steps} steps" if vsa.decay_rate > 0 else ""
        lines.append(f"- video sparse attention (VSA, fv_accel.vsa): sparsity {vsa.sparsity:g}{ramp}; trained gates "
                     "`to_gate_compress` in every self-attention" + (" (in the LoRA file)" if lora else ""))
    opt, loop, data = cfg.training.optimizer, cfg.training.loop, cfg.training.data
    lines.append(f"- steps: {steps if steps is not None else loop.max_train_steps}, batch size {data.train_batch_size} per process x "
                 f"{loop.gradient_accumulation_steps} accumulation step(s)")
    lines.append(f"- learning rate {opt.learning_rate:g} ({opt.lr_scheduler}, {opt.lr_warmup_steps} warmup steps), weight decay {opt.weight_decay:g}")
    size = f"{data_size} training clips" if data_size is not None else "unknown size"
    lines.append(f"- data: `{data.data_path}` ({size}{_set_aside_text((summary or {}).get('skipped_samples'))})")
    lines.append(f"- text embeddings padded to {data.text_max_length} tokens")
    if summary:
        first, last, k = summary.get("first_loss_mean"), summary.get("last_loss_mean"), summary.get("loss_mean_window")
        if isinstance(first, float) and isinstance(last, float) and k:
            lines.append(f"- training loss {first:.4f} -> {last:.4f} (mean of the first / last {k} logged steps)")
        if summary.get("best_heldout_loss") is not None:
            lines.append(f"- best held-out loss {summary['best_heldout_loss']:.4f} at step {summary.get('best_heldout_step')}")
    return lines


def _set_aside_text(skipped: Optional[list]) -> str:
    """The data line's note of the rows set aside in training for NaN/inf in their data (the run
    summary's `skipped_samples`), or ''."""
    if not skipped:
        return ""
    rows = "; ".join(
        f"`{Path(s['file']).name}` row {s['row']}" + (f" (id `{s['id']}`)" if s.get("id") else "") + f", step {s['step']}"
        for s in skipped
    )
    return f"; {len(skipped)} row(s) set aside when found to hold NaN/inf in their data, not trained on: {rows}"


def _few_step_lines(output_dir: Path, where: str, cfg: Any) -> list[str]:
    """A few-step student (DMD2): sample it with the scheduler saved beside it, at its step count
    and without guidance, as the run's validation did (its first prompt, at the size of its sample
    videos or its validation keys, else the pipeline's default size; with its text length)."""
    from fv_accel.data.loader import TEXT_MAX_LENGTH

    if not (output_dir / "scheduler" / "scheduler_config.json").is_file() or not cfg.method.dmd_denoising_steps:
        return []
    steps = len(cfg.method.dmd_denoising_steps)
    prompts = list(cfg.callbacks.validation.prompts or [])
    prompt = prompts[0] if prompts and isinstance(prompts[0], str) else "a prompt"
    val = cfg.callbacks.validation
    size = _sample_size(output_dir) or ((val.height, val.width, val.num_frames) if val.height and val.width and val.num_frames else None)
    args = "" if size is None else f"height={size[0]}, width={size[1]}, num_frames={size[2]}, "
    length = cfg.training.data.text_max_length
    args += f"max_sequence_length={length}, " if length != TEXT_MAX_LENGTH else ""
    return [
        "", f"A {steps}-step student (distilled with DMD2): sample it with the scheduler saved beside it, in "
        f"{steps} steps, without classifier-free guidance (the teacher's guidance is distilled in):", "",
        "```python", "from diffusers import FlowMatchLCMScheduler", "",
        f'pipe.scheduler = FlowMatchLCMScheduler.from_pretrained("{where}", subfolder="scheduler")',
        "seed = 1234",
        "torch.manual_seed(seed + 1)  # each step's fresh noise comes from the global generator",
        f"video = pipe({json.dumps(prompt)}, {args}num_inference_steps={steps}, guidance_scale=1.0, "
        "generator=torch.Generator().manual_seed(seed)).frames[0]",
        "```",
    ]


def _sample_size(output_dir: Path) -> Optional[tuple[int, int, int]]:
    """(height, width, frames) of the run's last sample video, None without one."""
    _, videos = _last_samples(output_dir)
    video = next((v for v in videos if v.suffix == ".mp4"), None)
    if video is None:
        return None
    import av

    try:
        with av.open(str(video)) as container:
            stream = container.streams.video[0]
            size = int(stream.height), int(stream.width), int(stream.frames)
    except (OSError, ValueError, IndexError):  # an unreadable sample: the pipeline's default size
        return None
    return size if size[2] > 0 else None


def _usage_notes(output_dir: Path, cfg: Any) -> list[str]:
    """After the diffusers snippet: the text length to sample with, and the ComfyUI file if there is one."""
    from fv_accel.data.loader import TEXT_MAX_LENGTH

    data = cfg.training.data
    lines: list[str] = []
    if data.text_max_length != TEXT_MAX_LENGTH:
        lines += ["", f"Trained on prompts padded to {data.text_max_length} tokens: sample with "
                  f"`pipe(..., max_sequence_length={data.text_max_length})`."]
    if (output_dir / "pytorch_lora_weights_comfyui.safetensors").is_file():
        lines += [
            "",
            "## Use it with ComfyUI",
            "",
            "Copy `pytorch_lora_weights_comfyui.safetensors` (keys in ComfyUI's `diffusion_model.` layout) into "
            "`ComfyUI/models/loras/` and apply it to the base model with a *LoraLoaderModelOnly* node.",
        ]
    return lines


def _sample_lines(output_dir: Path, cfg: Any) -> list[str]:
    """The Samples section (the validation prompts and the last step's videos) and the Curves section."""
    lines: list[str] = []
    step, videos = _last_samples(output_dir)
    prompts = list(cfg.callbacks.validation.prompts or []) if cfg.callbacks.validation.enable else []
    if prompts or videos:
        lines += ["", "## Samples", ""]
        if prompts:
            lines.append("Prompts:")
            lines += [f"- {p}" for p in prompts]
            lines.append("")
        if videos:
            lines.append(f"At step {step}:")
            lines.append("")
            for v in videos:
                rel = v.relative_to(output_dir).as_posix()
                if v.suffix == ".mp4":
                    lines.append(f'<video src="{rel}" controls loop muted></video>')
                else:
                    lines.append(f"![{v.stem}]({rel})")
    figures = [(n, t) for n, t in (("heldout_loss.png", "Held-out loss"), ("loss.png", "Training loss")) if (output_dir / "plots" / n).is_file()]
    if figures:
        lines += ["", "## Curves", ""]
        lines += [f"![{t}](plots/{n})" for n, t in figures]
    return lines


def _vsa_snippet(where: str, lora: bool, sparsity: float, subfolder: str = "transformer") -> list[str]:
    """What a run trained with video sparse attention adds: VSA enabled on the transformer at the
    trained sparsity, and its trained gates (a stock from_pretrained or load_lora_weights leaves them out)."""
    if lora:
        return ["", "Trained with video sparse attention (VSA): the LoRA file also holds the trained gates, which "
                "diffusers' `load_lora_weights` refuses. Load both with fv_accel, which calls "
                f"`fv_accel.vsa.enable_vsa(pipe.transformer, sparsity={sparsity:g})` before sampling:", "",
                "```python", "from fv_accel.vsa import load_vsa_lora", "",
                f'load_vsa_lora(pipe, "{where}", sparsity={sparsity:g})  # instead of pipe.load_lora_weights', "```"]
    return ["", f"Trained with video sparse attention (VSA): call `fv_accel.vsa.enable_vsa(pipe.transformer, sparsity={sparsity:g})` "
            "before sampling, then load the trained gates (`from_pretrained` drops them; a Hub repo: its local "
            "snapshot folder):", "",
            "```python", "from fv_accel.vsa import enable_vsa, load_vsa_gates", "",
            f"enable_vsa(transformer, sparsity={sparsity:g})  # the transformer loaded above (pipe.transformer)",
            f'load_vsa_gates(transformer, "{where}/{subfolder}")', "```"]


def _diffusers_snippet(
    output_dir: Path, where: str, family: Any, kind: Optional[str], lora: bool, base: Optional[str],
    vsa: Optional[float] = None, pipeline: Optional[str] = None,
) -> list[str]:
    """Loading code: the pipeline repo's own class (its model_index.json), which is right for every
    family and task; the transformer class is the student's. `base` is the run's `init_from`,
    `pipeline` where its VAE and text encoder came from (`_pipeline_source`); `vsa`: the sparsity
    of a run trained with video sparse attention (its gates need fv_accel)."""
    return _plain_snippet(output_dir, where, family, kind, lora, base, pipeline) + (
        [] if vsa is None else _vsa_snippet(where, lora, vsa)
    )


def _pipeline_source(base: Optional[str], pipeline: Optional[str] = None) -> Optional[str]:
    """The pipeline folder or Hub id the snippets load the VAE, text encoder and scheduler from: the
    run's own (`pipeline`), else its base when that is a pipeline (a Hub id, or a folder with
    model_index.json); None when unknown (an inline base, or a run folder of ours as base)."""
    if pipeline:
        return pipeline
    if base and (_is_hub_id(base) or (Path(base) / "model_index.json").is_file()):
        return base
    return None


def _pipeline_class_name(source: Optional[str]) -> str:
    """The diffusers pipeline class the snippets load `source` with: the class its model_index.json
    names (a folder, or a Hub repo in the local cache), else DiffusionPipeline. Named where known:
    `DiffusionPipeline.from_pretrained` drops a passed component that the pipeline declares optional
    (Wan's `transformer`) and loads the repo's own instead."""
    index = None
    if source and Path(source, "model_index.json").is_file():
        index = Path(source, "model_index.json")
    elif source and _is_hub_id(source):
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(source, "model_index.json")
        index = Path(cached) if isinstance(cached, str) else None
    try:
        name = json.loads(index.read_text()).get("_class_name") if index is not None else None
    except (OSError, ValueError):
        name = None
    return str(name or "DiffusionPipeline")


def _plain_snippet(
    output_dir: Path, where: str, family: Any, kind: Optional[str], lora: bool, base: Optional[str], pipeline: Optional[str]
) -> list[str]:
    transformer_cls = None
    if family is not None:
        classes = getattr(family, "transformer_classes", {})
        transformer_cls = classes.get(kind) or (next(iter(classes.values())) if classes else None)
    name = transformer_cls.__name__ if transformer_cls is not None else "AutoModel"
    source = _pipeline_source(base, pipeline)
    pipe = _pipeline_class_name(source)
    if lora and base is None:
        return ["The LoRA's base was built from the recipe's inline `transformer_config` (random weights, not saved): "
                f"the adapter applies to that base only. `python -m fv_accel.generate {output_dir.resolve()}` rebuilds it "
                "from the run's recipe and samples with the adapter."]
    if lora:  # the base's transformer, in the pipeline it was trained with, and the adapter on it
        subs = [] if base == source else [("transformer", base)]
    else:
        subs = [(p.name, where) for p in sorted(output_dir.glob("transformer*")) if (p / "config.json").is_file()]
        subs = subs or [("transformer", where)]
    out = ["```python", "import torch", f"from diffusers import {pipe}" + (f", {name}" if subs else ""), ""]
    names = ["transformer" if i == 0 else f"transformer_{i + 1}" for i in range(len(subs))]
    for var, (sub, folder) in zip(names, subs):
        out.append(f'{var} = {name}.from_pretrained("{folder}", subfolder="{sub}", torch_dtype=torch.bfloat16)')
    if source:
        args = "".join(f", {var}={var}" for var in names)
        out.append(f'pipe = {pipe}.from_pretrained("{source}"{args}, torch_dtype=torch.bfloat16)')
    if lora and source:
        out.append(f'pipe.load_lora_weights("{where}")')
    out.append("```")
    if not source:
        out += ["", "The pipeline the run sampled with is not recorded: the transformer loads on its own; pair it with "
                "the VAE and text encoder it was trained with" + (", then load the LoRA onto it." if lora else ".")]
    others = sorted(p.name for p in output_dir.glob("pytorch_lora_weights_*.safetensors") if "comfyui" not in p.name)
    if lora and others:  # a second expert's adapter (Wan 2.2 A14B, expert: both)
        out += ["", "Also here: " + ", ".join(f"`{n}`" for n in others) + " (`weight_name=` of `load_lora_weights`)."]
    if not lora and (output_dir / "ema" / "transformer" / "config.json").is_file():
        out += ["", 'EMA weights: `subfolder="ema/transformer"`.']
    return out


def export_card_text(out_dir: Path, *, source: Path, to: str, base: dict, family: Any, repo_id: Optional[str]) -> str:
    """The model card of an export folder (`python -m fv_accel.export ... --push_to_hub`): what
    it holds, where it came from and how to load it; `base` is the run's base_model.json fields."""
    import yaml

    out_dir = Path(out_dir)
    lora = (out_dir / "pytorch_lora_weights.safetensors").is_file() or (out_dir / "pytorch_lora_weights_comfyui.safetensors").is_file()
    init_from = base.get("init_from")
    task = base.get("task") if base.get("task") in PIPELINE_TAGS else "t2v"
    tags = ["fv_accel", "diffusers", "video-generation", PIPELINE_TAGS[task]] + (["lora"] if lora else [])
    if family is not None and getattr(family, "family", ""):
        tags.append(family.family)
    meta: dict[str, Any] = {"base_model": init_from} if _is_hub_id(init_from) else {}
    meta.update(library_name="diffusers", pipeline_tag=PIPELINE_TAGS[task], tags=tags)
    where = repo_id or str(out_dir.resolve())
    lines = [f"---\n{yaml.safe_dump(meta, sort_keys=False).strip()}\n---", "", f"# {repo_id or out_dir.name}", ""]
    lines.append(f"`--to {to}` export of the fv_accel run output `{Path(source).name}` "
                 f"({'LoRA' if lora else 'full transformer'}; base `{init_from or 'inline transformer_config'}`).")
    lines += ["", "## Use it with diffusers", ""]
    if to == "comfyui":
        lines.append("ComfyUI LoRA file: copy `pytorch_lora_weights_comfyui.safetensors` into `ComfyUI/models/loras/` "
                     "and apply it to the base model with a *LoraLoaderModelOnly* node.")
    else:
        vsa = (base.get("vsa") or {}).get("sparsity") or None
        lines += _diffusers_snippet(out_dir, where, family, base.get("model_class"), lora and to != "merged", init_from, vsa)
    return "\n".join(lines) + "\n"


def write_model_card(output_dir: Path, text: str) -> Path:
    """Write `text` as `<output_dir>/README.md`, checking that huggingface_hub parses it."""
    from huggingface_hub import ModelCard

    card = ModelCard(text)  # parses the front matter (raises on a malformed one)
    path = Path(output_dir) / CARD_NAME
    path.write_text(str(card), encoding="utf-8")
    return path


def push_folder(
    folder: Path,
    repo_id: str,
    *,
    private: bool = False,
    revision: Optional[str] = None,
    commit_message: Optional[str] = None,
    token: Optional[str] = None,
) -> str:
    """Upload `folder` (checkpoints, the lock and exports left out) to the model repo `repo_id`,
    creating it (and the branch `revision`) if absent; the commit's URL. Any failure is a
    HubPushError of one line."""
    folder = Path(folder)
    try:
        from huggingface_hub import HfApi

        api = HfApi(token=token)
        api.create_repo(repo_id, private=private, repo_type="model", exist_ok=True)
        if revision:
            api.create_branch(repo_id, branch=revision, repo_type="model", exist_ok=True)
        info = api.upload_folder(
            repo_id=repo_id,
            folder_path=str(folder),
            repo_type="model",
            revision=revision,
            ignore_patterns=PUSH_IGNORE,
            commit_message=commit_message or f"fv_accel: upload {folder.name}",
        )
    except Exception as err:  # noqa: BLE001 - every failure (offline, auth, network) is reported the same way
        text = " ".join(str(err).split()) or "no message"
        if len(text) > 300:
            text = text[:297] + "..."
        raise HubPushError(
            f"push to the Hub failed: repo {repo_id}: {type(err).__name__}: {text}; the outputs are kept at {folder}"
        ) from None
    return str(getattr(info, "commit_url", info))
