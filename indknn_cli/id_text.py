"""Record and user ids compared as text: one id, one spelling (review 53, F2).

Unicode writes some text two ways that mean and print the same: "José" composed (``'Jos\\xe9'``, NFC) or as "e"
plus a combining accent (``'Jose\\u0301'``, NFD; macOS file names, some exports). indknn compared ids by their
code points, so one person whose user id came from two systems was two users, each with a budget B (2·B under
``--privacy-unit user``), `delete --user` typed in one form erased only that form's records, and a record id
erased in one form came back in the other with a fresh budget (SPEC §8: a returning id keeps what it spent).

So every id is read as its NFC form (canonical composition; never NFKC, which merges ids that differ, e.g.
"ﬁ" and "fi"). NFC does merge the CJK compatibility ideographs (U+F900–U+FAFF) with their unified forms (U+F9E1
and U+674E are both 李): two ids a source system keeps apart by that difference alone are one person to indknn
(one budget; `delete` erases both), the side that never refunds (review 56, F5). Then: `embed` stores ids in
NFC, the library's append refuses any other form, and every comparison of ids (delete, account, the ledger's
returning ids, the user unit's users) goes through :func:`canonical`, so ids a store from before this rule holds
in another form still match theirs.
"""

from __future__ import annotations

import unicodedata

import numpy as np

FORM = "NFC"


def canonical(value) -> str:
    """``value`` as text in NFC (None and "" stay "")."""
    text = "" if value is None else str(value)
    return text if unicodedata.is_normalized(FORM, text) else unicodedata.normalize(FORM, text)


def canonical_array(values) -> np.ndarray:
    """:func:`canonical` of each value, as an object array (the ledger's id columns)."""
    return np.array([canonical(v) for v in values], dtype=object)


def is_canonical(text: str) -> bool:
    return unicodedata.is_normalized(FORM, text)


def index_by_canonical(record_ids, *, deleted, spent) -> dict[str, int]:
    """Index of each record id's NFC form (the ledger's records joining by id: review 56, F3). Two spellings of one
    id kept by a ledger from before NFC: the live one, else the one that spent most (its budget carries on)."""
    out: dict[str, int] = {}
    for i, rid in enumerate(record_ids):
        key = canonical(rid)
        j = out.get(key)
        if j is None or (deleted[j] and not deleted[i]) or (deleted[j] == deleted[i] and spent[i] > spent[j]):
            out[key] = i
    return out
