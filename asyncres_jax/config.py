"""Typed run configuration: dataclass schemas, YAML files in configs/, dotted `key=value` overrides.

OmegaConf does the parsing, merging and type conversion; unknown keys and ill-typed values are rejected
there. Choices and ranges are checked in `__post_init__`, so every error names the key and the fix.
Each field's `doc` metadata is the option's documentation (`python -m asyncres_jax.train --help-config`).
"""

from __future__ import annotations

import dataclasses
import pathlib
from dataclasses import dataclass, field
from typing import Any, Optional

import omegaconf
from omegaconf import OmegaConf

from asyncres_jax.errors import UserError


def opt(default: Any, doc: str, **kw) -> Any:
    """A documented config field."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"doc": doc}, **kw)
    if dataclasses.is_dataclass(default):
        return field(default_factory=type(default), metadata={"doc": doc}, **kw)
    return field(default=default, metadata={"doc": doc}, **kw)


def _choice(section: str, name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise UserError(f"{section}.{name}={value!r} is not valid; choose one of {', '.join(map(str, choices))}")


def _positive(section: str, name: str, value: float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise UserError(f"{section}.{name}={value} is not valid; it must be {bound}")


@dataclass
class ModelSection:
    name: str = opt("smollm2-135m-instruct", "model name, Hugging Face directory or .gguf file")
    dtype: str = opt("float32", "dtype of the learner's master parameters (float32 recommended)")
    rollout_dtype: str = opt("float32", "dtype of the rollout copies of the parameters (bfloat16 on GPUs)")

    def __post_init__(self):
        _choice("model", "dtype", self.dtype, ("float32", "bfloat16"))
        _choice("model", "rollout_dtype", self.rollout_dtype, ("float32", "bfloat16"))


@dataclass
class TasksSection:
    dataset: str = opt("data/generated", "folder of task directories with splits/{train,val,test}.txt")
    generate_n: int = opt(0, "if > 0 and the dataset folder is missing, generate this many tasks offline")
    generate_seed: int = opt(0, "seed of the offline task generator")
    train_split: str = opt("train", "split used for ES/GRPO updates")
    val_split: str = opt("val", "split evaluated every eval.every updates")
    test_split: str = opt("test", "split evaluated once at the end")
    families: list[str] = opt([], "train and evaluate only these task families (empty = all)")
    difficulties: list[str] = opt([], "train and evaluate only these tiers: easy, medium, hard (empty = all)")

    def __post_init__(self):
        _positive("tasks", "generate_n", self.generate_n, allow_zero=True)
        for d in self.difficulties:
            _choice("tasks", "difficulties", d, ("easy", "medium", "hard"))


@dataclass
class EpisodeSection:
    max_turns: int = opt(16, "turns per episode before it ends ungraded-as-is")
    max_new_tokens: int = opt(2048, "tokens generated per turn at most")
    context_limit: int = opt(16384, "rolling context in tokens; older turns are dropped beyond it")
    episode_timeout_s: float = opt(300.0, "wall-clock seconds per episode; a timed-out episode scores 0")
    command_timeout_s: float = opt(30.0, "seconds one command may run before its process tree is killed")
    temperature: float = opt(0.6, "sampling temperature (0 = greedy)")
    top_p: float = opt(1.0, "nucleus sampling threshold")
    fitness: str = opt("binary", "per-episode score: binary (tests pass) or partial (fraction of tests)")
    reward_key: str = opt("", "the verifier's reward.json metric taken as the reward (empty: `reward` if "
                              "written, else the mean of its metrics)")
    start_retries: int = opt(2, "more tries for a sandbox that fails to start; then the episode is left out "
                                "of the fitness and counted (start_errors)")
    first_reply_prefix: str = opt("", "text every episode's first reply starts with, e.g. '<command>' (steers a "
                                      "small model that ignores the tag format into running a command)")
    command_per_line: bool = opt(False, "scaffold for small models: every reply is '<command>' (given) + one "
                                        "generated line, closed by the harness; a line saying done ends the episode")
    system_prompt: str = opt("full", "full (the protocol's rules, ~270 tokens), compact (the same without the "
                                     "<think> format, ~145 tokens) or short (~70 tokens); the last two are for the "
                                     "one-command-per-line scaffold")

    def __post_init__(self):
        for name in ("max_turns", "max_new_tokens", "context_limit", "episode_timeout_s", "command_timeout_s"):
            _positive("episode", name, getattr(self, name))
        _positive("episode", "start_retries", self.start_retries, allow_zero=True)
        _positive("episode", "temperature", self.temperature, allow_zero=True)
        if not 0 < self.top_p <= 1:
            raise UserError(f"episode.top_p={self.top_p} is not valid; it must be in (0, 1]")
        _choice("episode", "fitness", self.fitness, ("binary", "partial"))
        _choice("episode", "system_prompt", self.system_prompt, ("full", "compact", "short"))


@dataclass
class SandboxSection:
    backend: str = opt("bwrap", "bwrap (daemonless), docker (any Docker-API engine via DOCKER_HOST) or auto (bwrap "
                                "where it isolates, else docker where an engine answers)")
    max_parallel: int = opt(16, "sandboxes alive at once")

    def __post_init__(self):
        _choice("sandbox", "backend", self.backend, ("bwrap", "docker", "auto"))
        _positive("sandbox", "max_parallel", self.max_parallel)


@dataclass
class ESSection:
    """The ES core's options (es.ESConfig: `core()` converts, and its checks are the section's) and the run's."""

    updates: int = opt(120, "ES updates to run")
    population: int = opt(30, "perturbations (members) per update, N")
    sigma: float = opt(0.0015, "noise scale")
    alpha: float = opt(0.00075, "learning rate: theta += alpha/N * sum z_i eps_i")
    noise: str = opt("iid", "iid (full rank), shared (equal-shaped leaves share noise) or lowrank (EGGROLL)")
    rank: int = opt(1, "rank r of low-rank noise")
    shaping: str = opt("zscore", "fitness shaping: zscore, centered_rank or raw")
    shaping_groups: str = opt("none", "none (the paper's rule: shape the whole cohort together) or batch (shape the "
                                      "results of each task batch apart: a stale result is compared only with results "
                                      "played on its tasks; a result alone on its batch gets 0; not with raw)")
    antithetic: bool = opt(False, "mirrored pairs (+eps, -eps); population must be even")
    optimizer: str = opt("sgd", "sgd (the paper's rule) or adam")
    divide_by_sigma: bool = opt(False, "estimate sum z_i eps_i / (N sigma) (the textbook gradient) instead of / N")
    weight_decay: float = opt(0.0, "decoupled pull toward the initial parameters: theta -= alpha * wd * (theta - "
                                   "theta0); > 0 turns replay off (replicas copy the weights)")
    adam_b1: float = opt(0.9, "optimizer=adam: first-moment decay")
    adam_b2: float = opt(0.999, "optimizer=adam: second-moment decay")
    adam_eps: float = opt(1e-8, "optimizer=adam: epsilon")
    tasks_per_member: int = opt(256, "tasks each member is evaluated on per update")
    batched_population: bool = opt(False, "lowrank only: run a whole cohort as one batch over one copy of W")
    members_per_batch: int = opt(0, "batched_population: members per batch (0: pool.workers_per_replica, all of a "
                                    "replica's workers in one batch; fewer runs several batches at once, so async "
                                    "batches overlap commits and some results land stale)")
    streams_per_batch: int = opt(1, "batched_population: play a batch's members as this many smaller batches at once, "
                                    "one thread each (2 on a 2-core CPU, which one generation keeps only partly "
                                    "busy); the batch still reports as one, so episodes and schedules are unchanged")

    def core(self):
        """The es.ESConfig of this section (every field that ESConfig has)."""
        from asyncres_jax import es  # the ES core's import is heavy (jax); configs are read without it

        return es.ESConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(es.ESConfig)})

    def __post_init__(self):
        for name in ("updates", "tasks_per_member"):
            _positive("es", name, getattr(self, name))
        _positive("es", "members_per_batch", self.members_per_batch, allow_zero=True)
        _positive("es", "streams_per_batch", self.streams_per_batch)
        try:
            self.core()
        except UserError as e:  # the core names its fields ESConfig.NAME; here they are YAML keys
            raise UserError(str(e).replace("ESConfig.", "es.")) from None
        if self.batched_population and self.noise != "lowrank":
            raise UserError("es.batched_population=true needs es.noise=lowrank")
        if self.members_per_batch and not self.batched_population:
            raise UserError(f"es.members_per_batch={self.members_per_batch} needs es.batched_population=true")
        if self.streams_per_batch > 1 and not self.batched_population:
            raise UserError(f"es.streams_per_batch={self.streams_per_batch} needs es.batched_population=true "
                            "(it splits a batched population's members); use 1")


