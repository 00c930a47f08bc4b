"""The overlap's settings of :class:`~megatron_edit.config.LocalSGDConfig`: the delayed outer step
and its merge, streaming fragments, and what the automatic overlap may choose among, with their
checks; a part of :mod:`megatron_edit.config`, which re-exports it. The fields are declared on
:class:`~megatron_edit.config.LocalSGDConfig`.

One rule is used across the package: a delay must be below H/F
(:func:`megatron_edit.algorithm.schedule.delay_limit`, re-exported here), so that an exchange is
applied before the next one (of the next fragment) is launched. A-EDiT (time-based syncs) plans
its intervals instead: every one but the last at least tau + 1 steps long for each worker
(:func:`megatron_edit.algorithm.asynchronous.min_interval`; its first interval, H or H/F with
fragments, is before any exchange is in flight).
"""

from __future__ import annotations

from ..algorithm.formats import DENSE, format_name, precision_order, topk_format
from ..algorithm.schedule import delay_limit  # noqa: F401 (re-exported)
from .values import FLAG_NAMES, ConfigError, _name, _require


def _known(name: str) -> bool:
    """Whether ``name`` is an exchange format (dense, or ``topk<density>-<values>``)."""
    try:
        topk_format(name)
    except ValueError:
        return False
    return True


