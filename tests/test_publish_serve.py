"""`imgcls publish` and `imgcls serve` on one tiny run: the folder's files and card as huggingface_hub reads them,
loading it back without the checkpoint (same predictions, a fine-tune), the refusals, and a real server process
answered by a real HTTP client: labels equal to `imgcls predict`'s, batches under concurrency, bad input in 4xx."""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import torch
import yaml
from huggingface_hub import ModelCard
from PIL import Image
from safetensors.torch import load_file

from deploy.serve import SPIN_SETTINGS, choose_workers
from lightning_modules import BackboneWithHead, ImageClassifier
from lightning_modules.pretrained import network_factory
from tests.helpers import CONFIGS, ROOT, TINY, TINY_ARCH, cli_env, concurrent_python, free_port, run_cli

SETTINGS = ["--trainer.enable_progress_bar", "false", "--trainer.precision", "32-true"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, digits_root) -> Path:
    """A run of TINY_ARCH on the 32 px digits, long enough to tell the digits apart."""
    run = tmp_path_factory.mktemp("publish_run")
    run_cli("fit", "--config", str(CONFIGS / "quickstart.yaml"), *TINY, *SETTINGS, "--data.root", str(digits_root),
            "--data.batch_size", "32", "--trainer.limit_train_batches", "30", "--trainer.limit_val_batches", "3",
            "--trainer.max_epochs", "2", "--trainer.default_root_dir", str(run))
    return run


