"""The overlapped step's contract (`LLMEngine.step`; walkthrough chapter 11; the course's
`overlap` unit): step n+1 is launched before step n is read and committed, a `Drain` commits the
step in flight before scheduling again, nothing launched is lost or committed twice, and on a
real engine the overlapped step commits exactly the tokens of the synchronous one (on the CPU
too, where the engine itself steps synchronously)."""
from contextlib import contextmanager

from nanodspark import LLM, SamplingParams
from nanodspark.engine import LLMEngine, PhaseClock
from nanodspark.scheduler import Drain

from test_engine import check_no_leak, prompts
from test_verify import make_drafter


class Handle:
    def __init__(self, eng, n):
        self.eng, self.n, self.read = eng, n, False

    def result(self):
        assert not self.read, "a step's result is read once"
        self.read = True
        self.eng.log.append(f"result {self.n}")
        return self.n


class FakeScheduler:
    def __init__(self, eng):
        self.eng = eng

    def schedule(self, decode_rows):
        eng, n = self.eng, self.eng.scheduled
        if n in eng.drain_at:
            eng.drain_at.discard(n)
            eng.log.append(f"drain {n}")
            raise Drain("req")
        eng.scheduled += 1
        eng.log.append(f"schedule {n}")
        return [n] if n < eng.plans else []


class FakeEngine:
    """`LLMEngine.step` and `schedule` on a stand-in: plans are step numbers; `plans` says how many
    steps have work; `drain_at` makes one schedule call raise Drain (a preemption while a step is
    in flight). Outputs are plain lists."""
    step, schedule, phase = LLMEngine.step, LLMEngine.schedule, LLMEngine.phase
    decode_rows = 1

    def __init__(self, plans, drain_at=(), overlap=True):
        self.plans, self.drain_at, self.log, self.clock = plans, set(drain_at), [], PhaseClock()
        self.scheduler, self.overlap, self.in_flight = FakeScheduler(self), overlap, None
        self.scheduled = self.launched = 0
        self.committed = []

    def launch(self, plan):
        self.log.append(f"launch {plan[0]}")
        self.launched += 1
        return Handle(self, plan[0])

    def commit(self, result, out):
        self.log.append(f"commit {result}")
        self.committed.append(result)
        out.add(f"out {result}")


def run(eng, calls):
    outs = []
    for _ in range(calls):
        outs += list(eng.step())
    return outs


def test_the_step_launches_the_next_one_before_it_commits_this_one():
    eng = FakeEngine(plans=3)
    assert list(eng.step()) == [] and eng.log == ["schedule 0", "launch 0"]       # nothing to commit yet
    assert eng.in_flight is not None and eng.clock.steps == 1
    assert list(eng.step()) == ["out 0"]
    assert eng.log[2:] == ["schedule 1", "launch 1", "result 0", "commit 0"]      # n+1 launched, then n read
    outs = run(eng, 3)
    assert outs == ["out 1", "out 2"] and eng.committed == [0, 1, 2] and eng.in_flight is None
    assert eng.log[6:] == ["schedule 2", "launch 2", "result 1", "commit 1", "schedule 3", "result 2", "commit 2",
                           "schedule 4"]
    assert eng.clock.steps == 3 and eng.launched == 3
    assert {"schedule", "launch", "result", "commit"} <= set(eng.clock.total)


def test_the_synchronous_step_reads_what_it_launched():
    eng = FakeEngine(plans=2, overlap=False)
    assert list(eng.step()) == ["out 0"] and eng.log == ["schedule 0", "launch 0", "result 0", "commit 0"]
    assert run(eng, 2) == ["out 1"] and eng.in_flight is None


def test_a_drain_commits_the_step_in_flight_before_scheduling_again():
    eng = FakeEngine(plans=3, drain_at=[2])
    assert run(eng, 2) == ["out 0"]
    assert list(eng.step()) == ["out 1"]                 # schedule(2) drained: step 1 committed first
    assert eng.log[-5:] == ["drain 2", "result 1", "commit 1", "schedule 2", "launch 2"]
    assert run(eng, 2) == ["out 2"] and eng.committed == [0, 1, 2]


def test_every_launched_step_is_committed_once_in_order():
    for plans in (0, 1, 5):
        for drains in ((), (1,), (1, 3, 4)):
            eng = FakeEngine(plans, drain_at=drains)
            outs = run(eng, plans + len(drains) + 2)
            assert eng.committed == list(range(plans)) == [int(o.split()[1]) for o in outs]
            assert eng.in_flight is None and eng.launched == plans


