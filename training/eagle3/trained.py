"""A trained drafter back from its run folder: the checkpoint a user names (best, latest or a path), the run's
config and the data set's frozen target weights. `eagle3 export` and `eagle3 evaluate` start here."""

from __future__ import annotations

from pathlib import Path

from eagle3.errors import ConfigError


def pick_checkpoint(run_dir: str, which: str) -> Path:
    """`best` (falls back to the newest valid one when no validation ran), `latest`, or a directory path."""
    from eagle3 import checkpoint as ckpt

    if which not in ("best", "latest"):
        path = Path(which)
        if not (path / ckpt.MARKER).is_file():
            raise ConfigError(
                f"--checkpoint {which!r} is not a complete checkpoint directory (no {ckpt.MARKER})"
            )
        return path
    best = ckpt.checkpoints_dir(run_dir) / ckpt.BEST
    if which == "best" and (best / ckpt.MARKER).is_file():
        return best
    newest = ckpt.newest_valid(run_dir)
    if newest is None:
        raise ConfigError(
            f"no valid checkpoint under {run_dir}/checkpoints; train first or pass --checkpoint PATH"
        )
    return newest


def load_trained(run_dir: str, which: str = "best"):
    """Rebuild the drafter of a run (config + dataset's frozen weights) with a checkpoint's trained weights."""
    import json

    from eagle3 import checkpoint as ckpt
    from eagle3.config import TrainConfig
    from eagle3.data import DatasetReader
    from eagle3.model import Eagle3Drafter
    from eagle3.spec import drafter_config

    path = pick_checkpoint(run_dir, which)
    cfg = TrainConfig(**json.loads((path / "config.json").read_text()))
    reader = DatasetReader(cfg.data_dir)
    dcfg = drafter_config(cfg, reader.index)
    model = Eagle3Drafter(dcfg)
    t2d, d2t = reader.vocab()
    target = reader.target_weights()
    model.load_target_weights(target["embed"], target["final_norm"], target["lm_head"], t2d, d2t)
    model.load_state_dict(ckpt.load_model_state(path), strict=False)
    model.eval()
    return model, path, cfg
