"""The staleness bound of asynchronous generation (``rlbuffers.rollouts.staleness``, issue 48),
with deterministic fakes: a fake clock and a fake pool whose workers take a given number of
fake seconds per job (a discrete-event simulation: no thread, no sleep). The bound holds under
a slow learner (generation is paced: workers wait for new weights, and it is counted) and
under a slow worker (the learner waits, and it is counted); every group is consumed once, in
submission order, none discarded; a resume regenerates the groups in flight at the crash."""

from __future__ import annotations

import pytest

from rlbuffers.rollouts.pool import RolloutResult
from rlbuffers.rollouts.staleness import PacedGeneration, StalenessGate


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


class FakePool:
    """``workers`` slots; job ``i`` runs on slot ``i % workers`` (as ``RayPool``) after the
    jobs queued there, taking ``seconds(group)`` fake seconds; ``results`` moves the clock to
    the last asked job's end and runs the job function then."""

    def __init__(self, workers, clock, seconds):
        self.workers, self.clock, self.seconds = workers, clock, seconds
        self.free = [0.0] * workers
        self.jobs = {}
        self.submitted = 0
        self.weights = None

    def set_weights(self, weights):
        self.weights = weights
        return weights["version"]

    def submit(self, fn, *args):
        job_id, self.submitted = self.submitted, self.submitted + 1
        slot = job_id % self.workers
        start = max(self.clock.now, self.free[slot])
        self.free[slot] = start + self.seconds(args[1])  # args: (version, group, ...)
        self.jobs[job_id] = (fn, self.weights, args, self.free[slot])
        return job_id

    def results(self, job_ids):
        self.clock.now = max([self.clock.now] + [self.jobs[j][3] for j in job_ids])
        out = []
        for j in job_ids:
            fn, weights, args, _ = self.jobs.pop(j)
            out.append(RolloutResult(j, fn(weights, *args), worker=j % self.workers,
                                     node="fake"))
        return out


def make_group(weights, version, group, prompt):
    """The fake job: which weights it saw, its group and prompt."""
    return {"weights_version": weights["version"], "group": group, "prompt": prompt}


def make_job(weights, version, first, prompts):
    """The fake job of ``len(prompts)`` groups (``groups_per_job``): one group per prompt."""
    return [make_group(weights, version, first + k, prompt) for k, prompt in enumerate(prompts)]


def train(steps, *, k, p=2, workers=2, learn_seconds=1.0, gen_seconds=lambda g: 1.0,
          sync_every=1, first=(0, 0), clock=None, in_flight=None, run_steps=None, per_job=1):
    """A learner loop on the fake pool: per step take P groups, learn for ``learn_seconds``,
    sync every ``sync_every`` steps, until ``steps`` more steps (of a run of ``run_steps``,
    by default the steps done before and these); ``per_job`` groups per job (a job's fake
    seconds: ``gen_seconds`` of its first group). Returns the groups, the per-step counters
    and the generator."""
    clock = clock or FakeClock()
    pool = FakePool(workers, clock, gen_seconds)
    gate = StalenessGate(k, p, first_group=first[0], first_version=first[1])
    args_of = lambda g: ([1000 + g + i for i in range(per_job)],)  # noqa: E731
    gen = PacedGeneration(pool, make_job, gate, args_of, clock=clock, in_flight=in_flight,
                          total_groups=(run_steps or first[1] + steps) * p,
                          groups_per_job=per_job)
    version = first[1]
    gen.sync({"version": version}, version)
    groups, counters = [], []
    for _ in range(steps):
        groups += gen.next_groups(p)
        clock.now += learn_seconds
        version += 1
        if version % sync_every == 0:
            gen.sync({"version": version}, version)
        counters.append(gen.counters())
    return groups, counters, gen


def check_groups(groups, k, first=0):
    assert [g.index for g in groups] == list(range(first, first + len(groups)))  # once, in order
    for g in groups:
        assert g.data["group"] == g.index and g.data["prompt"] == 1000 + g.index
        assert g.data["weights_version"] == g.version  # the job ran on the weights recorded
        assert 0 <= g.staleness <= k


@pytest.mark.parametrize("k", [0, 1, 2])
def test_slow_learner_paces_generation_within_the_bound(k):
    """Workers 10x faster than the learner: without a bound they would run ever further
    ahead; with it they wait for new weights, and the groups are exactly K versions stale."""
    groups, counters, _ = train(12, k=k, learn_seconds=10.0, gen_seconds=lambda g: 1.0,
                                in_flight=16)
    check_groups(groups, k)
    assert max(g.staleness for g in groups) == k  # the bound is reached, never passed
    assert all(g.staleness == k for g in groups[(k + 1) * 2:])
    later = counters[k + 1:-(k + 2)]  # the last K + 1 steps have every group started
    assert all(c["paced"] == 1 and c["generation_wait_seconds"] > 0 for c in later)
    # K >= 1: the groups were ready; K = 0 is the synchronous loop (the learner waits for
    # each step's generation, 1 s, and the workers for each update)
    assert all(c["learner_wait_seconds"] == (1.0 if k == 0 else 0.0) for c in later)
    assert all(c["staleness_max"] == k and c["staleness_mean"] == k for c in later)


