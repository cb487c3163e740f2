"""The sections of ``benchmarks/bench.py`` (one module a section or two; the numbers as in
bench.py's docstring) and what they share (``common``, ``procs``)."""
