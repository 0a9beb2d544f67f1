# eagle3-pve: the two README commands and their parts.
#   make demo   set up, provision the local CT 129, run train.yml on it (max_seq_len=16384)
#   make demo-pipeline   after the demo: the tiny real target -> datagen.yml -> train.yml -> evaluate.yml
#   make test   set up, then every lint and test tier, ending with one summary line
SHELL := /bin/bash
VENV := .venv/bin
MAX_SEQ_LEN ?= 16384

.PHONY: setup demo demo-pipeline test lint pytest molecule clean-ct

setup:
	@scripts/setup.sh

demo: setup
	@PATH=$(CURDIR)/$(VENV):$$PATH scripts/demo.sh $(MAX_SEQ_LEN)

# After the demo: the real pipeline in the same CT (tiny target, datagen.yml, train.yml, cleanup.yml, evaluate.yml).
STEPS ?= 200
demo-pipeline: setup
	@PATH=$(CURDIR)/$(VENV):$$PATH scripts/demo_pipeline.sh $(STEPS)

# The set-up's wall time goes into test.sh's closing table of stage times.
test:
	@t0=$$(date +%s); scripts/setup.sh && \
	EAGLE3_SETUP_SECONDS=$$(( $$(date +%s) - t0 )) PATH=$(CURDIR)/$(VENV):$$PATH scripts/test.sh

lint: setup
	@PATH=$(CURDIR)/$(VENV):$$PATH scripts/test.sh lint

pytest: setup
	@PATH=$(CURDIR)/$(VENV):$$PATH scripts/test.sh pytest

molecule: setup
	@PATH=$(CURDIR)/$(VENV):$$PATH scripts/test.sh molecule

clean-ct:
	@PATH=$(CURDIR)/$(VENV):$$PATH ansible-playbook provision.yml -e local_ct_state=absent
