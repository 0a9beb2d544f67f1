"""Trainer config: file + command line, validated with messages that name the key, the value and the fix."""

import pytest
import yaml
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
