"""Thin wrapper: `indknn bench index-speed ARGS` is the same."""
from indknn_cli.benchmarks.index_speed import main

if __name__ == "__main__":
    main()
