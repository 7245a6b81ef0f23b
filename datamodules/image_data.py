"""Image sources whose pixels go through injected transforms: what the image folder, the CSV manifest, Hugging Face
datasets and LitData shards share (the training and evaluation pipelines, the input contract, predicting a folder of
images, the bad-image scan of files, and the datasets of image files a source lists with `listing`)."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, NamedTuple

from lightning.pytorch.utilities import rank_zero_info

from core.config_types import ImageSide
from datamodules.bad_images import ScanCache, bad_images_message, find_bad_images
from datamodules.base import ClassificationData
from datamodules.datasets import ImageFiles, PredictImages, collate_encoded
from datamodules.decoding import read_encoded, read_image
from datamodules.device_batches import DeviceBatches
from datamodules.listing import FileSplits, list_images
from datamodules.presets import (
    ClassificationPresetEval,
    ClassificationPresetTrain,
    Preset,
    check_schedule,
    float_stage,
    with_short_forms,
)
from datamodules.samplers import refuse_balanced_multilabel
from datamodules.transforms import ImageTransform, ThenFloat, contract_of, stated, transform_config

log = logging.getLogger(__name__)

# Lightning's advice for a module among the hyperparameters; ImageData replaces its transforms there by their config.
warnings.filterwarnings("ignore", message=r"Attribute '(train|eval)_transform' is an instance of `nn.Module`")


class Transforms(NamedTuple):
    """The transforms of one setup, and how each split's images reach them."""

    train: Callable | None  # None with augment_on_device: the images are transformed on the device
    eval: Callable | None
    train_encoded: bool  # training JPEGs stay their bytes (fast_decode's crop, or the device decodes them)
    eval_encoded: bool

    def read(self, train: bool) -> Callable[[str], object]:
        """How a file of that split is read: decoded (`read_image`) or left encoded (`read_encoded`)."""
        return read_encoded if (self.train_encoded if train else self.eval_encoded) else read_image


