#!/usr/bin/env bash
# The main job on the embedded default: provision the local CT 129 (idempotent), make real training data in it, train.
#   1. provision.yml: the CT (LXC, systemd, stand-in GPUs, no network)
#   2. the tiny Llama target, trained on the host from the Python standard library's sources (built once and cached
#      under /var/cache/eagle3-pve, about a minute), copied into the CT with conversations made from the CT's own
#      Python sources (training ones, and held-out ones for evaluate.yml)
#   3. datagen.yml: eagle3 generate from the target, in the CT, as a systemd job (an earlier demo's training, still
#      running, is stopped first with cleanup.yml)
#   4. train.yml on that data, until healthy (it keeps training: cleanup.yml stops it)
# The folders in the CT are inventory/local's variables (eagle3_datagen_*, eagle3_train_data_dir, eagle3_evaluate_*).
# Usage: scripts/demo.sh [MAX_SEQ_LEN]   (make demo MAX_SEQ_LEN=8192)
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
export PATH="$ROOT/.venv/bin:$PATH"
max_seq_len=${1:-16384}
[ "$(id -u)" = 0 ] || { echo "demo: the local CT needs root (LXC containers with systemd); run as root" >&2; exit 1; }
t0=$SECONDS
say() { echo "[demo $((SECONDS - t0)) s] $*"; }

say "provision.yml: local CT 129 (LXC, systemd, stand-in GPUs, no network)"
ansible-playbook provision.yml
say "the tiny target on the host (built once, about a minute, then cached)"
target=$(cd training && HF_HUB_OFFLINE=1 "$ROOT/.venv-train/bin/python" -c \
    'import sys; from eagle3.tiny_target import cached; print(cached(log=lambda *a, **k: print(*a, file=sys.stderr)))')
say "copy it into the CT, with conversations from the CT's own Python sources"
ansible ct129 -m ansible.builtin.copy -a "src=$target/ dest=/var/lib/eagle3/tiny-target/ mode=0644 directory_mode=0755"
ansible ct129 -m ansible.builtin.script -a "$ROOT/scripts/stdlib_chats.py /var/lib/eagle3/chats.jsonl executable=python3"
ansible ct129 -m ansible.builtin.script \
    -a "$ROOT/scripts/stdlib_chats.py /var/lib/eagle3/chats-held-out.jsonl --held-out executable=python3"
# A demo run before this one left its training running (the main job keeps training); datagen.yml refuses to start
# beside a job that holds the GPUs, so this demo's own job is stopped first, the way a user would: cleanup.yml.
if ansible ct129 -m ansible.builtin.command -a "systemctl is-active --quiet eagle3-train.service" >/dev/null 2>&1; then
    say "an earlier demo's training is running in CT 129: cleanup.yml stops it first (datagen.yml needs the GPUs)"
    ansible-playbook cleanup.yml
fi
say "datagen.yml: the training data from the target (eagle3 generate in the CT)"
ansible-playbook datagen.yml
say "train.yml -e max_seq_len=$max_seq_len on that data"
t1=$SECONDS
ansible-playbook train.yml -e "max_seq_len=$max_seq_len"
say "train.yml: healthy after $((SECONDS - t1)) s (clean-up, deploy, start, the first healthy steps)"
say "done. Status any time: ansible-playbook status.yml; stop: ansible-playbook cleanup.yml; then the drafter's real"
say "acceptance length: ansible-playbook evaluate.yml (speculative decoding of the held-out conversations)"
