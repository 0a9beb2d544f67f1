"""A trained drafter back from its run folder: the checkpoint a user names (best, latest or a path), the run's
config and the data set's frozen target weights. `eagle3 export` and `eagle3 evaluate` start here.

Every checkpoint is verified against its COMPLETE manifest (eagle3.checkpoint.verify: each file's size and sha256)
before it is loaded, as training's resume does, so no export or evaluation is ever made from damaged weights.
These commands only read the run: a damaged checkpoint is named on stderr and left where it is.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from eagle3.errors import ConfigError


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def pick_checkpoint(run_dir: str, which: str, warn: Callable[[str], None] = _stderr) -> Path:
    """The checkpoint to load, verified: `latest` is the newest that verifies (each damaged newer one named through
    `warn`); `best` is checkpoints/best, or the same as `latest` when no validation ran; a directory path is used
    only when it verifies. ConfigError (exit 2) when what was named is damaged or nothing verifies.

    >>> pick_checkpoint("/nonexistent-run", "latest")
    Traceback (most recent call last):
    ...
    eagle3.errors.ConfigError: no valid checkpoint under /nonexistent-run/checkpoints; train first or pass --checkpoint PATH
    """
    from eagle3 import checkpoint as ckpt

    if which not in ("best", "latest"):
        path = Path(which)
        if not (path / ckpt.MARKER).is_file():
            raise ConfigError(f"--checkpoint {which!r} is not a complete checkpoint directory (no {ckpt.MARKER})")
        _refuse_damaged(
            path,
            f"--checkpoint {which!r}",
            "name another checkpoint directory, or use "
            "--checkpoint latest (the newest checkpoint of the run that verifies)",
        )
        return path
    best = ckpt.checkpoints_dir(run_dir) / ckpt.BEST
    if which == "best" and (best / ckpt.MARKER).is_file():
        _refuse_damaged(
            best,
            "--checkpoint best",
            "use --checkpoint latest (the newest step checkpoint that "
            "verifies) or --checkpoint PATH; the run's next better validation writes best again",
        )
        return best
    newest, skipped = ckpt.newest_verified(run_dir, warn)
    if newest is None:
        damaged = f" ({len(skipped)} damaged, named above)" if skipped else ""
        raise ConfigError(
            f"no valid checkpoint under {run_dir}/checkpoints{damaged}; train first or pass --checkpoint PATH"
        )
    return newest


def _refuse_damaged(path: Path, named: str, fix: str) -> None:
    """ConfigError naming `path` and what is wrong with it when it does not verify against its manifest."""
    from eagle3 import checkpoint as ckpt

    reason = ckpt.verify(path)
    if reason is not None:
        raise ConfigError(f"{named}: the checkpoint {path} is damaged ({reason}); it is not loaded: {fix}")


def load_trained(run_dir: str, which: str = "best", warn: Callable[[str], None] = _stderr):
    """Rebuild the drafter of a run (config + dataset's frozen weights) with a verified checkpoint's trained weights
    (pick_checkpoint says which); (model, checkpoint path, run config)."""
    import json

    from eagle3 import checkpoint as ckpt
    from eagle3.config import TrainConfig
    from eagle3.data import DatasetReader
    from eagle3.model import Eagle3Drafter
    from eagle3.spec import drafter_config

    path = pick_checkpoint(run_dir, which, warn)
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
