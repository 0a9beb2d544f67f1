# Copyright: eagle3-pve contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""Every role's variables and the kind of value each takes (a KINDS entry of input_grammar.py, or a structure).

role_inputs.py checks a role's variables against its table here; tests/test_role_inputs.py holds every table to its
role's meta/argument_specs.yml and defaults/main.yml. Data only: this file defines no filter (Ansible loads every
file in this folder as a filter plugin, so it has an empty FilterModule).
"""

from __future__ import annotations

# ---------------------------------------------------------------------------------------------------- tables
# name -> spec. "kind": a KINDS entry, or one of: seq_len, bool, int, float, nproc, node_rank, context_parallel,
# list (of "of": a kind), int_list, dict (keys "keys", values "values": kinds), trainer_config (a dict the trainer's
# declaration checks; "forbid": keys the role sets itself), raw (checked elsewhere; "why" says where). "empty": ""
# is allowed.
# int/float/int_list: "min"/"max" inclusive, "below" exclusive. tests/test_role_inputs.py holds every table to its
# role's meta/argument_specs.yml.
ROLE_FORBIDDEN_KEYS = ("max_seq_len", "context_parallel", "data_dir", "run_dir")
ROLE_VARIABLES: dict[str, dict[str, dict]] = {
    "eagle3_train": {
        "eagle3_train_max_seq_len": {"kind": "seq_len"},
        "eagle3_train_allow_unplanned_seq_len": {"kind": "bool"},
        "eagle3_train_context_parallel": {"kind": "context_parallel"},
        "eagle3_train_prefix": {"kind": "owned_dir"},
        "eagle3_train_config_dir": {"kind": "owned_dir"},
        "eagle3_train_run_dir": {"kind": "owned_dir"},
        "eagle3_train_data_dir": {"kind": "owned_dir"},
        "eagle3_train_synth_if_missing": {"kind": "bool"},
        "eagle3_train_synth_args": {"kind": "list", "of": "argv_item"},
        "eagle3_train_venv": {"kind": "owned_dir"},
        "eagle3_train_venv_provided": {"kind": "bool"},
        "eagle3_train_vllm": {"kind": "bool"},
        "eagle3_train_python": {"kind": "command"},
        "eagle3_train_nproc": {"kind": "nproc"},
        "eagle3_train_cpu_workers": {"kind": "int", "min": 1},
        "eagle3_train_nodes": {"kind": "list", "of": "inventory_host"},
        "eagle3_train_node_rank": {"kind": "node_rank"},
        "eagle3_train_node_addr": {"kind": "host"},
        "eagle3_train_rdzv_port": {"kind": "int", "min": 1, "max": 65535},
        "eagle3_train_run_id": {"kind": "run_id"},
        "eagle3_train_rdzv_timeout": {"kind": "int", "min": 1},
        "eagle3_train_socket_ifname": {"kind": "ifname", "empty": True},
        "eagle3_train_nccl_ib_hca": {"kind": "ib_hca", "empty": True},
        "eagle3_train_state_dir": {"kind": "owned_dir"},
        "eagle3_train_config": {"kind": "trainer_config", "forbid": ROLE_FORBIDDEN_KEYS},
        "eagle3_train_config_overrides": {"kind": "trainer_config", "forbid": ROLE_FORBIDDEN_KEYS},
        "eagle3_train_env": {"kind": "dict", "keys": "worker_env_name", "values": "text"},
        "eagle3_train_plan_memory_gb": {"kind": "float", "min": 0.0},
        "eagle3_train_plan_margin": {"kind": "float", "min": 0.0, "below": 1.0},
        "eagle3_train_min_steps": {"kind": "int", "min": 1},
        "eagle3_train_health_timeout": {"kind": "int", "min": 1},
        "eagle3_train_health_poll": {"kind": "int", "min": 1},
        "eagle3_train_stall_timeout": {"kind": "int", "min": 1},
        "eagle3_train_stop_timeout": {"kind": "int", "min": 1},
        "eagle3_train_kill_after": {"kind": "int", "min": 1},
        "eagle3_train_restart_sec": {"kind": "int", "min": 0},
        "eagle3_train_nice": {"kind": "int", "min": -20, "max": 19},
        "eagle3_train_node_exporter": {"kind": "bool"},
        "eagle3_train_node_exporter_listen": {"kind": "listen_address"},
        "eagle3_train_node_exporter_textfile_dir": {"kind": "owned_dir"},
        "eagle3_train_restart_delays": {"kind": "int_list", "min": 0},
        "eagle3_train_restart_limit": {"kind": "int", "min": 1},
        "eagle3_train_enabled": {"kind": "bool"},
        "eagle3_train_start_ct": {"kind": "bool"},
        "eagle3_train_lock_wait": {"kind": "int", "min": 0},
    },
    "gpu_cleanup": {
        "gpu_cleanup_unit": {"kind": "unit"},
        "gpu_cleanup_marker": {"kind": "env_marker"},
        "gpu_cleanup_devices": {"kind": "list", "of": "path_glob"},
        "gpu_cleanup_protect": {"kind": "list", "of": "proc_glob"},
        "gpu_cleanup_match_cmdline": {"kind": "list", "of": "regex", "empty": True},
        "gpu_cleanup_sweep": {"kind": "list", "of": "sweep_glob", "empty": True},
        "gpu_cleanup_stop_timeout": {"kind": "float", "min": 0.0},
        "gpu_cleanup_term_timeout": {"kind": "float", "min": 0.0},
        "gpu_cleanup_kill_timeout": {"kind": "float", "min": 0.0},
        "gpu_cleanup_stop_report": {"kind": "abspath", "empty": True},
        "gpu_cleanup_timeout": {"kind": "float", "min": 1.0},
        "gpu_cleanup_gpu_memory_tolerance_mib": {"kind": "int", "min": 0},
        "gpu_cleanup_respawn_window": {"kind": "float", "min": 0.0},
        "gpu_cleanup_spare_unit": {"kind": "bool"},
        "gpu_cleanup_other_units": {"kind": "list", "of": "unit", "empty": True},
    },
    "eagle3_datagen": {
        "eagle3_datagen_target": {"kind": "abspath"},
        "eagle3_datagen_tiny_target": {"kind": "bool"},
        "eagle3_datagen_data": {"kind": "abspath"},
        "eagle3_datagen_out": {"kind": "owned_dir"},
        "eagle3_datagen_max_len": {"kind": "int", "min": 2},
        "eagle3_datagen_draft_vocab": {"kind": "int", "min": 0},
        "eagle3_datagen_dtype": {"kind": "raw", "why": "its choices (meta/argument_specs.yml)"},
        "eagle3_datagen_shard_samples": {"kind": "int", "min": 1},
        "eagle3_datagen_regenerate": {"kind": "bool"},
        "eagle3_datagen_temperature": {"kind": "float", "min": 0},
        "eagle3_datagen_seed": {"kind": "int", "min": 0},
        "eagle3_datagen_prefix": {"kind": "owned_dir"},
        "eagle3_datagen_venv": {"kind": "owned_dir"},
        "eagle3_datagen_timeout": {"kind": "int", "min": 1},
        "eagle3_datagen_poll": {"kind": "int", "min": 1},
    },
    "eagle3_evaluate": {
        "eagle3_evaluate_target": {"kind": "abspath"},
        "eagle3_evaluate_data": {"kind": "abspath"},
        "eagle3_evaluate_run_dir": {"kind": "owned_dir"},
        "eagle3_evaluate_checkpoint": {"kind": "raw", "why": "its choices (meta/argument_specs.yml)"},
        "eagle3_evaluate_k": {"kind": "int", "min": 1, "max": 16},
        "eagle3_evaluate_max_new": {"kind": "int", "min": 1},
        "eagle3_evaluate_prompts": {"kind": "int", "min": 1},
        "eagle3_evaluate_prefix": {"kind": "owned_dir"},
        "eagle3_evaluate_venv": {"kind": "owned_dir"},
        "eagle3_evaluate_timeout": {"kind": "int", "min": 1},
    },
    "run_lock": {
        "run_lock_path": {"kind": "abspath"},
        "run_lock_purpose": {"kind": "text", "empty": True},
        "run_lock_playbook": {"kind": "text", "empty": True},
        "run_lock_wait": {"kind": "int", "min": 0},
        "run_lock_ttl": {"kind": "int", "min": 1},
        "run_lock_renew_for": {"kind": "int", "min": 0},
        "run_lock_break": {"kind": "lock_token", "empty": True},
    },
    "ct_running": {
        "ct_running_when_stopped": {"kind": "raw", "why": "its choices (meta/argument_specs.yml)"},
        "ct_running_start": {"kind": "bool"},
        "ct_running_boot_timeout": {"kind": "int", "min": 1},
    },
    "local_ct": {
        "local_ct_vmid": {"kind": "int", "min": 100, "max": 999999999},
        "local_ct_state": {"kind": "raw", "why": "its choices (meta/argument_specs.yml)"},
        "local_ct_lxcpath": {"kind": "owned_dir"},
        "local_ct_suite": {"kind": "deb_suite"},
        "local_ct_mirror": {"kind": "url"},
        "local_ct_rootfs_cache": {"kind": "owned_dir"},
        "local_ct_packages": {"kind": "list", "of": "deb_package"},
        "local_ct_disabled_units": {"kind": "list", "of": "unit", "empty": True},
        "local_ct_standin_dir": {"kind": "owned_dir"},
        "local_ct_gpu_devices": {"kind": "raw", "why": "the role's device checks (tasks/present.yml)"},
        "local_ct_train_venv": {"kind": "abspath", "empty": True},
        "local_ct_train_venv_mountpoint": {"kind": "abspath"},
        "local_ct_extra_binds": {"kind": "list", "of": "abspath", "empty": True},
        "local_ct_shared_dirs": {"kind": "list", "of": "bind_pair", "empty": True},
        "local_ct_boot_timeout": {"kind": "int", "min": 1},
        "local_ct_rootfs_build_timeout": {"kind": "int", "min": 1},
    },
    "pve_gpu_host": {
        "pve_gpu_host_root": {"kind": "abspath"},
        "pve_gpu_host_uvm_unit": {"kind": "bool"},
        "pve_gpu_host_uvm_unit_name": {"kind": "unit"},
        "pve_gpu_host_persistenced": {"kind": "bool"},
        "pve_gpu_host_require_control_devices": {"kind": "bool"},
    },
    "gpu_userspace": {
        "gpu_userspace_driver_version": {"kind": "version", "empty": True},
        "gpu_userspace_run_path": {"kind": "abspath", "empty": True},
        "gpu_userspace_run_url": {"kind": "url", "empty": True},
        "gpu_userspace_run_checksum": {"kind": "checksum", "empty": True},
        "gpu_userspace_run_dest": {"kind": "abspath"},
        "gpu_userspace_installer_args": {"kind": "list", "of": "argv_item", "empty": True},
        "gpu_userspace_install_timeout": {"kind": "int", "min": 1},
        "gpu_userspace_smi_timeout": {"kind": "int", "min": 1},
        "gpu_userspace_nvidia_smi": {"kind": "command"},
        "gpu_userspace_lib_dirs": {"kind": "list", "of": "abspath"},
    },
    "pve_gpu_container": {
        "pve_gpu_container_vmid": {"kind": "int", "min": 100, "max": 999999999},
        "pve_gpu_container_node_host": {"kind": "inventory_host"},
        "pve_gpu_container_node": {"kind": "dns_label"},
        "pve_gpu_container_state": {"kind": "raw", "why": "its choices (meta/argument_specs.yml)"},
        "pve_gpu_container_template": {"kind": "pve_volume"},
        "pve_gpu_container_rootfs": {"kind": "pve_volume"},
        "pve_gpu_container_hostname": {"kind": "dns_label"},
        "pve_gpu_container_cores": {"kind": "int", "min": 1},
        "pve_gpu_container_memory": {"kind": "int", "min": 16},
        "pve_gpu_container_swap": {"kind": "int", "min": 0},
        "pve_gpu_container_net": {"kind": "list", "of": "pve_property", "empty": True},
        "pve_gpu_container_features": {"kind": "dict", "keys": "env_name", "values": "flag"},
        "pve_gpu_container_onboot": {"kind": "bool"},
        "pve_gpu_container_unprivileged": {"kind": "bool"},
        "pve_gpu_container_gpus": {
            "kind": "raw",
            "why": "the pve_gpu_devices filter (GPU numbers on the node)",
        },
        "pve_gpu_container_control_devices": {"kind": "list", "of": "abspath", "empty": True},
        "pve_gpu_container_device_mode": {"kind": "file_mode", "empty": True},
        "pve_gpu_container_device_gid": {"kind": "run_id", "empty": True},
        "pve_gpu_container_extra_devices": {"kind": "raw", "why": "the pve_lxc module's device checks"},
        "pve_gpu_container_rdma": {"kind": "raw", "why": "auto/true/false (tasks/main.yml)"},
        "pve_gpu_container_host_rdma_devices": {"kind": "list", "of": "abspath", "empty": True},
        "pve_gpu_container_host_gpu_devices": {"kind": "list", "of": "abspath", "empty": True},
        "pve_gpu_container_raw_lines": {"kind": "list", "of": "lxc_line", "empty": True},
        "pve_gpu_container_raw_exclusive": {"kind": "bool"},
        "pve_gpu_container_restart": {"kind": "raw", "why": "its choices (meta/argument_specs.yml)"},
        "pve_gpu_container_task_timeout": {"kind": "int", "min": 1},
        "pve_gpu_container_api_backend": {"kind": "raw", "why": "its choices (meta/argument_specs.yml)"},
        "pve_gpu_container_api_host": {"kind": "host", "empty": True},
        "pve_gpu_container_api_port": {"kind": "int", "min": 1, "max": 65535, "empty": True},
        "pve_gpu_container_api_user": {"kind": "pve_user", "empty": True},
        "pve_gpu_container_api_password": {"kind": "secret", "empty": True},
        "pve_gpu_container_api_otp": {"kind": "secret", "empty": True},
        "pve_gpu_container_api_token_id": {"kind": "pve_token_id", "empty": True},
        "pve_gpu_container_api_token_secret": {"kind": "secret", "empty": True},
        "pve_gpu_container_api_validate_certs": {"kind": "bool", "empty": True},
        "pve_gpu_container_api_ca_path": {"kind": "abspath", "empty": True},
        "pve_gpu_container_api_timeout": {"kind": "int", "min": 1, "empty": True},
    },
    # The playbooks' own -e variables (status.yml).
    "status": {
        "report": {"kind": "bool"},
        "report_dir": {"kind": "controller_path"},
    },
}

# Variables a role sets itself (register, set_fact) under its prefix: never inputs, never typos.
ROLE_FACTS: dict[str, tuple[str, ...]] = {
    "gpu_cleanup": ("gpu_cleanup_result",),
    "ct_running": ("ct_running_stopped", "ct_running_stopped_status"),
    "run_lock": (
        "run_lock_controller",
        "run_lock_lease",
        "run_lock_verdict",
        "run_lock_first",
        "run_lock_second",
        "run_lock_third",
    ),
    "pve_gpu_container": (
        "pve_gpu_container_ct",
        "pve_gpu_container_power",
        "pve_gpu_container_raw",
        "pve_gpu_container_devices",
    ),
    "pve_gpu_host": (
        "pve_gpu_host_persistenced_unit_file",
        "pve_gpu_host_uvm_unit_file",
        "pve_gpu_host_driver_version",
        "pve_gpu_host_gpu_devices",
        "pve_gpu_host_control_devices",
        "pve_gpu_host_rdma_devices",
    ),
}

# Names a playbook takes without a role prefix: never strays.
PLAYBOOK_NAMES = ("max_seq_len", "context_parallel", "report", "report_dir")


class FilterModule:
    """No filters: the tables are read by role_inputs.py."""

    def filters(self):
        return {}
