# radbo: two commands for a fresh machine.
#   make demo   create .venv if missing, install radbo, run the demo job (replacing runs/demo)
#   make test   same set-up, then the whole test suite
#   make lint   ruff (lint and format) and mypy on radbo/
#   make test-kernels   the float-sensitive tests once per PyTorch CPU kernel this CPU runs
PYTHON     ?= python3
VENV       ?= .venv
TORCH_SPEC ?= torch==2.13.0
PIP        := $(VENV)/bin/python -m pip
STAMP      := $(VENV)/.radbo-installed
DEMO_CONFIG ?= examples/demo.toml

.PHONY: demo test test-kernels lint install clean

install: $(STAMP)

# Torch first (the CPU build; override TORCH_SPEC for another), then radbo with its dev extra.
$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet "$(TORCH_SPEC)"
	$(PIP) install --quiet -e ".[dev]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/radbo run $(DEMO_CONFIG) --overwrite

test: $(STAMP)
	$(VENV)/bin/python -m pytest -n 2

# PyTorch picks its CPU kernels by instruction set, and each rounds in its own order. The tests
# marked float_sensitive run under every instruction set this CPU offers: the portable kernels,
# AVX2 and, where /proc/cpuinfo lists avx512f, AVX-512 (a set the CPU lacks would silently fall
# back). Each pass holds ATen (ATEN_CPU_CAPABILITY), MKL's matrix products
# (MKL_ENABLE_INSTRUCTIONS) and oneDNN's convolutions (ONEDNN_MAX_CPU_ISA) to the same set, as
# a CPU without the wider ones would run them.
KERNELS = default $(if $(shell grep -qw avx2 /proc/cpuinfo 2>/dev/null && echo y),avx2) \
	$(if $(shell grep -qw avx512f /proc/cpuinfo 2>/dev/null && echo y),avx512)

test-kernels: $(STAMP)
	set -e; for kernel in $(KERNELS); do \
		case $$kernel in \
			default) mkl=SSE4_2; dnn=SSE41 ;; \
			avx2) mkl=AVX2; dnn=AVX2 ;; \
			avx512) mkl=AVX512; dnn=AVX512_CORE ;; \
		esac; \
		echo "== float-sensitive tests, $$kernel kernels (ATen $$kernel, MKL $$mkl, oneDNN $$dnn) on$$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"; \
		ATEN_CPU_CAPABILITY=$$kernel MKL_ENABLE_INSTRUCTIONS=$$mkl ONEDNN_MAX_CPU_ISA=$$dnn \
			$(VENV)/bin/python -m pytest -n 2 -m "float_sensitive and not slow"; \
	done

lint: $(STAMP)
	$(VENV)/bin/ruff check radbo tests examples benchmarks
	$(VENV)/bin/ruff format --check radbo tests examples benchmarks
	$(VENV)/bin/mypy

clean:
	rm -rf $(VENV) runs .pytest_cache
