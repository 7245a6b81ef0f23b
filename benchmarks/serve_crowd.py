"""Serving under a crowd: `imgcls serve` on the loopback, many concurrent clients for a fixed time, valid images mixed
with hostile requests, and what the server is like afterwards.

    python -m benchmarks.run --only serve_crowd

Each client loops until the time is up, drawing each request from its own seeded stream: half are valid images
(PNG or JPEG, raw body), the rest spread over KINDS: a truncated JPEG, a decompression bomb (a small PNG of 50
megapixels), a wrong and a missing Content-Type, an empty body, a body declared over --max_bytes, and a client that
disconnects mid-request (its body cut short, or the whole request sent and the answer never read). Every valid
request must get the label the same model gives the image in this process; every bad one its 4xx with a one-line
`detail`. Before the timed run a warm-up crowd runs; the server's processes (main, API server, inference workers:
those whose environment holds this run's mark) and their resident memory are read after it and after the run: no
process may die or be replaced, and the memory after must be within MEMORY_MARGIN of the memory before.
tests/test_serve_crowd.py runs the same crowd on a small network and asserts all of it.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import random
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from benchmarks.common import free_port, table

TITLE = "Serving under a crowd"
ROOT = Path(__file__).resolve().parents[1]
MARK = "IMGCLS_CROWD_MARK"
MAX_BYTES = 1_000_000
MEMORY_MARGIN = (0.10, 32)  # the memory after may exceed the memory before by 10%, plus 32 MiB
# Bad requests: (what is sent, the status expected, a word its one-line detail holds); None: no answer is read.
KINDS = {
    "truncated JPEG": (422, "truncated"),
    "decompression bomb": (413, "megapixels"),
    "wrong Content-Type": (415, "text/plain"),
    "missing Content-Type": (415, "none"),
    "empty body": (400, "empty"),
    "body over --max_bytes": (413, "--max_bytes"),
    "disconnects mid-body": (None, None),
    "disconnects before the answer": (None, None),
}
VALID = "valid image"


def request_bytes(body: bytes, content_type: str | None, length: int | None = None) -> bytes:
    head = [b"POST /predict HTTP/1.1", b"Host: 127.0.0.1", b"Connection: close",
            b"Content-Length: " + str(len(body) if length is None else length).encode()]
    if content_type is not None:
        head.append(b"Content-Type: " + content_type.encode())
    return b"\r\n".join(head) + b"\r\n\r\n" + body


async def exchange(port: int, data: bytes, read: bool = True) -> tuple[int, bytes] | None:
    """Send `data` on a new connection; (status, body) of the answer, or None where `read` is False (then the
    connection is closed at once, as a client that gave up)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        if not read:
            return None
        status = int((await reader.readline()).split()[1])
        length = 0
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        return status, await reader.readexactly(length)
    finally:
        writer.close()
        try:
            await writer.wait_closed()
        except OSError:  # the server closed first
            pass


