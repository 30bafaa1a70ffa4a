"""Audit 10 (2026-11-28), F1: a budget snapshot written by hand at the next generation number was accepted.

Reading snapshot g with pyarrow, setting every ``spent`` to 0, writing it as snapshot g+1 (its metadata copied as
it was, or its chain head made up) and pointing ``CURRENT`` at it needs no hash to be computed, yet serving and
``account --verify`` accepted it: the store's high-water mark was compared with the snapshot only at the same
generation, and every record could be charged up to 2·B. A compaction now announces its new snapshot (generation
and file hash) in the store's mark before ``CURRENT`` switches to it, and a ledger past the mark's generation is
accepted only at the announced snapshot. Real Zarr stores, Parquet ledgers and ``indknn`` subprocesses.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from indknn_cli import deletion
from indknn_cli import ledger_integrity as integrity
from indknn_cli.deletion import delete_records
from indknn_cli.errors import LedgerIntegrityError, StoreError
from indknn_cli.ledger import BudgetLedger
from indknn_cli.ledger_integrity import MARK_NAME
from indknn_cli.ledger_readonly import open_ledger_readonly
from indknn_cli.ledger_verify import verify_ledger
from indknn_cli.serving import build_index, make_params, serve_queries
from indknn_cli.store import ExtractorInfo, FeatureStore

from .conftest import clustered

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", INDKNN_WIDTH="200")
# σ1 large: count charges alone retire records within a few batches, so a refund is plain to see
PARAMS = dict(epsilon=1.0, delta=1e-5, tau=0.3, sigma2=1.0, sigma1=10.0, planned_queries=200)


def _world(root: Path):
    x, y, _ = clustered(300, 16, 3, seed=21)
    st = FeatureStore.create(root / "s.zarr", extractor=ExtractorInfo("vectors", "none", "1"), dim=16,
                             label_names=["a", "b", "c"], chunk_rows=64)
    st.append("private", x, labels=y, record_ids=[f"r{i:03d}" for i in range(300)],
              user_ids=[f"u{i % 30}" for i in range(300)])
    for k, name in enumerate(("q1", "q2", "q3")):
        q, _, _ = clustered(60, 16, 3, seed=30 + k)
        st.append("query", q, record_ids=[f"{name}-{i}" for i in range(60)], batch=name)
    lp = root / "L"
    build_index(store_path=st.path, ledger_path=lp, params=make_params(**PARAMS))
    serve_queries(store_path=st.path, ledger_path=lp, query_batch="q1", seed=1, batch_size=20)
    return Path(st.path), lp


def _stopped_compaction(root: Path, monkeypatch):
    """A world whose store compaction (r001 erased) stopped after it wrote the ledger's renumbered snapshot."""
    from .test_delete import Crash, _crash_at

    sp, lp = _world(root)
    delete_records(store_path=sp, ledger_path=lp, record_ids=["r001"])
    _crash_at(monkeypatch, "compact-ledger-prepared")
    with pytest.raises(Crash):
        delete_records(store_path=sp, ledger_path=lp, compact=True)
    monkeypatch.setattr(deletion, "FAULT_HOOK", None)
    return sp, lp


def _generation(lp: Path) -> int:
    return int(json.loads((lp / "CURRENT").read_text())["generation"])


def _forge_next_generation(lp: Path, *, store: Path, blind: bool) -> int:
    """The audit's forgeries: snapshot g+1 = snapshot g with spent and selections reset, its metadata copied as it
    is (``blind`` False; the events after it folded by copying the mark's head) or its chain head made up
    (``blind``: one event past the mark, a head of zeros); CURRENT points at it; generation g and the events go."""
    g = _generation(lp)
    snap = pq.read_table(lp / f"snapshot-{g:06d}.parquet")
    meta = json.loads(snap.schema.metadata[b"indknn"])
    mark = json.loads((store / MARK_NAME).read_text())
    if blind:
        meta.update(last_event_seq=mark["seq"] + 1, chain_head_seq=mark["seq"] + 1, chain_head_sha256="0" * 64)
    else:
        meta.update(last_event_seq=mark["seq"], chain_head_seq=mark["seq"], chain_head_sha256=mark["sha256"])
    cols = {name: snap.column(name) for name in snap.column_names}
    cols["spent"] = pa.array(np.zeros(snap.num_rows))
    cols["times_selected"] = pa.array(np.zeros(snap.num_rows, np.int64))
    table = pa.table(cols, schema=snap.schema.remove_metadata()).replace_schema_metadata(
        {b"indknn": json.dumps(meta).encode()})
    pq.write_table(table, lp / f"snapshot-{g + 1:06d}.parquet")
    shutil.copy(lp / f"answers-{g:06d}.parquet", lp / f"answers-{g + 1:06d}.parquet")
    (lp / "CURRENT").write_text(json.dumps({"generation": g + 1}))
    for p in [*(lp / "events").glob("*.parquet"), lp / f"snapshot-{g:06d}.parquet", lp / f"answers-{g:06d}.parquet"]:
        p.unlink()
    return g + 1


