"""Each private record's *content key*: a hash of that record's own input and label, and of nothing else.

The private search (``index --tune private``) deals records into shards by a public coin of this key, and the
score's sensitivity of 1 rests on one record's key never depending on another record (docs/TUNING.md, "The base
run"). Two earlier keys broke that:

* the record id (audit 4, F1): ``embed`` numbers rows without an id column by their position, so leaving one
  person out renamed every later record;
* the stored float32 vector (audit 5, F1): the text extractor embedded rows in padded batches, so a row's vector
  changed in its last bits with the rows that shared its batch (it now embeds each text alone); leaving one person out of 1,200 texts changed
  the vector bytes, hence the shard, of 68 *other* records, and the un-noised score moved by up to 9.

So ``embed`` hashes what the record *is* before any model reads it: the text, the image file's bytes or the
vector as given, with the label (HMAC-SHA256 under the store's random salt), and stores the key beside the row (array ``private/content_key``, FORMAT.md).
Rows appended with their vectors directly (``FeatureStore.append``, bench, tests) are keyed by the vector they
were given, which is then their input. Erasure blanks the key with the row; compaction carries it.

Stores made before the key existed have no such array. Their vectors are a function of the row alone for the
row-wise extractors (:data:`ROW_WISE`), whose key is then the stored vector's hash; for the others (``text``,
``image``) the private search is refused: the vector bytes are not a key.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from .errors import BadInputError
from .wording import count

#: The store array holding each private row's key (64 hex digits; "" = not recorded).
KEY_ARRAY = "content_key"
#: Root attribute of a store that records keys: the random salt of its keyed hash (HMAC-SHA256). Drawn when the
#: store is created, before any record (so a key still depends on its record alone), and carried by compaction.
#: A key is then no plain hash of a text that anyone could recompute without the store, and one person's keys do
#: not link across stores. It is in the store beside the vectors: it does not hide a record from whoever holds
#: the store (its vector does not either).
SALT_ATTR = "content_key_salt"
#: Extractors whose stored vector is a function of its own input row only (no batch, no padding): a vector's
#: bytes then identify the record as well as its input does.
ROW_WISE = frozenset({"vectors", "hog", "pixels"})
_DOMAIN = b"indknn-record-key-v1\0"


def new_salt() -> str:
    return secrets.token_hex(32)


def _digest(salt: str | None, data: bytes) -> str:
    if salt is None:
        return hashlib.sha256(data).hexdigest()
    return hmac.new(bytes.fromhex(salt), data, hashlib.sha256).hexdigest()


def _item_bytes(item: Any) -> bytes:
    """The input as the extractor receives it, as bytes: text (UTF-8), an image file's bytes, a vector's values."""
    if isinstance(item, str):
        return b"text\0" + item.encode("utf-8", "surrogatepass")
    if isinstance(item, (bytes, bytearray, memoryview)):
        return b"bytes\0" + bytes(item)
    if isinstance(item, (os.PathLike, Path)):
        try:
            return b"file\0" + Path(item).read_bytes()
        except OSError as exc:
            raise BadInputError(f"{item}: cannot read the file ({exc.strerror or type(exc).__name__})") from None
    arr = np.asarray(item)
    if arr.dtype.kind not in "biuf":
        raise BadInputError(f"cannot key an input item of type {type(item).__name__}")
    arr = np.ascontiguousarray(arr, dtype=np.float64)
    return b"vector\0" + str(arr.shape).encode() + b"\0" + arr.tobytes()


def input_keys(items: Any, labels: Sequence[int], *, salt: str | None = None) -> list[str]:
    """One key per input item: the keyed hash (``salt``: the store's) of the item's own bytes and its label index
    (``embed``'s private rows)."""
    rows = list(items) if not isinstance(items, np.ndarray) else [items[i] for i in range(items.shape[0])]
    labs = np.asarray(labels, np.int64).reshape(-1)
    if len(rows) != labs.size:
        raise BadInputError(f"record keys: {len(rows)} input items but {labs.size} labels")
    return [_digest(salt, _DOMAIN + int(lab).to_bytes(8, "little", signed=True) + _item_bytes(it))
            for it, lab in zip(rows, labs)]


def vector_keys(features, labels, *, salt: str | None = None) -> list[str]:
    """One key per vector: the keyed hash (``salt``: the store's; None: plain sha256) of its float32 bytes and its
    label (rows given as vectors)."""
    x = np.ascontiguousarray(features, np.float32)
    y = np.asarray(labels, np.int64).reshape(-1)
    if x.ndim != 2 or x.shape[0] != y.shape[0]:
        raise BadInputError(f"record keys: {x.shape[0] if x.ndim else 0} feature rows but {y.shape[0]} labels")
    return [_digest(salt, int(lab).to_bytes(8, "little", signed=True) + row.tobytes()) for row, lab in zip(x, y)]


def stored_keys(*, keys: np.ndarray | None, features: np.ndarray, labels: np.ndarray, extractor: str,
                where: str) -> list[str]:
    """The keys of some private rows of a store: ``keys`` as stored (None: the store has no key array).

    A row without a recorded key falls back to its vector's hash only under a row-wise extractor; otherwise the
    private search cannot deal it fairly and is refused (exit 2), naming what to do instead."""
    n = int(np.asarray(labels).shape[0])
    out = [""] * n if keys is None else [str(k) for k in keys]
    missing = [i for i, k in enumerate(out) if not k]
    if not missing:
        return out
    if extractor not in ROW_WISE:
        raise BadInputError(
            f"{where}: {count(len(missing), 'private row')} without a recorded content key (the store was written "
            f"before indknn recorded one). Its extractor {extractor!r} embedded rows in batches then, so a vector's bytes "
            "depend on the rows embedded with it and cannot deal the private search's shards: re-embed the private rows "
            "into a new store, or tune on public rows (--tune public), or give --tau and --sigma2")
    sub = np.asarray(missing, np.int64)
    for i, k in zip(missing, vector_keys(np.asarray(features)[sub], np.asarray(labels)[sub])):
        out[i] = k
    return out
