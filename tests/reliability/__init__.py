"""Reliability: bad data, bad model output and fuzzed parsers.

- `test_bad_data`: empty data sets, missing and mistyped fields, lines that are not UTF-8 or not
  usable JSON, over-long prompts (skipped and counted), duplicate uids.
- `test_bad_outputs`: completions with no answer, huge completions, token ids that decode to
  invalid UTF-8, malformed tool calls: each scores 0 with a reason.
- `test_fuzz_parsers`: hypothesis and byte-level mutations against answer extraction, math
  grading, tool-call parsing, GGUF and safetensors reading.

Every hypothesis test has a bounded example count and `derandomize=True`, so a run tries the same
inputs each time and the counts in the module docstrings stay true.
"""