def _account_verify(lp: Path, sp: Path):
    return subprocess.run([sys.executable, "-m", "indknn_cli", "account", "--ledger", str(lp), "--store", str(sp),
                           "--verify"], env=ENV, capture_output=True, text=True, timeout=120)


@pytest.mark.heavy
@pytest.mark.parametrize("compacted,blind", [(True, False), (False, False), (False, True)])
def test_f1_a_snapshot_written_by_hand_at_the_next_generation_is_refused(tmp_path, compacted, blind):
    sp, lp = _world(tmp_path)
    serve_queries(store_path=sp, ledger_path=lp, query_batch="q2", seed=2, batch_size=20)
    if compacted:  # the audit's first case: right after a compaction, no event after the snapshot
        delete_records(store_path=sp, ledger_path=lp, compact=True)
        assert not list((lp / "events").glob("*.parquet"))
    before = open_ledger_readonly(lp).state.spent.copy()
    assert before.max() > 0
    _forge_next_generation(lp, store=sp, blind=blind)
    assert open_ledger_readonly(lp).state.spent.max() == 0  # the forgery opens on its own

    with pytest.raises(LedgerIntegrityError, match="no compaction announced that snapshot"):
        serve_queries(store_path=sp, ledger_path=lp, query_batch="q3", seed=3, batch_size=20)
    assert open_ledger_readonly(lp).state.spent.max() == 0  # nothing charged from the forged zeros
    assert not verify_ledger(lp, store_path=sp)["verified"]
    r = _account_verify(lp, sp)
    assert r.returncode != 0 and "no compaction announced" in r.stderr, (r.returncode, r.stdout, r.stderr)
    # an erasure is never blocked by it
    assert delete_records(store_path=sp, ledger_path=lp, record_ids=["r007"]).records_erased == 1


@pytest.mark.heavy
def test_f1_a_compaction_announces_its_snapshot_and_a_reader_that_read_the_mark_before_it_is_not_refused(tmp_path):
    sp, lp = _world(tmp_path)
    old_mark = integrity.read_mark(sp)  # a reader without the ledger lock reads the mark first
    delete_records(store_path=sp, ledger_path=lp, compact=True)  # ... a compaction publishes generation g+1
    mark = json.loads((sp / MARK_NAME).read_text())
    ledger = BudgetLedger.open(lp)
    assert ledger.generation == old_mark["generation"] + 1 == mark["generation"]
    assert mark["snapshot_sha256"] == ledger.snapshot_sha256 and "next_generation" not in mark
    store = FeatureStore.open(sp, mode="r")
    assert integrity.check_binding(store, ledger, lp, mark=old_mark)["bound"]  # ... then opens the ledger
    ledger.snapshot_sha256 = "f" * 64  # the same reader, had the snapshot file been replaced by another one
    with pytest.raises(LedgerIntegrityError, match="no compaction announced"):
        integrity.check_mark(sp, ledger, required=True, mark=old_mark)


@pytest.mark.heavy
def test_f1_a_crash_between_the_announcement_and_the_publication_is_finished(tmp_path, monkeypatch):
    """The announced snapshot is the only one accepted past the mark: after a crash between the switch of CURRENT
    and the mark's rewrite, the next command opens the ledger; with the announcement forged away it is refused."""
    sp, lp = _world(tmp_path)
    ledger = BudgetLedger.open(lp)
    ledger.mark_path = integrity.mark_path(sp)
    real = integrity.write_mark
    calls = []

    def crash_on_second(path, led, *, announce=None):
        calls.append(announce)
        if announce is None:  # the mark's rewrite after CURRENT switched: the process dies first
            raise KeyboardInterrupt("crash")
        real(path, led, announce=announce)

    monkeypatch.setattr(integrity, "write_mark", crash_on_second)
    with pytest.raises(KeyboardInterrupt):
        ledger.compact()
    monkeypatch.setattr(integrity, "write_mark", real)
    assert calls[0] is not None and calls[0][0] == ledger.generation
    mark = json.loads((sp / MARK_NAME).read_text())
    assert mark["next_generation"] == _generation(lp) == mark["generation"] + 1
    res = serve_queries(store_path=sp, ledger_path=lp, query_batch="q2", seed=2, batch_size=20)  # accepted
    assert len(res.answers) == 60
    assert json.loads((sp / MARK_NAME).read_text())["generation"] == _generation(lp)


