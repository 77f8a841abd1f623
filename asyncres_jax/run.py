"""The run layer: what the ES trainer, the GRPO trainer and evaluation share.

A run directory (RUN_DIR) holds config.yaml (the resolved config), manifest.json (git revision, package
versions, mesh and devices of every session), metrics.jsonl and checkpoints/; one training process at a time
holds its lock. Here: preparing and locking it, the manifest, loading the policy model and the tasks, the
sandbox backend, SIGINT/SIGTERM handling, finding and restoring checkpoints, exporting one, and `Trainer`, the
base of both trainers (checkpoint, restore, metrics, elapsed time, stop request, close).
"""

from __future__ import annotations

import abc
import datetime as dt
import fcntl
import hashlib
import importlib.metadata
import json
import os
import pathlib
import platform
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np
from omegaconf import OmegaConf

from asyncres_jax import distributed, es, metrics
from asyncres_jax.checkpoint import Checkpointer, flatten, unflatten_like
from asyncres_jax.config import TrainConfig, load_config, to_yaml
from asyncres_jax.errors import UserError
from asyncres_jax.mesh import make_mesh
from asyncres_jax.model.sharding import param_shardings

CONFIG_FILE, MANIFEST_FILE, CHECKPOINTS, LOCK_FILE = "config.yaml", "manifest.json", "checkpoints", ".lock"
# Keys that may change between sessions of one run: where it runs, how long it goes on, and how many generations a
# batched population plays at once (the same episodes either way).
SESSION_KEYS = ("mesh", "run_dir", "es.updates", "grpo.steps", "pool.backend", "pool.ray_address", "pool.ray_actors",
                "pool.ray_cpus_per_actor", "pool.ray_gpus_per_actor", "eval.base_from", "es.streams_per_batch")
ADDED_KEYS = ("es.divide_by_sigma", "es.weight_decay", "es.adam_b1", "es.adam_b2", "es.adam_eps", "episode.reward_key",
              "episode.start_retries", "episode.system_prompt", "pool.pace_admission", "es.shaping_groups",
              "pool.held_back_tasks", "es.members_per_batch")
PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy", "transformers", "tokenizers",
            "safetensors", "omegaconf", "asyncres-jax")


def log(msg: str) -> None:
    if not distributed.is_main_process():  # one log per run, from process 0
        return
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def compilation_cache() -> None:
    """A persistent XLA cache (compiles dominate a short CPU run); JAX_COMPILATION_CACHE_DIR overrides it."""
    if jax.config.jax_compilation_cache_dir:
        return
    cache = pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache")) / "asyncres_jax" / "xla"
    jax.config.update("jax_compilation_cache_dir", str(cache))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


# ------------------------------------------------------------------------------------------- run directory


def identity(cfg: TrainConfig) -> dict:
    """The config minus SESSION_KEYS: a run directory belongs to exactly one identity."""
    d = OmegaConf.to_container(OmegaConf.structured(cfg))
    for key in SESSION_KEYS:
        *parents, last = key.split(".")
        node = d
        for p in parents:
            node = node[p]
        node.pop(last, None)
    return d


def fingerprint(cfg: TrainConfig) -> str:
    """A hash of the identity. Options the schema gained after runs were made count only when set: at their
    defaults they leave the fingerprint as it was, so the checkpoints of those runs still resume."""
    d, default = identity(cfg), identity(TrainConfig())
    for key in ADDED_KEYS:
        section, name = key.split(".")
        if d[section][name] == default[section][name]:
            del d[section][name]
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def _differences(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b)):
            out += _differences(a.get(k), b.get(k), f"{prefix}{k}.")
        return out
    return [] if a == b else [f"{prefix[:-1]} ({a!r} there, {b!r} here)"]


