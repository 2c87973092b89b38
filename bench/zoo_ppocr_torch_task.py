"""A zoo task on a third-party depthwise CNN in PyTorch: PP-OCRv4's text detector (DBNet on a
PP-LCNetV3 backbone: depthwise convolutions, hard-swish, learnable affine blocks), the ONNX file
that the ``rapidocr_onnxruntime`` wheel ships, converted to a ``torch.fx`` module with real
``nn.Conv2d`` layers by ``slimline.compress.qat.onnx_module.to_torch`` (outputs equal ONNX Runtime's to cosine
0.99999994), so that QAT can train it.

Inputs are 160 x 160 squares preprocessed as rapidocr does (``zoo_inputs.ppocr_det``; the zoo
uses 320, a quarter of the pixels keeps QAT's training steps affordable on 2 shared cores):
- evaluation: the zoo's evaluation images (squares of the scanned page's lower half; not its
  text-free photo, see ``_zoo_images``) plus pages of rendered text (sentences of gensim's Lee corpus ``lee.cor`` on
  squares of the zoo's evaluation photos);
- calibration: the zoo's calibration images plus rendered pages of ``lee_background.cor`` sentences
  on the calibration photos;
- training (distillation, no labels): more rendered pages like the calibration ones, other seeds.
Nothing is downloaded: the photos and the scan come with scikit-image, the text with gensim, the
font with Pillow.

The metric is the text-mask IoU against FP32: pixels whose text probability exceeds 0.3
(rapidocr's ``DetPostProcess`` threshold), intersection over union with FP32's mask over the
whole evaluation set.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import numpy as np
import onnx
import torch
from PIL import Image, ImageDraw, ImageFont

import zoo_inputs as zi
from slimline.compress.qat.onnx_module import to_torch

METRIC_NAME = "text_mask_iou"
OUTPUT_KIND = "other"
LEARNING_RATE = 1e-3  # QAT trains at its lr_scale of this

SIDE, THRESHOLD = 160, 0.3
BATCH = int(os.environ.get("PPOCR_BATCH", "4"))  # rows a batch (training steps see one)
CALIB_PAGES, EVAL_PAGES = 16, 8
TRAIN_PAGES = int(os.environ.get("PPOCR_TRAIN_PAGES", "192"))  # rendered pages QAT distils on


def _package_file(name: str) -> Path:
    import importlib.util

    spec = importlib.util.find_spec(name.split("/")[0])
    assert spec is not None and spec.submodule_search_locations, f"{name} is not installed"
    return Path(next(iter(spec.submodule_search_locations))).joinpath(*name.split("/")[1:])


@cache
def model() -> torch.nn.Module:
    path = _package_file("rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx")
    return to_torch(onnx.load(str(path)))


@cache
def _sentences(corpus: str) -> list[str]:
    text = _package_file(f"gensim/test/test_data/{corpus}").read_text(errors="ignore")
    words = text.split()
    return [" ".join(words[i : i + 6]) for i in range(0, len(words) - 6, 6)]


def render_page(seed: int, corpus: str, photos: tuple[str, ...]) -> np.ndarray:
    """A 320 x 320 RGB page (scaled to ``SIDE`` by the preprocessing): lines of dark or light text at random sizes and places on a square
    of one of ``photos`` (washed out, so the text stays legible) or on plain paper."""
    rng = random.Random(seed)
    if rng.random() < 0.7:
        bg = zi.resize(zi.center_square(zi.photo(rng.choice(photos))), 320, 320)
        wash = rng.uniform(0.3, 0.8)
        canvas = (bg * (1 - wash) + 235 * wash).astype(np.uint8)
    else:
        canvas = np.full((320, 320, 3), rng.randint(200, 255), np.uint8)
    img = Image.fromarray(canvas)
    draw = ImageDraw.Draw(img)
    lines = _sentences(corpus)
    y = rng.randint(0, 20)
    while y < 320 - 12:
        size = rng.randint(12, 34)
        ink = rng.randint(0, 70)
        draw.text(
            (rng.randint(-20, 60), y),
            rng.choice(lines),
            fill=(ink, ink, ink),
            font=ImageFont.load_default(size=size),
        )
        y += int(size * rng.uniform(1.3, 2.6))
    return np.asarray(img)


def _pages(seeds: range, corpus: str, photos: tuple[str, ...]) -> np.ndarray:
    return np.stack([zi.ppocr_det(render_page(s, corpus, photos), SIDE) for s in seeds])


def _zoo_images() -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The text images of ``zoo_inputs.ppocr_det_inputs``: (calibration, evaluation) squares of
    the scanned page. Its text-free photos are left out: the detector's map of them is ~0
    everywhere, where cosine to FP32 measures noise (ONNX Runtime and PyTorch, both FP32, differ
    by at most 3e-5 there, yet their cosine is 0.43)."""
    page = zi.photo("page")
    half = len(page) // 2
    return zi.square_crops(page[:half]), zi.square_crops(page[half:])


@cache
def _rows() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(calibration, evaluation, training) rows."""
    zoo_calib, zoo_eval = (
        np.stack([zi.ppocr_det(i, SIDE) for i in imgs]) for imgs in _zoo_images()
    )
    calib = _pages(range(CALIB_PAGES), "lee_background.cor", zi.CALIB_PHOTOS)
    evaluation = _pages(range(10_000, 10_000 + EVAL_PAGES), "lee.cor", zi.EVAL_PHOTOS)
    train = _pages(range(1_000, 1_000 + TRAIN_PAGES), "lee_background.cor", zi.CALIB_PHOTOS)
    return (
        np.concatenate([zoo_calib, calib]),
        np.concatenate([zoo_eval, evaluation]),
        train,
    )


def _batches(rows: np.ndarray) -> Iterator[dict[str, np.ndarray]]:
    for i in range(0, len(rows), BATCH):
        yield {"x": rows[i : i + BATCH]}


def calibration_data() -> Iterator[dict[str, np.ndarray]]:
    return _batches(_rows()[0])


def train_data() -> Iterator[tuple[dict[str, np.ndarray], None]]:
    """Unlabelled rendered pages: QAT distils from the FP32 detector's maps."""
    rows = _rows()[2]
    return ((b, None) for b in _batches(rows))


def eval_data() -> Iterator[tuple[dict[str, np.ndarray], np.ndarray]]:
    """Evaluation rows labelled with FP32's text mask."""
    fp32 = model()
    for batch in _batches(_rows()[1]):
        with torch.no_grad():
            prob = fp32(torch.from_numpy(batch["x"])).numpy()
        yield batch, prob > THRESHOLD


def metric(outputs: np.ndarray, labels: np.ndarray) -> float:
    mask, ref = np.asarray(outputs) > THRESHOLD, np.asarray(labels).astype(bool)
    union = np.logical_or(mask, ref).sum()
    return float(np.logical_and(mask, ref).sum() / union) if union else 1.0
