"""The shipped transform presets (torchvision transforms v2): classes with keyword arguments, as torchvision's
references/classification presets.py, injected as ``data.train_transform`` and ``data.eval_transform``."""

from __future__ import annotations

from typing import Literal, get_args

import torch
from PIL import Image
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as F

from core.config_types import ImageSide, check_arguments
from datamodules.decoding import decode_for_crop

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

Preset = Literal["imagenet", "keras", "none"]
PRESETS: tuple[str, ...] = get_args(Preset)
AutoAugment = Literal["none", "trivialaugment", "randaugment", "autoaugment", "augmix"]
AUTO_AUGMENTS: tuple[str, ...] = get_args(AutoAugment)


def auto_augment_transform(policy: AutoAugment, magnitude: int | None = None) -> v2.Transform | None:
    """torchvision v2's automatic augmentation `policy` on uint8 images (None for ``none``).

    `magnitude` is the policy's own strength setting, None for torchvision's default: RandAugment's magnitude (9 of
    31 bins), AugMix's severity (3 of 10), TrivialAugmentWide's number of magnitude bins (31); AutoAugment's
    ImageNet policy has none.
    """
    if policy not in AUTO_AUGMENTS:
        raise ValueError(f"data.train_transform.auto_augment={policy!r} is unknown; choose one of "
                         f"{', '.join(AUTO_AUGMENTS)}")
    if policy == "none":
        return None
    if policy == "autoaugment":
        if magnitude is not None:
            raise ValueError("data.train_transform.auto_augment_magnitude has no meaning for autoaugment (ImageNet "
                             "policy); set it null")
        return v2.AutoAugment(v2.AutoAugmentPolicy.IMAGENET)
    key, default = {"trivialaugment": ("num_magnitude_bins", 31), "randaugment": ("magnitude", 9),
                    "augmix": ("severity", 3)}[policy]
    cls = {"trivialaugment": v2.TrivialAugmentWide, "randaugment": v2.RandAugment, "augmix": v2.AugMix}[policy]
    return cls(**{key: default if magnitude is None else magnitude})


def erase_value(preset: Preset) -> list[int]:
    """The uint8 fill of random erasing: the pixel that normalises to 0 (the ImageNet mean) where the preset
    normalises, so erasing before the float conversion equals torchvision's erasing after it; black otherwise."""
    _check_preset(preset)
    return [round(255 * m) for m in IMAGENET_MEAN] if preset == "imagenet" else [0, 0, 0]


def float_stage(mean: list[float] | None, std: list[float] | None) -> v2.Compose:
    """The last, per-pixel stage of every pipeline: uint8 (..., 3, H, W) -> float32 in [0, 1], then (x - mean) / std
    where they normalise (None: not at all).

    The DataModule runs it on whole batches after the host-to-device copy, so workers ship uint8 (4x fewer bytes
    through shared memory and the copy) and the arithmetic runs on the accelerator.
    """
    steps = [v2.ToDtype(torch.float32, scale=True)]
    if mean is not None and std is not None and (any(mean) or any(s != 1 for s in std)):
        steps.append(v2.Normalize(list(mean), list(std)))
    return v2.Compose(steps)


class RandomResizedCropFlip:
    """`v2.RandomResizedCrop(size)` then `v2.RandomHorizontalFlip()`, for one image, through v2's functional kernels.

    It draws the same random numbers as those two transforms, so the same seed gives the same crop and flip, without
    the per-call dispatch of v2's class API (about a sixth of the CPU time per image at 224 px). It takes decoded
    images (uint8 (3, H, W) tensors or PIL images) and JPEG files' bytes (1-D uint8 tensors from `read_encoded`),
    which it decodes for the crop: exactly, or with `fast_decode` through libjpeg-turbo's fast path (see
    `decode_for_crop`: slightly different pixels, decoded at reduced size when the crop allows it).
    """

    def __init__(self, size: int, *, fast_decode: bool = False) -> None:
        self.crop = v2.RandomResizedCrop(size, antialias=True)
        self.fast_decode = fast_decode

    def _params(self, height: int, width: int) -> dict:
        return self.crop.make_params([torch.empty(3, height, width, device="meta")])  # only the size is read

    def __call__(self, image) -> torch.Tensor:
        if isinstance(image, Image.Image):
            image = F.pil_to_tensor(image)
        if image.ndim == 1:
            image, params = decode_for_crop(image, self._params, self.crop.size, fast=self.fast_decode)
        else:
            params = self._params(image.shape[-2], image.shape[-1])
        # Resized from a channels_last copy of the crop: torch's vectorised uint8 kernel then reads and writes
        # interleaved pixels, faster than from the strided crop (benchmarks/input_pipeline.py), and the result stays
        # (3, S, S) in HWC order.
        crop = F.crop(image, **params).unsqueeze(0).contiguous(memory_format=torch.channels_last)
        image = F.resize(crop, self.crop.size, antialias=True)[0]
        return F.horizontal_flip(image) if torch.rand(1) < 0.5 else image  # v2.RandomHorizontalFlip's draw


