"""PNG figures of each experiment (the paper's Figures 1–4 / Table 1 counterparts)."""

from __future__ import annotations

import math
from pathlib import Path

from .report import plot_grid, plot_lines

PRIVATE_METHODS = ("ind-knn", "ind-knn+reuse", "private-knn", "linear-noisysgd")
TUNED_METHODS = ("ind-knn (tuned privately)", "ind-knn best grid point (oracle, B_serve)")


def _ds(result: dict) -> str:
    d = result.get("dataset", {})
    return f"{d.get('name', '?')} ({d.get('extractor', '?')}, {d.get('split', {}).get('private', '?')} private)"


def _series(rows: list[dict], x: str, methods) -> tuple[dict, dict]:
    """{method: (xs, median accuracies)} and {method: (min, max)} over query draws, sorted by ``x``."""
    series, bands = {}, {}
    for m in methods:
        pts = sorted((r[x], r["accuracy_median"], r["accuracy_min"], r["accuracy_max"]) for r in rows
                     if r["method"] == m)
        if pts:
            series[m] = ([q[0] for q in pts], [q[1] for q in pts])
            bands[m] = ([q[2] for q in pts], [q[3] for q in pts])
    return series, bands


def _majority(result: dict, hl: dict, hb: dict) -> None:
    maj = result.get("majority_class")
    if maj:
        name = f"majority class ({maj['label_name']})"
        hl[name] = maj["accuracy_median"]
        hb[name] = (maj["accuracy_min"], maj["accuracy_max"])


def make_plots(result: dict, out_dir: Path, stem: str) -> list[Path]:
    out_dir = Path(out_dir)
    kind = result["experiment"]
    paths: list[Path] = []
    if kind == "accuracy-vs-eps":
        rows = result["results"]
        series, bands = _series(rows, "epsilon", PRIVATE_METHODS + TUNED_METHODS)
        if any(m in series for m in TUNED_METHODS):  # say which rows were tuned without privacy
            from .experiments import TABLE_LABEL

            series = {TABLE_LABEL.get(m, m): v for m, v in series.items()}
            bands = {TABLE_LABEL.get(m, m): v for m, v in bands.items()}
        hl = {r["method"]: r["accuracy_median"] for r in rows if float(r["epsilon"]) == math.inf}  # "inf" in a written JSON
        hb = {r["method"]: (r["accuracy_min"], r["accuracy_max"]) for r in rows if float(r["epsilon"]) == math.inf}
        _majority(result, hl, hb)
        T = result["dataset"].get("queries_per_draw")
        c = result["config"]
        paths.append(plot_lines(out_dir / f"{stem}.png", series=series, hlines=hl, bands=bands, hbands=hb,
                                xlabel=f"total ε (δ={c['delta']:g}; Ind-KNN {c['conversion'].upper()}, tuned "
                                f"privately RDP; P-kNN {c['pknn_accountant'].upper()}; SGD "
                                f"{c['sgd_accountant'].upper()}; per record, add/remove one record)",
                                ylabel=f"median accuracy, {T} queries (band: min–max over draws)",
                                title=f"Accuracy vs ε\n{_ds(result)}"))
    elif kind == "accuracy-vs-queries":
        series, bands = _series(result["results"], "queries", PRIVATE_METHODS)
        hl, hb = {}, {}
        _majority(result, hl, hb)
        paths.append(plot_lines(out_dir / f"{stem}.png", series=series, bands=bands, hlines=hl, hbands=hb,
                                xlabel="number of queries T", ylabel="median accuracy (band: min–max over draws)",
                                logx=True, title=f"Accuracy vs T at ε={result['epsilon']:g} (per record, add/remove one "
                                f"record)\n{_ds(result)}"))
    elif kind == "retraining":
        rows = result["results"]
        qs = [r["retrain_every"] for r in rows]
        paths.append(plot_lines(out_dir / f"{stem}_time.png", series={
            "ind-knn (deletions)": (qs, [r["indknn_seconds_per_query"] for r in rows]),
            "linear-noisysgd (retrained)": (qs, [r["noisysgd_seconds_per_query"] for r in rows])},
            xlabel="retrain every Q queries", ylabel="amortised seconds per query", logx=True, logy=True,
            title=f"Amortised cost vs retraining frequency\n{_ds(result)}"))
        series = {}
        for q, c in result["privacy_curves"].items():
            series[f"linear-noisysgd Q={q}"] = (c["queries"], c["noisysgd_epsilon"])
        if result["privacy_curves"]:
            c = result["privacy_curves"][min(result["privacy_curves"], key=lambda k: int(k))]
            series["ind-knn median realised ε (selected records)"] = (
                c["queries"], c["indknn_median_realised_epsilon_selected"])
        paths.append(plot_lines(out_dir / f"{stem}_privacy.png", series=series,
                                hlines={"ind-knn guarantee": result["epsilon"]}, xlabel="queries answered",
                                ylabel="ε (per record, add/remove one record)",
                                title=f"Privacy cost vs queries\n{_ds(result)}"))
    elif kind == "speed":
        series = {}
        for r in result["results"]:
            s = series.setdefault(f"{r['kind']} d={r['d']}", ([], []))
            s[0].append(r["n"])
            s[1].append(r["queries_per_second"])
        paths.append(plot_lines(out_dir / f"{stem}.png", series=series, xlabel="private records N",
                                ylabel="queries / s", logx=True, logy=True, title="Engine throughput (synthetic)"))
    elif kind == "min-margin":
        from .abstain import plot

        paths += plot(result, out_dir, stem)
    elif kind == "tune":
        res = result["result"]
        s1 = res["stage1"]["sweep"]
        paths.append(plot_lines(out_dir / f"{stem}_stage1.png", series={
            "non-private Ind-KNN accuracy": ([r["tau"] for r in s1], [r["accuracy"] for r in s1])},
            xlabel="τ", ylabel="validation accuracy", title=f"Tuner stage 1 (τ* = {res['stage1']['tau_star']})"))
        for eps, grid in res["grids"].items():
            paths.append(plot_grid(out_dir / f"{stem}_eps{eps}.png", grid=grid,
                                   title=f"Tuner stage 2 at ε={eps} ({result.get('conversion', 'gdp')}, per record, "
                                         f"add/remove one record)\n{_ds(result)}"))
    return paths
