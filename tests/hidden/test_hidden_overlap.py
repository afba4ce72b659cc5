"""Hidden tests of the `overlap` unit (run by `course grade`, never exported): random schedules
with drains, the overlapped step's calls and outputs against the order the contract fixes."""
import random

from test_overlap_loop import FakeEngine


def expected(plans, drains, calls):
    """The log and the outputs of each call: schedule n+1 (a drain first commits the step in
    flight, then schedules again), launch it if it has work, then read and commit step n."""
    drains, log, outs, pending, n = set(drains), [], [], None, 0
    for _ in range(calls):
        out = []
        if n in drains:
            drains.discard(n)
            log.append(f"drain {n}")
            if pending is not None:
                log += [f"result {pending}", f"commit {pending}"]
                out.append(f"out {pending}")
                pending = None
        log.append(f"schedule {n}")
        plan = n if n < plans else None
        n += 1
        if plan is not None:
            log.append(f"launch {plan}")
        if pending is not None:
            log += [f"result {pending}", f"commit {pending}"]
            out.append(f"out {pending}")
        pending = plan
        outs.append(out)
    return log, outs


def test_random_schedules_follow_the_overlapped_order():
    rng = random.Random(12)
    for _ in range(200):
        plans = rng.randint(0, 8)
        drains = sorted(rng.sample(range(plans + 2), rng.randint(0, min(3, plans + 2))))
        calls = plans + len(drains) + rng.randint(1, 3)
        eng = FakeEngine(plans, drain_at=drains)
        outs = [list(eng.step()) for _ in range(calls)]
        want_log, want_outs = expected(plans, drains, calls)
        assert eng.log == want_log and outs == want_outs, (plans, drains)
        assert eng.clock.steps == plans and eng.committed == list(range(plans)) and eng.in_flight is None