@pytest.mark.heavy
@pytest.mark.parametrize("field", ["generation", "sha256", "snapshot_sha256"])
def test_f1_a_mark_without_its_generation_or_hashes_is_refused(tmp_path, field):
    """Removing a field from the mark (plain JSON, no hash to compute) skipped the checks that read it."""
    sp, lp = _world(tmp_path)
    mark = json.loads((sp / MARK_NAME).read_text())
    (sp / MARK_NAME).write_text(json.dumps({k: v for k, v in mark.items() if k != field}))
    with pytest.raises(LedgerIntegrityError, match="does not match its own sha256"):  # the seal (review 27)
        serve_queries(store_path=sp, ledger_path=lp, query_batch="q2", seed=2, batch_size=20)


@pytest.mark.heavy
def test_f1_an_unannounced_snapshot_is_never_rolled_forward_by_a_delete_and_the_erasure_goes_on(tmp_path,
                                                                                               monkeypatch):
    """A store compaction that crashed after the swap is finished by the next delete, which rolls the ledger
    forward to the snapshot naming the new store. That snapshot replaced by one with every spent reset was rolled
    forward too; now only the snapshot the mark announced is, and the erasure goes on without the ledger."""
    from .test_delete import Crash, _crash_at

    sp, lp = _world(tmp_path)
    delete_records(store_path=sp, ledger_path=lp, record_ids=["r001", "r002"])
    _crash_at(monkeypatch, "compact-swapped")
    with pytest.raises(Crash):
        delete_records(store_path=sp, ledger_path=lp, compact=True)
    monkeypatch.setattr(deletion, "FAULT_HOOK", None)
    g = _generation(lp)
    nxt = lp / f"snapshot-{g + 1:06d}.parquet"
    snap = pq.read_table(nxt)
    cols = {name: snap.column(name) for name in snap.column_names}
    cols["spent"] = pa.array(np.zeros(snap.num_rows))
    pq.write_table(pa.table(cols, schema=snap.schema), nxt)  # the same metadata, every spent 0

    res = delete_records(store_path=sp, ledger_path=lp, record_ids=["r010"])
    assert res.records_erased == 1 and _generation(lp) == g and nxt.exists()  # not rolled forward
    with pytest.raises(Exception):  # and the ledger is not served from
        serve_queries(store_path=sp, ledger_path=lp, query_batch="q2", seed=2, batch_size=20)


@pytest.mark.heavy
def test_a_store_compaction_that_crashed_after_its_swap_is_still_finished(tmp_path, monkeypatch):
    from .test_delete import Crash, _crash_at

    sp, lp = _world(tmp_path)
    delete_records(store_path=sp, ledger_path=lp, record_ids=["r001", "r002"])
    spent = open_ledger_readonly(lp).state.spent.copy()
    _crash_at(monkeypatch, "compact-swapped")
    with pytest.raises(Crash):
        delete_records(store_path=sp, ledger_path=lp, compact=True)
    monkeypatch.setattr(deletion, "FAULT_HOOK", None)
    mark = json.loads((sp / MARK_NAME).read_text())  # the new store folder carries the announcement
    assert mark["next_generation"] == _generation(lp) + 1
    delete_records(store_path=sp, ledger_path=lp, compact=True)
    led = open_ledger_readonly(lp)
    assert led.generation == json.loads((sp / MARK_NAME).read_text())["generation"]
    np.testing.assert_array_equal(led.state.spent, spent)  # carried unchanged: nothing refunded
    assert len(serve_queries(store_path=sp, ledger_path=lp, query_batch="q2", seed=2, batch_size=20).answers) == 60


