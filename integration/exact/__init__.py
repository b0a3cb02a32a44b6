"""Elastic data parallelism with exact arithmetic (EasyScale's half of Spotline).

- :mod:`.reduction`: gradient reduction over logical workers, the same bits however they
  are grouped into processes.
- :mod:`.dp_engine`: DeepSpeed's plain data-parallel engine with that reduction.

Which logical workers a pipeline runs, and what each reads, is pure planning:
:mod:`spotline.plan.logical` and :mod:`spotline.plan.sampler`.
"""
