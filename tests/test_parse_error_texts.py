"""The texts of jsonargparse's parse errors that core/parse_errors.py rewrites into one line, pinned: one case
per pattern it reads, fed to `imgcls fit` in this process (parsing only). Each case names the fragment of
jsonargparse's own message that its pattern reads and the line the user gets. A jsonargparse that words any of them
otherwise fails here by name; pyproject.toml keeps jsonargparse below its next minor version, raised once this
passes on it."""

from __future__ import annotations

import sys

import pytest

import core.parse_errors as parse_errors
from imgcls.commands import main
from tests.helpers import CONFIGS

# name -> (arguments after the quickstart config, or a config file's text; a fragment of jsonargparse's message; the
# start of the one line printed)
CASES = {
    "a key on the command line": (
        ["--model.recipe.lr_scalling", "none"], "unrecognized arguments: --model.recipe.lr_scalling none",
        "--model.recipe.lr_scalling is not an option; did you mean --model.recipe.lr_scaling"),
    "a key in a config file": (
        "trainer:\n  max_epochss: 3\n", "Subcommand 'fit' does not accept option 'trainer.max_epochss'",
        "--trainer.max_epochss is not an option; did you mean --trainer.max_epochs"),
    "a value out of its type's range": (
        ["--data.num_workers", "-1"], "Not of type NonNegativeInt: does not conform to restriction v>=0",
        "data.num_workers=-1 must be >= 0, or null"),
    "a value not in a Literal": (
        ["--model.net.arch", "resnt50"], 'Parser key "arch":\n  Does not validate against any of the Union subtypes\n'
        "  Subtypes: [typing.Literal['alexnet'", "model.net.arch='resnt50' is unknown; did you mean resnet50"),
    "a misspelt class": (
        ["--model.loss", "torch.nn.CrossEntropyLos"], "Problem with given class_path 'torch.nn.CrossEntropyLos':\n"
        "        module 'torch.nn' has no attribute 'CrossEntropyLos'",
        "model.loss=torch.nn.CrossEntropyLos: torch.nn has no CrossEntropyLos; did you mean torch.nn.CrossEntropyLoss"),
    "a misspelt callable class": (
        ["--model.optimizer", "torch.optim.AdamWW"], "expects a function or a callable class: module 'torch.optim' has "
        "no attribute 'AdamWW'\n    - Expected a <class 'NoneType'>\n  Given value type: <class 'str'>\n  Given value: "
        "torch.optim.AdamWW", "model.optimizer=torch.optim.AdamWW: torch.optim has no AdamWW; did you mean "
        "torch.optim.AdamW"),
    "a callable class's unknown argument": (
        ["--model.optimizer.lrr", "0.1"], "expects a function or a callable class: Option 'lrr' is not accepted. Got "
        "value: Namespace(class_path='torch.optim.AdamW', init_args=Namespace(lrr='0.1'))",
        "model.optimizer.lrr: torch.optim.AdamW takes no argument lrr; did you mean model.optimizer.lr?"),
    "a callable class's unknown argument in a config file": (
        "model:\n  net:\n    init_args:\n      archh: resnet18\n", "expects a function or a callable class: Option "
        "'archh' is not accepted. Got value: Namespace(init_args=Namespace(archh='resnet18'), "
        "class_path='lightning_modules.BackboneWithHead')",
        "model.net.archh: lightning_modules.BackboneWithHead takes no argument archh; did you mean model.net.arch?"),
    "a callable class's argument out of range": (
        ["--model.net.dropout", "2"], 'Parser key "model.net":\n  Type collections.abc.Callable[[int], '
        "torch.nn.modules.module.Module] expects a function or a callable class: dropout=2 must be in [0, 1). Got "
        "value: Namespace(", "model.net.dropout=2 must be in [0, 1)"),
    "no class path": (
        ["--model.loss", "7"], "Expected a dot import path string: 7",
        "model.loss=7 is not a class: give a class_path (a dotted import path, e.g. torch.nn.X)"),
    "a subclass's unknown argument": (
        ["--model.loss.label_smoothin", "0.1"], "Problem with given class_path 'torch.nn.CrossEntropyLoss':\n"
        "        Option 'label_smoothin' is not accepted\n    - ",
        "--model.loss.label_smoothin is not an option; did you mean --model.loss.label_smoothing? "
        "(model.loss.class_path: torch.nn.CrossEntropyLoss)"),
    "a subclass's argument out of range": (
        ["--model.loss", "lightning_modules.losses.BinaryCrossEntropy", "--model.loss.label_smoothing", "1.0"],
        "Problem with given class_path 'lightning_modules.losses.BinaryCrossEntropy':\n        label_smoothing=1.0 "
        "must be in [0, 1)\n    - ", "model.loss.label_smoothing=1.0 must be in [0, 1)"),
    "the data source's unknown argument": (
        ["--data.roott", "x"], 'Parser key "data":\n  Does not validate against any of the Union subtypes\n  Subtypes: '
        "[<class 'datamodules.base.ClassificationData'>, <class 'NoneType'>]\n  Errors:\n    - Problem with given "
        "class_path 'datamodules.ImageFolderDataModule':\n        Option 'roott' is not accepted\n    - ",
        "--data.roott is not an option; did you mean --data.root? "
        "(data.class_path: datamodules.ImageFolderDataModule)"),
    "the data source's argument out of range": (
        ["--data.image_size", "16"], "Problem with given class_path 'datamodules.ImageFolderDataModule':\n        "
        "image_size=16 is below 32", "data.image_size=16 is below 32"),
    "a nested class's unknown argument": (
        ["--data.train_transform.auto_augmnt", "augmix"], "Problem with given class_path "
        "'datamodules.ImageFolderDataModule':\n        --train_transform.auto_augmnt is not an option",
        "--data.train_transform.auto_augmnt is not an option; did you mean --data.train_transform.auto_augment"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_jsonargparse_still_words_the_errors_that_imgcls_rewrites(case, monkeypatch, capsys, tmp_path):
    args, fragment, line = CASES[case]
    if isinstance(args, str):
        (tmp_path / "config.yaml").write_text(args)
        args = ["--config", str(tmp_path / "config.yaml")]
    messages = []  # jsonargparse's messages as parse_errors.py receives them, a nested parser's first

    def read(message, parser):
        messages.append(message)
        return one_line_error(message, parser)

    one_line_error = parse_errors.one_line_error
    monkeypatch.setattr(parse_errors, "one_line_error", read)
    monkeypatch.setattr(sys, "argv", ["imgcls"])  # the arguments are main's, not pytest's
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", str(CONFIGS / "quickstart.yaml"), *args])
    err = capsys.readouterr().err.strip()
    assert any(fragment in message for message in messages), f"jsonargparse words it otherwise now: {messages}"
    assert exit_info.value.code == 2 and err.startswith(f"imgcls: error: {line}") and "\n" not in err, err
