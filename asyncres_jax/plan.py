"""Compile-only plan: what a config costs per device on a mesh, before any accelerator or weight exists.

    python -m asyncres_jax.train --config configs/qwen2_5_7b_async1.yaml --mesh 8x1 --cpu-devices 8 --plan \
        model.name=tests/fixtures/qwen2_5_7b_instruct [--accelerator h100]

The model is built from its config.json alone (jax.eval_shape: abstract arrays, no weights). Three programs are
lowered and compiled with the shardings training gives them: the rollout decode step (one replica's 1xM
sub-mesh, the job's batch, a KV cache of the whole context), the ES update (per parameter leaf, on the learner's
DxM mesh) and the GRPO gradient and AdamW steps (a micro-batch of full-context rows on DxM). Per device it
reports parameter bytes, KV-cache bytes, the compiler's temporaries (memory analysis), and per decode step the
compiler's FLOPs and bytes with the roofline time on the named accelerator (ACCELERATORS, docs/scaling.md).
The run (cfg.algo) must fit the accelerator's memory: otherwise a one-line error says what does not fit.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from asyncres_jax import es
from asyncres_jax.config import TrainConfig
from asyncres_jax.errors import UserError
from asyncres_jax.mesh import make_mesh, replica_meshes
from asyncres_jax.model import NAMED_MODELS, decoder, named_model_path
from asyncres_jax.model.config import ModelConfig
from asyncres_jax.model.generate import DECODE_CHUNK, _decode, block_length
from asyncres_jax.model.sampling import Sampling
from asyncres_jax.model.sharding import param_shardings
from asyncres_jax.trainer import rollout_workers

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Accelerator:
    name: str
    memory_bytes: float  # HBM per device
    bandwidth: float  # HBM bytes/s
    bf16_flops: float  # dense bf16 FLOP/s


# Data-sheet figures (dense, without sparsity); the table in docs/scaling.md.
ACCELERATORS = {
    "h100": Accelerator("NVIDIA H100 SXM", 80 * GB, 3.35e12, 989e12),
    "h200": Accelerator("NVIDIA H200 SXM", 141 * GB, 4.8e12, 989e12),
    "v5e": Accelerator("Google TPU v5e", 16 * GB, 819e9, 197e12),
}


@dataclasses.dataclass
class Program:
    """One compiled program: per-device sizes from the compiler (bytes) and its cost analysis."""
    name: str
    arguments: int
    temporaries: int
    flops: float
    bytes_accessed: float
    compile_s: float


@dataclasses.dataclass
class Plan:
    model: str
    config: ModelConfig
    n_params: int
    mesh: tuple[int, int]
    accelerator: Accelerator
    batch: int  # decode rows per replica
    slots: int  # KV slots at full context
    master_bytes: int  # float32 masters per device (learner)
    rollout_bytes: int  # rollout copy per device (one replica)
    kv_bytes: int  # KV cache per device at full context
    kv_row_bytes: float  # per row, per device
    decode: Program
    es_update: Program  # the largest leaf's step (steps run one leaf at a time)
    grpo_grad: Program
    grpo_apply: Program
    grpo_rows: tuple[int, int]  # micro-batch rows x tokens
    lines: list[str] = dataclasses.field(default_factory=list)

    # -- what each run holds per device ------------------------------------------------------------------

    def total(self, algo: str, rows: int | None = None) -> float:
        """Bytes per device of an ES run (masters, the rollout copy, its KV cache, the larger of the decode's and
        the update's temporaries) or a GRPO run (masters, reference, gradients and Adam's two moments: 5 float32
        copies, plus the rollout's share). With `rows`, the rollout's KV cache and decode temporaries are
        scaled from the planned batch to that many rows."""
        scale = 1.0 if rows is None else rows / self.batch
        decode = scale * (self.kv_bytes + self.decode.temporaries)
        if algo == "es":
            return self.master_bytes + self.rollout_bytes + max(decode, self.kv_bytes * scale +
                                                                    self.es_update.temporaries)
        return 5 * self.master_bytes + self.rollout_bytes + max(decode, self.kv_bytes * scale +
                                                                self.grpo_grad.temporaries)

    def rows_that_fit(self, algo: str) -> int:
        return max((r for r in range(self.batch + 1) if self.total(algo, r) <= self.accelerator.memory_bytes),
                   default=0)

    def minimal_step(self) -> tuple[float, float]:
        """(FLOPs, bytes) of one decode step by counting: every weight and KV slot read once, 2 FLOPs per weight
        and row, 4 per head, slot and row in attention (QK^T and PV); the embedding table is a lookup."""
        c, m = self.config, self.mesh[1]
        lookup = c.vocab_size * c.hidden_size * (0 if c.tie_word_embeddings else 1)
        flops = self.batch * (2 * (self.n_params - lookup) / m + 4 * c.num_layers * c.num_heads // m * c.head_dim
                              * self.slots)
        return flops, self.rollout_bytes + self.kv_bytes

    def roofline_s(self, flops: float, nbytes: float) -> float:
        return max(flops / self.accelerator.bf16_flops, nbytes / self.accelerator.bandwidth)

    def decode_roofline_s(self) -> float:
        """The step time of the minimal traffic (the compiler's count on CPU includes its bf16 -> f32 copies)."""
        return self.roofline_s(*self.minimal_step())


# ------------------------------------------------------------------------------------------------ the model


def model_config(name: str) -> ModelConfig:
    """The decoder's hyper-parameters without reading weights: "tiny", a named model, a Hugging Face folder
    (only its config.json), a config.json file or a .gguf file (its header)."""
    if name == "tiny" or name.startswith("tiny:"):
        from asyncres_jax.model.tiny import tiny_config

        return tiny_config()
    path = named_model_path(name) if name in NAMED_MODELS else pathlib.Path(name)
    if path.is_dir():
        from asyncres_jax.model.loading import read_hf_config

        return read_hf_config(path)
    if path.suffix == ".json" and path.is_file():
        return ModelConfig.from_hf(json.loads(path.read_text()))
    if path.suffix == ".gguf" and path.is_file():
        from asyncres_jax.model.gguf import read_gguf

        return read_gguf(path)[1]
    raise UserError(f"--plan: model.name={name!r} is not a model folder with a config.json, a config.json, a "
                    f".gguf file or one of: {', '.join(NAMED_MODELS)}; e.g. model.name=tests/fixtures/"
                    "qwen2_5_7b_instruct")


def abstract(tree, shardings, dtype=None):
    """ShapeDtypeStructs carrying the shardings (nothing is allocated)."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, dtype or x.dtype, sharding=s), tree, shardings)


def device_bytes(tree) -> int:
    """Bytes one device holds of an abstract tree (the first device's shards; shardings here are even)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += math.prod(shape) * jnp.dtype(x.dtype).itemsize
    return total


def compile_program(name: str, lower: Callable[[], Any]) -> Program:
    t = time.monotonic()
    compiled = lower().compile()
    seconds = time.monotonic() - t
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, (list, tuple)) else cost) or {}
    return Program(name, int(mem.argument_size_in_bytes), int(mem.temp_size_in_bytes), float(cost.get("flops", 0)),
                   float(cost.get("bytes accessed", 0)), seconds)


# ------------------------------------------------------------------------------------------------ programs


def decode_batch(cfg: TrainConfig, replicas: int) -> int:
    """Rows one replica decodes at once: a job's episodes (a batched cohort's members' episodes together), or
    a GRPO task's group."""
    if cfg.algo != "es":
        return cfg.grpo.group_size
    members = rollout_workers(cfg.es.population, replicas, cfg.pool.workers_per_replica)[1]
    return (members if cfg.es.batched_population else 1) * cfg.es.tasks_per_member


def plan_decode(mcfg: ModelConfig, sub_mesh, batch: int, slots: int, dtype) -> tuple[Program, Any, Any]:
    """One decode chunk (a while loop whose body is one step, which is what the cost analysis counts)."""
    params = decoder.abstract_params(mcfg, dtype)
    params = abstract(params, param_shardings(params, mcfg, sub_mesh))
    heads = "model" if mcfg.num_kv_heads % sub_mesh.shape["model"] == 0 else None
    cache_sharding = NamedSharding(sub_mesh, P("data", heads, None, None))
    cache = jax.eval_shape(lambda: decoder.init_cache(mcfg, batch, slots, dtype))
    cache = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=cache_sharding), cache)
    rep = NamedSharding(sub_mesh, P())

    def arr(shape, dt):
        return jax.ShapeDtypeStruct(shape, dt, sharding=rep)

    b_i32, scalar = arr((batch,), jnp.int32), arr((), jnp.int32)
    key = jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0)).dtype, sharding=rep)
    mode = Sampling.of({"temperature": 0.6}).static(mcfg.vocab_size)
    program = compile_program("rollout decode", lambda: _decode.lower(
        params, cache, arr((batch, slots), jnp.bool_), b_i32, b_i32, b_i32, b_i32, arr((batch,), jnp.bool_), b_i32,
        key, scalar, scalar, arr((), jnp.float32), arr((), jnp.float32), None,
        cfg=mcfg, mode=mode, chunk=DECODE_CHUNK, eos=mcfg.eos_token_ids))
    return program, params, cache


