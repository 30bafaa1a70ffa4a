"""indknn: differentially private prediction with Ind-KNN (individual Rényi filters).

The library part (store, ledger, engine, accounting, ...) imports without typer
or rich; the command line lives in :mod:`indknn_cli.cli`.
"""

__version__ = "0.1.0"
FORMAT_VERSION = 1
