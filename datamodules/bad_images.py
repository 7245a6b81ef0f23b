"""Finding unreadable images before training: each file is decoded once, in a thread pool, and the verdicts are kept
in a cache file keyed by (path, size, mtime), so that a later start decodes only the files that changed."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image

log = logging.getLogger(__name__)

# JPEGs decode at 1/8 scale (DCT scaling): every entropy-coded byte is still read, so truncation is caught, at a
# fraction of the full decode cost. Other formats decode in full.
_DRAFT_SIZE = (64, 64)
_PROGRESS_FROM = 5000  # files to decode before a progress bar is worth showing
CACHE_VERSION = 1
# A file changed twice within its timestamp's resolution (up to 2 s on FAT and some NFS servers) can keep its size
# and mtime: verdicts of files that recent are not cached (git's "racy clean" rule), they are checked again next time.
_RACY_NS = 2_000_000_000
# On a local disk a stat is quick and threads only contend for the GIL; on a network file system each stat waits on
# the server, and threads overlap the waits: chunks go to the pool when the first chunk's stats took more than
# _SLOW_STAT_S each on average. The stat cost on a local disk is measured in benchmarks/scan_cache.py
# (docs/PERFORMANCE.md, "Start scan"); threaded stats and network file systems are not measured there.
_STAT_CHUNK = 4096
_SLOW_STAT_S = 50e-6
_GOOD, _UNKNOWN = -1, -2  # verdict codes; 0, 1, ... index the cache's list of reasons


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


def find_bad_images(paths: list[str], workers: int | None = None, progress: bool = False,
                    cache: ScanCache | None = None) -> list[tuple[str, str]]:
    """(path, reason) for every file of `paths` that cannot be decoded, in the order of `paths`.

    Decoding releases the GIL, so threads scale with cores; with `progress`, a bar is shown past 5,000 files to
    decode. With `cache`, a file whose size and mtime match its entry is not decoded again, and the cache is updated.
    """
    workers = workers or min(32, (os.cpu_count() or 1) + 4)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        def decode(todo: list[str]) -> Iterator[str | None]:  # in order, each as soon as it and those before are
            results = pool.map(image_problem, todo)
            if progress and len(todo) >= _PROGRESS_FROM:
                from rich.progress import track

                results = track(results, total=len(todo), description="checking images", transient=True)
            return results

        verdicts = list(decode(paths)) if cache is None else cache.verdicts(paths, pool, decode)
    return [(p, why) for p, why in zip(paths, verdicts, strict=True) if why is not None]


def bad_images_message(bad: list[tuple[str, str]], total: int, shown: int = 20) -> str:
    lines = [f"{len(bad)} of {total} images cannot be used:"]
    lines += [f"  {path}: {why}" for path, why in bad[:shown]]
    if len(bad) > shown:
        lines.append(f"  ... and {len(bad) - shown} more")
    return "\n".join(lines)


def user_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "imgcls" / "scan"


class ScanCache:
    """Verdicts of earlier scans of the images below `folder`, keyed by path (relative to `folder`), size and mtime.

    One file per set of files scanned together (`name`: train-val, test, predict), holding that set only, so that
    deleted files leave it. It lives in `folder` (`.imgcls-scan-cache-NAME.npz`, which travels with the data) where
    that can be written, else in the user's cache folder; of the two, the newer is read. Numpy arrays loaded with
    allow_pickle=False: a planted file can mislead the scan (a bad image then fails at its first read, naming the
    file) but cannot run code. A file that cannot be read is ignored, and every image decoded again.
    """

    def __init__(self, folder: str | os.PathLike, name: str) -> None:
        folder = os.fspath(folder)
        self.prefix = os.path.join(folder, "")  # as the listing spells it: paths below it are stored relative
        digest = hashlib.sha1(os.fsencode(os.path.abspath(folder))).hexdigest()[:16]
        self.files = (Path(folder) / f".imgcls-scan-cache-{name}.npz", user_cache_dir() / f"{digest}-{name}.npz")
        self.read: Path | None = None  # the file the last check used, and the one it wrote (None: none)
        self.written: Path | None = None
        self.known = self.checked = 0  # images of the last check: verdict from the cache, decoded now

    def summary(self) -> str:
        read = f"cache {self.read}" if self.read else "no cache yet"
        wrote = f"; wrote {self.written}" if self.written and self.written != self.read else ""
        return (f"data: start scan: {self.known:,} images known unchanged ({read}), {self.checked:,} decoded{wrote} "
                "(data.scan_cache)")

    def verdicts(self, paths: list[str], pool: ThreadPoolExecutor,
                 decode: Callable[[list[str]], Iterable[str | None]]) -> list[str | None]:
        """The verdict of each of `paths` (None: it decodes, else why not): from the cache where its size and mtime
        are unchanged, from `decode` for the rest; then the cache is written if it changed. A scan interrupted
        (Ctrl-C) writes the verdicts it has, so that the next start decodes only the rest."""
        start = time.time_ns()
        n = len(self.prefix)
        keys = [p[n:] if p.startswith(self.prefix) else p for p in paths]
        stat = _stat_all(paths, pool)  # (N, 2): size, mtime_ns
        codes = np.full(len(paths), _UNKNOWN, np.int64)
        cached = self._load()
        reasons: list[str] = []
        if cached is not None:
            old_keys, old_stat, old_codes, reasons = cached
            row = {k: i for i, k in enumerate(old_keys)}
            rows = np.fromiter((row.get(k, -1) for k in keys), np.int64, len(keys))
            hit = (rows >= 0) & (stat[:, 0] >= 0)
            hit[hit] = (old_stat[rows[hit]] == stat[hit]).all(axis=1)
            codes[hit] = old_codes[rows[hit]]
        todo = np.flatnonzero(codes == _UNKNOWN)
        code_of = {why: c for c, why in enumerate(reasons)}
        keep = (stat[:, 0] >= 0) & (stat[:, 1] < start - _RACY_NS)  # not racy, and stat could read it
        try:
            for i, why in zip(todo, decode([paths[i] for i in todo]), strict=True):
                codes[i] = _GOOD if why is None else code_of.setdefault(why, len(code_of))
        except BaseException:  # Ctrl-C in a long cold scan: the verdicts reached so far are kept for the next start
            keep &= codes != _UNKNOWN
            if keep.any():
                self._save([k for k, kept in zip(keys, keep, strict=True) if kept], stat[keep], codes[keep],
                           list(code_of))
            raise
        reasons = list(code_of)
        self.known, self.checked, self.written = len(paths) - len(todo), len(todo), None
        if keep.any() and (len(todo) or cached is None or len(cached[0]) != keep.sum()):
            self.written = self._save([k for k, kept in zip(keys, keep, strict=True) if kept], stat[keep],
                                      codes[keep], reasons)
        return [None if c == _GOOD else reasons[c] for c in codes.tolist()]

    def _load(self) -> tuple[list[str], np.ndarray, np.ndarray, list[str]] | None:
        """(keys, (size, mtime_ns) per key, verdict codes, reasons) of the newer cache file, or None."""
        self.read = None
        found = []
        for file in self.files:
            with contextlib.suppress(OSError):
                found.append((file.stat().st_mtime_ns, file))
        if not found:
            return None
        file = max(found)[1]
        try:
            with np.load(file, allow_pickle=False) as z:
                if int(z["version"]) != CACHE_VERSION:
                    raise ValueError(f"version {int(z['version'])}, this code reads {CACHE_VERSION}")
                stat = np.stack([z["size"], z["mtime_ns"]], axis=1).astype(np.int64)
                codes = z["verdict"].astype(np.int64)
                reasons = [str(r) for r in z["reasons"]]
                keys = _decode_keys(z["keys"].tobytes()) if len(stat) else []
            if not len(keys) == len(stat) == len(codes) or not np.all((codes >= _GOOD) & (codes < len(reasons))):
                raise ValueError("its arrays do not agree")
        except Exception as err:  # truncated, corrupt or foreign: ignored, never trusted in part
            log.warning(f"data.scan_cache: ignoring {file} ({type(err).__name__}: {err}); every image is decoded")
            return None
        self.read = file
        return keys, stat, codes, reasons

    def _save(self, keys: list[str], stat: np.ndarray, codes: np.ndarray, reasons: list[str]) -> Path | None:
        """Write the cache atomically (a temporary file, then a rename) to the first location that takes it."""
        arrays = dict(version=np.array(CACHE_VERSION), keys=np.frombuffer(_encode_keys(keys), np.uint8),
                      size=stat[:, 0], mtime_ns=stat[:, 1], verdict=codes.astype(np.int32),
                      reasons=np.array(reasons, dtype=str))
        errors = []
        for file in self.files:
            try:
                file.parent.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=file.parent, prefix=f"{file.name}.tmp")
                try:
                    with os.fdopen(fd, "wb") as f:
                        np.savez(f, allow_pickle=False, **arrays)
                        f.flush()
                        os.fsync(f.fileno())
                    os.replace(tmp, file)
                except BaseException:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp)
                    raise
            except OSError as err:  # a read-only data folder: the next location
                errors.append(f"{file.parent}: {err.strerror or err}")
                continue
            _remove_stale_temporaries(file)
            return file
        log.warning(f"data.scan_cache: cannot write the scan cache ({'; '.join(errors)}); the next start decodes "
                    "every image again")
        return None


def _stat_all(paths: list[str], pool: ThreadPoolExecutor) -> np.ndarray:
    start = time.perf_counter()
    first = _stat_chunk(paths[:_STAT_CHUNK])
    rest = [paths[i:i + _STAT_CHUNK] for i in range(_STAT_CHUNK, len(paths), _STAT_CHUNK)]
    slow = time.perf_counter() - start > _SLOW_STAT_S * len(first)
    return np.concatenate([first, *(pool.map(_stat_chunk, rest) if slow else map(_stat_chunk, rest))])


def _stat_chunk(paths: list[str]) -> np.ndarray:
    """(size, mtime_ns) of each path, (-1, -1) where it cannot be read: (len(paths), 2) int64."""
    out = []
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            out.append((-1, -1))
        else:
            out.append((st.st_size, st.st_mtime_ns))
    return np.array(out, dtype=np.int64).reshape(len(paths), 2)


def _encode_keys(keys: list[str]) -> bytes:
    return "\0".join(keys).encode(sys.getfilesystemencoding(), sys.getfilesystemencodeerrors())  # paths hold no NUL


def _decode_keys(data: bytes) -> list[str]:
    return data.decode(sys.getfilesystemencoding(), sys.getfilesystemencodeerrors()).split("\0")


def _remove_stale_temporaries(file: Path, age_s: float = 3600) -> None:
    """Temporary files of writers killed before their rename, older than any write in progress."""
    for tmp in file.parent.glob(f"{file.name}.tmp*"):
        with contextlib.suppress(OSError):
            if time.time() - tmp.stat().st_mtime > age_s:
                tmp.unlink()
