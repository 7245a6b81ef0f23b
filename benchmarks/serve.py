"""Serving on loopback: requests/s and p50/p99 latency of `imgcls serve` with dynamic batching, the same server with
`max_batch_size 1`, and a plain `http.server` endpoint around the same model (one request at a time, no LitServe);
then the model's forward pass alone at batch 1 and at the largest batch, in images/s.

    python -m benchmarks.run --only serve [--quick]

A fixed number of concurrent clients each post a bounded number of the same PNG (raw body); every answer must be a
200. The model is a random-weight ResNet of the quickstart's head written as a model folder (`imgcls publish`'s
layout), so the figures measure serving, not accuracy. The forward pass is timed in a process of its own set up as an
inference worker of `imgcls serve` (its torch threads, its OpenMP wait, the main thread): what batching can gain at
most, before any serving cost.
"""

from __future__ import annotations

import io
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from benchmarks.common import free_port, table, verdict

TITLE = "Serving"
ROOT = Path(__file__).resolve().parents[1]
BASELINE = "plain http.server, one request at a time"


def write_folder(folder: Path, arch: str, size: int) -> Path:
    """A model folder of a random-weight network, as `imgcls publish` lays it out."""
    import torch
    from safetensors.torch import save_file

    from datamodules.presets import ClassificationPresetEval
    from datamodules.transforms import contract_of
    from deploy.publish import model_config
    from lightning_modules import ImageClassifier
    from lightning_modules.pretrained import network_factory
    from training.records.saved_run import SavedRun

    torch.manual_seed(0)
    contract = contract_of(ClassificationPresetEval(image_size=size))
    net = {"class_path": "lightning_modules.network.BackboneWithHead", "init_args": {"arch": arch, "head_hidden": 1024}}
    model = ImageClassifier(num_classes=10, net=network_factory(net), levers={"channels_last": False},
                            input_contract=contract)
    saved = SavedRun(folder, {**dict(model.hparams), "net": net}, {}, 0, None, {})
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.net.state_dict().items()}, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(model_config(saved, None, False), indent=2))
    return folder