# -- F2: serve's start-up time stepped at one exact number of stored rows ------------------------------------
_BF16_IMPORT = r"""
import json, sys
import numpy as np
from indknn_cli import bf16_screen
from indknn_cli.candidates import ArraySource, find_candidates
bf16_screen.cpu_has_bf16 = lambda: True  # the rule as on a CPU with bf16 instructions
bf16_screen._probe = lambda dim: __import__("torch") is not None  # the probe's import, without its product
real, seen = bf16_screen.wanted, []
bf16_screen.wanted = lambda *a, **k: seen.append(real(*a, **k)) and False  # record the choice; FAISS's screen runs
rng = np.random.default_rng(0)
x = rng.standard_normal((int(sys.argv[2]), 384)).astype(np.float32)
q = rng.standard_normal((int(sys.argv[1]), 384)).astype(np.float32)
find_candidates(q / np.linalg.norm(q, axis=1, keepdims=True), ArraySource(x / np.linalg.norm(x, axis=1, keepdims=True)),
                kernel="cosine", tau=0.3, nu=None, device="cpu")
print(json.dumps([seen[0], "torch" in sys.modules]))
"""


@pytest.mark.heavy
@pytest.mark.parametrize("queries", [1024, 4096])
def test_f2_whether_torch_is_loaded_for_the_screen_does_not_depend_on_the_rows_stored(queries):
    """A batch's torch import (1.35 s) was decided on queries × rows × d: one record added at the threshold
    moved the run's time by the import (audit 10, F2: 17,895 rows no, 17,896 rows yes, at 20,000 queries,
    d = 384). The import now reads the query count only; so does the screen a batch takes."""
    def run(rows):
        out = subprocess.run([sys.executable, "-c", _BF16_IMPORT, str(queries), str(rows)], env=ENV,
                             capture_output=True, text=True, check=True, timeout=300)
        return json.loads(out.stdout.strip().splitlines()[-1])

    small, large = run(10), run(3000)  # 4,096 × 3,000 × 384 passed the old rule's 2^32 products; × 10 did not
    assert small[1] == large[1] == (queries >= 2048), (small, large)  # torch loaded, or not, alike
    # and which screen the batch takes (review 27: once torch was loaded, the rows chose between the screens,
    # and FAISS's import came with one of them)
    assert small[0] == large[0] == (queries >= 2048), (small, large)


def test_f2_the_run_level_decisions_read_public_figures_only(monkeypatch):
    """serve-queries decides on torch's and numba's imports at a run's start from its query count and batch size:
    the functions take no row count at all."""
    import inspect

    from indknn_cli import bf16_screen, candidates

    for fn in (bf16_screen.prepare, bf16_screen.run_rule, bf16_screen.rule, bf16_screen.wanted,
               candidates.use_compiled, candidates.prepare_compiled):
        assert "rows" not in inspect.signature(fn).parameters, fn.__name__
    monkeypatch.delenv("INDKNN_SCREEN", raising=False)
    monkeypatch.setattr(bf16_screen, "cpu_has_bf16", lambda: True)
    assert bf16_screen.run_rule(20_000, batch=1024) and not bf16_screen.run_rule(1_000, batch=1024)


# -- F3: a damaged snapshot's message named a way out that refuses it ----------------------------------------
@pytest.mark.heavy
def test_f3_a_truncated_snapshot_says_restore_then_repair_and_that_way_works_without_refund(tmp_path):
    """serve-queries said "`indknn repair` brings the ledger back" for a truncated snapshot, and repair then
    refused (it rebuilds from the snapshot). The message now names what works: restore the ledger from a backup,
    then repair, which retires every record; erasure goes on meanwhile."""
    from indknn_cli.ledger_repair import repair_ledger

    sp, lp = _world(tmp_path)
    backup = tmp_path / "L-backup"
    shutil.copytree(lp, backup)
    serve_queries(store_path=sp, ledger_path=lp, query_batch="q2", seed=2, batch_size=20)
    delete_records(store_path=sp, ledger_path=lp, compact=True)
    snap = lp / f"snapshot-{_generation(lp):06d}.parquet"
    snap.write_bytes(snap.read_bytes()[:200])
    with pytest.raises(LedgerIntegrityError, match="restore the ledger folder from a backup, then run `indknn repair`"):
        serve_queries(store_path=sp, ledger_path=lp, query_batch="q3", seed=3, batch_size=20)
    assert delete_records(store_path=sp, ledger_path=lp, record_ids=["r005"]).records_erased == 1
    shutil.rmtree(lp)
    shutil.copytree(backup, lp)  # older than the store's mark: a rollback, which repair retires
    res = repair_ledger(ledger_path=lp, store_path=sp)
    assert res.repaired
    led = open_ledger_readonly(lp)
    live = ~led.state.deleted
    assert (led.state.spent[live] >= led.params.budget).all()  # no refund: every record retired
    assert led.state.deleted[list(led.state.record_id).index("r005")]  # the erasure made meanwhile is kept
    out = serve_queries(store_path=sp, ledger_path=lp, query_batch="q3", seed=3, batch_size=20)
    assert len(out.answers) == 60