def test_the_overlapped_loop_commits_what_the_synchronous_one_does(tiny_dir, tmp_path):
    """A real engine, stepped by OverlapLoop on the CPU: the same tokens as SyncLoop, with a pool
    small enough to preempt (a Drain) and requests finishing in the step after the one in flight."""
    dr = make_drafter(tiny_dir, tmp_path / "drafter", gamma=4)
    ps = prompts(6, 8192, seed=4, lo=5, hi=40)
    params = [SamplingParams(temperature=1.0 if i % 2 else 0.0, seed=i, max_tokens=5 + 4 * i, ignore_eos=True)
              for i in range(6)]
    outs = []
    for overlap in (False, True):
        llm = LLM(str(tiny_dir), use_tqdm=False, drafter_path=str(dr), block_size=4, num_kv_blocks=30)
        eng = llm.engine
        eng.overlap = overlap
        preempted = []
        orig = eng.scheduler.preempt
        eng.scheduler.preempt = lambda r, o=orig: (preempted.append(r.request_id), o(r))
        got = [o.token_ids for o in llm.generate(ps, params)]
        assert [len(t) for t in got] == [p.max_tokens for p in params]
        outs.append(got)
        assert preempted, "the pool should be small enough to preempt"
        assert eng.in_flight is None
        check_no_leak(llm)
    assert outs[0] == outs[1]


def test_a_poisoned_speculative_request_fails_alone_in_the_overlapped_loop(tiny_dir, tmp_path):
    """Step n+1 is launched before step n shows that a request's logits are NaN, so n+1 carries
    the failed request's NaN confidences: observers (calibration, the cost scheduler's relay,
    the ceiling) must not see them. Crashed the calibration observer with an IndexError."""
    import torch
    dr = make_drafter(tiny_dir, tmp_path / "drafter", gamma=4)
    good = [p for p in prompts(4, 8192, seed=21, lo=5, hi=30) if 7 not in p]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = [o.token_ids for o in LLM(str(tiny_dir), use_tqdm=False, drafter_path=str(dr)).generate(good, greedy)]
    llm = LLM(str(tiny_dir), use_tqdm=False, drafter_path=str(dr))
    eng = llm.engine
    eng.overlap = True
    with torch.no_grad():
        eng.model.model.embed_tokens.weight[7] = float("nan")
    reqs = [eng.add_request(p, greedy) for p in good]
    poisoned = eng.add_request([3, 4, 7, 5], greedy)
    while eng.has_unfinished():
        eng.step()
    assert poisoned.finish_reason == "error" and [r.output_ids for r in reqs] == want
    assert not eng.metrics.pending.any() and eng.metrics.summary() and eng.metrics.online.count.sum() > 0
    check_no_leak(llm)


def test_eplb_closes_one_step_per_window_row_in_the_overlapped_loop(tiny_dir):
    """EPLB's recorder closes a step when it is launched: with step n+1 launched before step n is
    committed, each window row still holds exactly one step's (token, expert) pairs. (Closed at
    commit, the first row held two steps and the last none.)"""
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    rows = []
    for overlap in (False, True):
        llm = LLM(str(tiny_dir), use_tqdm=False, eplb=True, eplb_interval=0, eplb_window=64)
        eng = llm.engine
        eng.overlap = overlap
        llm.generate([[5, 6, 7, 8, 9]], greedy)       # a 5-token prefill, then 3 one-token decodes
        per_step = eng.eplb.recorder.per_step()[:, 0].sum(-1)        # pairs per step, first MoE layer
        rows.append(per_step.tolist())
    top_k, sync, overlapped = 2, rows[0], rows[1]
    assert sync == [5 * top_k] + [top_k] * 3
    # the overlapped loop may launch one more step before it learns the request is done: inert rows
    assert overlapped[:len(sync)] == sync and not any(overlapped[len(sync):])


def test_a_stream_leaves_the_overlapped_engine_idle(tiny_dir):
    """`LLM.stream` run to its end, or closed after its first output (an abort), commits the
    step still in flight: the engine has nothing unfinished, and nothing leaks."""
    llm = LLM(str(tiny_dir), use_tqdm=False)
    eng = llm.engine
    eng.overlap = True
    p = prompts(1, 8192, seed=11)[0]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    assert [t for o in llm.stream(p, greedy) for t in o.new_token_ids] == llm.generate([p], greedy)[0].token_ids
    assert not eng.has_unfinished()
    it = llm.stream(p, greedy)
    next(it)
    it.close()
    assert not eng.has_unfinished() and eng.in_flight is None
    check_no_leak(llm)
