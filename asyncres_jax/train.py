"""The main job: `python -m asyncres_jax.train --config configs/NAME.yaml [--mesh DxM] [key=value ...]`.

    python -m asyncres_jax.train --mesh 8x1                                    # the built-in default on 8 devices
    python -m asyncres_jax.train --config configs/smollm2_cpu.yaml            # the CPU default
    python -m asyncres_jax.train --config configs/qwen2_5_7b_async1.yaml --mesh 4x1
    python -m asyncres_jax.train --config C.yaml --cpu-devices 8 --mesh 4x2   # simulate 8 devices on a CPU
    python -m asyncres_jax.train --config C.yaml --mesh 8x1 --cpu-devices 8 --plan  # compile only: memory, roofline
    python -m asyncres_jax.train --config C.yaml --resume                      # continue RUN_DIR (also automatic)
    python -m asyncres_jax.train --config C.yaml --coordinator HOST:PORT --num-processes P --process-id I
    python -m asyncres_jax.train export --checkpoint RUN_DIR --out HF_DIR     # weights as HF safetensors
    python -m asyncres_jax.train --help-config                                 # every option, documented

The learner (float32 masters on the whole DxM mesh) and D rollout replicas (1xM sub-meshes) share one
process: the rollout pool's workers run ES jobs on the replicas and the cohort commits happen on the learner.
Every `checkpoint.every` updates the pool drains (in-flight jobs finish and are accounted), the whole state
is checkpointed with Orbax, and the pool resumes. SIGINT/SIGTERM: drain, checkpoint, remove sandboxes, exit 0;
a second signal exits at once (sandboxes removed, no thread or process left).

Without --config the built-in default runs: the CPU default (configs/smollm2_cpu.yaml) with the sandbox chosen
from what the machine has (sandbox.backend=auto) in runs/default; when the overrides name a dataset
(tasks.dataset=...), the schema defaults are underneath instead. A mesh asks for D*M devices: with fewer, one
line names the meshes that fit and --cpu-devices. Workers per replica follow the population and the mesh
(trainer.rollout_workers).

RUN_DIR holds: config.yaml (the resolved config), manifest.json (git revision, package versions, mesh and
devices of every session), metrics.jsonl (one line per update) and checkpoints/.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

from asyncres_jax import hostmem

USAGE = __doc__.split("\n\n")[1]
DEFAULT_CONFIG = pathlib.Path(__file__).resolve().parent.parent / "configs" / "smollm2_cpu.yaml"
DEFAULT_OVERRIDES = ["sandbox.backend=auto", "run_dir=runs/default"]


def _parse(argv: list[str]) -> argparse.Namespace:
    if argv[:1] == ["export"]:
        p = argparse.ArgumentParser(prog="python -m asyncres_jax.train export",
                                    description="Write a checkpoint's parameters as a Hugging Face model folder.")
        p.add_argument("--checkpoint", required=True,
                       help="a run directory (latest checkpoint), RUN_DIR/checkpoints, or RUN_DIR/checkpoints/STEP")
        p.add_argument("--out", required=True, help="output folder (config.json, model.safetensors, tokenizer)")
        p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                       help="dtype of the written weights")
        p.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")
        ns = p.parse_args(argv[1:])
        ns.command = "export"
        return ns
    p = argparse.ArgumentParser(prog="python -m asyncres_jax.train", usage=None,
                                description="Train an LLM agent with bounded-staleness asynchronous ES.",
                                epilog="overrides: dotted key=value pairs, e.g. es.population=8 pool.max_staleness=2; "
                                       "see --help-config. Subcommand: export --checkpoint DIR --out HF_DIR.")
    p.add_argument("--config", help="YAML run config (configs/*.yaml); without it the built-in default (the CPU "
                                    "default, sandbox chosen from the machine, run_dir runs/default), or the schema "
                                    "defaults when tasks.dataset= is given")
    p.add_argument("--mesh", help="DxM device mesh: D rollout replicas x M-way model parallel (overrides mesh=)")
    p.add_argument("--cpu-devices", type=int, metavar="N",
                   help="simulate N CPU devices (sets XLA_FLAGS before JAX starts)")
    p.add_argument("--plan", action="store_true",
                   help="compile only: per-device memory and decode roofline of this config on --mesh, from the "
                        "model's config.json (no weights, nothing runs; docs/scaling.md)")
    p.add_argument("--accelerator", default="h100", choices=("h100", "h200", "v5e"),
                   help="with --plan: the accelerator to plan for (memory, bandwidth, FLOP/s)")
    p.add_argument("--resume", action="store_true", help="continue the run in run_dir (an error if there is none)")
    p.add_argument("--coordinator", metavar="HOST:PORT",
                   help="several processes (hosts): process 0's address for jax.distributed (docs/scaling.md); "
                        "default: JAX_COORDINATOR_ADDRESS, or the SLURM/OpenMPI launcher's")
    p.add_argument("--num-processes", type=int, metavar="P", help="processes in the run (JAX_NUM_PROCESSES)")
    p.add_argument("--process-id", type=int, metavar="I", help="this process's index 0..P-1 (JAX_PROCESS_ID)")
    p.add_argument("--overwrite", action="store_true", help="delete an existing run in run_dir and start afresh")
    p.add_argument("--help-config", action="store_true", help="list every config option with its default and doc")
    p.add_argument("overrides", nargs="*", help="key=value config overrides")
    ns = p.parse_intermixed_args(argv)  # overrides may come before or after the options
    ns.command = "train"
    return ns


def _setup_devices(cpu_devices: int | None) -> None:
    """XLA reads its flags when the backend starts, so this runs before anything touches a device."""
    from asyncres_jax.errors import UserError

    if cpu_devices is None:
        return
    if cpu_devices < 1:
        raise UserError(f"--cpu-devices {cpu_devices}: give a positive number of simulated devices")
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={cpu_devices}"])
    os.environ["JAX_PLATFORMS"] = "cpu"


def main(argv: list[str] | None = None) -> int:
    from asyncres_jax.errors import cli_main

    return cli_main(_main)(sys.argv[1:] if argv is None else argv)


def _main(argv: list[str]) -> int:
    ns = _parse(argv)
    if ns.command == "train" and ns.help_config:
        from asyncres_jax.config import describe

        print("\n".join(describe()))
        return 0
    from asyncres_jax import distributed

    if ns.command == "train" and ns.plan:
        _setup_devices(ns.cpu_devices)
        import jax

        from asyncres_jax import plan

        cfg = _load(ns)
        check_devices(cfg.mesh, len(jax.devices()))
        return plan.run(cfg, ns.accelerator)
    if ns.command == "train":
        hostmem.limit_malloc_arenas()
        _setup_devices(ns.cpu_devices)
        distributed.initialize(distributed.resolve(ns.coordinator, ns.num_processes, ns.process_id))
    import jax  # after the device flags

    from asyncres_jax import run, trainer

    run.compilation_cache()
    if ns.command == "export":
        run.export(ns.checkpoint, ns.out, dtype=ns.dtype, overwrite=ns.overwrite)
        return 0
    cfg = _load(ns)
    check_devices(cfg.mesh, len(jax.devices()))  # before the dataset or the model are looked at
    distributed.check_config(cfg)
    return trainer.train(cfg, resume=ns.resume, overwrite=ns.overwrite, handle_signals=True, argv=argv)


def _load(ns: argparse.Namespace):
    """The config of the command line: --config (or the built-in default), overrides, then --mesh."""
    from asyncres_jax.config import load_config
    from asyncres_jax.errors import UserError

    path, overrides = ns.config, list(ns.overrides)
    if path is None and not any(o.startswith("tasks.dataset=") for o in overrides):
        if not DEFAULT_CONFIG.is_file():
            raise UserError(f"the built-in default {DEFAULT_CONFIG} is missing (an installed copy without configs/); "
                            "pass --config FILE")
        path, overrides = DEFAULT_CONFIG, DEFAULT_OVERRIDES + overrides
    return load_config(path, overrides + ([f"mesh={ns.mesh}"] if ns.mesh else []))


def check_devices(mesh: str, available: int) -> None:
    """A mesh asking for more devices than the machine has: one line with the meshes that fit and --cpu-devices."""
    from asyncres_jax.errors import UserError
    from asyncres_jax.mesh import parse_mesh, valid_meshes

    d, m = parse_mesh(mesh)
    if d * m > available:
        raise UserError(f"mesh {d}x{m} needs {d * m} devices but this machine has {available}; meshes that fit: "
                        f"{', '.join(valid_meshes(available))}; or simulate {d * m} CPU devices with "
                        f"--cpu-devices {d * m}")



if __name__ == "__main__":
    sys.exit(main())
