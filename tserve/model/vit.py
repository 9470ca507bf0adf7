"""Vision Transformer classifier: patch embedding, class token, learned positions, pre-norm blocks,
a final norm and a linear head on the class token. DeiT: a distillation token after the class token and, for a
model trained with a teacher, a second head on it, the two heads' logits averaged (as transformers'
`DeiTForImageClassificationWithTeacher` does at inference)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from tserve.model.config import ViTConfig
from tserve.model.layers import Block, make_norm


class ViT(nn.Module):
    def __init__(self, cfg: ViTConfig, backend: str = "auto") -> None:
        super().__init__()
        self.cfg = cfg
        self.patch_embed = nn.Conv2d(cfg.n_channels, cfg.d_model, kernel_size=cfg.patch_size, stride=cfg.patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.d_model))
        self.dist_token = nn.Parameter(torch.zeros(1, 1, cfg.d_model)) if cfg.distillation_token else None
        self.pos_emb = nn.Parameter(torch.randn(1, cfg.n_patches + cfg.n_prefix_tokens, cfg.d_model) * 0.02)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, backend=backend) for _ in range(cfg.n_layers))
        self.norm = make_norm(cfg)
        self.head = nn.Linear(cfg.d_model, cfg.n_classes)
        self.head_dist = nn.Linear(cfg.d_model, cfg.n_classes) if cfg.distillation_head else None
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    def tokens(self, pixels: Tensor) -> Tensor:
        """(B, C, H, W) -> (B, n_prefix_tokens + n_patches, C): the class token (DeiT: then the distillation
        token), then the patches in row-major order."""
        if pixels.is_cuda:
            # Channels-last: the patch convolution then writes (B, h, w, C), which is already the token layout
            # the transpose below asks for, and cuDNN's fast bf16 kernels want this format anyway.
            pixels = pixels.contiguous(memory_format=torch.channels_last)
        x = self.patch_embed(pixels).flatten(2).transpose(1, 2)
        prefix = [self.cls_token] if self.dist_token is None else [self.cls_token, self.dist_token]
        prefix = [t.expand(x.size(0), -1, -1).to(x.dtype) for t in prefix]
        return self.drop(torch.cat((*prefix, x), dim=1) + self.pos_emb.to(x.dtype))

    def _run(self, pixels: Tensor, attention_layers: set[int] | None) -> tuple[Tensor, dict[int, Tensor]]:
        """The prefix tokens' final states (after the final norm: what the heads read; the class token's first)
        and the maps asked for."""
        x = self.tokens(pixels)
        maps: dict[int, Tensor] = {}
        for i, block in enumerate(self.blocks):
            want = attention_layers is not None and i in attention_layers
            x, probs, _ = block(x, need_weights=want)
            if want:
                maps[i] = probs
        return self.norm(x)[:, :self.cfg.n_prefix_tokens], maps

    def classify(self, prefix: Tensor) -> Tensor:
        """The prefix tokens' final states -> class logits: the class token's head, averaged with the
        distillation token's where the model has one."""
        logits = self.head(prefix[:, 0])
        if self.head_dist is not None:
            logits = (logits + self.head_dist(prefix[:, 1])) / 2
        return logits

    def forward(self, pixels: Tensor) -> Tensor:
        """pixels (B, C, H, W), normalised -> class logits (B, n_classes)."""
        return self.classify(self._run(pixels, None)[0])

    def features(self, pixels: Tensor) -> Tensor:
        """pixels (B, C, H, W) -> the class token's final state (B, d_model), before the classifier head."""
        return self._run(pixels, None)[0][:, 0]

    def forward_with_attention(
        self, pixels: Tensor, layers: set[int] | None = None
    ) -> tuple[Tensor, dict[int, Tensor]]:
        layers = set(range(self.cfg.n_layers)) if layers is None else set(layers)
        prefix, maps = self._run(pixels, layers)
        return self.classify(prefix), maps

    def token_names(self) -> list[str]:
        g = self.cfg.grid_size
        prefix = ["[CLS]", "[DIST]"][:self.cfg.n_prefix_tokens]
        return prefix + [f"patch({r},{c})" for r in range(g) for c in range(g)]
