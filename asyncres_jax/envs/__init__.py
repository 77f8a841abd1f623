"""Terminal task environments: the task format, grading, the procedural generator and sandbox backends."""

from __future__ import annotations

from asyncres_jax.envs.sandbox import Backend, CommandResult, Grade, Sandbox, clean_output
from asyncres_jax.envs.task import Task, load_dataset, load_split, load_task
from asyncres_jax.errors import UserError

BACKENDS = ("bwrap", "docker")


def choose_backend(name: str) -> str:
    """`name`, or for "auto" what this machine has: bwrap where it isolates, else docker where a Docker-API
    engine answers; a one-line error naming both otherwise."""
    if name != "auto":
        return name
    from asyncres_jax.envs import bwrap
    from asyncres_jax.envs.docker_backend import engine_available

    problem = bwrap.host_problem()
    if problem is None:
        return "bwrap"
    if engine_available():
        return "docker"
    raise UserError(f"sandbox.backend=auto found no sandbox on this machine: bwrap cannot isolate here ({problem}) "
                    "and no Docker-API engine answers at $DOCKER_HOST (start Docker or podman's service)")


def make_backend(name: str, **kwargs) -> Backend:
    """A sandbox backend by name: `bwrap` (daemonless, the default), `docker` (any Docker-API engine) or `auto`."""
    name = choose_backend(name)
    if name == "bwrap":
        from asyncres_jax.envs.bwrap import BwrapBackend, BwrapConfig

        return BwrapBackend(BwrapConfig(**kwargs))
    if name == "docker":
        from asyncres_jax.envs.docker_backend import DockerBackend

        return DockerBackend(**kwargs)
    raise UserError(f"unknown sandbox backend {name!r}; choose one of: {', '.join(BACKENDS)}")


__all__ = ["Backend", "CommandResult", "Grade", "Sandbox", "Task", "clean_output", "load_dataset", "load_split",
           "load_task", "make_backend", "choose_backend", "BACKENDS"]
