"""The bench scripts' smoke tests: ``pytest bench/tests`` (CI runs it after the product's suite, ``pytest tests``).

They use the suite's shared fixtures (the tiny dataset, made once per test run) and carry the ``bench`` marker, so
``-m bench`` picks them out of a run that names both folders.
"""
from tests.conftest import once, one_thread, pytest_xdist_auto_num_workers, tiny_data  # noqa: F401  (the suite's fixtures)
