"""`indknn account --verify`: re-check a ledger's hash chain, parameters, budgets and answers without writing.

The checks themselves are :mod:`indknn_cli.ledger_integrity`'s (snapshot, events, binding, high-water mark);
this module runs them over a whole ledger and words the result.
"""

from __future__ import annotations

from pathlib import Path

from . import store_twins, store_versions
from .accounting import calibrate_budget
from .errors import BadInputError, LedgerError, LedgerIntegrityError
from .ledger_integrity import binding_of, check_binding, check_mark, head_seq, read_mark, snapshot_is_chained
from .ledger_rows import check_erased_owners, check_erased_rows_blank, check_rows_hold_records
from .rounding import up
from .store_layout import check_private_chunks
from .wording import adjacency, count, per_unit

#: A failed verification is tried again while the ledger folder changes under it (a serve committing, a compaction
#: publishing) or holds a snapshot past CURRENT (a compaction between its store swap and its publish, or stopped
#: there): readers take no lock, and an intact ledger read mid-compaction was refused, or even called rolled back
#: when two compactions landed between two reads (review 52, F1, F2). A tampered ledger fails every attempt.
ATTEMPTS, PAUSE_S = 8, 0.25


def verify_ledger(ledger_path, *, store_path=None) -> dict:
    """Walk the chain and every check above; return what was verified (``verified`` False and ``error``
    on failure: :func:`enforce_verified` raises it). ``store_path`` None: the store the ledger records,
    when it is still there. Tried again (at most :data:`ATTEMPTS` times) while the ledger is changing."""
    import time

    for attempt in range(ATTEMPTS):
        before = _folder_state(ledger_path)
        out = _verify_once(ledger_path, store_path=store_path)
        if out.get("verified") or attempt == ATTEMPTS - 1:
            break
        after = _folder_state(ledger_path)
        if after == before and not _snapshot_past_current(ledger_path):
            break  # nothing moved: the verdict stands
        time.sleep(PAUSE_S)
    return out


def _folder_state(ledger_path) -> tuple:
    """What a commit or a compaction changes in a ledger folder: CURRENT and the file names."""
    import os

    path = Path(ledger_path)
    try:
        current = (path / "CURRENT").read_bytes() if (path / "CURRENT").is_file() else b""
        return current, tuple(sorted(os.listdir(path))), tuple(sorted(os.listdir(path / "events")))
    except OSError:
        return (None,)


def _snapshot_past_current(ledger_path) -> bool:
    from .ledger_snapshot import current_generation, unpublished_store_uuids

    try:
        gen = current_generation(Path(ledger_path))
        return gen is not None and bool(unpublished_store_uuids(Path(ledger_path), gen))
    except Exception:  # noqa: BLE001 - an unreadable CURRENT: nothing in progress to wait for
        return False


