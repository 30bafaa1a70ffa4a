"""Each extractor: real MiniLM, pixels, HOG, vectors; open_clip (random weights) under -m image."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
from PIL import Image

from indknn_cli.errors import BadInputError
from indknn_cli.extractors import (ClipImageExtractor, HogExtractor, PixelsExtractor, TextExtractor,
                                   VectorsExtractor, extractor_from_info, get_extractor, resolve_device)
from indknn_cli.store import ExtractorInfo, normalize_rows

HAS_OPEN_CLIP = importlib.util.find_spec("open_clip") is not None
TINY_CLIP = "ViT-S-32-alt"  # ~23M-parameter image tower, builds in well under a second


@pytest.fixture(scope="module")
def minilm():
    return get_extractor("text", device="cpu")


def digit_images(tmp_path, n=4, size=28):
    rng = np.random.default_rng(0)
    paths = []
    for i in range(n):
        arr = (rng.random((size, size)) * 255).astype(np.uint8)
        arr[size // 4: 3 * size // 4, size // 2 - 1: size // 2 + 1] = 255  # a "1"
        p = tmp_path / f"img{i}.png"
        Image.fromarray(arr).save(p)
        paths.append(p)
    return paths


# -- text -------------------------------------------------------------------------
def test_minilm_on_a_few_sentences(minilm):
    assert isinstance(minilm, TextExtractor)
    assert minilm.info.name == "text" and minilm.info.model == "all-MiniLM-L6-v2"
    assert minilm.info.version.startswith("sentence-transformers-")
    assert minilm.input_kind == "text" and minilm.dim == 384
    x = minilm.embed([
        "The stock market fell sharply today.",
        "Shares dropped steeply on Wall Street this afternoon.",
        "The striker scored twice in the cup final.",
    ])
    assert x.shape == (3, 384) and x.dtype == np.float32
    u = normalize_rows(x)
    sim = u @ u.T
    assert sim[0, 1] > sim[0, 2] + 0.2 and sim[0, 1] > sim[1, 2] + 0.2
    assert minilm.embed([]).shape == (0, 384)


def test_minilm_is_deterministic_and_rebuilt_from_info(minilm):
    s = ["Same text twice."]
    again = extractor_from_info(minilm.info, device="cpu")
    assert again.info == minilm.info
    np.testing.assert_allclose(again.embed(s), minilm.embed(s), rtol=1e-5, atol=1e-6)


def test_text_model_must_be_a_local_folder(tmp_path):
    with pytest.raises(BadInputError, match="not a local folder"):
        get_extractor("text", model="some-org/some-model-to-download")
    (tmp_path / "notamodel").mkdir()
    with pytest.raises(BadInputError, match="cannot load text model"):
        get_extractor("text", model=str(tmp_path / "notamodel"), device="cpu")


def test_text_refuses_non_strings(minilm):
    with pytest.raises(BadInputError, match="not a string"):
        minilm.embed(["ok", 3])


# -- pixels / hog -------------------------------------------------------------------
def test_pixels(tmp_path):
    ex = get_extractor("pixels")
    assert isinstance(ex, PixelsExtractor) and ex.dim == 784 and ex.input_kind == "image"
    assert ex.info.model == "pixels-28" and ex.info.version.startswith("pillow-")
    paths = digit_images(tmp_path)
    x = ex.embed(paths)
    assert x.shape == (4, 784) and x.dtype == np.float32
    np.testing.assert_allclose(x[0], np.asarray(Image.open(paths[0]), dtype=np.float32).ravel() / 255.0)
    assert 0.0 <= x.min() and x.max() <= 1.0
    # colour and other sizes: grayscale, resized
    big = Image.open(paths[1]).convert("RGB").resize((56, 56))
    assert ex.embed([big]).shape == (1, 784)
    assert get_extractor("pixels", model="pixels-16").dim == 256


def test_hog(tmp_path):
    from skimage.feature import hog

    ex = get_extractor("hog")
    assert isinstance(ex, HogExtractor) and ex.dim == 324 and ex.info.model == "hog-28"
    assert "orientations=9" in ex.info.version and ex.info.version.startswith("skimage-")
    paths = digit_images(tmp_path)
    x = ex.embed(paths)
    assert x.shape == (4, 324) and x.dtype == np.float32
    g = np.asarray(Image.open(paths[0]).convert("L"), dtype=np.float32) / 255.0
    ref = hog(g, orientations=9, pixels_per_cell=(7, 7), cells_per_block=(2, 2), block_norm="L2-Hys")
    np.testing.assert_allclose(x[0], ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(ex.embed(paths), x)  # data-independent, deterministic
    assert not np.allclose(x[0], x[1])


def test_image_model_specs_are_checked():
    with pytest.raises(BadInputError, match="pixels-28"):
        get_extractor("pixels", model="pixels")
    with pytest.raises(BadInputError, match="multiple of 4"):
        get_extractor("hog", model="hog-30")
    with pytest.raises(BadInputError, match="ARCH:/path"):
        get_extractor("image", model=TINY_CLIP)
    with pytest.raises(BadInputError, match="--extractor must be one of"):
        get_extractor("fancy")


def test_unreadable_image_is_named(tmp_path):
    bad = tmp_path / "broken.png"
    bad.write_bytes(b"this is not a png")
    for name in ("pixels", "hog"):
        with pytest.raises(BadInputError, match="broken.png"):
            get_extractor(name).embed([bad])
    with pytest.raises(BadInputError, match="not found"):
        get_extractor("pixels").embed([tmp_path / "missing.png"])


# -- vectors ------------------------------------------------------------------------
def test_vectors_pass_through():
    ex = get_extractor("vectors")
    assert isinstance(ex, VectorsExtractor) and ex.dim is None and ex.input_kind == "vector"
    assert ex.info == ExtractorInfo("vectors", "precomputed", "passthrough")
    x = np.arange(12, dtype=np.float64).reshape(3, 4)
    out = ex.embed(x)
    assert out.dtype == np.float32 and ex.dim == 4
    np.testing.assert_array_equal(out, x.astype(np.float32))  # no normalisation here: the caller does it
    with pytest.raises(BadInputError, match="d=5"):
        ex.embed(np.ones((2, 5)))
    with pytest.raises(BadInputError, match="2-d"):
        get_extractor("vectors").embed(np.ones(3))
    assert get_extractor("vectors", model="my-encoder-v2").info.model == "my-encoder-v2"
    assert extractor_from_info(ExtractorInfo("vectors", "precomputed", "passthrough"), dim=7).dim == 7


def test_device_resolution():
    import torch

    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(BadInputError):
        resolve_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(BadInputError, match="no CUDA"):
            resolve_device("cuda")


@pytest.mark.skipif(HAS_OPEN_CLIP, reason="open_clip is installed here")
def test_image_extractor_without_open_clip_says_how_to_install():
    with pytest.raises(BadInputError, match=r"indknn\[image\]"):
        get_extractor("image", model=f"{TINY_CLIP}:random")


# -- open_clip (only in the image venv: `make test` runs `pytest -m image` there) ----
@pytest.mark.image
def test_open_clip_random_weights_and_checkpoint(tmp_path):
    import torch

    from indknn_cli import extractors

    ex = get_extractor("image", model=f"{TINY_CLIP}:random", device="cpu")
    assert isinstance(ex, ClipImageExtractor) and ex.input_kind == "image"
    assert ex.info.model == f"{TINY_CLIP}:random" and ex.info.version.startswith("open_clip-")
    paths = digit_images(tmp_path, n=3)
    x = ex.embed(paths)
    assert x.shape == (3, ex.dim) and ex.dim == 256 and x.dtype == np.float32
    assert np.isfinite(x).all()
    # seeded: the same random model in a fresh build (what serve-queries rebuilds from the store)
    extractors._CACHE.clear()
    again = extractor_from_info(ex.info, device="cpu")
    np.testing.assert_allclose(again.embed(paths), x, rtol=1e-4, atol=1e-5)
    # a local checkpoint file of that model gives the same features
    ckpt = tmp_path / "tiny.pt"
    torch.save(again._model.state_dict(), ckpt)
    from_file = get_extractor("image", model=f"{TINY_CLIP}:{ckpt}", device="cpu")
    assert from_file.info.model == f"{TINY_CLIP}:{ckpt.resolve()}"
    assert "ckpt-sha256-" in from_file.info.version
    np.testing.assert_allclose(from_file.embed(paths), x, rtol=1e-4, atol=1e-5)
    with pytest.raises(BadInputError, match="not found"):
        get_extractor("image", model=f"{TINY_CLIP}:{tmp_path / 'missing.pt'}")
    with pytest.raises(BadInputError, match="no architecture"):
        get_extractor("image", model="NoSuchArch:random")


@pytest.mark.image
def test_open_clip_into_a_store(tmp_path):
    from indknn_cli.embedding import embed_into_store
    from indknn_cli.store import FeatureStore

    for cls in ("0", "1"):
        (tmp_path / "imgs" / cls).mkdir(parents=True)
        for p in digit_images(tmp_path, n=2):
            p.rename(tmp_path / "imgs" / cls / p.name)
    res = embed_into_store(tmp_path / "imgs", store_path=tmp_path / "s.zarr", role="private",
                           extractor="image", model=f"{TINY_CLIP}:random", device="cpu", label_names=["0", "1"])
    assert res.rows_added == 4 and res.dim == 256
    s = FeatureStore.open(tmp_path / "s.zarr")
    np.testing.assert_allclose(np.linalg.norm(s.read("private", "features"), axis=1), 1.0, rtol=1e-5)
    assert s.label_names == ["0", "1"]
