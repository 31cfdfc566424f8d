"""The speed suite (see run.py); not part of the tests."""
