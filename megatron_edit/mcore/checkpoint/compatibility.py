"""Whether a checkpoint fits this run: the refusals of a resume, each one message naming what
differs and what to do (:class:`~megatron_edit.mcore.checkpoint.resume.ResumePlan` asks before
anything large is read). Each function returns the message, or None when the checkpoint fits.
"""

from __future__ import annotations

import re
from typing import Optional, Tuple

from ...config import FLAG_NAMES
from .keys import PREFIX, WORKER_KEY, is_local_sgd_key
from .record import FULLY_RESHARDABLE, OLD_FORMATS, format_message

# A run record's key (sharded objects carry a "/shard_..." suffix), with Megatron's prefix.
_RECORD_KEY = re.compile(r"^(.*?)local_sgd\.record(?:/|$)")


def unrecorded_state(saved: dict) -> Optional[str]:
    """A checkpoint without this optimizer's run record (``saved``: its metadata): EDiT state of
    an older format, of other optimizers, or without its record; None: none at all (a checkpoint
    of synchronous training)."""
    ours = [k for k in saved if is_local_sgd_key(k) and not WORKER_KEY.search(k)]
    if any(".record.dp_group_idx_" in k for k in ours):  # format 1: a record per slice
        return format_message(next(iter(OLD_FORMATS)), "the checkpoint")
    records = sorted({m.group(1) for k in ours for m in [_RECORD_KEY.match(k)] if m})
    if records:  # records under other optimizer prefixes: another ChainedOptimizer
        return (f"megatron_edit: the checkpoint holds EDiT records of other optimizers "
                f"({', '.join(r or '(none)' for r in records)}) than this run's: its model has "
                "another number of distributed optimizers (MoE: expert parallelism 1 keeps "
                "the experts in the dense optimizer, more a second one). EDiT's state cannot "
                "follow an expert-parallel change yet; keep --expert-model-parallel-size.")
    if ours:
        return (f"megatron_edit: the checkpoint has EDiT state but no EDiT record "
                f"({PREFIX}record): it is incomplete or corrupted.")
    return None


def layout_refusal(record: dict, sharding_type: str, parallel: Tuple[int, int],
                   expert: Tuple[int, int]) -> Optional[str]:
    """What Megatron's inner optimizer format (``sharding_type``) and EDiT cannot follow: another
    expert parallelism, another format, another TP / PP (``parallel``) in a bucket-space format."""
    tp, pp = parallel
    saved_ep, ep = tuple(record.get("expert_parallel", (1, 1))), expert
    if saved_ep != ep:
        return (f"megatron_edit: the checkpoint was saved with expert parallelism {saved_ep[0]} "
                f"(expert TP {saved_ep[1]}), this run has {ep[0]} (expert TP {ep[1]}): EDiT's "
                "state cannot follow an expert-parallel change yet; keep "
                "--expert-model-parallel-size and --expert-tensor-parallel-size.")
    if record["sharding_type"] != sharding_type:
        return (f"megatron_edit: the checkpoint's optimizer state is in Megatron's "
                f"{record['sharding_type']!r} format, this run loads {sharding_type!r}: "
                f"load it with metadata {{'distrib_optim_sharding_type': "
                f"{record['sharding_type']!r}}} (Megatron-LM does so by itself).")
    if (record["tensor_parallel"], record["pipeline_parallel"]) != (tp, pp) and \
            record["sharding_type"] not in FULLY_RESHARDABLE:
        return (f"megatron_edit: the checkpoint was saved with TP={record['tensor_parallel']}, "
                f"PP={record['pipeline_parallel']}, this run has TP={tp}, PP={pp}. EDiT's state "
                f"reshards, but Megatron's {record['sharding_type']!r} optimizer format stores "
                f"buckets and cannot follow a TP / PP change: save with 'fully_reshardable' "
                f"(--dist-ckpt-optim-fully-reshardable), or keep TP and PP.")
    return None


def in_flight_refusal(record: dict, flight: dict, config, workers: int, torchft: bool,
                      parallel: Tuple[int, int]) -> Optional[str]:
    """A checkpoint saved while a delayed outer step's exchange was in flight (``flight``): it
    resumes with the same workers, TP and PP, and the rule it was launched with (``config``: this
    run's LocalSGDConfig; ``torchft``: a torchft worker loads it)."""
    tp, pp = parallel
    if record["num_workers"] != workers:
        now = "a torchft worker loads it as 1" if torchft else f"{workers} now"
        return (f"megatron_edit: the checkpoint was saved while the exchange of a delayed outer "
                f"step was in flight (launched after step {flight['apply_at'] - flight['delay']}, "
                f"due after step {flight['apply_at']}); it resumes with the same number of "
                f"workers only ({record['num_workers']} saved, {now}). Resume with {record['num_workers']} workers"
                f"{' of the torch backend' if torchft else ''}, or from a checkpoint saved "
                "outside the exchange's window.")
    if (record["tensor_parallel"], record["pipeline_parallel"]) != (tp, pp):
        return (f"megatron_edit: the checkpoint was saved while the exchange of a delayed outer "
                f"step was in flight (due after step {flight['apply_at']}); it resumes with the "
                f"same tensor / pipeline parallel sizes only (saved TP={record['tensor_parallel']}, "
                f"PP={record['pipeline_parallel']}; now TP={tp}, PP={pp}).")
    if not config.outer_step_delay:
        return (f"megatron_edit: the checkpoint was saved while the exchange of a delayed outer "
                f"step was in flight (due after step {flight['apply_at']}); resume with "
                f"--local-sgd-outer-step-delay {flight['delay']} (this run has no delay).")
    return _in_flight_settings_changed(record, flight, config)


def _in_flight_settings_changed(record: dict, flight: dict, c) -> Optional[str]:
    """A delayed exchange in flight is applied by the rule it was launched with: a resume
    that changes the delay, the merge or the fragments is refused (naming the flag)."""
    saved = record.get("config", {})
    saved_rule = saved.get("outer_merge_rule") or ("keep_local" if flight.get("keep") else "lerp")
    due = f"(due after step {flight['apply_at']})"
    what = ("megatron_edit: the checkpoint was saved while the exchange of a delayed outer step was in "
            f"flight {due}")
    if flight["delay"] != c.outer_step_delay:
        return (f"{what}, launched with {FLAG_NAMES['outer_step_delay']} {flight['delay']}; this run has "
                f"{c.outer_step_delay}. Resume with {FLAG_NAMES['outer_step_delay']} {flight['delay']}, or "
                "from a checkpoint saved outside the exchange's window.")
    if saved_rule != c.merge_rule or (
            saved_rule == "lerp" and saved.get("merge_alpha") not in (None, c.merge_alpha)):
        was = saved_rule if saved_rule != "lerp" or saved.get("merge_alpha") is None else \
            f"lerp, {FLAG_NAMES['outer_merge_alpha']} {saved['merge_alpha']}"
        now = c.merge_rule if c.merge_rule != "lerp" else \
            f"lerp, {FLAG_NAMES['outer_merge_alpha']} {c.merge_alpha}"
        return (f"{what}, to be merged by {FLAG_NAMES['outer_merge_rule']} {was}; this run has {now}. "
                f"Resume with the saved merge, or from a checkpoint saved outside the exchange's window.")
    saved_f = int(saved.get("fragments", 1))
    if saved_f != c.fragments:
        return (f"{what}, for fragment {flight['fragment']} of {FLAG_NAMES['fragments']} {saved_f}; this "
                f"run has {c.fragments}. Resume with {FLAG_NAMES['fragments']} {saved_f}, or from a "
                "checkpoint saved outside the exchange's window.")
    return None

