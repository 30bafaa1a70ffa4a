"""The private rows' version log, and the check that a store is the one its ledger last saw (audit 6, F1).

The ledger finds a record's vector by its store row number. A store restored from an older copy while the ledger
stayed current (an ordinary recovery step) held other rows, or the same ids at other rows, or rows erased since:
rows appended after the copy and embedded again in another order were charged against other records' budgets (one
person paid 2·B), and an erased row came back as a candidate. Comparing record ids cannot catch every case (ids
that ``embed`` generates from row positions repeat in a re-embedded store), so the store itself says which state
it is in:

- every write to the private rows (an append's commit, flagging rows deleted, erasing them) appends a random
  token to the private group's ``versions`` attribute, in the same atomic ``zarr.json`` replace as the write's own
  commit where there is one (:func:`appended`);
- every ledger commit records the store's newest token (``store_seen``: store uuid and token) in its event, and
  the ledger state carries the latest into its snapshots (:mod:`indknn_cli.ledger_events`);
- every ledger writer (:func:`indknn_cli.ledger_integrity.attach`) and ``account --verify`` first checks that the
  token the ledger last recorded is in the store's log (:func:`check`): a store's log only grows, so a copy taken
  before that token was written, or a store rebuilt from scratch, lacks it, and is refused (LedgerIntegrityError,
  exit 1, naming no record) before anything is charged; ``repair`` brings it back into service.

A store compacted since the ledger's last commit has a new uuid and a log of its own: the check passes once and the
next commit records the new log's token. Stores made before the log have none: nothing is checked until their first
write starts one.
"""

from __future__ import annotations

import secrets

from .errors import LedgerIntegrityError

VERSIONS_ATTR = "versions"


def appended(group) -> dict:
    """The ``versions`` attribute with one new token: give it to the same ``attrs.update`` as the write's commit."""
    return {VERSIONS_ATTR: [str(v) for v in group.attrs.get(VERSIONS_ATTR, [])] + [secrets.token_hex(8)]}


def bump(store) -> None:
    """A write to the private rows that has no commit attribute of its own (flagging, erasing)."""
    g = store.group("private")
    g.attrs.update(appended(g))


def versions(store) -> list[str]:
    return [str(v) for v in store.group("private").attrs.get(VERSIONS_ATTR, [])]


def current(store) -> dict | None:
    """What a ledger commit records of the store (read from disk now): its uuid and newest token."""
    v = versions(store)
    return {"store_uuid": store.uuid, "version": v[-1]} if v else None


def check(store, ledger) -> None:
    """Refuse a store that is not a later state of the one the ledger last recorded (see the module doc)."""
    seen = getattr(ledger.state, "store_seen", None)
    if not isinstance(seen, dict) or seen.get("store_uuid") != store.uuid or not seen.get("version"):
        return  # nothing recorded yet, or recorded of the store before a compaction (a new uuid)
    if str(seen["version"]) in set(versions(store)):
        return
    raise LedgerIntegrityError(
        f"{store.path}: this is not the store the ledger last wrote against: its private rows' version log lacks "
        "the version the ledger recorded (the store was restored from an older copy, or rebuilt): its rows may hold "
        "other records than the ledger charges there, or records erased since; refusing, nothing charged. Restore "
        "the newest copy of the store, or run `indknn repair --ledger LEDGER --store STORE`: it retires every "
        "record at its budget (no refund), erases again the rows of records the ledger erased, and brings the "
        "store's rows in as they are now")
