"""The run-time controller (`spec_cli.decoding.adapt`): its cost curves, calibration and the probes of plain decoding,
fed synthetic steps."""

import math

import pytest

from spec_cli.decoding import adapt


def test_cost_curve_is_robust_and_non_decreasing():
    cost = adapt.Cost()
    cost.add(2, 0.9)  # a warm-up hiccup, seen once
    for _ in range(3):
        for n, t in [(1, 0.010), (2, 0.013), (4, 0.017), (8, 0.0165), (16, 0.020)]:
            cost.add(n, t)
    cost.add(16, 0.5)  # a busy neighbour, once
    assert cost(1) == pytest.approx(0.010) and cost(2) == pytest.approx(0.013)
    assert cost(3) == pytest.approx((0.013 + 0.01675) / 2)
    assert cost(4) == pytest.approx(cost(8)) == pytest.approx(0.01675)  # pooled: never cheaper for more
    assert cost(16) == pytest.approx(0.020) and cost(24) > cost(16)
    assert cost.extra(1, 3) == pytest.approx(cost(4) - cost(1))
    assert cost(1000) > 0 and adapt.Cost()(5) == 0.0
    for _ in range(9):  # the machine got slower: every size's reading follows (none kept from the old curve)
        for n, t in [(1, 0.020), (2, 0.026), (4, 0.034), (8, 0.033), (16, 0.040)]:
            cost.add(n, t)
    assert cost(1) == pytest.approx(0.020) and cost(3) == pytest.approx((0.026 + 0.0335) / 2)
    assert cost(16) == pytest.approx(0.040) and cost.extra(1, 3) == pytest.approx(0.0135)


def decide(c, steps, tokens, seconds, plain_seconds, verified=True, cue=None):
    """`steps` decisions of controller `c` where a speculative step brings `tokens` in `seconds` (`verified`:
    the draft offered the oracle something)."""
    decisions = []
    for _ in range(steps):
        speculate = c.speculate(cue)
        decisions.append(speculate)
        c.observe(speculate, tokens if speculate else 1, seconds if speculate else plain_seconds,
                  verified=verified)
    return decisions


def runs(decisions):
    """(first step, length) of each run of speculative steps."""
    out = []
    for i, d in enumerate(decisions):
        if d and (i == 0 or not decisions[i - 1]):
            out.append([i, 0])
        if d:
            out[-1][1] += 1
    return [tuple(r) for r in out]


def test_controller_probes_plain_decoding_and_backs_off():
    c = adapt.Controller()
    decisions = decide(c, 300, 2, 0.020, 0.008)  # 100 vs 125 tokens/s
    first = 3 * adapt.PLAIN_FIRST  # plain decoding measured early, on a few steps
    assert decisions[:first] == [True, True, False] * adapt.PLAIN_FIRST
    assert sum(decisions) <= 2 * adapt.PLAIN_FIRST + adapt.BURST * (300 / 50 + 1)  # then mostly plain, probes at
    # intervals that keep their cost small
    probes = runs(decisions)[adapt.PLAIN_FIRST:]
    assert len(probes) >= 3 and all(length == adapt.BURST for _, length in probes)  # judged as bursts
    gaps = [b[0] - (a[0] + a[1]) for a, b in zip(probes, probes[1:])]
    lost = adapt.BURST * (0.020 - 2 * 0.008) / 0.008  # plain steps' time a probe loses
    assert all(lost / adapt.PROBE_SHARE <= gap <= lost / adapt.PROBE_SHARE_LOSING + 2 for gap in gaps)
    # (the first probe, before any had lost, was paid on credit: the gap after it repays that too)
    assert gaps[1:] == sorted(gaps[1:]) and gaps[-1] > gaps[1]  # as probes keep losing, they come less often
    assert c.share < adapt.PROBE_SHARE
    decide(c, 2000, 2, 0.020, 0.008)
    assert c.share == pytest.approx(adapt.PROBE_SHARE_LOSING, abs=1e-3)
    decisions = decide(adapt.Controller(), 200, 3, 0.012, 0.008)  # 250 vs 125 tokens/s
    assert sum(decisions) > 190  # a plain step now and then keeps the comparison fresh


