"""Benchmarks and tools against the peers (llama.cpp, ik_llama.cpp) and of the pipeline.

A package: run each from the repository root as a module, `python -m bench.<name> --help`
(e.g. `python -m bench.bench_engine --model 1.5b-shape`). Scripts import the product and each other
as packages (`from bench.shapes import ...`, `from engine...`), never through sys.path, and take
their options with click, as the `rqllm` command does.
"""
