"""Benchmarks, each a module with ``main(argv) -> int`` run by name: ``python -m rlx.bench NAME``."""
