# indknn — two commands on a fresh machine: `make demo` and `make test`.
PY ?= python3
VENV := .venv
IMAGE_VENV := .venv-image
BIN := $(VENV)/bin
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
DEMO := demo_out

.PHONY: demo test test-fast test-image test-slow bench-quick clean

# Lean install: the CPU build of torch from local disk first, so that no
# dependency pulls the CUDA build.
$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	touch $@

# open_clip + torchvision: no CPU torchvision exists, so this venv takes the
# registry's CUDA torch (runs on CPU). Only the image-extractor tests use it.
$(IMAGE_VENV)/.installed: pyproject.toml
	$(PY) -m venv $(IMAGE_VENV)
	$(IMAGE_VENV)/bin/pip install -q --upgrade pip
	$(IMAGE_VENV)/bin/pip install -q -e '.[dev,image]'
	touch $@

demo: $(VENV)/.installed
	rm -rf $(DEMO) && mkdir -p $(DEMO)
	$(BIN)/indknn embed sample_data/ag_news_private.csv --store $(DEMO)/store.zarr --role private \
	    --extractor text --text-column text --label-column label --id-column id --user-column user \
	    --label-names Business,Sci/Tech,Sports,World \
	  | $(BIN)/indknn index --ledger $(DEMO)/ledger --eps 1 --delta 1e-5 --tune private --tune-share 0.2 --planned-queries 1000
	$(BIN)/indknn serve-queries sample_data/ag_news_queries.csv --store $(DEMO)/store.zarr \
	    --ledger $(DEMO)/ledger --text-column text --id-column id --batch-id day-1 --out $(DEMO)/answers-day-1.parquet
	$(BIN)/indknn account --store $(DEMO)/store.zarr --ledger $(DEMO)/ledger
	$(BIN)/indknn account --ledger $(DEMO)/ledger --eps 1 && echo "budget check passed: every record ε ≤ 1 at δ = 1e-5 (rdp conversion: the tuning search and serving composed)" >&2

test: $(VENV)/.installed $(IMAGE_VENV)/.installed
	$(BIN)/python -m pytest -q
	$(BIN)/python -m pytest -q -m 'heavy and not slow and not image'
	$(IMAGE_VENV)/bin/python -m pytest -q -m image

test-fast: $(VENV)/.installed
	$(BIN)/python -m pytest -q

test-heavy: $(VENV)/.installed
	$(BIN)/python -m pytest -q -m 'heavy and not slow and not image'

test-image: $(IMAGE_VENV)/.installed
	$(IMAGE_VENV)/bin/python -m pytest -q -m image

test-slow: $(VENV)/.installed
	$(BIN)/python -m pytest -q -m slow

bench-quick: $(VENV)/.installed
	$(BIN)/indknn bench accuracy-vs-eps --quick --out bench_out

clean:
	rm -rf $(VENV) $(IMAGE_VENV) $(DEMO) bench_out
