"""Throughput benchmarks behind ``diff-transformer bench``: they print figures, they assert nothing.

- :mod:`.attention`: every attention backend at matched parameters (time, TFLOP/s, peak memory).
- :mod:`.model`: training, prefill and decode tokens/s of DIFF vs Transformer (paper Table 7),
  and of transformers' DiffLlama of the same shape.
"""
