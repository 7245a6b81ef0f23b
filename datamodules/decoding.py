"""Decoding image files to 8-bit RGB tensors: from a path, from a file's bytes, batched on the device, and for a
random crop."""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import simplejpeg
import torch
from PIL import Image
from torchvision.io import ImageReadMode, decode_jpeg, read_file
from torchvision.transforms.v2.functional import pil_to_tensor

# torchvision 0.29 deprecates its image decoders in favour of TorchCodec and warns on every call (every image, in
# every worker). The JPEG decoder still works and is the fastest on hand; move to TorchCodec when it is removed.
warnings.filterwarnings("ignore", message="The image decoding and encoding capabilities of TorchVision",
                        category=DeprecationWarning)


def read_image(path: str) -> torch.Tensor:
    """Decode a file to a uint8 (3, H, W) RGB tensor: the pixels of `load_rgb`, reached faster for JPEGs.

    JPEGs go straight from libjpeg-turbo into a CHW tensor (torchvision.io), skipping PIL's image object and the
    HWC -> CHW copy; the pixels are identical to PIL's (tests/test_pipeline_equivalence.py). Anything else, or a
    JPEG that torchvision cannot read, goes through `load_rgb`.
    """
    if path.lower().endswith((".jpg", ".jpeg")):
        try:
            return decode_jpeg(read_file(path), mode=ImageReadMode.RGB)
        except RuntimeError:
            pass  # e.g. a truncated file or a PNG named .jpg: PIL decodes it or raises an error naming it
    return pil_to_tensor(load_rgb(path))


def load_rgb(path: str | io.BytesIO) -> Image.Image:
    """Decode any supported file to an 8-bit RGB PIL image.

    Grayscale, palette, RGBA, CMYK and 16-bit files are all converted; 16-bit data is rescaled,
    not clipped (PIL's own convert("RGB") would saturate it to white).
    """
    with Image.open(path) as img:
        img.load()
        if img.mode in ("I", "I;16", "I;16B", "I;16L", "F"):
            arr = np.asarray(img, dtype=np.float64)
            peak = 255.0 if arr.max(initial=0) <= 255 else 65535.0
            arr = np.clip(arr * (255.0 / peak), 0, 255).round().astype(np.uint8)
            return Image.fromarray(arr, mode="L").convert("RGB")
        if img.mode == "P" and "transparency" in img.info:
            img = img.convert("RGBA")  # avoids PIL's palette-transparency warning
        return img.convert("RGB")


def read_encoded(path: str) -> torch.Tensor:
    """A JPEG's bytes as a 1-D uint8 tensor, left for `decode_images` on the device; any other file decoded now.

    The loader workers of ``data.augment_on_device`` only read files: decoding a JPEG is most of the CPU cost of
    the input pipeline, and nvJPEG does it on the GPU. Other formats are decoded here (nvJPEG reads only JPEG).
    """
    if path.lower().endswith((".jpg", ".jpeg")):
        # Not torchvision's read_file: its tensor maps the file, and a loader worker cannot send a mapped tensor to the
        # main process (OSError: bad file descriptor, then the loader waits forever).
        return torch.frombuffer(bytearray(Path(path).read_bytes()), dtype=torch.uint8)
    return read_image(path)


_JPEG = b"\xff\xd8\xff"


def decode_bytes(data, *, encoded: bool = False) -> torch.Tensor:
    """An image file's bytes -> uint8 (3, H, W) RGB, the pixels `read_image` gives for the file. With `encoded`, a
    JPEG stays its bytes (1-D uint8, as `read_encoded` leaves it) for the fast-decode crop or the device."""
    buffer = bytearray(data)  # writable, as torch.frombuffer wants; LitData and Arrow hand out views
    if buffer[:3] == _JPEG:
        tensor = torch.frombuffer(buffer, dtype=torch.uint8)
        if encoded:
            return tensor
        try:
            return decode_jpeg(tensor, mode=ImageReadMode.RGB)
        except RuntimeError:
            pass  # a JPEG that libjpeg-turbo refuses: PIL decodes it or raises an error naming it
    return pil_to_tensor(load_rgb(io.BytesIO(buffer)))


def decode_images(items: list[torch.Tensor], device: torch.device | str) -> list[torch.Tensor]:
    """`read_encoded` results -> uint8 (3, H, W) RGB images on `device`; the JPEGs in one batched decode call.

    On CUDA the batch goes through nvJPEG; elsewhere through libjpeg-turbo, with the pixels of `read_image`. A file
    that the JPEG decoder refuses (a PNG named .jpg, say) is decoded by PIL, as `read_image` does.
    """
    device = torch.device(device)
    out = [t.to(device, non_blocking=True) if t.ndim == 3 else None for t in items]
    jpegs = [i for i, t in enumerate(items) if t.ndim == 1]
    if jpegs:
        encoded = [items[i] for i in jpegs]
        try:
            decoded = decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device)
        except RuntimeError:
            decoded = [_decode_one(t).to(device) for t in encoded]
        for i, image in zip(jpegs, decoded, strict=True):
            out[i] = image
    return out


def _decode_one(encoded: torch.Tensor) -> torch.Tensor:
    try:
        return decode_jpeg(encoded, mode=ImageReadMode.RGB)
    except RuntimeError:
        return pil_to_tensor(load_rgb(io.BytesIO(encoded.numpy().tobytes())))


def decode_for_crop(encoded: torch.Tensor, crop: Callable[[int, int], dict], size: tuple[int, int], *,
                    fast: bool) -> tuple[torch.Tensor, dict]:
    """Decode a JPEG's bytes for a crop that is resized to `size`: (uint8 (3, h, w) image, crop in its pixels).

    `crop(height, width)` draws the crop (top, left, height, width) for the full-size image, whose size is read from
    the header first. Exact (`fast` false): the pixels of `read_image`. Fast: libjpeg-turbo's fast integer IDCT and
    chroma upsampling, and the image decoded at 1/2, 1/4 or 1/8 scale in the DCT domain when the crop stays at
    least `size` there (less work than decoding it whole and shrinking it afterwards); the crop is scaled with it.
    """
    if fast:
        try:
            height, width = simplejpeg.decode_jpeg_header(encoded.numpy())[:2]
        except ValueError:  # not a JPEG after all (a PNG named .jpg): decoded exactly below
            pass
        else:
            params = crop(height, width)
            factor = 1
            while (factor < 8 and params["height"] >= 2 * factor * size[0]
                   and params["width"] >= 2 * factor * size[1]):
                factor *= 2
            try:
                array = simplejpeg.decode_jpeg(encoded.numpy(), fastdct=True, fastupsample=True,
                                               min_height=-(-height // factor), min_width=-(-width // factor))
            except ValueError:  # a JPEG that libjpeg-turbo's fast path refuses: decoded exactly below
                pass
            else:
                image = torch.from_numpy(array).permute(2, 0, 1)  # (3, h, w), HWC in memory like decode_jpeg's
                sy, sx = image.shape[1] / height, image.shape[2] / width
                top, left = int(params["top"] * sy), int(params["left"] * sx)
                return image, dict(top=top, left=left, height=min(round(params["height"] * sy), image.shape[1] - top),
                                   width=min(round(params["width"] * sx), image.shape[2] - left))
    image = _decode_one(encoded)
    return image, crop(image.shape[1], image.shape[2])
