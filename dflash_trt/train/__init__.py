"""Drafter training (arXiv 2602.06036 §4.2): target-regenerated data, a cached feature store, the trainer."""
