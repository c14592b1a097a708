"""Shared fixtures: offline demo assets and one Prefect test server per session."""

import os

import pytest

os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "90")


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory):
    from alignflow.demo import build

    return build(tmp_path_factory.mktemp("demo"))


@pytest.fixture
def base_overrides(demo_dir, tmp_path):
    """Point the config at the session's demo assets and a fresh store for this test."""
    return [f"paths.demo={demo_dir}", f"store.root={tmp_path / 'store'}", f"launcher.folder={tmp_path / 'jobs'}"]


@pytest.fixture(scope="session")
def prefect_server():
    """One Prefect API for the whole session: its start-up costs 10-16 s on 2 cores."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=90):
        yield
