"""`indknn account`: budgets, the (ε, δ) guarantee, retired records, history; `--eps E` checks for cron.

Read-only: takes no lock and writes nothing to the ledger.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from ..errors import EXIT_BUDGET_EXHAUSTED, BadInputError
from ..rounding import down as _down
from ..rounding import given as _given
from ..rounding import up as _up
from ..wording import count, per_unit
from .common import (emit_json, given_on_command_line, resolve_ledger, run_library_call, say, stderr_console,
                     stdout_console, verbosity)


def _load() -> None:
    """Import the library (numpy, pyarrow, zarr, scipy, ...) when the command runs, not at `indknn --help`: the
    names are this module's globals, declared here."""
    global CONVERSION_LABEL, enforce_verified, verification_lines, verify_ledger, QUANTILES, REALISED_LABEL, \
        AccountReport, build_account_report, enforce_checks, public_allowance
    from ..accounting import CONVERSION_LABEL
    from ..ledger_verify import enforce_verified, verification_lines, verify_ledger
    from ..report import (QUANTILES, REALISED_LABEL, AccountReport,
                          build_account_report, enforce_checks)
    from ..serving import public_allowance


HISTORY_ROWS = 20


def _print_subject(console, title: str, rec: dict) -> None:
    console.print(f"[bold]{escape(title)}[/]")
    t = Table(show_header=False)
    t.add_column("field", style="bold")
    t.add_column("value")
    rows = [("record id", rec["record_id"]), ("user id", rec["user_id"] or "—"), ("status", rec["status"]),
            ("spent", _up(rec["spent"])), ("remaining", _down(rec["remaining"])), ("budget B", _up(rec["budget"])),
            ("next count charge", _up(rec["next_charge_at_least"]) + (
                " (per record selected; a user selected through m records pays m²× this)"
                if rec.get("unit") == "user" else "")),
            ("times selected", str(rec["times_selected"]))]
    tuned = rec.get("tuning") is not None  # privately tuned: the record's loss includes its share of the search
    for c, v in rec["realised_epsilon_by_conversion"].items():
        what = f"{c}, tuning + serving" if tuned and c == "rdp" else (
            f"{c}: not applicable to tuning + serving" if tuned else c)
        what += ", the user's" * (rec.get("unit") == "user") + f"; {rec['realised_epsilon_unit']}"
        rows.append((f"realised ε ({what})", f"{_up(v, 4)}  [{REALISED_LABEL}]"))  # escaped below
    rows.append(("deleted", f"yes, at {rec['deleted_at']}" if rec["deleted"] else "no"))
    rows.append(("last change", rec["last_change"] or "—"))
    for k, v in rows:
        t.add_row(escape(k), escape(str(v)))  # ids and labels are text, never rich markup
    console.print(t)


