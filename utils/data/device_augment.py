"""Augmentation on the training device: the loader workers only read each image a batch needs, and the
training process draws the whole batch with torch (mosaic canvas, warp, mixup, HSV, flips), from the same
sample plans as the OpenCV path (utils/data/plan.py), so the labels are identical and the draws still come
from each sample's (seed, epoch, index).

Why: on a GPU node the warp and colour passes of 4-16 CPU cores per GPU set the training speed; on the
GPU they cost a few milliseconds per batch. The same code runs on CPU tensors (the tests).

The maths follows OpenCV's: a warp samples the canvas bilinearly in float32 with grey 114 outside it
(OpenCV 5's warpAffine/warpPerspective), HSV goes through OpenCV's 8-bit hue, saturation and value with the
same lookup rule, and every stage rounds to 8 bits where OpenCV's does. Images agree with the OpenCV path to
within interpolation rounding (a few pixels off by one; older OpenCV interpolates in fixed point and
differs by a little more).

``pack`` runs in a worker: the distinct tiles back to back in the batch's memory, and every plan as rows
of numbers. ``render_batch`` runs in the training process and returns float images in [0, 1].
"""
from __future__ import annotations

import numpy as np
import torch

from utils.data.batch import BatchMemory, DeferredImages
from utils.data.plan import Composite, SamplePlan
from utils.data.render import TileSource

# composite rows: canvas h, w, perspective, flip lr, flip ud, the inverse matrix (9), then 4 tile slots
# of (tile, x1a, y1a, x2a, y2a, x1b, y1b); an unused slot has tile -1
SLOTS, SLOT_COLUMNS, MATRIX_AT = 4, 7, 5
SLOTS_AT = MATRIX_AT + 9
COMPOSITE_COLUMNS = SLOTS_AT + SLOTS * SLOT_COLUMNS
# sample rows: first composite, second composite (-1: none), first composite's weight, HSV on, 3 gains
SAMPLE_COLUMNS = 7
GREY = 114
CHUNK_PIXELS = 1 << 24  # output pixels warped at once: bounds the gather's temporaries


def inverse_matrix(comp: Composite) -> np.ndarray:
    """Output pixel -> canvas point, as OpenCV inverts (its affine rule for affine warps); identity
    for an unwarped canvas."""
    if comp.matrix is None:
        return np.eye(3)
    M = comp.matrix
    if comp.perspective:
        return np.linalg.inv(M)
    d = M[0, 0] * M[1, 1] - M[0, 1] * M[1, 0]
    d = 1.0 / d if d else 0.0
    a11, a22, a12, a21 = M[1, 1] * d, M[0, 0] * d, -M[0, 1] * d, -M[1, 0] * d
    return np.array([[a11, a12, -a11 * M[0, 2] - a12 * M[1, 2]],
                     [a21, a22, -a21 * M[0, 2] - a22 * M[1, 2]],
                     [0.0, 0.0, 1.0]])


def pack(plans: list[SamplePlan], tiles: TileSource, memory: BatchMemory) -> DeferredImages:
    """The batch for the device: each distinct tile's pixels once, in ``memory``, and the plans as rows."""
    ids: dict[tuple[int, tuple[int, int]], int] = {}
    order = []
    for plan in plans:
        for comp in plan.composites:
            for t in comp.tiles:
                if (t.image, tuple(t.hw)) not in ids:
                    ids[(t.image, tuple(t.hw))] = len(order)
                    order.append(t)
    table = np.zeros((len(order), 3), np.int64)
    start = 0
    for k, t in enumerate(order):
        table[k] = start, t.hw[0], t.hw[1]
        start += t.hw[0] * t.hw[1]
    buf = memory.take(start * 3)
    pixels = buf.numpy()
    for k, t in enumerate(order):
        img = np.ascontiguousarray(tiles.get(t))
        pixels[table[k, 0] * 3:(table[k, 0] + img.shape[0] * img.shape[1]) * 3] = img.reshape(-1)
    composites, samples = [], np.zeros((len(plans), SAMPLE_COLUMNS))
    for b, plan in enumerate(plans):
        first = len(composites)
        for comp in plan.composites:
            composites.append(_composite_row(comp, plan, ids))
        samples[b, :3] = first, first + 1 if len(plan.composites) > 1 else -1, plan.mix_ratio
        if plan.hsv is not None:
            samples[b, 3:7] = 1, *plan.hsv
    return DeferredImages(tiles=buf, table=torch.from_numpy(table), composites=torch.from_numpy(np.stack(composites)),
                          samples=torch.from_numpy(samples), out_hw=tuple(plans[0].out_hw))


