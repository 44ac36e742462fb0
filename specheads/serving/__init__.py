"""Serving an exported head in a real engine and measuring it there (``specheads serve-eval``).

``engine.py``: finds vLLM's python (``.venv-vllm``, ``vllm.python=``, ``vllm`` on PATH), checks an export before
the engine starts, runs ``engine_worker.py`` (vLLM's offline API, self-contained) in a process of its own;
``endpoint.py``: a server the user runs; ``counters.py``: the engine's Prometheus counters, differenced;
``serve_eval.py``: the decode loop, figures per domain, the comparison with the evaluator, the report.
"""
