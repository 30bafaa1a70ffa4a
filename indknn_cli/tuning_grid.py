"""The default (τ, σ2) search grid of `index --tune` (no heavy imports: the CLI shows it in `--help`)."""

DEFAULT_TAUS = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7)
DEFAULT_SIGMA2S = (0.3, 0.5, 0.8, 1.2)
