"""Rotary position embeddings with the verifier's scaling: default, linear, llama3 and YaRN.

A drafter is served beside its verifier and reads the verifier's positions, so it should rotate its queries and keys
the way the verifier does. The scaling is described as Hugging Face configs describe it (``rope_scaling`` in
transformers 4, ``rope_parameters`` in transformers 5): a mapping with ``rope_type`` and that type's parameters.

- ``linear`` (position interpolation, Chen et al. 2023, arXiv:2306.15595): every frequency divided by ``factor``.
- ``llama3`` (Llama 3.1, Meta's reference ``apply_scaling``): wavelengths longer than
  ``original_max_position_embeddings / low_freq_factor`` are divided by ``factor``, those shorter than
  ``original_max_position_embeddings / high_freq_factor`` kept, the band between blended linearly in the
  context-to-wavelength ratio.
- ``yarn`` (Peng et al. 2023, arXiv:2309.00071, section 3): per dimension a blend of the interpolated
  (``/ factor``) and the original frequency, ramping from ``beta_fast`` to ``beta_slow`` rotations over the original
  context, and cos/sin multiplied by ``0.1 ln(factor) + 1`` (the paper's ``sqrt(1/t)``), or by the ratio of the two
  ``mscale`` terms when ``mscale`` and ``mscale_all_dim`` are given (DeepSeek-V2/V3 configs).

Dynamic NTK and LongRoPE depend on the length at run time or on per-dimension tables: they are refused by name.
tests/test_rope.py checks every type against transformers' own ``ROPE_INIT_FUNCTIONS``.
"""

from __future__ import annotations

import math
import typing

from eagle3.errors import ConfigError

if typing.TYPE_CHECKING:
    import torch

# Parameters of each rope_type: (required, optional). rope_theta may sit in the mapping too (transformers 5).
ROPE_PARAMETERS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "default": ((), ()),
    "linear": (("factor",), ()),
    "llama3": (("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"), ()),
    "yarn": (
        ("factor", "original_max_position_embeddings"),
        ("attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate"),
    ),
}
# Keys a Hugging Face rope mapping may hold that do not change the rotation described by the others.
_IGNORED = ("rope_theta",)