def prepare_run_dir(cfg: TrainConfig, resume: bool, overwrite: bool) -> bool:
    """Create RUN_DIR or check it belongs to this config, and lock it for this process (release_run_dir lets
    go). Returns True when an existing run continues."""
    run = pathlib.Path(cfg.run_dir)
    is_run = (run / CONFIG_FILE).is_file()
    if run.exists() and not run.is_dir():
        raise UserError(f"run_dir {run} is a file; choose another run_dir=")
    if run.is_dir() and not is_run and any(p.name != LOCK_FILE for p in run.iterdir()):
        raise UserError(f"run_dir {run} exists and is not a training run (no {CONFIG_FILE}); "
                        "choose another run_dir= (it is never deleted)")
    if is_run and overwrite and resume:
        raise UserError("--resume and --overwrite contradict each other; pass one of them")
    if not is_run and resume:
        raise UserError(f"--resume: there is no run in {run} to resume; drop --resume to start one")
    run.mkdir(parents=True, exist_ok=True)
    _lock_run_dir(run)
    try:
        if is_run and overwrite:
            log(f"--overwrite: deleting the run in {run}")
            for p in run.iterdir():  # all but the lock this process holds
                if p.name != LOCK_FILE:
                    shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
            is_run = False
        if is_run:
            diff = _differences(identity(load_config(run / CONFIG_FILE)), identity(cfg))
            if diff:
                raise UserError(f"run_dir {run} holds a run of a different config (differs in "
                                f"{'; '.join(diff[:4])}); use another run_dir=, or --overwrite to replace it")
    except BaseException:
        release_run_dir(run)
        raise
    (run / CONFIG_FILE).write_text(to_yaml(cfg))
    return is_run


_LOCKS: dict[pathlib.Path, Any] = {}  # the run directories this process holds, to their open lock files


def _lock_run_dir(run: pathlib.Path) -> None:
    """Take RUN_DIR/.lock (an advisory flock) for this process: a second training started into a run directory
    in use (say, a restart while the first still finishes an evaluation after SIGTERM) stops with an error
    instead of both writing checkpoints and metrics there. The kernel drops the lock when the process ends,
    however it ends, so a crash leaves nothing to clean up."""
    key = run.resolve()
    if key in _LOCKS:  # this process holds it already (a trainer rebuilt in the same process)
        return
    f = open(run / LOCK_FILE, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "another process"
        f.close()
        raise UserError(f"run_dir {run} is in use by a training process ({holder}); wait for it to end or stop "
                        "it, or choose another run_dir=") from None
    f.truncate(0)
    f.write(f"pid {os.getpid()} on {socket.gethostname()}")
    f.flush()
    _LOCKS[key] = f


def release_run_dir(run: str | pathlib.Path) -> None:
    """Let go of the run directory's lock (idempotent)."""
    f = _LOCKS.pop(pathlib.Path(run).resolve(), None)
    if f is not None:
        f.close()


def _git_revision() -> str | None:
    root = pathlib.Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (rev + ("-dirty" if dirty else "")) if rev else None


def _versions() -> dict[str, str | None]:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def write_manifest(run: pathlib.Path, cfg: TrainConfig, mesh, argv: list[str] | None, resumed_at: int | None) -> None:
    """manifest.json: the resolved config, and per session the git revision, packages, mesh and devices."""
    path = run / MANIFEST_FILE
    manifest = json.loads(path.read_text()) if path.is_file() else {"sessions": []}
    manifest["config"] = OmegaConf.to_container(OmegaConf.structured(cfg))
    manifest["config_fingerprint"] = fingerprint(cfg)
    manifest["sessions"].append({
        "started": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "argv": argv,
        "resumed_at_update": resumed_at,
        "git_revision": _git_revision(),
        "python": platform.python_version(),
        "host": platform.node(),
        "packages": _versions(),
        "mesh": {"data": int(mesh.shape["data"]), "model": int(mesh.shape["model"])},
        "devices": [str(d) for d in mesh.devices.flat],
        "platform": jax.default_backend(),
    })
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=2))
    tmp.replace(path)


# ------------------------------------------------------------------------------------------- model and tasks


def load_policy_model(name: str, dtype: str, mesh):
    """load_model, plus "tiny" / "tiny:SEED": the random-weight test model (asyncres_jax.model.tiny)."""
    if name == "tiny" or name.startswith("tiny:"):
        import jax.numpy as jnp

        from asyncres_jax.model.tiny import tiny_model

        seed = int(name.partition(":")[2] or 0)
        m = tiny_model(seed)
        make_mesh(mesh, cfg=m.config)  # the same fit checks as load_model
        params = jax.tree.map(lambda x: x.astype(jnp.dtype(dtype)), m.params)
        m.params = jax.device_put(params, param_shardings(params, m.config, mesh))
        m.mesh = mesh
        return m
    from asyncres_jax.model import load_model

    return load_model(name, dtype=dtype, mesh=mesh)


