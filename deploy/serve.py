"""`imgcls serve`: a model folder (`imgcls publish`) or a checkpoint behind an HTTP endpoint, with LitServe's dynamic
batching.

    imgcls serve runs/quickstart/published --port 8000 --max_batch_size 32 --batch_timeout 0.01
    curl -X POST --data-binary @cat.jpg -H "Content-Type: image/jpeg" http://127.0.0.1:8000/predict

POST /predict takes one image as the raw body (Content-Type image/* or application/octet-stream), one or more files as
multipart/form-data, or JSON {"images": [base64, ...]}; it answers {"predictions": [one per image]}. GET /health
answers "ok" once the model is loaded. Bad input gets a 4xx whose JSON `detail` is one line; docs/SERVING.md has the
schema and the error table. The preprocessing is the model's evaluation transform (its input contract).
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import logging
import os
import sys
from dataclasses import KW_ONLY, dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from core.command_line import parse_settings
from core.config_types import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt
from core.extras import require_extra

require_extra("serve", "imgcls serve")  # before LitServe's import: without the extra, one line and no traceback
import litserve as ls  # noqa: E402

log = logging.getLogger("imgcls.serve")

API_PATH = "/predict"
BATCH_HEADER = "X-Imgcls-Batch"  # images in the batch that answered this request, for clients that watch batching
DEFAULT_MAX_BYTES = 20 * 2**20
DEFAULT_MAX_PIXELS = 40_000_000  # per image; PIL's own bomb check starts at 89 MP, a 50 MP photo is refused here
RAW_TYPES = ("image/", "application/octet-stream")


@dataclass
class Served:
    """What serving needs of a model: the network in eval mode, its preprocessing, its classes and kind."""

    model: torch.nn.Module
    contract: dict[str, Any]
    class_names: list[str]
    multilabel: bool
    threshold: float | None


def check_model_path(path: str | Path, threshold: float | None) -> None:
    """Raises a one-line error for a path that is neither a model folder nor an imgcls checkpoint; a multi-label
    checkpoint needs --threshold (a folder carries its own)."""
    from lightning_modules.pretrained import read_config

    path = Path(path).expanduser()
    if path.is_dir():
        read_config(path)  # raises naming the file and the fix
        return
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; pass a model folder of imgcls publish or a checkpoint")
    from deploy.publish import read_run

    saved, _, _ = read_run(path)
    if saved.model.get("multilabel") and threshold is None:
        raise ValueError(f"{path} is a multi-label checkpoint, whose threshold is not saved: pass --threshold T")


def load_served(path: str | Path, threshold: float | None = None) -> Served:
    """The model of a folder (its network alone: no Lightning to import in each inference worker) or a checkpoint
    (the validated weights), on the CPU in eval mode, fp32."""
    path = Path(path).expanduser()
    if path.is_dir():
        from lightning_modules.pretrained import folder_threshold, pretrained_network, read_config

        config = read_config(path)
        multilabel = bool(config["multilabel"])
        return Served(pretrained_network(path, config), dict(config["preprocessing"]), list(config["class_names"]),
                      multilabel, folder_threshold(config, threshold) if multilabel else None)
    from deploy.export import load_for_export

    model, contract = load_for_export(path)
    if threshold is not None:
        model.threshold = threshold
    multilabel = bool(model.hparams.get("multilabel"))
    return Served(model, contract, list(model.class_names), multilabel, model.threshold if multilabel else None)


class Rejected:
    """A request that cannot be answered: its HTTP status and one-line reason (kept out of the batch, so that one bad
    image fails only its own request)."""

    def __init__(self, status: int, reason: str) -> None:
        self.status, self.reason = status, reason


def _reject(status: int, reason: str):
    from starlette.responses import JSONResponse

    return JSONResponse({"detail": reason}, status_code=status)


class ImageBody:
    """ASGI middleware before LitServe's /predict, which reads JSON or forms only: a raw image body or multipart files
    become JSON {"images": [base64]}; an empty body (400), a body over `max_bytes` (413) and any other content type
    (415) are answered here, in one line."""

    def __init__(self, app, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] != API_PATH:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        kind = headers.get(b"content-type", b"").decode("latin-1").split(";")[0].strip().lower()
        declared = headers.get(b"content-length", b"").decode("latin-1")
        too_big = _reject(413, f"the body is over the limit of {self.max_bytes:,} bytes (imgcls serve --max_bytes)")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await too_big(scope, receive, send)
            return
        body = bytearray()
        while True:
            message = await receive()
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                await too_big(scope, receive, send)
                return
            if not message.get("more_body"):
                break
        if not body:
            await _reject(400, "the body is empty: post an image (Content-Type image/jpeg, image/png, ...), "
                               "multipart/form-data files, or JSON {\"images\": [base64, ...]}")(scope, receive, send)
            return
        if kind == "application/json":
            try:
                json.loads(body)
            except ValueError as err:
                await _reject(422, f"the JSON body does not parse ({err})")(scope, receive, send)
                return
            images = None
        elif kind.startswith(RAW_TYPES):
            images = [bytes(body)]
        elif kind == "multipart/form-data":
            images = await _form_files(scope, bytes(body))
            if not images:
                await _reject(400, "the multipart body holds no file: send each image as a file field")(
                    scope, receive, send)
                return
        else:
            await _reject(415, f"Content-Type {kind or 'none'!r} is not accepted: send image/jpeg, image/png (any "
                               "image/*), application/octet-stream, multipart/form-data or application/json")(
                scope, receive, send)
            return
        if images is not None:
            body = json.dumps({"images": [base64.b64encode(b).decode("ascii") for b in images]}).encode()
            scope = dict(scope, headers=[(k, v) for k, v in scope["headers"]
                                         if k not in (b"content-type", b"content-length")]
                         + [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())])
        sent = False

        async def replay():
            nonlocal sent
            if sent:
                return {"type": "http.disconnect"}
            sent = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)


async def _form_files(scope, body: bytes) -> list[bytes]:
    from starlette.datastructures import UploadFile
    from starlette.requests import Request

    async def once():
        return {"type": "http.request", "body": body, "more_body": False}

    form = await Request(scope, once).form()
    return [await value.read() for _, value in form.multi_items() if isinstance(value, UploadFile)]


def decode_image(data: bytes, max_pixels: int) -> torch.Tensor | Rejected:
    """An image file's bytes -> uint8 (3, H, W) RGB (the pixels `imgcls predict` reads), or why not."""
    from PIL import Image, UnidentifiedImageError

    from datamodules.decoding import decode_bytes

    try:
        with Image.open(io.BytesIO(data)) as header:  # reads the header only: the size before any decoding
            width, height = header.size
    except (UnidentifiedImageError, OSError, ValueError):
        return Rejected(422, f"the body ({len(data):,} bytes) is not an image PIL can read (JPEG, PNG, WebP, ...)")
    if width * height > max_pixels:
        return Rejected(413, f"the image is {width}x{height} = {width * height / 1e6:.1f} megapixels, over the limit "
                             f"of {max_pixels / 1e6:g} (imgcls serve --max_pixels)")
    try:
        return decode_bytes(data)
    except (OSError, ValueError, RuntimeError, Image.DecompressionBombError) as err:
        return Rejected(422, f"the image could not be decoded ({str(err).splitlines()[0][:120]}): a truncated or "
                             "damaged file?")


