"""Issue 20: -h everywhere, --quiet/--verbose on every command, one-line account checks, no tracebacks,
escaped messages, progress only on a terminal."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
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


@pytest.mark.heavy
def test_quiet_silences_serve_summary(vector_store, tmp_path):
    store = vector_store.path
    ledger = tmp_path / "L"
    res = cli("index", "--store", store, "--ledger", ledger, "--eps", "1", "--tau", "0.5", "-q")
    assert res.returncode == 0 and res.stderr == "", res.stderr
    res = cli("serve-queries", "q1", "--store", store, "--ledger", ledger, "--seed", "1", "-q")
    assert res.returncode == 0 and res.stderr == "" and res.stdout.count("\n") > 0, res.stderr
    res = cli("serve-queries", "q1", "--store", store, "--ledger", ledger, "--seed", "1")
    assert "already answered" in res.stderr


@pytest.mark.heavy
def test_account_check_is_one_line_off_a_terminal(vector_store, tmp_path):
    ledger = tmp_path / "L"
    assert cli("index", "--store", vector_store.path, "--ledger", ledger, "--eps", "1", "--tau", "0.5").returncode == 0
    for extra, code in ((["--eps", "1"], 0), (["--eps", "0.5"], 4), (["--min-active", "100%"], 0),
                        (["--eps", "0.5", "--min-active", "2"], 4)):
        res = cli("account", "--ledger", ledger, *extra)
        assert res.returncode == code, res.stderr
        assert res.stdout == "" and len(res.stderr.strip().splitlines()) == 1, res.stderr
        assert ("FAILED" in res.stderr) == bool(code)
    res = cli("account", "--ledger", ledger, "--eps", "1", "-q")  # a passed check under -q: silent (cron mails
    assert res.returncode == 0 and res.stdout == "" and res.stderr == ""  # stderr; UX review 7); the exit code says it
    res = cli("account", "--ledger", ledger, "--eps", "0.5", "-q")  # a failed one: still its line
    assert res.returncode == 4 and len(res.stderr.strip().splitlines()) == 1 and "FAILED" in res.stderr


def test_bench_audit_bad_input_is_exit_2_without_traceback():
    res = cli("bench", "audit", "--trials", "10")
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr and "trials must be ≥ 20" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_unexpected_errors_print_no_traceback(monkeypatch, capsys):
    from indknn_cli.cli import app as app_mod

    def boom(**_):
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


@pytest.mark.heavy
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


@pytest.mark.heavy
def test_account_export_bad_name_is_exit_2(tmp_path, vector_store):
    ledger = tmp_path / "L"
    assert cli("index", "--store", vector_store.path, "--ledger", ledger, "--eps", "1").returncode == 0
    res = cli("account", "--ledger", ledger, "--export", tmp_path / "state.xlsx")
    assert res.returncode == 2 and ".parquet or .csv" in res.stderr and not (tmp_path / "state.xlsx").exists()
    res = cli("account", "--help", env={"COLUMNS": "300"})
    assert "OPERATOR ONLY" in res.stdout


def _run_with_stderr_on_a_pty(args, env=None):
    """Run the CLI with stderr on a pseudo-terminal (stdout a pipe); return (rc, stdout, stderr text)."""
    import pty

    master, slave = pty.openpty()
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("INDKNN_")}
    full_env.update(PYTHONPATH=str(ROOT), COLUMNS="100", TERM="xterm", **(env or {}))
    full_env.pop("NO_COLOR", None)
    proc = subprocess.Popen([sys.executable, "-m", "indknn_cli", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=slave, stdin=subprocess.DEVNULL, env=full_env)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: the child closed the pty
            break
        if not data:
            break
        chunks.append(data)
    out = proc.stdout.read().decode()
    rc = proc.wait(timeout=300)
    os.close(master)
    return rc, out, b"".join(chunks).decode(errors="replace")


@pytest.mark.heavy
def test_progress_only_on_a_terminal(vector_store, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    store, ledger = vector_store.path, tmp_path / "L"
    assert cli("index", "--store", store, "--ledger", ledger, "--eps", "1", "--tau", "0.5").returncode == 0
    rc, out, err = _run_with_stderr_on_a_pty(["serve-queries", "q1", "--store", store, "--ledger", ledger,
                                              "--seed", "1", "--batch-size", "16"])
    assert rc == 0 and out.count("\n") == 40, err
    assert "answering" in err and "━" in err and "40/40" in err
    res = cli("serve-queries", "q1", "--store", store, "--ledger", ledger, "--seed", "1", "--batch-id", "b2")
    assert res.returncode == 0 and "━" not in res.stderr and "answering" not in res.stderr
    rc, out, err = _run_with_stderr_on_a_pty(["serve-queries", "q1", "--store", store, "--ledger", ledger,
                                              "--seed", "1", "--batch-id", "b3", "-q"])
    assert rc == 0 and err.strip() == "", err  # --quiet: no bar either

    rng = np.random.default_rng(0)
    pq.write_table(pa.table({"id": [f"n{i}" for i in range(5)], "label": ["a"] * 5,
                             "vector": [list(map(float, v)) for v in rng.normal(size=(5, 16))]}), tmp_path / "v.parquet")
    rc, out, err = _run_with_stderr_on_a_pty(["embed", tmp_path / "v.parquet", "--store", tmp_path / "e.zarr",
                                              "--extractor", "vectors", "--label-names", "a"])
    assert rc == 0 and "embedding" in err and "━" in err, err
    res = cli("embed", tmp_path / "v.parquet", "--store", tmp_path / "e2.zarr", "--extractor", "vectors",
              "--label-names", "a")
    assert res.returncode == 0 and "━" not in res.stderr and "embedding" not in res.stderr, res.stderr


def test_embed_checks_the_input_before_loading_the_model(tmp_path, monkeypatch):
    from indknn_cli import embedding, extractors
    from indknn_cli.errors import BadInputError

    def no_model(*a, **k):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(extractors.TextExtractor, "__init__", no_model)
    (tmp_path / "t.csv").write_text("id,text,label\na,hello,x\n")
    with pytest.raises(BadInputError, match="text column 'nope' not found"):
        embedding.embed_into_store(tmp_path / "t.csv", store_path=tmp_path / "s.zarr", text_column="nope",
                                   label_names=["x"])
    with pytest.raises(BadInputError, match="no such file"):
        embedding.embed_into_store(tmp_path / "none.csv", store_path=tmp_path / "s.zarr")
    assert not (tmp_path / "s.zarr").exists()


def test_bench_speed_and_audit_help_is_typer_style():
    for cmd, flags in ((["bench", "serve-speed"], ["--n", "--d", "--queries", "--device"]),
                       (["bench", "index-speed"], ["--n", "--ag", "--out"]),
                       (["bench", "audit"], ["--eps", "--trials", "--reuse", "--no-reuse", "--seed"])):
        res = runner.invoke(app, [*cmd, "-h"], env={"COLUMNS": "250"})
        assert res.exit_code == 0, cmd
        text = res.stdout
        assert "usage: indknn" not in text and "issue 5" not in text, cmd
        assert "[default:" in text and all(f in text for f in flags), cmd
    res = runner.invoke(app, ["bench", "audit", "--reuse", "maybe"])
    assert res.exit_code == 2
    res = runner.invoke(app, ["serve-queries", "-h"], env={"COLUMNS": "300"})
    assert "K, M, G or T" in " ".join(res.stdout.split())


@pytest.mark.heavy
def test_bench_audit_quiet_and_off_a_terminal():
    res = cli("bench", "audit", "--trials", "40", "--seed", "1", "--eps", "2")
    assert res.returncode == 0 and "trials" not in res.stderr  # no progress lines in cron mail
    assert len(res.stderr.strip().splitlines()) == 1 and "ε lower bound" in res.stderr
    res = cli("bench", "audit", "--trials", "40", "--seed", "1", "-q")
    assert res.returncode == 0 and res.stderr == "" and res.stdout.startswith("{")


@pytest.mark.heavy
def test_redirected_account_tables_never_cut_ids(tmp_path):
    from indknn_cli.ledger import BudgetLedger
    from indknn_cli.serving import make_params

    led = BudgetLedger.create(tmp_path / "L", params=make_params(epsilon=1.0, delta=1e-5, tau=0.5, sigma2=0.5), store_uuid="x",
                              store_path="(none)")
    long_id = "2026-11-24-request-from-a-very-long-customer-identifier-0001"
    led.add_records(record_ids=[long_id], user_ids=["u-with-a-long-name-as-well-0001"], rows=[0])
    res = cli("account", "--ledger", tmp_path / "L", "--record", long_id)
    assert res.returncode == 0, res.stderr
    assert long_id in res.stdout and "…" not in res.stdout


def test_index_without_eps_names_only_what_is_missing(vector_store, tmp_path):
    res = cli("index", "--store", vector_store.path, "--ledger", tmp_path / "L")
    assert res.returncode == 2 and "needs --eps" in res.stderr and "have defaults" in res.stderr


@pytest.mark.heavy
def test_embed_says_loading_model_on_a_terminal_while_the_text_model_loads(tmp_path):
    """Issue 20: the bar is labelled "loading model" until the first rows are embedded (the model load is the
    long, silent part of a first embed), then "embedding"."""
    (tmp_path / "t.csv").write_text("id,text,label\na,the market rallied,x\nb,a late goal won it,y\n")
    rc, out, err = _run_with_stderr_on_a_pty(["embed", tmp_path / "t.csv", "--store", tmp_path / "t.zarr",
                                              "--extractor", "text", "--label-names", "x,y"])
    assert rc == 0, err
    assert "loading model" in err and "embedding" in err and err.index("loading model") < err.rindex("embedding")