def ensure_tasks(cfg: TrainConfig) -> pathlib.Path:
    """The dataset folder; generated offline on first use when tasks.generate_n > 0."""
    path = pathlib.Path(cfg.tasks.dataset)
    if path.is_dir():
        return path
    if cfg.tasks.generate_n <= 0:
        raise UserError(f"task folder {path} does not exist; point tasks.dataset= at a task dataset, or set "
                        "tasks.generate_n=N to generate one offline")
    log(f"generating {cfg.tasks.generate_n} tasks into {path} (seed {cfg.tasks.generate_seed})")
    cmd = [sys.executable, "-m", "asyncres_jax.tasks", "generate", "--out", str(path),
           "--n", str(cfg.tasks.generate_n), "--seed", str(cfg.tasks.generate_seed)]
    if cfg.tasks.families:  # only the families the run uses
        cmd += ["--families", *cfg.tasks.families]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise UserError(f"generating tasks into {path} failed: {tail}")
    return path


def filter_tasks(tasks: Sequence[Any], families: Sequence[str] = (), difficulties: Sequence[str] = ()) -> list:
    """Tasks whose family and difficulty are in the given lists (an empty list keeps all)."""
    out = [t for t in tasks if (not families or t.family in families)
           and (not difficulties or t.difficulty in difficulties)]
    if tasks and not out:
        raise UserError(f"no task matches families={list(families)} difficulties={list(difficulties)}; "
                        f"the split has families {sorted({t.family for t in tasks})}")
    return out


def train_tasks(cfg: TrainConfig, dataset: pathlib.Path) -> list:
    """The train split's tasks, filtered by tasks.families and tasks.difficulties."""
    from asyncres_jax.envs.task import load_split

    tasks = filter_tasks(load_split(dataset, cfg.tasks.train_split), cfg.tasks.families, cfg.tasks.difficulties)
    if not tasks:
        raise UserError(f"{dataset}/splits/{cfg.tasks.train_split}.txt lists no tasks")
    return tasks


def make_backend(cfg: TrainConfig):
    from asyncres_jax.envs import choose_backend

    if choose_backend(cfg.sandbox.backend) == "docker":
        from asyncres_jax.envs.docker_backend import DockerBackend, DockerConfig

        return DockerBackend(DockerConfig(command_timeout_s=cfg.episode.command_timeout_s))
    from asyncres_jax.envs.bwrap import BwrapBackend, BwrapConfig

    return BwrapBackend(BwrapConfig(command_timeout_s=cfg.episode.command_timeout_s))


# ------------------------------------------------------------------------------------------- the trainers' base


