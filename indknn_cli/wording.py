"""Plural rules for messages: ``1 record``, ``2 records``, ``1 query``, ``3 batches`` (never ``1 records``)."""

from __future__ import annotations

_ES = ("s", "x", "z", "ch", "sh")


def plural_of(word: str) -> str:
    """The English plural of a (last) word: query → queries, batch → batches, record → records, id → ids."""
    if word.endswith("y") and len(word) > 1 and word[-2] not in "aeiou":
        return word[:-1] + "ies"
    if word.endswith(_ES):
        return word + "es"
    return word + "s"


def count(n: int | float, noun: str, plural: str | None = None) -> str:
    """``n`` and ``noun``, the noun plural unless ``n`` is exactly 1 (``0 records``, ``1 record``, ``2 records``).

    ``noun`` may be several words: only the last is inflected (``1 record id``, ``2 record ids``); ``plural``
    overrides an irregular plural."""
    if plural is None:
        head, _, last = noun.rpartition(" ")
        plural = f"{head} {plural_of(last)}" if head else plural_of(last)
    return f"{n:g} {noun if n == 1 else plural}" if isinstance(n, float) else f"{n} {noun if n == 1 else plural}"


def per_unit(privacy_unit: str | None) -> str:
    """What an ε is stated for (SPEC §8: every printed ε names its unit and adjacency): ``per record, add/remove one
    record`` or ``per user, add/remove one user``."""
    unit = "user" if privacy_unit == "user" else "record"
    return f"per {unit}, {adjacency(unit)}"


def adjacency(privacy_unit: str | None) -> str:
    """The neighbouring relation of a privacy unit: ``add/remove one record`` or ``add/remove one user``."""
    return f"add/remove one {'user' if privacy_unit == 'user' else 'record'}"


def shown(value, limit: int = 60) -> str:
    """``repr(value)`` cut to about ``limit`` characters for a message: a label or id that swallowed the rest of a
    file (a stray quote in a CSV: review 60, F1) must not print the file's private rows on stderr."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit - 1]}…' ({len(str(value))} characters)"