@dataclass(eq=False, repr=False, kw_only=True)
class ImageData(ClassificationData):
    """Images prepared by injected transforms (datamodules/transforms.py): this class places the training and
    evaluation pipelines, states the input contract and predicts the images of `predict_dir`. A subclass either lists
    image files below a root (`listing`: the image folder, the CSV manifests), whose datasets this class builds, or
    builds its own in `setup_datasets(stage, transforms)`."""

    train_transform: ImageTransform | None = None
    """The training pipeline, by class_path: a shipped preset (`datamodules.presets.ClassificationPresetTrain`, the
    default), any torchvision v2 transform, or a class of yours (`datamodules.transforms.ImageTransform`: uint8
    (3, H, W) in, uint8 (3, S, S) out)."""
    eval_transform: ImageTransform | None = None
    """The validation, test and prediction pipeline, likewise (`datamodules.presets.ClassificationPresetEval`, the
    default). It becomes the model's input contract: a checkpoint evaluates, predicts and exports with it."""
    preset: Preset | None = None
    """Short form: when set, the ``preset`` of both shipped presets, over their own (one line says which values it
    replaces); null: each preset's own."""
    image_size: ImageSide | None = None
    """Short form: when set, the ``image_size`` of both shipped presets, over their own (one line says which values
    it replaces; an evaluation resize_size it changes goes back to image_size / 0.875); null: each preset's own."""
    progressive_resizing: dict[int, int] | None = None
    """Epoch -> training image side from that epoch on, e.g. ``{0: 128, 6: 160, 12: 176}`` (progressive resizing, as
    in FFCV and Composer: small, fast images early, full size late). The loaders keep producing the training
    transform's crops; each training batch is resized on the device, before normalisation. Evaluation keeps its size.
    null is off."""
    normalize_on_device: bool = True
    """Workers yield uint8 batches and the float conversion and normalization run after the copy to the device (same
    values, 4x fewer bytes moved); false yields float batches from the workers."""
    augment_on_device: bool = False
    """Workers only read the files; JPEG decoding (nvJPEG on CUDA, one call per batch), the transforms and the
    normalization run on the device, image by image, in the main process. For when the CPU cores cannot feed the
    GPUs; on a CPU-only machine it only moves the work around."""
    fast_decode: bool = False
    """Training JPEGs (imagenet preset) are decoded by libjpeg-turbo's fast path: fast integer IDCT and chroma
    upsampling, and at 1/2, 1/4 or 1/8 scale when the random crop is that many times larger than its output. Less CPU
    per image (benchmarks/input_pipeline.py); pixels differ from the exact decode by about one level in 255 on average.
    Evaluation images are always decoded exactly."""
    predict_dir: str | None = None
    """Folder of images (nested folders allowed) for ``imgcls predict``."""
    bad_images: Literal["raise", "skip"] = "raise"
    """What to do with image files that cannot be decoded, found by a scan at setup: ``raise`` (list them all and
    stop before training) or ``skip`` (log them and train on the rest)."""
    scan_cache: bool = True
    """Keep that scan's verdicts, keyed by path, size and mtime, in ``.imgcls-scan-cache-*.npz`` beside the images (in
    ``~/.cache/imgcls/scan`` when their folder is read-only): a later start decodes only the files added or changed
    since. false decodes every image at every start."""

    def __post_init__(self) -> None:
        super().__post_init__()
        train, evaluate = self._place_transforms()
        self.train_transform, self.eval_transform = train, evaluate
        # What a checkpoint rebuilds them from: a config, never the objects (checkpoints load weights_only).
        given = {k: self.hparams.get(k) for k in ("train_transform", "eval_transform")}
        self.hparams.update({k: transform_config(t, given[k]) for k, t in (("train_transform", train),
                                                                           ("eval_transform", evaluate))})
        self._contract = contract_of(evaluate, given["eval_transform"])
        train_size = stated(train, "image_size")
        self.device_batches = DeviceBatches(  # uint8 (B, 3, H, W) -> float32, the schedule, the device's transforms
            float_stage(*stated_normalization(train, evaluate)), schedule=check_schedule(self.progressive_resizing,
                                                                                     train_size),
            transforms={"train": train, "eval": evaluate} if self.augment_on_device else None, train_size=train_size)
        if self.augment_on_device:
            self.collate_fn = collate_encoded
        self.files = self.listing()
        if self.files is not None:  # read now (a listing, cheap): the CLI links the classes into the model
            self.class_names, self.multilabel = self.files.class_names, self.files.multilabel
            refuse_balanced_multilabel(self.sampler, self.multilabel, str(self.files.root))

    def _place_transforms(self) -> tuple[ImageTransform, ImageTransform]:
        """The training and evaluation transforms as this run uses them: the default presets where none is given, the
        short forms over the presets' own (said in one line where they replace a value), uint8 output."""
        train = self.train_transform if self.train_transform is not None else ClassificationPresetTrain()
        evaluate = self.eval_transform if self.eval_transform is not None else ClassificationPresetEval()
        train, replaced = with_short_forms(train, "data.train_transform", self.preset, self.image_size)
        evaluate, replaced_eval = with_short_forms(evaluate, "data.eval_transform", self.preset, self.image_size)
        if replaced or replaced_eval:
            forms = [f"data.{k}={v}" for k, v in (("preset", self.preset), ("image_size", self.image_size)) if v]
            rank_zero_info(f"{', '.join(forms)} (short form) replaces {', '.join(replaced + replaced_eval)}")
        if isinstance(train, ClassificationPresetTrain):
            train = train.replace(uint8_output=True, fast_decode=self.fast_decode)
        elif self.fast_decode and not getattr(train, "reads_encoded", False):
            raise ValueError(f"data.fast_decode decodes JPEGs inside the training transform, and "
                             f"{type(train).__name__} takes decoded images; set data.fast_decode false")
        if isinstance(evaluate, ClassificationPresetEval):
            evaluate = evaluate.replace(uint8_output=True)
        return train, evaluate

    @property
    def input_contract(self) -> dict:
        """The evaluation preprocessing (`datamodules.transforms.contract_of`): values (size, mean, std, ...) and the
        eval transform's class_path and init_args, linked into the model, which keeps it in its checkpoints, so that
        a checkpoint evaluates, predicts and exports as it was validated."""
        return dict(self._contract)

    def listing(self) -> FileSplits | None:
        """The image files of a source that lists them below a root (its splits, classes and samples), read at
        construction; None for a source that builds its own datasets in `setup_datasets`, or without a root."""
        return None

    def transforms(self) -> Transforms:
        """The training and evaluation transforms, as this run's settings place them."""
        if self.augment_on_device:  # the workers read; `device_batches` decodes and transforms on the device
            return Transforms(None, None, train_encoded=True, eval_encoded=True)
        train, evaluate = self.train_transform, self.eval_transform
        if not self.normalize_on_device:
            stage = self.device_batches.float_stage
            train, evaluate = ThenFloat(train, stage), ThenFloat(evaluate, stage)
        # With fast_decode the training transform decodes each JPEG for its crop (reduced size when it can).
        return Transforms(train, evaluate, train_encoded=self.fast_decode, eval_encoded=False)

    def setup(self, stage: str) -> None:
        if stage == "fit":  # only a fit runs the training transform
            stated_normalization(self.train_transform, self.eval_transform, strict=True)
        transforms = self.transforms()
        if stage == "predict":
            self.predict_set = self._predict_images(transforms)
            return
        self.setup_datasets(stage, transforms)

    def setup_datasets(self, stage: str, transforms: Transforms) -> None:
        """Set `train_set` and `val_set` (fit, validate) or `test_set` (test), with these transforms: the subclass's
        part of the contract (datamodules/base.py). Here: the image files of `listing`, scanned once per stage."""
        files = self.files
        if files is None:
            raise ValueError(f"data.root is required for {stage}; pass --data.root FOLDER")
        if stage in ("fit", "validate") and self.train_set is None:  # built once: `fit` validates again at its end
            train, val = files.train_val()
            train, val = self.drop_bad(train, val, folder=files.root, scan="train-val")  # one scan, one message
            self.train_set = ImageFiles(train, transforms.train, transforms.read(train=True))
            self.val_set = ImageFiles(val, transforms.eval, transforms.read(train=False))
        if stage == "test":
            if not files.has("test"):
                raise FileNotFoundError(f"{files.path('test')} does not exist; `imgcls test` needs a test split")
            (test,) = self.drop_bad(files.samples("test"), folder=files.root, scan="test")
            self.test_set = ImageFiles(test, transforms.eval, transforms.read(train=False))

    def _predict_images(self, transforms: Transforms) -> PredictImages:
        if self.predict_dir is None:
            raise ValueError("data.predict_dir is not set; pass --data.predict_dir FOLDER_OF_IMAGES")
        folder = Path(self.predict_dir).expanduser()
        if not folder.is_dir():
            raise FileNotFoundError(f"data.predict_dir={folder} is not a folder")
        paths = list_images(folder)
        if not paths:
            raise FileNotFoundError(f"data.predict_dir={folder} holds no images")
        (paths,) = self.drop_bad(paths, folder=folder, scan="predict")
        return PredictImages(paths, transforms.eval, transforms.read(train=False))

    def drop_bad(self, *splits: list, folder: Path, scan: str) -> list[list]:
        """Scan the samples of `splits` (paths or (path, target) pairs, below `folder`) once, on rank 0; raise on bad
        files, listing every split's, or drop them. Returns the splits, filtered. `scan` names the cache's file."""
        paths = [s[0] if isinstance(s, tuple) else s for split in splits for s in split]
        trainer = self.trainer
        bad = None
        if trainer is None or trainer.is_global_zero:
            cache = ScanCache(folder, scan) if self.scan_cache else None
            bad = find_bad_images(paths, progress=True, cache=cache)
            if cache is not None:
                rank_zero_info(cache.summary())
        if trainer is not None and trainer.world_size > 1:
            bad = trainer.strategy.broadcast(bad, src=0)  # one scan per run; every rank decides alike
        if not bad:
            return list(splits)
        message = bad_images_message(bad, len(paths))
        if self.bad_images == "raise":
            raise ValueError(f"{message}\nremove or fix these files, or set data.bad_images: skip")
        if trainer is None or trainer.is_global_zero:
            log.warning(f"data.bad_images=skip: skipping {message}")
        dropped = {p for p, _ in bad}
        kept = [[s for s in split if (s[0] if isinstance(s, tuple) else s) not in dropped] for split in splits]
        if not all(kept):
            raise ValueError(f"no usable image is left in a split after skipping {len(bad)} bad files "
                             f"(first: {bad[0][0]})")
        return kept


def stated_normalization(train, evaluate, *, strict: bool = False) -> tuple[list[float] | None, list[float] | None]:
    """(mean, std) of the float stage: what the evaluation transform states (else the training one); None: pixels
    are only scaled to [0, 1]. `strict` (fit) refuses two transforms that state different ones."""
    pairs = [(stated(t, "mean"), stated(t, "std")) for t in (evaluate, train)]
    given = [p for p in pairs if p != (None, None)]
    if strict and len(given) == 2 and given[0] != given[1]:
        raise ValueError(f"data.train_transform normalises with mean, std {given[1]} and data.eval_transform with "
                         f"{given[0]}; the float stage is one: give both transforms the same mean and std")
    return given[0] if given else (None, None)
