"""The step-time model and the choice of delay, fragments and format (algorithm/overlap_plan.py)."""

import math

import pytest

from megatron_edit.algorithm.overlap_plan import (
    Choice,
    Measurement,
    agreed,
    bound_fraction,
    choose,
    exposure_grew,
    scale_to_formats,
    exposed_seconds,
    format_seconds,
    plan,
    predict_formats,
    smallest_interval,
)


def test_exchange_seconds_are_the_wire_bytes_over_the_link_and_the_latency_per_message():
    # 2 workers: each sends its whole fp32 payload once; 4 workers: 2 * 3/4 of it
    assert format_seconds(250_000, 2, 8e6, ["fp32"])["fp32"] == pytest.approx(1.0)
    assert format_seconds(250_000, 4, 8e6, ["fp32"])["fp32"] == pytest.approx(1.5)
    # latency: 10 buckets, each a ring all-reduce of 2 (W - 1) = 6 messages in a row; the top-k
    # all-gather W - 1 = 3, the quantized exchange's all-to-all + all-gather W = 4
    with_latency = format_seconds(250_000, 4, 8e6, ["fp32", "int8", "topk0.02-int2"], buckets=10, latency_s=0.01)
    plain = format_seconds(250_000, 4, 8e6, ["fp32", "int8", "topk0.02-int2"])
    assert [with_latency[f] - plain[f] for f in plain] == pytest.approx([0.6, 0.4, 0.3])
    assert format_seconds(250_000, 1, 8e6, ["fp32", "topk0.02-int2"], latency_s=0.01) == {"fp32": 0.0,
                                                                                      "topk0.02-int2": 0.0}
    with pytest.raises(ValueError, match="unknown exchange format 'int3'"):
        format_seconds(10, 2, 1e6, ["int3"])


def test_exposed_and_fraction_against_the_hiding_benchmark():
    # scripts/bench: 27 Mbit/s, exchange 172 ms, step 43 ms, H = 8 (measured 0.72 layer-wise, 0.96 delay 4)
    t, c = 0.043, 0.172
    assert exposed_seconds(c, t, 0) == pytest.approx(c - t / 3)
    assert bound_fraction(t, exposed_seconds(c, t, 0), 8) == pytest.approx(0.69, abs=0.01)
    assert exposed_seconds(c, t, 4) == 0.0
    # 20 Mbit/s: 232 ms, 60 ms exposed with delay 4 (measured 0.88)
    assert exposed_seconds(0.232, t, 4) == pytest.approx(0.06)
    assert bound_fraction(t, exposed_seconds(0.232, t, 4), 8) == pytest.approx(0.85, abs=0.01)
    # fragments: each 1/F of the exchange behind tau steps
    assert exposed_seconds(0.232, t, 1, fragments=4) == pytest.approx(4 * (0.058 - 0.043))


def test_an_exchange_the_forward_pass_hides_needs_no_delay():
    ch = choose(0.3, {"fp32": 0.05}, 8)
    assert (ch.outer_step_delay, ch.fragments, ch.exchange_dtype, ch.hidden) == (0, 1, "fp32", True)
    assert ch.bound_fraction == 1.0


def test_an_exchange_shorter_than_one_step_takes_delay_1():
    ch = choose(0.1, {"fp32": 0.06}, 8)  # 1.2 * 0.06 > 0.1 / 3, < one step
    assert (ch.outer_step_delay, ch.fragments, ch.hidden) == (1, 1, True)


def test_the_smallest_covering_delay_then_fragments_under_the_cap():
    # 4.0 steps * margin 1.2 = 4.8 -> delay 5 > H/2 = 4: two fragments, delay ceil(2.4) = 3 < 8/2
    ch = choose(0.043, {"fp32": 0.172}, 8)
    assert (ch.outer_step_delay, ch.fragments, ch.hidden) == (3, 2, True)
    # with the cap lifted the delay alone covers it
    ch = choose(0.043, {"fp32": 0.172}, 8, max_delay=7)
    assert (ch.outer_step_delay, ch.fragments) == (5, 1)
    # exactly at the boundary: delay must stay below H/F
    ch = choose(1.0, {"fp32": 3.0}, 8, margin=1.0, max_delay=7)
    assert (ch.outer_step_delay, ch.fragments) == (3, 1)


