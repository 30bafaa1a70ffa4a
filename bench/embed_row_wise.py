"""What embedding each text on its own costs: the text extractor's row-wise path against batches of 64.

    INDKNN_DATA=../shared/data python bench/embed_row_wise.py [N] [COLUMN]

N AG News test texts (default 384) of COLUMN (``description``, default, or ``title``): the time of
``TextExtractor.embed`` (one text per forward pass on one torch thread, the machine's threads embedding different
texts at once: audit 5) against sentence-transformers' batched ``encode`` (64 per pass, the earlier default, whose
vectors depended on their batch), best of 2 each, in one run; prints the ratio, how many rows the batched vectors
differ in, and whether the row-wise vectors are unchanged when the texts come in reverse order.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np


def main(argv: list[str]) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import pyarrow.csv as pc

    from indknn_cli.extractors import get_extractor

    n = int(argv[0]) if argv else 384
    column = argv[1] if len(argv) > 1 else "description"
    path = Path(os.environ.get("INDKNN_DATA", "../shared/data")) / "ag_news" / "test.csv"
    texts = [str(s) for s in pc.read_csv(path).column(column).to_pylist()[:n]]
    ex = get_extractor("text", device="cpu")
    ex.embed(texts[:4])
    runs: dict[str, list[float]] = {"row-wise": [], "batched": []}
    out = {}
    for _ in range(2):
        for name in runs:
            t0 = time.perf_counter()
            out[name] = (ex.embed(texts) if name == "row-wise" else
                         ex._model.encode(texts, batch_size=64, convert_to_numpy=True, normalize_embeddings=False,
                                          show_progress_bar=False))
            runs[name].append(time.perf_counter() - t0)
    rw, bt = min(runs["row-wise"]), min(runs["batched"])
    reverse = ex.embed(texts[::-1])[::-1]
    print(f"{n} AG News texts ({column}): row-wise {rw:.2f} s, batched-64 {bt:.2f} s, ratio {rw / bt:.2f}; "
          f"batched vectors differ in {int((out['batched'] != out['row-wise']).any(axis=1).sum())} rows "
          f"(max {float(np.abs(out['batched'] - out['row-wise']).max()):.1e}); row-wise in reverse order "
          f"bit-identical: {bool(np.array_equal(reverse, out['row-wise']))}")


if __name__ == "__main__":
    main(sys.argv[1:])
