"""Where a Hugging Face decoder keeps its layers and final norm, and forward pre-hooks that keep what enters them:
the hidden states EAGLE-3 reads (eagle3.generate writes them, eagle3.evaluate decodes with them)."""

from __future__ import annotations

from eagle3.errors import ConfigError


class HiddenStates:
    """Forward pre-hooks that keep the inputs of the aux layers and of the final norm during one forward."""

    def __init__(self, model, aux_layers: tuple[int, int, int]):
        self.kept: dict[str, object] = {}
        layers, norm = decoder_layers(model), final_norm(model)
        self.handles = [
            layers[i].register_forward_pre_hook(self._keep(f"aux{n}"), with_kwargs=True)
            for n, i in enumerate(aux_layers)
        ]
        self.handles.append(norm.register_forward_pre_hook(self._keep("last"), with_kwargs=True))

    def _keep(self, name: str):
        def hook(_module, args, kwargs):
            self.kept[name] = args[0] if args else kwargs["hidden_states"]

        return hook

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def decoder_layers(model):
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ConfigError(f"generate: {type(model).__name__} has no model.layers (a decoder-only causal LM is needed)")
    return layers


def final_norm(model):
    norm = getattr(getattr(model, "model", None), "norm", None)
    if norm is None:
        raise ConfigError(f"generate: {type(model).__name__} has no model.norm (the final norm)")
    return norm
