"""Terminal task environments: the task format, grading, the procedural generator and sandbox backends."""

from __future__ import annotations

from asyncres_jax.envs.sandbox import Backend, CommandResult, Grade, Sandbox, clean_output
from asyncres_jax.envs.task import Task, load_dataset, load_split, load_task
from asyncres_jax.errors import UserError

BACKENDS = ("bwrap", "docker")


def make_backend(name: str, **kwargs) -> Backend:
    """A sandbox backend by name: `bwrap` (daemonless, the default) or `docker` (any Docker-API engine)."""
    if name == "bwrap":
        from asyncres_jax.envs.bwrap import BwrapBackend, BwrapConfig

        return BwrapBackend(BwrapConfig(**kwargs))
    if name == "docker":
        from asyncres_jax.envs.docker_backend import DockerBackend

        return DockerBackend(**kwargs)
    raise UserError(f"unknown sandbox backend {name!r}; choose one of: {', '.join(BACKENDS)}")


__all__ = ["Backend", "CommandResult", "Grade", "Sandbox", "Task", "clean_output", "load_dataset", "load_split",
           "load_task", "make_backend", "BACKENDS"]