def test_probes_that_lose_cost_at_most_a_few_percent():
    """Speculation that never pays (a probe step takes 6 plain steps' time for 1.5 tokens; the draft either
    offers nothing, or offers and loses): decoding with the controller stays within a few percent of plain
    decoding, however long it runs."""
    for verified in (True, False):
        c = adapt.Controller()
        step, tokens, seconds = 0.010, 0, 0.0
        for _ in range(3000):
            if c.speculate(lambda: True):  # and the text always looks like it repeats
                c.observe(True, 1.5, 3 * step, spent=6 * step, verified=verified)  # catch-up: spent only
                tokens, seconds = tokens + 1.5, seconds + 6 * step
            else:
                c.observe(False, 1, step)
                tokens, seconds = tokens + 1, seconds + step
        assert seconds / (tokens * step) < 1 + 2.5 * adapt.PROBE_SHARE


def test_a_look_at_an_unsure_draft_is_cheap_and_repeated_soon():
    """Where the draft offers nothing, a probe ends after one step, and costs little: the next look comes
    within a few steps, so speculation resumes as soon as the draft becomes sure."""
    c = adapt.Controller()
    decide(c, 400, 1.0, 0.0105, 0.010, verified=False)  # a look costs 5% of a step
    probes = runs(decide(c, 100, 1.0, 0.0105, 0.010, verified=False))
    assert all(length == 1 for _, length in probes)
    share = c.share  # looks that keep losing are paid from the smaller share
    assert share == pytest.approx(adapt.PROBE_SHARE_LOSING, abs=1e-3)
    assert len(probes) >= 100 / (0.05 / share + 2) - 1  # as often as the budget allows
    after = decide(c, 30, 4.0, 0.012, 0.010)  # the text turns predictable: the draft is sure and right
    assert after.index(True) <= 0.05 / share + 2 and all(after[after.index(True) + 1:][:20])


def test_while_speculating_an_unsure_draft_is_looked_at_less_and_less_often():
    """Speculation pays, then the draft turns unsure (offers nothing): the looks at it come after 1, 2, 4, ...
    plain steps, up to what the 3% rule allows; once it offers again, every step speculates."""
    c = adapt.Controller()
    decide(c, 50, 4.0, 0.012, 0.010)  # paying
    unsure = decide(c, 60, 1.0, 0.0105, 0.010, verified=False)  # a look costs 5% of a step
    looks = [i for i, d in enumerate(unsure) if d]
    gaps = [b - a - 1 for a, b in zip(looks, looks[1:])]
    cap = math.ceil(0.05 / adapt.PROBE_SHARE)
    assert gaps[:2] == [1, 2] and all(g <= max(cap, 2) for g in gaps) and gaps[-1] == min(cap, gaps[-1])
    sure = decide(c, 30, 4.0, 0.012, 0.010)
    assert sure.index(True) <= cap + 1 and all(sure[sure.index(True):])


def test_a_new_completion_gets_an_early_look_paid_by_the_completion():
    c = adapt.Controller()
    decide(c, 400, 1.5, 0.030, 0.010)  # speculation loses: probes come seldom
    c.credit = -1.0  # whatever earlier text's probes lost
    c.begin()
    assert runs(decide(c, 20, 1.5, 0.030, 0.010)) == [(adapt.PROBE_NEW_TEXT, 1)]  # one step
    assert c.credit >= -1.0  # not paid from the credit: at most one step per completion
    c.begin()
    after = decide(c, 20, 4.0, 0.012, 0.010)  # this text is one the draft guesses: the look wins
    assert not any(after[:adapt.PROBE_NEW_TEXT]) and all(after[adapt.PROBE_NEW_TEXT:])


