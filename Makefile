# cachebuild: `make demo` and `make test` do all the set-up themselves (README).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
DEMO   ?= demo-out
# Bench sizes; override e.g. `make bench BENCH_N=2000` for a quick look.
BENCH_N ?= 8000
BENCH_OUT ?= bench-out

.PHONY: install test test-all test-gpu demo bench lint clean device-wheels reliability

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[samples,test,dev]'
	touch $@

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest

test-all: $(STAMP)  ## slow tests too (GPU tests skip without CUDA)
	$(BIN)/python -m pytest -m ""

# The reliability suite, all rows (its fast ones also run in `make test`): kills, disk full, fuzzing,
# hostile files, training faults; prints the trials / survived / lost table, also in reliability-out/.
# RELIABILITY_SEED=N picks other random points; RELIABILITY_FUZZ_EXAMPLES=N inputs per image format.
reliability: $(STAMP)
	RELIABILITY_JSON=reliability-out/table.json $(BIN)/python -m pytest tests/reliability -q \
		-m "not gpu"

test-gpu: $(STAMP)
	$(BIN)/python -m pytest -m gpu

demo: $(STAMP)  ## built-in photos -> cache -> a short CPU (or GPU) training run
	$(BIN)/cachebuild sample $(DEMO)/photos
	$(BIN)/cachebuild imagenet $(DEMO)/photos --size 96 --out $(DEMO)/cache
	$(BIN)/cachebuild info $(DEMO)/cache/train
	$(BIN)/cachebuild train $(DEMO)/cache/train --val $(DEMO)/cache/val --model small_cnn --epochs 15 \
		--batch-size 32 --lr 0.05 --warmup-epochs 1 --workers 2 --out $(DEMO)/run

bench: $(STAMP)
	mkdir -p $(BENCH_OUT)
	$(BIN)/python bench/bench_build.py --n $(BENCH_N) --json $(BENCH_OUT)/build.json
	$(BIN)/python bench/bench_load.py --json $(BENCH_OUT)/load.json
	$(BIN)/python bench/bench_transforms.py --json $(BENCH_OUT)/transforms.json
	$(BIN)/python bench/bench_train.py --json $(BENCH_OUT)/train.json

device-wheels: $(STAMP)  ## zarr and simplejpeg for the GPU device image (Python 3.12, x86-64, no registry): see .ci/gpu-checks
	$(BIN)/python -m pip download -q "zarr==$$($(BIN)/python -c 'import zarr; print(zarr.__version__)')" \
		--python-version 3.12 --only-binary=:all: \
		--platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d .device-wheels
	$(BIN)/python -m pip download -q "simplejpeg==$$($(BIN)/python -c 'import simplejpeg; print(simplejpeg.__version__)')" \
		--python-version 3.12 --only-binary=:all: --no-deps \
		--platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d .device-wheels

lint: $(STAMP)
	$(BIN)/ruff check cachebuild loaders tests bench

clean:
	rm -rf $(DEMO) $(BENCH_OUT) reliability-out .pytest_cache
