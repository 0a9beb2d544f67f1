"""A target folder's tokenizer, read from the folder only (never the hub), with an error that names the folder."""

from __future__ import annotations

import os
from pathlib import Path

from eagle3.errors import ConfigError

# The files a Hugging Face tokenizer is read from (fast, sentencepiece, BPE vocab and merges, tiktoken).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt")


def load_tokenizer(target: str | os.PathLike, command: str):
    """The target folder's tokenizer. A folder without one (a model copied without its tokenizer files) or with one
    that does not load is a ConfigError in one line naming the folder and what is missing, not transformers'
    ValueError or OSError, which name neither."""
    from transformers import AutoTokenizer

    folder = Path(target)
    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, TypeError, KeyError) as e:
        names = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
        present = [n for n in names if n in TOKENIZER_FILES or n.endswith((".tiktoken", ".model"))]
        if not present:
            raise ConfigError(
                f"{command}: {folder} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}): copy the "
                "target's tokenizer files into it"
            ) from e
        reason = " ".join(str(e).split())[:300]
        raise ConfigError(
            f"{command}: the tokenizer in {folder} ({', '.join(present)}) does not load: {type(e).__name__}"
            + (f": {reason}" if reason else "")
        ) from e
