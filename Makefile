# eagle3-pve: the two README commands and their parts.
#   make demo   set up, provision the local CT 129, make real training data in it (the tiny target, datagen.yml),
#               run train.yml on it (max_seq_len=16384)
#   make test   set up, then every lint and test tier, ending with one summary line
#   make test-quick  the inner loop beside it, never instead of it: set up, lint, then both pytest tiers without
#               the tests marked slow (no molecule)
SHELL := /bin/bash
VENV := .venv/bin
MAX_SEQ_LEN ?= 16384

.PHONY: setup demo test test-quick lint pytest molecule clean-ct

setup:
	@scripts/setup.sh

demo: setup
	@PATH=$(CURDIR)/$(VENV):$$PATH scripts/demo.sh $(MAX_SEQ_LEN)

# The set-up's wall time goes into test.sh's closing table of stage times.
test:
	@t0=$$(date +%s); scripts/setup.sh && \
	EAGLE3_SETUP_SECONDS=$$(( $$(date +%s) - t0 )) PATH=$(CURDIR)/$(VENV):$$PATH scripts/test.sh

test-quick: setup
	@PATH=$(CURDIR)/$(VENV):$$PATH scripts/test.sh quick

lint: setup
	@PATH=$(CURDIR)/$(VENV):$$PATH scripts/test.sh lint

pytest: setup
	@PATH=$(CURDIR)/$(VENV):$$PATH scripts/test.sh pytest

molecule: setup
	@PATH=$(CURDIR)/$(VENV):$$PATH scripts/test.sh molecule

clean-ct:
	@PATH=$(CURDIR)/$(VENV):$$PATH ansible-playbook provision.yml -e local_ct_state=absent