def test_new_completions_looks_back_off_while_they_keep_losing_and_come_back_when_one_wins():
    """Where the draft is no use (sampling on a CPU where a second token costs 40% more), every completion's
    look costs the draft reading the prompt: after a few lost in a row, completions 1, 3, 7, then at most
    LOOK_SKIP_MAX begin without one. A look that wins brings them back at every completion."""
    c = adapt.Controller()
    decide(c, 400, 1.5, 0.030, 0.010)
    c.credit = -1.0  # no other probe: only looks
    looked = []
    for _ in range(40):
        c.begin()
        looked.append(bool(runs(decide(c, 20, 1.5, 0.030, 0.010))))
    firsts = [i for i, x in enumerate(looked) if x]
    gaps = [b - a for a, b in zip(firsts, firsts[1:])]
    assert gaps[:4] == [1, 2, 4, 8] and all(g == adapt.LOOK_SKIP_MAX + 1 for g in gaps[4:])
    assert sum(looked) <= 8
    looked = []
    for _ in range(2 * adapt.LOOK_SKIP_MAX + 4):  # the text becomes one the draft guesses
        c.begin()
        looked.append(any(decide(c, 20, 4.0, 0.012, 0.010)))
    assert all(looked[looked.index(True):])  # the first look that wins brings them back at every completion
    assert looked.index(True) <= adapt.LOOK_SKIP_MAX


def test_plain_speed_is_a_low_quantile_of_recent_plain_steps():
    """Stalls and cold starts only make a step slower: a process's first plain steps (kernels built, graphs
    captured) or a busy neighbour's must not make plain decoding look slower than it is."""
    c = adapt.Controller()
    for seconds in [0.030] * 3 + [0.010] * 5 + [0.050] * 3:  # cold starts, then a busy neighbour now and then
        c.observe(False, 1, seconds)
    assert c.plain_rate == pytest.approx(100.0)


def busy_then_idle(slow: float):
    """A controller that learned in a process `slow` times slower than this machine now is (the machine was busy,
    or another build ran), restored into a new process, and the steps it then takes: speculating brings 3 tokens
    in 2.5 plain steps' time here, a plain step 10 ms, a forward of n tokens 10 + 5 (n - 1) ms (the prompt's,
    40 tokens, 0.3 s)."""
    def forward(n, k=1.0):
        return k * (0.010 + 0.005 * (n - 1)) if n < 40 else k * 0.3

    busy = adapt.Controller()
    for _ in range(20):
        for n in (1, 2, 4, 6, 8, 12):
            busy.oracle.add(n, forward(n, slow))
        busy.observe(False, 1, forward(1, slow))
    busy.observe(True, 3, forward(1, slow) * 2.5)
    busy.credit = -100 * forward(1, slow)  # probes lost there: overdrawn by 100 plain steps
    c = adapt.Controller()
    c.restore(busy.state())
    return c, forward


def test_plain_steps_and_timings_kept_from_a_busy_process_give_way_to_this_ones():
    """What a process learned while the machine was 25 times slower (a compile beside it, a debug build) must not
    steer the next: speculating looked like it paid 3 tokens in 2.5 plain steps' time there, as here, but every
    price was 25 times what it is. A plain step early checks the kept plain speed (or speculating would keep
    winning against a plain speed 25 times too slow, never to time one again), and finding it off, the controller
    measures anew as a new one would; a step that read the prompt, its seconds read off the kept curve, is not a
    plain step's timing."""
    c, forward = busy_then_idle(25)
    assert c.plain_rate == pytest.approx(1 / 0.25)
    c.report(adapt.Step(speculated=False, tokens=1, verified=0, oracle_tail=40, oracle_seconds=forward(40)))
    decisions = []
    for _ in range(12):
        speculate = c.speculate()
        decisions.append(speculate)
        c.report(adapt.Step(speculated=speculate, tokens=3 if speculate else 1, verified=3 if speculate else 0,
                            oracle_tail=1, oracle_seconds=forward(4 if speculate else 1)))
    assert decisions[:9].count(False) == adapt.PLAIN_FIRST  # timed anew on the first steps...
    assert all(decisions[9:])  # ... and then speculating still pays
    assert list(c.plain) == pytest.approx([0.010] * adapt.PLAIN_FIRST)  # the kept ones gone (the prompt's left none)
    assert c.oracle(1) == pytest.approx(0.010) and c.oracle(4) == pytest.approx(0.025)  # timed here
    assert c.oracle(12) < 0.1  # 25 times the plain speed here: the kept timings, never timed again, went with it
    assert c.spec_rate == pytest.approx(3 / 0.025)  # ... and so did the rate speculating kept
    assert c.credit >= 0  # (and the probes' credit: an overdraft of a busy process's seconds is not this one's)