def _verify_once(ledger_path, *, store_path=None) -> dict:
    from .ledger import BudgetLedger
    from .ledger_readonly import open_ledger_readonly
    from .store import FeatureStore

    ledger_path = Path(ledger_path)
    if not BudgetLedger.exists(ledger_path):
        raise LedgerError(f"{ledger_path}: no budget ledger here (create one with `indknn index`)")
    out: dict = {"verified": False, "ledger": str(ledger_path)}
    try:
        explicit = store_path is not None
        first = open_ledger_readonly(ledger_path)
        if not explicit:
            recorded = Path(str(first.meta.get("store_path", "")))
            # a store's folder, or the state folder of a store on object storage (review 50: "none at the recorded"
            # state folder, which `--store s3://…` maps to and which holds the mark)
            from .object_store import POINTER

            store_path = recorded if any((recorded / f).is_file() for f in ("zarr.json", POINTER)) else None
            out["store_note"] = None if store_path else f"store not checked: none at the recorded {recorded}"
        store = FeatureStore.open(store_path, mode="r") if store_path is not None else None
        if not explicit and store is not None and store.uuid != first.meta.get("store_uuid"):
            # read again after the store: a compaction that finished between the two reads is seen (review 51, F1:
            # the first read's store uuid, stale, made an intact ledger look rolled back)
            first = open_ledger_readonly(ledger_path)
        if not explicit and store is not None and store.uuid != first.meta.get("store_uuid"):
            if (binding_of(store) or {}).get("ledger_uuid") == first.meta.get("ledger_uuid"):
                if _compacted_since(ledger_path, first, store):
                    # bound to this very ledger, and compacted from the ledger's store since this ledger was written,
                    # with no snapshot of this ledger for it: the ledger was rolled back (review 50, F5: a ledger copied
                    # before a `delete --compact` and restored after it)
                    raise LedgerIntegrityError(
                        f"{ledger_path}: the store at the recorded {store_path} is bound to this ledger but was "
                        f"compacted after it was written (store uuid {store.uuid}; the ledger's is "
                        f"{first.meta.get('store_uuid')}): the ledger was rolled back (an older copy restored), which "
                        "would refund charges")
                # else the ledger's own check words it below: a compaction to finish, or a store from before the
                # ledger's compaction (a copy of the pair compacted, or the store restored from an older copy)
            else:
                # review 48, F5: "this ledger belongs to another feature store (<the recorded path>)" named the very
                # path the ledger records, as if the reader had given it
                out["store_note"] = (f"store not checked: the store now at the recorded {store_path} is another "
                                     f"store (uuid {store.uuid}; the ledger's is {first.meta.get('store_uuid')}): the "
                                     "ledger's store was moved or replaced")
                store = None
        # review 47, F1: --store naming an older copy of the store passed a ledger rolled back to that copy's mark
        # while the store it was made for (a newer mark) still sat at the recorded path: that mark is checked too
        # when it is this ledger's (a copy with the same uuid, the original compacted since (review 50, F5), or the
        # state folder of a store on object storage, whose mark reads the bucket's too (review 50, F2))
        other = store_twins.recorded_elsewhere(first, store.path) if explicit and store is not None else None
        mark = read_mark(store.path) if store is not None else None  # before the ledger: no lock is held
        other_mark = read_mark(other) if other is not None else None
        if other_mark is None or other_mark.get("ledger_uuid") != first.meta.get("ledger_uuid"):
            other = None
        ledger = open_ledger_readonly(ledger_path, store_uuid=store.uuid if store is not None else None,
                                      store_compacted_from=store.compacted_from() if store is not None else frozenset())
        out.update(_describe(ledger))
        from .ledger_history import check_answers_summary

        out["answers_summary"] = check_answers_summary(ledger.state)
        if store is not None:
            info = check_binding(store, ledger, ledger_path, mark=mark)
            m = info["mark"]
            store_versions.check(store, ledger)  # the store the ledger last wrote against (not an older copy)
            compared = check_rows_hold_records(ledger, store)
            check_erased_owners(ledger, store)
            check_erased_rows_blank(store, ledger)  # review 67, F2; review 72, F1
            check_private_chunks(store)  # review 73, F16
            twin_info = _check_recorded(other, ledger, other_mark) if other is not None else None
            out["store"] = {
                "path": str(store.path), "store_uuid": store.uuid, "recorded_by_ledger": not explicit,
                "bound": info["bound"], "bound_ledger_uuid": (info["binding"] or {}).get("ledger_uuid"),
                "bound_ledger_path": (info["binding"] or {}).get("ledger_path"),
                "high_water_mark": None if m is None else {"seq": m["seq"], "sha256": m.get("sha256")},
                "ledger_ahead_of_mark_by": None if m is None else head_seq(ledger) - m["seq"],
                "records_at_their_rows": compared,  # live records whose store row holds their id (every one)
                "recorded_copy": twin_info,  # the store at the ledger's recorded path when --store named another copy
            }
        else:
            out["store"] = None
            # review 46, F7: the chain alone cannot see a rolled-back or truncated ledger, or an edited newest event
            # (nothing after it links to it): only the store's high-water mark can. Without the store, not verified.
            ev = out["events"]  # review 48, F5: "(events -..-)" for a ledger with no event after its snapshot
            span = f"events {ev['first_seq']}..{ev['last_seq']}" if ev["count"] else "no event after the snapshot"
            out["error"] = (f"{out.get('store_note') or 'the store was not found'}: the hash chain holds ({span}), but without "
                            "the store's high-water mark a rolled-back or truncated ledger, or an edited newest event, "
                            "cannot be told from an intact one; give --store STORE (the store's current copy)")
            return out
        out["verified"] = True
    except LedgerError as exc:
        out["error"] = str(exc)
    except Exception as exc:  # noqa: BLE001 - StoreError, unreadable files: the verification failed
        from .errors import IndknnError

        if not isinstance(exc, (IndknnError, OSError)):
            raise
        out["error"] = str(exc)
    return out


def _compacted_since(ledger_path, ledger, store) -> bool:
    """Whether ``store`` descends by compaction from the ledger's store (its compaction history names that uuid), with
    no snapshot of the ledger written for it past CURRENT (a compaction stopped or still running is not a rollback).
    A store *older* than the ledger (a copy of the pair compacted, a store restored from before a compaction) does
    not: the ledger's own check words that case."""
    from .ledger_snapshot import unpublished_store_uuids

    if ledger.meta.get("store_uuid") not in store.compacted_from():
        return False
    return store.uuid not in unpublished_store_uuids(Path(ledger_path), ledger.generation)


def _check_recorded(there: Path, ledger, mark) -> dict:
    """The high-water mark at the ledger's recorded path, when ``--store`` named another folder and that mark is this
    ledger's: the ledger must reach it too, or it was rolled back to the older copy's state."""
    try:
        check_mark(there, ledger, required=True, mark=mark)
    except LedgerError as exc:
        raise type(exc)(f"the store at the ledger's recorded path {there} holds this ledger's high-water mark too "
                        f"(another copy of the store given, or its state folder), checked: {exc}") from None
    return {"path": str(there), "high_water_mark": {"seq": mark["seq"], "sha256": mark.get("sha256")}}


