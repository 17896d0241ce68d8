"""A package, so that its test_api.py and tests/serve/test_api.py can be collected in one run."""