def plan_es_update(masters, es_cfg: es.ESConfig) -> Program:
    """The ES step of every distinct leaf (shape, sharding); the update runs leaf by leaf, so the largest
    temporaries of any one leaf are what the update adds on top of the parameters."""
    from asyncres_jax.es.update import CHUNK, _step

    leaves = jax.tree.leaves(masters)
    opt_state = jax.eval_shape(lambda: es.init(masters, es_cfg))
    opt_leaves = jax.tree.structure(masters).flatten_up_to(opt_state.opt)
    seeds = jax.ShapeDtypeStruct((es_cfg.num_seeds,), jnp.int32)
    coeffs = jax.ShapeDtypeStruct((es_cfg.num_seeds,), jnp.float32)
    lid = jax.ShapeDtypeStruct((), jnp.uint32)
    worst, seen = None, set()
    for x, s in zip(leaves, opt_leaves):
        key = (x.shape, x.sharding)
        if key in seen:
            continue
        seen.add(key)
        s = jax.tree.map(lambda y, x=x: jax.ShapeDtypeStruct(y.shape, y.dtype, sharding=_like(y, x)), s)
        p = compile_program(f"es update {x.shape}",
                            lambda x=x, s=s: _step.lower(x, s, None, seeds, coeffs, lid, es_cfg, x.sharding, CHUNK))
        if worst is None or p.temporaries > worst.temporaries:
            worst = dataclasses.replace(p, compile_s=p.compile_s + (worst.compile_s if worst else 0.0))
        else:
            worst.compile_s += p.compile_s
    worst.name = f"es update (N={es_cfg.population}, {len(seen)} leaf programs)"
    return worst


