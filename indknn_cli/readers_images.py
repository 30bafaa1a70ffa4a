"""Image folders for `indknn embed`: one sub-folder per class, or a flat folder of images (no labels)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Iterator, Sequence

from .errors import BadInputError
from .extractors import IMAGE_EXTENSIONS
from .readers_base import RecordBatch, Source

# ---------------------------------------------------------------------------
# image folders
# ---------------------------------------------------------------------------
def _numeric_sorted(names: Sequence[str]) -> list[str]:
    try:
        return sorted(names, key=lambda s: (int(s), s))
    except ValueError:
        return sorted(names)


def _image_files(folder: Path) -> list[Path]:
    out = []
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        for fn in sorted(filenames):
            if not fn.startswith(".") and Path(fn).suffix.lower() in IMAGE_EXTENSIONS:
                out.append(Path(dirpath) / fn)
    return out


class ImageFolderSource(Source):
    """One sub-folder per class (labels = folder names), or a flat folder of images (no labels).

    Record ids are the folder's name and the file's path below it
    (``mnist/3/test-00012.png``), so that re-embedding a grown folder with
    ``--if-exists skip`` adds only the new files.
    """

    kind = "image-folder"

    def __init__(self, folder: Path, *, extractor_kind: str, batch_rows: int):
        super().__init__(extractor_kind=extractor_kind, batch_rows=batch_rows)
        if extractor_kind != "image":
            raise BadInputError(f"{folder} is a folder: a folder is read only as images, with an image extractor "
                                f"(--extractor pixels, hog or image); give the file itself (.npy, .parquet, .csv, …)")
        self.folder = folder
        self.name = str(folder)
        subdirs = [d for d in folder.iterdir() if d.is_dir() and not d.name.startswith(".")]
        top = [p for p in folder.iterdir() if p.is_file() and not p.name.startswith(".")
               and p.suffix.lower() in IMAGE_EXTENSIONS]
        class_dirs = [d for d in subdirs if _image_files(d)]
        if class_dirs and top:
            raise BadInputError(f"{folder}: has both image files and class sub-folders; use one layout "
                                f"(one sub-folder per class, or a flat folder for unlabelled images)")
        if class_dirs:
            self.classes: list[str] | None = _numeric_sorted([d.name for d in class_dirs])
            self.files = [(p, c) for c in self.classes for p in _image_files(folder / c)]
        else:
            self.classes = None
            self.files = [(p, None) for p in sorted(top)]
        self._count = len(self.files)

    @property
    def has_labels(self) -> bool:
        return self.classes is not None

    def missing_labels_message(self) -> str:
        return (f"{self.name}: a flat folder of images has no labels; put the images of each class in a "
                f"sub-folder named after the class")

    def label_values(self) -> list[str] | None:
        return None if self.classes is None else list(self.classes)

    def batches(self, *, labels: bool = True) -> Iterator[RecordBatch]:
        for lo in range(0, len(self.files), self.batch_rows):
            chunk = self.files[lo:lo + self.batch_rows]
            yield RecordBatch(
                items=[p for p, _ in chunk],
                labels=[c for _, c in chunk] if (labels and self.classes is not None) else None,
                ids=[self._id(p) for p, _ in chunk],
                users=None,
                start=lo,
            )

    def _id(self, p: Path) -> str:
        return f"{self.folder.resolve().name}/{p.relative_to(self.folder).as_posix()}"

    def sha256(self) -> str:
        h = hashlib.sha256()
        for p, _ in self.files:
            h.update(p.relative_to(self.folder).as_posix().encode() + b"\0")
            with open(p, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
        return h.hexdigest()