@pytest.fixture(scope="module")
def folder(trained, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("published") / f"digits-{TINY_ARCH}"
    proc = run_cli("publish", "--ckpt_path", str(trained / "checkpoints" / "last.ckpt"), str(out))
    assert f"hf upload USER/NAME {out}" in proc.stdout
    return out


@pytest.fixture(scope="module")
def images(digits_root, tmp_path_factory) -> Path:
    """Two test digits of each class, as PNG and as JPEG."""
    out = tmp_path_factory.mktemp("to_predict")
    for label in range(10):
        for i, path in enumerate(sorted((digits_root / "test" / str(label)).glob("*.png"))[:2]):
            if i == 0:
                shutil.copy(path, out / f"{label}_{path.name}")
            else:
                Image.open(path).convert("RGB").save(out / f"{label}_{path.stem}.jpg", quality=90)
    return out


def predictions(run_dir: Path) -> dict[str, str]:
    with open(run_dir / "predictions.csv", newline="") as f:
        return {Path(row["path"]).name: row["class_name"] for row in csv.DictReader(f)}


def test_folder_holds_the_validated_weights_and_a_card_the_hub_reads(folder, trained, digits_root):
    assert {p.name for p in folder.iterdir()} == {"model.safetensors", "config.json", "README.md",
                                                  "training_config.yaml", "confusion_matrix.png"}
    ckpt = torch.load(trained / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    weights = load_file(folder / "model.safetensors")
    assert weights.keys() == {k.removeprefix("net.") for k in ckpt["state_dict"] if k.startswith("net.")}
    assert all(torch.equal(weights[k], ckpt["state_dict"][f"net.{k}"]) for k in weights)
    config = json.loads((folder / "config.json").read_text())
    assert network_factory(config["network"]).func is BackboneWithHead  # rebuilt from config.json alone
    assert config["network"]["init_args"] | {"arch": TINY_ARCH, "head_hidden": 32} == config["network"]["init_args"]
    assert config["class_names"] == [str(i) for i in range(10)] and config["num_classes"] == 10
    assert (config["multilabel"], config["threshold"], config["weights"]["averaged"]) == (False, None, False)
    assert config["preprocessing"] == ckpt["hyper_parameters"]["input_contract"]
    assert (folder / "training_config.yaml").read_text() == (trained / "config.yaml").read_text()

    card = ModelCard.load(folder / "README.md")
    assert card.data.library_name == "imgcls" and card.data.pipeline_tag == "image-classification"
    assert card.data.datasets == ["digits"] and TINY_ARCH in card.data.tags
    results = {r.metric_name: r.metric_value for r in card.data.eval_results}
    assert set(results) == {"top-1 accuracy", "top-5 accuracy", "macro F1"}
    score = ckpt["callbacks"][next(k for k in ckpt["callbacks"] if k.startswith("ModelCheckpoint"))]
    assert results["top-1 accuracy"] == pytest.approx(float(score["best_model_score"]))
    sevens = len(list((digits_root / "train" / "7").iterdir()))
    for text in ("## Classes", f"| 7 | {sevens} |", "## Recipe", "AdamW(lr=0.016", "## Hardware and training time",
                 "## Intended use and limits", "confusion_matrix.png"):
        assert text in card.text, text


def test_folder_predicts_as_the_checkpoint_and_fine_tunes(folder, trained, images, digits_root, tmp_path):
    model = ImageClassifier.from_pretrained(folder)
    reference = ImageClassifier.load_from_checkpoint(trained / "checkpoints" / "last.ckpt", map_location="cpu")
    x = torch.rand(4, 3, 32, 32)
    with torch.no_grad():  # the same weights (bitwise: the test above); the layouts may differ (channels_last: auto)
        torch.testing.assert_close(model(x), reference.eval()(x), rtol=1e-5, atol=1e-5)

    common = ["predict", "--data.predict_dir", str(images), "--trainer.accelerator", "cpu", *SETTINGS]
    run_cli(*common, "--model.net.weights", str(folder), "--trainer.default_root_dir", str(tmp_path / "from_folder"))
    run_cli(*common, "--ckpt_path", str(trained / "checkpoints" / "last.ckpt"), "--trainer.default_root_dir",
            str(tmp_path / "from_ckpt"))
    from_folder = predictions(tmp_path / "from_folder")
    assert len(from_folder) == 20 and from_folder == predictions(tmp_path / "from_ckpt")
    assert len(set(from_folder.values())) >= 5  # a trained model, not one constant label

    fit = run_cli("fit", "--config", str(CONFIGS / "quickstart.yaml"), *TINY, *SETTINGS,
                  "--model.net.arch", "resnet50", "--model.net.weights", str(folder), "--data.root", str(digits_root),
                  "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1", "--trainer.max_epochs",
                  "1", "--auto_resume", "false", "--trainer.default_root_dir", str(tmp_path / "fine_tune"))
    assert f"model.net.weights={folder}: loaded the network" in fit.stdout + fit.stderr
    tuned = torch.load(tmp_path / "fine_tune" / "checkpoints" / "last.ckpt", weights_only=True)
    # the folder's network, over the config's
    assert tuned["hyper_parameters"]["net"]["init_args"]["arch"] == TINY_ARCH


def test_publish_refuses_in_one_line_and_keeps_what_is_there(folder, trained, tmp_path):
    ckpt = trained / "checkpoints" / "last.ckpt"
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    refused = run_cli("publish", "--ckpt_path", str(ckpt), str(busy), check=False)
    assert refused.returncode == 2 and "--overwrite" in refused.stderr and len(refused.stderr.splitlines()) == 1
    assert [p.name for p in busy.iterdir()] == ["notes.txt"]
    run_cli("publish", "--ckpt_path", str(ckpt), str(busy), "--overwrite")
    assert (busy / "notes.txt").read_text() == "mine" and (busy / "model.safetensors").is_file()

    foreign = tmp_path / "foreign.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(2)}}, foreign)
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    state["hyper_parameters"]["multilabel"] = True
    multilabel = tmp_path / "multilabel.ckpt"
    torch.save(state, multilabel)
    for path, extra, expected in ((foreign, [], "is not a checkpoint of imgcls fit"),
                                  (multilabel, [], "pass --threshold"),
                                  (ckpt, ["--threshold", "0.5"], "--threshold is for multi-label models")):
        out = tmp_path / f"out_{path.stem}_{len(extra)}"
        proc = run_cli("publish", "--ckpt_path", str(path), str(out), *extra, check=False)
        assert proc.returncode == 2 and expected in proc.stderr and len(proc.stderr.splitlines()) == 1, proc.stderr
        assert not out.exists()
    run_cli("publish", "--ckpt_path", str(multilabel), str(tmp_path / "ml"), "--threshold", "0.3")
    config = json.loads((tmp_path / "ml" / "config.json").read_text())
    assert (config["multilabel"], config["threshold"]) == (True, 0.3)


@contextmanager
def serving(model: Path, log: Path, *args: str):
    """`imgcls serve MODEL ARGS` on a free loopback port (served): (its URL once /health answers, its port)."""
    port = free_port()
    with served(log, port, str(model), "--port", str(port), *args) as url:
        yield url, port


@contextmanager
def served(log: Path, port: int, *args: str):
    """`imgcls serve ARGS`, answering on `port`, as a process of its own (forked by the preloaded server through its
    launcher) with the OpenMP wait left to imgcls: its URL once /health answers; its processes' environment holds
    the port as IMGCLS_TEST_SERVE; killed with its workers at the end."""
    env = {k: v for k, v in cli_env(IMGCLS_TEST_SERVE=str(port)).items() if k not in SPIN_SETTINGS}
    with open(log, "w") as out:
        proc = subprocess.Popen([concurrent_python(), "-m", "imgcls", "serve", *args], cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"imgcls serve exited {proc.returncode}: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"no health within 120 s: {log.read_text()[-3000:]}"
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(folder, tmp_path_factory):
    """`imgcls serve FOLDER` with batches of up to 8 requests and a 2 MB body limit."""
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with serving(folder, log, "--max_batch_size", "8", "--batch_timeout", "0.05", "--max_bytes", "2000000") as (url, _):
        yield url


def post(url: str, **kwargs) -> httpx.Response:
    return httpx.post(f"{url}/predict", timeout=60, **kwargs)


def test_serve_settings_printed_to_a_file_serve_from_it_alone(folder, images, tmp_path):
    """`imgcls serve FOLDER OPTIONS --print_config` writes a YAML from which `imgcls serve --config FILE` serves the
    same: the file's model on the file's port, with its batching and its top_k."""
    port = free_port()
    printed = run_cli("serve", str(folder), "--port", str(port), "--max_batch_size", "3", "--batch_timeout", "0.05",
                      "--top_k", "2", "--print_config").stdout
    settings = yaml.safe_load(printed)
    assert (settings["model"], settings["port"], settings["max_batch_size"], settings["batch_timeout"],
            settings["top_k"], settings["host"]) == (str(folder), port, 3, 0.05, 2, "127.0.0.1")
    (tmp_path / "serve.yaml").write_text(printed)
    image = next(p for p in sorted(images.iterdir()) if p.suffix == ".png")
    with served(tmp_path / "serve.log", port, "--config", str(tmp_path / "serve.yaml")) as url:
        answers = [post(url, content=image.read_bytes(), headers={"Content-Type": "image/png"}) for _ in range(2)]
    assert [a.status_code for a in answers] == [200, 200]
    assert [len(a.json()["predictions"][0]["top_k"]) for a in answers] == [2, 2]
    assert "max_batch_size 3, batch_timeout 0.05 s" in (tmp_path / "serve.log").read_text()


def test_served_labels_equal_predict_and_batches_form(server, folder, images, tmp_path):
    run_cli("predict", "--model.net.weights", str(folder), "--data.predict_dir", str(images), "--trainer.accelerator",
            "cpu", *SETTINGS, "--trainer.default_root_dir", str(tmp_path))
    expected = predictions(tmp_path)
    files = sorted(p for p in images.iterdir() if p.suffix in (".png", ".jpg"))
    kinds = {".png": "image/png", ".jpg": "image/jpeg"}

    def one(path: Path) -> httpx.Response:
        return post(server, content=path.read_bytes(), headers={"Content-Type": kinds[path.suffix]})

    with ThreadPoolExecutor(max_workers=10) as pool:  # 20 requests, 10 at a time
        answers = list(pool.map(one, files))
    assert [a.status_code for a in answers] == [200] * len(files)
    assert {p.name: a.json()["predictions"][0]["label"] for p, a in zip(files, answers, strict=True)} == expected
    assert max(int(a.headers["X-Imgcls-Batch"]) for a in answers) > 1  # requests shared forward passes

    multipart = post(server, files=[("a", files[0].read_bytes()), ("b", files[1].read_bytes())])
    assert [p["label"] for p in multipart.json()["predictions"]] == [expected[files[0].name], expected[files[1].name]]
    top = multipart.json()["predictions"][0]["top_k"]
    assert len(top) == 5 and top[0]["score"] >= top[-1]["score"]


def test_server_answers_bad_input_in_one_line_and_keeps_serving(server, images):
    png = next(images.glob("*.png")).read_bytes()
    jpeg = next(images.glob("*.jpg")).read_bytes()
    huge = io.BytesIO()
    Image.new("L", (7100, 7100)).save(huge, "PNG")  # 50 megapixels, a small file
    cases = {
        "not an image": (b"hello, not an image", "image/png", 422, "is not an image"),
        "truncated JPEG": (jpeg[:-100], "image/jpeg", 422, "truncated"),  # its header whole, its scan cut
        "empty body": (b"", "image/png", 400, "empty"),
        "50 megapixels": (huge.getvalue(), "image/png", 413, "50.4 megapixels"),
        "wrong content type": (png, "text/plain", 415, "text/plain"),
        "over the size limit": (b"\0" * 2_100_000, "application/octet-stream", 413, "--max_bytes"),
        "broken JSON": (b"{not json", "application/json", 422, "does not parse"),
    }
    for name, (body, kind, status, reason) in cases.items():
        answer = post(server, content=body, headers={"Content-Type": kind})
        assert answer.status_code == status, (name, answer.text)
        detail = answer.json()["detail"]
        assert reason in detail and "\n" not in detail, (name, detail)
        assert post(server, content=png, headers={"Content-Type": "image/png"}).status_code == 200, name


def inference_worker_environ(port: int) -> dict[str, str]:
    """The environment of the one LitServe inference worker (a process spawned by multiprocessing, a fresh
    interpreter) of the `serving` on `port`."""
    environs, mark = [], f"IMGCLS_TEST_SERVE={port}".encode()
    for entry in Path("/proc").iterdir():
        try:
            if b"multiprocessing.spawn" in (entry / "cmdline").read_bytes():
                environ = (entry / "environ").read_bytes()
                if mark in environ.split(b"\0"):
                    environs.append(environ)
        except OSError:  # not a process, or one that ended
            continue
    assert len(environs) == 1, f"{len(environs)} inference workers of the server on port {port}"
    return dict(item.split("=", 1) for item in environs[0].decode(errors="replace").split("\0") if "=" in item)


def test_inference_workers_never_hold_more_threads_than_the_cores():
    assert choose_workers("cpu", 2) == (1, 2, "1 worker(s) x 2 torch threads on 2 cores")
    assert choose_workers("cpu", 16)[:2] == (4, 4)
    assert choose_workers("cuda", 16, devices=1)[:2] == (2, 8)
    assert choose_workers("cuda", 16, devices=4)[:2] == (2, 2)  # 8 workers on 16 cores
    assert choose_workers("cuda", 4, devices=8)[:2] == (2, 1)


ANIMALS = ["bird", "cat", "dog", "fish", "horse"]


@pytest.fixture(scope="module")
def multilabel(tmp_path_factory) -> tuple[Path, list[Path], dict[str, torch.Tensor]]:
    """A random-weight multi-label TINY_ARCH at 32 px as a model folder (imgcls publish's layout), PNG and JPEG images
    of other sizes, and the sigmoid of the model's logits for each image, from the pixels `imgcls predict` reads
    (`read_image`) through the preprocessing of the model's input contract (`eval_pipeline`). The folder's threshold
    lies in the widest gap between those scores near their median: each side holds labels, none is within rounding."""
    from safetensors.torch import save_file

    from datamodules.decoding import read_image
    from datamodules.presets import ClassificationPresetEval
    from datamodules.transforms import contract_of, eval_pipeline
    from deploy.publish import model_config
    from training.records.saved_run import SavedRun

    root = tmp_path_factory.mktemp("multilabel_serve")
    torch.manual_seed(0)
    net = {"class_path": "lightning_modules.network.BackboneWithHead",
           "init_args": {"arch": TINY_ARCH, "head_hidden": 16}}
    contract = contract_of(ClassificationPresetEval(image_size=32))
    model = ImageClassifier(num_classes=len(ANIMALS), class_names=ANIMALS, multilabel=True, net=network_factory(net),
                            levers={"channels_last": False}, input_contract=contract).eval()
    files = []
    for i, (width, height) in enumerate([(40, 36), (48, 48), (33, 57), (64, 40)]):
        pixels = torch.randint(0, 256, (height, width, 3), generator=torch.Generator().manual_seed(i),
                               dtype=torch.uint8)
        path = root / f"image{i}.{'png' if i % 2 else 'jpg'}"
        Image.fromarray(pixels.numpy()).save(path, **({} if i % 2 else {"quality": 90}))
        files.append(path)
    preprocess = eval_pipeline(contract)
    with torch.inference_mode():
        batch = torch.stack([preprocess(read_image(str(path))) for path in files])
        scores = dict(zip([p.name for p in files], model(batch).sigmoid(), strict=True))
    ranked = torch.cat(list(scores.values())).sort().values
    middle = ranked[len(ranked) // 4: 3 * len(ranked) // 4 + 1]
    gap = int((middle[1:] - middle[:-1]).argmax())
    assert middle[gap + 1] - middle[gap] > 1e-3, ranked  # no score within rounding of the threshold
    threshold = round(float(middle[gap] + middle[gap + 1]) / 2, 6)

    folder = root / "model"
    folder.mkdir()
    saved = SavedRun(folder, {**dict(model.hparams), "net": net}, {}, 0, None, {})
    save_file({k: v.contiguous() for k, v in model.net.state_dict().items()}, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(model_config(saved, threshold, False), indent=2))
    return folder, files, scores


def test_served_multi_label_answers_list_the_sigmoid_scores_at_or_above_the_threshold(multilabel, tmp_path):
    folder, files, scores = multilabel
    threshold = json.loads((folder / "config.json").read_text())["threshold"]
    kinds = {".png": "image/png", ".jpg": "image/jpeg"}
    with serving(folder, tmp_path / "serve.log", "--max_batch_size", "4", "--batch_timeout", "0.05") as (url, port):
        with ThreadPoolExecutor(max_workers=len(files)) as pool:
            answers = list(pool.map(lambda p: post(url, content=p.read_bytes(),
                                                   headers={"Content-Type": kinds[p.suffix]}), files))
        multipart = post(url, files=[(p.stem, p.read_bytes()) for p in files])
        worker_settings = [inference_worker_environ(port).get(name) for name in SPIN_SETTINGS]
    assert worker_settings == ["PASSIVE", None]  # OpenMP threads sleep between regions (serve.passive_openmp)
    assert [a.status_code for a in answers] == [200] * len(files) and multipart.status_code == 200
    chosen = 0
    for path, answer, in_one in zip(files, answers, multipart.json()["predictions"], strict=True):
        (served,) = answer.json()["predictions"]
        assert [label["label"] for label in in_one["labels"]] == [label["label"] for label in served["labels"]]
        expected = scores[path.name]
        assert served["threshold"] == threshold
        above = [(name, float(p)) for name, p in zip(ANIMALS, expected, strict=True) if p >= threshold]
        assert [label["label"] for label in served["labels"]] == [name for name, _ in above], (path.name, served)
        for label, other, (_, p) in zip(served["labels"], in_one["labels"], above, strict=True):
            assert label["score"] == pytest.approx(p, abs=1e-5) and other["score"] == pytest.approx(p, abs=1e-5)
        top = {label["label"]: label["score"] for label in served["top_k"]}
        assert top.keys() == set(ANIMALS)  # --top_k 5 of 5 classes: every score
        assert all(top[name] == pytest.approx(float(p), abs=1e-5) for name, p in zip(ANIMALS, expected, strict=True))
        assert 1 <= int(answer.headers["X-Imgcls-Batch"]) <= len(files)
        chosen += len(above)
    assert 0 < chosen < len(files) * len(ANIMALS)  # labels on both sides of the threshold


WORKER = """
import json, sys
import torch
from deploy.serve import ImageClassifierAPI
api = ImageClassifierAPI(sys.argv[1], threshold=None, top_k=5, max_pixels=40_000_000, threads=1)
api.setup("cpu")  # what each inference worker runs once it has been spawned
x = torch.load(sys.argv[2], weights_only=True)
print(json.dumps({"heavy": sorted({"lightning", "torchmetrics"} & set(sys.modules)), "training": api.model.training,
                  "threshold": api.served.threshold, "logits": api.model(x).tolist()}))
"""


def test_an_inference_worker_builds_the_folders_network_without_importing_lightning(multilabel, tmp_path):
    """A worker spawned by `imgcls serve FOLDER` (a fresh interpreter, one per worker and device) imports neither
    Lightning nor torchmetrics (~2.5 s of a worker's start on 2 cores), and its network answers as the folder's
    ImageClassifier.from_pretrained does."""
    folder, _, _ = multilabel
    x = torch.rand(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    torch.save(x, tmp_path / "x.pt")
    out = subprocess.run([sys.executable, "-c", WORKER, str(folder), str(tmp_path / "x.pt")], cwd=ROOT, env=cli_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    worker = json.loads(out.stdout.strip().splitlines()[-1])
    model = ImageClassifier.from_pretrained(folder)
    assert worker["heavy"] == [] and worker["training"] is False
    assert worker["threshold"] == model.threshold == json.loads((folder / "config.json").read_text())["threshold"]
    with torch.inference_mode():
        assert torch.equal(torch.tensor(worker["logits"]), model(x))
