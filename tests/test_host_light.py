"""The host-light step: the host's work per decode step does not grow with the batch.

At batch 256 the engine once spent ~36 µs of Python per request per step (schedule, launch,
result, commit), more than a small model's GPU step: then nothing speculative can pay at load.
The running batch's arrays (batch.py) make that work a few array operations for the whole
batch, plus Python for the requests something happens to. Timed with the engine's own phase
clock (`bench host`: the forward itself is subtracted), as a ratio of medians, not a time. On the
CPU everywhere: on a GPU the result phase would hold the device's step, which does grow."""
import torch

from nanodspark import LLM
from nanodspark.lab.bench_host import PHASES, time_phases
from nanodspark.lab.bench_speed import _prompts

from test_verify import make_drafter


def engine(model, drafter, batch: int):
    llm = LLM(str(model), drafter_path=str(drafter), max_num_seqs=batch, use_tqdm=False, device="cpu",
              max_num_batched_tokens=max(2048, batch * 16), cpu_kv_blocks=16 * batch)
    return llm, _prompts(batch, 24, llm.engine.model_config.vocab_size)


def test_host_work_per_step_at_256_is_at_most_1_5x_that_at_64(tiny_dir, tmp_path):
    """A plausible bug this catches: Python per request per step creeping back into a phase.
    The two batch sizes alternate, five rounds, and each keeps its least disturbed round: a
    neighbour's burst of CPU then cannot land on one size only. One torch thread while timing:
    the phases are host work, and a second intra-op thread only contends with the test running
    beside this one (on 2 cores that contention alone took the ratio from 1.36 to 1.57)."""
    drafter = make_drafter(tiny_dir, tmp_path / "d")
    engines = {b: engine(tiny_dir, drafter, b) for b in (64, 256)}
    ms = {b: [] for b in engines}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(5):
            for b, (llm, prompts) in engines.items():
                r = time_phases(llm, prompts, 6, [], stream_text=False)
                ms[b].append(sum(r[k] for k in PHASES))
    finally:
        torch.set_num_threads(threads)
    at_64, at_256 = min(ms[64]), min(ms[256])
    assert at_256 <= 1.5 * at_64, (ms[64], ms[256])


def test_a_steps_state_writes_travel_in_one_copy_and_land_field_by_field():
    """`DeviceState.apply` packs every write of a step (parameters, anchors, the entries of every
    group's tables) into one copy, through two staging buffers used in turn. Plausible bugs: a
    field read from the wrong column, a seed or a temperature mangled by the packing (all 64 bits
    of a seed; a float through its bits), one group's entries landing in another's table, the
    buffer of the step before overwritten by the next (on a GPU its copy may still be queued),
    a write too large for the buffer."""
    import numpy as np

    from nanodspark.device_state import DeviceState, StateWrites

    st = DeviceState(4, ["full", "draft"], 8, "cpu")
    sends = []
    real = st._send
    st._send = lambda a: sends.append(a.copy()) or real(a)
    st.draft_start[:] = 7
    w = StateWrites()
    w.params += [(1, 300, 16, 40, -2**63, 0.7, 0.95), (3, 90, 0, 0, 2**63 - 1, 0.0, 1.0)]
    w.anchors.append((2, 17, 12345))
    w.tables["full"] = [(1, 0, 5), (1, 1, 6)]
    w.tables["draft"] = [(1, 0, 9), (3, 2, 4)]
    st.apply(w)
    assert len(sends) == 1 and not (w.params or w.anchors or w.tables)
    assert st.limit_len.tolist()[1::2] == [300, 90] and st.kv_start.tolist()[1::2] == [16, 0]
    assert st.top_k.tolist()[1::2] == [40, 0] and st.seed.tolist()[1::2] == [-2**63, 2**63 - 1]
    assert st.temperature[1].item() == torch.tensor(0.7).item() and st.top_p[3].item() == 1.0
    assert st.draft_start.tolist() == [7, 0, 7, 0, 7]              # admitted slots start at 0
    assert (st.seq_len[2].item(), st.last_token[2].item()) == (17, 12345)
    assert st.tables["full"][1, :2].tolist() == [5, 6] and st.tables["full"][3].tolist() == [-1] * 8
    assert st.tables["draft"][1, :2].tolist() == [9, -1] and st.tables["draft"][3, 2].item() == 4
    w.tables["draft"] = [(0, c, 100 + c) for c in range(8)] * 40        # 1,280 values: the buffers grow
    st.apply(w)
    assert st.tables["draft"][0].tolist() == [100 + c for c in range(8)]
    assert st._hosts[0].numel() >= 1280 and st.tables["full"][0].tolist() == [-1] * 8
    w.anchors.append((0, 3, 4))
    st.apply(w)
    w.anchors.append((0, 5, 6))
    st.apply(w)                                   # a write in each turn: the other turn's buffer is kept
    assert np.array_equal(st._hosts[st._turn ^ 1][:3].numpy(), [0, 3, 4]) and st.seq_len[0].item() == 5
    st.apply(StateWrites())                       # nothing to write: no copy
    assert len(sends) == 4
