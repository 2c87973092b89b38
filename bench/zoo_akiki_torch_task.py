"""A zoo task on a third-party PyTorch model: akiki's CNN + GRU voice-activity detector
(``akiki.models/akiki-vad.pt``, a state dict for ``akiki._torch.AkikiModel``), on the CMU ARCTIC
utterance of ``pysptk``'s sdist, streamed as akiki's ``VoiceActivityDetector.push`` does (320
samples of context + 256 new ones, the GRU state carried from window to window).

``model()`` returns one cached module on every call, as tasks that load their weights once do.
The module returns the speech probability; the GRU state is an input, taken batch-first
([batch, 1, 128]) and handed to the GRU as [1, batch, 128]. The metric is the share of windows
whose speech decision (probability > 0.5, akiki's fixed threshold) agrees with FP32's.
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import numpy as np
import torch
from torch import nn

METRIC_NAME = "vad_agreement"
OUTPUT_KIND = "other"

SPEECH_SDIST = "pysptk-1.0.1.tar.gz"
SPEECH_MEMBER = "pysptk-1.0.1/pysptk/example_audio_data/arctic_a0007.wav"
CHUNK, CONTEXT, BATCH = 256, 320, 16


class SpeechProbability(nn.Module):
    """akiki's model with a batch-first state and one output, the speech probability."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, audio: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        probability, _ = self.inner(audio, state.transpose(0, 1).contiguous())
        out: torch.Tensor = probability.unsqueeze(1)
        return out


def _package() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("akiki")
    assert spec is not None and spec.submodule_search_locations, "akiki is not installed"
    return Path(next(iter(spec.submodule_search_locations)))


@cache
def _akiki() -> nn.Module:
    from akiki._torch import AkikiModel  # the package's own module, weights in its wheel

    ckpt = torch.load(_package() / "models" / "akiki-vad.pt", map_location="cpu", weights_only=True)
    release = json.loads((_package() / "models" / "release.json").read_text())
    assert ckpt["spec"]["kind"] == "gru" and ckpt["spec"]["hidden"] == 128, release
    inner = AkikiModel(ckpt["spec"]["hidden"])
    inner.load_state_dict(ckpt["state_dict"], strict=True)
    module: nn.Module = inner.eval()
    return module


@cache
def model() -> nn.Module:
    return SpeechProbability(_akiki()).eval()


@cache
def _windows() -> tuple[np.ndarray, np.ndarray]:
    """Every window of the utterance and the GRU state it is fed, from the FP32 model."""
    from scipy.io import wavfile

    default = Path(__file__).resolve().parent / "zoo" / "data"
    sdist = Path(os.environ.get("SLIMLINE_ZOO_DATA", default)) / SPEECH_SDIST
    with tarfile.open(sdist) as tar:
        member = tar.extractfile(SPEECH_MEMBER)
        assert member is not None
        _, wav = wavfile.read(io.BytesIO(member.read()))
    audio = wav.astype(np.float32) / 32768.0
    inner, ctx = _akiki(), np.zeros(CONTEXT, np.float32)
    state = torch.zeros(1, 1, 128)  # the release's GRU width (spec "hidden")
    windows, states = [], []
    with torch.no_grad():
        for start in range(0, len(audio) - CHUNK + 1, CHUNK):
            window = np.concatenate([ctx, audio[start : start + CHUNK]])
            windows.append(window)
            states.append(state[:, 0].numpy().copy())
            _, state = inner(torch.from_numpy(window[None]), state)
            ctx = window[-CONTEXT:]
    return np.stack(windows), np.stack(states)


def _batches(part: slice) -> Iterator[dict[str, np.ndarray]]:
    windows, states = _windows()
    windows, states = windows[part], states[part]
    for i in range(0, len(windows), BATCH):
        yield {"audio": windows[i : i + BATCH], "state": states[i : i + BATCH]}


def calibration_data() -> Iterator[dict[str, np.ndarray]]:
    """The utterance's first half."""
    return _batches(slice(0, len(_windows()[0]) // 2))


def eval_data() -> Iterator[tuple[dict[str, np.ndarray], np.ndarray]]:
    """The second half, labelled with FP32's speech decisions."""
    fp32 = model()
    for batch in _batches(slice(len(_windows()[0]) // 2, None)):
        with torch.no_grad():
            p = fp32(**{k: torch.from_numpy(v) for k, v in batch.items()}).numpy()
        yield batch, p > 0.5


def metric(outputs: np.ndarray, labels: np.ndarray) -> float:
    return float(((np.asarray(outputs) > 0.5) == np.asarray(labels)).mean())
