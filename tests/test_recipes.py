"""The shipped recipes (configs/recipes/*.yaml): overlays that compose with the base configs and train, shrunk."""

from __future__ import annotations

import pytest
import torch
import yaml

from tests.helpers import CONFIGS, TINY, cli_env, make_image_folder, run_cli

RECIPES = {  # recipe -> keys it must set in the resolved config, and whether it carries an EMA
    "torchvision_v2": ({"model.recipe.mixup_alpha": 0.2, "model.recipe.cutmix_alpha": 1.0,
                        "model.loss.init_args.label_smoothing": 0.1,
                        "data.train_transform.init_args.auto_augment": "trivialaugment",
                        "data.train_transform.init_args.random_erasing": 0.1,
                        "data.repeated_augmentation": 4, "model.optimizer.init_args.lr": 0.125,
                        "model.optimizer.init_args.nesterov": False}, True),
    "rsb_a3": ({"model.optimizer.class_path": "timm.optim.Lamb",
                "model.loss.class_path": "lightning_modules.losses.BinaryCrossEntropy",
                "model.loss.init_args.target_threshold": 0.2, "model.recipe.mixup_alpha": 0.1,
                "data.train_transform.init_args.auto_augment": "randaugment",
                "data.train_transform.init_args.auto_augment_magnitude": 6,
                "model.optimizer.init_args.lr": 0.001, "model.optimizer.init_args.weight_decay": 0.02,
                "model.lr_scheduler.init_args.warmup_epochs": 5.0}, False),
}


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return make_image_folder(tmp_path_factory.mktemp("recipes") / "images", {"a": 8, "b": 8}, size=48)


@pytest.mark.parametrize("recipe", RECIPES)
def test_each_recipe_composes_with_the_quickstart_and_trains(recipe, images, tmp_path):
    expected, ema = RECIPES[recipe]
    run = tmp_path / "run"
    # Shrunk as every test shrinks a shipped config: small images and batches, two epochs of two steps.
    run_cli("fit", "--config", str(CONFIGS / "quickstart.yaml"),
            "--config", str(CONFIGS / "recipes" / f"{recipe}.yaml"),
            *TINY, "--data.root", str(images), "--data.batch_size", "4",
            "--data.image_size", "null",  # TINY's short form would replace the presets' own sides, set here (FixRes)
            "--data.train_transform.image_size", "32", "--data.eval_transform.image_size", "40",
            "--trainer.max_epochs", "2",
            "--trainer.limit_train_batches", "2",
            "--trainer.limit_val_batches", "1", "--trainer.num_sanity_val_steps", "0",
            "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(run),
            # and the image side grown from 32 to 40 px in the second epoch
            "--data.train_transform.image_size", "40", "--data.progressive_resizing", "{0: 32, 1: 40}", env=cli_env())
    config = yaml.safe_load((run / "config.yaml").read_text())
    for key, value in expected.items():
        section, _, rest = key.partition(".")
        node = config[section].get("init_args", config[section]) if section == "data" else config[section]
        for part in rest.split("."):
            node = node[part]
        assert node == value, key
    checkpoint = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")
    assert checkpoint["global_step"] == 4
    assert ("current_model_state" in checkpoint) == ema  # the EMA appended to the base callbacks
    names = [c["class_path"] for c in config["trainer"]["callbacks"]]
    assert ("training.callbacks.EMA" in names) == ema
    assert config["checkpoint"]["monitor"] == "val/acc" and not any(n.endswith("ModelCheckpoint") for n in names)


def _default_list() -> set[str]:
    return {c["class_path"] for c in yaml.safe_load((CONFIGS / "callbacks" / "default.yaml").read_text())}


def _listed_callbacks(config: dict) -> list[str]:
    trainer = config.get("trainer") or {}
    entries = [c for key in ("callbacks", "callbacks+") if isinstance(trainer.get(key), list) for c in trainer[key]]
    return [c["class_path"] if isinstance(c, dict) else c for c in entries]


@pytest.mark.parametrize("path", sorted(p for p in CONFIGS.rglob("*.yaml") if "sweeps" not in p.parts
                                        and p != CONFIGS / "callbacks" / "default.yaml"),
                         ids=lambda p: str(p.relative_to(CONFIGS)))
def test_no_config_copies_the_callbacks_list_or_lists_the_runs_checkpoints(path):
    """configs/callbacks/default.yaml is the one list: a config names it or appends to it, and never lists its
    callbacks again. Nor does any list a ModelCheckpoint: the run's checkpoints are the `checkpoint` key."""
    listed = _listed_callbacks(yaml.safe_load(path.read_text()) or {})
    assert not set(listed) & _default_list()
    assert not [c for c in listed if c.endswith(("ModelCheckpoint", "StepCheckpoint"))]


def test_multilabel_on_the_production_config_keeps_its_frozen_backbone(images, tmp_path, monkeypatch):
    """recipes/multilabel.yaml over imagenet_ddp8.yaml: the production config's frozen first epoch and step
    checkpoints stay, the run's one ModelCheckpoint ranks by val/map, and the rest of the list is the default one."""
    from training.callbacks import FreezeBackbone, ModelCheckpoint
    from training.callbacks.model_checkpoint import StepCheckpoint
    from training.cli.app import ImgclsCLI, cli_main

    monkeypatch.setattr("sys.argv", ["imgcls"])
    monkeypatch.setattr(ImgclsCLI, "_run_subcommand", lambda self, subcommand: None)  # built, not run
    cli = cli_main(["fit", "--config", str(CONFIGS / "imagenet_ddp8.yaml"),
                    "--config", str(CONFIGS / "recipes" / "multilabel.yaml"), *TINY, "--model.net.weights", "null",
                    "--data.root", str(images), "--trainer.devices", "1", "--trainer.strategy", "auto",
                    "--trainer.default_root_dir", str(tmp_path / "run")])
    callbacks = cli.trainer.callbacks
    assert [c.epochs for c in callbacks if isinstance(c, FreezeBackbone)] == [1]
    assert [(c.monitor, c.mode, c.save_top_k, c.save_last) for c in callbacks if isinstance(c, ModelCheckpoint)] == [
        ("val/map", "max", 2, True)]
    assert [c.filename for c in callbacks if isinstance(c, ModelCheckpoint)] == [
        "epoch{epoch:03d}-val_map{val/map:.4f}"]
    steps = [c.state_key for c in callbacks if isinstance(c, StepCheckpoint)]
    assert len(steps) == 1 and "'every_n_train_steps': 500" in steps[0]  # imagenet_ddp8.yaml's
    names = {f"{type(c).__module__.split('.')[0]}.{type(c).__name__}" for c in callbacks}
    default = {f"{path.split('.')[0]}.{path.rsplit('.', 1)[-1]}" for path in _default_list()}
    assert default - names == {"lightning.RichModelSummary"}  # TINY's --trainer.enable_model_summary false
