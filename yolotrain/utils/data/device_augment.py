"""Augmentation on the training device: the loader workers only read each image a batch needs, and the
training process draws the whole batch with torch (mosaic canvas, warp, mixup, HSV, flips), from the same
sample plans as the OpenCV path (utils/data/plan.py), so the labels are identical and the draws still come
from each sample's (seed, epoch, index).

Why: on a GPU node the warp and colour passes of 4-16 CPU cores per GPU set the training speed; on the
GPU they cost a few milliseconds per batch. The same code runs on CPU tensors (the tests).

The maths follows OpenCV's: a warp samples the canvas bilinearly in float32 with grey 114 outside it
(OpenCV 5's warpAffine/warpPerspective), and HSV goes through tables of OpenCV's own 8-bit colour
conversions, built once per device by cv2 (``colour_tables``), with the loader's per-sample lookups
between them. Images agree with the OpenCV path but for a few pixels in 100,000 that the warp rounds
the other way (older OpenCV interpolates in fixed point and differs by a level more often).

``pack`` runs in a worker: the distinct tiles back to back in the batch's memory, and every plan as rows
of numbers. ``render_batch`` runs in the training process and returns float images in [0, 1].
"""
from __future__ import annotations

import numpy as np
import torch

from yolotrain.utils.core.transfer import to_device
from yolotrain.utils.data.augment import hsv_luts
from yolotrain.utils.data.batch import BatchMemory, DeferredImages
from yolotrain.utils.data.plan import Composite, SamplePlan
from yolotrain.utils.data.render import TileSource

