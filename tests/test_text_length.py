"""training.data.text_max_length: the padded text length of training batches, sample prompts, the
held-out loss and the model card's loading code."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fv_accel.config import ConfigError, default_recipe, load_config
from tests.conftest import tiny_overrides


def test_text_max_length_must_be_positive():
    with pytest.raises(ConfigError, match=r"key 'training.data.text_max_length'.* got 0"):
        load_config(default_recipe("dfsft"), {"training.data.text_max_length": 0})


def test_short_text_length_reaches_batches_prompts_heldout_and_card(tmp_path, tiny_data_path):
    from fv_accel.build import build_from_config
    from fv_accel.data.loader import LatentDataset
    from fv_accel.hub import card_text
    from fv_accel.models import WanStudent
    from fv_accel.validation import HeldoutLossCallback, VideoSamplingCallback, prompt_columns

    run = build_from_config(
        default_recipe("dfsft"),
        tiny_overrides(
            tmp_path,
            **{
                "training.data.data_path": tiny_data_path,
                "training.data.text_max_length": 16,
                "callbacks.validation.enable": True,
                "callbacks.validation.heldout_data_path": tiny_data_path,
            },
        ),
    )
    batch = next(iter(run.dataloader))
    full = LatentDataset(tiny_data_path)[(0, 0, 0)]  # the default length, 512
    assert full["text_embedding"].shape[0] == 512
    b, n, d = batch["text_embedding"].shape
    assert (n, d) == (16, full["text_embedding"].shape[1]) and batch["text_attention_mask"].shape == (b, 16)
    # The tiny captions are shorter than 16 tokens: cutting the padding loses no token.
    real = int(full["text_attention_mask"].sum())
    assert 0 < real < 16
    first = LatentDataset(tiny_data_path, text_max_length=16)[(0, 0, 0)]
    torch.testing.assert_close(first["text_embedding"], full["text_embedding"][:16], rtol=0, atol=0)
    assert int(first["text_attention_mask"].sum()) == real

    heldout = next(cb for cb in run.callbacks if isinstance(cb, HeldoutLossCallback))
    assert heldout.dataset[(heldout.rows[0], 0, 0)]["text_embedding"].shape == (16, d)

    sampler = next(cb for cb in run.callbacks if isinstance(cb, VideoSamplingCallback))
    sampler._load(SimpleNamespace(accelerator=run.accelerator, method=run.method))
    prompt = sampler.prompts[0].prompt
    emb = sampler.embeddings[prompt]
    assert emb["text_embedding"].shape == (1, 16, d) and emb["text_attention_mask"].shape == (1, 16)
    encoder = WanStudent.make_encoder(sampler.model_source)
    long = prompt_columns({k: v.float() for k, v in encoder.encode_caption(prompt).items()}, 512)
    torch.testing.assert_close(emb["text_embedding"], long["text_embedding"][:, :16], rtol=0, atol=0)
    assert long["text_embedding"][:, 16:].abs().sum() == 0  # only padding was left out

    text = card_text(tmp_path, run.config, family=WanStudent, kind="wan", task="t2v", shift=3.0, data_size=8, steps=1)
    assert "- text embeddings padded to 16 tokens" in text and "max_sequence_length=16" in text
    default = card_text(tmp_path, load_config(default_recipe("dfsft"), {"training.data.text_max_length": 512}), family=WanStudent, kind="wan", task="t2v",
                        shift=3.0, data_size=8, steps=1)
    assert "padded to 512 tokens" in default and "max_sequence_length" not in default
