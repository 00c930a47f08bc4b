"""The pseudo-gradient penalty's settings of :class:`~megatron_edit.config.LocalSGDConfig`
(clipping, norm-weighted averaging, the anomaly detector's EWMA): their checks, a part of
:mod:`megatron_edit.config`, which re-exports it. The fields are declared, with their flags and
documentation, on :class:`~megatron_edit.config.LocalSGDConfig`.
"""

from __future__ import annotations

from .values import FLAG_NAMES, ConfigError, _name, _require


class PenaltySettings:
    """The penalty's checks, mixed into LocalSGDConfig."""

    def _check_penalty(self) -> None:
        """``clip_pseudo_grad``, ``weight_softmax_temperature`` and the EWMA's settings."""
        _require(self.clip_pseudo_grad is None or self.clip_pseudo_grad > 0, "clip_pseudo_grad",
                 f"must be a positive norm or None (got {self.clip_pseudo_grad!r}).")
        _require(self.weight_softmax_temperature is None or self.weight_softmax_temperature > 0,
                 "weight_softmax_temperature", f"must be > 0 or None (got {self.weight_softmax_temperature!r}).")
        _require(0.0 < self.ewma_alpha <= 1.0, "ewma_alpha", f"must be in (0, 1] (got {self.ewma_alpha!r}).")
        _require(self.ewma_warmup_steps >= 0, "ewma_warmup_steps",
                 f"must be an integer >= 0 (got {self.ewma_warmup_steps!r}).")
        _require(self.ewma_threshold > 0, "ewma_threshold", f"must be > 0 (got {self.ewma_threshold!r}).")
        if self.weight_softmax_temperature is not None and not self.pseudo_gradnorm_reduce:
            raise ConfigError(
                f"{_name('weight_softmax_temperature')}: only used with norm-weighted averaging; "
                f"add {FLAG_NAMES['pseudo_gradnorm_reduce']}.")