class ImageClassifierAPI(ls.LitAPI):
    """Decode and preprocess per request (in the inference worker), one forward pass per batch of requests."""

    def __init__(self, model_path: str, *, threshold: float | None, top_k: int, max_pixels: int, threads: int,
                 **kwargs) -> None:
        super().__init__(**kwargs)
        self.model_path, self.threshold, self.top_k = model_path, threshold, top_k
        self.max_pixels, self.threads = max_pixels, threads

    def setup(self, device) -> None:
        from datamodules.transforms import eval_pipeline  # the contract's preprocessing, as export lists it

        torch.set_num_threads(self.threads)
        logging.basicConfig(level=os.environ.get("IMGCLS_SERVE_LOG", "INFO"), format="%(name)s: %(message)s")
        served = load_served(self.model_path, self.threshold)
        self.model = served.model.to(device)
        self.device, self.served = device, served
        self.transform = eval_pipeline(served.contract)
        log.info("serving %s on %s: %d classes, %s", self.model_path, device, len(served.class_names),
                 "multi-label" if served.multilabel else "single-label")

    def decode_request(self, request: dict):
        images = request.get("images") if isinstance(request, dict) else None
        if not isinstance(images, list) or not images or not all(isinstance(i, str) for i in images):
            return Rejected(422, 'JSON bodies are {"images": [base64 of an image file, ...]}')
        tensors = []
        for index, text in enumerate(images):
            try:
                data = base64.b64decode(text, validate=True)
            except (binascii.Error, ValueError):
                return Rejected(422, f"images[{index}] is not base64")
            image = decode_image(data, self.max_pixels)
            if isinstance(image, Rejected):
                if len(images) > 1:
                    image.reason = f"images[{index}]: {image.reason}"
                return image
            tensors.append(self.transform(image))
        return torch.stack(tensors)  # (N, 3, S, S) for the N images of this request

    def batch(self, inputs: list):
        return inputs  # requests hold 1..N images each: stacked in predict

    @torch.inference_mode()
    def predict(self, inputs: list) -> list:
        if not isinstance(inputs, list):  # max_batch_size 1: LitServe passes the one request's input as it is
            return self.predict([inputs])[0]
        good = [x for x in inputs if not isinstance(x, Rejected)]
        if not good:
            return inputs
        batch = torch.cat(good).to(self.device)
        logits = self.model(batch).float()
        probs = (logits.sigmoid() if self.served.multilabel else logits.softmax(dim=1)).cpu()
        log.debug("batch of %d requests, %d images", len(good), len(batch))
        parts = iter(probs.split([len(x) for x in good]))
        return [x if isinstance(x, Rejected) else (next(parts), len(batch)) for x in inputs]

    def unbatch(self, output: list) -> list:
        return output

    def encode_response(self, output):
        from starlette.responses import JSONResponse

        if isinstance(output, Rejected):
            return JSONResponse({"detail": output.reason}, status_code=output.status)
        probs, batch_images = output
        return JSONResponse({"predictions": [self.describe(p) for p in probs]},
                            headers={BATCH_HEADER: str(batch_images)})

    def describe(self, probs: torch.Tensor) -> dict:
        names, k = self.served.class_names, min(self.top_k, len(probs))
        top = probs.topk(k)
        top_k = [{"label": names[i], "score": round(float(p), 6)} for p, i in zip(top.values, top.indices,
                                                                                 strict=True)]
        if self.served.multilabel:
            chosen = [{"label": names[i], "score": round(float(probs[i]), 6)}
                      for i in range(len(names)) if probs[i] >= self.served.threshold]
            return {"labels": chosen, "threshold": self.served.threshold, "top_k": top_k}
        return {"label": top_k[0]["label"], "score": top_k[0]["score"], "top_k": top_k}


