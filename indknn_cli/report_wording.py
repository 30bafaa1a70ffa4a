"""The words of the account report: the privacy unit and adjacency every printed ε is stated for (SPEC §8), and the
notes that say which figures are exact and for the data holder only."""

from __future__ import annotations

REALISED_LABEL = "realised individual loss (descriptive, not a guarantee)"
#: The privacy unit and the adjacency every printed ε is stated for (SPEC §8).
UNIT = "record"
ADJACENCY = "add/remove one record"
SCOPE = ("the guarantee is per record, for neighbouring data sets that differ by adding or removing one record; "
         "it is not a per-user guarantee (a user with several records is not protected as one unit); under "
         "replace-one adjacency the Gaussian-DP μ doubles")
USER_LEVEL_NOTE = (
    "no user-level figure: records of one user selected by the same query add linearly (the count moves by m, "
    "a class's vote by the sum of the user's weights), so composing the user's per-record spends would "
    "understate the user's loss, and the ledger does not keep per-query contributions to compute it exactly; "
    "the guarantee is per record (add/remove one record)")
USER_SCOPE = ("the guarantee is per user (the ledger's privacy unit), for neighbouring data sets that differ by "
              "adding or removing one user with all their records; under replace-one adjacency the Gaussian-DP μ "
              "doubles")
USER_UNIT_NOTE = ("per user: the filter charges this user as one unit (SPEC §9); every record of the user carries "
                  "the user's spent, and the user's realised ε is the user's spent converted")

#: What a data subject's view (--record / --user) is: exact figures of that record or user alone.
SUBJECT_NOTE = ("operator-only: spent, remaining, times_selected, status and realised_epsilon are exact, noise-free "
                "figures of this record (user) from the private data, for the data holder and the data subject "
                "(an access request); never shown to query-senders")

#: What the exact figures of a full report are (SPEC §8): printed by `account` before them, and in its JSON.
OPERATOR_ONLY_NOTE = ("operator-only: records, records_active, records_retired, records_deleted, answers_by_label, "
                      "answers_at_k_min, spent_*, realised_epsilon and history are exact statistics of the private "
                      "data, for the data holder only; they must never drive what query-senders see (whether to "
                      "serve, what is released): gate serving on `account --queries-left` instead; "
                      "under --tune-method random-search, tuning.runs_drawn, thetas_tried and chosen_run are not "
                      "covered by the tuning guarantee (it covers the chosen τ, σ2 and its noisy score; under "
                      "exp-mech every tuning field is public or the chosen τ, σ2)")


def unit_figures(privacy_unit: str) -> dict:
    """unit, adjacency and scope for a ledger's privacy unit (every printed ε names them, SPEC §8)."""
    if privacy_unit == "user":
        return {"unit": "user", "adjacency": "add/remove one user", "scope": USER_SCOPE}
    return {"unit": UNIT, "adjacency": ADJACENCY, "scope": SCOPE}


def tuned_conversion_label(share: dict) -> str:
    """The conversion of a privately tuned ledger's headline (review 65, F4: it was labelled "RDP (α·B ...)", the
    untuned curve, although the figure composes the search with serving; docs/TUNING.md "Accounting"). ``share``:
    :func:`tuning.headline`'s figures."""
    search = ("ZCDpEvent(ρ) of the exponential mechanism" if share.get("method") == "exp-mech"
              else "RepeatAndSelectDpEvent of the random search")
    return f"RDP composition of the tuning search ({search}) with serving's α·B, dp-accounting RdpAccountant"


def seeded_note(n: int) -> str:
    """What `account` says of answers released by a seeded serve (review 73, F0): the seed is printed with each
    answer, so whoever reads them can recompute the noise and with it the exact count of records near each query."""
    return (f"{n} answer{'s were' if n != 1 else ' was'} released with a fixed --seed (for experiments only): the seed "
            "is printed with each answer, so their noise can be recomputed: the guarantee does not hold for the "
            "records near those queries")


def public_tuning(t: dict | None) -> dict:
    """`account`'s ``tuned_on_public_rows`` for a ledger made with ``index --tune public`` (else nothing)."""
    if not t or t.get("mode") != "public":
        return {}
    return {"tuned_on_public_rows": {
        "chosen": {"tau": t.get("chosen_tau"), "sigma2": t.get("chosen_sigma2")}, "epsilon_tuning": 0.0,
        "note": "τ and σ2 chosen on the store's labelled public rows (index --tune public): no private record read, "
                "no privacy cost"}}
