"""`serve-queries --out FILE.parquet`: the released answers written as they commit, published atomically.

Rows are appended to a hidden temporary file next to ``FILE`` (a Parquet row group per
:data:`ROW_GROUP_ROWS` answers, so memory stays O(one row group) whatever the batch's size, issue 21),
then fsync → rename → fsync of the folder when the run ends: ``FILE`` is either absent (or its previous
version, untouched) or complete. A failed run removes the temporary file. A process killed outright leaves
it behind under its hidden name (``.FILE.tmp-XXXXXXXX``), never under ``FILE``, and the next writer of
``FILE`` removes it: each writer holds an exclusive ``flock`` on its own temporary file while it lives, so a
leftover that can be locked belongs to no live writer (a live one's is skipped). The sweep assumes a local file
system with ``flock`` (as the ledger's locks do); only regular files named exactly so are touched.
"""

from __future__ import annotations

import fcntl
import os
import re
import stat
import uuid
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .errors import BadInputError
from .fsio import fsync_dir, storage_error
from .output_files import refuse_not_a_file

#: Answers per row group of the --out file (rows are buffered until then; the last group holds the rest).
ROW_GROUP_ROWS = 1 << 16

SCHEMA = pa.schema([
    ("batch_id", pa.string()), ("query_index", pa.int64()), ("query_id", pa.string()), ("label", pa.int32()),
    ("label_name", pa.string()), ("released_count", pa.float64()), ("seed", pa.int64()),
])


def rows_table(rows: list[dict]) -> pa.Table:
    """Released answers (the dicts of ``serve_queries``' ``on_committed``) as a table of :data:`SCHEMA`."""
    return pa.table({
        "batch_id": pa.array([r["batch_id"] for r in rows], pa.string()),
        "query_index": pa.array([r["query_index"] for r in rows], pa.int64()),
        "query_id": pa.array([r["query_id"] for r in rows], pa.string()),
        "label": pa.array([r["label"] for r in rows], pa.int32()),
        "label_name": pa.array([r["label_name"] for r in rows], pa.string()),
        "released_count": pa.array([r["released_count"] for r in rows], pa.float64()),
        "seed": pa.array([None if r.get("seed") is None else int(r["seed"]) for r in rows], pa.int64()),
    }, schema=SCHEMA)


class ReplayedAnswers(list):
    """Answers an earlier run released, returned again as dicts (:class:`AnswerRows` ``replayed``'s list form)."""

    replayed = True


class AnswerRows(Sequence):
    """One part's released answers as a table of :data:`SCHEMA`, read as ``on_committed``'s dicts on demand
    (issue 21): serve-queries builds the table from arrays, ``--out`` appends it as it is, and only a consumer
    that iterates (JSON lines on stdout, a library caller) makes one dict per answer, with the keys in
    SCHEMA's order and ``seed`` only when the run was seeded, as before."""

    __slots__ = ("table", "_dicts", "replayed")

    def __init__(self, table: pa.Table, *, replayed: bool = False):
        if table.schema != SCHEMA:
            raise ValueError(f"answer rows must have the schema {SCHEMA}, got {table.schema}")
        self.table = table
        self._dicts: list[dict] | None = None
        #: answers an earlier run released under this batch id, returned again (nothing charged)
        self.replayed = replayed

    def dicts(self) -> list[dict]:
        if self._dicts is None:
            cols = [self.table.column(n).to_pylist() for n in SCHEMA.names]
            names = SCHEMA.names[:-1]
            rows = [dict(zip(names, vals)) for vals in zip(*cols[:-1])]
            for row, seed in zip(rows, cols[-1]):
                if seed is not None:
                    row["seed"] = seed
            self._dicts = rows
        return self._dicts

    def abstained(self) -> int:
        """How many of these answers abstained (label −1, serve-queries --min-margin)."""
        return int(np.count_nonzero(self.table.column("label").to_numpy() == -1))

    def __len__(self) -> int:
        return self.table.num_rows

    def __getitem__(self, i):
        return self.dicts()[i]

    def __iter__(self):
        return iter(self.dicts())

    def __eq__(self, other):
        if isinstance(other, (list, tuple, AnswerRows)):
            return self.dicts() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"AnswerRows({len(self)} answers)"