class Trainer(abc.ABC):
    """What the ES and GRPO trainers share. A subclass sets `model`, `mesh` and what `version`, `_arrays`,
    `_params`, `_checkpoint_meta` and `_load_checkpoint` read, then calls `_open_records`."""

    unit = "update"  # how logs name one step of `version`

    def __init__(self, cfg: TrainConfig, total_updates: int):
        self.cfg = cfg
        self.run_dir = pathlib.Path(cfg.run_dir)
        self.total_updates = total_updates  # what evaluation calls the end of the run
        self.backend = None
        self.before_run_hooks: list[Callable[[Any], None]] = []  # e.g. evaluation of the base model
        self.drained_hooks: list[Callable[[Any], None]] = []  # e.g. validation every eval.every updates
        self.elapsed0, self.ckpt_step = 0.0, 0
        self._stop = threading.Event()

    @property
    @abc.abstractmethod
    def version(self) -> int:
        """Updates (ES) or steps (GRPO) reached."""

    def _open_records(self, *, continuing: bool, resume: bool, argv: list[str] | None, **metrics_kw) -> None:
        """Checkpointer, the latest checkpoint restored when the run continues, metrics writer, manifest."""
        self.checkpointer = Checkpointer(self.run_dir / CHECKPOINTS, self.cfg.checkpoint.keep, report=log)
        metrics_step = self._restore() if continuing else None
        if metrics_step is None and resume:
            self.checkpointer.close()
            raise UserError(f"--resume: {self.run_dir} has no readable checkpoint; drop --resume to start over")
        main = distributed.is_main_process()  # processes > 0 keep their own record in RUN_DIR/processes/I
        self.metrics = metrics.MetricsWriter(distributed.process_dir(self.run_dir), metrics_step or 0,
                                             total=self.total_updates, tensorboard=main, progress=main,
                                             initial=self.version, **metrics_kw)
        if main:
            write_manifest(self.run_dir, self.cfg, self.mesh, argv, self.version if continuing else None)

    # -- checkpoints -----------------------------------------------------------------------------------

    @abc.abstractmethod
    def _arrays(self) -> dict:
        """The arrays a checkpoint holds, flat (checkpoint.flatten), as restore templates too."""

    @abc.abstractmethod
    def _params(self):
        """The float32 master parameters (their layout fingerprint guards a restore)."""

    @abc.abstractmethod
    def _checkpoint_meta(self) -> dict:
        """The trainer's own part of a checkpoint's JSON record."""

    @abc.abstractmethod
    def _load_checkpoint(self, meta: dict, arrays: dict) -> None:
        """Load a restored checkpoint's record and arrays into the trainer."""

    def save_checkpoint(self) -> None:
        meta = {
            **self._checkpoint_meta(),
            "metrics_step": self.metrics.step, "elapsed_seconds": self.elapsed(),
            "rng": {"global_seed": self.cfg.seed, "counter": self.version},
            "config_fingerprint": fingerprint(self.cfg), "layout": es.layout_fingerprint(self._params()),
            "saved": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        }
        self.ckpt_step += 1
        self.checkpointer.save(self.ckpt_step, self._arrays(), meta)
        log(f"checkpoint {self.ckpt_step} at {self.unit} {self.version}{self._checkpoint_note(meta)}")

    def _checkpoint_note(self, meta: dict) -> str:
        return ""

    def _restore(self) -> int | None:
        """The latest readable checkpoint of this run loaded; returns its metrics step (None: there is none)."""
        check = self.checkpointer.same_run(fingerprint(self.cfg), es.layout_fingerprint(self._params()),
                                           self.cfg.model.name)
        restored = self.checkpointer.restore_latest(self._arrays(), check)
        if restored is None:
            return None
        self._load_checkpoint(restored.meta, restored.arrays)
        self.ckpt_step, self.elapsed0 = restored.step, float(restored.meta["elapsed_seconds"])
        log(f"resuming {self.run_dir} at {self.unit} {self.version} (checkpoint {restored.step})")
        return int(restored.meta["metrics_step"])

    # -- the loop --------------------------------------------------------------------------------------

    def elapsed(self) -> float:
        return self.elapsed0 + (time.monotonic() - self._t0 if hasattr(self, "_t0") else 0.0)

    def request_stop(self) -> None:
        """Finish what is in flight, checkpoint and return from run() (what the first SIGINT/SIGTERM does)."""
        self._stop.set()

    def close(self) -> None:
        """Remove every sandbox and close the writers (idempotent)."""
        try:
            if self.backend is not None:
                self.backend.close()
                self.backend = None
        finally:
            if hasattr(self, "metrics"):
                self.metrics.close()
            if hasattr(self, "checkpointer"):
                self.checkpointer.close()
            if distributed.is_main_process():
                release_run_dir(self.run_dir)


# ------------------------------------------------------------------------------------------- entry points


