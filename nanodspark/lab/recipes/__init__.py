"""Recipes that build the embedded default model's data: the corpus and the tokenizer.

    python -m nanodspark.lab.recipes.corpus --out build/corpus
    python -m nanodspark.lab.recipes.tokenizer --corpus build/corpus --out nanodspark/assets/default

See walkthrough/04_default_model.md.
"""
