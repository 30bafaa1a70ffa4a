"""What every `indknn embed` reader shares: defaults, the batch type, the Source protocol (readers.py opens them)."""

from __future__ import annotations

import csv
import hashlib
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from .errors import BadInputError
from .id_text import is_canonical
from .wording import shown

DEFAULT_TEXT_COLUMN = "text"
DEFAULT_LABEL_COLUMN = "label"
DEFAULT_IMAGE_COLUMN = "path"
DEFAULT_VECTOR_COLUMN = "vector"
DEFAULT_ID_COLUMN = "id"  # used when the input has such a column; --id-column "" generates ids instead
DEFAULT_USER_COLUMN = "user"  # likewise; --user-column "" reads no user ids
NPZ_DEFAULTS = {"x": "x", "label": "y", "id": "ids", "user": "users"}
TEXT_JOINER = ". "

TABLE_SUFFIXES = {".csv": "csv", ".tsv": "csv", ".parquet": "parquet", ".pq": "parquet",
                  ".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl"}

csv.field_size_limit(2**31 - 1)


@dataclass
class RecordBatch:
    """One batch of input rows. ``start`` is the 0-based index of the first row in the input."""

    items: Any  # list[str] texts | list[Path] images | np.ndarray [n, d] vectors
    labels: list[str] | None
    ids: list[str] | None
    users: list[str] | None
    start: int = 0

    def __len__(self) -> int:
        return len(self.items)


#: C0 and C1 controls, and invisible format characters (zero-width, direction marks, byte-order mark): an id holding
#: one looks like another id it is not (review 40, L4: "x\u200b" beside "x").
#: Also the soft hyphen, the Arabic letter mark, the Mongolian vowel separator, line and paragraph separators, the
#: bidi isolates, interlinear annotation marks and the tag characters (review 69, F5).
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u00ad\u061c\u180e\u200b-\u200f\u2028-\u202e\u2060-\u2069"
                      "\ufeff\ufff9-\ufffb\U000e0000-\U000e007f]")
#: Batch ids (operator-chosen names) also refuse what renders as nothing in them: the combining grapheme joiner,
#: Hangul fillers, Khmer vowel inherents, variation selectors, the braille blank, musical formatting (review 70,
#: F3). Not record ids: a variation selector belongs to emoji ids such as "❤️", which embed takes.
_BATCH_INVISIBLE = re.compile("[\u034f\u115f\u1160\u17b4\u17b5\u180b-\u180f\u2800\u3164\ufe00-\ufe0f"
                              "\uffa0\U0001d173-\U0001d17a\U000e0100-\U000e01ef]")
#: Spaces other than U+0020 (no-break and the like), refused in batch ids: "day 1" with U+00A0 looks like "day 1".
_OTHER_SPACE = re.compile(r"[^\S ]")


def check_batch_id(batch_id: str, *, option: str = "--batch-id") -> None:
    """Refuse a batch id holding a control or invisible character, as record ids are (review 66, F4: a tab was
    taken, echoed in every answer line and written as "_" in the event file's name)."""
    if m := (_CONTROL.search(batch_id) or _BATCH_INVISIBLE.search(batch_id)):
        raise BadInputError(f"{option} {shown(batch_id)} holds the control character U+{ord(m.group()):04X} (a "
                            "control or invisible character); batch ids must be printable text")
    if m := _OTHER_SPACE.search(batch_id):  # review 70, F3
        raise BadInputError(f"{option} {shown(batch_id)} holds the space character U+{ord(m.group()):04X}, which "
                            "looks like another; batch ids take the plain space (U+0020) only")
    # review 69, F5: "day1 " or a decomposed "é" was another batch: charged again instead of printed again
    if batch_id != batch_id.strip():
        raise BadInputError(f"{option} {shown(batch_id)} starts or ends with a space; batch ids are taken as typed, "
                            "so it would name another batch than the one without it: leave the space out")
    if unicodedata.normalize("NFC", batch_id) != batch_id:
        raise BadInputError(f"{option} {shown(batch_id)} is not in Unicode NFC form (a letter and its accent as two "
                            "characters); type it composed, as another spelling would name another batch")


