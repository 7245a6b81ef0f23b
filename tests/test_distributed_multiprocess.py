"""Multi-process runs of the real `imgcls fit` on gloo: 2-process DDP correctness, the 8-device production config,
two torchrun "nodes" with an elastic restart, a failing rank, and FSDP."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import yaml

from lightning_modules import ImageClassifier
from tests.helpers import CONFIGS, ROOT, TINY, cli_env, free_port, make_image_folder, run_cli

pytestmark = pytest.mark.slow

PROBE = "tests.distributed_probe.Probe"


def _probe_args(out: Path, **init_args) -> list[str]:
    args = [f"--trainer.callbacks+={PROBE}", f"--trainer.callbacks.out_dir={out}"]
    return args + [f"--trainer.callbacks.{k}={v}" for k, v in init_args.items()]


def _strategy_args(**init_args) -> list[str]:
    args = ["--trainer.strategy=training.strategy.CompressedDDPStrategy"]
    return args + [f"--trainer.strategy.{k}={v}" for k, v in init_args.items()]


def _records(out: Path, world: int) -> list[dict]:
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


def _run(cmd: list[str], timeout: float, env=None) -> subprocess.CompletedProcess:
    """Run a launcher in its own process group; on timeout kill the whole group (no stray ranks)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env or cli_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd[:6])} ... timed out after {timeout}s\n{out[-6000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """3 classes x 8 train images; 17 val images, so that 2 ranks hold 9 and 8 (3 and 2 batches of 4)."""
    root = tmp_path_factory.mktemp("ddp") / "images"
    make_image_folder(root, {"a": 8, "b": 8, "c": 8}, splits=("train",), size=32)
    make_image_folder(root, {"a": 6, "b": 6, "c": 5}, splits=("val",), size=32, seed=1)
    return root


def test_two_process_ddp_equals_one_process_on_the_concatenated_batch(tmp_path, folder):
    out = tmp_path / "probe"
    run_cli(
        "fit", "--config", str(CONFIGS / "quickstart.yaml"), *TINY, "--data.root", str(folder),
        "--data.batch_size", "4", "--trainer.devices", "2", "--trainer.precision", "32-true",
        "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "1", "--trainer.num_sanity_val_steps", "0",
        "--model.freeze_backbone_epochs", "1", "--model.dropout", "0", "--model.head_hidden", "0",
        "--trainer.default_root_dir", str(tmp_path / "run"),
        *_strategy_args(compression="none"), *_probe_args(out, perturb_nonzero_ranks="true"),
        env=cli_env(MASTER_PORT=str(free_port())), timeout=300,
    )
    r0, r1 = _records(out, 2)
    assert (r0["world_size"], r1["world_size"], r0["rank"], r1["rank"]) == (2, 2, 0, 1)
    # Rank 1's weights were perturbed before wrapping: DDP's broadcast from rank 0 undid it.
    assert r0["start_digest"] == r1["start_digest"]
    assert r0["end_digest"] == r1["end_digest"]
    # Each rank drew its own half of the shuffled training set (DistributedSampler), no overlap.
    assert not set(r0["sampler_indices"]) & set(r1["sampler_indices"])
    assert len(r0["sampler_indices"]) + len(r1["sampler_indices"]) == 24

    # lr scaled by the global batch: the quickstart's lr per 256 images x (2 ranks x 4) / 256 for the head groups.
    lr = yaml.safe_load((CONFIGS / "quickstart.yaml").read_text())["model"]["lr"]
    assert max(r0["lrs"]) == pytest.approx(lr * 8 / 256)

    # Gradients after DDP's all-reduce == one process on the two ranks' batches concatenated. BatchNorm must not
    # see per-rank batch statistics for this to hold: the frozen-backbone epoch keeps it on its running statistics
    # (SyncBatchNorm would too, but torch runs it on CUDA only). The backbone still gets gradients, at lr 0.
    model = ImageClassifier.load_from_checkpoint(tmp_path / "run" / "checkpoints" / "last.ckpt", map_location="cpu")
    model.load_state_dict(r0["initial_state"])  # the weights before the step
    model.train()
    for module in model.modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            module.eval()
    x = torch.cat([r0["batch"][0], r1["batch"][0]])  # (8, 3, 32, 32)
    y = torch.cat([r0["batch"][1], r1["batch"][1]])
    F.cross_entropy(model(x), y, label_smoothing=model.hparams.label_smoothing).backward()
    for name, param in model.named_parameters():
        torch.testing.assert_close(r0["grads"][name], param.grad, rtol=1e-4, atol=1e-6, msg=name)
        torch.testing.assert_close(r1["grads"][name], param.grad, rtol=1e-4, atol=1e-6, msg=name)

    # val/acc is global and exact: every val image counted once across the ranks, and both ranks log the same.
    preds = torch.cat([torch.cat(r["val_pred"], dim=1) for r in (r0, r1)], dim=1)  # (2, N)
    assert preds.shape[1] == 17
    assert [len(r["val_pred"]) for r in (r0, r1)] == [3, 2]  # uneven batch counts did not deadlock
    global_acc = float((preds[0] == preds[1]).float().mean())
    assert r0["val"][-1] == r1["val"][-1] == pytest.approx(global_acc, abs=1e-6)


def test_powersgd_every_rank_hooked_and_state_in_checkpoint(tmp_path, folder):
    out = tmp_path / "probe"
    common = [
        "fit", "--config", str(CONFIGS / "quickstart.yaml"), *TINY, "--data.root", str(folder),
        "--data.batch_size", "4", "--trainer.devices", "2", "--trainer.limit_train_batches", "3",
        "--trainer.limit_val_batches", "1", "--trainer.num_sanity_val_steps", "0",
        "--trainer.default_root_dir", str(tmp_path / "run"),
        *_strategy_args(compression="powersgd", powersgd_start_iter=2), *_probe_args(out),
    ]
    run_cli(*common, "--trainer.max_epochs", "1", env=cli_env(MASTER_PORT=str(free_port())), timeout=300)
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    saved = ckpt["powersgd_state"]
    assert saved["world_size"] == 2 and [s["iter"] for s in saved["ranks"]] == [3, 3]
    name = next(iter(saved["ranks"][0]["error"]))
    assert not torch.equal(saved["ranks"][0]["error"][name], saved["ranks"][1]["error"][name])  # rank-local memory
    run_cli(*common, "--trainer.max_epochs", "2", "--ckpt_path", "last",
            env=cli_env(MASTER_PORT=str(free_port())), timeout=300)
    records = _records(out, 2)
    assert [r["comm_hook"] for r in records] == ["resumable_powerSGD_hook"] * 2
    assert [r["start_step"] for r in records] == [3, 3]
    assert [r["powersgd"]["iter"] for r in records] == [6, 6]
    assert records[0]["end_digest"] == records[1]["end_digest"]


def test_production_config_runs_on_eight_cpu_processes(tmp_path):
    root = make_image_folder(tmp_path / "images", {"a": 16, "b": 16}, splits=("train",), size=32)
    make_image_folder(root, {"a": 8, "b": 8}, splits=("val",), size=32, seed=1)
    out = tmp_path / "probe"
    proc = run_cli(
        "fit", "--config", str(CONFIGS / "imagenet_ddp8.yaml"), "--trainer.accelerator", "cpu",
        # torch.compile stays off: 8 inductor compilations cost minutes on 2 cores, and the compiled path of this
        # config is run once, in one process, by tests/test_cli.py::test_production_config_runs_one_batch_on_cpu.
        "--data.root", str(root), "--model.weights", "null", "--model.compile", "false",
        "--model.arch", "resnet18", "--model.head_hidden", "16",
        "--data.image_size", "32", "--data.batch_size", "2", "--data.num_workers", "0",
        "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1",
        "--trainer.num_sanity_val_steps", "0", "--trainer.enable_model_summary", "false",
        "--trainer.default_root_dir", str(tmp_path / "run"), *_probe_args(out),
        env=cli_env(MASTER_PORT=str(free_port())), timeout=420,
    )
    assert "bf16-mixed" in proc.stdout + proc.stderr  # Lightning's fallback warning for 16-mixed on CPU
    records = _records(out, 8)
    assert sorted(r["rank"] for r in records) == list(range(8))
    assert {r["world_size"] for r in records} == {8}
    assert {r["comm_hook"] for r in records} == {"fp16_compress_hook"}
    shards = [set(r["sampler_indices"]) for r in records]
    assert sum(len(s) for s in shards) == 32 and len(set().union(*shards)) == 32  # disjoint, covering
    assert len({r["end_digest"] for r in records}) == 1
    writes = [json.loads(line) for line in (out / "checkpoint_writes.jsonl").read_text().splitlines()]
    assert writes and {w["rank"] for w in writes} == {0}
    assert len({w["path"] for w in writes}) == len(writes)  # each file written once
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").is_file()


def test_one_failing_rank_fails_the_job_quickly_with_its_error(tmp_path, folder):
    start = time.monotonic()
    proc = run_cli(
        "fit", "--config", str(CONFIGS / "quickstart.yaml"), *TINY, "--data.root", str(folder),
        "--data.batch_size", "4", "--trainer.devices", "2", "--trainer.max_epochs", "1",
        "--trainer.num_sanity_val_steps", "0", "--trainer.default_root_dir", str(tmp_path / "run"),
        *_strategy_args(compression="fp16", timeout_s=120), *_probe_args(tmp_path / "probe", fail_rank=1, fail_step=1),
        env=cli_env(MASTER_PORT=str(free_port())), timeout=300, check=False,
    )
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    assert "probe: injected failure on rank 1" in proc.stdout + proc.stderr
    assert elapsed < 100, f"the job took {elapsed:.0f}s to notice a dead rank"


def test_torchrun_two_nodes_with_elastic_restart_resume(tmp_path, folder):
    port = free_port()
    out = tmp_path / "probe"
    fit = [
        "fit", "--config", str(CONFIGS / "quickstart.yaml"), *TINY, "--data.root", str(folder),
        "--data.batch_size", "2", "--trainer.devices", "2", "--trainer.num_nodes", "2",  # 6 images per rank
        "--trainer.max_epochs", "2", "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1",
        "--trainer.num_sanity_val_steps", "0", "--trainer.default_root_dir", str(tmp_path / "run"),
        *_strategy_args(compression="fp16", timeout_s=120),
        # Rank 3 (node 1) dies at step 3, after epoch 0's last.ckpt: torchrun restarts every worker once.
        *_probe_args(out, fail_rank=3, fail_step=3), "--ckpt_path", "last",
    ]
    nodes = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "imgcls-test",
             "--max-restarts", "3", "--monitor-interval", "1", "-m", "training.cli", *fit],
            # A fresh TCPStore per restart round (see docs/DISTRIBUTED.md): with the shared agent store, restarted
            # workers read the dead workers' gloo addresses left from the previous round.
            cwd=ROOT, env=cli_env(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1"), stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )
        for _ in range(2)
    ]
    outputs = []
    try:
        for node in nodes:
            outputs.append(node.communicate(timeout=480)[0])
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
                node.communicate()
    log = "\n".join(outputs)
    assert [n.returncode for n in nodes] == [0, 0], "\n\n".join(f"node {i}:\n{o[-5000:]}" for i, o in enumerate(outputs))
    assert (out / "failed_once").exists() and "probe: injected failure on rank 3" in log
    records = _records(out, 4)
    assert [r["world_size"] for r in records] == [4] * 4
    assert [r["start_step"] for r in records] == [2] * 4  # the restarted workers resumed from last.ckpt
    assert [r["end_step"] for r in records] == [4] * 4
    assert len({r["end_digest"] for r in records}) == 1