def test_an_exchange_longer_than_h_is_not_hidden_and_says_so():
    ch = choose(0.01, {"fp32": 1.0}, 8)
    assert not ch.hidden
    # the least exposed setting within the cap H/2 = 4: F * tau steps hide the most at
    # 2 fragments x delay 3 (6 steps), more than delay 4 alone (4) or 4 fragments x delay 1 (4)
    assert (ch.outer_step_delay, ch.fragments) == (3, 2)
    assert ch.exposed_s == pytest.approx(1.0 - 0.06)
    assert "not hidden" in ch.line()


def test_the_most_precise_format_that_can_be_hidden():
    times = {"fp32": 1.0, "int8": 0.26, "int4": 0.13}
    ch = choose(0.1, times, 8, ["fp32", "int8", "int4"])
    assert ch.exchange_dtype == "int8" and ch.hidden
    assert ch.outer_step_delay == math.ceil(1.2 * 0.26 / 0.1) and ch.fragments == 1
    # int8 not allowed: int4
    ch = choose(0.1, times, 8, ["int4", "fp32"])
    assert ch.exchange_dtype == "int4"
    # only fp32 allowed: never a format the user did not allow
    ch = choose(0.1, times, 8, ["fp32"])
    assert ch.exchange_dtype == "fp32" and not ch.hidden


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="write topk<density>-int2"):
        choose(0.1, {"fp32": 1.0}, 8, ["int2"])
    with pytest.raises(ValueError, match="formats must be"):
        choose(0.1, {"fp32": 1.0}, 8, [])
    with pytest.raises(ValueError, match="no exchange time for int8"):
        choose(0.1, {"fp32": 1.0}, 8, ["int8"])
    with pytest.raises(ValueError, match="margin"):
        choose(0.1, {"fp32": 1.0}, 8, margin=0.5)
    with pytest.raises(ValueError, match="step time"):
        choose(0.0, {"fp32": 1.0}, 8)


def test_every_worker_chooses_the_same_from_the_same_numbers():
    args = (0.0431, {"fp32": 0.2, "int8": 0.05}, 16, ["fp32", "int8"])
    assert choose(*args) == choose(*args)
    assert isinstance(choose(*args), Choice)


def test_plan_from_the_model_size_and_the_link():
    # 137,250 fp32 parameters = 549 kB; 2 workers at 27 Mbit/s -> 163 ms
    times, ch = plan(137_250, 2, 27e6, 0.043, 8, ["fp32"])
    assert times["fp32"] == pytest.approx(549_000 * 8 / 27e6)
    assert ch.hidden and ch.fragments * ch.outer_step_delay * 0.043 >= 1.2 * times["fp32"]


# --- the runtime's choice (auto_overlap): the run's own F, agreed measurements ---------------

def test_the_runs_own_fragments_only():
    """With F fixed (the runtime keeps the run's F), the choice never changes it: the fewest
    fragments that would hide it are not taken; a delay of H/F or more is never chosen."""
    # t = 1 s, H = 8: fp32 C = 5 s needs tau = 6 with F = 1 (> H/2), hidden with F = 2 (tau 3)
    free = choose(1.0, {"fp32": 5.0}, 8)
    assert (free.fragments, free.outer_step_delay, free.hidden) == (2, 3, True)
    kept = choose(1.0, {"fp32": 5.0}, 8, fragments=(1,))
    assert (kept.fragments, kept.outer_step_delay, kept.hidden) == (1, 4, False)  # the cap H/2: fastest
    four = choose(1.0, {"fp32": 5.0}, 8, fragments=(4,))  # tau = ceil(1.2 * 5 / 4) = 2 >= H/F = 2
    assert (four.fragments, four.outer_step_delay, four.hidden) == (4, 1, False)
    quick = choose(1.0, {"fp32": 0.1}, 8, fragments=(4,))  # hidden by the forward pass: no delay
    assert (quick.fragments, quick.outer_step_delay, quick.hidden) == (4, 0, True)
    with pytest.raises(ValueError, match="must divide the sync interval 8"):
        choose(1.0, {"fp32": 5.0}, 8, fragments=(3,))


def test_a_format_not_allowed_is_never_chosen():
    """int4 would hide the exchange; with fp32 and int8 allowed only, the fastest of those."""
    times = {"fp32": 8.0, "int8": 4.0, "int4": 0.2}
    assert choose(1.0, times, 8, ("fp32", "int8", "int4"), fragments=(1,)).exchange_dtype == "int4"
    only = choose(1.0, times, 8, ("fp32", "int8"), fragments=(1,))
    assert (only.exchange_dtype, only.outer_step_delay, only.hidden) == ("int8", 4, False)