def normalize_rope_scaling(scaling: object, where: str = "rope_scaling") -> dict | None:
    """The scaling as one canonical mapping, or None for unscaled rope; ConfigError names what is wrong.

    Accepts transformers 4's ``type`` for ``rope_type``; a ``rope_theta`` inside is left to the caller.

    >>> normalize_rope_scaling(None), normalize_rope_scaling({}), normalize_rope_scaling({"rope_type": "default"})
    (None, None, None)
    >>> normalize_rope_scaling({"type": "linear", "factor": 4})
    {'rope_type': 'linear', 'factor': 4.0}
    >>> normalize_rope_scaling({"rope_type": "dynamic", "factor": 2.0})
    Traceback (most recent call last):
    ...
    eagle3.errors.ConfigError: rope_scaling.rope_type='dynamic' is not supported: use one of default, linear, llama3, yarn (dynamic NTK and LongRoPE change with the length at run time)
    >>> normalize_rope_scaling({"rope_type": "yarn", "factor": 4.0})
    Traceback (most recent call last):
    ...
    eagle3.errors.ConfigError: rope_scaling: rope_type 'yarn' needs original_max_position_embeddings
    """
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise ConfigError(f"{where}={scaling!r} is not a mapping (for example {{rope_type: yarn, factor: 4.0, ...}})")
    values = dict(scaling)
    kind = values.pop("rope_type", None)
    legacy = values.pop("type", None)
    if kind is not None and legacy is not None and kind != legacy:
        raise ConfigError(f"{where}: rope_type={kind!r} and type={legacy!r} disagree")
    kind = kind or legacy or ("default" if not values or set(values) <= set(_IGNORED) else None)
    if kind is None:
        raise ConfigError(f"{where}: no rope_type (one of {', '.join(ROPE_PARAMETERS)})")
    if kind not in ROPE_PARAMETERS:
        raise ConfigError(
            f"{where}.rope_type={kind!r} is not supported: use one of {', '.join(ROPE_PARAMETERS)} "
            "(dynamic NTK and LongRoPE change with the length at run time)"
        )
    for key in _IGNORED:
        values.pop(key, None)
    if values.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(f"{where}: partial_rotary_factor={values['partial_rotary_factor']} is not supported")
    values.pop("partial_rotary_factor", None)
    required, optional = ROPE_PARAMETERS[kind]
    unknown = sorted(set(values) - set(required) - set(optional))
    if unknown:
        raise ConfigError(
            f"{where}: {unknown} not understood for rope_type {kind!r} "
            f"(it takes {', '.join(required + optional) or 'nothing else'})"
        )
    for key in required:
        if values.get(key) is None:
            raise ConfigError(f"{where}: rope_type {kind!r} needs {key}")
    if kind == "default":
        return None
    out: dict = {"rope_type": kind}
    for key in required + optional:
        value = values.get(key)
        if value is None:
            continue
        if key == "truncate":
            if not isinstance(value, bool):
                raise ConfigError(f"{where}.truncate={value!r} must be true or false")
            out[key] = value
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{where}.{key}={value!r} is not a number")
        out[key] = int(value) if key == "original_max_position_embeddings" else float(value)
        if out[key] <= 0:
            raise ConfigError(f"{where}.{key}={value!r} must be positive")
    if kind == "llama3" and out["high_freq_factor"] <= out["low_freq_factor"]:
        raise ConfigError(f"{where}: high_freq_factor must be larger than low_freq_factor")
    return out


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 * mscale * ln(factor) + 1 (1 without scaling): cos and sin carry it, and an
    MLA layer's softmax scale its square when mscale_all_dim is given (eagle3.mla.softmax_scale)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def inv_freq_and_scale(
    head_dim: int, theta: float, scaling: dict | None = None, device=None
) -> tuple[torch.Tensor, float]:
    """The rotary frequencies [head_dim / 2] (fp32) and the factor cos and sin are multiplied by.

    >>> f, s = inv_freq_and_scale(4, 10000.0)
    >>> [round(v, 4) for v in f.tolist()], s
    ([1.0, 0.01], 1.0)
    >>> f, s = inv_freq_and_scale(4, 10000.0, {"rope_type": "linear", "factor": 2.0})
    >>> [round(v, 4) for v in f.tolist()], s
    ([0.5, 0.005], 1.0)
    """
    import torch  # here, not at the top: the controller imports this module (through eagle3.config) without torch

    base = theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    inv_freq = 1.0 / base
    scaling = normalize_rope_scaling(scaling)
    if scaling is None:
        return inv_freq, 1.0
    kind, factor = scaling["rope_type"], scaling["factor"]
    if kind == "linear":
        return inv_freq / factor, 1.0
    if kind == "llama3":
        context = scaling["original_max_position_embeddings"]
        long_wave = context / scaling["low_freq_factor"]  # longer: fully interpolated
        short_wave = context / scaling["high_freq_factor"]  # shorter: kept
        wavelen = 2 * math.pi / inv_freq
        blend = (context / wavelen - scaling["low_freq_factor"]) / (
            scaling["high_freq_factor"] - scaling["low_freq_factor"]
        )
        blended = (1 - blend) * inv_freq / factor + blend * inv_freq
        out = torch.where(wavelen > long_wave, inv_freq / factor, inv_freq)
        middle = (wavelen >= short_wave) & (wavelen <= long_wave)
        return torch.where(middle, blended, out), 1.0
    # yarn: which dimensions turn fewer than beta_slow / more than beta_fast times over the original context.
    context = scaling["original_max_position_embeddings"]
    beta_fast, beta_slow = scaling.get("beta_fast", 32.0), scaling.get("beta_slow", 1.0)

    def dim_of(rotations: float) -> float:  # the dimension whose wavelength fits `rotations` times in context
        return head_dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, device=device, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    # ramp 0: high-frequency dimensions keep their frequency; ramp 1: low-frequency ones are interpolated.
    inv_freq = inv_freq * (1 - ramp) + (inv_freq / factor) * ramp
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all:
            attention = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
        else:
            attention = yarn_mscale(factor)
    return inv_freq, float(attention)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, scaling: dict | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama (NeoX-style, rotate-half) rotary tables in fp32: cos, sin [S, head_dim], scaled as the verifier's.

    >>> import torch
    >>> cos, sin = rope_cos_sin(torch.tensor([0, 1]), 4, 10000.0)
    >>> cos[0].tolist(), [round(v, 4) for v in sin[1].tolist()]
    ([1.0, 1.0, 1.0, 1.0], [0.8415, 0.01, 0.8415, 0.01])
    """
    import torch

    inv_freq, scale = inv_freq_and_scale(head_dim, theta, scaling, device=positions.device)
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [S, hd/2]
    angles = torch.cat([freqs, freqs], dim=-1)  # [S, hd]
    if scale == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * scale, angles.sin() * scale
