"""Issue 20: -h everywhere, --quiet/--verbose on every command, one-line account checks, no tracebacks,
escaped messages, progress only on a terminal."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from indknn_cli.cli.app import app

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def _commands():
    """Every command path of the app, `bench` sub-commands included."""
    out = []
    for info in app.registered_commands:
        out.append([info.name])
    for g in app.registered_groups:
        for info in g.typer_instance.registered_commands:
            out.append([g.name, info.name])
    return out


def cli(*args, env=None, input=None):
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("INDKNN_")}
    full_env.update(PYTHONPATH=str(ROOT), **(env or {}))
    return subprocess.run([sys.executable, "-m", "indknn_cli", *map(str, args)], capture_output=True, text=True,
                          env=full_env, input=input, timeout=300)


def test_the_cli_is_this_checkout():
    out = subprocess.run([sys.executable, "-c", "import indknn_cli; print(indknn_cli.__file__)"],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}).stdout
    assert out.strip().startswith(str(ROOT))


def test_dash_h_and_quiet_verbose_everywhere():
    cmds = _commands()
    assert {"embed", "index", "serve-queries", "account", "delete", "repair"} <= {c[-1] for c in cmds}
    assert runner.invoke(app, ["-h"]).exit_code == 0
    for cmd in cmds:
        res = runner.invoke(app, [*cmd, "--help"], env={"COLUMNS": "200"})
        assert res.exit_code == 0, cmd
        if cmd[0] != "bench" or cmd[-1] not in ("serve-speed", "index-speed", "user-unit", "audit"):
            assert "--quiet" in res.stdout and "-q" in res.stdout and "--verbose" in res.stdout, cmd
            short = runner.invoke(app, [*cmd, "-h"], env={"COLUMNS": "200"})
            assert short.exit_code == 0 and short.stdout == res.stdout, cmd


def test_id_column_default_is_in_the_help():
    for cmd in ("embed", "serve-queries"):
        res = runner.invoke(app, [cmd, "--help"], env={"COLUMNS": "300"})
        assert "default: id when" in " ".join(res.stdout.split()), cmd
    res = runner.invoke(app, ["serve-queries", "--help"], env={"COLUMNS": "300"})
    text = " ".join(res.stdout.split())
    assert "Image path column" in text and "precomputed query vectors" in text  # no option without help


def test_quiet_keeps_errors_and_drops_the_rest(tmp_path):
    res = cli("account", "--ledger", tmp_path / "none", "-q")
    assert res.returncode == 2 and "no budget ledger" in res.stderr
    res = cli("account", "-q", "-v")
    assert res.returncode == 2 and "cannot be used together" in res.stderr


def test_quiet_silences_serve_summary(vector_store, tmp_path):
    store = vector_store.path
    ledger = tmp_path / "L"
    res = cli("index", "--store", store, "--ledger", ledger, "--eps", "1", "--tau", "0.5", "-q")
    assert res.returncode == 0 and res.stderr == "", res.stderr
    res = cli("serve-queries", "q1", "--store", store, "--ledger", ledger, "--seed", "1", "-q")
    assert res.returncode == 0 and res.stderr == "" and res.stdout.count("\n") > 0, res.stderr
    res = cli("serve-queries", "q1", "--store", store, "--ledger", ledger, "--seed", "1")
    assert "already answered" in res.stderr


def test_account_check_is_one_line_off_a_terminal(vector_store, tmp_path):
    ledger = tmp_path / "L"
    assert cli("index", "--store", vector_store.path, "--ledger", ledger, "--eps", "1", "--tau", "0.5").returncode == 0
    for extra, code in ((["--eps", "1"], 0), (["--eps", "0.5"], 4), (["--min-active", "100%"], 0),
                        (["--eps", "0.5", "--min-active", "2"], 4)):
        res = cli("account", "--ledger", ledger, *extra)
        assert res.returncode == code, res.stderr
        assert res.stdout == "" and len(res.stderr.strip().splitlines()) == 1, res.stderr
        assert ("FAILED" in res.stderr) == bool(code)
    res = cli("account", "--ledger", ledger, "--eps", "1", "-q")  # a passed check under -q: still its one line
    assert res.returncode == 0 and res.stdout == "" and len(res.stderr.strip().splitlines()) == 1


def test_bench_audit_bad_input_is_exit_2_without_traceback():
    res = cli("bench", "audit", "--trials", "10")
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr and "trials must be ≥ 20" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_unexpected_errors_print_no_traceback(monkeypatch, capsys):
    from indknn_cli.cli import app as app_mod

    def boom():
        raise RuntimeError("secret 0.123")

    monkeypatch.setattr(app_mod, "app", boom)
    monkeypatch.delenv("INDKNN_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exc:
        app_mod.main()
    assert exc.value.code == 1
    err = capsys.readouterr().err
    assert "RuntimeError" in err and "secret" not in err and "Traceback" not in err
    monkeypatch.setenv("INDKNN_DEBUG", "1")
    with pytest.raises(RuntimeError):
        app_mod.main()


def test_messages_are_escaped(tmp_path, capsys):
    res = cli("embed", tmp_path / "no[red]such[/red].csv", "--store", tmp_path / "s.zarr", "--extractor", "vectors")
    assert res.returncode == 2 and "no[red]such[/red].csv" in res.stderr, res.stderr
    from indknn_cli.cli.common import say

    say("pip install 'indknn[image]'")
    assert "'indknn[image]'" in capsys.readouterr().err


@pytest.mark.parametrize("suffix", [".parquet", ".csv"])
def test_account_export(vector_store, tmp_path, suffix):
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    from indknn_cli.ledger import BudgetLedger

    store, ledger = vector_store.path, tmp_path / "L"
    assert cli("index", "--store", store, "--ledger", ledger, "--eps", "1", "--tau", "0.5").returncode == 0
    assert cli("serve-queries", "q1", "--store", store, "--ledger", ledger, "--seed", "1").returncode == 0
    assert cli("delete", "--record", "r0003", "--store", store, "--ledger", ledger).returncode == 0
    out = tmp_path / f"state{suffix}"
    res = cli("account", "--ledger", ledger, "--export", out)
    assert res.returncode == 0, res.stderr
    assert "operator only" in res.stderr
    t = pq.read_table(out) if suffix == ".parquet" else pacsv.read_csv(out)
    rows = {r["record_id"]: r for r in t.to_pylist()}
    led = BudgetLedger.open(ledger)
    s = led.state
    assert len(rows) == len(s) == 300
    for i in range(len(s)):
        r = rows[str(s.record_id[i])]
        assert r["spent"] == pytest.approx(float(s.spent[i]), rel=1e-12)
        assert r["times_selected"] == int(s.times_selected[i])
    assert rows["r0003"]["status"] == "deleted" and rows["r0003"]["deleted_at"] is not None
    assert sum(r["spent"] > 0 for r in rows.values()) > 0  # the events, not the snapshot
    assert {"epsilon", "delta", "B", "conversion", "unit", "adjacency", "realised_epsilon_gdp",
            "realised_epsilon_rdp", "last_change", "user_id", "status", "budget"} <= set(t.column_names)
    r0 = next(iter(rows.values()))
    assert r0["unit"] == "record" and r0["adjacency"] == "add/remove one record" and r0["conversion"] == "gdp"
    assert r0["epsilon"] == pytest.approx(1.0, rel=1e-3)
    if suffix == ".parquet":
        import pyarrow as pa

        assert t.schema.field("last_change").type == pa.timestamp("us", tz="UTC")


def test_account_export_bad_name_is_exit_2(tmp_path, vector_store):
    ledger = tmp_path / "L"
    assert cli("index", "--store", vector_store.path, "--ledger", ledger, "--eps", "1").returncode == 0
    res = cli("account", "--ledger", ledger, "--export", tmp_path / "state.xlsx")
    assert res.returncode == 2 and ".parquet or .csv" in res.stderr and not (tmp_path / "state.xlsx").exists()
    res = cli("account", "--help", env={"COLUMNS": "300"})
    assert "OPERATOR ONLY" in res.stdout
