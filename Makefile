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

# The attention explorer's browser test (tests/test_explorer.py) drives Debian's Chromium through
# ChromeDriver; install them when missing and we may (root, apt-get). Never fails the set-up: without them
# that one test is skipped.
APT_CHROMIUM := DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium chromium-driver

$(VENV)/.test-installed: $(VENV)/.installed
	$(PIP) -e '.[test]'
	@if [ ! -x /usr/bin/chromedriver ]; then \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    echo "installing chromium + chromium-driver (apt-get) for the explorer's browser test"; \
	    ( $(APT_CHROMIUM) || { apt-get update -q && $(APT_CHROMIUM); } ) >/dev/null 2>&1 \
	      || echo "chromium could not be installed: the explorer's browser test will be skipped"; \
	  else \
	    echo "no /usr/bin/chromedriver (and no root apt-get): the explorer's browser test will be skipped"; \
	  fi; \
	fi
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
