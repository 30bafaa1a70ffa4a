"""Thin wrapper: `indknn bench serve-speed ARGS` is the same."""
from indknn_cli.benchmarks.serve_speed import main

if __name__ == "__main__":
    main()
