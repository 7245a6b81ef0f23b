"""Finding unreadable images before training: every file is opened and decoded once, in a thread pool, no cache."""

from __future__ import annotations

import os
import warnings
from concurrent.futures import ThreadPoolExecutor

from PIL import Image

# JPEGs decode at 1/8 scale (DCT scaling): every entropy-coded byte is still read, so truncation is caught, at a
# fraction of the full decode cost. Other formats decode in full.
_DRAFT_SIZE = (64, 64)


def image_problem(path: str) -> str | None:
    """Why `path` cannot be used as a training image, or None when it decodes."""
    try:
        if os.path.getsize(path) == 0:
            return "empty file (0 bytes)"
        if not os.access(path, os.R_OK):
            return "no read permission"
        with warnings.catch_warnings():
            # Past MAX_IMAGE_PIXELS PIL only warns; past 2x it raises. Both are refused here, one rule for all.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as img:
                img.draft("RGB", _DRAFT_SIZE)
                img.load()
    except Image.DecompressionBombError as err:
        return f"too large, refused by the decompression-bomb guard ({err})"
    except Image.DecompressionBombWarning as err:
        return f"too large, refused by the decompression-bomb guard ({err})"
    except Image.UnidentifiedImageError:
        return "not an image (PIL cannot identify the format)"
    except PermissionError:
        return "no read permission"
    except (OSError, SyntaxError, ValueError) as err:  # PIL reports truncation and bad headers as OSError/SyntaxError
        return f"cannot be decoded ({err})"
    return None


def find_bad_images(paths: list[str], workers: int | None = None, progress: bool = False) -> list[tuple[str, str]]:
    """(path, reason) for every file of `paths` that cannot be decoded, in the order of `paths`.

    Decoding releases the GIL, so threads scale with cores; a progress bar is shown for large lists.
    """
    workers = workers or min(32, (os.cpu_count() or 1) + 4)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        results = pool.map(image_problem, paths, chunksize=64)
        if progress:
            from rich.progress import track

            results = track(results, total=len(paths), description="checking images", transient=True)
        return [(p, why) for p, why in zip(paths, results, strict=True) if why is not None]


def bad_images_message(bad: list[tuple[str, str]], total: int, shown: int = 20) -> str:
    lines = [f"{len(bad)} of {total} images cannot be used:"]
    lines += [f"  {path}: {why}" for path, why in bad[:shown]]
    if len(bad) > shown:
        lines.append(f"  ... and {len(bad) - shown} more")
    return "\n".join(lines)