# -- review 27 of these fixes -----------------------------------------------------------------------------------
@pytest.mark.heavy
def test_review_27_f1_a_mark_moved_back_by_hand_to_an_earlier_event_is_refused(tmp_path):
    """The two newest events removed and the mark's `seq` and `sha256` set to the last one kept (its hash is the
    next event's `prev_sha256`, readable with pyarrow): a rollback that needed no hash. The mark now carries the
    sha256 of its own fields."""
    sp, lp = _world(tmp_path)
    serve_queries(store_path=sp, ledger_path=lp, query_batch="q2", seed=2, batch_size=60)
    serve_queries(store_path=sp, ledger_path=lp, query_batch="q3", seed=3, batch_size=60)
    events = sorted((lp / "events").glob("*.parquet"))
    keep, gone = events[:-2], events[-2:]
    link = json.loads(pq.read_schema(gone[0]).metadata[b"indknn_event"])["prev_sha256"]
    mark = json.loads((sp / MARK_NAME).read_text())
    mark.update(seq=int(keep[-1].name[:8]), sha256=link)
    for p in gone:
        p.unlink()
    (sp / MARK_NAME).write_text(json.dumps(mark))
    with pytest.raises(LedgerIntegrityError, match="does not match its own sha256"):
        serve_queries(store_path=sp, ledger_path=lp, query_batch="q2", seed=2, batch_size=60)
    assert not verify_ledger(lp, store_path=sp)["verified"]
    assert delete_records(store_path=sp, ledger_path=lp, record_ids=["r004"]).records_erased == 1


@pytest.mark.heavy
def test_review_27_f3_a_stopped_compactions_copy_and_snapshot_are_removed_by_the_next_serve(tmp_path, monkeypatch):
    """A compaction stopped before its publication leaves a copy of the store whose mark announces the unpublished
    snapshot, and that snapshot: swapped back in later, the pair rolled the ledger back. The next ledger writer
    removes both."""
    sp, lp = _stopped_compaction(tmp_path, monkeypatch)
    g = _generation(lp)
    assert (lp / f"snapshot-{g + 1:06d}.parquet").exists() and list(sp.parent.glob(".s.zarr.compacting-*"))
    serve_queries(store_path=sp, ledger_path=lp, query_batch="q2", seed=2, batch_size=60)
    assert not (lp / f"snapshot-{g + 1:06d}.parquet").exists() and not list(sp.parent.glob(".s.zarr.compacting-*"))


@pytest.mark.heavy
def test_review_27_f7_a_store_compacted_while_verify_read_it_is_run_again_not_restored(tmp_path):
    """`account --verify` opened the store and the ledger, a compaction swapped the store, and the rows read by path
    were the new store's: reported as a store restored from an older copy, with the advice to repair (which retires
    every record). Now: ConcurrentChangeError, run again."""
    from indknn_cli.errors import ConcurrentChangeError
    from indknn_cli.ledger_rows import check_rows_hold_records

    sp, lp = _world(tmp_path)
    delete_records(store_path=sp, ledger_path=lp, record_ids=["r001", "r002", "r003"])
    store = FeatureStore.open(sp, mode="r")
    ledger = open_ledger_readonly(lp, store_uuid=store.uuid)
    delete_records(store_path=sp, ledger_path=lp, compact=True)  # rows renumbered under the reader
    with pytest.raises(ConcurrentChangeError, match="run again"):
        check_rows_hold_records(ledger, store)