def _print_tables(report: AccountReport, *, full: bool) -> None:
    d = report.data
    out = stdout_console()
    out.print(f"[bold]Guarantee[/] (the filter's): every {escape(d['unit'])}'s total charge ≤ B = {_up(d['budget'])}")
    out.print(escape(f"unit: one {d['unit']}; adjacency: {d['adjacency']} ({d['scope']})"))
    out.print(f"ledger: {escape(d['ledger'])}")
    g = Table()
    g.add_column("δ")
    for c in ("gdp", "rdp"):
        g.add_column(f"ε ({c})", justify="right")
    for row in d["guarantees"]:
        g.add_row(f"{_given(row['delta'])}", *[_up(row["epsilon_by_conversion"][c], 4) for c in ("gdp", "rdp")])
    out.print(g)
    out.print(f"headline: ε({escape(d['conversion'])}) = {_up(d['epsilon'])} at δ = {_given(d['delta'])}, "
              f"{escape(d['adjacency'])}")
    if d.get("tuning") is None:
        for c in ("gdp", "rdp"):
            out.print(escape(f"  {c}: {CONVERSION_LABEL[c]}"))
    else:  # review 65, F4: the rdp column is the composition; the gdp one is empty
        out.print(escape(f"  rdp: {d['conversion_label']}; gdp: not applicable to the composition"))
    if d.get("seeded_answers"):  # review 73, F0: a seeded serve's answers carry their seed
        from ..report_wording import seeded_note

        out.print("[bold yellow]warning:[/] " + escape(seeded_note(d["seeded_answers"])))
    out.print(f"the ledger was calibrated for ε({escape(d['target_conversion'])}) = {_given(d['target_epsilon'])} "
              f"at δ = {_given(d['ledger_delta'])}, {escape(d['adjacency'])}")
    if d.get("tuned_on_public_rows"):
        p = d["tuned_on_public_rows"]
        out.print(escape(f"tuning: τ={p['chosen']['tau']:g}, σ2={p['chosen']['sigma2']:g}, {p['note']}"))
    t = d.get("tuning")
    if t is not None:  # index --tune private: the headline composes the search with serving (RDP)
        how = ("by the exponential mechanism" if t.get("method") == "exp-mech" else
               f"{t['runs_drawn']} runs, a figure for the operator only")
        out.print(escape(f"of which tuning (τ={t['chosen']['tau']:g}, σ2={t['chosen']['sigma2']:g}, "
                         f"{how}): ε(rdp) = {_up(t['epsilon_tuning'], 4)} alone; serving "
                         f"alone ε(rdp) = {_up(t['epsilon_serving_alone'], 4)}; composed by RDP = "
                         f"{_up(t['epsilon_total'])} at δ = {_given(d['delta'])}, {d['adjacency']} (gdp: not "
                         "applicable to the composition)"))
        if t.get("seeded"):
            from ..tuning import SEEDED_NOTE

            out.print("[yellow]warning:[/] " + escape(f"the search was seeded: {SEEDED_NOTE}"))
    if d.get("subject") in ("record", "user"):
        out.print(escape(f"[OPERATOR ONLY] {d['operator_only'].removeprefix('operator-only: ')}"))
    if d.get("subject") == "record":
        _print_subject(out, f"Record {d['record_id']}", d)
    if d.get("subject") == "user":
        u = d
        out.print(f"[bold]User {escape(u['user_id'])}[/]: {count(u['records'], 'record')} "
                  f"(active {u['records_active']}, retired {u['records_retired']}, deleted {u['records_deleted']})")
        t = Table()
        for col in ("record id", "status", "spent", "remaining", "times selected",
                    f"realised ε ({escape(d['conversion'])})", "deleted at"):
            t.add_column(col, justify="right" if col not in ("record id", "status") else "left")
        for r in u["record_list"]:
            t.add_row(escape(r["record_id"]), escape(r["status"]), _up(r["spent"]), _down(r["remaining"]),
                      str(r["times_selected"]), _up(r["realised_epsilon_by_conversion"][d["conversion"]], 4),
                      escape(r["deleted_at"] or "—"))
        if d["unit"] == "user":  # the privacy unit's own figure first, then its records' rows (review 42, L6)
            out.print(escape(f"user {u['user_id']} (the privacy unit): spent {_up(u['spent'])}, remaining "
                             f"{_down(u['remaining'])}, realised ε ({d['conversion']}, per user, {d['adjacency']}) "
                             f"{_up(u['realised_epsilon_by_conversion'][d['conversion']], 4)} "
                             f"[{REALISED_LABEL}]"))
        out.print(t)
        if d["unit"] == "user":
            out.print(escape(f"the table's rows are the user's records (each live one carries the user's spent, so its row's "
                             f"realised ε ({d['conversion']}) is the user's); the privacy unit's figure is the line "
                             "above the table"))
        else:
            out.print(escape(f"realised ε ({d['conversion']}) per record: [{REALISED_LABEL}]"))
        out.print(escape(u["user_level"]))
    if not full:
        return
    out.print(escape(f"[OPERATOR ONLY] {d['operator_only'].removeprefix('operator-only: ')}"))
    out.print("[bold]Records[/]")
    r = Table()
    for col in ("records", "active", "retired", "deleted", "queries answered", "batches"):
        r.add_column(col, justify="right")
    r.add_row(str(d["records"]), str(d["records_active"]), str(d["records_retired"]), str(d["records_deleted"]),
              str(d["queries_answered"]), str(d["batches"]))
    out.print(r)
    out.print("retired: budget left below the next count charge; deleted: tombstones (never refunded)")
    if d.get("answers_not_held"):
        out.print(f"queries answered counts {d['answers_not_held']} answers released in events a repair could not "
                  "recover (the ledger no longer holds them; a batch among them sent again is answered afresh)")
    clamp = d["answers_at_k_min"]
    if clamp["answers"]:
        out.print(escape(f"answers at the K_min = {clamp['k_min']:g} clamp: {100 * clamp['share']:.1f}% "
                         f"({clamp['at_k_min']} of {count(clamp['answers'], 'answer')}; noise-only answers are "
                         f"likely there) [OPERATOR ONLY: {clamp['note']}]"))
    out.print("[bold]Distribution over all records[/]")
    q = Table()
    q.add_column("")
    for name, _ in QUANTILES:
        q.add_column(name, justify="right")
    q.add_row("spent", *[_up(d["spent_quantiles"][k], 4) for k, _ in QUANTILES])
    q.add_row("spent / B", *[_up(d["spent_fraction_quantiles"][k], 3) for k, _ in QUANTILES])
    re = d["realised_epsilon"]
    q.add_row(escape(f"realised ε ({re['conversion']})"), *[_up(re[k], 4) for k, _ in QUANTILES])
    out.print(q)
    # review 55, F11: the unit and adjacency of these figures, as every ε printed carries them
    of_user = " (each record carries its user's figure)" if d["unit"] == "user" else ""
    out.print(escape(f"realised ε({re['conversion']}) at δ = {_given(re['delta'])}, {per_unit(d['unit'])}{of_user}, "
                     f"in this table and in the history's median below: {REALISED_LABEL}"))
    hist = d["history"]
    if hist:
        out.print("[bold]History by batch[/]")
        h = Table()
        for col in ("batch", "answers", "queries answered", "active", "retired", "retired %", "deleted",
                    escape(f"median realised ε ({d['conversion']})")):
            h.add_column(col, justify="left" if col == "batch" else "right")
        for row in hist[-HISTORY_ROWS:]:
            h.add_row(escape(str(row["batch_id"])), str(row["answers"]), str(row["queries_answered"]),
                      str(row["records_active"]), str(row["records_retired"]), f"{100 * row['retired_fraction']:.1f}",
                      str(row["records_deleted"]), _up(row["realised_epsilon_median"], 4))
        out.print(h)
        if len(hist) > HISTORY_ROWS:
            out.print(f"last {HISTORY_ROWS} of {len(hist)} batches (all of them in --json)")


