"""Reading images the way the scan verified them: one decoder for the scan, the loader and the cache.

Every image is fully decoded by ``_decode_bgr`` (EXIF orientation applied, any PIL mode converted to
BGR uint8), so whatever the scan accepts trains with the same pixels and size. Sizes are (h, w).
"""
from __future__ import annotations

import io
import os
from pathlib import Path

import cv2
import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from yolotrain.utils.core.errors import UserError

IMG_SUFFIXES = (".bmp", ".jpg", ".jpeg", ".png", ".tif", ".tiff", ".webp")
IMG_FORMATS = {"bmp", "jpeg", "mpo", "png", "tiff", "webp"}  # what PIL reports for those suffixes
MIN_IMAGE_PX = 10


def _orientation(im: Image.Image) -> int | None:
    """EXIF orientation tag (1-8) or None; broken EXIF blocks are common and treated as absent."""
    try:
        value = im.getexif().get(0x0112)
    except Exception:  # PIL raises many types for malformed EXIF
        return None
    return int(value) if isinstance(value, int) else None


def _to_uint8(a: np.ndarray, mode: str) -> np.ndarray:
    """16-bit and 32-bit integer or float pixels scaled to 0-255 (as cv2 does for 16-bit files)."""
    if a.dtype == np.uint8:
        return a
    if mode == "F":  # float images: [0, 1] if they fit there, else already 0-255
        a = a.astype(np.float64)
        finite = a[np.isfinite(a)]
        scale = 255.0 if finite.size and finite.max() <= 1.0 else 1.0
        return np.clip(np.nan_to_num(a * scale), 0, 255).round().astype(np.uint8)
    a = np.clip(a.astype(np.int64), 0, 65535)  # 'I;16*' and 'I' (16-bit PNG/TIFF) are 0-65535
    return ((a * 255 + 32767) // 65535).astype(np.uint8)


def _pil_to_bgr(im: Image.Image) -> np.ndarray:
    """Decoded PIL image -> upright (EXIF applied) BGR uint8 (h, w, 3), whatever the mode.

    Alpha is composited on grey 114, the letterbox padding colour, so transparent areas look
    like padding rather than whatever RGB happens to be stored under them.
    """
    im = ImageOps.exif_transpose(im)
    mode = im.mode
    if mode == "1":
        im, mode = im.convert("L"), "L"
    if mode in ("P", "L", "RGB") and "transparency" in im.info:
        im, mode = im.convert("RGBA"), "RGBA"
    if mode in ("LA", "La", "PA", "RGBA", "RGBa"):
        rgba = np.asarray(im.convert("RGBA"), dtype=np.float32)
        alpha = rgba[..., 3:] / 255.0
        rgb = (rgba[..., :3] * alpha + 114.0 * (1.0 - alpha)).round().astype(np.uint8)
    elif mode.startswith("I") or mode in ("F", "L"):
        grey = _to_uint8(np.asarray(im), mode)
        rgb = np.repeat(grey[..., None], 3, axis=2)
    else:  # RGB, CMYK (PIL undoes Adobe inversion), YCbCr, LAB, HSV, P without transparency
        rgb = np.asarray(im.convert("RGB"))
    return np.ascontiguousarray(rgb[..., ::-1])


def _decode_bgr(data: bytes) -> tuple[np.ndarray, str]:
    """Fully decode image bytes to upright BGR uint8 and a warning; ValueError with the reason.

    The scan and the loader both call this, so an image the scan accepts is read the same way
    (same pixels, same EXIF handling, same size) when training. JPEGs that lack their end marker
    are decoded with one appended in memory (the file is never rewritten). Plain RGB/grey JPEGs
    without an EXIF rotation take cv2's faster decoder; everything else goes through PIL.
    """
    if not data:
        raise ValueError("empty file (0 bytes)")
    warning = ""
    if data[:2] == b"\xff\xd8" and data.rstrip(b"\x00")[-2:] != b"\xff\xd9":
        data, warning = data + b"\xff\xd9", "truncated JPEG (no end marker), still readable"
    try:
        with Image.open(io.BytesIO(data)) as im:
            fmt = (im.format or "").lower()
            if fmt not in IMG_FORMATS:
                raise ValueError(f"unsupported image format '{fmt}'")
            w, h = im.size
            if min(w, h) < MIN_IMAGE_PX:  # before decoding: cheap, and the size is what matters
                raise ValueError(f"image size {w}x{h} below {MIN_IMAGE_PX} pixels")
            orientation = _orientation(im)
            if fmt in ("jpeg", "mpo") and im.mode in ("RGB", "L") and orientation in (None, 1):
                img = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
                if img is not None and img.shape[:2] == (h, w):
                    return img, warning
            im.load()  # the full decode: truncated or broken data raises here
            return _pil_to_bgr(im), warning
    except ValueError:
        raise
    except UnidentifiedImageError:
        raise ValueError("unreadable image (not a recognised image format)") from None
    except Image.DecompressionBombError as e:
        raise ValueError(f"image too large ({e})") from None
    except Exception as e:  # PIL raises many types for broken files
        what = "truncated JPEG, not decodable" if warning else "unreadable image"
        raise ValueError(f"{what} ({type(e).__name__}: {e})") from None


def read_image_bgr(path: str | Path) -> np.ndarray:
    """Image as upright BGR uint8 (h, w, 3): EXIF orientation applied, any mode converted.

    16-bit -> 8-bit (scaled), greyscale -> 3 channels, palette/alpha -> RGB composited on grey
    114, CMYK -> BGR; a JPEG missing its end marker is read as far as it goes. Labels refer to
    this upright image, and the scan records its size, so the loader must read images with this
    (plain cv2.imread returns None for truncated JPEGs and drops alpha without compositing).
    Raises UserError naming the file when it cannot be read.
    """
    try:
        data = Path(path).read_bytes()
        return _decode_bgr(data)[0]
    except OSError as e:
        raise UserError(f"{path}: cannot read image ({e.strerror or e})") from None
    except ValueError as e:
        raise UserError(f"{path}: {e}") from None


def decode_image_bgr(data: bytes, name: str) -> np.ndarray:
    """``read_image_bgr`` for bytes already read (a shard member): the same decoder, errors naming ``name``."""
    try:
        return _decode_bgr(data)[0]
    except ValueError as e:
        raise UserError(f"{name}: {e}") from None


def verify_image(path: str) -> tuple[tuple[int, int], str]:
    """Upright size (h, w) after a full decode and a warning ('' if none); ValueError when unusable.

    The scan calls this so that the size it records is the one the loader will see.
    """
    if not os.path.isfile(path):
        raise ValueError("image not found")
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ValueError(f"cannot read file ({e.strerror or e})") from None
    img, warning = _decode_bgr(data)
    h, w = img.shape[:2]
    if min(w, h) < MIN_IMAGE_PX:  # EXIF rotation cannot change this, but a decoder might disagree
        raise ValueError(f"image size {w}x{h} below {MIN_IMAGE_PX} pixels")
    return (h, w), warning
