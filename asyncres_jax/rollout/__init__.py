"""Rollouts: the versioned parameter store, the staleness coordinator, the async worker pool
(and, in episodes.py, the episode runner)."""

from asyncres_jax.rollout.coordinator import (
    Accepted,
    Attempt,
    Cohort,
    Coordinator,
    Job,
    JobResult,
    PoolConfig,
    UpdateMetrics,
    batch_seeds,
)
from asyncres_jax.rollout.es_store import es_param_store
from asyncres_jax.rollout.pool import Replica, RolloutPool
from asyncres_jax.rollout.ray_pool import ActorSpec, RayRolloutPool, ReplicaState  # Ray itself loads on first use
from asyncres_jax.rollout.replicas import replicas_from_mesh
from asyncres_jax.rollout.simulate import Outcome, SimRun, best_useful_fraction, simulate
from asyncres_jax.rollout.store import LogEntry, ParamStore

__all__ = [
    "Accepted", "ActorSpec", "Attempt", "Cohort", "Coordinator", "Job", "JobResult", "LogEntry", "Outcome",
    "ParamStore", "PoolConfig", "RayRolloutPool", "Replica", "ReplicaState", "RolloutPool", "SimRun", "UpdateMetrics",
    "batch_seeds", "best_useful_fraction", "es_param_store", "replicas_from_mesh", "simulate",
]

# the episode runner (episodes.py)
from asyncres_jax.rollout.episodes import (
    EpisodeConfig,
    EpisodeResult,
    ModelPolicy,
    Policy,
    PolicyBatch,
    ScriptedPolicy,
    TokenState,
    run_episodes,
)

__all__ += ["EpisodeConfig", "EpisodeResult", "ModelPolicy", "Policy", "PolicyBatch", "ScriptedPolicy", "TokenState",
            "run_episodes"]