@dataclass
class PoolSection:
    mode: str = opt("async", "sync (barrier), async (bounded staleness) or controlled (fixed delays)")
    max_staleness: int = opt(1, "K: results staler than K updates are dropped (async)")
    held_back: int = opt(3, "controlled: results of each cohort held back")
    delay: int = opt(4, "controlled: updates by which held-back results are delayed")
    held_back_tasks: str = opt("dispatch", "controlled: the task batch a held-back job plays: dispatch (its own "
                                           "version's) or landing (that of the cohort it is held back for, so it "
                                           "shares tasks with the fresh results there; see es.shaping_groups)")
    pace_admission: bool = opt(False, "async: start a job only if its result is sure to be accepted; cohorts "
                               "are formed in dispatch order and a commit waits for its slowest job (nothing "
                               "dropped or cancelled, no bias toward fast episodes, idle workers instead)")
    workers_per_replica: int = opt(1, "worker threads sharing one model replica, at most: fewer on a mesh whose "
                                      "replicas x workers would reach es.population (N must exceed the workers)")
    job_deadline_s: float = opt(3600.0, "a job running longer is re-issued with the same seed")
    backend: str = opt("threads", "threads (replicas on this process's devices) or ray (one Ray actor per replica)")
    ray_address: str = opt("", "ray: an existing cluster ('auto' or host:port); empty starts a local one")
    ray_actors: int = opt(0, "ray: rollout actors (0: one per data replica of the mesh)")
    ray_cpus_per_actor: float = opt(1.0, "ray: CPUs each actor reserves")
    ray_gpus_per_actor: float = opt(0.0, "ray: GPUs each actor reserves (its devices)")

    def __post_init__(self):
        _choice("pool", "mode", self.mode, ("sync", "async", "controlled"))
        _choice("pool", "backend", self.backend, ("threads", "ray"))
        _choice("pool", "held_back_tasks", self.held_back_tasks, ("dispatch", "landing"))
        if self.held_back_tasks != "dispatch" and self.mode != "controlled":
            raise UserError(f"pool.held_back_tasks={self.held_back_tasks} needs pool.mode=controlled (mode is "
                            f"{self.mode}): only controlled schedules hold results back")
        _positive("pool", "ray_actors", self.ray_actors, allow_zero=True)
        _positive("pool", "ray_cpus_per_actor", self.ray_cpus_per_actor, allow_zero=True)
        _positive("pool", "ray_gpus_per_actor", self.ray_gpus_per_actor, allow_zero=True)
        _positive("pool", "max_staleness", self.max_staleness, allow_zero=True)
        _positive("pool", "held_back", self.held_back, allow_zero=True)
        _positive("pool", "delay", self.delay)
        _positive("pool", "workers_per_replica", self.workers_per_replica)
        _positive("pool", "job_deadline_s", self.job_deadline_s)
        if self.pace_admission and self.mode != "async":
            raise UserError(f"pool.pace_admission=true needs pool.mode=async (mode is {self.mode}); "
                            "barrier schedules never drop a result")