class ClassificationPresetTrain:
    """Training-time augmentation (torchvision v2), as torchvision's references/classification presets: a decoded
    image (uint8 (3, H, W) tensor or PIL image) in, float (3, S, S) out; with ``uint8_output=True`` it stops before
    `float_stage` and returns the uint8 (3, S, S) image (`datamodules.transforms.ImageTransform`'s contract, as
    the DataModule builds it). The imagenet preset also takes a JPEG's bytes (`RandomResizedCropFlip`), decoded fast
    with ``fast_decode``.

    As ``data.train_transform``, the DataModule's short forms ``data.preset`` and ``data.image_size``, when set,
    replace `preset` and `image_size`, and ``data.fast_decode`` decides `fast_decode`.

    Args:
        preset: ``imagenet`` (random resized crop and flip), ``keras`` (resize, rotation, shifts, flip) or ``none``
            (resize only); null: imagenet.
        image_size: side of the training crops; null: 224. Below the evaluation side is FixRes (torchvision's V2
            recipe trains at 176 and evaluates at 224): random crops enlarge objects, and evaluating larger makes up
            for it.
        auto_augment: automatic augmentation policy (on uint8): ``none``, ``trivialaugment`` (TrivialAugmentWide,
            torchvision's V2 recipe), ``randaugment``, ``autoaugment`` (ImageNet policy) or ``augmix``.
        auto_augment_magnitude: the policy's strength, null = torchvision's default: RandAugment magnitude (9),
            AugMix severity (3), TrivialAugmentWide's number of magnitude bins (31).
        random_erasing: probability of erasing a random box of each image (0.1 in torchvision's V2 recipe), filled
            with the pixel that normalises to zero.
        uint8_output: stop before the float conversion and normalisation.
        fast_decode: JPEG bytes are decoded by libjpeg-turbo's fast path for the crop (imagenet only).
    """

    def __init__(self, *, preset: Preset | None = None, image_size: ImageSide | None = None,
                 auto_augment: AutoAugment = "none", auto_augment_magnitude: int | None = None,
                 random_erasing: float = 0.0, uint8_output: bool = False, fast_decode: bool = False) -> None:
        check_arguments("data.train_transform", ClassificationPresetTrain.__init__,
                        dict(preset=preset, image_size=image_size))
        self.init_args = dict(preset=preset, image_size=image_size, auto_augment=auto_augment,
                              auto_augment_magnitude=auto_augment_magnitude, random_erasing=random_erasing)
        preset, image_size = preset or "imagenet", int(image_size or 224)
        check_fast_decode(preset, fast_decode)
        if not 0.0 <= random_erasing <= 1.0:
            raise ValueError(f"data.train_transform.random_erasing={random_erasing} is a probability: choose a value "
                             "in [0, 1]")
        self.preset, self.image_size = preset, image_size
        self.uint8_output, self.fast_decode = uint8_output, fast_decode
        self.mean, self.std = normalization(preset)
        self.reads_encoded = preset == "imagenet"  # RandomResizedCropFlip decodes a JPEG's bytes for its crop
        if preset == "imagenet":
            # Cropped and resized as uint8, before the float conversion: cheaper per pixel. Takes JPEG bytes too.
            steps = [RandomResizedCropFlip(image_size, fast_decode=fast_decode)]
        elif preset == "keras":
            # The classic Keras ImageDataGenerator recipe: rotation ±20°, shifts of 0.2, flip, rescale 1/255.
            steps = [
                v2.PILToTensor(),
                v2.Resize((image_size, image_size), antialias=True),
                v2.RandomAffine(degrees=20, translate=(0.2, 0.2)),
                v2.RandomHorizontalFlip(),
            ]
        else:
            steps = _plain(image_size)
        # torchvision's reference order: crop and flip, the policy, then erasing; all on uint8, before the float stage.
        policy = auto_augment_transform(auto_augment, auto_augment_magnitude)
        if policy is not None:
            steps.append(policy)
        if random_erasing > 0:
            steps.append(v2.RandomErasing(p=random_erasing, value=erase_value(preset)))
        self.transforms = v2.Compose(steps if uint8_output else [*steps, *float_stage(self.mean, self.std).transforms])

    def replace(self, **changes) -> ClassificationPresetTrain:
        """This preset with `changes` to its arguments (the DataModule's short forms, uint8_output, fast_decode)."""
        return type(self)(**{**self.init_args, "uint8_output": self.uint8_output, "fast_decode": self.fast_decode,
                             **changes})

    def config(self) -> dict:
        """class_path and init_args that rebuild this transform, its preset and size resolved."""
        init_args = {**self.init_args, "preset": self.preset, "image_size": self.image_size}
        return {"class_path": f"{type(self).__module__}.{type(self).__name__}", "init_args": init_args}

    def __call__(self, img):
        return self.transforms(img)