def _describe(ledger) -> dict:
    snap_seq = ledger.snapshot_event_seq
    head = head_seq(ledger)
    p = ledger.params
    tuning = ledger.meta.get("tuning")
    try:
        if tuning:  # index --tune private: B is what serving is left after the search (review 55, F12: compared
            # with the untuned calibration, a correct ledger's B looked 5 % off, "to 1e-9")
            from .tuning_accounting import search_args, serving_budget

            cal = serving_budget(epsilon=p.epsilon, delta=p.delta, **search_args(tuning))
        else:
            cal = calibrate_budget(epsilon=p.epsilon, delta=p.delta, conversion=p.conversion)
    except (BadInputError, KeyError, TypeError, ValueError):
        cal = None
    return {
        "ledger_uuid": ledger.meta["ledger_uuid"], "generation": ledger.generation,
        "snapshot": {"file": f"snapshot-{ledger.generation:06d}.parquet", "sha256": ledger.snapshot_sha256,
                     "last_event_seq": snap_seq, "chained": snapshot_is_chained(ledger.meta)},
        "events": {"count": head - snap_seq, "first_seq": snap_seq + 1 if head > snap_seq else None,
                   "last_seq": head if head > snap_seq else None, "unchained_legacy": ledger.unchained_events},
        "head": {"seq": head, "sha256": ledger.head_sha256},
        "budgets": {"budget": p.budget, "calibrated_budget": cal, "bit_identical": p.budget == cal,
                    "epsilon": p.epsilon, "delta": p.delta,
                    "conversion": p.conversion, "unit": getattr(p, "privacy_unit", "record") or "record",
                    "adjacency": adjacency(getattr(p, "privacy_unit", "record")), "records": len(ledger.state),
                    "records_at_budget": len(ledger.state),
                    "tuning_epsilon": float(tuning["epsilon_tuning"]) if tuning else None},
    }


def enforce_verified(result: dict) -> None:
    if not result.get("verified"):
        raise LedgerIntegrityError(f"verification failed: {result.get('error')}")


def verification_lines(r: dict) -> list[str]:
    """Plain text of ``account --verify`` for a compliance reviewer (no markup)."""
    if not r.get("verified"):
        return [f"ledger {r['ledger']}: NOT verified", f"  {r.get('error')}"]
    ev, b, h = r["events"], r["budgets"], r["head"]
    rng = f"events {ev['first_seq']}..{ev['last_seq']}" if ev["count"] else "no events"
    lines = [
        f"ledger {r['ledger']} (uuid {r['ledger_uuid']}): verified",
        f"  snapshot {r['snapshot']['file']} sha256 {r['snapshot']['sha256']} (folds events up to "
        f"{r['snapshot']['last_event_seq']}{'' if r['snapshot']['chained'] else '; written before hash chaining'})",
        f"  hash chain: {count(ev['count'], 'event')} after the snapshot, {rng}, contiguous, no duplicates, every link "
        f"matches" + (f" ({ev['unchained_legacy']} written before chaining, unchecked)" if ev["unchained_legacy"] else ""),
        f"  chain head: event {h['seq']} sha256 {h['sha256']}",
        f"  budgets: B = {b['budget']!r} is the calibration of ε={b['epsilon']!r}, δ={b['delta']!r} "
        f"({b['conversion']}, {per_unit(b.get('unit'))})"
        + (f", what serving is left after private tuning's ε(rdp)={up(b['tuning_epsilon'], 4)} (RDP composition)"
           if b.get("tuning_epsilon") is not None else "")
        + f"{' (bit-identical)' if b['bit_identical'] else ' (to 1e-9)'}; all {b['records']} records carry B",
    ]
    s = r.get("store")
    if s is None:
        lines.append(f"  {r.get('store_note') or 'store not checked (give --store)'}")
    else:
        bound = (f"bound to this ledger (uuid {s['bound_ledger_uuid']}, recorded path {s['bound_ledger_path']})"
                 if s["bound"] else "not bound yet (bound by the next index or serve-queries)")
        lines.append(f"  store {s['path']} (uuid {s['store_uuid']}): {bound}")
        m = s["high_water_mark"]
        lines.append("  high-water mark: none" if m is None else
                     f"  high-water mark: event {m['seq']} sha256 {m['sha256']}; the ledger reaches it"
                     f"{' and is ' + count(ahead, 'event') + ' ahead' if (ahead := s['ledger_ahead_of_mark_by']) else ''}")
        if (tw := s.get("recorded_copy")) is not None:
            tm = tw["high_water_mark"]
            lines.append(f"  another copy of this store is at the ledger's recorded path {tw['path']}: checked too, the "
                         f"ledger reaches its high-water mark (event {tm['seq']}); serve-queries and index refuse the "
                         "copy given here while that one is there")
        if "records_at_their_rows" in s:
            lines.append(f"  store rows: each of the {count(s['records_at_their_rows'], 'live record')} sits at a row "
                         "holding its own record id")
    lines.append("  [OPERATOR ONLY] the counts above are exact figures of the private data: for the data holder, "
                 "never for query-senders")
    return lines
