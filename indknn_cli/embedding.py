"""`indknn embed` as a library call: stream an input through a public extractor into the store.

Atomicity: everything is validated while the rows are written past the store's
committed ``n_rows`` (invisible to readers); the commit (one attribute update)
happens only after the last batch. Any error before it leaves the store as it
was; a store created by the failing call is removed again.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from . import data_quality
from . import object_store, store_lease
from .errors import BadInputError, StoreError
from .extractors import Extractor, extractor_from_info, get_extractor, input_kind_of
from .id_text import canonical
from .readers import Source, open_source
from .readers_base import _has_surrogates, check_batch_id, check_key_text
from .record_keys import input_keys
from .embedding_rows import embed_rows, first_row_of, open_checked, sort_label_names
from .store import ROLES, ExtractorInfo, FeatureStore
from .wording import count, shown

log = logging.getLogger(__name__)  # --verbose: indknn's own INFO lines on stderr

IF_EXISTS = ("error", "skip")
BATCH_INPUTS_ATTR = "batch_inputs"  # queries group attr: {batch name: sha256 of the input bytes}

ProgressFn = Callable[[int, "int | None"], None]
#: ``embed --role test``: labelled query rows (a batch of the query group whose labels are kept for bench's
#: scoring; serve-queries never reads query labels).
TEST_ROLE = "test"


@dataclass
class EmbedResult:
    store: str
    role: str
    rows_added: int
    rows_skipped: int
    dim: int
    extractor: ExtractorInfo
    batch: str | None = None
    start: int = 0
    stop: int = 0
    created: bool = False
    warnings: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        """The JSON line `indknn embed` prints."""
        out = {
            "store": self.store,
            "role": self.role,
            "rows_added": self.rows_added,
            "rows_skipped": self.rows_skipped,
            "d": self.dim,
            "extractor": self.extractor.as_dict(),
        }
        if self.role in ("query", TEST_ROLE):
            out["batch_id"] = self.batch  # the name answers carry too (review 42, M4)
            out["batch"] = self.batch  # the same, under the name it had before 2026-11-28 (pipes written for it)
        if self.role == "private":  # exact counts of the private rows, as index, delete and account say (review 73 F12)
            out["operator_only"] = "operator-only: rows_added and rows_skipped are exact counts of private rows"
        return out


def _store_exists(path: Path) -> bool:
    loc = object_store.location(path)
    return (path / "zarr.json").is_file() if loc is None else object_store.exists(loc)


def embed_into_store(
    source: str | os.PathLike | Source,
    *,
    store_path: str | os.PathLike,
    role: str = "private",
    extractor: str | Extractor | None = None,
    model: str | None = None,
    text_column: str | None = None,
    label_column: str | None = None,
    id_column: str | None = None,
    user_column: str | None = None,
    image_column: str | None = None,
    vector_column: str | None = None,
    if_exists: str = "error",
    batch: str | None = None,
    label_names: Sequence[str] | None = None,
    device: str = "auto",
    batch_rows: int = 256,
    progress: ProgressFn | None = None,
    lock: bool = True,
    stdin=None,
    scheduler: str | None = None,
) -> EmbedResult:
    """Embed ``source`` (a path, ``-`` for stdin, or an open :class:`Source`) into the store.

    ``extractor=None`` means the store's own extractor when the store exists,
    else ``text``; ``model=None`` with the store's extractor name means the
    store's model. ``lock=False`` only when the caller already holds
    ``store.write_lock()``. ``scheduler``: a Dask scheduler address; the rows are then embedded on its
    workers, which write them into chunk-aligned regions (:mod:`.dask_embed`); the commit stays here.
    """
    if role not in ROLES + (TEST_ROLE,):
        raise BadInputError(f"--role must be one of {', '.join(ROLES + (TEST_ROLE,))}, got {role!r}")
    if if_exists not in IF_EXISTS:
        raise BadInputError(f"--if-exists must be error or skip, got {if_exists!r}")
    if batch is not None and role not in ("query", TEST_ROLE):
        raise BadInputError("--batch-id applies to --role query only (or --role test)")
    if batch is not None:
        check_batch_id(batch)
    if label_names is not None and role == "query":  # silently ignored before (review 66, F4)
        raise BadInputError("--label-names applies to --role private, public or test (the store's class list); "
                            "queries carry no labels: leave --label-names out")
    store_path = object_store.local_path(store_path)  # an s3:// URL: its local state folder
    store = None
    if _store_exists(store_path) or (object_store.location(store_path) is None and store_path.exists()
                                     and (store_path.is_file() or any(store_path.iterdir()))):
        store = FeatureStore.open(store_path, mode="a")  # refuses other format versions and foreign folders
    elif role in ("query", TEST_ROLE):
        raise StoreError(f"{store_path}: no feature store here; queries go into an existing store "
                         f"(embed the private set first: indknn embed DATA --role private --label-names A,B,... --store {store_path})")
    reader_opts = dict(text_column=text_column, label_column=label_column, id_column=id_column,
                       user_column=user_column, image_column=image_column, vector_column=vector_column,
                       batch_rows=batch_rows, stdin=stdin)
    # Check the input (file, format, columns) before loading a model (issue 20): the input kind needs no model.
    kind = None if isinstance(source, Source) or isinstance(extractor, Extractor) else input_kind_of(
        extractor if extractor is not None else (store.extractor.name if store is not None else "text"))
    opened = open_checked(source, kind, reader_opts, defaulted=extractor is None and store is None)
    try:
        with contextlib.ExitStack() as stack:
            ex = _resolve_extractor(extractor, model, device, store)
            if store is not None:  # other extractor or other d: a clear StoreError
                store = FeatureStore.open(store_path, mode="a", expect_extractor=ex.info, expect_dim=ex.dim)
            if opened is not None and ex.input_kind != kind:  # cannot happen with the built-in extractors
                opened.close()
                opened = None
            dist = None
            if scheduler:
                from .dask_embed import DaskFeatureWriter

                dist = stack.enter_context(DaskFeatureWriter.connect(scheduler, ex, device=device))
            return _embed(opened if opened is not None else source, store=store, store_path=store_path, role=role,
                          ex=ex, if_exists=if_exists, batch=batch, label_names=label_names, progress=progress,
                          lock=lock, reader_opts=reader_opts, dist=dist)
    finally:
        if opened is not None:
            opened.close()


class QueryBatchName(str):
    """The name of a stored query batch, with its rows in the queries group as ``.start`` / ``.stop``."""

    start: int
    stop: int

    def __new__(cls, name: str, start: int, stop: int) -> "QueryBatchName":
        obj = super().__new__(cls, name)
        obj.start, obj.stop = int(start), int(stop)
        return obj

    @property
    def rows(self) -> tuple[int, int]:
        return self.start, self.stop


def embed_query_file(
    source: str | os.PathLike | Source,
    *,
    store: FeatureStore | str | os.PathLike | None = None,
    store_path: str | os.PathLike | None = None,
    batch: str | None = None,
    device: str = "auto",
    lock: bool = True,
    progress: ProgressFn | None = None,
    lock_timeout: float = 60.0,
    **reader_opts,
) -> QueryBatchName:
    """Embed a raw query file with the store's own extractor into query batch ``batch``.

    ``store`` is an open :class:`FeatureStore` or a path (``store_path`` is an
    alias). ``batch=None`` names the batch ``q-`` + the first 16 hex digits of
    the input's sha256. Idempotent: the same input under the same batch name
    adds nothing and returns the stored batch; other content under an existing
    name is a BadInputError. Returns the batch name (a ``str``) carrying the
    batch's rows in the queries group as ``.start`` / ``.stop``. ``lock=False``
    only when the caller already holds ``store.write_lock()``; ``lock_timeout``: seconds to wait for it (and,
    on object storage, for the store's writer lease).
    """
    target = store if store is not None else store_path
    if target is None:
        raise BadInputError("embed_query_file: give the store")
    st = target if isinstance(target, FeatureStore) else FeatureStore.open(target, mode="a")
    ex = extractor_from_info(st.extractor, device=device, dim=st.dim)
    reader_opts.setdefault("batch_rows", 256)
    res = _embed(source, store=st, store_path=st.path, role="query", ex=ex, if_exists="error",
                 batch=batch, label_names=None, progress=progress, lock=lock, reader_opts=reader_opts,
                 lock_timeout=lock_timeout)
    start, stop, _ = st.query_batch(res.batch)
    return QueryBatchName(res.batch, start, stop)


def _resolve_extractor(extractor, model, device, store: FeatureStore | None) -> Extractor:
    ex = _pick_extractor(extractor, model, device, store)
    info = getattr(ex, "info", None)
    log.info("extractor %s", f"{info.name} ({info.model}, {info.version})" if info is not None else type(ex).__name__)
    return ex


def _pick_extractor(extractor, model, device, store: FeatureStore | None) -> Extractor:
    if isinstance(extractor, Extractor):
        return extractor
    if extractor is None:
        if store is not None and model is None:
            return extractor_from_info(store.extractor, device=device)
        extractor = store.extractor.name if store is not None else "text"
    if model is None and store is not None and store.extractor.name == extractor:
        model = store.extractor.model
    return get_extractor(extractor, model=model, device=device)


def _embed(source, *, store: FeatureStore | None, store_path: Path, role: str, ex: Extractor, if_exists: str,
           batch: str | None, label_names: Sequence[str] | None, progress: ProgressFn | None, lock: bool,
           reader_opts: dict, dist=None, lock_timeout: float = 60.0) -> EmbedResult:
    own_source = not isinstance(source, Source)
    src = open_source(source, extractor_kind=ex.input_kind, **reader_opts) if own_source else source
    try:
        return _embed_source(src, store=store, store_path=store_path, role=role, ex=ex, if_exists=if_exists,
                             batch=batch, label_names=label_names, progress=progress, lock=lock, dist=dist,
                             lock_timeout=lock_timeout)
    finally:
        if own_source:
            src.close()


def _embed_source(src: Source, *, store: FeatureStore | None, store_path: Path, role: str, ex: Extractor,
                  if_exists: str, batch: str | None, label_names: Sequence[str] | None,
                  progress: ProgressFn | None, lock: bool, dist=None, lock_timeout: float = 60.0) -> EmbedResult:
    warnings: list[str] = []

    # -- labels: known up front (a scan of the label column / the class folders). --role test: query rows whose
    # labels are stored for scoring (bench) and never read by serving (it reads the query vectors only).
    test = role == TEST_ROLE
    if test:
        role = "query"
    use_labels = role != "query" or test
    name_index: dict[str, int] = {}
    if label_names is not None:
        label_names = [str(n).strip() for n in label_names]
        if not label_names or any(not n for n in label_names) or len(set(label_names)) != len(label_names):
            raise BadInputError(f"--label-names must be distinct non-empty names, got {label_names}")
        for n in label_names:  # review 40: a lone surrogate made a store every serve failed on (UnicodeEncodeError)
            if _has_surrogates(n):
                raise BadInputError(f"--label-names: {n!r} is not valid Unicode text")
            check_key_text([n], what="label name", display="--label-names", start=0)
            if n == "abstain":
                raise BadInputError("--label-names: 'abstain' is the label name of an abstention "
                                    "(serve-queries --min-margin); name the class otherwise")
    if role == "query" and not test:
        if src.has_labels:
            warnings.append(f"{src.name}: labels are ignored for queries (not stored; --role test keeps them "
                            f"for bench's scoring)")
        names = store.label_names if store is not None else []
        names_source = "declared"  # an empty list: a store created from query rows takes no labelled rows later
    else:
        if not src.has_labels:
            raise BadInputError(src.missing_labels_message())
        # labels compared in Unicode NFC, as ids are (review 73, F13: a decomposed "Café" was "unknown label 'Café';
        # the store's labels are ['Café', …]", two names that print the same)
        present = list(dict.fromkeys(canonical(v) for v in src.label_values() or []))
        if store is not None:
            names = list(store.label_names)
            if label_names is not None and [canonical(n) for n in label_names] != [canonical(n) for n in names]:
                raise BadInputError(f"--label-names {label_names} differ from the store's label names {names} "
                                    f"(label names are fixed when the store is created)")
        else:
            if label_names is None and role == "private":
                # The class list is released with every answer (a label outside it can never be answered), so
                # one record with a label of its own would change what serving can release: the list must be
                # declared, never read from the private rows (SPEC §1 and §8; audit 9, F1).
                raise BadInputError(
                    f"{src.name}: a store created from private rows needs --label-names (the class list, declared "
                    "in advance: every answer is one of these names, so it must not be read from the private "
                    "records); or create the store from labelled public rows (--role public) first")
            names = list(label_names) if label_names is not None else sort_label_names(present)
            names_source = "declared" if label_names is not None else "public rows"  # only they may infer it
        name_index = {canonical(n): i for i, n in enumerate(names)}
        unknown = [v for v in present if v not in name_index]
        if unknown:
            raise BadInputError(f"{src.name}: {first_row_of(src, unknown[0])}unknown label {shown(unknown[0])}"
                                f"{' (and %d more)' % (len(unknown) - 1) if len(unknown) > 1 else ''}; "
                                f"the store's labels are {names}")

    # -- query batches: a name, and idempotent re-runs
    input_sha = None

    def existing_batch(st: FeatureStore | None) -> EmbedResult | None:
        """Same batch name already stored: same input → idempotent result; other input → error."""
        if role != "query" or st is None or batch not in st.batches():
            return None
        start, stop, _ = st.query_batch(batch)
        recorded = dict(st.group("query").attrs.get(BATCH_INPUTS_ATTR, {})).get(batch)
        if recorded == input_sha:
            return EmbedResult(store=st.where, role=TEST_ROLE if test else role, rows_added=0,
                               rows_skipped=stop - start,
                               dim=st.dim, extractor=st.extractor, batch=batch, start=start, stop=stop,
                               warnings=warnings + [f"query batch {batch!r} is already in the store "
                                                    f"(same input); nothing added"])
        raise BadInputError(f"query batch {batch!r} is already in store {store_path} with other content; "
                            f"choose another --batch-id")

    if role == "query":
        input_sha = src.sha256()
        batch = batch or ("test-" if test else "q-") + input_sha[:16]
        done = existing_batch(store)
        if done is not None:
            return done

    total = src.count() if progress is not None else None
    created = False
    pre_existing_dir = store_path.is_dir() and store is None
    loc = object_store.location(store_path)
    named = loc.name if loc is not None else str(store_path)  # what the JSON line says: a remote store's URL
    # a new store on object storage: its writer lease is held from its creation through the first append, and
    # through the removal of a store that failed (another machine could otherwise write into it in between)
    new_remote = store is None and loc is not None and lock
    if new_remote:
        object_store.refuse_new_store(loc)
    with store_lease.hold(loc, timeout=60.0) if new_remote else contextlib.nullcontext():
        try:
            with contextlib.ExitStack() as stack:
                existing: set[str] = set()
                app = None
                generated_from = 0          # rows of the role that compactions removed (generated ids count them)
                erased: dict[str, str] = {}  # ids erased from the store → their user: a generated id never takes one
                                             # (audit 4, F2); an erased id comes back under its own user only

                def start_writing(st: FeatureStore):
                    nonlocal existing, generated_from
                    if lock:
                        stack.enter_context(st.write_lock(timeout=lock_timeout))
                    if dist is not None:  # runs before the lock is released: no worker still writing after it
                        stack.callback(dist.drain)
                    if role != "query":  # query ids are unique within their batch
                        existing = {canonical(r) for r in st.record_ids(role).tolist()}  # a store from before NFC
                    if role == "private":
                        generated_from = sum(int(c.get("rows_removed", 0)) for c in st.root.attrs.get("compactions", [])
                                             if isinstance(c, dict))
                        for rid, uid in st.erased_ids():
                            if not erased.get(canonical(rid)):  # the first user it was erased under (the tombstone's)
                                erased[canonical(rid)] = canonical(uid)
                    return st.appender(role, batch=batch)

                if store is not None:
                    app = start_writing(store)
                    done = existing_batch(store)  # again under the lock: a concurrent run may have added it
                    if done is not None:
                        return done
                dim = store.dim if store is not None else None
                seen: set[str] = set()
                rows_in = rows_skipped = rows_added = 0
                empty: list[int] = []  # rows (1-based) with an empty text
                truncated: list[int] = []  # rows (1-based) longer than the text model reads
                read_limit = 0
                erased_skipped = erased_readmitted = 0  # ids erased from the store (UX review 7, finding 2)
                for rb in src.batches(labels=use_labels):
                    n = len(rb)
                    rows = list(range(rb.start, rb.start + n))
                    check_key_text(rb.ids, what="record id", display=src.name, start=rb.start)
                    check_key_text(rb.users, what="user id", display=src.name, start=rb.start)
                    ids = list(rb.ids) if rb.ids is not None else [None] * n
                    if role != "query":  # one id, one spelling: stored in Unicode NFC (review 53, F2; id_text); a
                        # query's id is released with its answer as the sender wrote it
                        ids = [r if r is None else canonical(r) for r in ids]
                        if rb.users is not None:
                            rb.users = [u if u is None else canonical(u) for u in rb.users]
                    keep = []
                    for j, rid in enumerate(ids):
                        if rid is not None:
                            if rid in seen:
                                raise BadInputError(f"{src.name}: row {rows[j] + 1}: duplicate id {shown(rid)} in the input")
                            seen.add(rid)
                            if rid in existing:
                                if if_exists == "error":
                                    raise BadInputError(
                                        f"{src.name}: row {rows[j] + 1}: id {shown(rid)} is already in the {role} set of "
                                        f"{store_path}; pass --if-exists skip to skip such rows")
                                rows_skipped += 1
                                continue
                            if rid in erased:
                                if if_exists == "skip":  # a re-run import never brings back people who were erased
                                    erased_skipped += 1
                                    rows_skipped += 1
                                    continue
                                was = erased[rid]
                                now = (rb.users[j] or "") if rb.users is not None else ""
                                if was and was != now:  # review 60, F3: written, then every `index` refused it
                                    raise BadInputError(
                                        f"{src.name}: row {rows[j] + 1}: record id {shown(rid)} was erased from this store "
                                        "under another user; an erased id keeps its user (the budget it spent stays "
                                        "with that user): give this row a new record id")
                                erased_readmitted += 1
                        keep.append(j)
                    rows_in += n
                    if keep:
                        sel = keep if len(keep) < n else None
                        pick = (lambda seq: seq if sel is None or seq is None else
                                (seq[sel] if isinstance(seq, np.ndarray) else [seq[k] for k in sel]))
                        items, labels, users = pick(rb.items), pick(rb.labels), pick(rb.users)
                        rows_k, ids_k = pick(rows), pick(ids)
                        if ex.input_kind == "text":
                            empty += [rows_k[k] + 1 for k in data_quality.empty_texts(items)]
                            if dist is None and hasattr(ex, "too_long"):  # review 66, F9
                                cut, read_limit = ex.too_long(items)
                                truncated += [rows_k[k] + 1 for k in cut]
                        if dist is None:
                            xn = embed_rows(ex, items, rows_k, ids_k, name=src.name, dim=dim,
                                            store_named=named if store is not None else None)
                            dim = dim or int(xn.shape[1])
                        else:  # embedded on the Dask workers, which write the features (dask_embed.py)
                            xn, dim = None, dim or dist.dim_of(ex, items)
                        lab_idx = None
                        if use_labels:
                            lab_idx = np.empty(len(keep), dtype=np.int32)
                            for k, lab in enumerate(labels):
                                if (lab := canonical(lab)) not in name_index:
                                    raise BadInputError(f"{src.name}: row {rows_k[k] + 1}: unknown label {shown(lab)}; "
                                                        f"the store's labels are {names}")
                                lab_idx[k] = name_index[lab]
                        if store is None:
                            try:
                                store = FeatureStore.create(store_path, extractor=ex.info, dim=dim, label_names=names,
                                                            label_names_source=names_source)
                            except OSError as exc:
                                raise StoreError(f"{store_path}: cannot create the store ({exc})") from None
                            created = True
                            app = start_writing(store)
                        final_ids = []
                        for k, rid in enumerate(ids_k):
                            if rid is None:
                                # numbered by the rows ever appended to the role (compacted ones too), so an id that
                                # an erased record had is never handed to a new one (it would inherit its ledger row)
                                rid = f"{role}-{app.stop + generated_from + k:08d}"
                                if rid in existing or rid in seen or rid in erased:
                                    raise BadInputError(f"{src.name}: row {rows_k[k] + 1}: generated id {rid!r} "
                                                        f"collides with an existing id; give an --id-column")
                            final_ids.append(rid)
                        if dist is not None:
                            dist.submit(store, role, items, rows_k, ids_k, at=app.stop, name=src.name)
                        # each private record's key from its own input, before any model reads it: the private search
                        # deals shards by it, and a batch-embedded vector's bytes depend on its batch (audit 5, F1)
                        keys = (input_keys(items, lab_idx if lab_idx is not None else np.full(len(keep), -1),
                                           salt=store.key_salt) if role == "private" else None)
                        app.write(xn, labels=lab_idx, record_ids=final_ids, user_ids=users, content_keys=keys)
                        rows_added += len(keep)
                    if progress is not None:
                        progress(rows_in, total)
                if rows_in == 0:
                    raise BadInputError(f"{src.name}: empty input (0 rows)")
                if erased_skipped:
                    warnings.append(f"{src.name}: {count(erased_skipped, 'row')} skipped: their ids were erased from "
                                    "this store (--if-exists skip never brings an erased record back; to re-admit one, "
                                    "e.g. to relabel it, embed it without --if-exists skip)")
                if erased_readmitted:
                    warnings.append(f"{src.name}: {count(erased_readmitted, 'id')} erased from this store before "
                                    "embedded again: re-admitted, each keeping the budget it had spent")
                start = stop = store.n_rows(role) if store is not None else 0
                if rows_added:
                    if dist is not None:
                        dist.finish(store, role)  # every worker's rows written, or the first failure raised
                    extra = None
                    if role == "query":
                        inputs = dict(store.group("query").attrs.get(BATCH_INPUTS_ATTR, {}))
                        inputs[batch] = input_sha
                        extra = {BATCH_INPUTS_ATTR: inputs}
                    start, stop = app.commit(extra)
                    log.info("%s: %s written to the store's %s rows", src.name, count(rows_added, "row"), role)
                    warnings += data_quality.store_warnings(store, role, src.name, empty)
                    warnings += data_quality.truncated_warning(src.name, truncated, limit=read_limit)
        except BaseException:
            if created:
                remote = store.remote
                object_store.remove(store_path)  # on object storage: the objects written too
                if remote is not None:
                    object_store.local_path(remote.name)
                elif pre_existing_dir:
                    store_path.mkdir(exist_ok=True)
            raise
    return EmbedResult(store=named, role=TEST_ROLE if test else role, rows_added=rows_added,
                       rows_skipped=rows_skipped,
                       dim=int(store.dim), extractor=store.extractor, batch=batch, start=start, stop=stop,
                       created=created, warnings=warnings)

