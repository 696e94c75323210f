"""Data generators for the bundled demo models (scenes, videos, speech, the copy task), the tokenizer and
processor files their checkpoints ship, and the example assets. The benchmarks and tests use them; the training
and evaluation scripts live outside the package, in the repository's `demo/`."""
