"""Multi-process runs on gloo: 2-process DDP correctness, post-local SGD, the 8-device production config, two
torchrun "nodes" with an elastic restart, and a failing rank."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
import torchvision
import yaml
from torch.utils.data import DataLoader, TensorDataset
from torchvision.models import ResNet50_Weights

from core import hardware
from lightning_modules import ImageClassifier
from tests.distributed_probe import Probe
from tests.helpers import (
    CONFIGS,
    FREEZE_FIRST_EPOCH,
    ROOT,
    TINY,
    cli_env,
    concurrent_python,
    free_port,
    join_ranks,
    kill_args,
    make_image_folder,
    run_cli,
    start_ranks,
    torchrun,
)
from training.distributed.strategy import CompressedDDPStrategy

pytestmark = pytest.mark.slow

PROBE = "tests.distributed_probe.Probe"


def _probe_args(out: Path, **init_args) -> list[str]:
    args = [f"--trainer.callbacks+={PROBE}", f"--trainer.callbacks.out_dir={out}"]
    return args + [f"--trainer.callbacks.{k}={v}" for k, v in init_args.items()]


def _strategy_args(**init_args) -> list[str]:
    args = ["--trainer.strategy=training.distributed.strategy.CompressedDDPStrategy"]
    return args + [f"--trainer.strategy.{k}={v}" for k, v in init_args.items()]


def _records(out: Path, world: int) -> list[dict]:
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]


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
        *FREEZE_FIRST_EPOCH, "--model.net.dropout", "0", "--model.net.head_hidden", "0",
        "--trainer.default_root_dir", str(tmp_path / "run"),
        *_strategy_args(compression="none"), *_probe_args(out, perturb_nonzero_ranks="true", record_tensors="true"),
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
    lr = yaml.safe_load((CONFIGS / "quickstart.yaml").read_text())["model"]["optimizer"]["init_args"]["lr"]
    assert max(r0["lrs"]) == pytest.approx(lr * 8 / 256)

    # Gradients after DDP's all-reduce == one process on the two ranks' batches concatenated. BatchNorm must not
    # see per-rank batch statistics for this to hold: the frozen-backbone epoch keeps it on its running statistics
    # (SyncBatchNorm would too, but torch runs it on CUDA only). The frozen backbone gets no gradient at all.
    model = ImageClassifier.load_from_checkpoint(tmp_path / "run" / "checkpoints" / "last.ckpt", map_location="cpu")
    model.load_state_dict(r0["initial_state"])  # the weights before the step
    head = {name for name, _ in model.named_parameters() if name.startswith("net.head.")}
    assert set(r0["grads"]) == set(r1["grads"]) == head
    model.train()
    for module in model.modules():
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            module.eval()
    x = torch.cat([r0["batch"][0], r1["batch"][0]])  # (8, 3, 32, 32)
    y = torch.cat([r0["batch"][1], r1["batch"][1]])
    model.loss(model(x), y).backward()  # the run's own loss (configs/quickstart.yaml: smoothed CE)
    for name, param in model.named_parameters():
        if name not in head:
            continue
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
        *_strategy_args(compression="powersgd", **{"powersgd.start_iter": 2}), *_probe_args(out),
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


class _TwoClassLinear(L.LightningModule):
    """8 features -> 2 logits: post-local SGD's bookkeeping needs no more than a model with parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


LOCAL_SGD_START, LOCAL_SGD_PERIOD, LOCAL_SGD_STEPS = 2, 3, 8


