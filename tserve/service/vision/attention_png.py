"""PNG pictures of attention maps (Pillow only): a grid of heatmaps with token labels, and for a ViT the
class token's attention laid over the image."""

from __future__ import annotations

import io

import torch
from PIL import Image, ImageDraw, ImageFont

from tserve.model.attention_maps import AttentionMap

_FONT = ImageFont.load_default()
_PANEL = 240  # heatmap side in pixels
_LABEL = 90  # room for token labels
_MAX_LABELS = 40  # beyond this many tokens, labels would overlap: leave them out


def _colour(weights: torch.Tensor) -> Image.Image:
    """(Q, K) in [0, 1] -> RGB heatmap, white (0) to dark blue (max of the map)."""
    w = weights / weights.max().clamp_min(1e-9)
    r = (255 * (1 - w)).to(torch.uint8)
    g = (255 * (1 - 0.8 * w)).to(torch.uint8)
    b = torch.full_like(r, 255) - (w * 80).to(torch.uint8)
    return Image.fromarray(torch.stack([r, g, b], -1).numpy(), "RGB")


def _short(token: str) -> str:
    return token if len(token) <= 12 else token[:11] + "…"


def _panel(m: AttentionMap, head: int, head_index: int) -> Image.Image:
    q, k = m.weights.shape[1:]
    cell = max(1, _PANEL // max(q, k))
    heat = _colour(m.weights[head_index]).resize((k * cell, q * cell), Image.NEAREST)
    labels = q <= _MAX_LABELS and k <= _MAX_LABELS
    margin = _LABEL if labels else 0
    img = Image.new("RGB", (margin + heat.width + 10, margin + heat.height + 24), "white")
    img.paste(heat, (margin, margin + 20))
    draw = ImageDraw.Draw(img)
    draw.text((margin, 4), f"{m.module} layer {m.layer} head {head}", fill="black", font=_FONT)
    if labels:
        for i, tok in enumerate(m.query_tokens):
            draw.text((2, margin + 20 + i * cell + cell // 2 - 5), _short(tok), fill="black", font=_FONT)
        top = Image.new("RGB", (margin, heat.width), "white")
        top_draw = ImageDraw.Draw(top)
        for j, tok in enumerate(m.key_tokens):
            top_draw.text((2, j * cell + cell // 2 - 5), _short(tok), fill="black", font=_FONT)
        img.paste(top.rotate(90, expand=True), (margin, 20))
    return img


def heatmap_grid(maps: list[AttentionMap], heads: list[int], columns: int = 4) -> bytes:
    panels = [_panel(m, h, i) for m in maps for i, h in enumerate(heads)]
    if not panels:
        raise ValueError("no attention maps to draw")
    w = max(p.width for p in panels)
    h = max(p.height for p in panels)
    cols = min(columns, len(panels))
    rows = (len(panels) + cols - 1) // cols
    sheet = Image.new("RGB", (cols * w, rows * h), "white")
    for n, p in enumerate(panels):
        sheet.paste(p, ((n % cols) * w, (n // cols) * h))
    return _png(sheet)


def image_overlay(image: Image.Image, cls_attention: torch.Tensor, grid: int, title: str) -> bytes:
    """The class token's attention over the patches (grid x grid) laid over the image as a red heat."""
    base = image.convert("L").convert("RGB").resize((_PANEL, _PANEL))
    a = cls_attention.reshape(grid, grid)
    a = (a / a.max().clamp_min(1e-9) * 255).to(torch.uint8).numpy()
    heat = Image.fromarray(a, "L").resize((_PANEL, _PANEL), Image.BILINEAR)
    red = Image.new("RGB", base.size, (255, 0, 0))
    blended = Image.composite(red, base, heat.point(lambda v: int(v * 0.7)))
    out = Image.new("RGB", (_PANEL * 2 + 10, _PANEL + 24), "white")
    out.paste(base, (0, 24))
    out.paste(blended, (_PANEL + 10, 24))
    ImageDraw.Draw(out).text((4, 4), title, fill="black", font=_FONT)
    return _png(out)


def _png(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()
