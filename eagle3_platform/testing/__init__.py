"""Test doubles and synthetic data, kept out of the production import path: no module outside this
subpackage imports it (tests/test_layering.py enforces that). Tests and the benchmark scripts use it.

spec.py       a tiny target with varied greedy output, a randomly initialised EAGLE-3 draft
oracle.py     a drafter that proposes from a known continuation (verify-machinery ceiling)
serve.py      a fake engine for the embedded server (`python -m eagle3_platform.testing.serve`), a random export
synthetic.py  synthetic feature shards (random, or real target features of random token ids)
"""
