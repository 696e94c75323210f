"""Training and evaluation scripts for the bundled demo models (demo-vl, its draft and LoRA adapter, demo-asr).

Run from the repository root (`python -m demo.train_vl ...`, or the Makefile's train-*/eval-* targets). They are
not part of the serving package: `tessera` never imports them. The data generators they train on (scenes,
speech, the copy task) and the tokenizer/processor builders stay in `tessera/demo/`, which the benchmarks and
tests use too."""
