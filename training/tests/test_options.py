"""Run options are resolved once (eagle3.options.resolve_options): the trainer and the memory planner see the
same dtype, attention, sharding and TTT keywords for the same config, and neither resolves them on its own."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import yaml
from eagle3 import loop as loop_module
from eagle3 import options
from eagle3 import plan as P
from eagle3.config import TrainConfig, load_config
from eagle3.distributed import DistInfo
from eagle3.errors import ConfigError
from eagle3.loop import Trainer
from eagle3.metrics import RunFiles
from eagle3.model import ttt_forward
from eagle3.process import StopRequested

# The options both sides report, by the planner's JSON names.
COMPARED = (
    "device",
    "autocast",
    "frozen_bf16",
    "attention",
    "fsdp",
    "activation_checkpointing",
    "loss_chunk_size",
)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from eagle3.synth import SynthConfig, synthesize

    out = tmp_path_factory.mktemp("options") / "data"
    synthesize(out, SynthConfig(num_samples=8, hidden_size=64, min_len=16, max_len=64), log=lambda *a, **k: None)
    return out


def write_config(tmp_path, data, **keys):
    path = tmp_path / "train.yaml"
    values = {
        "data_dir": str(data),
        "run_dir": str(tmp_path / "run"),
        "max_seq_len": 128,
        "val_fraction": 0.25,
    }
    path.write_text(yaml.safe_dump({**values, **keys}))
    return path


def trainer_view(config_path, monkeypatch, world_size: int = 1) -> dict:
    """What the trainer runs with on CPU: its resolved options and, on one rank, what its forward really gets
    (the keywords ttt_forward is called with in a validation pass, autocast, the frozen weights' dtype)."""
    cfg = load_config(str(config_path), [])
    info = DistInfo(rank=0, world_size=world_size, local_rank=0, device=torch.device("cpu"))
    trainer = Trainer(cfg, info, RunFiles(cfg.run_dir, enabled=False), StopRequested(lambda name: None))
    trainer.check_data()
    run = trainer.run_options
    view = {key: getattr(run, key) for key in COMPARED}
    if world_size > 1:  # building the model needs the process group beyond one rank
        return view
    trainer.build_model()
    seen = []

    def spy(module, batch, **kwargs):
        seen.append({**kwargs, "autocast": torch.is_autocast_enabled("cpu")})
        return ttt_forward(module, batch, **kwargs)

    monkeypatch.setattr(loop_module, "ttt_forward", spy)
    assert trainer.validate(step=0) is not None
    forward = seen[0]
    view |= {key: forward[key] for key in ("autocast", "attention", "activation_checkpointing", "loss_chunk_size")}
    view["frozen_bf16"] = trainer.model.embed_tokens.weight.dtype == torch.bfloat16
    assert (forward["ttt_steps"], forward["gamma"]) == (cfg.ttt_steps, cfg.ttt_gamma)
    return view


def planner_view(config_path, capsys, world_size: int = 1) -> dict:
    capsys.readouterr()  # the trainer's log lines
    args = ["--config", str(config_path), "--json", "--memory-gb", "8", "--world-size", str(world_size)]
    assert P.main([*args, "--lengths", "128"]) == 0, capsys.readouterr().err
    planned = json.loads(capsys.readouterr().out)["options"]
    return {key: planned[key] for key in COMPARED}


CONFIGS = [
    ({}, 1),
    ({"dtype": "bf16"}, 1),
    ({"dtype": "fp32", "attention": "exact", "activation_checkpointing": True, "loss_chunk_size": 512}, 1),
    ({"device": "cpu", "attention": "auto", "ttt_steps": 3, "ttt_gamma": 0.8}, 1),
    ({"fsdp": True, "dtype": "bf16"}, 2),
    ({"activation_checkpointing": "selective", "loss_chunk_size": 256}, 1),
]


@pytest.mark.parametrize(("keys", "world_size"), CONFIGS)
def test_trainer_and_planner_see_the_same_resolved_options(tmp_path, data, capsys, monkeypatch, keys, world_size):
    config = write_config(tmp_path, data, **keys)
    assert trainer_view(config, monkeypatch, world_size) == planner_view(config, capsys, world_size)


def test_neither_side_resolves_on_its_own(tmp_path, data, capsys, monkeypatch):
    """Through a resolve_options that answers what no config says, both sides must run with that answer (each
    calls it as eagle3.options.resolve_options, where the test replaces it)."""
    calls = []
    real = options.resolve_options

    def odd(cfg, device, world_size=1, nodes=1):
        calls.append(world_size)
        resolved = real(cfg, device, world_size, nodes)
        return dataclasses.replace(
            resolved,
            loss_chunk_size=384,
            activation_checkpointing="full" if resolved.activation_checkpointing == "none" else "none",
        )

    monkeypatch.setattr(options, "resolve_options", odd)
    config = write_config(tmp_path, data, loss_chunk_size=4096)
    trainer, planner = trainer_view(config, monkeypatch), planner_view(config, capsys)
    assert len(calls) == 2, "the trainer and the planner each resolve once, through eagle3.options"
    for view in (trainer, planner):
        assert view["loss_chunk_size"] == 384 and view["activation_checkpointing"] == "full"


@pytest.mark.parametrize(
    ("keys", "device", "world_size", "expected"),
    [
        ({}, "cpu", 1, dict(autocast=False, frozen_bf16=False, attention="exact", sharded=False)),
        ({}, "cuda", 1, dict(autocast=True, frozen_bf16=True, attention="flex", sharded=False)),
        ({"dtype": "fp32"}, "cuda", 1, dict(autocast=False, frozen_bf16=False, attention="flex")),
        ({"dtype": "bf16"}, "cpu", 1, dict(autocast=True, frozen_bf16=False, attention="exact")),
        ({"fsdp": True}, "cuda", 8, dict(sharded=True, store_frozen_bf16=False)),
        ({"fsdp": True}, "cuda", 1, dict(sharded=False, store_frozen_bf16=True)),
    ],
)
def test_auto_means_one_thing_per_device(keys, device, world_size, expected):
    run = options.resolve_options(TrainConfig(**keys), device, world_size)
    assert {key: getattr(run, key) for key in expected} == expected


def test_flex_on_a_cpu_device_is_refused_once_with_one_message():
    message = "attention='flex' needs CUDA (flex_attention has no backward on CPU); use exact or auto"
    with pytest.raises(ConfigError) as err:
        options.resolve_options(TrainConfig(attention="flex"), "cpu")
    assert str(err.value) == message
    with pytest.raises(ConfigError) as err:  # device: cpu written in the config: refused at load time
        load_config(None, ["--data-dir", "d", "--run-dir", "r", "--device", "cpu", "--attention", "flex"])
    assert str(err.value) == message
