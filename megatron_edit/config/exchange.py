"""The exchange's settings of :class:`~megatron_edit.config.LocalSGDConfig` (the format, its block
of scales, error feedback, the sparse top-k exchange): the formats and their checks, a part of
:mod:`megatron_edit.config`, which re-exports it. The fields themselves are declared, with their
flags and documentation, on :class:`~megatron_edit.config.LocalSGDConfig`.
"""

from __future__ import annotations

from ..algorithm.formats import DENSE, TOPK_MAX_CHUNK  # noqa: F401 (TOPK_MAX_CHUNK: re-exported)
from ..algorithm.formats import TOPK_VALUES as TOPK_DTYPES
from .values import FLAG_NAMES, ConfigError, _name, _require

EXCHANGE_DTYPES = DENSE + ("int2",)
"""What ``exchange_dtype`` takes: the dense formats, and int2 for the top-k exchange's values."""


class ExchangeSettings:
    """The exchange's derived values and checks, mixed into LocalSGDConfig."""

    @property
    def error_feedback(self) -> bool:
        """Whether error feedback is on: ``exchange_error_feedback``, or when it is None, whether
        the exchange is top-k (``exchange_topk_density``) or, with ``auto_overlap``, may be
        (a top-k format among ``auto_formats``): one setting for every format of the run."""
        if self.exchange_error_feedback is None:
            return self.may_use("topk")
        return self.exchange_error_feedback

    def _check_exchange(self) -> None:
        """The format (``exchange_dtype``), its block of scales, error feedback, then the top-k
        exchange's settings."""
        _require(self.exchange_dtype in EXCHANGE_DTYPES, "exchange_dtype",
                 f"must be one of {EXCHANGE_DTYPES} (got {self.exchange_dtype!r}).")
        _require(self.exchange_block_size >= 2 and self.exchange_block_size % 2 == 0, "exchange_block_size",
                 f"must be an even integer >= 2 (got {self.exchange_block_size!r}); 256 is the default.")
        if self.exchange_block_size != 256 and self.exchange_topk_density is None and not self.may_use("scaled"):
            raise ConfigError(
                f"{_name('exchange_block_size')}: only used by the scaled formats (fp8, int8, "
                f"int4); {FLAG_NAMES['exchange_dtype']} is {self.exchange_dtype}.")
        if self.exchange_error_feedback and not self.may_use("lossy"):
            raise ConfigError(
                f"{_name('exchange_error_feedback')}: an fp32 exchange drops nothing; add "
                f"{FLAG_NAMES['exchange_dtype']} bf16|fp8|int8|int4 (or "
                f"{FLAG_NAMES['exchange_topk_density']}, or with {FLAG_NAMES['auto_overlap']} such a "
                f"format in {FLAG_NAMES['auto_formats']}) or drop the flag.")
        self._check_topk()

    def _check_topk(self) -> None:
        """The sparse exchange's settings (``exchange_topk_density``, ``exchange_topk_chunk``)."""
        d, chunk, dtype = self.exchange_topk_density, self.exchange_topk_chunk, self.exchange_dtype
        _require(d is None or 0.0 < d <= 1.0, "exchange_topk_density",
                 f"must be in (0, 1] (got {d!r}): the fraction of each chunk's entries sent, e.g. 0.02; "
                 "None: the dense exchange.")
        _require(chunk >= 2, "exchange_topk_chunk", f"must be an integer >= 2 (got {chunk!r}); 4096 is the default.")
        _require(chunk <= TOPK_MAX_CHUNK, "exchange_topk_chunk",
                 f"{chunk} needs {(chunk - 1).bit_length()} index bits; indices take at most 16 bits "
                 f"(chunks of at most {TOPK_MAX_CHUNK} elements): use a smaller chunk, e.g. 4096.")
        if d is None:
            if chunk != 4096 and not self.may_use("topk"):
                raise ConfigError(
                    f"{_name('exchange_topk_chunk')}: only used by the top-k exchange; add "
                    f"{FLAG_NAMES['exchange_topk_density']} (e.g. 0.02) or drop the flag.")
            if dtype == "int2":
                raise ConfigError(
                    f"{_name('exchange_dtype')}: int2 is for the top-k exchange's kept values (a dense "
                    f"tensor in 2 bits loses most of its entries); add {FLAG_NAMES['exchange_topk_density']} "
                    "(e.g. 0.02), or use int4 for a dense exchange.")
            return
        if dtype not in TOPK_DTYPES:
            raise ConfigError(
                f"{_name('exchange_dtype')}: the top-k exchange sends its values in one of {TOPK_DTYPES}, "
                f"not {dtype}; choose one of them, or drop {FLAG_NAMES['exchange_topk_density']}.")
        if self.exchange_block_size != 256 and not self.may_use("scaled"):
            raise ConfigError(
                f"{_name('exchange_block_size')}: the top-k exchange has one scale per chunk "
                f"({FLAG_NAMES['exchange_topk_chunk']}); drop {FLAG_NAMES['exchange_block_size']}.")