def bad_request(kind: str, jpeg: bytes, bomb: bytes) -> tuple[bytes, bool]:
    """The bytes of a request of `kind`, and whether its answer is read."""
    return {
        "truncated JPEG": (request_bytes(jpeg[:-100], "image/jpeg"), True),
        "decompression bomb": (request_bytes(bomb, "image/png"), True),
        "wrong Content-Type": (request_bytes(jpeg, "text/plain"), True),
        "missing Content-Type": (request_bytes(jpeg, None), True),
        "empty body": (request_bytes(b"", "image/png"), True),
        "body over --max_bytes": (request_bytes(b"\0" * 1000, "application/octet-stream", MAX_BYTES + 1), True),
        "disconnects mid-body": (request_bytes(jpeg[: len(jpeg) // 2], "image/jpeg", len(jpeg)), False),
        "disconnects before the answer": (request_bytes(jpeg, "image/jpeg"), False),
    }[kind]


async def client(port: int, number: int, seed: int, until: float, images: list[tuple[bytes, str, str]],
                 bomb: bytes, out: dict) -> None:
    rng = random.Random(f"{seed}-{number}")
    jpeg = next(data for data, kind, _ in images if kind == "image/jpeg")
    while time.monotonic() < until:
        kind = VALID if rng.random() < 0.5 else rng.choice(list(KINDS))
        start = time.perf_counter()
        try:
            if kind == VALID:
                data, content_type, label = rng.choice(images)
                status, body = await exchange(port, request_bytes(data, content_type))
                got = json.loads(body)["predictions"][0]["label"] if status == 200 else body[:200]
                if status != 200 or got != label:
                    out["errors"].append(f"{kind}: {status} {got!r}, expected 200 {label!r}")
                out["latency_s"].append(time.perf_counter() - start)
            else:
                data, read = bad_request(kind, jpeg, bomb)
                answer = await exchange(port, data, read=read)
                if answer is not None:
                    status, body = answer
                    detail = json.loads(body).get("detail", "") if body.startswith(b"{") else body.decode()[:200]
                    expected, word = KINDS[kind]
                    if status != expected or word not in detail or "\n" in detail:
                        out["errors"].append(f"{kind}: {status} {detail!r}, expected {expected} with {word!r}")
        except (OSError, asyncio.IncompleteReadError, ValueError, IndexError) as err:
            if not kind.startswith("disconnects"):  # a client that hangs up may see its own connection end
                out["errors"].append(f"{kind}: {type(err).__name__}: {err}")
        out["counts"][kind] = out["counts"].get(kind, 0) + 1


async def crowd(port: int, clients: int, seconds: float, images, bomb: bytes, seed: int = 0) -> dict:
    out: dict = {"errors": [], "counts": {}, "latency_s": []}
    until = time.monotonic() + seconds
    start = time.perf_counter()
    await asyncio.gather(*(client(port, n, seed, until, images, bomb, out) for n in range(clients)))
    out["seconds"] = time.perf_counter() - start
    return out


def server_processes(mark: str) -> dict[int, int]:
    """pid -> resident KiB of every process whose environment holds MARK=mark (the server and its workers)."""
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            if f"{MARK}={mark}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                status = (entry / "status").read_text()
                found[int(entry.name)] = int(status.split("VmRSS:")[1].split()[0]) if "VmRSS:" in status else 0
        except (OSError, ValueError):  # not a process, one that ended, or a kernel thread
            continue
    return found


@contextmanager
def serving(folder: Path, log: Path, mark: str, *args: str):
    """`imgcls serve FOLDER ARGS` on a free port, its processes marked: the port once /health answers."""
    from benchmarks.serve import await_health, stop

    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), MARK: mark}
    with open(log, "w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "imgcls", "serve", str(folder), "--port", str(port),
                                 "--max_bytes", str(MAX_BYTES), *args], cwd=ROOT, env=env, stdout=sink,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        await_health(proc, f"http://127.0.0.1:{port}", log)
        yield port
    finally:
        stop(proc)


def sample_images(folder: Path, count: int = 8) -> tuple[list[tuple[bytes, str, str]], bytes]:
    """`count` photo-like images (PNG and JPEG) with the label the model gives each here, each chosen with a clear
    margin between its first and second class (a batch's float rounding never flips it); and a 50-megapixel PNG."""
    import numpy as np
    import torch
    from PIL import Image

    from benchmarks.common import photo
    from datamodules.transforms import eval_pipeline
    from deploy.serve import decode_image, load_served

    served = load_served(folder)
    transform, rng, found = eval_pipeline(served.contract), np.random.default_rng(0), []
    while len(found) < count:
        image, buffer = photo(rng, 96, 80), io.BytesIO()
        kind = "image/png" if len(found) % 2 else "image/jpeg"
        image.save(buffer, "PNG" if kind == "image/png" else "JPEG", quality=90)
        with torch.inference_mode():
            probs = served.model(transform(decode_image(buffer.getvalue(), 10**8))[None]).softmax(1)[0]
        top = probs.topk(2).values
        if top[0] - top[1] > 1e-3:
            found.append((buffer.getvalue(), kind, served.class_names[int(probs.argmax())]))
    bomb = io.BytesIO()
    Image.new("L", (7100, 7100)).save(bomb, "PNG")
    return found, bomb.getvalue()


def run(folder: Path, clients: int, seconds: float, warmup: float, *args: str) -> dict:
    """The crowd against `imgcls serve FOLDER ARGS`: the timed run's outcome, and the server before and after it."""
    images, bomb = sample_images(folder)
    mark = secrets.token_hex(8)
    with tempfile.TemporaryDirectory() as tmp, serving(folder, Path(tmp) / "serve.log", mark, *args) as port:
        asyncio.run(crowd(port, clients, warmup, images, bomb, seed=1))
        before = server_processes(mark)
        timed = asyncio.run(crowd(port, clients, seconds, images, bomb))
        time.sleep(1.0)  # the last disconnected requests' work done
        after = server_processes(mark)
        log = (Path(tmp) / "serve.log").read_text()
    latency = sorted(timed.pop("latency_s"))
    return {**timed, "clients": clients, "valid": len(latency),
            "p50_ms": 1000 * statistics.median(latency) if latency else None,
            "p99_ms": 1000 * latency[min(len(latency) - 1, int(0.99 * len(latency)))] if latency else None,
            "pids_before": sorted(before), "pids_after": sorted(after),
            "rss_before_mib": sum(before.values()) / 1024, "rss_after_mib": sum(after.values()) / 1024,
            "tracebacks": [line for line in log.splitlines() if "Traceback" in line or "died" in line.lower()]}


def within_margin(r: dict) -> bool:
    share, mib = MEMORY_MARGIN
    return r["rss_after_mib"] <= r["rss_before_mib"] * (1 + share) + mib


def main(quick: bool = False) -> dict:
    from benchmarks.serve import write_folder

    clients, seconds, warmup = (8, 4, 2) if quick else (64, 60, 15)
    arch, size = ("resnet18", 32) if quick else ("resnet50", 224)
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_folder(Path(tmp) / "model", arch, size)
        result = run(folder, clients, seconds, warmup, "--max_batch_size", "16", "--batch_timeout", "0.01")
    return {"arch": arch, "image_size": size, "duration_s": seconds, **result}


def render(r: dict) -> tuple[str, str]:
    rows = [[kind, count] for kind, count in sorted(r["counts"].items())]
    body = table(["request", "sent"], rows)
    kept = r["pids_before"] == r["pids_after"]
    share, mib = MEMORY_MARGIN
    body += (f"\n\n{r['valid']} valid requests in {r['seconds']:.0f} s ({r['valid'] / r['seconds']:.1f} requests/s "
             f"beside the bad ones), p50 {r['p50_ms']:.0f} ms, p99 {r['p99_ms']:.0f} ms; wrong answers: "
             f"{len(r['errors'])}. The server's {len(r['pids_before'])} processes "
             f"{'all lived through it' if kept else 'changed'}; their resident memory went from "
             f"{r['rss_before_mib']:.0f} MiB to {r['rss_after_mib']:.0f} MiB (the margin: {share:.0%} plus {mib} MiB, "
             f"{'kept' if within_margin(r) else '**exceeded**'}).")
    return body, (f"{r['arch']} at {r['image_size']} px, random weights, max_batch_size 16; {r['clients']} "
                  f"concurrent clients for {r['duration_s']} s after a warm-up crowd, half valid images, half "
                  "hostile requests; on loopback")