def _post_local_sgd_rank(local_rank: int, port: int, out: str) -> None:
    """One of two ranks started by torch.multiprocessing: Lightning reads LOCAL_RANK as an external launch."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(local_rank), NODE_RANK="0")
    torch.set_num_threads(1)
    L.seed_everything(0)
    x = torch.randn(16 * LOCAL_SGD_STEPS, 8)  # (N, 8): 8 batches of 8 per rank once the sampler halves it
    data = DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=8, shuffle=True)
    strategy = CompressedDDPStrategy(post_local_sgd={"period": LOCAL_SGD_PERIOD, "start_iter": LOCAL_SGD_START,
                                                     "group_size": 1}, timeout_s=60)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=LOCAL_SGD_STEPS, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Probe(out, digest_every_step=True)])
    trainer.fit(_TwoClassLinear(), data)


def test_post_local_sgd_ranks_drift_apart_between_averagings_and_agree_after_each(tmp_path):
    out = tmp_path / "probe"
    ranks = start_ranks(_post_local_sgd_rank, (free_port(), str(out)), 2)
    join_ranks(ranks, 120, "the 2 post-local SGD ranks")  # a rank's exception is raised here
    r0, r1 = _records(out, 2)
    assert r0["comm_hook"] == r1["comm_hook"] == "post_localSGD_hook"
    same = [a == b for a, b in zip(r0["step_digests"], r1["step_digests"], strict=True)]
    # Before the start iteration gradients are all-reduced globally: the ranks step alike. From it on each rank
    # (a group of 1) steps on its own shard's gradients, and the periodic averager equalises the models at steps
    # start, start + k, start + 2k, ... (0-based, after the optimizer step).
    assert same == [i < LOCAL_SGD_START or (i - LOCAL_SGD_START) % LOCAL_SGD_PERIOD == 0
                    for i in range(LOCAL_SGD_STEPS)]


def test_production_config_runs_on_eight_cpu_processes(tmp_path):
    root = make_image_folder(tmp_path / "images", {"a": 16, "b": 16}, splits=("train",), size=32)
    make_image_folder(root, {"a": 8, "b": 8}, splits=("val",), size=32, seed=1)
    # The config's IMAGENET1K_V2 weights, offline: a stand-in file where torchvision looks before downloading.
    hub = tmp_path / "torch" / "hub" / "checkpoints"
    hub.mkdir(parents=True)
    torch.save(torchvision.models.resnet50().state_dict(), hub / Path(ResNet50_Weights.IMAGENET1K_V2.url).name)
    out = tmp_path / "probe"
    proc = run_cli(
        "fit", "--config", str(CONFIGS / "imagenet_ddp8.yaml"), "--trainer.accelerator", "cpu",
        "--data.root", str(root), "--trainer.default_root_dir", str(tmp_path / "run"),
        # 8 inductor compilations cost ~200 s on 2 cores; the compiled path of this config is run once, in one
        # process, by tests/test_cli.py::test_production_config_runs_one_batch_on_cpu.
        "--model.levers.compile", "false",
        # The config's 64 images of 224 px per rank: 512 ResNet50 passes per step on 2 cores and GBs of activations
        # per process. With 2 the 8 processes and their loader workers peak at ~9 GB (PSS) in all. At 64 px, as
        # test_cli.py's one-process run of this config, each pass costs a twelfth of one at 224 px.
        "--data.batch_size", "2", "--data.image_size", "64",
        # A few steps: two per rank, then one validation batch.
        "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1",
        *_probe_args(out),
        env=cli_env(MASTER_PORT=str(free_port()), TORCH_HOME=str(tmp_path / "torch")), timeout=540,
    )
    records = _records(out, 8)
    # precision: auto is chosen from this CPU, announced once (rank 0), and every rank trains under it: bf16
    # autocast on a CPU with native bf16, fp32 on any other.
    expected, why = hardware.choose_precision(hardware.detect(), "cpu")
    assert (proc.stdout + proc.stderr).count(f"precision: {expected} ({why})") == 1
    autocast = {"bf16-mixed": ("torch.bfloat16", "torch.bfloat16"), "32-true": (None, "torch.float32")}[expected]
    assert {(r["precision"], r["autocast"], r["logits_dtype"]) for r in records} == {(expected, *autocast)}
    assert sorted(r["rank"] for r in records) == list(range(8))
    assert {r["world_size"] for r in records} == {8}
    assert {r["comm_hook"] for r in records} == {"fp16_compress_hook"}
    shards = [set(r["sampler_indices"]) for r in records]
    assert sum(len(s) for s in shards) == 32 and len(set().union(*shards)) == 32  # disjoint, covering
    assert len({r["end_digest"] for r in records}) == 1
    assert records[0]["end_digest"] != records[0]["start_digest"]  # the step changed the weights
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
        # fp32: under bf16 autocast TINY_ARCH's BatchNorm over 2 images of one pixel (its last stage) can overflow
        "--trainer.precision", "32-true", *_strategy_args(compression="fp16", timeout_s=120),
        # Rank 3 (node 1) dies at step 3, after epoch 0's last.ckpt: torchrun restarts every worker once.
        *_probe_args(out, fail_rank=3, fail_step=3), "--ckpt_path", "last",
        # The backbone thaws at epoch 1, where the restarted workers resume: DDP must be wrapped again to all-reduce
        # its gradients, or the 4 ranks' weights part (the equal digests below).
        *FREEZE_FIRST_EPOCH,
    ]
    nodes = [
        subprocess.Popen(
            [*torchrun("--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                       "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "imgcls-test", "--max-restarts", "3",
                       "--monitor-interval", "1"), *fit],
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
    assert [n.returncode for n in nodes] == [0, 0], "\n\n".join(f"node {i}:\n{o[-5000:]}"
                                                                for i, o in enumerate(outputs))
    assert (out / "failed_once").exists() and "probe: injected failure on rank 3" in log
    records = _records(out, 4)
    assert [r["world_size"] for r in records] == [4] * 4
    assert [r["start_step"] for r in records] == [2] * 4  # the restarted workers resumed from last.ckpt
    assert [r["end_step"] for r in records] == [4] * 4
    assert len({r["end_digest"] for r in records}) == 1


def test_resume_on_another_world_size_rescales_the_learning_rate(tmp_path, folder):
    """Elastic restarts inside an epoch, 2 -> 1 -> 2 processes: each run is preempted mid-epoch (SIGTERM), and the
    next resumes on the other world size. The learning rates follow the global batch (halved, then doubled), and the
    epoch in progress restarts on the new shards, with one line saying how many samples are drawn again."""
    run = tmp_path / "run"
    common = ["fit", "--config", str(CONFIGS / "quickstart.yaml"), *TINY, "--data.root", str(folder),
              "--data.batch_size", "4", "--trainer.precision", "32-true", "--trainer.limit_train_batches", "4",
              "--trainer.limit_val_batches", "1", "--trainer.num_sanity_val_steps", "0", "--trainer.max_epochs", "2",
              "--trainer.default_root_dir", str(run), "--trainer.enable_progress_bar", "false"]
    preempted = run / "checkpoints" / "preempted.ckpt"

    def preempt_at(step: int) -> list[str]:
        return [*kill_args(step, "train"), "--trainer.callbacks.sig", str(int(signal.SIGTERM))]

    # 2 processes (3 batches of 4 per rank and epoch): SIGTERM after step 1; the ranks agree a step later and save at
    # step 2, 2 batches x 2 ranks x 4 images into epoch 0.
    first = run_cli(*common, "--trainer.devices", "2", *preempt_at(1), check=False,
                    env=cli_env(MASTER_PORT=str(free_port())), timeout=300)
    assert first.returncode == 128 + signal.SIGTERM, first.stderr[-3000:]
    two = torch.load(preempted, weights_only=True, map_location="cpu")
    assert (two["global_step"], two["epoch"]) == (2, 0)
    # 1 process (4 batches per epoch): epoch 0 restarts (16 samples drawn again); preempted after its first batch.
    one = run_cli(*common, "--trainer.devices", "1", "--ckpt_path", "last", *preempt_at(3), check=False,
                  env=cli_env(), timeout=300)
    out = one.stdout + one.stderr
    assert one.returncode == 128 + signal.SIGTERM, out[-3000:]
    assert "learning rates rescaled x0.5 (linear scaling" in out
    # The run's length: the 2 steps taken, epoch 0 again and epoch 1 (4 steps each): 10 (Lightning's estimate, 8,
    # would end the cosine at step 8 and train the last steps at lr 0).
    assert "lr schedule: 6 -> 10 optimizer steps; the cosine follows the new length from step 2" in out
    assert ("resuming on 1 processes, saved on 2 inside epoch 0, which restarts from its first batch on the new "
            "shards: the 16 samples it had drawn before the checkpoint are drawn again, none is skipped") in out
    resumed = torch.load(preempted, weights_only=True, map_location="cpu")
    assert (resumed["global_step"], resumed["epoch"]) == (3, 0)
    assert resumed["lr_scale"] == pytest.approx(two["lr_scale"] / 2)
    initial = [g["initial_lr"] for g in resumed["optimizer_states"][0]["param_groups"]]
    assert initial == pytest.approx([g["initial_lr"] / 2 for g in two["optimizer_states"][0]["param_groups"]])
    # 2 processes again: epoch 0 restarts (4 samples drawn again) and runs its 3 batches, then epoch 1: step 9.
    back = run_cli(*common, "--trainer.devices", "2", "--ckpt_path", "last",
                   env=cli_env(MASTER_PORT=str(free_port())), timeout=300)
    out = back.stdout + back.stderr
    assert "learning rates rescaled x2 (linear scaling" in out
    assert "lr schedule: 10 -> 9 optimizer steps; the cosine follows the new length from step 3" in out  # 3 + 2 x 3
    assert "saved on 1 inside epoch 0, which restarts from its first batch on the new shards: the 4 samples" in out
    final = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")
    assert (final["global_step"], final["epoch"]) == (3 + 3 + 3, 1)
    assert final["lr_plan"] == {"total_steps": 9}  # planned to end at the step the run ended at
    assert final["lr_schedulers"][0]["_last_lr"] == [0.0] * 4  # the schedule's end, though the length changed twice


def test_a_dataset_smaller_than_a_batch_per_process_still_trains(tmp_path):
    """10 training images, batch 8, 2 processes: 5 per process. drop_last decided on the whole dataset (10 > 8) left
    every process without a single batch, and the run trained nothing without a word."""
    root = make_image_folder(tmp_path / "images", {"a": 5, "b": 5}, splits=("train",), size=32)
    make_image_folder(root, {"a": 2, "b": 2}, splits=("val",), size=32, seed=1)
    run = tmp_path / "run"
    proc = run_cli("fit", "--config", str(CONFIGS / "quickstart.yaml"), *TINY, "--data.root", str(root),
                   "--data.batch_size", "8", "--trainer.devices", "2", "--trainer.max_epochs", "2",
                   "--trainer.precision", "32-true", "--trainer.default_root_dir", str(run),
                   "--trainer.enable_progress_bar", "false", env=cli_env(MASTER_PORT=str(free_port())), timeout=300)
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")["global_step"] == 2
    assert "10 training images over 2 process(es) give 5 per process, fewer than data.batch_size=8" in \
        proc.stdout + proc.stderr


def test_two_process_powersgd_fit_ends_its_process_groups_and_exits_0(tmp_path):
    """Issue 22: a 2-process PowerSGD fit trained, saved and printed its summary, and then, now and then, a rank died
    of "terminate called without an active exception" (SIGABRT): a gloo worker thread was still releasing the last
    collective (after_fit's broadcast) when the interpreter shut down. Before the process groups were destroyed at
    the end of the run (training.distributed.strategy.destroy_process_groups), this setup hit it in about 1 run in 2.

    The race needs no repeats to be ruled out: a probe (GroupsAtExit) records, as each rank's interpreter exits,
    that torch.distributed is no longer initialised and that none of its threads (gloo's, the store's) lives on.
    And the issue's command exits 0 without the abort: the production config's strategy with PowerSGD, 3 steps,
    which end the fit inside its first epoch (5 batches a rank), so that no validation stands between that broadcast
    and the exit. Started with pipes (its ranks forked by the preloaded server through its launcher, each exiting
    as a fresh one does: imgcls.startup.run), not by run_cli, whose output files are read when rank 0
    exits: the output then holds rank 1's to its end, and the exit code is rank 0's, a scheduler's."""
    root = make_image_folder(tmp_path / "images", {str(c): 16 for c in range(10)}, splits=("train",), size=32)
    make_image_folder(root, {str(c): 2 for c in range(10)}, splits=("val",), size=32, seed=1)
    run, out = tmp_path / "run", tmp_path / "probe"
    args = [concurrent_python(), "-m", "imgcls", "fit", "--config", str(CONFIGS / "imagenet_ddp8.yaml"), *TINY,
            "--model.net.weights", "null", "--data.root", str(root), "--trainer.devices", "2",
            "--trainer.strategy.init_args.compression", "powersgd", "--trainer.max_steps", "3",
            "--trainer.num_sanity_val_steps", "0", "--trainer.enable_progress_bar", "false",
            "--trainer.callbacks+=tests.distributed_probe.GroupsAtExit", f"--trainer.callbacks.out_dir={out}",
            "--trainer.default_root_dir", str(run)]
    proc = subprocess.Popen(args, cwd=ROOT, env=cli_env(MASTER_PORT=str(free_port())), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=300)  # until every rank has closed the pipes: rank 1's end too
    except BaseException:  # the timeout, or pytest-timeout / Ctrl-C: no rank left behind
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        raise
    output = stdout + stderr
    assert proc.returncode == 0 and "terminate called" not in output, f"exited {proc.returncode}\n{output[-6000:]}"
    assert "last checkpoint" in output and (run / "checkpoints" / "last.ckpt").is_file()
    at_exit = [json.loads((out / f"exit_rank{rank}.json").read_text()) for rank in range(2)]
    assert at_exit == [{"initialized": False, "distributed_threads": []}] * 2, at_exit


def test_the_ranks_of_a_ddp_fit_hold_its_run_folder_once(tmp_path, folder):
    """Only global rank 0 takes the hold: rank 1 (started by Lightning's launcher with the same command) finds the
    lock held by rank 0 and the lease naming rank 0's process, and the job runs."""
    out, run = tmp_path / "probe", tmp_path / "run"
    run_cli("fit", "--config", str(CONFIGS / "quickstart.yaml"), *TINY, "--data.root", str(folder),
            "--data.batch_size", "4", "--trainer.devices", "2", "--trainer.strategy", "ddp",
            "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1",
            "--trainer.default_root_dir", str(run), "--trainer.callbacks+=tests.fault_injection.HoldProbe",
            "--trainer.callbacks.out", str(out), env=cli_env(MASTER_PORT=str(free_port())), timeout=300)
    rank0, rank1 = (json.loads((out / f"hold.rank{r}.json").read_text()) for r in (0, 1))
    assert rank0["pid"] != rank1["pid"]
    assert rank1["lease"]["pid"] == rank0["pid"] and rank1["locked_by_another"]
