# cachebuild: `make demo` and `make test` do all the set-up themselves (README).
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-stamp
DEMO   ?= demo-out
# Extra arguments for the bench harness, e.g. `make bench BENCH_ARGS="--n 2000 --no-peers"`.
BENCH_ARGS ?=
# glibc tunables for the harness, e.g. BENCH_GLIBC=glibc.cpu.x86_non_temporal_threshold=0x20000 (docs/performance.md,
# "Memory copies on virtual machines"); with any set, the copy-bound load rows are measured again without.
BENCH_GLIBC ?=
# `make test` runs on this many pytest-xdist processes (2: the 2-core box it must finish on in 5 minutes; 1 runs
# it in this process, e.g. to debug; `auto` takes every core)
TEST_WORKERS ?= 2
TIMINGS ?= make-demo make-test
TIMINGS_OUT ?= bench/results/2026-12-02-vm-demo
BENCH_RUN := $(if $(BENCH_GLIBC),GLIBC_TUNABLES=$(BENCH_GLIBC) )$(BIN)/python -m bench

.PHONY: install test test-all test-gpu demo bench bench-quick bench-peers bench-scale lint clean device-wheels reliability timings

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[samples,test,dev]'
	touch $@

install: $(STAMP)

# PYTHONDONTWRITEBYTECODE (set on some machines) would make every pytest process rewrite and compile all ~190 test
# modules again (~10 s of CPU each, on the 2-core box): the test targets let Python keep its bytecode.
test: $(STAMP)  ## the default run: not slow, not gpu, on TEST_WORKERS processes; the 25 slowest listed at the end (durations: README)
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest $(if $(filter 1,$(TEST_WORKERS)),,-n $(TEST_WORKERS)) --durations=25

test-all: $(STAMP)  ## slow tests too (GPU tests skip without CUDA)
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -m ""

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
	$(BIN)/cachebuild imagenet $(DEMO)/photos --size 96 --out $(DEMO)/cache --force  # a plan this small builds in-process; --force: a cache of an older release too
	$(BIN)/cachebuild info $(DEMO)/cache/train
	$(BIN)/cachebuild train $(DEMO)/cache/train --val $(DEMO)/cache/val --model small_cnn --epochs 15 \
		--batch-size 32 --lr 0.05 --warmup-epochs 1 --workers 2 --out $(DEMO)/run --overwrite

bench: $(STAMP)  ## every contender on the same files: bench/results/<date>-<host>/
	$(BENCH_RUN) --profile full $(BENCH_ARGS)

bench-quick: $(STAMP)  ## the same tables on a small set: bench/results/<date>-<host>-quick/
	$(BENCH_RUN) --profile quick $(BENCH_ARGS)

# The ImageNet shape (1,281,167 train files in 1,000 folders + 50,000 flat val) through every step, each step's
# time and memory a curve of N: bench/results/<date>-<host>-scale/scale.{json,md,png}. The generated tree and the
# caches go to SCALE_WORK (outside the repository; the tree, ~5 GB, is made once in ~7 min and kept).
SCALE_WORK ?= /work/scale-data
SCALE_ARGS ?= --n 10000,100000,1281167 --size 32
bench-scale: $(STAMP)  ## every step's time and memory against N (bench/results/2026-12-02-vm-scale: 14 min on 2 cores)
	SCALE_WORK=$(SCALE_WORK) $(BIN)/python -m bench.scale $(SCALE_ARGS)

bench-peers: $(STAMP)  ## a venv per peer (FFCV, LitData, WebDataset, DALI, SPDL, Streaming, datago) in bench/.venvs, then the full run with them
	PY=$(BIN)/python bash bench/peers/setup.sh || echo "some peers did not install (above): the run skips them with the reason"
	$(BENCH_RUN) --profile full $(BENCH_ARGS)

device-wheels: $(STAMP)  ## zarr, simplejpeg, torchcodec, psutil, matplotlib for the GPU device image (Python 3.12, x86-64, no registry)
	$(BIN)/python -m pip download -q "zarr==$$($(BIN)/python -c 'import zarr; print(zarr.__version__)')" psutil matplotlib \
		--python-version 3.12 --only-binary=:all: \
		--platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d .device-wheels
	$(BIN)/python -m pip download -q "simplejpeg==$$($(BIN)/python -c 'import simplejpeg; print(simplejpeg.__version__)')" \
		--python-version 3.12 --only-binary=:all: --no-deps \
		--platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d .device-wheels
	$(BIN)/python -m pip download -q "torchcodec>=0.16" --python-version 3.12 --only-binary=:all: --no-deps \
		--platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 -d .device-wheels

lint: $(STAMP)
	$(BIN)/ruff check cachebuild loaders tests bench support doctools
	$(BIN)/mypy  # cachebuild/, loaders/, bench/, support/, doctools/: settings in pyproject.toml
	$(BIN)/lint-imports  # the layers and no cycles: [tool.importlinter] in pyproject.toml
	$(BIN)/python -m doctools.check_docs  # README.md and docs/: figures traced, generated blocks current, links, flags

# The README's stated durations: `make install` first, then this (adds to the folder's commands.json), then
# `python -m doctools.blocks` to write them into the README.
timings: $(STAMP)
	$(BIN)/python -m doctools.timings --out $(TIMINGS_OUT) $(TIMINGS)

clean:
	rm -rf $(DEMO) bench/work reliability-out .pytest_cache
