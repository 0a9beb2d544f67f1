"""No result from a damaged input: `eagle3 export`, `eagle3 evaluate` and `init_from` verify the weights they load
against their record (a checkpoint's COMPLETE manifest, an export's sha256 in config.json), as training's resume
does. `latest` (and `best` without a best/) passes over a damaged newest checkpoint, naming it and leaving it in
place; a damaged checkpoint named explicitly, a damaged best/ or a damaged export is refused with exit 2.

The damage is one flipped bit in a weight: the file still loads, only its sha256 tells (the worst case)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from eagle3 import checkpoint as ckpt
from eagle3.errors import ConfigError
from eagle3.tiny_target import cached
from pipeline_support import read_status, run_trainer, synth_dataset, write_config
from safetensors.torch import load_file

VERIFIER = ["--verifier", "org/target", "--verifier-arch", "LlamaForCausalLM"]
DAMAGE = "model.safetensors does not match its sha256"
# Every test here reads the module's real training run (below).
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A real tiny run: checkpoints at steps 2 and 4, best/ (the validation at the end) a copy of step 4."""
    base = tmp_path_factory.mktemp("trained")
    data = synth_dataset(base)
    run = base / "run"
    cfg = write_config(
        base / "train.yaml",
        data_dir=str(data),
        run_dir=str(run),
        max_seq_len=512,
        ttt_steps=2,
        max_steps=4,
        warmup_steps=1,
        log_every=2,
        val_every=4,
        val_max_batches=1,
        checkpoint_every=2,
        num_threads=1,
        telemetry_every_s=0,
        tensorboard=False,
    )
    assert run_trainer(["train", "--config", str(cfg)], base / "train.txt", timeout=300) == 0
    assert [s for s, _ in ckpt.list_valid(run)] == [2, 4]
    return run