def plan_grpo(masters, mcfg: ModelConfig, cfg: TrainConfig, mesh) -> tuple[Program, Program, tuple[int, int]]:
    """A micro-batch's gradient (rows x full-context tokens, rows split over "data") and the AdamW step."""
    from asyncres_jax.grpo.step import GRPOHyper, make_optimizer, step_functions

    hp = GRPOHyper.from_config(cfg)
    d = mesh.shape["data"]
    rows = d * -(-hp.micro_batch_size // d)
    tokens = cfg.grpo.max_segment_tokens or cfg.episode.context_limit
    shardings = jax.tree.map(lambda x: x.sharding, masters)
    _, grad_fn, apply_fn = step_functions(mcfg, hp, shardings)
    by_row = NamedSharding(mesh, P("data", None))

    def bt(dt):
        return jax.ShapeDtypeStruct((rows, tokens - 1), dt, sharding=by_row)
    grad = compile_program("grpo gradient", lambda: jax.jit(grad_fn).lower(
        masters, jax.ShapeDtypeStruct((rows, tokens), jnp.int32, sharding=by_row), bt(jnp.float32), bt(jnp.float32),
        jax.ShapeDtypeStruct((rows,), jnp.float32, sharding=NamedSharding(mesh, P("data"))), bt(jnp.float32)))
    opt = _with_param_shardings(jax.eval_shape(make_optimizer(hp).init, masters), masters)
    apply = compile_program("grpo AdamW step", lambda: jax.jit(apply_fn, donate_argnums=(0, 1)).lower(
        masters, opt, masters))
    return grad, apply, (rows, tokens)


def _like(y, x):
    """The sharding of state leaf y that belongs to parameter x: x's own, or replicated for a counter."""
    return x.sharding if y.shape == x.shape else NamedSharding(x.sharding.mesh, P())


def _with_param_shardings(opt, masters):
    """Optax state with the parameters' shardings on its parameter-shaped subtrees (Adam's moments) and the
    rest (step counters) replicated."""
    treedef = jax.tree.structure(masters)
    mesh = jax.tree.leaves(masters)[0].sharding.mesh

    def place(t):
        if jax.tree.structure(t) == treedef:
            return jax.tree.map(lambda y, x: jax.ShapeDtypeStruct(y.shape, y.dtype, sharding=_like(y, x)), t, masters)
        return jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=NamedSharding(mesh, P()))
    return jax.tree.map(place, opt, is_leaf=lambda t: jax.tree.structure(t) == treedef)


