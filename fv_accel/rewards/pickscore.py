"""PickScore (Kirstain et al. 2023): how much people would prefer an image for its prompt, as
FastVideo 0.2.1 and DiffusionNFT compute it.

The model `yuvalkirstain/PickScore_v1` (a CLIP ViT-H fine-tuned on Pick-a-Pic) loaded with
`AutoModel`, its processor `laion/CLIP-ViT-H-14-laion2B-s32B-b79K` with `AutoProcessor`. For a
frame and its prompt: the image and text embeddings (`get_image_features` / `get_text_features`),
each L2-normalised; score = logit_scale.exp() * <text, image> / 26 (DiffusionNFT's scale, about 1
for a good match). A clip scores the mean over its chosen frames (option `frames`, default the
first frame only, as FastVideo).
"""

from __future__ import annotations

from typing import Sequence

import torch

from fv_accel.rewards.base import (
    CLIP_MAX_TEXT_TOKENS,
    RewardEntry,
    clip_frames_as_images,
    projected_features,
    register_reward,
    sample_chunks,
)
from fv_accel.rewards.loading import FrozenModelReward

PICKSCORE_DIVISOR = 26.0


@register_reward
class PickScore(FrozenModelReward):
    name = "pickscore"
    options = {
        "model": "yuvalkirstain/PickScore_v1",
        "revision": None,
        "processor": "laion/CLIP-ViT-H-14-laion2B-s32B-b79K",
        "processor_revision": None,
        "frames": 1,
        "dtype": "float32",
    }

    def __init__(self, entry: RewardEntry, device: torch.device):
        from transformers import AutoModel, AutoProcessor

        super().__init__(entry, device)
        opts = entry.options
        self.load(AutoProcessor.from_pretrained, opts["processor"], opts["processor_revision"], AutoModel.from_pretrained)

    @torch.inference_mode()
    def __call__(self, clips: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        images, per_sample = clip_frames_as_images(clips, self.frames)
        text_emb = self.text_embeddings(prompts)  # [B, D]
        scale = self.model.logit_scale.float().exp()
        scores = []
        for chunk in sample_chunks(len(prompts), per_sample):
            image_emb = self.image_embeddings(images[chunk.start * per_sample : chunk.stop * per_sample])
            image_emb = image_emb.view(-1, per_sample, image_emb.shape[-1])  # [b, F, D]
            per_frame = scale * (text_emb[chunk, None, :] * image_emb).sum(-1) / PICKSCORE_DIVISOR
            scores.append(per_frame.mean(dim=1))
        return torch.cat(scores).float()

    def text_embeddings(self, prompts: Sequence[str]) -> torch.Tensor:
        """L2-normalised text embeddings [B, D] (float32) of the prompts, truncated to 77 tokens."""
        text = self.processor(
            text=list(prompts), padding=True, truncation=True, max_length=CLIP_MAX_TEXT_TOKENS, return_tensors="pt"
        ).to(self.device)
        out = self.model.get_text_features(input_ids=text["input_ids"], attention_mask=text["attention_mask"])
        emb = projected_features(out, self.model.config.projection_dim, "text").float()
        return emb / emb.norm(dim=-1, keepdim=True)

    def image_embeddings(self, images: list) -> torch.Tensor:
        """L2-normalised image embeddings [N, D] (float32) of PIL images (the processor's resize,
        centre crop and normalisation)."""
        pixels = self.processor(images=images, return_tensors="pt")["pixel_values"]
        out = self.model.get_image_features(pixel_values=pixels.to(device=self.device, dtype=self.dtype))
        emb = projected_features(out, self.model.config.projection_dim, "image").float()
        return emb / emb.norm(dim=-1, keepdim=True)
