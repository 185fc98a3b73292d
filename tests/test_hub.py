"""The model card every completed run writes, and the Hub upload (training.hub, export --push_to_hub)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fv_accel.config import ConfigError, default_recipe, load_config
from tests.conftest import tiny_overrides

LORA = {"models.student.lora.enable": True, "models.student.lora.rank": 4, "training.loop.max_train_steps": 2}


class RecordingApi:
    """Stands in for huggingface_hub.HfApi: records the calls and the files upload_folder would send."""

    calls: list = []

    def __init__(self, token=None, **kwargs):
        pass

    def create_repo(self, repo_id, **kwargs):
        RecordingApi.calls.append(("create_repo", repo_id, kwargs))
        return f"https://hub.test/{repo_id}"

    def create_branch(self, repo_id, **kwargs):
        RecordingApi.calls.append(("create_branch", repo_id, kwargs))

    def upload_folder(self, *, repo_id, folder_path, **kwargs):
        from huggingface_hub.utils import filter_repo_objects

        root = Path(folder_path)
        files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
        sent = sorted(filter_repo_objects(files, ignore_patterns=kwargs.get("ignore_patterns")))
        RecordingApi.calls.append(("upload_folder", repo_id, {**kwargs, "files": sent}))

        class Info:
            commit_url = f"https://hub.test/{repo_id}/commit/1"

        return Info()


def test_hub_keys_are_validated():
    with pytest.raises(ConfigError, match=r"key 'training.hub.repo_id': expected a Hub repo id .* got None"):
        load_config(default_recipe("dfsft"), {"training.hub.push_to_hub": True})
    with pytest.raises(ConfigError, match=r"key 'training.hub.repo_id'.*'a b/c'"):
        load_config(default_recipe("dfsft"), {"training.hub.repo_id": "a b/c"})


def test_lora_run_writes_a_card_and_pushes_its_outputs(tmp_path, tiny_data_path, monkeypatch, capsys):
    import huggingface_hub
    from huggingface_hub import ModelCard

    from fv_accel.build import build_from_config
    from fv_accel.trainer import Trainer

    RecordingApi.calls = []
    monkeypatch.setattr(huggingface_hub, "HfApi", RecordingApi)
    overrides = {
        **tiny_overrides(tmp_path), **LORA,
        "training.checkpoint.training_state_checkpointing_steps": 1,
        "training.hub.push_to_hub": True, "training.hub.repo_id": "me/x",
        "training.hub.private": True, "training.hub.revision": "v1",
    }
    run = build_from_config(default_recipe("dfsft"), overrides)
    Trainer(run).run()
    out = tmp_path / "out"
    card = ModelCard.load(out / "README.md")
    assert card.data.library_name == "diffusers" and card.data.pipeline_tag == "text-to-video"
    assert {"dfsft", "diffusion-forcing", "lora", "wan", "text-to-video"} <= set(card.data.tags)
    assert card.data.base_model is None  # the tiny base is an inline config, not a Hub model
    # The adapter's base is the recipe's inline, randomly initialised transformer: no stock pipeline
    # holds it, so the card points at generate (which rebuilds it) instead of a snippet that loads another.
    assert "load_lora_weights" not in card.text and f"python -m fv_accel.generate {out.resolve()}" in card.text
    for text in ("chunk size: 3", "training shift: 3.0", "steps: 2", "(8 training clips)",
                 "Use it with ComfyUI", "LoRA: rank 4"):
        assert text in card.text, text
    (create, _, c), (branch, _, b), (upload, repo, u) = RecordingApi.calls
    assert (create, c["private"], c["exist_ok"]) == ("create_repo", True, True)
    assert (branch, b["branch"]) == ("create_branch", "v1")
    assert (upload, repo, u["revision"]) == ("upload_folder", "me/x", "v1")
    assert {"README.md", "pytorch_lora_weights.safetensors", "pytorch_lora_weights_comfyui.safetensors",
            "base_model.json", "logs/metrics.jsonl"} <= set(u["files"])
    assert (out / "checkpoint-1").is_dir() and not any(f.startswith(("checkpoint-", ".fv_accel")) for f in u["files"])
    assert "pushed" in capsys.readouterr().out
    # What the card points to: generate rebuilds the inline base at the run's seed, the adapter on it.
    import torch

    from fv_accel.generate import load, resolve_source

    rebuilt = load(resolve_source(str(out)), "a prompt", "", torch.device("cpu")).student.transformer.state_dict()
    trained = run.method.student.transformer.state_dict()
    assert rebuilt.keys() == trained.keys() and all(torch.equal(rebuilt[k], trained[k]) for k in trained)


def test_push_without_network_fails_in_one_line_and_keeps_the_outputs(tmp_path, tiny_data_path, capsys):
    from fv_accel.cli import main

    assert os.environ.get("HF_HUB_OFFLINE") == "1"  # tests/conftest.py: no network
    argv = ["--output_dir", str(tmp_path / "out")]
    for key, value in {**tiny_overrides(tmp_path), **LORA, "training.hub.push_to_hub": True, "training.hub.repo_id": "me/x"}.items():
        if key != "training.checkpoint.output_dir":
            argv += [f"--{key}", "[none]" if value == ["none"] else str(value).lower() if isinstance(value, bool) else str(value)]
    assert main("dfsft", argv) == 3
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1 and "repo me/x" in err[0] and f"the outputs are kept at {tmp_path / 'out'}" in err[0], err
    assert (tmp_path / "out" / "pytorch_lora_weights.safetensors").is_file() and (tmp_path / "out" / "README.md").is_file()


def test_push_to_an_unreachable_endpoint_is_one_line(tmp_path, monkeypatch):
    from huggingface_hub import constants

    from fv_accel.hub import HubPushError, push_folder

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    (tmp_path / "README.md").write_text("x")
    with pytest.raises(HubPushError) as info:
        push_folder(tmp_path, "me/x")
    text = str(info.value)
    assert "\n" not in text and "repo me/x" in text and f"kept at {tmp_path}" in text, text


def test_export_push_to_hub_writes_a_card_and_uploads(tmp_path, monkeypatch, capsys):
    import huggingface_hub
    import torch
    from huggingface_hub import ModelCard
    from safetensors.torch import save_file

    from fv_accel.export import main

    RecordingApi.calls = []
    monkeypatch.setattr(huggingface_hub, "HfApi", RecordingApi)
    src = tmp_path / "run"
    src.mkdir()
    lora = {"transformer.blocks.0.attn1.to_q.lora_A.weight": torch.zeros(2, 8), "transformer.blocks.0.attn1.to_q.lora_B.weight": torch.zeros(8, 2)}
    save_file(lora, str(src / "pytorch_lora_weights.safetensors"),
              metadata={"lora_adapter_metadata": '{"r": 2, "lora_alpha": 2, "target_modules": ["to_q"]}'})
    (src / "base_model.json").write_text('{"family": "wan", "init_from": "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "model_class": "wan"}')
    main([str(src), "--to", "diffusers", "--push_to_hub", "me/y", "--revision", "r1"])
    out = src / "exports" / "final_diffusers"
    card = ModelCard.load(out / "README.md")
    assert card.data.base_model == "Wan-AI/Wan2.1-T2V-1.3B-Diffusers" and "lora" in card.data.tags
    assert 'pipe.load_lora_weights("me/y")' in card.text
    upload = RecordingApi.calls[-1]
    assert upload[:2] == ("upload_folder", "me/y") and upload[2]["revision"] == "r1"
    assert upload[2]["files"] == ["README.md", "pytorch_lora_weights.safetensors"]


def test_card_of_a_full_run_shows_samples_curves_and_loading(tmp_path):
    from huggingface_hub import ModelCard

    from fv_accel.hub import card_text, write_model_card
    from fv_accel.models import WanStudent

    cfg = load_config(default_recipe("dfsft"), {"models.student.init_from": "Wan-AI/Wan2.1-T2V-1.3B-Diffusers"})
    for rel in ("samples/step-0/00-a.mp4", "samples/step-300/00-a.mp4", "samples/step-300/01-b.mp4",
                "plots/heldout_loss.png", "plots/loss.png", "transformer/config.json", "ema/transformer/config.json"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("{}")
    text = card_text(tmp_path, cfg, family=WanStudent, kind="wan", task="t2v", shift=3.0, data_size=8, steps=300,
                     summary={"first_loss": 1.5, "last_loss": 0.5, "first_loss_mean": 1.25, "last_loss_mean": 0.625,
                              "loss_mean_window": 10, "best_heldout_loss": 0.7, "best_heldout_step": 300})
    card = ModelCard.load(write_model_card(tmp_path, text))
    assert card.data.base_model == "Wan-AI/Wan2.1-T2V-1.3B-Diffusers" and "lora" not in card.data.tags
    body = card.text
    assert f'WanTransformer3DModel.from_pretrained("{tmp_path.resolve()}", subfolder="transformer"' in body
    assert 'DiffusionPipeline.from_pretrained("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", transformer=transformer' in body
    assert "At step 300:" in body and '<video src="samples/step-300/01-b.mp4"' in body and "step-0/" not in body
    assert "- a green square moving down on a black background" in body  # the recipe's sample prompts
    assert "![Held-out loss](plots/heldout_loss.png)" in body and "best held-out loss 0.7000 at step 300" in body
    assert "training loss 1.2500 -> 0.6250 (mean of the first / last 10 logged steps)" in body
    assert "ComfyUI" not in body  # a full fine-tune has no ComfyUI LoRA file
