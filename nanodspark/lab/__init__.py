"""The lab room: what measures and builds the engine rather than serves with it.

The idea
    The core (`nanodspark/*.py`) is what a request needs, from `LLM.generate` to the committed
    token. Everything else that the repository does with the engine lives here:

    bench.py, bench_engine.py, bench_profile.py   the benchmarks (`python -m nanodspark.bench`):
                                                   kernels, engine throughput, the step-cost
                                                   profile, the DSpark economics sweep
    profile_stats.py                               how a step-cost table is measured: rounds,
                                                   round-adjusted estimate, trend gate
    plots.py, figures.py                           the figures (matplotlib, the `lab` extra) and
                                                   every committed one redrawn from its data
    workloads.py                                   the named prompt sets (math, chat, poetry, code, mix)
    text_proxy.py                                  teacher-forced acceptance on held-out natural text
    recipes/                                       the default model: corpus, tokenizer, target
                                                   training, optional teacher distillation

Invariants
    * The core never imports this package (tests/test_layout.py checks it); this package
      imports the core freely.
    * Every command line here runs as `python -m nanodspark.lab.<module>` (the benchmarks also
      as `python -m nanodspark.bench`, the command the walkthrough and the result files record).

Walkthrough: chapters 04 (recipes, workloads), 06 §9 (text proxy), 07 §4 (profiling) and 09 (results).
"""