class ClassificationPresetEval:
    """Evaluation transform: deterministic resize (and center crop for `imagenet`); ``uint8_output`` as for
    training. As ``data.eval_transform``, the DataModule's short forms ``data.preset`` and ``data.image_size``, when
    set, replace `preset` and `image_size`; the run's resolved values become the model's input contract (`config`,
    `contract_values`).

    Args:
        preset: ``imagenet`` (resize the short side, then center crop) or ``keras`` / ``none`` (resize to a square);
            null: imagenet.
        image_size: side of the validation, test and prediction images; null: 224.
        resize_size: ``imagenet``: the short side before the center crop; null = image_size / 0.875 (256 for 224).
            torchvision's V2 weights evaluate at 232 -> 224.
        uint8_output: stop before the float conversion and normalisation.
    """

    def __init__(self, *, preset: Preset | None = None, image_size: ImageSide | None = None,
                 resize_size: ImageSide | None = None, uint8_output: bool = False) -> None:
        check_arguments("data.eval_transform", ClassificationPresetEval.__init__,
                        dict(preset=preset, image_size=image_size, resize_size=resize_size))
        self.init_args = dict(preset=preset, image_size=image_size, resize_size=resize_size)
        preset, image_size = preset or "imagenet", int(image_size or 224)
        self.preset, self.image_size, self.uint8_output = preset, image_size, uint8_output
        self.resize_size = int(resize_size or round(image_size / 0.875))
        if self.resize_size < image_size:
            raise ValueError(f"data.eval_transform.resize_size={self.resize_size} is below the crop, "
                             f"data.eval_transform.image_size={image_size}; it is the short side before the center "
                             "crop")
        self.mean, self.std = normalization(preset)
        if preset == "imagenet":
            steps = [
                v2.PILToTensor(),
                v2.Resize(self.resize_size, antialias=True),
                v2.CenterCrop(image_size),
            ]
        else:
            steps = _plain(image_size)
        self.transforms = v2.Compose(steps if uint8_output else [*steps, *float_stage(self.mean, self.std).transforms])

    def replace(self, **changes) -> ClassificationPresetEval:
        """This preset with `changes` to its arguments (the DataModule's short forms, uint8_output)."""
        return type(self)(**{**self.init_args, "uint8_output": self.uint8_output, **changes})

    def config(self) -> dict:
        """class_path and init_args that rebuild this transform (`datamodules.transforms.build_transform`)."""
        init_args = dict(preset=self.preset, image_size=self.image_size,
                         resize_size=self.resize_size if self.preset == "imagenet" else None)
        return {"class_path": f"{type(self).__module__}.{type(self).__name__}", "init_args": init_args}

    def contract_values(self) -> dict:
        """This transform as plain values, as timm's `pretrained_cfg` states a model's: what a model trained with it
        expects of an RGB image. The model keeps them in its input contract (`model.input_contract`), with the
        transform's class_path and init_args under ``transform`` (`datamodules.transforms.contract_of`); evaluation,
        prediction and export rebuild the transform from it."""
        imagenet = self.preset == "imagenet"
        return {
            "preset": self.preset,
            "image_size": self.image_size,  # the square side the network sees
            "resize_size": self.resize_size if imagenet else None,  # the short side, then the center crop
            "crop": "center" if imagenet else "none",  # none: the whole image resized to a square
            "interpolation": "bilinear",
            "mean": self.mean,  # after scaling pixels to [0, 1]
            "std": self.std,
        }

    def __call__(self, img):
        return self.transforms(img)


