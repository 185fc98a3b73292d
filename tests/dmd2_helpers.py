"""Overrides for tiny DMD2 runs in tests: configs/tiny_dmd2.yaml with an inline random-weight
teacher (student and critic inherit it, so all three start from the same weights), small sizes,
everything inside tmp_path."""

from __future__ import annotations

from pathlib import Path

from conftest import tiny_overrides

DMD2_RECIPE = str(Path(__file__).resolve().parents[1] / "configs" / "tiny_dmd2.yaml")

TINY_TEACHER = {
    "patch_size": [1, 2, 2],
    "num_attention_heads": 2,
    "attention_head_dim": 16,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 32,
    "freq_dim": 32,
    "ffn_dim": 64,
    "num_layers": 1,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "rope_max_seq_len": 32,
}


def dmd2_overrides(tmp_path, **extra) -> dict:
    out = tiny_overrides(tmp_path)
    for key in [k for k in out if k.startswith("models.student.transformer_config")]:
        del out[key]
    out.update({
        "models.teacher.init_from": None,
        "models.teacher.transformer_config": dict(TINY_TEACHER),
        "training.data.train_batch_size": 2,
        "training.data.text_max_length": 16,
        "training.loop.max_train_steps": 4,
    })
    out.update(extra)
    return out
