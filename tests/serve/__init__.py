"""A package, so that test modules here may share basenames with tests elsewhere (test_api, test_errors)."""
