"""scripts/gpu_smoke.sh's Python part on CPU with its tiny config: it decodes, runs an ES update and reports both
next to the plan's numbers for the same shapes (on a GPU it does the same with Qwen2.5-7B's shapes)."""

import json
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent


def test_gpu_smoke_script_runs_its_tiny_config_on_cpu():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHON=sys.executable, PYTHONPATH=str(REPO),
               JAX_COMPILATION_CACHE_DIR=str(REPO / ".cache" / "jax"))
    env.pop("XLA_FLAGS", None)
    done = subprocess.run(["bash", "scripts/gpu_smoke.sh", "--tiny", "--json"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout)
    assert (out["batch"], out["new_tokens"], out["population"], out["platform"]) == (4, 16, 4, "cpu")
    assert out["tokens_per_s"] > 0 and out["update_seconds"] > 0 and out["decode_seconds"] > 0
    assert out["plan_tokens_per_s"] > 0 and out["plan_bytes"] > 0 and out["n_params"] > 0
    assert out["peak_bytes"] is None or out["peak_bytes"] > 0  # CPU devices keep no memory statistics


def test_gpu_smoke_rejects_bad_sizes_in_one_line():
    from asyncres_jax.benchmarks import smoke

    assert smoke.main(["--batch", "0"]) == 2
