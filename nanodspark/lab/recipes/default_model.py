"""The recipe of the embedded default model, one command per step:

    python -m nanodspark.lab.recipes.default_model corpus    --out build/corpus      # CPU, ~3 min, needs pip/apt
    python -m nanodspark.lab.recipes.default_model tokenizer --corpus build/corpus   # CPU, ~1 min
    python -m nanodspark.lab.recipes.default_model train     --corpus .carry/corpus --out OUT   # GPU, ~4 min

and one optional step, not used by the shipped target (walkthrough 04 §5b):

    python -m nanodspark.lab.recipes.default_model distill   --corpus build/corpus   # a teacher's answers

Each step is its own module (corpus.py, tokenizer.py, distill.py, train_target.py); this file only
dispatches, so `--help` after a step name shows that step's options.
"""
import sys


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    steps = {"corpus": "corpus", "tokenizer": "tokenizer", "distill": "distill", "train": "train_target"}
    if not argv or argv[0] not in steps:
        raise SystemExit(__doc__)
    import runpy
    sys.argv = [f"nanodspark.lab.recipes.{steps[argv[0]]}"] + argv[1:]
    runpy.run_module(f"nanodspark.lab.recipes.{steps[argv[0]]}", run_name="__main__")


if __name__ == "__main__":
    main()