def test_formats_scale_with_their_bytes():
    times = scale_to_formats(0.4, "fp32", 1024, ("fp32", "bf16", "int8", "int4"), 256)
    assert times["fp32"] == 0.4 and times["bf16"] == pytest.approx(0.2)
    # the quantized formats count their scales (one fp32 per block) and padding
    assert times["int8"] == pytest.approx(0.4 * (1024 + 16) / 4096)
    assert times["int4"] == pytest.approx(0.4 * (512 + 16) / 4096)
    # measured in int8: fp32 is the inverse ratio
    assert scale_to_formats(times["int8"], "int8", 1024, ("fp32",), 256)["fp32"] == pytest.approx(0.4)


def test_agreement_takes_the_fastest_step_and_the_slowest_exchange():
    """Each rank packs its numbers; the elementwise MAX over ranks (what the all-reduce does)
    gives every rank the same measurement: the smallest step, the largest exchange per format
    and the largest exposed wait."""
    formats = ("fp32", "int8")
    ranks = [Measurement(0.10, {"fp32": 0.30, "int8": 0.08}, 0.0), Measurement(0.13, {"fp32": 0.10, "int8": 0.09}, 0.2)]
    maxed = [max(col) for col in zip(*(m.pack(formats) for m in ranks))]
    agreed_m = agreed(maxed, formats)
    assert agreed_m == Measurement(0.10, {"fp32": 0.30, "int8": 0.09}, 0.2)
    assert agreed(ranks[0].pack(formats), formats) == ranks[0]
    # whether the exchange was measured by this sync: any rank's
    ranks[1] = Measurement(0.13, {"fp32": 0.10, "int8": 0.09}, 0.2, fresh=True)
    maxed = [max(col) for col in zip(*(m.pack(formats) for m in ranks))]
    assert agreed(maxed, formats).fresh and not agreed(ranks[0].pack(formats), formats).fresh


def test_the_exposed_wait_grew():
    assert not exposure_grew(0.04, 0.0, 0.1)  # under half a step: noise
    assert exposure_grew(0.06, 0.0, 0.1)
    assert not exposure_grew(0.9, 0.7, 0.1)  # half a step more, but not 1.5 times
    assert exposure_grew(1.2, 0.7, 0.1)


def test_a_re_decision_takes_more_fragments_only_where_those_in_force_no_longer_cover_the_exchange():
    """H = 8, fp32 at about 215 ms: at a 59 ms step one fragment would need a delay of 5 > H/2,
    so the rule takes 2 with a delay of 3; at 69 ms one fragment with a delay of 4. Measured in
    a run at 20 Mbit/s, the step moved between those at every re-decision and F flipped. One
    fragment with a delay of 4 still covers 215 ms at 59 ms a step (4 x 59 = 236 ms, without
    the 1.2 margin a new choice needs): kept. Fewer fragments are taken at once; where the
    setting in force no longer covers the exchange, or the format changes, the new choice."""
    from megatron_edit.algorithm.overlap_plan import keep_fragments

    two = choose(0.059, {"fp32": 0.215}, 8, ("fp32",), fragments=(1, 2))
    one = choose(0.069, {"fp32": 0.219}, 8, ("fp32",), fragments=(1, 2))
    assert (two.outer_step_delay, two.fragments) == (3, 2) and (one.outer_step_delay, one.fragments) == (4, 1)
    kept = keep_fragments(one, two, 0.059, {"fp32": 0.215}, 8)
    assert (kept.exchange_dtype, kept.outer_step_delay, kept.fragments, kept.hidden) == ("fp32", 4, 1, True)
    assert keep_fragments(two, one, 0.069, {"fp32": 0.219}, 8) == one  # fewer fragments: at once
    slower = choose(0.050, {"fp32": 0.215}, 8, ("fp32",), fragments=(1, 2))  # 4 x 50 < 215: not covered
    assert slower.fragments == 2 and keep_fragments(one, slower, 0.050, {"fp32": 0.215}, 8) == slower
    int8 = choose(0.059, {"fp32": 0.9, "int8": 0.215}, 8, ("fp32", "int8"), fragments=(1, 2))
    assert int8.exchange_dtype == "int8" and keep_fragments(one, int8, 0.059, {"fp32": 0.9, "int8": 0.215}, 8) == int8