class Signals:
    """First SIGINT/SIGTERM: graceful stop. Second: remove sandboxes and exit at once."""

    def __init__(self, trainer):
        self.trainer, self.count, self.old = trainer, 0, {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self.old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        self.count += 1
        name = signal.Signals(signum).name
        if self.count == 1:
            log(f"{name}: finishing in-flight jobs, then checkpoint and exit (again to exit at once)")
            self.trainer.request_stop()
            return
        log(f"{name} again: removing sandboxes and exiting now")
        try:
            backend = self.trainer.backend
            if backend is not None:
                backend.close()
                # Episode threads may still be copying a sandbox's files into the backend's folder while it is
                # deleted; a reaper deletes it again once this process (and so every thread) is gone.
                if getattr(backend, "_own_root", False):
                    subprocess.Popen(["sh", "-c", 'while kill -0 "$0" 2>/dev/null; do sleep 0.02; done; rm -rf "$1"',
                                      str(os.getpid()), str(backend.root)], start_new_session=True,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        finally:
            os._exit(128 + signum)  # daemon worker threads and --die-with-parent sandboxes end with us

    def __exit__(self, *exc):
        for sig, handler in self.old.items():
            signal.signal(sig, handler)


def run_to_end(trainer, handle_signals: bool) -> None:
    """trainer.run(), with SIGINT/SIGTERM turned into a drain-and-checkpoint stop when asked (the CLI does)."""
    if handle_signals:
        with Signals(trainer):
            trainer.run()
    else:
        trainer.run()


def find_checkpoint(path: pathlib.Path) -> tuple[pathlib.Path, int | None]:
    """(run dir, step or None for the latest) from a run dir, its checkpoints/ folder or one step folder."""
    path = path.absolute()
    for run, step in ((path, None), (path.parent, None), (path.parent.parent, path.name)):
        if (run / CONFIG_FILE).is_file() and (run / CHECKPOINTS).is_dir():
            if step is not None and not step.isdigit():
                break
            return run, None if step is None else int(step)
    raise UserError(f"{path} is not a run directory or one of its checkpoints "
                    f"(expected RUN_DIR/{CONFIG_FILE} and RUN_DIR/{CHECKPOINTS}/)")


def restore_params(run: pathlib.Path, step: int | None, cfg: TrainConfig, model):
    """(parameters, the Restored checkpoint) of RUN_DIR's latest checkpoint, or of checkpoint `step`."""
    if cfg.algo == "grpo":
        from asyncres_jax.grpo.step import opt_template

        opt_state = opt_template(model.params, cfg)
    else:
        opt_state = es.init(model.params, cfg.es.core())
    template = {**flatten(model.params, "params"), **flatten(opt_state, "opt")}
    ckpt = Checkpointer(run / CHECKPOINTS, cfg.checkpoint.keep, report=log)
    try:
        if step is not None and step not in ckpt.steps():
            raise UserError(f"{run / CHECKPOINTS} has no checkpoint {step}; it has {ckpt.steps()}")
        restored = ckpt.restore_latest(template, steps=None if step is None else [step])
    finally:
        ckpt.close()
    if restored is None:
        raise UserError(f"{run / CHECKPOINTS} holds no readable checkpoint")
    return unflatten_like(model.params, restored.arrays, "params"), restored


def export(checkpoint: str, out: str, *, dtype: str = "float32", overwrite: bool = False) -> pathlib.Path:
    """A checkpoint's parameters as a Hugging Face folder: config.json (the original model's when it had one,
    else derived: Qwen2/Llama style), model.safetensors and the tokenizer files when the model has them."""
    import jax.numpy as jnp

    from asyncres_jax.model.loading import save_hf

    run, step = find_checkpoint(pathlib.Path(checkpoint))
    out_dir = pathlib.Path(out)
    if out_dir.exists() and any(out_dir.iterdir()) and not overwrite:
        raise UserError(f"{out_dir} exists and is not empty; choose another --out or pass --overwrite")
    cfg = load_config(run / CONFIG_FILE)
    mesh = make_mesh("1x1", jax.devices()[:1])
    model = load_policy_model(cfg.model.name, cfg.model.dtype, mesh)
    params, restored = restore_params(run, step, cfg, model)
    params = jax.tree.map(lambda x: np.asarray(x.astype(jnp.dtype(dtype))), params)
    if out_dir.exists() and overwrite:
        shutil.rmtree(out_dir)
    save_hf(out_dir, model.config, params)
    source = pathlib.Path(cfg.model.name)
    if source.is_dir() and (source / "config.json").is_file():
        original = json.loads((source / "config.json").read_text())
        original["torch_dtype" if "torch_dtype" in original else "dtype"] = dtype
        (out_dir / "config.json").write_text(json.dumps(original, indent=2))
    if model.tokenizer is not None:
        model.tokenizer.save_pretrained(str(out_dir))
    version = restored.meta["version"]
    (out_dir / "asyncres_export.json").write_text(json.dumps(
        {"run_dir": str(run), "checkpoint": restored.step, "update": version, "model": cfg.model.name}, indent=2))
    log(f"exported update {version} of {run} to {out_dir}")
    return out_dir