def plain_server(folder: str, port: int) -> None:
    """The baseline: http.server, one request at a time (a lock), the same decode, transform and model."""
    import threading

    import torch

    from datamodules.transforms import eval_pipeline
    from deploy.serve import decode_image, load_served

    served = load_served(folder)
    transform, lock = eval_pipeline(served.contract), threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self._answer(200, b"ok")

        def do_POST(self):  # noqa: N802
            data = self.rfile.read(int(self.headers["Content-Length"]))
            with lock, torch.inference_mode():
                probs = served.model(transform(decode_image(data, 40_000_000))[None]).softmax(1)[0]
            self._answer(200, json.dumps({"label": served.class_names[int(probs.argmax())]}).encode())

        def _answer(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


def forward_rates(folder: str, batches: list[int], seconds: float) -> dict[int, float]:
    """Images/s of the model's forward pass alone at each batch size, on the device and with the torch threads an
    inference worker of `imgcls serve` gets, in this process's main thread (where LitServe's loop runs a batch)."""
    import torch

    from deploy.serve import choose_workers, load_served

    cuda = torch.cuda.is_available()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    torch.set_num_threads(choose_workers("cuda" if cuda else "cpu", cores)[1])
    served = load_served(folder)
    device = "cuda" if cuda else "cpu"
    model, size = served.model.to(device), served.contract["image_size"]
    rates = {}
    with torch.inference_mode():
        for batch in batches:
            x = torch.rand(batch, 3, size, size, device=device)
            model(x)  # warm-up: the first pass picks the kernels
            times = []
            while sum(times) < seconds or len(times) < 3:
                start = time.perf_counter()
                model(x)
                if cuda:
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            rates[batch] = batch / statistics.median(times)
    return rates


def forward_in_a_worker(folder: str, batches: list[int], seconds: float) -> dict[int, float]:
    """`forward_rates` in a fresh process whose OpenMP reads the wait `imgcls serve` gives its workers."""
    from deploy.serve import passive_openmp

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    passive_openmp(env)
    out = subprocess.run([sys.executable, "-m", "benchmarks.serve", "--forward", folder, json.dumps(batches),
                          str(seconds)], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return {int(k): v for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}


def await_health(proc: subprocess.Popen, url: str, log: Path, timeout: float = 180) -> None:
    """Return once the server at `url` answers /health; raise with its log's end if it exits or takes too long."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{' '.join(proc.args)} did not come up:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.5)


def stop(proc: subprocess.Popen) -> None:
    """Kill the server with its workers (its session)."""
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def measure(cmd: list[str], port: int, body: bytes, clients: int, requests: int) -> dict:
    """Start the server, wait for its health, fire clients x requests posts; requests/s and latencies (ms), and the
    seconds from its launch to its first answer."""
    import httpx

    log = Path(tempfile.mkstemp(suffix=".log")[1])
    launched = time.perf_counter()
    with open(log, "w") as sink:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
    url = f"http://127.0.0.1:{port}"
    try:
        await_health(proc, url, log)
        headers = {"Content-Type": "image/png"}
        with httpx.Client(timeout=120) as client:
            warm = client.post(f"{url}/predict", content=body, headers=headers)
            if warm.status_code != 200:
                raise RuntimeError(f"{' '.join(cmd)} answered {warm.status_code}: {log.read_text()[-3000:]}")
            first_answer = time.perf_counter() - launched

            def one_client(_):
                times = []
                for _ in range(requests):
                    start = time.perf_counter()
                    client.post(f"{url}/predict", content=body, headers=headers).raise_for_status()
                    times.append(time.perf_counter() - start)
                return times

            start = time.perf_counter()
            with ThreadPoolExecutor(clients) as pool:
                latencies = sorted(t for part in pool.map(one_client, range(clients)) for t in part)
            wall = time.perf_counter() - start
    finally:
        stop(proc)
        log.unlink()
    return {"requests_per_s": len(latencies) / wall, "p50_ms": 1000 * statistics.median(latencies),
            "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
            "first_answer_s": first_answer}


def main(quick: bool = False) -> dict:
    from PIL import Image

    clients, requests, size = (4, 3, 64) if quick else (16, 30, 224)
    largest = 16  # the batched server's max_batch_size
    arch = "resnet18" if quick else "resnet50"
    image = io.BytesIO()
    Image.effect_noise((size + size // 7, size + size // 7), 64).convert("RGB").save(image, "PNG")
    with tempfile.TemporaryDirectory() as tmp:
        folder = str(write_folder(Path(tmp) / "model", arch, size))
        serve = [sys.executable, "-m", "imgcls", "serve", folder, "--accelerator", "auto"]
        candidates = {
            "imgcls serve, max_batch_size 16": serve + ["--max_batch_size", str(largest), "--batch_timeout", "0.01"],
            "imgcls serve, max_batch_size 1": serve + ["--max_batch_size", "1"],
            BASELINE: [sys.executable, "-m", "benchmarks.serve", "--plain", folder],
        }
        rows = {}
        for name, cmd in candidates.items():
            port = free_port()
            cmd = cmd + (["--port", str(port)] if "--plain" not in cmd else [str(port)])
            rows[name] = measure(cmd, port, image.getvalue(), clients, requests)
        forward = forward_in_a_worker(folder, [1, largest], 0.5 if quick else 3.0)
    return {"arch": arch, "image_size": size, "clients": clients, "requests_per_client": requests, "rows": rows,
            "forward_img_s": {str(b): v for b, v in forward.items()}}


def render(r: dict) -> tuple[str, str]:
    base = r["rows"][BASELINE]["requests_per_s"]
    rows = [[name, f"{v['requests_per_s']:.1f}", f"{v['requests_per_s'] / base:.2f}x", f"{v['p50_ms']:.0f}",
             f"{v['p99_ms']:.0f}", f"{v['first_answer_s']:.1f}" if "first_answer_s" in v else "-"]
            for name, v in r["rows"].items()]  # records stored before the first answer was timed have none
    body = table(["server", "requests/s", "vs plain", "p50 ms", "p99 ms", "launch to first answer, s"], rows)
    batched, single = r["rows"]["imgcls serve, max_batch_size 16"], r["rows"]["imgcls serve, max_batch_size 1"]
    gain = batched["requests_per_s"] / single["requests_per_s"]
    body += (f"\n\nTarget, batching at least 2x the requests/s of max_batch_size 1 at equal p99: {gain:.2f}x, p99 "
             f"{batched['p99_ms']:.0f} ms against {single['p99_ms']:.0f} ms ({verdict(gain >= 2)}).")
    if "forward_img_s" in r:  # results stored before the forward pass was timed have none
        (b1, one), (bn, many) = sorted(((int(b), v) for b, v in r["forward_img_s"].items()))
        body += (f" The forward pass alone, as an inference worker runs it: {one:.1f} img/s at batch {b1}, "
                 f"{many:.1f} img/s at batch {bn} ({many / one:.2f}x): the most batching can gain here.")
    return body, (f"{r['arch']} at {r['image_size']} px, {r['clients']} concurrent clients x "
                  f"{r['requests_per_client']} requests each, one PNG as the raw body, on loopback")


def figures(r: dict) -> dict[str, str]:
    rows = r["rows"]
    batched, single = rows["imgcls serve, max_batch_size 16"], rows["imgcls serve, max_batch_size 1"]
    return {"batching_x": f"{batched['requests_per_s'] / single['requests_per_s']:.2f}x",
            "batched_rps": f"{batched['requests_per_s']:.1f} req/s",
            "batched_p99": f"{batched['p99_ms']:.0f} ms", "single_p99": f"{single['p99_ms']:.0f} ms",
            "plain_rps": f"{rows[BASELINE]['requests_per_s']:.1f} req/s",
            **({"first_answer": f"{batched['first_answer_s']:.1f} s"} if "first_answer_s" in batched else {}),
            **forward_figures(r.get("forward_img_s"))}


def forward_figures(rates: dict[str, float] | None) -> dict[str, str]:
    if not rates:
        return {}
    (b1, one), (bn, many) = sorted((int(b), v) for b, v in rates.items())
    return {"forward_b1": f"{one:.1f} img/s", "forward_batched": f"{many:.1f} img/s",
            "forward_batched_x": f"{many / one:.2f}x", "forward_batch": str(bn)}


def cli() -> None:
    """`python -m benchmarks.serve --plain|--forward ...`: one of the section's helper processes."""
    if len(sys.argv) == 4 and sys.argv[1] == "--plain":
        plain_server(sys.argv[2], int(sys.argv[3]))
    elif len(sys.argv) == 5 and sys.argv[1] == "--forward":
        print(json.dumps(forward_rates(sys.argv[2], json.loads(sys.argv[3]), float(sys.argv[4]))))
    else:
        raise SystemExit("usage: python -m benchmarks.serve --plain FOLDER PORT | --forward FOLDER BATCHES SECONDS "
                         "(the section itself: python -m benchmarks.run --only serve)")


if __name__ == "__main__":
    cli()
