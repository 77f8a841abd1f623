"""Shared by the docker test modules: skip without a Docker-API engine, except under CI=true, where a missing
engine fails the test instead (CI must exercise the docker backend)."""

import os

import pytest

from asyncres_jax.envs import docker_backend as db


def require_engine() -> None:
    """Skip without an engine; under CI=true, fail instead (CI must exercise the docker backend)."""
    if db.engine_available():
        return
    where = os.environ.get("DOCKER_HOST", "the default socket")
    if os.environ.get("CI") == "true":
        pytest.fail(f"CI=true but no Docker-API engine answers at {where}: run `make system` and the tests "
                    "under scripts/with_services.sh", pytrace=False)
    pytest.skip(f"no Docker-API engine at {where} (run under scripts/with_services.sh to test the docker backend)")
