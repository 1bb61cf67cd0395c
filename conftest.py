"""pytest options for test_grpo_colocate.py: tests marked slow run only with --slow (`bash run.sh test --slow`)."""
import pytest


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", help="also run the tests marked slow (8 ranks on the CPU)")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: minutes of CPU (8 ranks); skipped unless pytest runs with --slow")


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--slow"):
        skip = pytest.mark.skip(reason="slow: run with `bash run.sh test --slow`")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip)