def test_without_the_bound_a_slow_learner_gets_ever_staler_groups():
    """The contrast: a bound as large as the run lets staleness grow with the run."""
    groups, _, _ = train(12, k=100, learn_seconds=10.0, in_flight=24)
    assert max(g.staleness for g in groups) == 11


@pytest.mark.parametrize("k", [0, 2])
def test_slow_worker_makes_the_learner_wait_within_the_bound(k):
    """One group (every third) takes 25 s on its worker: the learner waits for it in order
    (it is never overtaken by later, faster groups) and nothing is paced."""
    groups, counters, _ = train(9, k=k, learn_seconds=1.0,
                                gen_seconds=lambda g: 25.0 if g % 3 == 0 else 1.0)
    check_groups(groups, k)
    assert sum(c["learner_wait_seconds"] for c in counters) > 50
    assert all(c["staleness_max"] <= k for c in counters)


def test_sync_every_is_bounded_by_the_staleness_and_the_error_says_so():
    """Weights synced every 3 steps with K = 1: the learner's 3rd step would need a group 2
    versions staler than its weights; the generator refuses, naming the fix."""
    with pytest.raises(RuntimeError, match="sync newer weights"):
        train(6, k=1, sync_every=3)
    groups, _, _ = train(6, k=2, sync_every=3, learn_seconds=10.0, in_flight=16)
    check_groups(groups, 2)


def test_resume_regenerates_the_groups_in_flight_none_skipped_or_twice():
    """A learner 'killed' after 4 steps with groups in flight: a new generator from the
    checkpoint (groups consumed, version) asks the same groups again, with the same
    arguments; the run's groups are each consumed once."""
    first, _, gen = train(4, k=2, learn_seconds=10.0, in_flight=16, run_steps=7)
    assert gen.pending  # groups generated or in flight when the learner died
    rest, _, _ = train(3, k=2, learn_seconds=10.0, in_flight=16, first=(8, 4))
    check_groups(first + rest, 2)
    assert rest[0].index == gen.pending[0] == 8


@pytest.mark.parametrize("kwargs, message", [
    ({"max_staleness": -1, "groups_per_step": 1}, "max_staleness: expected an integer >= 0"),
    ({"max_staleness": 1, "groups_per_step": 0}, "groups_per_step: expected an integer >= 1"),
    ({"max_staleness": 1.5, "groups_per_step": 1}, "max_staleness: expected an integer"),
])
def test_bad_gate_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StalenessGate(**kwargs)


def test_gate_rule_and_broken_staleness_is_refused():
    gate = StalenessGate(1, 2, first_group=4, first_version=2)
    assert [gate.start(2) for _ in range(5)] == [4, 5, 6, 7, None]  # 8 is used at version 4
    assert gate.staleness(7, 2) == 1
    with pytest.raises(RuntimeError, match="staleness 2 outside"):
        gate.staleness(7, 1)
    gen = PacedGeneration(FakePool(1, FakeClock(), lambda g: 1.0), make_job,
                          StalenessGate(1, 2), lambda g: ([g],), in_flight=2)
    gen.sync({"version": 0}, 0)
    with pytest.raises(ValueError, match=r"n: expected at most in_flight \(2\) groups, got 3"):
        gen.next_groups(3)
    with pytest.raises(RuntimeError, match=r"sync\(weights, version\)"):
        PacedGeneration(FakePool(1, FakeClock(), lambda g: 1.0), make_job, gate,
                        lambda g: ([g],)).fill()


# ----- several groups per job (``groups_per_job`` J, a divisor of P) -----


@pytest.mark.parametrize("k", [0, 1, 2])
@pytest.mark.parametrize("per_job", [2, 4])
def test_jobs_of_several_groups_keep_the_bound_under_a_slow_learner(k, per_job):
    """P = 4, J = 2 or 4: workers 10x faster than the learner are paced, every group is
    exactly K versions stale once the bound is reached, never more, and each group has the
    version it has with one group per job (the bound is the same rule, per step)."""
    run = dict(k=k, p=4, learn_seconds=10.0, in_flight=16)
    groups, counters, _ = train(10, per_job=per_job, **run)
    check_groups(groups, k)
    assert max(g.staleness for g in groups) == k
    assert all(g.staleness == k for g in groups[(k + 1) * 4:])
    later = counters[k + 1:-(k + 2)]
    assert later and all(c["paced"] == 1 and c["generation_wait_seconds"] > 0 for c in later)
    singles, _, _ = train(10, per_job=1, **run)
    assert [(g.index, g.version) for g in groups] == [(g.index, g.version) for g in singles]