# composite rows: canvas h, w, perspective, flip lr, flip ud, the inverse matrix (9), then 4 tile slots
# of (tile, x1a, y1a, x2a, y2a, x1b, y1b); an unused slot has tile -1
SLOTS, SLOT_COLUMNS, MATRIX_AT = 4, 7, 5
SLOTS_AT = MATRIX_AT + 9
COMPOSITE_COLUMNS = SLOTS_AT + SLOTS * SLOT_COLUMNS
# sample rows: first composite, second composite (-1: none), first composite's weight, HSV on
SAMPLE_COLUMNS = 4
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
    luts = np.zeros((len(plans), 3, 256), np.uint8)
    for b, plan in enumerate(plans):
        first = len(composites)
        for comp in plan.composites:
            composites.append(_composite_row(comp, plan, ids))
        samples[b, :3] = first, first + 1 if len(plan.composites) > 1 else -1, plan.mix_ratio
        if plan.hsv is not None:  # the loader's own tables (yolotrain.utils.data.augment.hsv_luts)
            samples[b, 3] = 1
            luts[b] = hsv_luts(plan.hsv)
    return DeferredImages(tiles=buf, table=torch.from_numpy(table), composites=torch.from_numpy(np.stack(composites)),
                          samples=torch.from_numpy(samples), luts=torch.from_numpy(luts), out_hw=tuple(plans[0].out_hw))


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
    """A packed batch drawn on ``device``: float32 (B, 3, H, W) RGB in [0, 1], channels_last strides.

    Every decision (which canvases are perspective, which samples blend, which have HSV) is read from the
    host's copy of the rows, so drawing never waits for the device: on CUDA it is queued on a side stream
    (utils/data/device_feed.py) while the model trains on the previous batch."""
    tiles = d.tiles.to(device, non_blocking=True)
    comps, plan = d.composites.numpy(), d.samples.numpy()  # host rows (pinned or not)
    canvas = paste(tiles, d.table.tolist(), comps, device)
    h, w = (int(v) for v in d.out_hw)
    rows = d.composites.to(device, non_blocking=True)
    perspective = bool(comps[:, 2].any())
    per_chunk = max(1, CHUNK_PIXELS // (h * w))
    warped = torch.cat([warp(canvas[i:i + per_chunk], rows[i:i + per_chunk], (h, w), perspective)
                        for i in range(0, len(comps), per_chunk)])
    samples = d.samples.to(device, non_blocking=True)
    mixed = mix(warped, samples, plan)
    if not plan[:, 3].any():  # no sample has HSV gains
        return mixed.to(torch.uint8).flip(-1).float().div_(255).permute(0, 3, 1, 2)
    rgb = colour(mixed, samples, d.luts.to(device, non_blocking=True))
    return rgb.float().div_(255).permute(0, 3, 1, 2)


FRAME = 2  # grey pixels around every canvas: a point's 2x2 neighbourhood is always inside the framed canvas


def paste(tiles: torch.Tensor, table: list, comps: np.ndarray, device: torch.device) -> torch.Tensor:
    """Every composite's canvas, uint8 (C, H + 4, W + 4, 3) for the batch's largest canvas: grey 114 with a
    two-pixel grey frame (what a warp reads outside the canvas) and the tiles pasted in (integer copies).

    Each paste is a strided view of the canvas and of its tile, and all of them one foreach copy: a batch
    pastes hundreds of tiles, and a Python slice-and-copy per tile costs the host more than the device."""
    hc, wc = int(comps[:, 0].max()), int(comps[:, 1].max())
    hp, wp = hc + 2 * FRAME, wc + 2 * FRAME
    canvas = torch.full((len(comps), hp, wp, 3), GREY, dtype=torch.uint8, device=device)
    dst, src, base = [], [], tiles.storage_offset()
    for c, row in enumerate(comps):
        for tile, x1a, y1a, x2a, y2a, x1b, y1b in row[SLOTS_AT:].reshape(SLOTS, SLOT_COLUMNS).astype(np.int64).tolist():
            h, w = y2a - y1a, x2a - x1a
            if tile < 0 or h <= 0 or w <= 0:
                continue
            start, _, tw = table[tile]
            dst.append(canvas.as_strided((h, w, 3), (wp * 3, 3, 1), ((c * hp + FRAME + y1a) * wp + FRAME + x1a) * 3))
            src.append(tiles.as_strided((h, w, 3), (tw * 3, 3, 1), base + (start + y1b * tw + x1b) * 3))
    if dst:
        torch._foreach_copy_(dst, src)
    return canvas


def source_points(rows: torch.Tensor, out_hw: tuple[int, int],
                  perspective: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each output pixel's canvas point (x, y), float32 (C, H, W): the inverse matrix applied to the
    pixel (the flipped pixel for a flipped sample: a flip after the warp is a flip of where it samples).
    ``perspective``: some row is a perspective warp (the host knows; the device is not asked)."""
    h, w = out_hw
    dev = rows.device
    xs = torch.arange(w, device=dev, dtype=torch.float32).expand(len(rows), w)
    ys = torch.arange(h, device=dev, dtype=torch.float32).expand(len(rows), h)
    xs = torch.where(rows[:, 3:4] > 0, (w - 1) - xs, xs)[:, None, :]
    ys = torch.where(rows[:, 4:5] > 0, (h - 1) - ys, ys)[:, :, None]
    m = rows[:, MATRIX_AT:SLOTS_AT].float().view(-1, 9, 1, 1)
    u = m[:, 0] * xs + m[:, 1] * ys + m[:, 2]
    v = m[:, 3] * xs + m[:, 4] * ys + m[:, 5]
    if perspective:
        persp = rows[:, 2] > 0
        z = m[:, 6] * xs + m[:, 7] * ys + m[:, 8]
        z = torch.where(persp.view(-1, 1, 1), z, torch.ones_like(z))
        z = torch.where(z != 0, 1.0 / z, torch.zeros_like(z))
        u, v = u * z, v * z
    return u, v


def warp(canvas: torch.Tensor, rows: torch.Tensor, out_hw: tuple[int, int], perspective: bool) -> torch.Tensor:
    """Bilinear samples of each framed canvas at its output pixels' points, rounded to 8-bit levels:
    float32 (C, H, W, 3) BGR. Points outside the canvas read the grey frame: the top-left neighbour is
    clamped into the frame's outer ring, so the other three are at +1, +width and +width+1. The pixel
    indices are int32 where they fit (half the memory traffic of int64; index_select takes either)."""
    u, v = source_points(rows, out_hw, perspective)
    c, hp, wp, _ = canvas.shape
    index = torch.int32 if c * hp * wp < 2 ** 31 else torch.int64
    x0f, y0f = torch.floor(u), torch.floor(v)
    fx, fy = (u - x0f)[..., None], (v - y0f)[..., None]
    x0 = x0f.clamp_(-FRAME, wp - 2 * FRAME).to(index) + FRAME  # -2 .. canvas width, framed
    y0 = y0f.clamp_(-FRAME, hp - 2 * FRAME).to(index) + FRAME
    base = (torch.arange(c, device=canvas.device, dtype=index).view(-1, 1, 1) * (hp * wp) + y0 * wp + x0).view(-1)
    flat = canvas.view(-1, 3)

    def at(offset: int) -> torch.Tensor:
        return flat.index_select(0, base + offset if offset else base).view(*u.shape, 3).float()

    a, b = at(0), at(1)
    top = torch.lerp(a, b, fx)
    a, b = at(wp), at(wp + 1)
    return torch.round(torch.lerp(top, torch.lerp(a, b, fx), fy)).clamp_(0, 255)


def mix(warped: torch.Tensor, samples: torch.Tensor, plan: np.ndarray) -> torch.Tensor:
    """Each sample's image: its composite, or (mixup) the truncated blend of its two, as OpenCV's path blends.
    ``plan``: the host's copy of ``samples``, for the decisions; the blended rows' indices are copied to the
    device without waiting (a Python list as an index would make the host wait for the device)."""
    first, second = plan[:, 0].astype(np.int64), plan[:, 1].astype(np.int64)
    mixed = second >= 0
    if not mixed.any():
        return warped if np.array_equal(first, np.arange(len(warped))) else warped[samples[:, 0].long()]
    dev = warped.device
    rows, partners = (to_device(torch.from_numpy(a), dev) for a in (np.flatnonzero(mixed), second[mixed]))
    out = warped.index_select(0, samples[:, 0].long())
    r = samples.index_select(0, rows)[:, 2].view(-1, 1, 1, 1)
    blended = torch.floor(out.index_select(0, rows).double() * r + warped.index_select(0, partners).double() * (1 - r))
    return out.index_copy_(0, rows, blended.float())


def colour(img: torch.Tensor, samples: torch.Tensor, luts: torch.Tensor) -> torch.Tensor:
    """Each sample's HSV gains (where it has them) and the BGR -> RGB order: uint8 (B, H, W, 3) RGB.

    OpenCV's own 8-bit conversions, as tables over every colour (``colour_tables``), so the device repeats
    the loader's cvtColor exactly; between them each sample's hue, saturation and value lookups ``luts``
    (B, 3, 256), packed by the workers with yolotrain.utils.data.augment.hsv_luts."""
    bgr = img.to(torch.uint8)
    on = samples[:, 3] > 0
    to_hsv, to_rgb = colour_tables(img.device)
    wide = bgr.to(torch.int32)  # every index below is under 2^24: int32 for the lookups
    idx = (wide[..., 0] << 16) | (wide[..., 1] << 8) | wide[..., 2]
    h, s, v = to_hsv.index_select(0, idx.view(-1)).view(*idx.shape, 3).to(torch.int32).unbind(-1)
    luts = luts.reshape(-1)
    k = torch.arange(len(img), device=img.device, dtype=torch.int32).view(-1, 1, 1) * 768

    def lookup(offset: int, level: torch.Tensor) -> torch.Tensor:
        return luts.index_select(0, (k + (offset + level)).view(-1)).view(level.shape).to(torch.int32)

    h, s, v = lookup(0, h), lookup(256, s), lookup(512, v)
    rgb = to_rgb.index_select(0, ((h * 256 + s) * 256 + v).view(-1)).view(*idx.shape, 3)
    return torch.where(on.view(-1, 1, 1, 1), rgb, bgr.flip(-1))


_TABLES: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}


def colour_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """OpenCV's 8-bit BGR -> HSV for every one of the 2^24 colours (index b << 16 | g << 8 | r), and HSV ->
    RGB for every 8-bit HSV (index (h * 256 + s) * 256 + v, h < 180), computed once per device by cv2
    itself: 48 MiB and 34 MiB of uint8."""
    key = str(device)
    if key not in _TABLES:
        import cv2

        every = np.arange(1 << 24, dtype=np.uint32)
        bgr = np.stack(((every >> 16) & 255, (every >> 8) & 255, every & 255), -1).astype(np.uint8)
        to_hsv = cv2.cvtColor(bgr.reshape(4096, 4096, 3), cv2.COLOR_BGR2HSV).reshape(-1, 3)
        every = np.arange(180 * 256 * 256, dtype=np.uint32)
        hsv = np.stack((every >> 16, (every >> 8) & 255, every & 255), -1).astype(np.uint8)
        to_rgb = cv2.cvtColor(hsv.reshape(2880, 4096, 3), cv2.COLOR_HSV2RGB).reshape(-1, 3)
        _TABLES[key] = torch.from_numpy(to_hsv).to(device), torch.from_numpy(to_rgb).to(device)
    return _TABLES[key]