def test_plain_steps_kept_from_a_process_like_this_one_keep_their_rates():
    c, forward = busy_then_idle(1.2)
    kept_spec = c.spec_rate
    for _ in range(3 * adapt.PLAIN_FIRST):
        speculate = c.speculate()
        c.report(adapt.Step(speculated=speculate, tokens=3 if speculate else 1, verified=3 if speculate else 0,
                            oracle_tail=1, oracle_seconds=forward(4 if speculate else 1)))
    assert c.plain_own == 1 and c.plain_rate == pytest.approx(1 / 0.012)  # one plain step checked the kept speed
    assert kept_spec < c.spec_rate < 3 / 0.025  # decayed into this process's, not dropped
    assert c.oracle(12) == pytest.approx(forward(12, 1.2))  # kept: never timed here, and within the drift


def test_a_kept_timing_that_contradicts_this_process_is_dropped_and_kept_ones_fade_across_processes():
    busy = adapt.Cost()
    for _ in range(9):
        for n, t in [(1, 0.25), (8, 2.0)]:
            busy.add(n, t)
    c = adapt.Cost()
    c.restore(busy.state())
    assert c(8) == pytest.approx(2.0)
    for _ in range(adapt.TRUSTED):
        c.add(1, 0.01)
    assert c(1) == pytest.approx(0.01)  # a size's own timings replace its kept ones
    for _ in range(adapt.TRUSTED):
        c.add(24, 0.5)  # a bigger forward timed here, faster than the kept 8-token one
    assert c(8) < 0.5 and c(24) == pytest.approx(0.5)  # 8 tokens: no longer priced out
    for _ in range(adapt.AGE // adapt.SPAN):  # processes that never ran the sizes
        again = adapt.Cost()
        again.restore(c.state())
        c = again
    assert c.curve() == []  # forgotten


def test_the_rate_a_slot_must_beat_follows_the_text_not_the_best_speculative_run():
    """Dinkelbach's ratio, the rate each verified node and draft forward must beat, is what steps bring lately
    (never less than plain decoding): a copy run at 500 tokens/s raises it, and new text starts again from
    plain decoding's 140 and follows what its own steps bring. Held at the copy run's 500, a draft right nine
    times in ten on fresh text would go unverified though plain decoding, the real alternative, is slower."""
    c = adapt.Controller()
    for _ in range(15):
        c.observe(False, 1, 1 / 140)
    for _ in range(20):
        c.observe(True, 8, 8 / 500)
    assert c.reference == pytest.approx(500, rel=0.01)
    c.begin()
    assert c.reference == pytest.approx(140, rel=0.01)
    for _ in range(6):
        c.observe(True, 2, 2 / 200)
    assert 180 < c.reference <= 200
    for _ in range(10):
        c.observe(True, 1, 1 / 100)  # speculation losing: never below plain decoding
    assert c.reference == pytest.approx(140, rel=0.01)


def test_a_near_tie_is_decoded_plainly_but_for_probes():
    """Speculating brings 2 tokens in 19.6 ms, 102 tokens/s against plain decoding's 100: within the noise of a
    busy machine, where such a tie is as likely a loss. Speculating is not the steady state: steps go back to
    plain after each probe (which lost nothing measurable, so the next comes soon)."""
    c = adapt.Controller()
    decisions = decide(c, 600, 2, 0.0196, 0.010)
    assert sum(decisions[100:]) < 0.7 * 500
    assert all(length <= adapt.BURST for _, length in runs(decisions[100:]))


def test_a_cue_starts_a_probe_and_misleading_cues_share_the_probes_budget():
    c = adapt.Controller()
    decide(c, 400, 1.5, 0.030, 0.010)  # speculation loses: probes come seldom
    burst = adapt.BURST * (0.030 - 1.5 * 0.010)  # seconds a losing burst loses
    c.credit = 0.0  # (between timed probes: one is not due)
    decisions = decide(c, 2000, 1.5, 0.030, 0.010, cue=lambda: True)  # the text repeats, but speculation loses
    probes = runs(decisions)
    assert probes[0] == (0, adapt.BURST)  # a cue does not wait for a timed probe's credit
    assert all(length == 1 for _, length in probes[1:])  # overdrawn: one-step probes, as the credit allows
    lost = sum(length for _, length in probes) * (0.030 - 1.5 * 0.010)
    plain = (len(decisions) - sum(decisions)) * 0.010
    assert lost <= adapt.PROBE_SHARE * plain + 2 * burst  # their share, and at most about one burst overdrawn
    assert len(probes) > 5  # yet they keep coming, as the credit allows
    winning = decide(c, 200, 4.0, 0.012, 0.010, cue=lambda: True)  # the repeat pays: speculation resumes
    assert sum(winning[-100:]) > 95


def test_probes_of_every_kind_together_cost_at_most_their_share():
    """Timed probes, cues and new completions draw on one credit: however often the text looks new or
    repeating, losing probes cost at most a few percent of the time."""
    c = adapt.Controller()
    step, tokens, seconds = 0.010, 0, 0.0
    for i in range(6000):
        if i % 100 == 0:
            c.begin()
        if c.speculate(lambda: True):
            c.observe(True, 1.5, 3 * step, spent=4 * step)
            tokens, seconds = tokens + 1.5, seconds + 4 * step
        else:
            c.observe(False, 1, step)
            tokens, seconds = tokens + 1, seconds + step
    per_completion = 2.5 / 100  # each new completion's one-step look, paid by the completion: 2.5 plain steps lost
    assert seconds / (tokens * step) < 1 + 2 * adapt.PROBE_SHARE_LOSING + per_completion


def test_calibration_learns_how_often_the_oracle_agrees():
    cal = adapt.Calibration()
    for _ in range(300):
        cal.add_node(0.95, 0, True)
        cal.add_node(0.55, 0, False)
    assert cal.node(0.95, 0) > 0.98 and cal.node(0.55, 0) < 0.02
    assert cal.node(0.35, 1) == pytest.approx(0.35)  # untouched: the prior, a calibrated draft


def test_the_calibration_of_trigram_guesses_is_kept_and_an_older_state_without_it_keeps_the_prior():
    cal = adapt.Calibration()
    prior = cal.trigram(0.55, 0)
    for k in range(40):
        cal.add_trigram(0.55, 0, k % 4 == 0)
        cal.add_trigram(0.55, 1, False)
    assert cal.trigram(0.55, 0) < prior and cal.trigram(0.55, 1) < cal.trigram(0.55, 0)
    again = adapt.Calibration()
    again.restore(cal.state())
    assert again.trigram(0.55, 0) == cal.trigram(0.55, 0) and again.trigram(0.55, 1) == cal.trigram(0.55, 1)
    older = {k: v for k, v in cal.state().items() if k != "trigrams"}  # kept before trigram guesses existed
    again = adapt.Calibration()
    again.restore(older)
    assert again.trigram(0.55, 0) == prior and again.node(0.55, 0) == cal.node(0.55, 0)
    with pytest.raises(ValueError):
        adapt.Calibration().restore({**cal.state(), "trigrams": [[[0, 1]]]})


def test_a_steps_report_feeds_the_cost_curves_the_calibration_and_the_rates():
    """One report a step: the forwards go to their cost curves, the judgements to the calibration and the top
    child's rate, and the step's rate counts neither the draft reading the prompt nor the oracle reading it."""
    c = adapt.Controller()
    c.report(adapt.Step(speculated=True, tokens=3, verified=4, oracle_tail=1, oracle_seconds=0.010, draft_tail=1,
                        drafts=[(1, 0.002), (4, 0.003)], drafting=0.006, drafter="Lookup", guesses=[True, False],
                        nodes=[(0.95, 0, True), (0.35, 1, False)], groups=[(0.55, True)]))
    assert c.oracle(5) == pytest.approx(0.010) and c.draft(1) == pytest.approx(0.002)
    assert c.draft(4) == pytest.approx(0.003)
    assert c.drafter_rate("Lookup").value == pytest.approx(2 / 4)  # the prior's 1 in 2, then one kept in two
    assert c.top.value == pytest.approx(0.95 * 0.6 + 0.05)  # the best child's: accepted
    assert c.calibration.node(0.95, 0) > 0.95 and c.calibration.node(0.35, 1) < 0.35
    assert c.calibration.group(0.55) > 0.55
    assert (c.spec_tokens, c.spec_seconds) == (3, pytest.approx(0.016))  # the oracle's step and the drafting
    c.begin()
    c.report(adapt.Step(speculated=True, tokens=2, verified=4, oracle_tail=40, oracle_seconds=0.5, draft_tail=40,
                        prompt_left=39, drafts=[(40, 0.050)], drafting=0.052))
    # the oracle's step as if it had not read the prompt, 0.010; the drafting less the draft's catching up
    assert c.recent_seconds == pytest.approx(0.010 + 0.052 - (0.050 - 0.002))


def test_a_steps_rate_counts_all_it_took_so_the_hosts_work_can_make_plain_steps_win():
    """A step's whole time (`Step.wall`: from its start to the next one's) counts, not only its forwards: on a
    GPU the host's work around a speculative step (the tree, the walk, the draft's cache) can cost as much as a
    forward, and plain steps pay less of it. Here speculating brings 1.5 tokens a forward, so forwards alone
    say it wins; with the host's work counted it loses, and steps go plain."""
    def run(wall_spec, wall_plain):
        c = adapt.Controller()
        for k in range(40):
            if c.speculate():
                c.report(adapt.Step(speculated=True, tokens=3, verified=3, oracle_tail=1, oracle_seconds=0.001,
                                    drafts=[(1, 0.0005)] * 2, drafting=0.001, wall=wall_spec))
            else:
                c.report(adapt.Step(speculated=False, tokens=1, verified=0, oracle_tail=1, oracle_seconds=0.001,
                                    wall=wall_plain))
        return c
    forwards_only = run(None, None)
    assert forwards_only.spec_rate > forwards_only.plain_rate and forwards_only.speculate()
    counted = run(0.0035 * 3, 0.0012)  # 3.5 ms a token speculating, all told; 1.2 ms plainly
    assert counted.spec_rate < counted.plain_rate
    assert counted.plain_rate == pytest.approx(1 / 0.0012)
    assert sum(counted.speculate() for _ in range(10)) <= 1


def test_alone_a_long_read_for_a_short_answer_is_not_begun():
    """Speculating brings 3 tokens in 2 plain steps' time (20 ms a token against 30: 10 ms saved a token); the
    draft reads ~2 ms a token. A 500-token read (~1 s) pays over 200 tokens, not over 50; a short read always
    goes ahead, as does everything while the rates are not known."""
    c = adapt.Controller()
    assert c.speculate(catch_up=500, remaining=10)  # (nothing measured: a look)
    for k in range(40):
        if c.speculate():
            c.report(adapt.Step(speculated=True, tokens=3, verified=3, oracle_tail=1, oracle_seconds=0.060,
                                drafts=[(1, 0.0), (k % 16 + 1, 0.002 * (k % 16 + 1))], drafting=0.0))
        else:
            c.report(adapt.Step(speculated=False, tokens=1, verified=0, oracle_tail=1, oracle_seconds=0.030))
    assert c.spec_rate == pytest.approx(50, rel=0.05) and c.plain_rate == pytest.approx(1 / 0.030, rel=0.05)
    assert c.draft(500) == pytest.approx(1.0, rel=0.1)
    assert not c.worth_reading(500, 50) and c.worth_reading(500, 200)
    assert c.worth_reading(adapt.READ_ANYWAY, 1) and c.worth_reading(500, None)
    assert not any(c.speculate(catch_up=500, remaining=50) for _ in range(20))


def test_in_company_a_steps_extra_time_counts_for_every_sequence_that_waits_for_it():
    """Sequences sharing forwards (a server's slots): what a speculative step takes beyond a plain step, every
    other sequence waits for too. A step that wins alone (3 tokens in 2.5 plain steps' time) loses beside seven
    others, where the batch's tokens per second is the measure; and a controller in company starts plain, with
    no free look at the draft, since a look costs every sequence the draft reading the prompt."""
    def run(company):
        c = adapt.Controller(company=company)
        first = c.speculate()
        for _ in range(60):
            if c.speculate():
                c.report(adapt.Step(speculated=True, tokens=3, verified=3, oracle_tail=1, oracle_seconds=0.025,
                                    drafts=[(1, 0.0)], drafting=0.0))
            else:
                c.report(adapt.Step(speculated=False, tokens=1, verified=0, oracle_tail=1, oracle_seconds=0.010))
        return first, c
    first, alone = run(1)
    assert first and alone.spec_rate > alone.plain_rate and alone.speculate()
    first, together = run(8)
    assert not first and together.spec_rate < together.plain_rate
    assert sum(together.speculate() for _ in range(20)) <= 3  # probes, paid from the credit


def test_a_slot_that_learned_alone_measures_anew_in_a_crowd_and_alone_again():
    """A server's slot keeps its controller from request to request: one that learned alone that speculating
    pays (3 tokens in 2.5 plain steps' time) must not go on speculating beside 11 others where it loses (the
    batch's 12 tokens in 0.12 s against 13 in 0.2 s), judged against plain steps it timed alone. Rates are
    forgotten where the company changes its size class, not as clients come and go within one."""
    def steps(c, company, n, tokens, spec_seconds, plain_seconds):
        for _ in range(n):
            c.seat(company, 0.004 if company > 1 else None)
            if c.speculate():
                c.report(adapt.Step(speculated=True, tokens=tokens, verified=3, oracle_tail=1,
                                    oracle_seconds=spec_seconds, drafts=[(1, 0.0)], drafting=0.0))
            else:
                c.report(adapt.Step(speculated=False, tokens=1, verified=0, oracle_tail=1,
                                    oracle_seconds=plain_seconds))

    c = adapt.Controller()
    steps(c, 1, 40, 3, 0.025, 0.010)
    assert c.speculate() and c.spec_rate > 1.05 * c.plain_rate
    c.seat(12, 0.004)  # 12 sequences: a plain step 0.12 s; a speculative one 0.2 s for 2 tokens, 11 others waiting
    assert c.plain_rate is None and c.spec_rate is None and not c.speculate()
    steps(c, 12, 60, 2, 0.2, 0.12)
    assert c.plain_rate == pytest.approx(1 / 0.12) and sum(c.speculate() for _ in range(20)) <= 3
    before = (c.spec_tokens, c.spec_seconds, list(c.plain))
    c.seat(9, 0.004)  # clients coming and going: still the same class (8-15)
    c.seat(15, 0.004)
    assert (c.spec_tokens, c.spec_seconds, list(c.plain)) == before
    c.seat(1, None)  # alone again: measured anew, speculating first
    assert c.plain_rate is None and c.speculate()


def test_in_company_a_probe_waits_until_the_credit_covers_the_draft_catching_up_for_everyone():
    """A probe starts with the draft reading the text it skipped (a prompt: hundreds of tokens), and in company
    every sequence waits for that: beside 15 others it must wait for the credit to cover 16 times the read, a
    short catch-up soon, a prompt's never within a completion; alone, the credit's usual rule."""
    def controller(company):
        c = adapt.Controller()
        for n, t in [(1, 0.01), (16, 0.012), (128, 0.05), (256, 0.1)] * 3:
            c.draft.add(n, t)  # (reads past 128 tokens are not kept: the curve is extended)
        c.seat(company, 0.004 if company > 1 else None)
        for _ in range(adapt.PROBE_FIRST + 3):
            c.observe(False, 1, 0.12)  # plain steps: each earns the credit 3% of its time
        return c
    alone = controller(1)
    assert alone.credit > 0 and alone.speculate(catch_up=300)  # alone: the first probe comes as before
    crowd = controller(16)
    assert crowd.credit < 16 * crowd.draft(300)
    assert not crowd.speculate(catch_up=300) and not crowd.speculate(lambda: True, catch_up=300)
    for _ in range(45):
        crowd.observe(False, 1, 0.12)  # the credit grows towards the read it waits for (past one step's share)
    assert crowd.credit >= 16 * crowd.draft(1) and crowd.speculate(catch_up=1)  # a step's catch-up: a probe


def test_in_company_nodes_are_priced_at_the_shared_forwards_cost_of_a_row_for_every_sequence():
    c = adapt.Controller()
    for n, t in [(1, 0.010), (2, 0.011), (4, 0.012), (8, 0.014), (16, 0.018)] * 3:
        c.oracle.add(n, t)
    c.plain.extend([0.010] * 5)
    alone = c.price(1)
    assert alone(3) == pytest.approx(100 * c.oracle.extra(1, 3))  # the rate (100 tok/s) times the seconds
    c.company, c.row_seconds = 8, 0.0005  # beside 7 others, a row adds 0.5 ms to the shared forward
    together = c.price(1)
    assert together(3) == pytest.approx(100 * 8 * 0.0005 * 3)
    c.draft.add(1, 0.0001)
    assert c.expand([0.9, 0.5, 0.3], levels=0, planned=0, oracle_tail=1) == 1  # only the surest node pays
    c.company = 1
    assert c.expand([0.9, 0.5, 0.3], levels=0, planned=0, oracle_tail=1) == 3


def test_steps_without_the_draft_verify_the_guesses_only_while_that_beats_the_oracle_alone():
    """On a GPU a sampled or coupled walk down the lookup's guesses can cost what the forward does: guessing
    is measured apart from plain decoding (whose rate stays the oracle alone's) and kept only where it pays."""
    assert adapt.Policy().guess()  # a fixed policy guesses whenever the lookup has something
    losing = adapt.Controller()
    assert not losing.guess()  # the oracle alone is measured first
    for _ in range(adapt.PLAIN_FIRST):
        losing.observe(False, 1, 0.010)
    assert losing.guess()  # nothing known of guessing yet: try it
    for _ in range(10):
        losing.observe(False, 1, 0.015, guessed=True)  # 67 tokens/s against the oracle alone's 100
    assert losing.plain_rate == pytest.approx(100.0)  # guessed steps are not plain decoding
    assert not losing.guess() and losing.guess(lambda: True)  # guesses only where the text repeats itself
    for _ in range(10):
        losing.observe(False, 1, 0.015, guessed=True)  # ... which loses too (sampling that leaves the copies)
    followed = [losing.guess(lambda: True) for _ in range(4 * adapt.GUESS_PROBE)]
    assert sum(followed) == 4 and followed[adapt.GUESS_PROBE - 1]  # one cue in GUESS_PROBE, to measure again
    taken = []
    for _ in range(3 * adapt.GUESS_PROBE):
        taken.append(losing.guess(lambda: True))
        if taken[-1]:
            losing.observe(False, 4, 0.015, guessed=True)  # the text copies now: guessing on a cue pays again
        else:
            losing.observe(False, 1, 0.010)
    assert all(taken[adapt.GUESS_PROBE:])  # every cue followed again once one probe paid

    paying = adapt.Controller()
    for _ in range(adapt.PLAIN_FIRST):
        paying.observe(False, 1, 0.010)
    for _ in range(adapt.REFRESH - 1):
        assert paying.guess()
        paying.observe(False, 3, 0.015, guessed=True)  # 200 tokens/s
    assert paying.guess()
    paying.observe(False, 3, 0.015, guessed=True)
    assert not paying.guess()  # the oracle alone again now and then: its rate drifts with the context
    paying.observe(False, 1, 0.010)
    assert paying.guess()


def test_guesses_with_chances_of_their_own_are_priced_at_every_step_but_the_oracle_alone_is_still_measured():
    """Fitted heads guess new text at every step, each guess with its chance: the tree's prices decide, so a
    recent run of refused guesses does not stop such steps, but the oracle alone is measured first and again now
    and then."""
    c = adapt.Controller()
    assert not c.guess(priced=True)  # the oracle alone is measured first
    for _ in range(adapt.PLAIN_FIRST):
        c.observe(False, 1, 0.010)
    for _ in range(10):
        c.observe(False, 1, 0.015, guessed=True)  # guessing lost lately
    assert not c.guess() and c.guess(priced=True)
    for _ in range(adapt.REFRESH - 10):
        assert c.guess(priced=True)
        c.observe(False, 1, 0.015, guessed=True)
    assert not c.guess(priced=True)  # a plain step now and then
    c.observe(False, 1, 0.010)
    assert c.guess(priced=True)