@pytest.mark.parametrize("k", [0, 2])
def test_a_slow_job_of_several_groups_makes_the_learner_wait_within_the_bound(k):
    """P = 4, J = 2, every third job (its first group a multiple of 6) takes 25 s: the
    learner waits for it, in order, and the bound holds."""
    groups, counters, _ = train(9, k=k, p=4, per_job=2, learn_seconds=1.0,
                                gen_seconds=lambda g: 25.0 if g % 6 == 0 else 1.0)
    check_groups(groups, k)
    assert sum(c["learner_wait_seconds"] for c in counters) > 50
    assert all(c["staleness_max"] <= k for c in counters)
    assert [g.index for g in groups[:4]] == [0, 1, 2, 3]


def test_resume_with_jobs_of_several_groups_regenerates_the_jobs_in_flight():
    """J = 2: the groups in flight at the 'kill' are whole jobs, asked again from the
    checkpoint's position; every group of the run consumed once."""
    first, _, gen = train(4, k=2, p=4, per_job=2, learn_seconds=10.0, in_flight=16,
                          run_steps=7)
    assert gen.pending and len(gen.pending) % 2 == 0 and gen.pending[0] == 16
    rest, _, _ = train(3, k=2, p=4, per_job=2, learn_seconds=10.0, in_flight=16,
                       first=(16, 4))
    check_groups(first + rest, 2)


def test_several_groups_per_job_bad_arguments_are_named():
    clock = FakeClock()
    pool = FakePool(1, clock, lambda g: 1.0)
    with pytest.raises(ValueError, match=r"groups_per_job: expected a divisor of the gate's "
                                         r"groups_per_step \(4\), got 3"):
        PacedGeneration(pool, make_job, StalenessGate(1, 4), lambda g: (), groups_per_job=3)
    with pytest.raises(ValueError, match=r"in_flight: expected at least groups_per_job \(4\)"):
        PacedGeneration(pool, make_job, StalenessGate(1, 4), lambda g: (), groups_per_job=4,
                        in_flight=3)
    with pytest.raises(ValueError, match=r"total_groups: expected first_group \(0\) plus a "
                                         r"multiple of groups_per_job \(2\), got 7"):
        PacedGeneration(pool, make_job, StalenessGate(1, 4), lambda g: (), groups_per_job=2,
                        total_groups=7)
    gen = PacedGeneration(pool, make_job, StalenessGate(1, 4), lambda g: ([g, g + 1],),
                          groups_per_job=2, in_flight=8)
    gen.sync({"version": 0}, 0)
    with pytest.raises(ValueError, match=r"n: expected a multiple of groups_per_job \(2\), "
                                         r"got 3"):
        gen.next_groups(3)
    with pytest.raises(ValueError, match="count: expected an integer >= 1"):
        StalenessGate(1, 4).start(0, 0)
    short = PacedGeneration(pool, make_group, StalenessGate(1, 4), lambda g: (g,),
                            groups_per_job=2, in_flight=8)  # returns one group, not a list
    short.sync({"version": 0}, 0)
    with pytest.raises(RuntimeError, match=r"job \d+ \(groups 0..1\): expected a list of 2 "
                                           r"groups back, got dict of 1"):
        short.next_groups(2)
    bare = PacedGeneration(pool, make_group, StalenessGate(1, 4), lambda g: (g,),
                           in_flight=8)  # one group per job, returned bare: not a list
    bare.sync({"version": 0}, 0)
    with pytest.raises(RuntimeError, match=r"job \d+ \(groups 0..0\): expected a list of 1 "
                                           r"groups back, got dict of 1"):
        bare.next_groups(1)


def test_gate_admits_a_job_only_when_its_last_group_is_admitted():
    gate = StalenessGate(0, 4, first_group=8, first_version=2)
    assert gate.admits(2, 4) and not gate.admits(1, 4)
    assert gate.start(2, 4) == 8 and gate.next_group == 12
    assert gate.start(2, 2) is None and gate.next_group == 12  # consumed at version 3
    straddling = StalenessGate(0, 4, first_group=0)
    straddling.start(0, 3)
    assert not straddling.admits(0, 2)  # groups 3 and 4: 4 is consumed at version 1


@pytest.mark.parametrize("k", [0, 1])
def test_two_workers_lose_nothing_with_half_a_step_per_job_and_idle_with_a_whole_step(k):
    """Why auto picks J = P / N: two workers, P = 4, a job costing 2 s per group (no gain from
    batching assumed): jobs of 2 groups end the run at the same fake time as jobs of 1 (both
    workers on the next step), jobs of 4 later (the bound admits only K steps ahead of the one
    trained, so with K <= 1 one worker idles)."""
    end = {}
    for j in (1, 2, 4):
        clock = FakeClock()
        groups, _, _ = train(12, k=k, p=4, workers=2, per_job=j, learn_seconds=1.0,
                             gen_seconds=lambda first, j=j: 2.0 * j, clock=clock,
                             in_flight=max(4, 4 * j))
        check_groups(groups, k)
        end[j] = clock.now
    assert end[2] == end[1] < end[4]