@pytest.mark.heavy
def test_review_27_f4_a_bound_s3_store_whose_bucket_mark_was_removed_is_refused(tmp_path, monkeypatch):
    """A copy of the state folder and ledger on another machine passed once the bucket's mark was deleted (the
    local, stale mark was then the only one): review 23's 2·B. A bound store on object storage must have it."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    from indknn_cli import ledger_mark_remote
    from indknn_cli.object_store import local_path, location

    from .s3_server import moto_server
    from .test_review_23 import _two_machines

    with moto_server() as endpoint:
        url = _two_machines(tmp_path, endpoint, monkeypatch)
        serve_queries(store_path=url, ledger_path=tmp_path / "LA", query_batch="q1")
        monkeypatch.setenv("INDKNN_STATE_DIR", str(tmp_path / "stateB"))
        fs, mark_url = ledger_mark_remote._where(local_path(url))
        fs.rm_file(mark_url)
        assert location(local_path(url)) is not None and not fs.exists(mark_url)
        with pytest.raises(LedgerIntegrityError, match="bucket's copy of its high-water mark is missing"):
            serve_queries(store_path=url, ledger_path=tmp_path / "LB", query_batch="q2")


@pytest.mark.heavy
def test_review_28_another_stores_compaction_copies_are_never_taken_for_this_stores(tmp_path, monkeypatch):
    """The leftovers were found with a glob of the store's name: a store named ``a[1].zarr`` matched
    ``.a1.zarr.old-…`` and ``.a1.zarr.compacting-…``, so serving it removed store a1's copies: with the swap stopped
    between its two renames, a1 itself (review 28, F1). Names are now matched exactly."""
    from .test_delete import Crash, _crash_at

    a = tmp_path / "a"
    sp, lp = _world(a)
    delete_records(store_path=sp, ledger_path=lp, record_ids=["r001"])
    monkeypatch.setattr(deletion, "USE_RENAME_EXCHANGE", False)
    _crash_at(monkeypatch, "compact-half-swapped")  # a1's store now exists only as .s.zarr.old-<token>
    with pytest.raises(Crash):
        delete_records(store_path=sp, ledger_path=lp, compact=True)
    monkeypatch.setattr(deletion, "FAULT_HOOK", None)
    left = sorted(p.name for p in a.iterdir() if p.name.startswith(".s.zarr."))
    assert any(".old-" in n for n in left) and not sp.exists()
    # another store beside it, whose name is a glob pattern matching "s.zarr"
    other = a / "[s].zarr"
    shutil.copytree(tmp_path / "a" / left[[".old-" in n for n in left].index(True)], other)
    from indknn_cli.deletion_compact import _leftovers, discard_unpublished

    assert _leftovers(other) == []  # nothing of s.zarr's is taken for [s].zarr's
    discard_unpublished(FeatureStore.open(other, mode="r"), None)  # what serving [s].zarr runs
    assert sorted(p.name for p in a.iterdir() if p.name.startswith(".s.zarr.")) == left
    # s.zarr's documented recovery still finds its own copy and goes on
    assert delete_records(store_path=sp, ledger_path=lp, compact=True).compaction is not None
    assert sp.exists()


def test_review_29_f3_a_dot_named_stores_copy_is_not_taken_for_the_stores_own(tmp_path):
    """Review 29, F3: ``..s.zarr.compacting-<token>`` is the copy a compaction of a store named ``.s.zarr`` makes;
    the leftovers of ``s.zarr`` listed it too, and serving s.zarr removed it (mid-swap: .s.zarr's store folder gone
    until the next command recovered it). Each store now matches only ``.<its name>.compacting|old-<token>``."""
    from indknn_cli.deletion_compact import _leftovers

    token = "0123456789ab"
    for name in (f"..s.zarr.compacting-{token}", f".s.zarr.compacting-{token}", f".s.zarr.old-{token}",
                 f"..s.zarr.old-{token}", f".s.zarr.compacting-{token}x", f".s.zarr.compacting-{token[:-1]}"):
        (tmp_path / name).mkdir()
    assert [p.name for p in _leftovers(tmp_path / "s.zarr")] == [f".s.zarr.compacting-{token}", f".s.zarr.old-{token}"]
    assert [p.name for p in _leftovers(tmp_path / ".s.zarr")] == [f"..s.zarr.compacting-{token}",
                                                                  f"..s.zarr.old-{token}"]


@pytest.mark.heavy
def test_review_29_current_naming_a_missing_snapshot_says_damaged_not_busy(tmp_path):
    """Review 29 (noticed): CURRENT edited to name a snapshot that does not exist made serving say "ledger files changed
    while reading; try again", which never clears; it now says the ledger is damaged (exit 2, as a CURRENT that is not
    JSON) naming the snapshots present, an erasure still goes through, and CURRENT written back serves again. Exit 1
    since review 31 (damage, as the README's table says; it was 2, bad input)."""
    sp, lp = _world(tmp_path)
    (lp / "CURRENT").write_text(json.dumps({"generation": 7}))
    r = subprocess.run([sys.executable, "-m", "indknn_cli", "serve-queries", "q2", "--store", str(sp), "--ledger",
                        str(lp)], capture_output=True, text=True, env=ENV)
    assert r.returncode == 1 and r.stdout == ""
    assert "CURRENT names snapshot-000007.parquet, which is missing" in r.stderr and "try again" not in r.stderr
    assert "snapshot-000001.parquet" in r.stderr
    res = delete_records(store_path=sp, ledger_path=lp, record_ids=["r004"])  # never blocked by a damaged ledger
    assert res.records_erased == 1 and res.tombstones_pending == 1
    (lp / "CURRENT").write_text(json.dumps({"generation": 1}))
    assert serve_queries(store_path=sp, ledger_path=lp, query_batch="q2", seed=2).newly_answered == 60


def _repair_cli(sp: Path, lp: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "indknn_cli", "repair", "--store", str(sp), "--ledger", str(lp),
                           *extra], capture_output=True, text=True, env=ENV)