@dataclass
class GRPOSection:
    steps: int = opt(129, "GRPO steps to run")
    prompts_per_step: int = opt(16, "tasks per step")
    group_size: int = opt(16, "episodes per task (G)")
    epochs: int = opt(2, "passes over each batch")
    minibatch_size: int = opt(64, "episodes per gradient step")
    micro_batch_size: int = opt(8, "sequences per forward/backward pass; a minibatch's gradients accumulate")
    max_segment_tokens: int = opt(0, "leave training segments longer than this out of the loss, counted in "
                                     "metrics as segments_skipped (0 = no limit; bounds the backward pass's "
                                     "memory)")
    lr: float = opt(1e-6, "AdamW learning rate")
    weight_decay: float = opt(0.01, "AdamW weight decay")
    grad_clip: float = opt(1.0, "global gradient-norm clip")
    clip_eps: float = opt(0.2, "PPO ratio clip")
    kl_coef: float = opt(1e-3, "k3 KL penalty coefficient against the initial model")

    def __post_init__(self):
        for name in ("steps", "prompts_per_step", "group_size", "epochs", "minibatch_size", "micro_batch_size", "lr",
                     "grad_clip"):
            _positive("grpo", name, getattr(self, name))
        _positive("grpo", "max_segment_tokens", self.max_segment_tokens, allow_zero=True)


@dataclass
class EvalSection:
    every: int = opt(10, "evaluate the validation split every k updates (0 = never)")
    val_tasks: int = opt(100, "validation tasks evaluated (tiers balanced)")
    test_tasks: int = opt(300, "test tasks evaluated at the end (tiers balanced)")
    seeds: list[int] = opt([42, 43, 44], "sampling seeds of held-out evaluation")
    val_seeds: list[int] = opt([], "sampling seeds of the periodic validation (empty = eval.seeds)")
    temperature: Optional[float] = opt(None, "sampling temperature of held-out evaluation (empty = "
                                             "episode.temperature)")
    base_from: str = opt("", "a run directory whose base-model (update 0) evaluations this run reuses when they "
                             "exist and were made with the same settings, instead of repeating them (a study's rows)")

    def __post_init__(self):
        _positive("eval", "every", self.every, allow_zero=True)
        if not self.seeds:
            raise UserError("eval.seeds is empty; give at least one seed, e.g. eval.seeds=[42,43,44]")
        if self.temperature is not None:
            _positive("eval", "temperature", self.temperature, allow_zero=True)


