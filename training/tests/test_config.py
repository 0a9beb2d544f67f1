"""Trainer config: file + command line, validated with messages that name the key, the value and the fix."""

import dataclasses
from pathlib import Path

import pytest
import yaml
from eagle3 import config, config_help
from eagle3.config import TrainConfig, dump_config, load_config
from eagle3.errors import ConfigError


def _file(tmp_path, **values):
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump({"data_dir": "/data", "run_dir": str(tmp_path / "run"), **values}))
    return path


def test_file_values_then_command_line_overrides_win(tmp_path):
    cfg = load_config(
        str(_file(tmp_path, max_seq_len=4096, lr=1e-4)), ["--max-seq-len", "16384", "--lr=3e-4", "--fsdp"]
    )
    assert cfg.max_seq_len == 16384
    assert cfg.lr == pytest.approx(3e-4)
    assert cfg.fsdp is True
    assert cfg.ttt_steps == 5  # default kept


def test_json_config_and_list_override(tmp_path):
    path = tmp_path / "c.json"
    path.write_text('{"data_dir": "/d", "run_dir": "/r", "standin_gpu_devices": ["/dev/nvidia0"]}')
    cfg = load_config(str(path), ["--standin-gpu-devices", "/tmp/a,/tmp/b"])
    assert cfg.standin_gpu_devices == ["/tmp/a", "/tmp/b"]


@pytest.mark.parametrize(
    ("override", "words"),
    [
        (["--max-seq-len", "24000"], ["max_seq_len=24000", "multiple of 128", "23936", "24064"]),
        (["--max-seq-len", "0"], ["max_seq_len=0", "positive multiple"]),
        (["--ttt-steps", "0"], ["ttt_steps=0", "at least 1"]),
        (["--device", "tpu"], ["device='tpu'", "auto, cpu, cuda"]),
        (["--lr", "fast"], ["lr='fast'", "a number"]),
        (["--ttt-gamma", "1.5"], ["ttt_gamma=1.5", "(0, 1]"]),
        (["--val-fraction", "1"], ["val_fraction=1.0", "[0, 1)"]),
        (["--max-sequence-len", "4096"], ["unknown config key 'max_sequence_len'", "max_seq_len"]),
    ],
)
def test_bad_values_are_named_with_the_fix(tmp_path, override, words):
    with pytest.raises(ConfigError) as e:
        load_config(str(_file(tmp_path)), override)
    for word in words:
        assert word in str(e.value)


def test_unknown_key_in_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="unknown config key 'batch_size'"):
        load_config(str(_file(tmp_path, batch_size=8)), [])


def test_missing_paths_are_reported(tmp_path):
    with pytest.raises(ConfigError, match="data_dir is empty"):
        load_config(None, ["--run-dir", "/r"])
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(str(tmp_path / "nope.yaml"), [])


def test_dump_round_trips(tmp_path):
    cfg = load_config(str(_file(tmp_path)), ["--max-seq-len", "2048"])
    path = dump_config(cfg, tmp_path / "run")
    again = TrainConfig(**yaml.safe_load(path.read_text()))
    assert again == cfg


# ------------------------------------------------------------------------------------- the declaration
def test_every_key_is_declared_with_help_and_a_type():
    for spec in config.SPECS.values():
        assert spec.help and "\n" not in spec.help, spec.name
        assert spec.type_name in ("int", "float", "bool", "str", "bool|str", "list", "mapping"), spec.name
        assert not (spec.choices and spec.bound), f"{spec.name}: choices or a bound, not both"
    assert set(config.SPECS) == {f.name for f in dataclasses.fields(TrainConfig)}
    assert config.CHOICES["device"] == ("auto", "cpu", "cuda")


