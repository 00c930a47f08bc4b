"""The reducer's config (:class:`GTAConfig`): the linear (weighted) mean of the pseudo-gradients
or generalized task arithmetic. Part of :mod:`megatron_edit.config`, which re-exports it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..flags import documented, flag
from .values import FLAG_NAMES, ConfigError, _check_types, _name, _require

REDUCERS = ("linear", "gta")
GTA_CONSENSUS = ("sum", "count")
GTA_SPARSIFICATION = ("magnitude", "random", "rescaled_random")


@documented
@dataclass
class GTAConfig:
    """The reducer that turns the workers' pseudo-gradients into one."""

    reducer: str = flag(
        "--local-sgd-reducer", "linear", choices=REDUCERS,
        help="linear: (weighted) mean of the pseudo-gradients; gta: generalized task arithmetic.")
    """``linear``: (weighted) mean. ``gta``: generalized task arithmetic (sparsify, sign
    consensus, mean of the agreeing entries)."""

    consensus_method: Optional[str] = flag("--gta-consensus-method", None, choices=GTA_CONSENSUS,
                                           help="GTA sign consensus (needs --local-sgd-reducer gta).")
    """GTA: ``sum`` (sign of the sum) or ``count`` (sign of the sum of signs); None: no sign
    consensus."""

    sparsification_method: Optional[str] = flag(
        "--gta-sparsification-method", None, choices=GTA_SPARSIFICATION,
        help="GTA sparsification (needs --local-sgd-reducer gta).")
    """GTA: ``magnitude``, ``random`` or ``rescaled_random``; None: no sparsification."""

    normalize: bool = flag(
        "--gta-normalize", True, help="GTA: divide by the weight of the workers that kept each entry.")
    """GTA: divide by the number (weight) of entries kept instead of the number of workers."""

    density: float = flag(
        "--gta-density", 1.0, help="GTA: fraction of entries kept by sparsification, in (0, 1].")
    """GTA: fraction of entries kept by sparsification, in (0, 1]."""

    int8_mask: bool = flag("--gta-int8-mask", False, help="GTA: masks as int8 (less memory, traffic).")
    """GTA: keep masks as int8 instead of the pseudo-gradient's dtype (memory)."""

    def __post_init__(self) -> None:
        _check_types(self)
        _require(isinstance(self.reducer, str) and self.reducer in REDUCERS, "reducer",
                 f"must be 'linear' or 'gta' (got {self.reducer!r}).")
        _require(self.consensus_method in (None,) + GTA_CONSENSUS, "consensus_method",
                 f"must be one of {GTA_CONSENSUS} or None (got {self.consensus_method!r}).")
        _require(self.sparsification_method in (None,) + GTA_SPARSIFICATION, "sparsification_method",
                 f"must be one of {GTA_SPARSIFICATION} or None (got {self.sparsification_method!r}).")
        _require(0.0 < self.density <= 1.0, "density", f"must be in (0, 1] (got {self.density!r}).")
        if self.reducer != "gta":
            for name in ("consensus_method", "sparsification_method"):
                if getattr(self, name) is not None:
                    raise ConfigError(f"{_name(name)}: only used with reducer='gta' (--local-sgd-reducer gta).")
            if self.density != 1.0:
                raise ConfigError(f"{_name('density')}: only used with reducer='gta'.")
            if self.int8_mask:
                raise ConfigError(f"{_name('int8_mask')}: only used with reducer='gta'.")
            if not self.normalize:
                raise ConfigError(f"{_name('normalize')}: only used with reducer='gta' "
                                  "(--no-gta-normalize needs --local-sgd-reducer gta).")
        elif self.density < 1.0 and self.sparsification_method is None:
            raise ConfigError(
                f"{_name('density')}: density < 1 needs a sparsification method "
                f"({FLAG_NAMES['sparsification_method']} magnitude|random|rescaled_random)."
            )


def check_combination(local, gta: GTAConfig) -> None:
    """Options of :class:`~megatron_edit.config.LocalSGDConfig` (``local``) and the reducer's that
    do not work together (ConfigError naming the flags)."""
    if gta.reducer == "gta" and local.exchange_topk_density is not None:
        raise ConfigError(
            f"{FLAG_NAMES['reducer']} gta with {FLAG_NAMES['exchange_topk_density']}: GTA sparsifies and "
            f"merges with sign consensus over a dense fp32 exchange; use one of the two."
        )
    if gta.reducer == "gta" and local.exchange_dtype != "fp32":
        raise ConfigError(
            f"{FLAG_NAMES['reducer']} gta with {FLAG_NAMES['exchange_dtype']} "
            f"{local.exchange_dtype}: GTA's sign consensus and masks need the fp32 exchange; use "
            f"the linear reducer with a quantized exchange, or GTA with fp32."
        )
    if gta.reducer == "gta" and local.auto_overlap and local.allowed_formats != ("fp32",):
        raise ConfigError(
            f"{FLAG_NAMES['reducer']} gta with {FLAG_NAMES['auto_formats']} {local.auto_formats}: GTA's sign "
            "consensus and masks need the fp32 exchange; drop the formats other than fp32."
        )