def as_table(rows) -> pa.Table:
    """Released answers (AnswerRows, or a list of their dicts) as a table of :data:`SCHEMA`."""
    return rows.table if isinstance(rows, AnswerRows) else rows_table(list(rows))


def check_out_path(path: str | os.PathLike, *, probe: bool = True) -> None:
    """``--out`` must be a file that can be written (BadInputError, exit 2), checked before anything is charged: a
    folder, a parent that is a file or missing, or a folder this process cannot write in failed only when the
    answers were published, after the batch was charged (review 31, QA)."""
    import tempfile

    path = Path(path)
    parent = path.parent
    if path.is_dir():
        raise BadInputError(f"--out {path} is a folder; give a file path (answers are one Parquet file)")
    refuse_not_a_file(path, option="--out")  # /dev/null or a named pipe was replaced by the file (review 44, H1)
    if path.suffix.lower() in (".csv", ".tsv", ".json", ".jsonl", ".ndjson", ".txt"):
        raise BadInputError(f"--out writes a Parquet file, and {path.name} ends in {path.suffix}: name it .parquet, "
                            "or leave --out out for JSON lines on stdout")
    if parent.exists() and not parent.is_dir():
        raise BadInputError(f"--out: {parent} is a file, not a folder")
    if not parent.is_dir():
        raise BadInputError(f"--out: folder {parent} does not exist")
    if not probe:
        return
    try:
        with tempfile.NamedTemporaryFile(dir=parent, prefix=f".{path.name}.check-"):
            pass
    except OSError as exc:
        raise BadInputError(f"--out: cannot write a file in {parent} ({exc.strerror or type(exc).__name__})") from None


def refuse_output_over(path: str | os.PathLike, *, option: str, folders=(), files=()) -> None:
    """An output file (``--out``, ``--export``) inside the ledger's or the store's folder, or that is the input
    being read, is refused (BadInputError, exit 2) before anything is charged or written: `--out L/snapshot-….parquet`
    was accepted, the batch charged, then the answers written over the ledger's snapshot, which `repair` cannot
    rebuild (review 38, F1). ``folders``/``files``: (what, path) pairs; symlinks and ``..`` resolved."""
    refuse_not_a_file(path, option=option)
    out = Path(path).resolve()
    for what, folder in folders:
        if folder is None:
            continue
        f = Path(folder).resolve()
        if out == f or f in out.parents:
            raise BadInputError(f"{option} {path} is inside {what} {folder}: writing there would replace its files; "
                                "write the file somewhere else")
    for what, file in files:
        if file is not None and Path(file).exists() and out == Path(file).resolve():
            raise BadInputError(f"{option} {path} is {what}: writing there would replace it; write the file "
                                "somewhere else")


