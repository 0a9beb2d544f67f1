"""`eagle3 generate --engine vllm`: the hidden states taken from vLLM instead of transformers, for targets that
need a serving engine (tensor parallel across GPUs, vLLM's kernels and quantized weights) to run at all.

vLLM's `extract_hidden_states` speculative method runs the target over each sample (one output token, not kept)
and keeps the hidden states of the layers it is asked for in a cache-only attention layer; a KV connector writes
each request's states to a safetensors file when the request ends, under a file lock the reader waits on. vLLM
numbers the hidden state entering layer i as i and the output of the last of n layers as n, so asking for the aux
layers and n gives exactly what the transformers path's hooks keep (generate.HiddenStates): the aux layers'
inputs and the last hidden state before the final norm.

The connector shipped with vLLM (ExampleHiddenStatesConnector) copies the states into pinned host memory on a CUDA
stream, which vLLM's CPU build cannot do (`pin_memory` needs an accelerator). HiddenStatesConnector is that
connector with a plain copy and write when the cache is in host memory; on a GPU it is vLLM's own path unchanged.

Everything else is generate's: the tokens and loss masks (the project's tokenizer and chat template), the shards,
their order and resuming, the draft vocabulary and index.json. The target's embedding, final norm and head are
read from its safetensors files (the names found on a model built on the meta device), never loaded whole.
vLLM is imported only by this module and eagle3/engine_vllm.py, and only with `--engine vllm`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector,
    extract_from_kv_cache,
)

from eagle3.errors import DataError

# Each request's states wait here (inside the dataset folder) until its shard is written; removed after each shard.
SPOOL = ".vllm-hidden-states"


class _Written:
    """A finished host-side copy, answering get_finished's poll like a completed CUDA event."""

    @staticmethod
    def query() -> bool:
        return True


class HiddenStatesConnector(ExampleHiddenStatesConnector):
    """vLLM's hidden-states connector, with a synchronous copy and write when the cache is in host memory."""

    def _submit_async_write(self, pending) -> None:
        if self._kv_cache is None or self._kv_cache.is_cuda:
            super()._submit_async_write(pending)
            return
        if not self._is_tp_rank_zero:
            return
        from safetensors.torch import save_file

        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (blocks[:, None] * self._block_size + torch.arange(self._block_size)).flatten()
        states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).clone()
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        try:
            os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
            save_file({"hidden_states": states, "token_ids": pending.token_ids.clone()}, pending.filename)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)  # releases the reader waiting on the lock
        self._req_copy_events[pending.req_id] = _Written()


def engine_arguments(target: Path, layers, num_layers: int, longest: int, spool: Path, extra: dict | None) -> dict:
    """LLM(...) keyword arguments for extraction; `extra` (--vllm-args) adds or overrides any of them.

    >>> args = engine_arguments(Path("/t"), (2, 4, 5), 8, 300, Path("/d/.s"), {"tensor_parallel_size": 2})
    >>> args["speculative_config"]["draft_model_config"]
    {'hf_config': {'eagle_aux_hidden_state_layer_ids': [2, 4, 5, 8]}}
    >>> args["max_model_len"], args["tensor_parallel_size"], args["kv_transfer_config"]["kv_connector"]
    (301, 2, 'HiddenStatesConnector')
    """
    args = {
        "model": str(target),
        "skip_tokenizer_init": True,
        "enforce_eager": True,  # one forward per sample: a CUDA graph would buy nothing
        "enable_prefix_caching": False,
        "max_model_len": longest + 1,  # the sample and the one token vLLM must generate
        "seed": 0,
        "speculative_config": {
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [*layers, num_layers]}},
        },
        "kv_transfer_config": {
            "kv_connector": HiddenStatesConnector.__name__,
            "kv_connector_module_path": __name__,
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": str(spool)},
        },
    }
    args.update(extra or {})
    return args


class HiddenStatesSource:
    """The engine, started once for the shards a run still needs; states(samples) -> [(aux, last)] per sample,
    aux the three aux layers' inputs side by side [T, 3H], last the last hidden state [T, H]."""

    def __init__(self, target: Path, layers, num_layers: int, longest: int, out: Path, extra: dict | None, log):
        from vllm.platforms import current_platform

        from eagle3.engine_vllm import VllmEngine

        self.spool = out / SPOOL
        shutil.rmtree(self.spool, ignore_errors=True)  # states of a killed run: their requests are gone
        args = engine_arguments(target, layers, num_layers, longest, self.spool, extra)
        if current_platform.is_cpu():
            args.setdefault("dtype", "float32")  # as the transformers path on CPU
        self.engine = VllmEngine.from_arguments(args)
        log(
            f"generate: vLLM engine up in {self.engine.start_seconds:.0f} s (hidden states of layers "
            f"{[*layers, num_layers]})",
            flush=True,
        )

    def states(self, samples: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        from vllm import SamplingParams
        from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import load_hidden_states
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        outputs = self.engine.llm.generate(
            [TokensPrompt(prompt_token_ids=ids) for ids in samples], params, use_tqdm=False
        )
        result = []
        for ids, output in zip(samples, outputs, strict=True):
            path = (output.kv_transfer_params or {}).get("hidden_states_path")
            if path is None:
                raise DataError("generate: vLLM returned no hidden states (is the extract_hidden_states method on?)")
            data = load_hidden_states(path)  # waits for the writer's lock
            Path(path).unlink()
            Path(path + ".lock").unlink(missing_ok=True)
            if data["token_ids"].tolist() != list(ids):
                raise DataError(f"generate: vLLM's hidden states in {path} are of other tokens than the sample's")
            hidden = data["hidden_states"]  # [T, 4, H]: the three aux layers, then the last layer's output
            result.append((hidden[:, :3].reshape(hidden.shape[0], -1), hidden[:, 3]))
        return result

    def close(self) -> None:
        self.engine.close()
        shutil.rmtree(self.spool, ignore_errors=True)


def target_weights(target: Path, config) -> dict[str, torch.Tensor]:
    """The target's input embedding, final norm and output head, read from its safetensors files by name. The
    names are those of the model's own parameters (built on the meta device, nothing allocated); a tied head is
    the embedding."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from eagle3.target_hooks import final_norm

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    wanted = {
        "embed": model.get_input_embeddings().weight,
        "final_norm": final_norm(model).weight,
        "lm_head": model.get_output_embeddings().weight,
    }
    index = target / "model.safetensors.index.json"
    files = json.loads(index.read_text())["weight_map"] if index.is_file() else None
    single = target / "model.safetensors"
    result = {}
    for key, param in wanted.items():
        for name in names.get(id(param), []):
            file = single if files is None else target / files[name] if name in files else None
            if file is None or not file.is_file():
                continue
            with safe_open(str(file), framework="pt") as f:
                if name in f.keys():  # noqa: SIM118 (safe_open is no mapping)
                    result[key] = f.get_tensor(name)
                    break
        if key not in result:
            raise DataError(
                f"generate: the target's {key} ({', '.join(names.get(id(param), ['?']))}) is not in its safetensors "
                f"files in {target}"
            )
    return result