# ------------------------------------------------------------------------------------------------ the plan


def make_plan(cfg: TrainConfig, accelerator: str = "h100", devices=None, programs: tuple[str, ...] = ("es", "grpo"),
              report: Callable[[str], None] = print) -> Plan:
    """Compile the programs of `cfg` on its mesh (the visible devices stand in for the accelerator's)."""
    if accelerator not in ACCELERATORS:
        raise UserError(f"--accelerator {accelerator}: choose one of {', '.join(ACCELERATORS)}")
    acc = ACCELERATORS[accelerator]
    mcfg = model_config(cfg.model.name)
    mesh = make_mesh(cfg.mesh, devices, cfg=mcfg)
    d, m = mesh.shape["data"], mesh.shape["model"]
    dtype = jnp.dtype(cfg.model.dtype)
    rollout_dtype = jnp.dtype(cfg.model.rollout_dtype)
    masters = decoder.abstract_params(mcfg, dtype)
    masters = abstract(masters, param_shardings(masters, mcfg, mesh))
    n_params = sum(x.size for x in jax.tree.leaves(masters))
    batch = decode_batch(cfg, d)
    slots = block_length(cfg.episode.context_limit) + DECODE_CHUNK
    report(f"plan: {cfg.model.name} ({n_params / 1e9:.2f}B parameters) on mesh {d}x{m} of "
           f"{mesh.devices.flat[0].platform} devices standing in for {acc.name}; compiling...")
    decode, rollout_params, cache = plan_decode(mcfg, replica_meshes(mesh)[0], batch, slots, rollout_dtype)
    es_update = plan_es_update(masters, cfg.es.core()) if "es" in programs else None
    grad = apply = None
    rows = (0, 0)
    if "grpo" in programs:
        grad, apply, rows = plan_grpo(masters, mcfg, cfg, mesh)
    kv = device_bytes(cache)
    return Plan(model=cfg.model.name, config=mcfg, n_params=n_params, mesh=(d, m), accelerator=acc, batch=batch,
                slots=slots, master_bytes=device_bytes(masters), rollout_bytes=device_bytes(rollout_params),
                kv_bytes=kv, kv_row_bytes=kv / batch, decode=decode, es_update=es_update, grpo_grad=grad,
                grpo_apply=apply, grpo_rows=rows)