def _seeded(chk: dict) -> str:
    """Why an --eps check failed whatever the ε (review 73, F0)."""
    if not chk.get("seeded_answers"):
        return ""
    from ..report_wording import seeded_note

    return f", but {seeded_note(chk['seeded_answers'])}"


def _one_line_check(report: AccountReport) -> None:
    """`account --eps/--min-active` used as a check off a terminal (or with --quiet): one verdict line on stderr,
    the documented exit code, no tables."""
    d = report.data
    parts = []
    chk = d.get("check_eps")
    if chk is not None:
        parts.append(f"--eps {_given(chk['eps'])} check {'passed' if chk['passed'] else 'FAILED'}: guarantee "
                     f"ε({chk['conversion']}) = {_checked_eps(chk)} at δ = {_given(chk['delta'])}, "
                     f"{d['adjacency']}{_seeded(chk)}")
    chk = d.get("check_min_active")
    if chk is not None:
        parts.append(f"--min-active {chk['min_active']} check {'passed' if chk['passed'] else 'FAILED'}: "
                     f"{chk['records_active']} active (need {chk['required']}; operator-only figure)")
    # A failed check is an error, shown under --quiet too; a passed one is a message, silenced by -q (cron
    # mails whatever reaches stderr: UX review 7, finding 4). The exit code says it either way.
    say("; ".join(parts), errors=bool(report.failures))
    if report.failures:
        raise typer.Exit(code=report.failures[0][0].exit_code)  # --eps wins when both fail (exit 4)
    raise typer.Exit(code=0)


def _modes(ctx, *, queries_left: bool, verify: bool, export, eps, min_active, record, user, plot,
           delta=None, conversion=None) -> None:
    """One job per run: --verify, --export and --queries-left each print their own output, so the options of
    another job were silently ignored (review 38: `--queries-left --eps 0.5` exited 0 where the check gives 4;
    `--max-queries` without --queries-left did nothing). Refused (exit 2) instead."""
    jobs = [flag for flag, on in (("--verify", verify), ("--export", export is not None),
                                  ("--queries-left", queries_left)) if on]
    if len(jobs) > 1:
        raise BadInputError(f"{jobs[0]} and {jobs[1]} are separate jobs: run account once for each")
    if jobs:
        extra = [flag for flag, on in (("--eps", eps is not None), ("--min-active", min_active is not None),
                                       ("--record", record is not None), ("--user", user is not None),
                                       ("--plot", plot is not None)) if on]
        if jobs[0] != "--export":  # the export's ε columns use them; the check and the allowance read no ε
            extra += [flag for flag, on in (("--delta", delta is not None), ("--conversion", conversion is not None))
                      if on]
        if extra:
            raise BadInputError(f"{extra[0]} does not apply to {jobs[0]}, which prints only its own result: run "
                                "account once for each")
    if given_on_command_line(ctx, "max_queries") and not queries_left:
        raise BadInputError("--max-queries is the T of --queries-left: give --queries-left too")


