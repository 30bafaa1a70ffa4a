"""The privacy-unit options (``--privacy-unit``, ``--max-records-per-user``, ``--user-for-missing``; SPEC §9) and
their check. A leaf: :class:`~indknn_cli.ledger_state.PrivacyParams` validates them, :mod:`.user_unit` acts on them."""

from __future__ import annotations

from .errors import BadInputError

PRIVACY_UNITS = ("record", "user")
USER_FOR_MISSING = ("refuse", "record")


def check_unit_options(*, privacy_unit: str, max_records_per_user, user_for_missing: str) -> None:
    if privacy_unit not in PRIVACY_UNITS:
        raise BadInputError(f"--privacy-unit must be record or user, got {privacy_unit!r}")
    if user_for_missing not in USER_FOR_MISSING:
        raise BadInputError(f"--user-for-missing must be refuse or record, got {user_for_missing!r}")
    if max_records_per_user is not None:
        if privacy_unit != "user":
            raise BadInputError("--max-records-per-user needs --privacy-unit user")
        if isinstance(max_records_per_user, bool) or not isinstance(max_records_per_user, int) \
                or not 1 <= max_records_per_user <= 1_000_000:
            raise BadInputError(f"--max-records-per-user must be an integer in [1, 1000000], "
                                f"got {max_records_per_user!r}")
