"""Thin wrapper: `indknn bench audit ARGS` is the same."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from indknn_cli.benchmarks.audit import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
