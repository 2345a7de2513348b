"""The benchmarks' harness: what every ``scripts/bench_*.py`` shares, so that each holds only what it measures.

- :mod:`bench.timing`: one way to time (variants interleaved in a rotating order, medians; onnxruntime sessions
  on a set number of threads);
- :mod:`bench.results`: the machine a run measured on (the CPU's name and flags, the library versions) and the
  JSON writer ``scripts/render_docs.py`` reads the docs' tables from (``docs/results/``), one run per CPU;
- :mod:`bench.peers`: onnxruntime's own quantizers at their documented settings, and fidelity beside speed;
- :mod:`bench.models`: the model zoo the benchmarks and the demo build (torchvision-shaped CNNs, random weights);
- ``bench/peer_tfmot.py``: TensorFlow Model Optimization, run in a side environment of its own.

A benchmark is run from the repository root (``python scripts/bench_zoo.py``), which puts ``scripts/`` first on
``sys.path``; ``import bench`` then finds this package.
"""