@pytest.mark.heavy
def test_repair_writes_back_a_current_that_names_a_missing_snapshot_and_retires_nobody_when_the_mark_agrees(
        tmp_path):
    """CURRENT edited to name a snapshot that does not exist: serving says the ledger is damaged (review 29), and
    `repair` said "the snapshot itself is damaged or edited; restore it from a backup" though it was whole. Repair now
    writes CURRENT back to the newest snapshot present (the old one kept in quarantine/); the ledger then verifies
    against the store's mark, so nobody is retired and nothing is refunded. --dry-run writes nothing."""
    sp, lp = _world(tmp_path)
    spent = BudgetLedger.open(lp).state.spent.copy()
    (lp / "CURRENT").write_text(json.dumps({"generation": 7}))
    r = _repair_cli(sp, lp, "--dry-run")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["current_written_back"] == 1 and "would write it back to generation 1" in r.stderr
    assert json.loads((lp / "CURRENT").read_text()) == {"generation": 7} and not (lp / "quarantine").exists()
    r = _repair_cli(sp, lp)
    out = json.loads(r.stdout)
    assert r.returncode == 0 and out["repaired"] and out["current_written_back"] == 1 and out["records_retired"] == 0
    assert out["cost"].startswith("none") and "nothing retired, no budget refunded" in r.stderr
    assert json.loads((lp / "CURRENT").read_text()) == {"generation": 1}
    assert json.loads((Path(out["quarantine_folder"]) / "CURRENT").read_text()) == {"generation": 7}
    assert np.array_equal(BudgetLedger.open(lp).state.spent, spent)
    assert verify_ledger(ledger_path=lp, store_path=sp)["verified"]
    assert serve_queries(store_path=sp, ledger_path=lp, query_batch="q2", seed=2).newly_answered == 60


@pytest.mark.heavy
def test_repair_of_a_current_whose_snapshot_was_removed_retires_everyone_and_refunds_nothing(tmp_path):
    """The current snapshot removed, an older one left (a crash after CURRENT moved on and before the old files went):
    written back, the ledger is behind the store's mark (a rollback), so repair retires every record; no spent goes
    down. With no snapshot left at all, repair says so (exit 1) and writes nothing."""
    sp, lp = _world(tmp_path)
    old = {p.name: p.read_bytes() for p in lp.glob("*-000001.parquet")}
    delete_records(store_path=sp, ledger_path=lp, compact=True)  # the ledger compacted: generation 2
    serve_queries(store_path=sp, ledger_path=lp, query_batch="q2", seed=2)
    led = BudgetLedger.open(lp)
    assert led.generation == 2
    spent = dict(zip(led.state.record_id, led.state.spent))
    for name, body in old.items():
        (lp / name).write_bytes(body)
    (lp / "snapshot-000002.parquet").unlink()
    r = _repair_cli(sp, lp)
    out = json.loads(r.stdout)
    assert r.returncode == 0 and out["current_written_back"] == 1 and out["records_retired"] > 0, r.stderr
    after = BudgetLedger.open(lp)
    budget = after.params.budget
    assert all(after.state.spent[i] >= min(spent.get(rid, 0.0), budget) for i, rid in enumerate(after.state.record_id))
    assert after.state.spent[~after.state.deleted].min() >= budget  # every record retired
    assert verify_ledger(ledger_path=lp, store_path=sp)["verified"]

    for p in lp.glob("snapshot-*.parquet"):  # nothing left to point at
        p.unlink()
    (lp / "CURRENT").write_text(json.dumps({"generation": 9}))
    r = _repair_cli(sp, lp)
    assert r.returncode == 1 and r.stdout == "" and "no other snapshot of this store's ledger is left" in r.stderr
    assert json.loads((lp / "CURRENT").read_text()) == {"generation": 9}


