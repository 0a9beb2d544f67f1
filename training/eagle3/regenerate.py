"""`eagle3 generate --regenerate`: every assistant turn replaced by the target's own response first, so the drafter
learns what the target will say (the distribution it will serve). Resumable: OUT/regenerated.jsonl keeps each
record as it is done."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

REGENERATED_FILE = "regenerated.jsonl"


def regenerate(
    records: list[dict], model, tokenizer, out: Path, *, temperature: float, seed: int, max_new: int, log=print
) -> list[dict]:
    """The records with every assistant turn replaced by the target's own response to the turns before it (greedy
    at temperature 0, else sampled with seed + sample number), so the drafter learns what the target will say.

    Written as it goes to OUT/regenerated.jsonl, one line per record, flushed and synced: a restart reads the
    complete lines back and regenerates from the first missing one (a torn last line is dropped)."""
    import torch

    path = out / REGENERATED_FILE
    done: list[dict] = []
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                done.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a line cut by a kill: regenerated again
        done = done[: len(records)]
        with path.open("w") as f:  # rewrite without the torn tail
            f.writelines(json.dumps(r) + "\n" for r in done)
    if done:
        log(f"generate: regenerate: resuming after {len(done)} of {len(records)} records", flush=True)
    device = next(model.parameters()).device
    started = time.monotonic()
    with path.open("a") as f:
        for n in range(len(done), len(records)):
            record = records[n]
            if "messages" in record:
                turns = [dict(t) for t in record["messages"]]
                for i, turn in enumerate(turns):
                    if turn["role"] != "assistant":
                        continue
                    prompt = tokenizer.apply_chat_template(turns[:i], add_generation_prompt=True, return_dict=True)
                    ids = torch.tensor([list(prompt["input_ids"])], device=device)
                    torch.manual_seed(seed + n)
                    with torch.inference_mode():
                        new = model.generate(
                            input_ids=ids,
                            attention_mask=torch.ones_like(ids),
                            max_new_tokens=max_new,
                            do_sample=temperature > 0,
                            temperature=temperature if temperature > 0 else None,
                            top_p=None,
                            top_k=None,
                            eos_token_id=tokenizer.eos_token_id,
                            pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
                        )[0, ids.shape[1] :]
                    turn["content"] = tokenizer.decode(new, skip_special_tokens=True)
                record = {"messages": turns}
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())
            done.append(record)
            if (n + 1) % 16 == 0 or n + 1 == len(records):
                log(
                    f"generate: regenerated {n + 1}/{len(records)} records ({time.monotonic() - started:.0f} s)",
                    flush=True,
                )
    return done