def check_key_text(values, *, what: str, display: str, start: int, surrounding_space: bool = False,
                   composed: bool = False) -> None:
    """Refuse a record or user id holding a control character (BadInputError naming the row and the character).

    The store keeps ids as fixed-width Unicode, which drops trailing NULs: ``"r1\x00"`` became ``"r1"``, a second
    live row of record r1 under another user, and every later serve was refused until both were erased (review 37,
    F1); an id of NULs alone became ``""``, the id erased rows carry. Other control characters (tab, newline) make
    an id that `delete --ids-file` and CSV exports cannot carry.

    ``surrounding_space`` (the library's append): also refuse leading or trailing whitespace, Unicode spaces
    included. `embed`'s readers trim ids, and `delete`/`account` trim the ids asked for; a store made through the
    library with ids "a" and "a " had `delete --record "a "` erase "a", another person (review 39, F1).

    ``composed`` (the library's append of private and public rows): refuse an id not in Unicode NFC form (`embed`
    composes them: :mod:`.id_text`; a query's id is released as written)."""
    if values is None:
        return
    for j, v in enumerate(values):
        if v is None:
            continue
        if m := _CONTROL.search(v):
            raise BadInputError(f"{display}: row {start + j + 1}: {what} {shown(v)} holds the control character "
                                f"U+{ord(m.group()):04X} (a control or invisible character); ids must be printable text")
        if surrounding_space and v != v.strip():
            raise BadInputError(f"{display}: row {start + j + 1}: {what} {shown(v)} starts or ends with whitespace; "
                                "ids are stored trimmed (as `embed` reads them)")
        if composed and not is_canonical(v):  # review 53, F2: one id, one spelling (id_text)
            raise BadInputError(f"{display}: row {start + j + 1}: {what} {shown(v)} is not in Unicode NFC form; ids are "
                                "stored composed (as `embed` stores them): pass unicodedata.normalize('NFC', id)")


def _label_str(v: Any) -> str:
    if isinstance(v, (bool, np.bool_)):
        return str(bool(v))
    if isinstance(v, (int, np.integer)):
        return str(int(v))
    if isinstance(v, (float, np.floating)) and float(v).is_integer():
        return str(int(v))
    if isinstance(v, bytes):
        return v.decode("utf-8")
    return str(v).strip()


def _has_surrogates(s: str) -> bool:
    try:
        s.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


class Source:
    """Base class of the readers (see :func:`open_source`)."""

    kind = ""
    name = ""
    columns: list[str] | None = None

    def __init__(self, *, extractor_kind: str, batch_rows: int):
        if extractor_kind not in ("text", "image", "vector"):
            raise BadInputError(f"extractor kind must be text, image or vector, got {extractor_kind!r}")
        if batch_rows <= 0:
            raise BadInputError(f"--batch-size (rows read and embedded per batch) must be positive, got {batch_rows}")
        self.extractor_kind = extractor_kind
        self.batch_rows = int(batch_rows)
        self._labels: list[str] | None = None
        self._count: int | None = None
        self._cleanup: list[Path] = []
        self.bytes_path: Path | None = None  # the file whose bytes identify the input (sha256)

    # -- interface ---------------------------------------------------------
    @property
    def has_labels(self) -> bool:
        raise NotImplementedError

    def label_values(self) -> list[str] | None:
        """Distinct labels present (first-seen order); ``None`` when the input has no labels."""
        raise NotImplementedError

    def batches(self) -> Iterator[RecordBatch]:
        raise NotImplementedError

    def count(self) -> int | None:
        """Number of rows (may scan the input once; ``None`` if unknown)."""
        return self._count

    def missing_labels_message(self) -> str:
        return f"{self.name}: no labels in this input"

    def sha256(self) -> str:
        """Hash of the input's bytes (stdin: of the spooled bytes)."""
        h = hashlib.sha256()
        assert self.bytes_path is not None
        with open(self.bytes_path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        return h.hexdigest()

    def close(self) -> None:
        for p in self._cleanup:
            try:
                p.unlink()
            except OSError:
                pass
        self._cleanup.clear()

    def __enter__(self) -> "Source":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


