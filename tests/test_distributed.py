"""Fast tests of CompressedDDPStrategy in one process (a world of one gloo rank): YAML, hooks, bytes, PowerSGD
resume."""

from __future__ import annotations

from functools import partial

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint

from benchmarks.distributed import _train_step, count_allreduce_bytes, expected_allreduce_bytes, wrap_ddp
from datamodules import ImageFolderDataModule
from lightning_modules import BackboneWithHead, ImageClassifier
from tests.distributed_probe import Probe
from tests.helpers import CONFIGS, TINY_ARCH, free_port, make_image_folder, run_cli
from training.distributed.strategy import POWERSGD_KEY, CompressedDDPStrategy, ResumablePowerSGDHook


@pytest.fixture
def images(tmp_path):
    return make_image_folder(tmp_path / "images", {"a": 6, "b": 6}, size=32)


@pytest.fixture
def master_port(monkeypatch):
    """A fresh rendezvous port for the one-rank process group of each test."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def _fit(images, tmp_path, strategy, max_steps: int, ckpt_path=None, name="run") -> Probe:
    """Fit a tiny TINY_ARCH with `strategy` in this process; the Probe holds what happened."""
    L.seed_everything(0)
    data = ImageFolderDataModule(str(images), batch_size=4, num_workers=0, image_size=32, preset="none")
    model = ImageClassifier(num_classes=2, net=partial(BackboneWithHead, arch=TINY_ARCH, head_hidden=0, dropout=0.0),
                            optimizer=partial(torch.optim.SGD, lr=0.4, momentum=0.9, nesterov=True, weight_decay=1e-4))
    probe = Probe(str(tmp_path / name / "probe"))
    trainer = L.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, max_steps=max_steps, max_epochs=-1, logger=False,
        default_root_dir=str(tmp_path / name), enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, callbacks=[probe, ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), save_last=True,
                                                                every_n_train_steps=max_steps)],
    )
    trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    probe.trainer = trainer
    return probe


def _strategy_from_yaml(text: str):
    """Instantiate `trainer.strategy` from YAML as LightningCLI does (jsonargparse, class_path + init_args)."""
    import yaml
    from jsonargparse import ArgumentParser
    from lightning.pytorch.strategies import Strategy

    parser = ArgumentParser()
    parser.add_subclass_arguments(Strategy, "strategy")
    config = yaml.safe_load(text)["trainer"]["strategy"]
    return parser.instantiate_classes(parser.parse_object({"strategy": config})).strategy


def test_strategy_is_configurable_from_yaml():
    strategy = _strategy_from_yaml(
        "trainer:\n"
        "  strategy:\n"
        "    class_path: training.distributed.strategy.CompressedDDPStrategy\n"
        "    init_args: {compression: powersgd, powersgd: {rank: 2, start_iter: 5}, bucket_cap_mb: 8,\n"
        "                static_graph: true, post_local_sgd: null}\n"
    )
    assert isinstance(strategy, CompressedDDPStrategy)
    assert strategy.compression == "powersgd"
    assert strategy.powersgd_kwargs["rank"] == 2 and strategy.powersgd_kwargs["start_iter"] == 5
    assert strategy._ddp_kwargs == {"bucket_cap_mb": 8.0, "gradient_as_bucket_view": True, "static_graph": True,
                                    "find_unused_parameters": False}
    production = _strategy_from_yaml((CONFIGS / "imagenet_ddp8.yaml").read_text())
    assert isinstance(production, CompressedDDPStrategy) and production.compression == "fp16"
    assert production._ddp_kwargs["static_graph"] and not production._ddp_kwargs["find_unused_parameters"]


def test_bad_settings_name_the_key():
    with pytest.raises(ValueError, match="compression='int8'.*none, fp16, bf16, powersgd"):
        CompressedDDPStrategy(compression="int8")
    with pytest.raises(ValueError, match="post_local_sgd cannot be combined with compression=powersgd"):
        CompressedDDPStrategy(compression="powersgd", post_local_sgd={"period": 4})


@pytest.mark.parametrize("compression, hook", [
    ("none", None), ("fp16", "fp16_compress_hook"), ("bf16", "bf16_compress_hook"),
    ("powersgd", "resumable_powerSGD_hook"),
])
def test_comm_hook_is_registered_on_cpu(tmp_path, images, master_port, compression, hook):
    # Lightning's own DDPStrategy would leave every one of these unregistered on CPU.
    probe = _fit(images, tmp_path, CompressedDDPStrategy(compression=compression, powersgd={"start_iter": 2}), 3)
    assert probe.record["comm_hook"] == hook  # DDP's logging data: "" / None without a hook
    assert probe.record["end_step"] == 3


def test_post_local_sgd_averages_models(tmp_path, images, master_port):
    strategy = CompressedDDPStrategy(post_local_sgd={"period": 2, "start_iter": 1, "group_size": 1})
    probe = _fit(images, tmp_path, strategy, 3)
    assert probe.record["comm_hook"] == "post_localSGD_hook"
    assert probe.record["model_averaging_period"] == 2  # the strategy's averager, as training ended
    # Let go of at teardown: they hold process groups, which the end of a run destroys (destroy_process_groups).
    assert probe.trainer.strategy.model_averager is None and probe.trainer.strategy.comm_state is None


def test_allreduce_bytes_per_step_match_parameter_shapes(master_port):
    """ResNet50 + the seed's 1024 head: fp16/bf16 move half of fp32, PowerSGD rank 4 under 5%."""
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    measured, expected = {}, {}
    for compression in ("none", "fp16", "bf16", "powersgd"):
        net = BackboneWithHead(10, arch="resnet50", dropout=0.0)
        ddp, _ = wrap_ddp(net, compression, count=True, powersgd_start_iter=2)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
        for _ in range(3):  # buckets rebuilt after step 1; PowerSGD compresses from step 3
            _train_step(ddp, optimizer, batch=2, size=32, classes=10)
        with count_allreduce_bytes() as counted:
            _train_step(ddp, optimizer, batch=2, size=32, classes=10)
        measured[compression], expected[compression] = counted["bytes"], expected_allreduce_bytes(net, compression)
    n_params = sum(p.numel() for p in BackboneWithHead(10, arch="resnet50", dropout=0.0).parameters())
    assert expected["none"] == 4 * n_params
    assert measured == expected
    assert measured["fp16"] == measured["bf16"] == measured["none"] // 2
    assert measured["powersgd"] <= 0.05 * measured["none"]


