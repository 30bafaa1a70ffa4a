"""Answers as arrays end to end (issue 21, GPU pipeline): the compiled filter's AnswerArrays, a part's AnswerRows and
the --out writer give what the lists of QueryAnswer and of dicts gave, value for value and key for key."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from indknn_cli.answers_out import SCHEMA, AnswerRows, AnswersWriter, rows_table
from indknn_cli.engine import ABSTAIN_LABEL, AnswerArrays, QueryAnswer


def _dict_rows(n, *, seed=None, first=0):
    rows = []
    for j in range(n):
        label = ABSTAIN_LABEL if j % 5 == 3 else j % 3
        row = {"batch_id": "b", "query_index": first + j, "query_id": f"q{first + j}", "label": label,
               "label_name": "abstain" if label == ABSTAIN_LABEL else f"c{label}", "released_count": 1.5 + j}
        if seed is not None:
            row["seed"] = seed
        rows.append(row)
    return rows


@pytest.mark.parametrize("seed", [None, 7, -(1 << 63)])
def test_answer_rows_read_as_the_dicts_serving_used_to_build(seed):
    rows = _dict_rows(11, seed=seed)
    ar = AnswerRows(rows_table(rows))
    assert len(ar) == 11 and ar == rows and list(ar) == rows and ar[4] == rows[4]
    # the JSON lines are the same text: same keys in the same order, "seed" only in a seeded run
    assert [json.dumps(r) for r in ar] == [json.dumps(r) for r in rows]
    assert ar.abstained() == sum(r["label"] == ABSTAIN_LABEL for r in rows) == 2
    with pytest.raises(ValueError, match="schema"):
        AnswerRows(rows_table(rows).drop_columns(["seed"]))


def test_answers_writer_takes_tables_and_dicts_alike(tmp_path):
    parts = [_dict_rows(5, first=0), _dict_rows(4, first=5), _dict_rows(0, first=9), _dict_rows(6, first=9)]
    with AnswersWriter(tmp_path / "a.parquet", row_group_rows=4) as w:  # tables, row groups across parts
        for p in parts:
            w.write(AnswerRows(rows_table(p)))
    with AnswersWriter(tmp_path / "b.parquet", row_group_rows=4) as w:  # the dicts, as before
        for p in parts:
            w.write(p)
    a, b = pq.ParquetFile(tmp_path / "a.parquet"), pq.ParquetFile(tmp_path / "b.parquet")
    assert a.read().equals(b.read()) and a.read().schema == SCHEMA
    assert a.read().to_pylist() == [dict(r, seed=None) for p in parts for r in p]
    assert [a.metadata.row_group(i).num_rows for i in range(a.num_row_groups)] == [4, 4, 4, 3]
    with AnswersWriter(tmp_path / "empty.parquet") as w:  # an empty batch still gets its (empty) file
        w.write(AnswerRows(SCHEMA.empty_table()))
    assert pq.read_table(tmp_path / "empty.parquet").num_rows == 0


def test_answer_arrays_are_a_sequence_of_query_answers():
    labels, counts, margins = np.array([2, ABSTAIN_LABEL, 0]), np.array([1.0, 2.5, 3.0]), np.array([0.5, 0.1, np.inf])
    aa = AnswerArrays(labels, counts, margins)
    as_list = [QueryAnswer(2, 1.0, 0.5), QueryAnswer(ABSTAIN_LABEL, 2.5, 0.1), QueryAnswer(0, 3.0, np.inf)]
    assert len(aa) == 3 and aa == as_list and list(aa) == as_list and aa[1] == as_list[1]
    assert aa[1:] == as_list[1:] and isinstance(aa[1:], AnswerArrays)
    assert isinstance(aa[0].label, int) and isinstance(aa[0].released_count, float)
    both = aa + aa[:1]  # the halves of a batch past the pair bound, joined in order
    assert isinstance(both, AnswerArrays) and both == as_list + as_list[:1]
    assert aa + as_list[:1] == as_list + as_list[:1] and as_list[:1] + aa == as_list[:1] + as_list
    assert AnswerArrays.of(as_list) == aa and AnswerArrays.of(aa) is aa
    assert AnswerArrays.of([QueryAnswer(1, 2.0)]).margins[0] != AnswerArrays.of([QueryAnswer(1, 2.0)]).margins[0]
    with pytest.raises(ValueError):
        AnswerArrays(labels, counts[:2], margins)


def test_event_and_released_rows_agree_on_a_real_serve(tmp_path):
    """A seeded serve with --min-margin: the released rows (AnswerRows) are the ledger's answer rows, and the
    abstentions counted in the event's info are the released -1 labels."""
    from indknn_cli.benchmarks.serve_speed import make_store
    from indknn_cli.ledger import BudgetLedger
    from indknn_cli.serving import serve_queries

    make_store(tmp_path, 300, 16, 200, 0.5)
    got = []
    serve_queries(store_path=tmp_path / "s.zarr", ledger_path=tmp_path / "L", query_batch="bench", seed=3,
                  batch_size=64, device="cpu", reuse=False, keep_answers=False, on_committed=got.append,
                  min_margin=0.5)
    assert [len(p) for p in got] == [64, 64, 64, 8] and all(isinstance(p, AnswerRows) for p in got)
    released = [r for p in got for r in p]
    assert [r["query_index"] for r in released] == list(range(200))
    assert all(r["seed"] == 3 and r["batch_id"] == "bench" for r in released)
    ledger = BudgetLedger.open(tmp_path / "L")
    answers = pa.concat_tables(ledger.state.answer_tables())
    ledger_rows = sorted(answers.select(["query_index", "query_id", "label", "label_name", "released_count"])
                         .to_pylist(), key=lambda r: r["query_index"])
    assert ledger_rows == [{k: r[k] for k in ledger_rows[0]} for r in released]
    abst = sum(p.abstained() for p in got)
    assert abst == sum(r["label"] == ABSTAIN_LABEL for r in released) > 0
    infos = [json.loads(pq.read_schema(path).metadata[b"indknn_event"]) for _, path in ledger._event_files()]
    assert sum(i.get("abstained", 0) for i in infos if i.get("event_type", "serve") == "serve") == abst
    assert all(r["label_name"] == "abstain" for r in released if r["label"] == ABSTAIN_LABEL)