def choose_workers(accelerator: str, cores: int, devices: int = 1) -> tuple[int, int, str]:
    """(inference workers per device, torch threads per worker, why): the workers of all `devices` together never hold
    more threads than the cores."""
    if accelerator == "cuda":
        threads = max(1, cores // (2 * devices))
        return 2, threads, (f"2 workers per GPU (one decodes while the other runs the batch) on {devices} GPU(s), "
                            f"{threads} torch threads each")
    workers = max(1, cores // 4)  # a worker needs a few threads for its batch's convolutions
    threads = max(1, cores // workers)
    return workers, threads, f"{workers} worker(s) x {threads} torch threads on {cores} cores"


SPIN_SETTINGS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def passive_openmp(environ=os.environ) -> str:
    """Sets OMP_WAIT_POLICY=PASSIVE in `environ` unless the OpenMP wait is set there already; says which.

    The inference workers' threads fill the cores, and torch's OpenMP (libgomp) makes a thread that reaches the end of
    a parallel region spin up to 300,000 rounds for its teammates before it sleeps; nearly every operator of the
    network is such a region. When anything else takes a core (the API server, the clients, another job), the
    teammate that lost it cannot finish its part while the other spins on the core it would need. On 2 cores beside
    other jobs a ResNet50 forward pass at batch 1 took 0.5 to 1.1 s instead of 28 ms, three quarters of the worker's
    CPU went to libgomp's spin loop, and requests waited into 504s (docs/SERVING.md). Sleeping threads cost a wake-up
    per region instead. The workers are spawned by LitServe and inherit this environment; libgomp reads it when torch
    loads it, so it must be set before they start. This process and the API servers it forks loaded theirs already."""
    set_by_user = [name for name in SPIN_SETTINGS if name in environ]
    if set_by_user:
        return "OpenMP wait from the environment (" + ", ".join(f"{n}={environ[n]}" for n in set_by_user) + ")"
    environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return "idle OpenMP threads sleep (OMP_WAIT_POLICY=PASSIVE)"


def device_count(accelerator: str, devices: int | str) -> int:
    if accelerator != "cuda":
        return 1
    return torch.cuda.device_count() if devices == "auto" else int(devices)


@dataclass(kw_only=True)
class RequestLimits:
    """What one request may be; over a limit it gets the status that names it (413, 504), never a worker's crash."""

    max_bytes: PositiveInt = DEFAULT_MAX_BYTES
    """largest body accepted (else 413)"""
    max_pixels: PositiveInt = DEFAULT_MAX_PIXELS
    """largest image accepted (else 413)"""
    timeout: PositiveFloat = 30
    """seconds a request may wait before a 504"""


@dataclass
class ServeSettings(RequestLimits):
    """The settings of `imgcls serve`: the model, the server and its batching, and (inherited) the request limits."""

    model: str
    """a model folder of imgcls publish, or a checkpoint of imgcls fit"""
    _: KW_ONLY
    host: str = "127.0.0.1"
    """0.0.0.0 to answer other machines"""
    port: NonNegativeInt = 8000
    """the HTTP port"""
    max_batch_size: PositiveInt = 32
    """requests per forward pass, at most"""
    batch_timeout: NonNegativeFloat = 0.01
    """seconds a batch waits to fill up"""
    accelerator: Literal["auto", "cpu", "cuda"] = "auto"
    """where the model runs (auto: cuda if there is one)"""
    devices: PositiveInt | Literal["auto"] = "auto"
    """GPUs to use (auto: all)"""
    workers_per_device: PositiveInt | None = None
    """inference processes per device (default: by the cores)"""
    top_k: PositiveInt = 5
    """labels per answer (single-label)"""
    threshold: float | None = None
    """multi-label: the folder's threshold, or this"""


def build_server(args: ServeSettings) -> ls.LitServer:
    accelerator = args.accelerator
    if accelerator == "auto":
        accelerator = "cuda" if torch.cuda.is_available() else "cpu"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    devices = device_count(accelerator, args.devices)
    workers, threads, why = choose_workers(accelerator, cores, devices)
    if args.workers_per_device:
        workers, threads = args.workers_per_device, max(1, cores // (args.workers_per_device * devices))
        why = f"{workers} worker(s) per device (--workers_per_device) x {threads} torch threads on {cores} cores"
    waiting = passive_openmp()
    print(f"imgcls serve: {accelerator}, {why}, {waiting}; max_batch_size {args.max_batch_size}, batch_timeout "
          f"{args.batch_timeout} s", flush=True)
    api = ImageClassifierAPI(str(args.model), threshold=args.threshold, top_k=args.top_k, max_pixels=args.max_pixels,
                       threads=threads, max_batch_size=args.max_batch_size, batch_timeout=args.batch_timeout,
                       api_path=API_PATH)
    return ls.LitServer(api, accelerator=accelerator, devices=args.devices, workers_per_device=workers,
                        timeout=args.timeout, middlewares=[(ImageBody, {"max_bytes": args.max_bytes})])


def main(argv: list[str] | None = None) -> None:
    args = parse_settings(ServeSettings, argv, prog="imgcls serve", description=__doc__)
    from training.resume.checkpoints import UnsafeCheckpointError

    try:
        check_model_path(args.model, args.threshold)
    except (FileNotFoundError, ValueError, UnsafeCheckpointError) as err:
        print(f"imgcls serve: error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    server = build_server(args)
    server.run(host=args.host, port=args.port, generate_client_file=False, num_api_servers=1)


if __name__ == "__main__":
    main()
