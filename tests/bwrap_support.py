"""Shared by the bwrap test modules: a module-scoped backend that skips with the reason on a host without
bwrap or user namespaces, and fails instead when CI=true (CI must exercise the sandbox)."""

import os

import pytest

from asyncres_jax.envs import bwrap


def bwrap_or_skip() -> None:
    problem = bwrap.host_problem()
    if problem:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but the bwrap sandbox cannot run: {problem}")
        pytest.skip(problem)


@pytest.fixture(scope="module")
def backend():
    bwrap_or_skip()
    with bwrap.BwrapBackend() as b:
        yield b
