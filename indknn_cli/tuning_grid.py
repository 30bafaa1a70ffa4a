"""Defaults of `index --tune` (no heavy imports: the CLI shows them in `--help`). docs/TUNING.md explains them.

τ grid: cosine thresholds for sentence-embedding features (all-MiniLM-L6-v2 and its kind), where unrelated
texts score about 0–0.1 and same-topic texts 0.1–0.5: a public prior on the extractor, not on the private data.
σ2 grid: from the range where the filter's budget neither runs out within the planned queries nor goes unused.
Number of runs: logarithmic distribution (η = 0) with mean 10: at the same share it costs less per run than the
geometric one (dp-accounting's RepeatAndSelectDpEvent), so more runs fit.
"""

DEFAULT_TAUS = (0.1, 0.15, 0.2, 0.25, 0.3)
DEFAULT_SIGMA2S = (0.5, 0.8, 1.2)
DEFAULT_TUNE_SHARE = 0.2
DEFAULT_TUNE_RUNS = 10.0
DEFAULT_TUNE_SHAPE = 0.0
DEFAULT_TUNE_QUERIES = 500