@pytest.mark.heavy
def test_repair_passes_over_a_stopped_compactions_snapshot_and_puts_current_back_when_it_fails(tmp_path,
                                                                                                monkeypatch):
    """Review 32, F1: a store compaction stopped after it wrote the ledger's renumbered snapshot 2 (for the store it
    had not published), then CURRENT damaged: repair pointed CURRENT at snapshot 2, failed ("run again"), and from
    then on every command, erasures included, was refused. Repair now takes only a snapshot of this store (and its
    bound ledger), and puts CURRENT back when the repair fails."""
    from indknn_cli import ledger_repair

    sp, lp = _stopped_compaction(tmp_path, monkeypatch)
    assert (lp / "snapshot-000002.parquet").is_file() and _generation(lp) == 1
    spent = BudgetLedger.open(lp).state.spent.copy()

    (lp / "CURRENT").write_text(json.dumps({"generation": 99}))

    def fails(*a, **k):
        raise RuntimeError("disk gone")

    monkeypatch.setattr(ledger_repair, "_refusal", lambda path, store, real=ledger_repair._refusal: (
        fails() if _generation(path) != 99 else real(path, store)))
    with pytest.raises(RuntimeError):
        ledger_repair.repair_ledger(ledger_path=lp, store_path=sp)
    assert json.loads((lp / "CURRENT").read_text()) == {"generation": 99}  # as repair found it
    assert delete_records(store_path=sp, ledger_path=lp, record_ids=["r004"]).records_erased == 1  # not blocked
    monkeypatch.undo()

    r = _repair_cli(sp, lp)
    out = json.loads(r.stdout)
    assert r.returncode == 0 and out["current_written_back"] == 1 and out["records_retired"] == 0, r.stderr
    assert (BudgetLedger.open(lp).state.spent >= spent).all()
    assert delete_records(store_path=sp, ledger_path=lp, record_ids=["r005"]).records_erased == 1
    assert delete_records(store_path=sp, ledger_path=lp, compact=True).compaction is not None
    assert verify_ledger(ledger_path=lp, store_path=sp)["verified"]


@pytest.mark.heavy
def test_strict_delete_mid_swap_of_a_stopped_compaction_erases_and_dry_run_says_why_it_cannot(tmp_path, monkeypatch):
    """Review 32 (erasure sweep, F8): with a compaction stopped between its two renames, `delete --strict` (and
    --dry-run) said "not an indknn feature store … create one with `indknn embed`" and erased nothing, though a plain
    delete finished the compaction and erased. --strict now goes the locked way (recovery first, then the same
    strict check); --dry-run, which writes nothing, says what stopped it."""
    from .test_delete import Crash, _crash_at

    sp, lp = _world(tmp_path)
    delete_records(store_path=sp, ledger_path=lp, record_ids=["r001"])
    monkeypatch.setattr(deletion, "USE_RENAME_EXCHANGE", False)
    _crash_at(monkeypatch, "compact-half-swapped")
    with pytest.raises(Crash):
        delete_records(store_path=sp, ledger_path=lp, compact=True)
    monkeypatch.setattr(deletion, "FAULT_HOOK", None)
    assert not sp.exists()
    with pytest.raises(StoreError, match="stopped mid-swap"):
        delete_records(store_path=sp, ledger_path=lp, record_ids=["r004"], dry_run=True)
    res = delete_records(store_path=sp, ledger_path=lp, record_ids=["r004"], strict=True)
    assert res.records_erased == 1 and sp.exists()


@pytest.mark.heavy
def test_an_erasure_with_an_unreadable_ledger_reaches_a_stopped_compactions_copy(tmp_path, monkeypatch):
    """Review 32 (erasure sweep, F5): a compaction stopped with its copy beside the store, and the ledger unreadable:
    `delete` erased the live row but the copy kept the person's vector (the recovery that removes copies needs the
    ledger). The request's rows are now erased in every such copy too; the note (exit 1) still says the copies are
    there."""
    from indknn_cli.store import FeatureStore

    sp, lp = _stopped_compaction(tmp_path, monkeypatch)
    copies = [p for p in sp.parent.iterdir() if p.name.startswith(f".{sp.name}.compacting-")]
    assert copies
    rid = "r050"
    row = list(FeatureStore.open(copies[0]).read("private", "record_id")).index(rid)
    assert FeatureStore.open(copies[0]).read("private", "features")[row].any()
    (lp / "CURRENT").write_text("{not json")
    res = delete_records(store_path=sp, ledger_path=lp, record_ids=[rid])
    assert res.records_erased == 1 and "1 row of this request erased in them as well" in res.physical_erasure
    copy = FeatureStore.open(copies[0])
    assert not copy.read("private", "features")[row].any() and copy.read("private", "deleted")[row]
    assert rid not in list(copy.read("private", "record_id"))