class AnswersWriter:
    """Append released answers to ``path`` (via a temporary file); :meth:`commit` publishes it, :meth:`abort`
    removes the temporary file. As a context manager: commit on a normal exit, abort on an exception."""

    def __init__(self, path: str | os.PathLike, *, row_group_rows: int | None = None):
        self.path = Path(path)
        check_out_path(self.path, probe=False)  # its own temporary file, made next, is the write probe
        self.row_group_rows = int(row_group_rows or ROW_GROUP_ROWS)
        self.rows = 0
        self._pending: list[pa.Table] = []  # tables of SCHEMA, not yet written
        self._pending_rows = 0
        self._writer: pq.ParquetWriter | None = None
        self._done = False
        self._lock_fd: int | None = None
        self.tmp, self._lock_fd = self._create_locked_tmp()
        try:
            _remove_dead_temps(self.path, keep=self.tmp)
        except BaseException:
            self.abort()
            raise

    def _create_locked_tmp(self) -> tuple[Path, int]:
        """A new hidden temporary file, created and locked by this writer (checked to be the file at its path:
        a sweeper may remove a file in the instant between its creation and its lock)."""
        for _ in range(100):
            tmp = self.path.with_name(f".{self.path.name}.tmp-{uuid.uuid4().hex[:8]}")
            try:
                fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
            except FileExistsError:
                continue
            except OSError as exc:
                raise storage_error(self.path, exc) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                if os.stat(tmp).st_ino == os.fstat(fd).st_ino:
                    return tmp, fd
            except FileNotFoundError:  # removed by a sweeper before our lock: make another
                os.close(fd)
                continue
            except OSError as exc:  # e.g. no flock on this file system: nothing left behind
                os.close(fd)
                tmp.unlink(missing_ok=True)
                raise storage_error(self.path, exc) from None
            except BaseException:
                os.close(fd)
                tmp.unlink(missing_ok=True)
                raise
            os.close(fd)
        raise storage_error(self.path, OSError("could not create a temporary file next to it"))

    def _release(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def write(self, rows) -> None:
        """Append released answers (AnswerRows, or a list of their dicts)."""
        table = as_table(rows)
        self._pending.append(table)
        self._pending_rows += table.num_rows
        self.rows += table.num_rows
        while self._pending_rows >= self.row_group_rows:
            pending = pa.concat_tables(self._pending)
            self._flush(pending.slice(0, self.row_group_rows))
            rest = pending.slice(self.row_group_rows)
            self._pending, self._pending_rows = [rest], rest.num_rows

    def _flush(self, table: pa.Table) -> None:
        try:
            if self._writer is None:
                self._writer = pq.ParquetWriter(self.tmp, SCHEMA)
            self._writer.write_table(table, row_group_size=max(1, table.num_rows))
        except OSError as exc:
            raise storage_error(self.path, exc) from None

    def commit(self) -> None:
        """Write what is buffered, close, fsync and rename into place (the file's one commit point)."""
        if self._done:
            return
        try:
            if self._pending_rows or self._writer is None:  # an empty batch still gets its (empty) file
                self._flush(pa.concat_tables(self._pending) if self._pending else SCHEMA.empty_table())
                self._pending, self._pending_rows = [], 0
            self._writer.close()
            self._writer = None
            with open(self.tmp, "rb+") as fh:
                os.fsync(fh.fileno())
            # a path that became a pipe or a device since the run began (review 45, F3): refused, not replaced; the
            # answers are in the ledger, and the same --batch-id run again returns them without a charge
            refuse_not_a_file(self.path, option="--out")
            os.replace(self.tmp, self.path)
        except OSError as exc:
            self.abort()
            raise storage_error(self.path, exc) from None
        except BaseException:
            self.abort()
            raise
        self._done = True
        self._release()
        fsync_dir(self.path.parent)

    def abort(self) -> None:
        """Drop the temporary file; ``path`` is left as it was."""
        self._done = True
        self._pending, self._pending_rows = [], 0
        if self._writer is not None:
            try:
                self._writer.close()
            except Exception:  # noqa: BLE001 - the file is removed anyway
                pass
            self._writer = None
        self.tmp.unlink(missing_ok=True)
        self._release()

    def __enter__(self) -> "AnswersWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.commit()
        else:
            self.abort()


def _remove_dead_temps(path: Path, *, keep: Path) -> list[Path]:
    """Remove ``path``'s hidden temporary files left by killed writers (those no live writer has locked)."""
    pattern = re.compile(r"\." + re.escape(path.name) + r"\.tmp-[0-9a-f]{8}")
    removed = []
    try:
        names = os.listdir(path.parent if str(path.parent) else ".")
    except OSError:
        return removed
    for name in names:
        cand = path.with_name(name)
        if cand == keep or not pattern.fullmatch(name):
            continue
        try:  # never follow a link; never block on a FIFO
            fd = os.open(cand, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):  # only regular files are ours
                os.close(fd)
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # a live writer holds it
            os.close(fd)
            continue
        try:
            if os.stat(cand, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
                cand.unlink()
                removed.append(cand)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def read_answers_parquet(path: str | os.PathLike) -> pa.Table:
    """An answers file of ``serve-queries --out``; ``seed`` is int64 as in the JSON lines (files written before
    it was, with a string ``seed``, are read to the same type)."""
    table = pq.read_table(path)
    i = table.schema.get_field_index("seed")
    if i >= 0 and table.schema.field(i).type != pa.int64():
        table = table.set_column(i, "seed", table.column(i).cast(pa.int64()))
    return table