class OverlapSettings:
    """The overlap's derived values and checks, mixed into LocalSGDConfig."""

    @property
    def start_format(self) -> str:
        """The format the run starts in (:func:`~megatron_edit.algorithm.formats.format_name`):
        ``exchange_dtype``, or ``topk<density>-<dtype>`` with ``exchange_topk_density``."""
        return format_name(self.exchange_dtype, self.exchange_topk_density)

    @property
    def allowed_formats(self) -> tuple:
        """The exchange formats ``auto_overlap`` may choose (``auto_formats``, else the format
        the run starts in alone), most precise first
        (:func:`~megatron_edit.algorithm.formats.precision_order`: the dense formats, then the
        top-k ones by the bits they send per element)."""
        if self.auto_formats is None:
            return (self.start_format,)
        return tuple(precision_order([n for n in self._auto_format_names() if _known(n)], self.exchange_topk_chunk))

    def _auto_format_names(self) -> list:
        return [n.strip() for n in str(self.auto_formats).split(",")]

    def may_use(self, kind: str) -> bool:
        """Whether a format of ``kind`` may be in force in this run (the one in force, or with
        ``auto_overlap`` one it may choose): ``topk`` (the top-k exchange), ``scaled`` (a dense
        format with a scale per block: fp8, int8, int4) or ``lossy`` (any but fp32)."""
        formats = self.allowed_formats if self.auto_overlap else (self.start_format,)
        test = {"topk": lambda f: topk_format(f) is not None, "scaled": lambda f: f in ("fp8", "int8", "int4"),
                "lossy": lambda f: f != "fp32"}[kind]
        return any(test(f) for f in formats if _known(f))

    @property
    def allowed_fragments(self) -> tuple:
        """The numbers of fragments ``auto_overlap`` may choose (``auto_fragments``, else
        ``fragments`` alone), fewest first."""
        if self.auto_fragments is None:
            return (self.fragments,)
        return tuple(sorted(int(n) for n in self._auto_fragment_names()))

    @property
    def async_sync_time(self) -> float:
        """A-EDiT: seconds between two syncs, ``local_sgd_sync_time / fragments``: each sync
        exchanges one fragment, so each fragment is synced every ``local_sgd_sync_time`` (as
        Streaming DiLoCo syncs each fragment every H steps and one every H/F)."""
        return self.local_sgd_sync_time / self.fragments

    @property
    def async_first_interval(self) -> int:
        """A-EDiT: the first interval after warmup (no speed measured yet), H/F steps."""
        return self.local_sgd_sync_interval // self.fragments

    def _auto_fragment_names(self) -> list:
        return [n.strip() for n in str(self.auto_fragments).split(",")]

    def _check_auto(self) -> None:
        """``auto_overlap`` and its settings (``auto_formats``, ``auto_fragments``, ``auto_every``)."""
        _require(self.auto_every >= 1, "auto_every", f"must be an integer >= 1 (got {self.auto_every!r}).")
        if self.auto_formats is not None:
            names = self._auto_format_names()
            bad = [n for n in names if not _known(n)]
            _require(not bad and len(set(names)) == len(names), "auto_formats",
                     f"must be a comma-separated list of distinct formats of {', '.join(DENSE)} or "
                     f"topk<density>-<values> (values fp32, int8, int4 or int2, e.g. topk0.02-int2) "
                     f"(got {self.auto_formats!r}).")
        if self.auto_fragments is not None:
            names, h = self._auto_fragment_names(), self.local_sgd_sync_interval
            numbers = [int(n) for n in names if n.isdigit() and int(n) >= 1]
            _require(len(numbers) == len(names) == len(set(numbers)), "auto_fragments",
                     f"must be a comma-separated list of distinct integers >= 1 (got {self.auto_fragments!r}).")
            bad = [int(n) for n in names if h % int(n) or delay_limit(h, int(n)) < 2]
            _require(not bad, "auto_fragments",
                     f"{bad[0] if bad else ''} must divide {FLAG_NAMES['local_sgd_sync_interval']} {h} and leave "
                     "H/F >= 2 (room for a delay tau < H/F); give divisors of H up to H/2.")
        if not self.auto_overlap:
            given = [f for f, default in (("auto_formats", None), ("auto_fragments", None), ("auto_every", 20))
                     if getattr(self, f) != default]
            if given:
                raise ConfigError(f"{_name(given[0])}: only used by {FLAG_NAMES['auto_overlap']}; add it "
                                  "or drop the flag.")
            return
        if self.start_format not in self.allowed_formats:
            flags = f"{FLAG_NAMES['exchange_dtype']} {self.exchange_dtype}" + (
                "" if self.exchange_topk_density is None
                else f" {FLAG_NAMES['exchange_topk_density']} {self.exchange_topk_density:g}")
            raise ConfigError(
                f"{_name('auto_formats')}: the run starts in {flags} ({self.start_format}), which is not "
                f"among {self.auto_formats}; add it, or start in one of them.")
        if self.fragments not in self.allowed_fragments:
            raise ConfigError(
                f"{_name('auto_fragments')}: the run starts with {FLAG_NAMES['fragments']} {self.fragments}, "
                f"which is not among {self.auto_fragments}; add it, or start with one of them.")
        if delay_limit(self.local_sgd_sync_interval, self.fragments) < 2 and not self.use_async:  # (A-EDiT: planned)
            raise ConfigError(
                f"{_name('auto_overlap')}: {FLAG_NAMES['local_sgd_sync_interval']} "
                f"{self.local_sgd_sync_interval} / {FLAG_NAMES['fragments']} {self.fragments} leaves no room "
                "for a delay (tau < H/F); drop the flag or sync less often.")

    @property
    def merge_alpha(self) -> float:
        """The lerp merge's alpha in effect: ``outer_merge_alpha``, or 0.5 when it is None."""
        return 0.5 if self.outer_merge_alpha is None else float(self.outer_merge_alpha)

    @property
    def merge_rule(self) -> str:
        """The merge rule in effect: ``outer_merge_rule``, or ``lerp`` when it is None."""
        return self.outer_merge_rule or "lerp"

    @property
    def merge_keeps_local(self) -> bool:
        """Whether the merge of a delayed outer step keeps part of each worker's own progress
        (``keep_local``, or ``lerp`` with alpha > 0): the replicas then differ right after a
        delayed sync, by design (the one rule for it)."""
        return self.merge_rule == "keep_local" or self.merge_alpha > 0

    @property
    def keeps_launch_params(self) -> bool:
        """Whether a delayed exchange keeps each worker's parameters at its launch until the apply
        (the ``keep_local`` merge adds the progress made since)."""
        return bool(self.outer_step_delay) and self.merge_rule == "keep_local"

    def _check_delay(self) -> None:
        """The delayed outer step's and the fragments' settings (``outer_step_delay``,
        ``outer_merge_alpha``, ``fragments``)."""
        tau, alpha = self.outer_step_delay, self.outer_merge_alpha
        _require(tau >= 0, "outer_step_delay", f"must be an integer >= 0 (got {tau!r}); 0: no delay.")
        _require(alpha is None or 0.0 <= alpha <= 1.0, "outer_merge_alpha", f"must be in [0, 1] (got {alpha!r}).")
        rule = self.outer_merge_rule
        _require(rule in (None, "lerp", "keep_local"), "outer_merge_rule",
                 f"must be 'lerp', 'keep_local' or None (got {rule!r}).")
        if rule is not None and tau == 0 and not self.auto_overlap:
            raise ConfigError(
                f"{_name('outer_merge_rule')}: the merge only follows a delayed outer step; add "
                f"{FLAG_NAMES['outer_step_delay']} (a number of steps >= 1) or drop the flag.")
        if rule == "keep_local" and alpha not in (None, 0.0):
            raise ConfigError(
                f"{_name('outer_merge_alpha')}: alpha is the lerp rule's; keep_local keeps the local "
                f"steps whole. Drop one of {FLAG_NAMES['outer_merge_alpha']} and "
                f"{FLAG_NAMES['outer_merge_rule']} keep_local.")
        if alpha is not None and tau == 0 and not self.auto_overlap:
            raise ConfigError(
                f"{_name('outer_merge_alpha')}: the merge only follows a delayed outer step; add "
                f"{FLAG_NAMES['outer_step_delay']} (a number of steps >= 1) or drop the flag.")
        # A-EDiT plans its intervals (H is its first, before any exchange is in flight), each but the
        # last at least tau + 1 steps: nothing to refuse here.
        if tau >= delay_limit(self.local_sgd_sync_interval) and not self.use_async:
            raise ConfigError(
                f"{_name('outer_step_delay')}: {tau} must be < {FLAG_NAMES['local_sgd_sync_interval']} "
                f"({self.local_sgd_sync_interval}): an exchange must be applied before the next one is "
                "launched (one in flight at a time).")
        f, h = self.fragments, self.local_sgd_sync_interval
        _require(f >= 1, "fragments", f"must be an integer >= 1 (got {f!r}); 1: no fragments.")
        if h % f:
            raise ConfigError(
                f"{_name('fragments')}: {f} must divide {FLAG_NAMES['local_sgd_sync_interval']} ({h}): "
                "one fragment is synchronised every H/F steps.")
        if f > 1 and tau >= delay_limit(h, f) and not self.use_async:  # (A-EDiT: planned, tau + 1 each)
            raise ConfigError(
                f"{_name('outer_step_delay')}: {tau} must be < H/F = {delay_limit(h, f)} with {f} fragments "
                f"({FLAG_NAMES['local_sgd_sync_interval']} {h}): a fragment's exchange must be applied "
                "before the next fragment's is launched (one in flight at a time).")