def test_powersgd_state_survives_checkpoint_and_resume(tmp_path, images, master_port, monkeypatch):
    first = _fit(images, tmp_path, CompressedDDPStrategy(compression="powersgd", powersgd={"start_iter": 2}), 4,
                 name="a")
    saved = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)[POWERSGD_KEY]
    assert saved["world_size"] == 1
    state = saved["ranks"][0]
    assert state["iter"] == 4
    errors = state["error"]
    assert set(errors) == {n for n, p in first.trainer.lightning_module.named_parameters()}
    assert sum(float(e.abs().sum()) for e in errors.values()) > 0  # a real residual, not zeros

    # Resume: the restored per-parameter memory is what PowerSGD adds to the first resumed step's gradients.
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
    seen = {}
    original = powersgd.powerSGD_hook

    def spy(state, bucket):
        if state.iter == 4 and bucket.index() not in seen:  # first resumed step: the memory it starts from
            seen[bucket.index()] = ([p for p in bucket.parameters()], state.error_dict[bucket.index()].clone())
        return original(state, bucket)

    monkeypatch.setattr(powersgd, "powerSGD_hook", spy)
    strategy = CompressedDDPStrategy(compression="powersgd", powersgd={"start_iter": 2})
    resumed = _fit(images, tmp_path, strategy, 6, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"), name="b")
    assert resumed.record["start_step"] == 4
    assert resumed.record["powersgd"]["iter"] == 6
    names = {id(p): n for n, p in resumed.trainer.lightning_module.named_parameters()}
    assert seen
    for params, error in seen.values():
        expected = torch.cat([errors[names[id(p)]] for p in params])
        torch.testing.assert_close(error, expected)


class _Bucket:
    """The part of dist.GradBucket that the hook reads."""

    def __init__(self, index: int, params: list[torch.nn.Parameter]) -> None:
        self._index, self._params = index, params
        self._buffer = torch.cat([p.detach().flatten() for p in params])

    def index(self) -> int:
        return self._index

    def parameters(self) -> list[torch.nn.Parameter]:
        return self._params

    def buffer(self) -> torch.Tensor:
        return self._buffer


def test_powersgd_error_memory_follows_parameters_when_buckets_change(monkeypatch):
    """DDP re-buckets after a resume's first step: each parameter's error must land in its new bucket's slot."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
    params = {name: torch.nn.Parameter(torch.randn(shape)) for name, shape in
              [("w1", (4, 3)), ("b1", (4,)), ("w2", (2, 4)), ("b2", (2,))]}
    hook = ResumablePowerSGDHook({id(p): n for n, p in params.items()})
    state = powersgd.PowerSGDState(process_group=None, start_powerSGD_iter=2)
    seen = {}

    def fake_powersgd(st, bucket):  # records the memory it is given, leaves a residual 10 x (index + 1) larger
        index = bucket.index()
        seen[index] = st.error_dict[index].clone()
        st.error_dict[index] = st.error_dict[index] + 10 * (index + 1)
        future = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    monkeypatch.setattr(powersgd, "powerSGD_hook", fake_powersgd)
    errors = {n: torch.full((p.numel(),), float(i)) for i, (n, p) in enumerate(params.items())}
    hook.load_state_dict(state, {"iter": 5, "error": errors})
    # Layout A: two buckets in reverse order; then layout B: everything in one bucket, another order.
    hook(state, _Bucket(0, [params["b2"], params["w2"]])).wait()
    hook(state, _Bucket(1, [params["b1"], params["w1"]])).wait()
    torch.testing.assert_close(seen[0], torch.cat([errors["b2"], errors["w2"]]))
    torch.testing.assert_close(seen[1], torch.cat([errors["b1"], errors["w1"]]))
    hook(state, _Bucket(0, [params["w1"], params["w2"], params["b1"], params["b2"]])).wait()
    torch.testing.assert_close(seen[0], torch.cat([errors["w1"] + 20, errors["w2"] + 10, errors["b1"] + 20,
                                                   errors["b2"] + 10]))
    saved = hook.state_dict(state)
    assert saved["iter"] == 5 and set(saved["error"]) == set(params)
    torch.testing.assert_close(saved["error"]["w1"], errors["w1"] + 30)  # after layout B's step


def test_fsdp_config_builds_block_sharded_fsdp2_for_large_backbones():
    """configs/fsdp.yaml over the 8-GPU config: resnet152, FSDP2 with one unit and checkpoint per Bottleneck block
    (tests/test_fsdp.py trains with it on 2 CPU processes)."""
    import yaml
    from torchvision.models.resnet import Bottleneck

    from training.distributed.fsdp import FSDP2Strategy

    proc = run_cli("fit", "--config", str(CONFIGS / "imagenet_ddp8.yaml"), "--config", str(CONFIGS / "fsdp.yaml"),
                   "--print_config", timeout=120)
    config = yaml.safe_load(proc.stdout)
    assert config["model"]["net"]["init_args"]["arch"] == "resnet152" and config["trainer"]["devices"] == 8
    assert config["model"]["levers"]["optimizer_impl"] == "foreach" and config["trainer"]["precision"] == "bf16-mixed"
    assert config["trainer"]["strategy"]["class_path"] == "training.distributed.fsdp.FSDP2Strategy"

    strategy = _strategy_from_yaml((CONFIGS / "fsdp.yaml").read_text())
    assert type(strategy) is FSDP2Strategy
    assert strategy.units == strategy.activation_checkpointing == (Bottleneck,)
    assert strategy.reshard_after_forward and strategy.broadcast_buffers and strategy.save_distributed_checkpoint


def test_powersgd_memories_survive_an_overflowed_step(master_port):
    """An inf gradient (an fp16 overflow that the gradient scaler skips) must not poison PowerSGD's error memory and
    warm-start Q: the steps after it give finite gradients again."""
    from torch.nn.parallel import DistributedDataParallel

    from training.distributed.strategy import build_comm_hook

    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    ddp = DistributedDataParallel(net)
    state, hook = build_comm_hook("powersgd", net, rank=1, start_iter=2, min_compression_rate=1.0)
    ddp.register_comm_hook(state, hook)
    x = torch.randn(8, 32)
    finite = []
    for step in range(6):
        ddp.zero_grad(set_to_none=True)
        loss = ddp(x).square().mean()
        (loss * float("inf") if step == 3 else loss).backward()
        finite.append(all(torch.isfinite(p.grad).all() for p in net.parameters()))
        memories = [*state.error_dict.values(), *state.q_memory_dict.values()]
        assert all(torch.isfinite(m).all() for m in memories), step
        assert memories or step < 2, step  # compressing (and remembering) from the start iteration on
    assert finite == [True, True, True, False, True, True]
