"""Cut the shipped sample from ../shared/data (relative to the repository root).

Run from anywhere:  python sample_data/make_sample.py
Deterministic (seed 20241123): re-running it rewrites the same files.

* ag_news_private.csv   2,000 AG News test rows, 500 per class: id,user,text,label
* ag_news_queries.csv     200 other rows, 50 per class:       id,text,label
* mnist/<digit>/*.png     300 MNIST test digits, 30 per class (class folders 0..9)
* mnist_queries/*.png      50 other MNIST test digits, 5 per class (flat folder)
* mnist_queries.csv       id,path,label for those 50 (path relative to this folder)
"""

from __future__ import annotations

import csv
import shutil
from pathlib import Path

import numpy as np
from PIL import Image

SEED = 20241123
HERE = Path(__file__).resolve().parent
DATA = HERE.parent.parent / "shared" / "data"
AG_CLASSES = {1: "World", 2: "Sports", 3: "Business", 4: "Sci/Tech"}


def stratified(labels: np.ndarray, per_class: int, rng: np.random.Generator, exclude=()) -> np.ndarray:
    excl = set(int(i) for i in exclude)
    out = []
    for c in np.unique(labels):
        pool = np.array([i for i in np.flatnonzero(labels == c) if int(i) not in excl])
        out.extend(rng.choice(pool, size=per_class, replace=False).tolist())
    return np.sort(np.asarray(out))


def ag_news(rng: np.random.Generator) -> None:
    with open(DATA / "ag_news" / "test.csv", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    labels = np.array([int(r["label"]) for r in rows])
    private = stratified(labels, 500, rng)
    queries = stratified(labels, 50, rng, exclude=private)
    assert not set(private.tolist()) & set(queries.tolist())

    def text(r):
        return f"{r['title'].strip()}. {r['description'].strip()}"

    users = rng.integers(1, 501, size=len(private))  # 500 synthetic users, ~4 records each
    with open(HERE / "ag_news_private.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["id", "user", "text", "label"])
        for i, u in zip(private, users):
            w.writerow([f"ag-{i:05d}", f"u{u:04d}", text(rows[i]), AG_CLASSES[int(labels[i])]])
    with open(HERE / "ag_news_queries.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["id", "text", "label"])
        for i in queries:
            w.writerow([f"ag-{i:05d}", text(rows[i]), AG_CLASSES[int(labels[i])]])


def mnist(rng: np.random.Generator) -> None:
    z = np.load(DATA / "mnist" / "mnist.npz")
    x, y = z["x_test"], z["y_test"]
    private = stratified(y, 30, rng)
    queries = stratified(y, 5, rng, exclude=private)
    for d in ("mnist", "mnist_queries"):
        shutil.rmtree(HERE / d, ignore_errors=True)
    for i in private:
        folder = HERE / "mnist" / str(int(y[i]))
        folder.mkdir(parents=True, exist_ok=True)
        Image.fromarray(x[i]).save(folder / f"test-{i:05d}.png", optimize=True)
    (HERE / "mnist_queries").mkdir()
    with open(HERE / "mnist_queries.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["id", "path", "label"])
        for i in queries:
            name = f"test-{i:05d}.png"
            Image.fromarray(x[i]).save(HERE / "mnist_queries" / name, optimize=True)
            w.writerow([f"mnist-{i:05d}", f"mnist_queries/{name}", str(int(y[i]))])


def main() -> None:
    rng = np.random.default_rng(SEED)
    ag_news(rng)
    mnist(rng)
    print(f"sample written to {HERE}")


if __name__ == "__main__":
    main()