def normalization(preset: Preset) -> tuple[list[float], list[float]]:
    """(mean, std) per channel of the preset's float stage, after scaling pixels to [0, 1]."""
    _check_preset(preset)
    if preset == "imagenet":
        return list(IMAGENET_MEAN), list(IMAGENET_STD)
    return [0.0, 0.0, 0.0], [1.0, 1.0, 1.0]


def with_short_forms(transform, key: str, preset: Preset | None, image_size: int | None) -> tuple[object, list[str]]:
    """`transform` (the data.`key`) with the DataModule's short forms data.preset and data.image_size, where set, over
    a shipped preset's own: (the transform, the `key.arg=value`s they replace). A side they change resets an
    evaluation preset's resize_size to its usual ratio. Refused for another transform, which has no such arguments."""
    if preset is None and image_size is None:
        return transform, []
    if not isinstance(transform, ClassificationPresetTrain | ClassificationPresetEval):
        raise ValueError(f"data.preset and data.image_size are short forms for the shipped presets, and {key} is "
                         f"{type(transform).__name__}: set its own arguments (docs/EXTENDING.md, Transforms)")
    changes = {k: v for k, v in (("preset", preset), ("image_size", image_size)) if v is not None}
    own = transform.init_args
    replaced = [f"{key}.{k}={own[k]}" for k, v in changes.items() if own[k] not in (None, v)]
    resize = own.get("resize_size")
    if resize is not None and image_size not in (None, transform.image_size):
        changes["resize_size"] = None
        replaced.append(f"{key}.resize_size={resize}")
    return transform.replace(**changes), replaced


def _plain(image_size: int) -> list:
    """Resize to a square (so batches stack); no augmentation. `float_stage` rescales pixels to [0, 1]."""
    return [v2.PILToTensor(), v2.Resize((image_size, image_size), antialias=True)]


def check_fast_decode(preset: str, fast_decode: bool) -> None:
    _check_preset(preset)
    if fast_decode and preset != "imagenet":
        raise ValueError(f"data.fast_decode speeds up the random crops of preset imagenet; preset {preset!r} has "
                         "none: set data.fast_decode false")


def _check_preset(preset: str) -> None:
    if preset not in PRESETS:
        raise ValueError(f"data.preset={preset!r} is unknown; choose one of {', '.join(PRESETS)}")


def check_schedule(schedule: dict[int, int] | None, train_size: int | None) -> dict[int, int] | None:
    """data.progressive_resizing, checked and sorted by epoch: {epoch: side}, each side within [32, train_size] (the
    training transform's image_size; unbounded above when it states none)."""
    if not schedule:
        return None
    schedule = {int(epoch): int(side) for epoch, side in schedule.items()}
    bad = {e: s for e, s in schedule.items() if e < 0 or not 32 <= s <= (train_size or s)}
    if bad:
        raise ValueError(f"data.progressive_resizing has entries {bad}: epochs must be >= 0 and sides between 32 and "
                         f"data.train_transform.image_size={train_size} (the loaders' crop size, which batches are "
                         "resized from)")
    return dict(sorted(schedule.items()))
