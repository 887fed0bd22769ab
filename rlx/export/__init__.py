"""``python -m rlx.export --run DIR [--step N] --to hf|peft|merged|quantized|gguf-lora OUT``: a
run's checkpoint written for serving or for other tools, streamed weight by weight, with a
progress bar. The command line only; the work is ``rlx.run.exporting`` (which writes through
``rlx.io.export``).

May import ``rlx.commandline`` (the command line), ``rlx.run`` and the foundation
(``rlx.types``, ``rlx.errors``, ``rlx.mesh``).
"""
