"""The samples `eagle3 generate` and `eagle3 evaluate` read: records from a local file, and their tokens with the
loss mask.

Input: JSONL with `messages` ([{role, content}], the OpenAI layout) or `conversations` ([{from, value}], ShareGPT:
human/gpt/system), or `text` (all of it supervised); or a plain-text file, one sample per paragraph (blank-line
separated), all supervised. A conversation is tokenized through the target's chat template, and the loss mask
covers the assistant turns (each turn's tokens found by rendering the conversation up to it and through it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from eagle3.errors import ConfigError, DataError

SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}


@dataclass
class Sample:
    input_ids: list[int]
    loss_mask: list[int]


def read_records(path: Path) -> list[dict]:
    """The samples of a JSONL or plain-text file as records: {"messages": [...]} or {"text": "..."}."""
    if not path.is_file():
        raise DataError(f"generate: {path} does not exist")
    records: list[dict] = []
    if path.suffix in (".jsonl", ".json"):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: not JSON ({e})") from e
            records.append(_record(row, f"{path}:{n}"))
    else:
        records = [{"text": p.strip()} for p in path.read_text().split("\n\n") if p.strip()]
    if not records:
        raise DataError(f"generate: {path} holds no samples")
    return records


def _record(row: object, where: str) -> dict:
    if not isinstance(row, dict):
        raise DataError(f"{where}: a sample must be a JSON object with messages, conversations or text")
    if "messages" in row or "conversations" in row:
        turns = row.get("messages", row.get("conversations"))
        if not isinstance(turns, list) or not turns:
            raise DataError(f"{where}: messages must be a non-empty list of turns")
        messages = []
        for turn in turns:
            if not isinstance(turn, dict):
                raise DataError(f"{where}: a turn must be an object ({turn!r})")
            role = turn.get("role", SHAREGPT_ROLES.get(str(turn.get("from", "")).lower()))
            content = turn.get("content", turn.get("value"))
            if role not in ("system", "user", "assistant") or not isinstance(content, str):
                raise DataError(
                    f"{where}: turn {turn!r} needs role system/user/assistant (or from human/gpt/system) and "
                    "a string content (or value)"
                )
            messages.append({"role": role, "content": content})
        return {"messages": messages}
    if isinstance(row.get("text"), str):
        return {"text": row["text"]}
    raise DataError(f"{where}: no messages, conversations or text in {sorted(row)}")


def tokenize(record: dict, tokenizer, max_len: int, where: str = "") -> Sample:
    """Tokens and loss mask of one record: a conversation through the chat template, the assistant turns
    supervised; plain text all supervised. Truncated to `max_len` tokens."""
    if "text" in record:
        ids = tokenizer(record["text"], add_special_tokens=True)["input_ids"][:max_len]
        return Sample(ids, [1] * len(ids))
    messages = record["messages"]
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            "generate: the target's tokenizer has no chat template, and the data are conversations; "
            "give text samples instead, or a target with a chat template"
        )

    def render(turns, prompt: bool) -> list[int]:
        out = tokenizer.apply_chat_template(turns, tokenize=True, add_generation_prompt=prompt, return_dict=True)
        return list(out["input_ids"])

    ids = render(messages, False)
    mask = [0] * len(ids)
    for i, turn in enumerate(messages):
        if turn["role"] != "assistant":
            continue
        before = render(messages[:i], True)
        through = render(messages[: i + 1], False)
        if ids[: len(through)] != through or through[: len(before)] != before:
            raise DataError(
                f"generate: {where}: the chat template does not render a conversation as the concatenation of "
                "its turns, so the assistant tokens cannot be found; give text samples instead"
            )
        for j in range(len(before), len(through)):
            mask[j] = 1
    return Sample(ids[:max_len], mask[:max_len])


def build_plan(records: list[dict], tokenizer, max_len: int) -> list[Sample]:
    samples = []
    for n, record in enumerate(records):
        sample = tokenize(record, tokenizer, max_len, f"sample {n}")
        if sum(sample.loss_mask) and len(sample.input_ids) >= 2:
            samples.append(sample)
    if not samples:
        raise DataError("generate: no sample has a supervised token (an assistant turn, or text)")
    return samples
