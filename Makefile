# `make demo` and `make test` are the two commands for a new user; both create .venv/ when missing.
VENV ?= .venv
PY := $(VENV)/bin/python
# Python 3.12: pyenv's 3.12 where present (its bare shim refuses when another version is global).
PYTHON312 ?= $(shell (PYENV_VERSION=$$(pyenv versions --bare 2>/dev/null | grep '^3\.12' | tail -n1) \
	python3.12 -c 'import sys; print(sys.executable)' || python3.12 -c 'import sys; print(sys.executable)') 2>/dev/null)
SOURCES := $(wildcard ffi/*.cc ffi/*.h cuda/*.cu cuda/*.h cuda/*.cuh cuda/CMakeLists.txt) CMakeLists.txt pyproject.toml

.PHONY: demo test bench install clean bazel-test

$(VENV)/.deps: requirements-dev.txt
	@test -n "$(PYTHON312)" || { echo "error: Python 3.12 not found (install it, or set PYTHON312=/path/to/python3.12)"; exit 1; }
	test -x $(PY) || $(PYTHON312) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
	touch $@

# Rebuilt when a C++/CUDA source changes; the package itself is an editable install of the checkout.
$(VENV)/.installed: $(VENV)/.deps $(SOURCES)
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) -m magi_jax demo
	$(PY) examples/train_lm.py --steps 20
	$(PY) examples/drop_in_attention.py

test: install
	$(PY) -m pytest -q

bench: install
	$(PY) -m magi_jax bench --backend cpu

# Bazel (Debian's bazel-bootstrap 4.2.3, offline): installs it when missing; the build takes the headers,
# nanobind and the test interpreter from the venv (see README.md, Bazel).
BAZEL ?= bazel
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

bazel-test: $(VENV)/.deps
	@command -v $(BAZEL) >/dev/null || { echo "bazel not found: installing Debian's bazel-bootstrap"; \
		$(SUDO) apt-get update -qq && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bazel-bootstrap; }
	$(BAZEL) test --repo_env=MAGI_JAX_PYTHON=$(abspath $(PY)) //...

clean:
	rm -rf build $(VENV) *.png
