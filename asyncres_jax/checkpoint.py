"""Orbax checkpoints of the whole training state: arrays (sharded) plus a JSON record, written atomically.

A checkpoint step is a folder RUN_DIR/checkpoints/<step> with two Orbax items:
  arrays  flat {"params/layers/0/attn/q_proj/kernel": array, "opt/3": array, ...}, restored straight into
          the shardings of a template (so a run may resume on another mesh)
  meta    JSON: version, the coordinator's counters and accepted-but-uncommitted results, the update log,
          data cursor, metrics step, fingerprints of the config and of the leaf layout
Orbax writes into a temporary folder and renames it when complete, so a crash mid-save leaves no step behind.
A step that exists but cannot be read (corrupt, truncated, hand-edited) is reported, moved aside to
`corrupt-<step>` (so the resumed run can write that step again) and the previous one is used.
"""

from __future__ import annotations

import dataclasses
import logging
import pathlib
import sys
from typing import Any, Callable

import jax
import numpy as np
import orbax.checkpoint as ocp

from asyncres_jax.es.noise import path_string

# Orbax logs every save at INFO through absl; the training program reports checkpoints itself.
logging.getLogger("absl").setLevel(logging.WARNING)


def flatten(tree, prefix: str) -> dict[str, Any]:
    """A pytree -> {"prefix/leaf/path": leaf}; None leaves (absent subtrees) are skipped by jax.tree."""
    return {f"{prefix}/{path_string(kp)}": x for kp, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def unflatten_like(template, flat: dict[str, Any], prefix: str):
    """The inverse of flatten, onto the structure of `template`."""
    paths = [f"{prefix}/{path_string(kp)}" for kp, _ in jax.tree_util.tree_flatten_with_path(template)[0]]
    missing = [p for p in paths if p not in flat]
    if missing:
        raise KeyError(f"checkpoint lacks {missing[:3]}")
    return jax.tree.unflatten(jax.tree.structure(template), [flat[p] for p in paths])


def abstract(flat: dict[str, Any]) -> dict[str, jax.ShapeDtypeStruct]:
    """Shape, dtype and sharding of each array: what restore fills (in that sharding)."""
    def one(x):
        sharding = x.sharding if isinstance(x, jax.Array) else None
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sharding)
    return {k: one(x) for k, x in flat.items()}


@dataclasses.dataclass(frozen=True)
class Restored:
    step: int
    arrays: dict[str, jax.Array]
    meta: dict


class Checkpointer:
    """Save/restore numbered steps under `directory`, keeping the last `keep`."""

    def __init__(self, directory: str | pathlib.Path, keep: int, report: Callable[[str], None] | None = None):
        self.directory = pathlib.Path(directory).absolute()
        self.report = report or (lambda msg: print(msg, file=sys.stderr, flush=True))
        options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=False)
        self._manager = ocp.CheckpointManager(self.directory, options=options, item_names=("arrays", "meta"))

    def steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def save(self, step: int, arrays: dict[str, Any], meta: dict) -> None:
        args = ocp.args.Composite(arrays=ocp.args.StandardSave(arrays), meta=ocp.args.JsonSave(meta))
        self._manager.save(step, args=args, force=True)
        self._manager.wait_until_finished()

    def same_run(self, config_fingerprint: str, layout: str, model_name: str) -> Callable[[dict], None]:
        """A `check` for restore_latest: the checkpoint must come from this config and this parameter layout."""
        from asyncres_jax.errors import UserError

        def check(meta: dict) -> None:
            if meta.get("config_fingerprint") != config_fingerprint:
                raise UserError(f"{self.directory} holds checkpoints of a different config; "
                                "use another run_dir= or --overwrite")
            if meta.get("layout") != layout:
                raise UserError(f"{self.directory}: checkpoint parameters do not match the model "
                                f"{model_name!r} (layout {meta.get('layout')} vs {layout})")

        return check

    def restore_latest(self, template: dict[str, Any], check: Callable[[dict], None] = lambda meta: None,
                       steps: list[int] | None = None) -> Restored | None:
        """The newest readable step (of `steps`, default all) with arrays placed like `template`'s, or None.

        `check(meta)` may raise UserError (a checkpoint of another run): that is not corruption and propagates.
        """
        target = abstract(template)
        for step in reversed(sorted(self.steps() if steps is None else steps)):
            try:
                meta = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
                check(meta)
                arrays = self._manager.restore(step, args=ocp.args.Composite(
                    arrays=ocp.args.StandardRestore(target))).arrays
                return Restored(step, dict(arrays), meta)
            except Exception as e:  # any unreadable step is set aside; UserError is re-raised
                from asyncres_jax.errors import UserError

                if isinstance(e, UserError):
                    raise
                aside = self.directory / f"corrupt-{step}"
                n = 1
                while aside.exists():
                    aside, n = self.directory / f"corrupt-{step}.{n}", n + 1
                self.report(f"checkpoint {self.directory / str(step)} is unreadable "
                            f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}); "
                            f"moved to {aside.name}, trying the previous one")
                (self.directory / str(step)).rename(aside)
                self._manager.reload()
        return None

    def close(self) -> None:
        self._manager.close()
