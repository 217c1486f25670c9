"""Quantizers by name: the built-in names, their grammar, and custom quantizers made nameable.

The metadata records a cache's quantizer by name, so every quantizer a cache can hold has one:
``none``, ``int8``, ``fp8``, ``int4``, ``int4-g<N>`` (one scale per N values), ``-asym`` after an
int4 name (a zero point per group), ``-rot`` after any of int8 / fp8 / int4 names (the fixed
rotation), ``int4-ch`` (a scale per channel per page), ``int4-ol`` / ``int4-ol<K>`` (each token's 4 / K
largest values at 8 bits), and the names ``register_quantizer`` added.
"""

from __future__ import annotations

import re

from easykv.quantization._builtin import Fp8Quantizer, Int4Quantizer, Int8Quantizer
from easykv.quantization._channel import Int4ChannelQuantizer
from easykv.quantization._outlier import Int4OutlierQuantizer
from easykv.quantization._pages import NoQuantizer, Quantizer
from easykv.validation import show

_REGISTRY: dict[str, Quantizer] = {q.name: q for q in (NoQuantizer(), Int4ChannelQuantizer())}
_BYTE = re.compile(r"(int8|fp8)(-rot)?")
_INT4 = re.compile(r"int4(?:-g([0-9]+))?(-asym)?(-rot)?")
_OUTLIER = re.compile(r"int4-ol([0-9]+)?")
_BUILT_IN = ("none", "int8", "int8-rot", "fp8", "fp8-rot", "int4", "int4-rot", "int4-asym", "int4-asym-rot",
             "int4-g<N>", "int4-g<N>-rot", "int4-g<N>-asym", "int4-g<N>-asym-rot", "int4-ch",
             "int4-ol", "int4-ol<K>")


def available_quantizers() -> tuple[str, ...]:
    """Every name ``get_quantizer`` (and so ``create`` / ``init_cache``) accepts: the built-in
    ones (``<N>``: any even group size dividing head_dim; ``<K>``: an even number of outliers, at
    most head_dim / 2) and the registered ones."""
    return _BUILT_IN + tuple(sorted(set(_REGISTRY) - set(_BUILT_IN)))


def register_quantizer(quantizer: Quantizer) -> None:
    """Make a custom quantizer nameable (metadata records quantizers by name).

    Args:
      quantizer: an object of the `Quantizer` protocol (``name``, ``bytes_per_token_head``,
        ``validate``); registering it again is a no-op.

    Raises:
      ValueError: ``quantizer`` is no `Quantizer`, its name is not a lower-case string, or the
        name already names a different one.
    """
    if not isinstance(quantizer, Quantizer):
        raise ValueError(f"{show(quantizer)} does not implement the Quantizer protocol "
                         "(name, bytes_per_token_head, validate)")
    name = quantizer.name
    if not isinstance(name, str) or not name or name != name.lower() or name.strip() != name:
        # get_quantizer looks names up in lower case: a name with capitals could be registered
        # and listed but never found again
        fix = name.strip().lower() if isinstance(name, str) and name.strip() else "my-quant"
        raise ValueError(f"a quantizer's name must be a non-empty lower-case string without surrounding spaces "
                         f"(names are looked up in lower case); got {show(name)}: name it {fix!r}")
    known = get_quantizer_or_none(name)
    if known is not None and known != quantizer:
        raise ValueError(f"a different quantizer is already registered as {show(quantizer.name)}: {show(known)}")
    _REGISTRY[quantizer.name] = quantizer


def _built_in(key: str) -> Quantizer | None:
    byte = _BYTE.fullmatch(key)
    if byte:
        cls = Int8Quantizer if byte.group(1) == "int8" else Fp8Quantizer
        return cls(rotate=byte.group(2) is not None)
    int4 = _INT4.fullmatch(key)
    if int4:
        group = None if int4.group(1) is None else int(int4.group(1))
        return Int4Quantizer(group_size=group, asymmetric=int4.group(2) is not None, rotate=int4.group(3) is not None)
    outlier = _OUTLIER.fullmatch(key)
    if outlier:
        return Int4OutlierQuantizer(4 if outlier.group(1) is None else int(outlier.group(1)))
    return None


def get_quantizer(quantizer: str | Quantizer | None) -> Quantizer:
    """Resolve ``None``, a name (see ``available_quantizers``) or a quantizer object to a
    quantizer object.

    Args:
      quantizer: None (``"none"``: pages hold the cache dtype), a name (looked up in lower
        case), or a quantizer object registered under its name.

    Raises:
      ValueError: an unknown name, an unregistered object, or anything else.
    """
    if quantizer is None:
        return _REGISTRY["none"]
    if isinstance(quantizer, str):
        key = quantizer.lower()
        found = _REGISTRY.get(key) or _built_in(key)
        if found is None:
            raise ValueError(f"unknown quantizer {show(quantizer)}; available: {', '.join(available_quantizers())}")
        return found
    if isinstance(quantizer, Quantizer):
        if get_quantizer_or_none(quantizer.name) != quantizer:
            raise ValueError(
                f"quantizer {show(quantizer)} is not registered under its name {show(quantizer.name)}; the "
                "metadata records quantizers by name, so call easykv.register_quantizer(q) first"
            )
        return quantizer
    raise ValueError(
        f"quantizer must be None, a name ({', '.join(available_quantizers())}) or a Quantizer "
        f"object, got {type(quantizer).__name__}: {show(quantizer)}"
    )


def get_quantizer_or_none(name: str) -> Quantizer | None:
    try:
        return get_quantizer(name)
    except ValueError:
        return None
