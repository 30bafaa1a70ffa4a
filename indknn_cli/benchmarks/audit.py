"""Empirical privacy audit of Ind-KNN: ε lower bound from a canary attack vs the certified ε.

    indknn bench audit                          # 2000 trials per world, OS-entropy noise
    indknn bench audit --trials 5000 --eps 4 --out audit.json

:func:`run` returns one dict: the measured ε lower bound (Clopper–Pearson,
confidence 1 − α), the certified ε of the budget B with its conversion, the
chosen membership-inference test and its error rates, and ``passed`` (the lower
bound does not exceed the certified ε; the command exits 4 when it does: an
implementation leak). Method and references: indknn_cli/audit.py.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from ..audit import AuditConfig, run_audit
from ..output_files import check_output_file, write_text_file


def run(*, out: Path | None = None, progress: Callable[[int, int], None] | None = None, **settings) -> dict:
    """The audit of :class:`~indknn_cli.audit.AuditConfig` ``settings`` (its fields; unset ones keep its
    defaults; ``seed`` None: OS entropy). ``out``: also write the JSON object there (checked before the run: a
    folder, pipe, device or missing folder is refused). ``progress(done, total)``: trials run so far."""
    import json

    if out is not None:
        check_output_file(out, option="--out")
    config = AuditConfig(**settings)
    t0 = time.perf_counter()
    result = run_audit(config, on_progress=progress)
    summary = result.as_dict()
    summary["seconds"] = round(time.perf_counter() - t0, 2)
    summary["noise"] = "seeded (experiment)" if config.seed is not None else "OS entropy"
    if out is not None:
        write_text_file(out, json.dumps(summary, ensure_ascii=False) + "\n", option="--out")
    return summary
