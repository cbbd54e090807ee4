# The two set-up commands: `make run` (venv + the main job on the embedded corpus) and `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
# python3.12 is required (jax 0.12); pyenv machines may only expose it under their versions directory.
PY312  ?= $(shell for p in python3.12 $$(ls -d $$HOME/.pyenv/versions/3.12*/bin/python3.12 /root/.pyenv/versions/3.12*/bin/python3.12 /usr/local/bin/python3.12 /usr/bin/python3.12 2>/dev/null); do $$p -c 'import sys; assert sys.version_info[:2]==(3,12)' >/dev/null 2>&1 && echo $$p && break; done)
# worksteal: a worker that runs out of tests takes some of those queued on the other
PYTEST_ARGS ?= -n 2 --dist worksteal

.PHONY: venv test test-slow run parity clean
venv: $(VENV)/.installed

$(VENV)/.installed: requirements.lock setup.cfg setup.py pyproject.toml
	@test -n "$(PY312)" || { echo "python3.12 not found: install it or pass PY312=/path/to/python3.12"; exit 1; }
	$(PY312) -m venv $(VENV)
	$(PY) -m pip install -q -r requirements.lock
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $@

test: venv
	$(PY) -m pytest $(PYTEST_ARGS)

test-slow: venv
	$(PY) -m pytest $(PYTEST_ARGS) -m slow

parity: venv
	$(PY) -m moc_jax.parity tests/fixtures/moc_pt_paper_small.npz
	$(PY) -m moc_jax.parity tests/fixtures/moc_pt_token_small.npz

run: venv
	$(PY) -m moc_jax.main --config=configs/moc.py:tiny --workdir=runs/tiny

clean:
	rm -rf $(VENV) runs
