#!/usr/bin/env bash
# The real pipeline in the demo's CT 129, after `make demo`: the tiny Llama target (trained on the host from the
# Python standard library's sources, built once and cached, copied in), conversations from the CT's own Python
# sources, datagen.yml, train.yml on that data for STEPS healthy steps, cleanup.yml, evaluate.yml.
# Usage: scripts/demo_pipeline.sh [STEPS]   (make demo-pipeline STEPS=300)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
export PATH="$ROOT/.venv/bin:$PATH"
steps=${1:-200}
dir=/var/lib/eagle3-pipeline   # in the CT: the target, the conversations, the dataset and the run
[ "$(id -u)" = 0 ] || { echo "demo-pipeline: the local CT needs root; run as root" >&2; exit 1; }
[[ "$steps" =~ ^[1-9][0-9]*$ ]] || { echo "demo-pipeline: STEPS=$steps is not a positive whole number" >&2; exit 2; }
t0=$SECONDS
say() { echo "[demo-pipeline $((SECONDS - t0)) s] $*"; }

say "provision.yml: the local CT 129 (idempotent)"
ansible-playbook provision.yml
say "the tiny target on the host (built once, about a minute, then cached)"
target=$(cd training && HF_HUB_OFFLINE=1 "$ROOT/.venv-train/bin/python" -c \
    'import sys; from eagle3.tiny_target import cached; print(cached(log=lambda *a, **k: print(*a, file=sys.stderr)))')
say "copy it and the conversations into the CT ($dir)"
ansible ct129 -m ansible.builtin.copy -a "src=$target/ dest=$dir/target/ mode=0644 directory_mode=0755"
ansible ct129 -m ansible.builtin.script -a "cmd='$ROOT/scripts/stdlib_chats.py $dir/chat.jsonl' executable=python3"
say "datagen.yml: eagle3 generate from the target"
ansible-playbook datagen.yml -e "eagle3_datagen_target=$dir/target" -e "eagle3_datagen_data=$dir/chat.jsonl" \
    -e "eagle3_datagen_out=$dir/data" -e eagle3_datagen_max_len=512 -e eagle3_datagen_draft_vocab=512
say "train.yml on that data until $steps healthy steps"
ansible-playbook train.yml -e max_seq_len=1024 -e "eagle3_train_data_dir=$dir/data" -e "eagle3_train_run_dir=$dir/run" \
    -e "eagle3_train_min_steps=$steps"
say "cleanup.yml: stop it (a checkpoint is saved on the way)"
ansible-playbook cleanup.yml
say "evaluate.yml: the real acceptance length by speculative decoding"
ansible-playbook evaluate.yml -e "eagle3_evaluate_target=$dir/target" -e "eagle3_evaluate_data=$dir/chat.jsonl" \
    -e "eagle3_evaluate_run_dir=$dir/run" -e eagle3_evaluate_checkpoint=latest -e eagle3_evaluate_prompts=4 \
    -e eagle3_evaluate_max_new=32
say "done. The run's report: ansible-playbook status.yml -e report=true -e eagle3_train_run_dir=$dir/run"
