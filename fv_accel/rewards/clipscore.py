"""CLIPScore: how well an image matches its prompt under OpenAI's CLIP, as FastVideo computes it.

The model `openai/clip-vit-large-patch14` (`CLIPModel`) and its `CLIPProcessor`: the text padded
to 77 tokens and truncated, the frames through the processor's image processor on PIL images
(resize, centre crop, normalisation; its PIL backend needs no torchvision); score =
`logits_per_image` of the frame with its own prompt (the diagonal) / 100, i.e. the cosine
similarity times logit_scale.exp() / 100. A clip scores the mean over its chosen frames (option
`frames`, default the first frame only, as FastVideo).
"""

from __future__ import annotations

from typing import Sequence

import torch

from fv_accel.rewards.base import CLIP_MAX_TEXT_TOKENS, RewardEntry, clip_frames_as_images, register_reward, sample_chunks
from fv_accel.rewards.loading import FrozenModelReward

CLIPSCORE_DIVISOR = 100.0


@register_reward
class CLIPScore(FrozenModelReward):
    name = "clipscore"
    options = {"model": "openai/clip-vit-large-patch14", "revision": None, "frames": 1, "dtype": "float32"}

    def __init__(self, entry: RewardEntry, device: torch.device):
        from transformers import CLIPModel, CLIPProcessor

        super().__init__(entry, device)
        self.load(CLIPProcessor.from_pretrained, entry.options["model"], entry.options["revision"], CLIPModel.from_pretrained)

    @torch.inference_mode()
    def __call__(self, clips: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        images, per_sample = clip_frames_as_images(clips, self.frames)
        scores = []
        for chunk in sample_chunks(len(prompts), per_sample):
            inputs = self.processor(
                text=list(prompts[chunk]), images=images[chunk.start * per_sample : chunk.stop * per_sample],
                padding="max_length", max_length=CLIP_MAX_TEXT_TOKENS, truncation=True, return_tensors="pt",
            ).to(self.device)
            outputs = self.model(
                input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"],
                pixel_values=inputs["pixel_values"].to(self.dtype),
            )
            n = chunk.stop - chunk.start
            # logits_per_image [n * F, n]: each frame's row, its own sample's prompt's column.
            logits = outputs.logits_per_image.float().view(n, per_sample, n)
            own = logits[torch.arange(n), :, torch.arange(n)]  # [n, F]
            scores.append((own / CLIPSCORE_DIVISOR).mean(dim=1))
        return torch.cat(scores).float()