def copy_run(trained: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the trained run to damage: (run_dir, its checkpoints folder)."""
    run = shutil.copytree(trained, tmp_path / "run")
    return run, ckpt.checkpoints_dir(run)


def flip_a_weight_bit(path: Path) -> None:
    """XOR the lowest bit of the first element of one float tensor of a safetensors file, after its checkpoint or
    export was complete: the file keeps its size and still loads; only its sha256 differs."""
    data = bytearray(path.read_bytes())
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    name = min(k for k, v in header.items() if k != "__metadata__" and v["dtype"] in ("F32", "BF16", "F16"))
    data[8 + length + header[name]["data_offsets"][0]] ^= 1
    path.write_bytes(bytes(data))


def export(run: Path, out: Path, log: Path, *checkpoint: str) -> tuple[int, str]:
    code = run_trainer(["export", str(run), str(out), *VERIFIER, *checkpoint], log)
    return code, log.read_text()


@pytest.mark.parametrize("which", ["latest", "best"])
def test_export_passes_over_a_damaged_newest_checkpoint_naming_it(trained, tmp_path, which):
    """`best` without a best/ (no validation kept one) is the newest that verifies, like `latest`."""
    run, root = copy_run(trained, tmp_path)
    shutil.rmtree(root / ckpt.BEST)
    newest, older = root / "step_00000004", root / "step_00000002"
    flip_a_weight_bit(newest / "model.safetensors")
    code, log = export(run, tmp_path / "out", tmp_path / "export.txt", "--checkpoint", which)
    assert code == 0, log
    assert f"warning: checkpoint {newest} skipped: {DAMAGE} in the manifest" in log
    assert "left in place" in log and f"exported {older} -> {tmp_path / 'out'}" in log
    assert newest.is_dir() and not list(root.glob("*.corrupt"))  # a read-only command moves nothing
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    step2 = ckpt.load_model_state(older)
    assert torch.equal(exported["fc.weight"], step2["fc.weight"].to(exported["fc.weight"].dtype))


def test_a_run_whose_every_checkpoint_is_damaged_is_refused(trained, tmp_path):
    run, root = copy_run(trained, tmp_path)
    shutil.rmtree(root / ckpt.BEST)
    for step in (2, 4):
        flip_a_weight_bit(root / ckpt.step_dir_name(step) / "model.safetensors")
    code, log = export(run, tmp_path / "out", tmp_path / "export.txt", "--checkpoint", "latest")
    assert code == 2, log
    assert log.count("warning: checkpoint ") == 2
    assert f"export: no valid checkpoint under {run}/checkpoints (2 damaged, named above)" in log
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_a_damaged_best_is_refused_not_replaced_by_another(trained, tmp_path):
    run, root = copy_run(trained, tmp_path)
    flip_a_weight_bit(root / ckpt.BEST / "model.safetensors")
    code, log = export(run, tmp_path / "out", tmp_path / "export.txt")  # --checkpoint best, the default
    assert code == 2, log
    assert f"export: --checkpoint best: the checkpoint {root / ckpt.BEST} is damaged ({DAMAGE}" in log
    assert "it is not loaded: use --checkpoint latest" in log
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_a_damaged_checkpoint_named_explicitly_is_neither_exported_nor_evaluated(trained, tmp_path):
    run, root = copy_run(trained, tmp_path)
    named = root / "step_00000002"
    flip_a_weight_bit(named / "model.safetensors")
    code, log = export(run, tmp_path / "out", tmp_path / "export.txt", "--checkpoint", str(named))
    assert code == 2, log
    assert f"export: --checkpoint '{named}': the checkpoint {named} is damaged ({DAMAGE}" in log
    assert not (tmp_path / "out" / "model.safetensors").exists()
    # evaluate checks the target's folder (config, tokenizer), then verifies the drafter before it loads the target:
    # the refusal comes before any decoding, and nothing is recorded
    args = [
        "evaluate",
        str(run),
        "--target",
        str(cached(log=lambda *a, **k: None)),
        "--data",
        str(tmp_path / "none.jsonl"),
        "--checkpoint",
        str(named),
    ]
    code = run_trainer(args, tmp_path / "evaluate.txt")
    log = (tmp_path / "evaluate.txt").read_text()
    assert code == 2, log
    assert f"evaluate: --checkpoint '{named}': the checkpoint {named} is damaged ({DAMAGE}" in log
    assert not (run / "evaluate.jsonl").exists()


def test_evaluate_loads_the_newest_checkpoint_that_verifies(trained, tmp_path, capsys):
    from eagle3.evaluate import load_drafter

    run, root = copy_run(trained, tmp_path)
    newest = root / "step_00000004"
    flip_a_weight_bit(newest / "model.safetensors")
    model, cfg = load_drafter(run, "latest")
    assert cfg.evaluated_step == 2  # the step its result is recorded at
    step2 = ckpt.load_model_state(root / "step_00000002")
    assert torch.equal(model.fc.weight.detach(), step2["fc.weight"])
    assert f"warning: checkpoint {newest} skipped: {DAMAGE}" in capsys.readouterr().err
    flip_a_weight_bit(root / "step_00000002" / "model.safetensors")
    with pytest.raises(ConfigError, match=r"no valid checkpoint under .* \(2 damaged, named above\)"):
        load_drafter(run, "latest")


def test_init_from_or_evaluate_of_a_damaged_export_is_refused(trained, tmp_path):
    from eagle3.cli import main
    from eagle3.evaluate import load_drafter

    out = tmp_path / "export"
    assert main(["export", str(trained), str(out), *VERIFIER]) == 0
    record = json.loads((out / "config.json").read_text())["eagle3_pve"]["files"]["model.safetensors"]
    assert record == dict(zip(("size", "sha256"), ckpt.file_digest(out / "model.safetensors"), strict=True))
    flip_a_weight_bit(out / "model.safetensors")
    damage = f"the export {out} is damaged (model.safetensors does not match the sha256 config.json records"
    with pytest.raises(ConfigError, match=damage.replace("(", r"\(")):
        load_drafter(out)
    cfg = write_config(
        tmp_path / "train.yaml",
        data_dir=_data_dir(trained),
        run_dir=str(tmp_path / "run2"),
        max_seq_len=512,
        ttt_steps=2,
        max_steps=1,
        warmup_steps=1,
        num_threads=1,
        telemetry_every_s=0,
        tensorboard=False,
        init_from=str(out),
    )
    code = run_trainer(["train", "--config", str(cfg)], tmp_path / "train.txt")
    log = (tmp_path / "train.txt").read_text()
    assert code == 2, log
    assert f"init_from: {damage}" in log
    status = read_status(tmp_path / "run2")
    assert status["error"]["kind"] == "config" and status["step"] == 0
    assert ckpt.list_valid(tmp_path / "run2") == []


def _data_dir(run: Path) -> str:
    return json.loads((ckpt.newest_valid(run) / "config.json").read_text())["data_dir"]