def _gb(x: float) -> str:
    return f"{x / GB:8.2f} GB" if x >= 0.1 * GB else f"{x / 1e6:8.2f} MB"


def format_plan(plan: Plan) -> list[str]:
    a, (d, m) = plan.accelerator, plan.mesh
    out = [f"model {plan.model}: {plan.n_params / 1e9:.2f}B parameters; mesh {d}x{m} ({d} rollout replicas x "
           f"{m}-way model parallel); per device, planned for {a.name} ({a.memory_bytes / GB:.0f} GB, "
           f"{a.bandwidth / 1e12:.2f} TB/s, {a.bf16_flops / 1e12:.0f} TFLOP/s bf16)",
           f"  parameters: float32 masters {_gb(plan.master_bytes)}, rollout copy {_gb(plan.rollout_bytes)}",
           f"  KV cache at full context ({plan.batch} rows x {plan.slots} slots): {_gb(plan.kv_bytes)} "
           f"({plan.kv_row_bytes / 1e6:.1f} MB per row)",
           f"  {'program (compiled for this mesh)':44s} {'arguments':>11s} {'temporaries':>11s} {'compile':>8s}"]
    for p in (plan.decode, plan.es_update, plan.grpo_grad, plan.grpo_apply):
        if p is not None:
            out.append(f"  {p.name:44s} {_gb(p.arguments)} {_gb(p.temporaries)} {p.compile_s:7.1f}s")
    flops, nbytes = plan.minimal_step()
    for what, f, b in (("compiler's cost analysis", plan.decode.flops, plan.decode.bytes_accessed),
                       ("counted (weights + KV read once)", flops, nbytes)):
        t = plan.roofline_s(f, b)
        bound = "memory" if b / a.bandwidth >= f / a.bf16_flops else "compute"
        out.append(f"  decode step, {what}: {f / 1e9:.1f} GFLOP, {b / GB:.2f} GB; per token {f / plan.batch / 1e9:.2f} "
                   f"GFLOP, {b / plan.batch / 1e6:.1f} MB; roofline {t * 1e3:.2f} ms/step ({bound}-bound), "
                   f"{plan.batch / t:,.0f} tokens/s per replica, {d * plan.batch / t:,.0f} on the mesh")
    for algo, prog in (("es", plan.es_update), ("grpo", plan.grpo_grad)):
        if prog is None:
            continue
        total = plan.total(algo)
        extra = f" with a {plan.grpo_rows[0]} x {plan.grpo_rows[1]}-token micro-batch" if algo == "grpo" else ""
        out.append(f"  {algo.upper()} run per device{extra}: {_gb(total)} of {a.memory_bytes / GB:.0f} GB: "
                   + ("fits" if total <= a.memory_bytes else
                      f"does not fit; {plan.rows_that_fit(algo)} rollout rows would fit at full context"))
    return out


def check_fits(plan: Plan, algo: str) -> None:
    """A one-line error when the run of `algo` does not fit the accelerator, with what would."""
    a = plan.accelerator
    total = plan.total(algo)
    if total <= a.memory_bytes:
        return
    raise UserError(
        f"does not fit: algo={algo} on mesh {plan.mesh[0]}x{plan.mesh[1]} needs {total / GB:.1f} GB per device and "
        f"{a.name} has {a.memory_bytes / GB:.0f} GB (KV cache {plan.kv_bytes / GB:.1f} GB for {plan.batch} rows at "
        f"full context); {plan.rows_that_fit(algo)} rows would fit: lower es.tasks_per_member or "
        "episode.context_limit, or use a larger model axis or --accelerator")


def run(cfg: TrainConfig, accelerator: str = "h100", devices=None) -> int:
    """The --plan entry point: compile, print the report, and fail (exit 2) when the run does not fit."""
    plan = make_plan(cfg, accelerator, devices, report=lambda s: print(s, flush=True))
    print("\n".join(format_plan(plan)), flush=True)
    check_fits(plan, cfg.algo)
    return 0