@pytest.mark.parametrize("name", [n for n, s in config.SPECS.items() if s.bound and s.bound is not config.REQUIRED])
def test_each_bound_is_enforced_with_the_key_the_value_and_the_bound(tmp_path, name):
    spec = config.SPECS[name]
    bad = {
        ">= 1": 0,
        ">= 0": -1,
        "> 0": 0,
        "(0, 1]": 1.5,
        "[0, 1)": 1.0,
        "[0, 1]": 1.5,
        "multiple of 128": 100,
        config.CHECKPOINT_MODE.label: "sometimes",
    }[spec.bound.label]
    with pytest.raises(ConfigError) as e:
        load_config(str(_file(tmp_path)), [spec.flag, str(bad)])
    message = str(e.value)
    assert message.startswith(f"{name}=") and str(bad) in message and spec.bound.says in message


@pytest.mark.parametrize("name", list(config.CHOICES))
def test_each_choice_list_is_enforced(tmp_path, name):
    with pytest.raises(ConfigError, match=f"{name}='nope' is not one of {', '.join(config.CHOICES[name])}"):
        load_config(str(_file(tmp_path)), [f"--{name}", "nope"])


@pytest.mark.parametrize(
    ("written", "argv", "expected"),
    [
        (False, [], False),
        (True, [], True),
        ("selective", [], "selective"),
        ("full", [], "full"),
        ("off", [], False),
        (False, ["--activation-checkpointing", "selective"], "selective"),
        ("selective", ["--activation-checkpointing"], True),  # a bare flag means true (full)
        ("selective", ["--activation-checkpointing=false"], False),
    ],
)
def test_activation_checkpointing_takes_a_boolean_or_a_mode(tmp_path, written, argv, expected):
    cfg = load_config(str(_file(tmp_path, activation_checkpointing=written)), argv)
    assert cfg.activation_checkpointing == expected and type(cfg.activation_checkpointing) is type(expected)


@pytest.mark.parametrize("value", ["sometimes", 3, [True]])
def test_activation_checkpointing_refuses_anything_else_naming_the_modes(tmp_path, value):
    with pytest.raises(ConfigError, match=r"activation_checkpointing=.* is not (one of )?false, selective"):
        load_config(str(_file(tmp_path, activation_checkpointing=value)), [])


def test_unknown_key_lists_the_known_ones(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(str(_file(tmp_path)), ["--help"])
    assert "unknown config key 'help'" in str(e.value)
    assert all(name in str(e.value) for name in config.SPECS)


def test_train_help_lists_every_key_with_type_default_and_allowed_values():
    text = config_help.render_help()
    for spec in config.SPECS.values():
        line = next(line for line in text.splitlines() if line.strip().startswith(spec.flag + " "))
        assert config.format_default(spec.default) in line or spec.bound is config.REQUIRED, line
        assert spec.allowed in line, line
        assert spec.help in text
    assert "--config FILE" in text


def test_readme_key_table_is_the_declaration():
    readme = Path(__file__).resolve().parents[1] / "README.md"
    assert config_help.readme_table(readme.read_text()) == config_help.render_markdown(), (
        "training/README.md's config key table differs from eagle3/config.py; "
        "regenerate it: cd training && python -m eagle3.config_help --readme README.md"
    )


def test_update_readme_rewrites_only_between_the_markers(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n{config_help.README_BEGIN}\nold table\n{config_help.README_END}\noutro\n")
    assert config_help.update_readme(readme) is True
    text = readme.read_text()
    assert text.startswith("intro\n") and text.endswith("outro\n") and "old table" not in text
    assert config_help.readme_table(text) == config_help.render_markdown()
    assert config_help.update_readme(readme) is False


def test_the_ttt_steps_default_is_declared_once():
    """The config's default, the TTT forward's and the export's speculative tokens are eagle3.options.TTT_STEPS."""
    import inspect

    from eagle3 import export, model, options

    assert config.SPECS["ttt_steps"].default is options.TTT_STEPS
    for fn, name in (
        (model.ttt_forward, "ttt_steps"),
        (model.Eagle3Drafter.forward, "ttt_steps"),
        (export.export_speculators, "speculative_tokens"),
    ):
        assert inspect.signature(fn).parameters[name].default is options.TTT_STEPS, fn.__qualname__