@dataclass
class CheckpointSection:
    every: int = opt(10, "checkpoint every k updates (after draining in-flight jobs)")
    keep: int = opt(3, "checkpoints kept")

    def __post_init__(self):
        _positive("checkpoint", "every", self.every)
        _positive("checkpoint", "keep", self.keep)


@dataclass
class TrainConfig:
    algo: str = opt("es", "es or grpo")
    seed: int = opt(0, "global seed: member seeds, task batches and sampling seeds derive from it")
    run_dir: str = opt("runs/default", "where checkpoints, metrics and the manifest go")
    mesh: str = opt("1x1", "DxM: D data replicas (rollout engines) x M-way model parallel")
    model: ModelSection = opt(ModelSection(), "the policy")
    tasks: TasksSection = opt(TasksSection(), "the task dataset")
    episode: EpisodeSection = opt(EpisodeSection(), "the agent protocol's limits and sampling")
    sandbox: SandboxSection = opt(SandboxSection(), "where commands run")
    es: ESSection = opt(ESSection(), "Evolution Strategies")
    pool: PoolSection = opt(PoolSection(), "the rollout pool and its staleness rule")
    grpo: GRPOSection = opt(GRPOSection(), "the GRPO baseline")
    eval: EvalSection = opt(EvalSection(), "held-out evaluation")
    checkpoint: CheckpointSection = opt(CheckpointSection(), "Orbax checkpoints")

    def __post_init__(self):
        _choice("", "algo", self.algo, ("es", "grpo"))
        from asyncres_jax.mesh import parse_mesh  # mesh imports jax: only when a config is built

        parse_mesh(self.mesh)
        if self.algo == "es" and self.model.dtype == "bfloat16":
            # One update at the paper's sigma and alpha is below half a bf16 ulp of about half a kernel's entries:
            # they would not move, and the run would learn less than its log of updates says.
            raise UserError("model.dtype=bfloat16 with algo=es: an ES step is smaller than bfloat16 resolves for many "
                            "weights, so they would silently not change; use model.dtype=float32 (and "
                            "model.rollout_dtype=bfloat16 for small rollout copies)")


def load_config(path: str | pathlib.Path | None, overrides: list[str] = ()) -> TrainConfig:
    """Schema defaults <- YAML file <- `key=value` overrides, validated into a TrainConfig."""
    merged = OmegaConf.structured(TrainConfig)
    try:
        if path is not None:
            for layer in _config_layers(pathlib.Path(path)):
                merged = OmegaConf.merge(merged, layer)
        for item in overrides:
            if "=" not in item:
                raise UserError(f"override {item!r} is not key=value, e.g. es.population=8")
        merged = OmegaConf.merge(merged, OmegaConf.from_dotlist(list(overrides)))
        return OmegaConf.to_object(merged)
    except omegaconf.errors.OmegaConfBaseException as e:
        raise UserError(_one_line(e)) from None


def _config_layers(path: pathlib.Path, seen: tuple = ()) -> list:
    """The YAML file and, first, the files it builds on: a top-level `base: OTHER.yaml` (relative to the file)
    is loaded underneath it, so a study's configs state only how they differ from a shared one."""
    if not path.is_file():
        raise UserError(f"config file {path} does not exist; see configs/ for the shipped ones")
    if path.resolve() in seen:
        raise UserError(f"config file {path} builds on itself through `base:`; remove the cycle")
    layer = OmegaConf.load(path)
    base = layer.pop("base", None)
    if base is None:
        return [layer]
    return _config_layers(path.parent / str(base), seen + (path.resolve(),)) + [layer]


def _one_line(e: Exception) -> str:
    msg = str(e).splitlines()[0]
    key = getattr(e, "full_key", None)
    if isinstance(e, omegaconf.errors.ConfigKeyError):
        return f"{msg}: unknown config key {key!r}; see `python -m asyncres_jax.train --help-config`"
    return f"config key {key!r}: {msg}" if key else msg


def to_yaml(cfg: TrainConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def describe(schema: type = TrainConfig, prefix: str = "") -> list[str]:
    """Every option as 'key = default  # doc', for --help-config."""
    lines = []
    for f in dataclasses.fields(schema):
        key = f"{prefix}{f.name}"
        doc = f.metadata.get("doc", "")
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if dataclasses.is_dataclass(default):
            lines.append(f"# {key}: {doc}")
            lines.extend(describe(type(default), key + "."))
        else:
            lines.append(f"{key} = {default!r}  # {doc}")
    return lines
