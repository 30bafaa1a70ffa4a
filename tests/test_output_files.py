"""Files indknn writes for the user never replace or write through what is already at their paths (reviews 44–45).

`--out`, `--export`, `--plot` and bench's JSON are written to a temporary file and renamed into place. A device or
a pipe at the path, a link into /dev or /proc (`--out /dev/stdout`), and a link left at a predictable temporary name
turned that into damage: the machine's /dev/null replaced, the ledger's snapshot overwritten by a read-only command.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from indknn_cli.answers_out import AnswersWriter
from indknn_cli.cli.app import app
from indknn_cli.errors import BadInputError
from indknn_cli.output_files import refuse_not_a_file

from .conftest import served_pair

runner = CliRunner()


_world = served_pair


def _digest(*roots: Path) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest()
            for r in roots for p in sorted(r.rglob("*")) if p.is_file() and not p.is_symlink() and p.name != "LOCK"}


@pytest.mark.heavy
def test_export_and_plot_never_write_through_a_link_at_a_temporary_name(tmp_path):
    """Review 45, F1: `account --export budgets.parquet` wrote into `budgets.parquet.tmp` whatever it was: a link
    left there to the ledger's snapshot made a read-only command overwrite it (repair cannot rebuild a snapshot)."""
    sp, lp = _world(tmp_path)
    snap = next(lp.glob("snapshot-*.parquet"))
    out = tmp_path / "out"
    out.mkdir()
    for name in ("budgets.parquet.tmp", ".budgets.parquet.tmp", "budgets.csv.tmp", ".budgets.csv.tmp"):
        (out / name).symlink_to(snap)
    before = _digest(lp, sp)
    for target in ("budgets.parquet", "budgets.csv"):
        res = runner.invoke(app, ["account", "--ledger", str(lp), "--export", str(out / target)])
        assert res.exit_code == 0, res.output
        assert (out / target).is_file() and not (out / target).is_symlink()
    res = runner.invoke(app, ["account", "--ledger", str(lp), "--plot", str(out / "budgets.png")])
    assert res.exit_code == 0, res.output
    assert _digest(lp, sp) == before  # the snapshot (and everything else) untouched
    assert runner.invoke(app, ["account", "--verify", "--ledger", str(lp), "--store", str(sp)]).exit_code == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(["budgets.parquet.tmp", ".budgets.parquet.tmp",
                                                            "budgets.csv.tmp", ".budgets.csv.tmp", "budgets.parquet",
                                                            "budgets.csv", "budgets.png"])  # no temporary left
    assert oct((out / "budgets.csv").stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def test_out_into_proc_is_refused_before_anything_is_charged(tmp_path):
    """Review 45, F2: `--out /dev/stdout > answers.parquet` (as root) charged the batch, replaced the machine's
    /dev/stdout link with the Parquet file and left answers.parquet empty, exit 0. /proc cannot be written, so
    `--out /proc/self/fd/1` shows the order safely: before, the batch was charged and the rename then failed (exit
    1); now it is refused first (exit 2), nothing charged."""
    sp, lp = _world(tmp_path)
    before = _digest(lp)
    res = runner.invoke(app, ["serve-queries", "q2", "--store", str(sp), "--ledger", str(lp), "--out",
                              "/proc/self/fd/1"])
    assert res.exit_code == 2 and "/dev or /proc" in res.stderr, res.output
    assert _digest(lp) == before


@pytest.mark.parametrize("path", ["/dev/stdout", "/dev/stderr", "/dev/fd/1", "/dev/core", "/proc/self/fd/2",
                                  "/dev/shm/../stdout"])
def test_a_path_in_dev_or_proc_is_not_a_file_of_the_users(path):
    """The check alone (nothing is written: a test must never touch /dev): every output path in /dev or /proc, or
    resolving there, is refused."""
    with pytest.raises(BadInputError, match="/dev or /proc"):
        refuse_not_a_file(path, option="--out")


def test_a_file_in_dev_shm_is_an_ordinary_file(tmp_path):
    """/dev/shm is a tmpfs of ordinary files: an output there (or a link to one) is not refused."""
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm")
    refuse_not_a_file("/dev/shm/indknn-test-answers.parquet", option="--out")  # absent: fine
    link = tmp_path / "a.parquet"
    link.symlink_to("/dev/shm/indknn-test-answers.parquet")
    refuse_not_a_file(link, option="--out")


def test_a_path_that_becomes_a_pipe_before_the_commit_is_not_replaced(tmp_path):
    """Review 45, F3: the checks ran when the writer was made; a pipe made at the path afterwards was replaced."""
    path = tmp_path / "answers.parquet"
    w = AnswersWriter(path)
    w.write([{"batch_id": "b", "query_index": 0, "query_id": "q0", "label": 1, "label_name": "b",
              "released_count": 3.0}])
    os.mkfifo(path)
    with pytest.raises(BadInputError, match="named pipe"):
        w.commit()
    assert path.is_fifo() and [p.name for p in tmp_path.iterdir()] == ["answers.parquet"]


@pytest.mark.heavy
def test_bench_audit_out_replaces_a_link_never_writes_through_it(tmp_path):
    """Review 48, F1: `bench audit --out LINK` wrote the audit's JSON through a link onto a ledger's snapshot."""
    from indknn_cli.benchmarks import audit

    target = tmp_path / "snapshot-000001.parquet"
    target.write_bytes(b"PAR1 not to be touched PAR1")
    link = tmp_path / "audit.json"
    link.symlink_to(target)
    audit.run(trials=20, seed=1, out=link)
    assert target.read_bytes() == b"PAR1 not to be touched PAR1"
    assert not link.is_symlink() and json.loads(link.read_text())["certified_epsilon"] > 0


@pytest.mark.parametrize("kind", ["folder", "fifo", "missing-folder"])
def test_bench_audit_out_that_is_not_a_file_is_refused_before_the_run(tmp_path, kind):
    from indknn_cli.benchmarks import audit

    out = tmp_path / "x.json"
    if kind == "folder":
        out.mkdir()
    elif kind == "fifo":
        os.mkfifo(out)
    else:
        out = tmp_path / "nowhere" / "x.json"
    with pytest.raises(BadInputError, match="folder|named pipe|does not exist"):
        audit.run(trials=20, out=out)


def test_a_folder_at_an_output_path_is_refused_by_name(tmp_path):
    """Review 48, F2: `account --export FOLDER` failed after the work (exit 1) naming a temporary file."""
    (tmp_path / "dir.csv").mkdir()
    with pytest.raises(BadInputError, match=r"--export .*dir\.csv is a folder"):
        refuse_not_a_file(tmp_path / "dir.csv", option="--export")
