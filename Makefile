# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install -q --disable-pip-version-check -c constraints.txt

.PHONY: demo demo-quick test install clean

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) -e .
	touch $@

$(VENV)/.test-installed: $(VENV)/.installed
	$(PIP) -e '.[test]'
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/vlberts demo --out runs/demo

demo-quick: $(VENV)/.installed
	$(VENV)/bin/vlberts demo --quick --out runs/demo-quick

test: $(VENV)/.test-installed
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) runs .pytest_cache
