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
