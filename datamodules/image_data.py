"""Image sources whose pixels go through injected transforms: the part the image folder, the CSV manifest, Hugging
Face datasets and LitData shards share (the training and evaluation pipelines, the input contract, predicting a
folder of images, the bad-image scan of files)."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Literal, NamedTuple

from lightning.pytorch.utilities import rank_zero_info

from core.config_types import ImageSide, check_arguments
from datamodules.bad_images import ScanCache, bad_images_message, find_bad_images
from datamodules.base import ClassificationData
from datamodules.datasets import PredictImages, collate_encoded
from datamodules.images import list_images, read_encoded, read_image
from datamodules.presets import ClassificationPresetEval, ClassificationPresetTrain, Preset, check_schedule, float_stage
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


class ImageData(ClassificationData):
    """Images prepared by injected transforms (datamodules/transforms.py): a subclass lists its samples in
    `setup_datasets(stage, transforms)`; this class places the training and evaluation pipelines, states the input
    contract and predicts the images of `predict_dir`.

    Args:
        train_transform: the training pipeline, by class_path: a shipped preset
            (`datamodules.presets.ClassificationPresetTrain`, the default), any torchvision v2 transform, or a class
            of yours (`datamodules.transforms.ImageTransform`: uint8 (3, H, W) in, uint8 (3, S, S) out).
        eval_transform: the validation, test and prediction pipeline, likewise
            (`datamodules.presets.ClassificationPresetEval`, the default). It becomes the model's input contract: a
            checkpoint evaluates, predicts and exports with it.
        preset: short form: the preset of a shipped preset whose own is null: ``imagenet``, ``keras`` or ``none``.
        image_size: short form: the side of a shipped preset whose own is null (both, unless FixRes sets them).
        progressive_resizing: epoch -> training image side from that epoch on, e.g. ``{0: 128, 6: 160, 12: 176}``
            (progressive resizing, as in FFCV and Composer: small, fast images early, full size late). The loaders
            keep producing the training transform's crops; each training batch is resized on the device, before
            normalisation. Evaluation keeps its size. null is off.
        normalize_on_device: workers yield uint8 batches and the float conversion and normalization run after the
            copy to the device (same values, 4x fewer bytes moved); false yields float batches from the workers.
        augment_on_device: workers only read the files; JPEG decoding (nvJPEG on CUDA, one call per batch), the
            transforms and the normalization run on the device, image by image, in the main process. For when the
            CPU cores cannot feed the GPUs; on a CPU-only machine it only moves the work around.
        fast_decode: training JPEGs (imagenet preset) are decoded by libjpeg-turbo's fast path: fast integer IDCT
            and chroma upsampling, and at 1/2, 1/4 or 1/8 scale when the random crop is that many times larger than
            its output. Less CPU per image (benchmarks/input_pipeline.py); pixels differ from the exact decode by
            about one level in 255 on average. Evaluation images are always decoded exactly.
        predict_dir: folder of images (nested folders allowed) for ``imgcls predict``.
        bad_images: what to do with image files that cannot be decoded, found by a scan at setup: ``raise`` (list
            them all and stop before training) or ``skip`` (log them and train on the rest).
        scan_cache: keep that scan's verdicts, keyed by path, size and mtime, in ``.imgcls-scan-cache-*.npz`` beside
            the images (in ``~/.cache/imgcls/scan`` when their folder is read-only): a later start decodes only the
            files added or changed since. false decodes every image at every start.
        **kwargs: the loader and sampler settings of `ClassificationData` (batch_size, num_workers, sampler, ...).
    """

    def __init__(
        self,
        train_transform: ImageTransform | None = None,
        eval_transform: ImageTransform | None = None,
        preset: Preset = "imagenet",
        image_size: ImageSide = 224,
        progressive_resizing: dict[int, int] | None = None,
        normalize_on_device: bool = True,
        augment_on_device: bool = False,
        fast_decode: bool = False,
        predict_dir: str | None = None,
        bad_images: Literal["raise", "skip"] = "raise",
        scan_cache: bool = True,
        **kwargs,
    ) -> None:
        check_arguments("data", ImageData.__init__, locals())  # the annotated ranges and choices
        super().__init__(**kwargs)
        self.preset, self.image_size = preset, image_size
        train = train_transform if train_transform is not None else ClassificationPresetTrain()
        evaluate = eval_transform if eval_transform is not None else ClassificationPresetEval()
        if isinstance(train, ClassificationPresetTrain):
            train = train.with_defaults(preset=preset, image_size=image_size, uint8_output=True,
                                        fast_decode=fast_decode)
        elif fast_decode and not getattr(train, "reads_encoded", False):
            raise ValueError(f"data.fast_decode decodes JPEGs inside the training transform, and "
                             f"{type(train).__name__} takes decoded images; set data.fast_decode false")
        if isinstance(evaluate, ClassificationPresetEval):
            evaluate = evaluate.with_defaults(preset=preset, image_size=image_size, uint8_output=True)
        self.train_transform, self.eval_transform = train, evaluate
        # What a checkpoint rebuilds them from: a config, never the objects (checkpoints load weights_only).
        given = {k: self.hparams.get(k) for k in ("train_transform", "eval_transform")}
        self.hparams.update({k: transform_config(t, given[k]) for k, t in (("train_transform", train),
                                                                           ("eval_transform", evaluate))})
        self._contract = contract_of(evaluate, given["eval_transform"])
        self.train_image_size, self.eval_image_size = stated(train, "image_size"), stated(evaluate, "image_size")
        self.progressive_resizing = check_schedule(progressive_resizing, self.train_image_size)
        self.normalize_on_device, self.augment_on_device = normalize_on_device, augment_on_device
        self.fast_decode, self.bad_images, self.scan_cache = fast_decode, bad_images, scan_cache
        self.predict_dir = Path(predict_dir).expanduser() if predict_dir is not None else None
        self.float_transform = float_stage(*normalisation_of(train, evaluate))  # uint8 (B, 3, H, W) -> float32
        self.collate_fn = collate_encoded if augment_on_device else self.collate_fn

    @property
    def input_contract(self) -> dict:
        """The evaluation preprocessing (`datamodules.transforms.contract_of`): values (size, mean, std, ...) and the
        eval transform's class_path and init_args, linked into the model, which keeps it in its checkpoints, so that
        a checkpoint evaluates, predicts and exports as it was validated."""
        return dict(self._contract)

    def transforms(self) -> Transforms:
        """The training and evaluation transforms, as this run's settings place them."""
        if self.augment_on_device:  # the workers read; `augment_batch` decodes and transforms on the device
            self._device_transforms = {"train": self.train_transform, "eval": self.eval_transform}
            return Transforms(None, None, train_encoded=True, eval_encoded=True)
        train, evaluate = self.train_transform, self.eval_transform
        if not self.normalize_on_device:
            train, evaluate = ThenFloat(train, self.float_transform), ThenFloat(evaluate, self.float_transform)
        # With fast_decode the training transform decodes each JPEG for its crop (reduced size when it can).
        return Transforms(train, evaluate, train_encoded=self.fast_decode, eval_encoded=False)

    def setup(self, stage: str) -> None:
        if stage == "fit":  # only a fit runs the training transform
            normalisation_of(self.train_transform, self.eval_transform, strict=True)
        transforms = self.transforms()
        if stage == "predict":
            self.predict_set = self._predict_images(transforms)
            return
        self.setup_datasets(stage, transforms)

    def setup_datasets(self, stage: str, transforms: Transforms) -> None:
        """Set `train_set` and `val_set` (fit, validate) or `test_set` (test), with these transforms: the subclass's
        part of the contract (datamodules/base.py)."""
        raise NotImplementedError(f"{type(self).__name__} lists no samples: it must define setup_datasets")

    def _predict_images(self, transforms: Transforms) -> PredictImages:
        if self.predict_dir is None:
            raise ValueError("data.predict_dir is not set; pass --data.predict_dir FOLDER_OF_IMAGES")
        if not self.predict_dir.is_dir():
            raise FileNotFoundError(f"data.predict_dir={self.predict_dir} is not a folder")
        paths = list_images(self.predict_dir)
        if not paths:
            raise FileNotFoundError(f"data.predict_dir={self.predict_dir} holds no images")
        (paths,) = self.drop_bad(paths, folder=self.predict_dir, scan="predict")
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


def normalisation_of(train, evaluate, *, strict: bool = False) -> tuple[list[float] | None, list[float] | None]:
    """(mean, std) of the float stage: what the evaluation transform states (else the training one); None: pixels
    are only scaled to [0, 1]. `strict` (fit) refuses two transforms that state different ones."""
    pairs = [(stated(t, "mean"), stated(t, "std")) for t in (evaluate, train)]
    given = [p for p in pairs if p != (None, None)]
    if strict and len(given) == 2 and given[0] != given[1]:
        raise ValueError(f"data.train_transform normalises with mean, std {given[1]} and data.eval_transform with "
                         f"{given[0]}; the float stage is one: give both transforms the same mean and std")
    return given[0] if given else (None, None)