def _composite_row(comp: Composite, plan: SamplePlan, ids: dict) -> np.ndarray:
    row = np.zeros(COMPOSITE_COLUMNS)
    row[:MATRIX_AT] = *comp.canvas_hw, comp.perspective, plan.flip_lr, plan.flip_ud
    row[MATRIX_AT:SLOTS_AT] = inverse_matrix(comp).reshape(-1)
    slots = row[SLOTS_AT:].reshape(SLOTS, SLOT_COLUMNS)
    slots[:, 0] = -1
    for k, t in enumerate(comp.tiles):
        slots[k] = ids[(t.image, tuple(t.hw))], *t.rect, *t.origin
    return row


def render_batch(d: DeferredImages, device: torch.device) -> torch.Tensor:
    """A packed batch drawn on ``device``: float32 (B, 3, H, W) RGB in
    [0, 1], channels_last strides."""
    tiles = d.tiles.to(device, non_blocking=True)
    comps = d.composites.numpy() if d.composites.device.type == "cpu" else d.composites.cpu().numpy()
    canvas = paste(tiles, d.table.tolist(), comps, device)
    h, w = (int(v) for v in d.out_hw)
    rows = d.composites.to(device, non_blocking=True)
    per_chunk = max(1, CHUNK_PIXELS // (h * w))
    warped = torch.cat([warp(canvas[i:i + per_chunk], rows[i:i + per_chunk], (h, w))
                        for i in range(0, len(comps), per_chunk)])
    samples = d.samples.to(device, non_blocking=True)
    img = mix(warped, samples)
    img = hsv(img, samples)
    return img.flip(-1).div_(255).permute(0, 3, 1, 2)


def paste(tiles: torch.Tensor, table: list, comps: np.ndarray, device: torch.device) -> torch.Tensor:
    """Every composite's canvas, uint8 (C, H + 2, W + 2, 3) for the batch's largest canvas: grey 114 with a
    one-pixel grey frame (what a warp reads outside the canvas) and the tiles pasted in (integer copies)."""
    hc, wc = int(comps[:, 0].max()), int(comps[:, 1].max())
    canvas = torch.full((len(comps), hc + 2, wc + 2, 3), GREY, dtype=torch.uint8, device=device)
    for c, row in enumerate(comps):
        for tile, x1a, y1a, x2a, y2a, x1b, y1b in row[SLOTS_AT:].reshape(SLOTS, SLOT_COLUMNS).astype(np.int64).tolist():
            if tile < 0:
                continue
            start, th, tw = table[tile]
            img = tiles[start * 3:(start + th * tw) * 3].view(th, tw, 3)
            canvas[c, 1 + y1a:1 + y2a, 1 + x1a:1 + x2a] = img[y1b:y1b + y2a - y1a, x1b:x1b + x2a - x1a]
    return canvas


def source_points(rows: torch.Tensor, out_hw: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each output pixel's canvas point (x, y), float32 (C, H, W): the inverse matrix applied to the
    pixel (the flipped pixel for a flipped sample: a flip after the warp is a flip of where it samples)."""
    h, w = out_hw
    dev = rows.device
    xs = torch.arange(w, device=dev, dtype=torch.float32).expand(len(rows), w)
    ys = torch.arange(h, device=dev, dtype=torch.float32).expand(len(rows), h)
    xs = torch.where(rows[:, 3:4] > 0, (w - 1) - xs, xs)[:, None, :]
    ys = torch.where(rows[:, 4:5] > 0, (h - 1) - ys, ys)[:, :, None]
    m = rows[:, MATRIX_AT:SLOTS_AT].float().view(-1, 9, 1, 1)
    u = m[:, 0] * xs + m[:, 1] * ys + m[:, 2]
    v = m[:, 3] * xs + m[:, 4] * ys + m[:, 5]
    persp = rows[:, 2] > 0
    if bool(persp.any()):
        z = m[:, 6] * xs + m[:, 7] * ys + m[:, 8]
        z = torch.where(persp.view(-1, 1, 1), z, torch.ones_like(z))
        z = torch.where(z != 0, 1.0 / z, torch.zeros_like(z))
        u, v = u * z, v * z
    return u, v


def warp(canvas: torch.Tensor, rows: torch.Tensor, out_hw: tuple[int, int]) -> torch.Tensor:
    """Bilinear samples of each framed canvas at its output pixels' points, rounded to 8-bit levels:
    float32 (C, H, W, 3) BGR. Points outside the canvas read the grey frame."""
    u, v = source_points(rows, out_hw)
    c, hp, wp, _ = canvas.shape
    x0f, y0f = torch.floor(u), torch.floor(v)
    fx, fy = (u - x0f)[..., None], (v - y0f)[..., None]
    x0 = x0f.clamp(-1, wp - 2).long() + 1  # framed coordinates: -1 and the far edge are grey
    y0 = y0f.clamp(-1, hp - 2).long() + 1
    x1 = (x0f + 1).clamp(-1, wp - 2).long() + 1
    y1 = (y0f + 1).clamp(-1, hp - 2).long() + 1
    flat = canvas.view(-1, 3)
    base = (torch.arange(c, device=canvas.device) * (hp * wp)).view(-1, 1, 1)

    def at(y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return flat[base + y * wp + x].float()

    a, b = at(y0, x0), at(y0, x1)
    top = a + fx * (b - a)
    a, b = at(y1, x0), at(y1, x1)
    bottom = a + fx * (b - a)
    return torch.round(top + fy * (bottom - top)).clamp_(0, 255)


def mix(warped: torch.Tensor, samples: torch.Tensor) -> torch.Tensor:
    """Each sample's image: its composite, or (mixup) the truncated blend of its two, as OpenCV's path blends."""
    first = warped[samples[:, 0].long()]
    second = samples[:, 1].long()
    mixed = second >= 0
    if not bool(mixed.any()):
        return first
    r = samples[:, 2].view(-1, 1, 1, 1)
    other = warped[second.clamp(min=0)]
    blended = torch.floor(first.double() * r + other.double() * (1 - r)).float()
    return torch.where(mixed.view(-1, 1, 1, 1), blended, first)


def hsv(img: torch.Tensor, samples: torch.Tensor) -> torch.Tensor:
    """HSV gains of the samples that have them, through OpenCV's 8-bit HSV (hue 0-179): the same table rule
    as utils.data.augment.hsv_luts, applied to each pixel's H, S and V (BGR in, BGR out, 0-255 levels)."""
    on = samples[:, 3] > 0
    if not bool(on.any()):
        return img
    h, s, v = bgr_to_hsv(img)
    g = samples[:, 4:7].view(-1, 1, 1, 3).double()
    h2 = torch.floor(torch.fmod(h.double() * g[..., 0], 180.0))
    s2 = torch.floor(torch.clamp(s.double() * g[..., 1], 0, 255))
    v2 = torch.floor(torch.clamp(v.double() * g[..., 2], 0, 255))
    out = hsv_to_bgr(h2.float(), s2.float(), v2.float())
    return torch.where(on.view(-1, 1, 1, 1), out, img)


def bgr_to_hsv(img: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """OpenCV's 8-bit BGR -> HSV (hue 0-179, halved degrees), exactly: its integer division tables with 12
    fraction bits. Each of H, S, V as int32 (..., H, W)."""
    b, g, r = img.to(torch.int32).unbind(-1)
    v = torch.maximum(torch.maximum(b, g), r)
    diff = v - torch.minimum(torch.minimum(b, g), r)
    sdiv, hdiv = _hsv_tables(img.device)
    s = (diff * sdiv[v] + 2048) >> 12
    hue = torch.where(v == r, g - b, torch.where(v == g, b - r + 2 * diff, r - g + 4 * diff))
    h = (hue * hdiv[diff] + 2048) >> 12
    return torch.where(h < 0, h + 180, h), s, v


def _hsv_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """OpenCV's sdiv_table (255 << 12) / v and hdiv_table180 (180 << 12) / (6 diff), rounded; 0 at 0."""
    i = torch.arange(256, dtype=torch.float64, device=device).clamp(min=1)
    sdiv, hdiv = torch.round(255 * 4096 / i), torch.round(180 * 4096 / (6 * i))
    sdiv[0] = hdiv[0] = 0
    return sdiv.to(torch.int32), hdiv.to(torch.int32)


def hsv_to_bgr(h: torch.Tensor, s: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """8-bit HSV (hue 0-179) -> BGR on 0-255 levels, (..., 3) float: the sector rule of OpenCV's conversion,
    truncated to levels as OpenCV 5's 8-bit path does (older OpenCV rounds: at most one level apart)."""
    s, v = s / 255.0, v / 255.0
    hh = torch.remainder(h / 30.0, 6.0)
    sector = torch.floor(hh)
    f = hh - sector
    p, q, t = v * (1 - s), v * (1 - s * f), v * (1 - s * (1 - f))
    sector = sector.long().clamp_(0, 5)
    # per sector (0-5): which of v, p, q, t each of b, g, r takes (OpenCV's sector table)
    table = torch.stack((v, p, q, t), -1)
    order = torch.tensor([[1, 3, 0], [1, 0, 2], [3, 0, 1], [0, 2, 1], [0, 1, 3], [2, 1, 0]], device=h.device)
    bgr = torch.gather(table, -1, order[sector])
    bgr = torch.where((s == 0)[..., None], v[..., None].expand_as(bgr), bgr)
    return torch.floor(bgr * 255.0 + 1e-4).clamp_(0, 255)