def test_top_k_formats_parse_order_and_their_wire_bytes():
    """``topk<density>-<values>``: the sparse exchange's all-gather carries the W - 1 other
    workers' payloads (indices, values, a scale per chunk); the dense formats 2 (W - 1) / W of
    theirs. Most precise first: the dense formats, then the top-k ones by bytes."""
    from megatron_edit.algorithm import topk
    from megatron_edit.algorithm.overlap_plan import format_flags, precision_order, topk_format, wire_bytes

    assert topk_format("topk0.02-int2") == (0.02, "int2") and topk_format("int4") is None
    for bad in ("int2", "topk0-int2", "topk2-int2", "topk0.02-bf16", "topkx-int2", "top0.02-int2"):
        with pytest.raises(ValueError):
            topk_format(bad)
    assert format_flags("topk0.02-int2") == "--local-sgd-exchange-dtype int2 --local-sgd-exchange-topk-density 0.02"
    assert format_flags("int8") == "--local-sgd-exchange-dtype int8"
    n = 1 << 24
    assert wire_bytes(n, "topk0.02-int2", 4) == 3 * topk.encoded_bytes(n, 0.02, 4096, "int2")
    assert wire_bytes(n, "fp32", 4) == 2 * 3 / 4 * 4 * n
    assert wire_bytes(n, "topk0.02-int2", 2) / wire_bytes(n, "fp32", 2) == pytest.approx(0.009, abs=0.0005)
    assert precision_order(["topk0.01-int2", "int4", "topk0.03-int2", "fp32"]) == \
        ["fp32", "int4", "topk0.03-int2", "topk0.01-int2"]


def test_top_k_formats_scale_with_the_bytes_one_rank_sends_and_are_chosen_when_the_link_needs_them():
    """The automatic overlap's times for the top-k formats (issue 60): scaled from the measured
    format by :func:`megatron_edit.algorithm.wire.wire_bytes` (the all-gather of the W - 1 other
    payloads against the dense formats' 2 (W - 1) / W), with the run's top-k chunk; when no
    dense format can be hidden, the most precise top-k one that can is chosen."""
    from megatron_edit.algorithm import wire

    n = 1 << 20
    for workers in (2, 4):
        times = scale_to_formats(1.0, "int8", n, ("int8", "topk0.02-int2", "topk0.02-int4"), 256, workers, 1024)
        for fmt in ("topk0.02-int2", "topk0.02-int4"):
            assert times[fmt] == pytest.approx(wire.wire_bytes(n, fmt, workers, 256, 1024)
                                               / wire.wire_bytes(n, "int8", workers, 256))
        assert times["topk0.02-int2"] < times["topk0.02-int4"] < times["int8"] == 1.0
    # the all-gather grows with W, the dense exchange does not: top-k costs more relative to int8 at W = 4
    assert scale_to_formats(1.0, "int8", n, ("topk0.02-int2",), 256, 4)["topk0.02-int2"] > \
        scale_to_formats(1.0, "int8", n, ("topk0.02-int2",), 256, 2)["topk0.02-int2"]
    # measured in a top-k format: the dense ones are the inverse ratio
    back = scale_to_formats(times["topk0.02-int2"], "topk0.02-int2", n, ("int8",), 256, 4, 1024)
    assert back["int8"] == pytest.approx(1.0)
    # H = 8, a step of 0.1 s: int8 at 2 s cannot be hidden (tau 24 > H/2); topk0.02-int4 at 0.3 s
    # needs tau 4 (the cap), topk0.02-int2 would need 3: the most precise that hides, int4 values
    formats = ("int8", "topk0.02-int2", "topk0.02-int4")
    chosen = choose(0.1, {"int8": 2.0, "topk0.02-int2": 0.25, "topk0.02-int4": 0.3}, 8, formats, fragments=(1,))
    assert (chosen.exchange_dtype, chosen.outer_step_delay, chosen.hidden) == ("topk0.02-int4", 4, True)
    chosen = choose(0.1, {"int8": 0.2, "topk0.02-int2": 0.01, "topk0.02-int4": 0.02}, 8, formats, fragments=(1,))
    assert chosen.exchange_dtype == "int8"  # int8 hides: the dense format first