def test_a_seed_past_int64_is_refused_before_anything_is_charged(tmp_path):
    """Review 30, F2: `--seed 2^70 --out FILE` charged the first part, then failed writing the seed into --out's
    int64 column (exit 1, "Internal error"); the seed is now checked first: exit 2, nothing charged or written."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from indknn_cli.benchmarks.serve_speed import make_store
    from indknn_cli.ledger import BudgetLedger

    make_store(tmp_path, 200, 8, 100, 0.5)
    before = sorted(p.name for p in (tmp_path / "L" / "events").iterdir())
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    for seed in (str(1 << 70), str(-(1 << 63) - 1)):
        r = subprocess.run([sys.executable, "-m", "indknn_cli", "serve-queries", "bench", "--store", str(tmp_path / "s.zarr"),
                            "--ledger", str(tmp_path / "L"), "--seed", seed, "--batch-size", "32", "--out",
                            str(tmp_path / "a.parquet")], capture_output=True, text=True, env=env)
        assert r.returncode == 2 and "--seed must be an integer from -2^63 to 2^63-1" in r.stderr, r.stderr
    assert sorted(p.name for p in (tmp_path / "L" / "events").iterdir()) == before
    assert not (tmp_path / "a.parquet").exists() and BudgetLedger.open(tmp_path / "L").state.spent.max() == 0


def test_answers_released_before_come_back_as_answer_rows_equal_to_the_first_release(tmp_path):
    from indknn_cli.benchmarks.serve_speed import make_store
    from indknn_cli.serving import serve_queries

    make_store(tmp_path, 300, 16, 100, 0.5)
    kw = dict(store_path=tmp_path / "s.zarr", ledger_path=tmp_path / "L", query_batch="bench", batch_size=32,
              device="cpu", keep_answers=False)
    for seed in (None, -(1 << 63)):
        first, again = [], []
        serve_queries(**kw, seed=seed, batch_id=f"b{seed}", on_committed=first.append)
        serve_queries(**kw, seed=seed, batch_id=f"b{seed}", on_committed=again.append)  # nothing new: re-emitted
        assert all(isinstance(p, AnswerRows) for p in first + again) and [len(p) for p in again] == [32, 32, 32, 4]
        assert [r for p in again for r in p] == [r for p in first for r in p]
        assert all(("seed" in r) == (seed is not None) for p in again for r in p)