def account_command(
    ctx: typer.Context,
    ledger: Optional[Path] = typer.Option(None, "--ledger", help="Ledger folder (else $INDKNN_LEDGER, ./indknn-ledger)."),
    store: Optional[str] = typer.Option(None, "--store", envvar="INDKNN_STORE", show_envvar=False,
                                         help="Feature store: a folder or an s3:// URL (else $INDKNN_STORE; optional): checks that the ledger belongs to it and reports its label names and rows not yet indexed."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object on stdout instead of tables."),
    eps: Optional[float] = typer.Option(None, "--eps", help="Check: exit 4 when the ledger's guarantee ε (headline conversion, see --conversion) at δ is above E (cron)."),
    delta: Optional[float] = typer.Option(None, "--delta", help="δ for the guarantee and the --eps check (default: the ledger's δ)."),
    conversion: Optional[str] = typer.Option(None, "--conversion", help="Headline conversion: gdp or rdp (default: the ledger's). Both are always reported."),
    min_active: Optional[str] = typer.Option(None, "--min-active", help="Operator check (exact, private figure: never gate serving on it): exit 3 when fewer records are active than N (a count, e.g. 500) or a fraction of the records not deleted (e.g. 0.1 or 10%)."),
    queries_left: bool = typer.Option(False, "--queries-left", help="Public gate for cron: print one JSON line (T, queries answered, queries left) and exit 3 when none is left. Reads public figures only; safe to drive serving."),
    max_queries: Optional[str] = typer.Option(None, "--max-queries", envvar="INDKNN_MAX_QUERIES", help="T for --queries-left (default: the ledger's --planned-queries; else $INDKNN_MAX_QUERIES)."),
    record: Optional[str] = typer.Option(None, "--record", help="One record's status, spent, remaining, realised ε, times selected, deletion (data-subject access request): that record's figures and the ledger's guarantee only, nothing about other records."),
    user: Optional[str] = typer.Option(None, "--user", help="One user's records, record by record. Record-unit ledger: no user-level ε (the guarantee is per record, add/remove one record). User-unit ledger (index --privacy-unit user): also the user's own spent and realised ε, per user."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write a picture (PNG/PDF/SVG): retired fraction and median realised loss against queries answered, histogram of spent/B."),
    export: Optional[Path] = typer.Option(None, "--export", help="OPERATOR ONLY (exact private figures): write FILE.parquet or FILE.csv with one row per record as it stands now (id, user, status, spent, budget, remaining, realised ε by conversion, times selected, last change and deleted at as UTC timestamps) and ε, δ, B, conversion, unit and adjacency as columns. Prints one JSON line (file, rows). docs/EXPORT.md has a duckdb query."),
    verify: bool = typer.Option(False, "--verify", help="Walk the ledger's hash chain and check its budgets, the store binding and the store's high-water mark (--store, else the store the ledger records); print what was verified. Exit 1 when a check fails."),
) -> None:
    """Where privacy budgets stand: the (ε, δ) guarantee (gdp and rdp), active/retired/deleted records, history.

    Every ε is for one privacy unit under add/remove adjacency: one record (the default), or one user with all
    their records for a ledger made with `index --privacy-unit user`. Under replace-one adjacency the
    Gaussian-DP μ doubles.

    Read-only: takes no lock and writes nothing, so it is safe while serve-queries holds the ledger lock.

    For the data holder only: the counts, spent budgets and realised losses shown here are exact statistics of
    the private data. They must never drive what query-senders see (whether to serve, what to release): gate
    serving on public figures with --queries-left or serve-queries --max-queries.

    Exit codes: 0 ok (all checks passed); 1 a damaged or rolled-back ledger (or --verify failed); 2 bad input or an unknown --record/--user; 3 no query left (--queries-left) or fewer active records than --min-active; 4 the guarantee is above --eps (4 when both checks fail).
    """
    run_library_call(lambda: _modes(ctx, queries_left=queries_left, verify=verify, export=export, eps=eps,
                                    min_active=min_active, record=record, user=user, plot=plot, delta=delta,
                                    conversion=conversion))
    _load()
    err = stderr_console()
    if store is not None and not store.strip() and not given_on_command_line(ctx, "store"):
        store = None  # a blank $INDKNN_STORE is unset, as in every other command (review 48, F7)
    from_env = store is not None and not given_on_command_line(ctx, "store")  # -v says "from $INDKNN_STORE"
    ledger_path = resolve_ledger(ledger)
    if verify:
        result = run_library_call(lambda: verify_ledger(ledger_path, store_path=_store(store, from_env)))
        emit_json(result) if json_out else typer.echo("\n".join(verification_lines(result)))
        run_library_call(lambda: enforce_verified(result))
        return
    if export is not None:
        from ..export import EXPORT_NOTE, export_account

        result = run_library_call(lambda: export_account(ledger_path=ledger_path, out=export, delta=delta,
                                                         conversion=conversion, store_path=_store(store, from_env)))
        emit_json(result)
        say(f"wrote {count(result['rows'], 'record')} to {result['export']} ({EXPORT_NOTE})")
        return
    if queries_left:
        allowance = run_library_call(lambda: public_allowance(ledger_path=ledger_path, max_queries=max_queries))
        emit_json(allowance.as_dict())
        if allowance.left == 0:
            say(f"query allowance reached: {allowance.answered} of T = {allowance.max_queries} answered", errors=True)
            raise typer.Exit(code=EXIT_BUDGET_EXHAUSTED)
        return
    report = run_library_call(lambda: build_account_report(
        ledger_path=ledger_path, store_path=_store(store, from_env), delta=delta, conversion=conversion, eps=eps,
        min_active=min_active, record_id=record, user_id=user, plot_path=plot))
    d = report.data
    check = d.get("store_check") if isinstance(d, dict) else None
    if check is not None and not check["checked"]:  # D3: the ledger could not be checked against its store
        err.print(escape(check["note"]))
    if (eps is not None or min_active is not None) and not json_out and record is None and user is None \
            and plot is None and (verbosity() == 0 or not sys.stdout.isatty()):
        _one_line_check(report)  # cron: one line on stderr, no tables
    if json_out:
        emit_json(d)
    else:
        _print_tables(report, full=record is None and user is None)
    if plot is not None:
        err.print(escape(f"wrote {plot}"))
    if d["conversion"] != d["ledger_conversion"]:
        err.print(escape(f"note: headline conversion {d['conversion']}, the ledger was calibrated with "
                         f"{d['ledger_conversion']}"))
    chk = d.get("check_eps")
    if chk is not None:
        over = chk["records_realised_above_eps"]
        verdict = "passed" if chk["passed"] else "FAILED"
        err.print(escape(f"--eps {_given(chk['eps'])} check {verdict}: guarantee ε({chk['conversion']}) = "
                         f"{_checked_eps(chk)} at δ = {_given(chk['delta'])}, {d['adjacency']}{_seeded(chk)}"))
        err.print(escape(f"{over} {'record' if over == 1 else 'records'}' realised loss ε({chk['conversion']}, per "
                         f"{d['unit']}, {d['adjacency']}) is above {_given(chk['eps'])} (informational: {REALISED_LABEL})"))
    chk = d.get("check_min_active")
    if chk is not None and chk["passed"]:
        err.print(escape(f"--min-active {chk['min_active']} check passed: {chk['records_active']} active "
                         f"(need {chk['required']}; operator-only figure)"))
    run_library_call(lambda: enforce_checks(report))


def _store(store: Optional[str], from_env: bool):
    """--store as given (a folder or an s3:// URL, mapped to its state folder), or None. An empty --store is refused
    as in every other command (review 50, F9: `--verify --store ""` checked the recorded store instead). ``from_env``:
    typer read it from $INDKNN_STORE, which resolve_store reads itself and names (review 60, F5)."""
    from .common import resolve_store

    return None if store is None else resolve_store(None if from_env else store)


def _checked_eps(chk: dict) -> str:
    """The ε of an ``--eps`` check: rounded up, unless that would print a figure above the --eps it passed (review 50,
    F7: "--eps 0.99999999999995 check passed: ε = 1"); then exactly."""
    shown = _up(chk["epsilon"])
    if chk["passed"] and chk["epsilon"] is not None and float(shown) > chk["eps"]:
        return _given(chk["epsilon"])
    return shown