def test_most_precise_first_is_one_rule_for_dense_and_top_k_formats():
    """:func:`megatron_edit.algorithm.formats.precision_order` (torch-free, what the configuration
    orders ``auto_formats`` with) and the planner's are the same: the dense formats in their
    order, then the top-k ones by density x (index bits + value bits), most first; equal bits,
    the higher density first."""
    from megatron_edit.algorithm.formats import precision_order as formats_order
    from megatron_edit.algorithm.overlap_plan import precision_order

    names = ["topk0.01-fp32", "topk0.02-int2", "int4", "topk0.05-int2", "topk0.02-int4", "fp32", "int8"]
    # chunk 4096: 12 index bits: 0.01 x 44 = 0.44, 0.02 x 14 = 0.28, 0.05 x 14 = 0.70, 0.02 x 16 = 0.32
    expected = ["fp32", "int8", "int4", "topk0.05-int2", "topk0.01-fp32", "topk0.02-int4", "topk0.02-int2"]
    assert formats_order(names) == precision_order(names) == expected
    # chunk 4: 2 index bits: 0.01 x 34 = 0.34 now ranks above 0.02 x 6 = 0.12 and 0.02 x 4 = 0.08 too
    assert formats_order(["topk0.02-int2", "topk0.01-fp32", "topk0.02-int4"], chunk=4) == \
        ["topk0.01-fp32", "topk0.02-int4", "topk0.02-int2"]
    # equal bits: the higher density first (chunk 65536, 16 index bits: 0.25 x 48 = 0.5 x 24 = 12)
    assert formats_order(["topk0.25-fp32", "topk0.5-int8"], chunk=1 << 16) == ["topk0.5-int8", "topk0.25-fp32"]


def test_a_format_is_predicted_from_its_codec_the_latency_per_message_and_the_rest_per_byte():
    """A top-k exchange measured at 0.1 s among 4 workers, 10 buckets: 0.06 s of it codec, 10 x 3
    messages of 1 ms latency, the 0.01 s left over its bytes is the link's rate. int8 is then its
    own codec + 10 x 4 messages + its bytes at that rate; fp32 (no codec) 10 x 6 messages + its
    bytes. Scaled by bytes alone, fp32 was ~90x the top-k time."""
    from megatron_edit.algorithm import wire

    n, w, fmts = 1 << 20, 4, ("fp32", "int8", "topk0.02-int2")
    codec = {"fp32": 0.0, "int8": 0.02, "topk0.02-int2": 0.06}
    times, per_byte = predict_formats(0.1, "topk0.02-int2", n, fmts, 256, w, 4096, codec_s=codec,
                                      latency_s=0.001, buckets=10)
    sent = {f: wire.wire_bytes(n, f, w, 256, 4096) for f in fmts}
    assert per_byte == pytest.approx(0.01 / sent["topk0.02-int2"])
    assert times["topk0.02-int2"] == 0.1
    assert times["int8"] == pytest.approx(0.02 + 0.04 + sent["int8"] * per_byte)
    assert times["fp32"] == pytest.approx(0.06 + sent["fp32"] * per_byte)
    assert times["fp32"] < 0.2 * scale_to_formats(0.1, "topk0.02-int2", n, ("fp32",), 256, w, 4096)["fp32"]
    # codec and latency more than the measured time (noise): nothing left for the bytes (0 per
    # byte); a rate the caller knows (probed) is taken as it is
    over, rate = predict_formats(0.05, "topk0.02-int2", n, fmts, 256, w, 4096, codec_s=codec, latency_s=0.001,
                                 buckets=10)
    assert rate == 0.0 and over["fp32"] == pytest.approx(0.06) and over["topk0.02-int2"] == 0.05
    known = 1e-8
    over, rate = predict_formats(0.1, "topk0.02-int2", n, fmts, 256, w, 4096, codec_s=codec, latency_s=0.001,
                                 buckets=10, per_byte_s=known)
    assert rate == known and over["fp32"] == pytest.approx(0.06 + sent["fp32"] * known)
    assert over["topk0.02-int2"] == 0.1
    # neither codec nor latency: the bytes' ratio, as scale_to_formats
    plain, _ = predict_formats(0.1, "topk0.02-int2", n, fmts, 256, w, 4096)
    assert plain == pytest.approx(scale_to_formats(0.1, "topk0.02-int2", n, fmts, 256, w, 4096))


def test_the_smallest_interval_is_the_first_h_whose_choice_hides_the_exchange():
    """1.3B parameters, 2 workers, 100 Mbit/s, 0.5 s steps, int4 or the top-k exchange: the H
    returned hides the exchange and the H before it does not; the search starts at ``smallest``
    and gives up past ``largest``."""
    model = dict(params=1_300_000_000, workers=2, link_bits_per_s=100e6, step_s=0.5, formats=["int4", "topk0.02-int2"])
    h, choice = smallest_interval(**model)
    times = format_seconds(1_300_000_000, 2, 100e6, ["int4", "topk0.02-int2"])
    assert h > 1 and choice.hidden and choice == choose(0.5, times, h, ["int4", "topk0.02-int2"])
    assert not choose(0.5, times, h - 1, ["int4", "topk0.02-int2"]).hidden
    assert smallest_interval(**model, smallest=h + 1)[0] > h
    assert smallest_interval(**model, largest=h - 1) is None
