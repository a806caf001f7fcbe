"""tools/plan.py end to end: table, JSON, --evaluate, --write, --plot, --profile-local, presets, errors."""

import importlib.util
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

import llmtrain.planner
from llmtrain.config import ConfigError, load, validate_world
from llmtrain.planner.cluster.files import PRESETS, load_cluster, preset_names

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("plan_tool", ROOT / "tools" / "plan.py")
plan_tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plan_tool)


@pytest.fixture
def model_yaml(tmp_path):
    path = tmp_path / "model.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "model": {"arch": "llama", "num_layers": 16, "hidden_size": 2048, "num_attention_heads": 16,
                          "num_kv_heads": 4, "vocab_size": 32000, "seq_length": 2048},
                "train": {"global_batch_size": 128, "micro_batch_size": 1, "precision": "bf16"},
            }
        )
    )  # fmt: skip
    return path


def run_plan(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """tools/plan.py as a user runs it: its own process, through llmtrain.cli.run_tool."""
    return subprocess.run(
        [sys.executable, str(ROOT / "tools" / "plan.py"), *args], cwd=cwd, capture_output=True, text=True
    )


@pytest.mark.slow  # multi-second (4 s on two idle cores): runs in CI, not in -m 'not slow'
def test_json_evaluate_write_and_plot(model_yaml, tmp_path, capsys):
    best, png = tmp_path / "best.yaml", tmp_path / "plan.png"
    search = ["--config", str(model_yaml), "--cluster", "a100-80gb", "--gpus", "16", "--top", "3", "--json",
              "--evaluate", "parallel.tp=2 parallel.pp=2"]  # fmt: skip
    argv = [*search, "--write", str(best), "--plot", str(png)]
    assert plan_tool.main(argv) == 0
    printed = json.loads(capsys.readouterr().out)
    records = printed["layouts"]
    why = printed["explanation"]
    assert why["step_time_s"] == records[0]["step_time_s"] == pytest.approx(sum(why["time_s"].values()))
    assert printed["per_layer"] is None
    assert len(records) == 3 and all(r["tp"] == 2 and r["pp"] == 2 and r["dp"] == 4 for r in records)
    assert records[0]["step_time_s"] <= records[1]["step_time_s"]
    job = load(best)
    assert (job.parallel.tp, job.parallel.pp, validate_world(job, 16)) == (2, 2, 4)
    assert png.stat().st_size > 10_000
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "best.yaml",
        "model.yaml",
        "plan.png",
    ]  # no temp left

    # A second run must not replace the files (the user may have edited best.yaml) unless asked to.
    best.write_text(best.read_text() + "# my edits\n")
    edited = best.read_text()
    for output in (["--write", str(best)], ["--plot", str(png)]):
        with pytest.raises(ConfigError, match="already exists; choose another path, or pass --overwrite"):
            plan_tool.main([*search, *output])
    assert best.read_text() == edited
    assert plan_tool.main([*argv, "--overwrite"]) == 0
    assert "# my edits" not in best.read_text() and load(best).parallel.tp == 2


def test_table_and_errors_raised_to_run_tool(model_yaml, capsys):
    assert plan_tool.main(["--config", str(model_yaml), "--gpus", "8", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "step_s" in out and "TFLOP/s" in out
    with pytest.raises(ConfigError, match="cluster file nowhere.yaml does not exist"):
        plan_tool.main(["--config", str(model_yaml), "--gpus", "8", "--cluster", "nowhere.yaml"])
    with pytest.raises(ConfigError, match="not a planner setting"):
        plan_tool.main(["--config", str(model_yaml), "--gpus", "8", "--evaluate", "parallel.tpp=2"])


def test_a_user_error_is_one_line_without_traceback(model_yaml):
    done = run_plan("--config", str(model_yaml), "--gpus", "8", "--cluster", "nowhere.yaml")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == (
        "plan: error: cluster file nowhere.yaml does not exist; pass a YAML path or a preset "
        f"({', '.join(preset_names())})\n"
    )
    debug = run_plan("--config", str(model_yaml), "--gpus", "8", "--cluster", "nowhere.yaml", "--debug")
    assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_help_imports_neither_torch_nor_the_planner():
    code = (
        "import runpy, sys\n"
        f"sys.argv = [{str(ROOT / 'tools' / 'plan.py')!r}, '--help']\n"
        "try:\n"
        "    runpy.run_path(sys.argv[0], run_name='__main__')\n"
        "except SystemExit as done:\n"
        "    assert done.code == 0\n"
        "heavy = [m for m in sys.modules if m.split('.')[0] in ('torch', 'yaml', 'matplotlib')\n"
        "         or m.startswith(('llmtrain.planner', 'llmtrain.config'))]\n"
        "print('imported:', heavy, file=sys.stderr)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "--profile-local" in done.stdout and done.stderr.strip() == "imported: []"


@pytest.mark.slow  # 2 s: with the whole suite, not the quick subset
def test_presets_ship_in_the_package_and_a_users_file_still_works(model_yaml, tmp_path):
    assert preset_names() == [
        "a100-40gb",
        "a100-80gb",
        "h100-80gb",
        "h100-96gb-500w",
        "h200-141gb",
        "mixed-h100-a100",
    ]
    assert Path(str(PRESETS)) == Path(llmtrain.planner.__file__).parent / "clusters"
    assert not (ROOT / "configs" / "clusters").exists()
    # A user's own cluster file, written with YAML 1.2 exponents (read as numbers, not strings).
    mine = tmp_path / "mine.yaml"
    mine.write_text(
        (PRESETS / "h100-80gb.yaml")
        .read_text()
        .replace("name: dgx-h100-80gb", "name: my-h100s")
        .replace("latency_us: 8,", "latency_us: 8e0,")
        .replace("count: 512", "count: 2")
    )
    assert load_cluster(mine).inter.latency_us == 8.0 and load_cluster(mine).num_devices == 16
    # Run from a folder outside the repository: neither the preset name nor the path depends on the cwd.
    for cluster in ("h100-80gb", str(mine)):
        done = run_plan("--config", str(model_yaml), "--cluster", cluster, "--gpus", "16", "--top", "1",
                        "--json", cwd=tmp_path)  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["layouts"][0]["fits"]


@pytest.mark.slow  # builds a wheel (several seconds)
def test_a_wheel_carries_the_presets_and_the_reference_table(tmp_path):
    # Build from a copy: the build writes build/ and *.egg-info beside setup.py, not into the working tree.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.py", "pyproject.toml"):
        shutil.copy(ROOT / name, src)
    for package in ("llmtrain", "kernels"):
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            ".",
        ],
        cwd=src,
        check=True,
    )
    (wheel,) = tmp_path.glob("llmtrain-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {f"llmtrain/planner/clusters/{n}.yaml" for n in preset_names()}
    shipped.add("llmtrain/planner/data/megatron_a100_2021.csv")
    assert shipped <= names


@pytest.mark.slow  # two gloo processes
def test_profile_local_writes_a_loadable_cluster(tmp_path, capsys):
    out = tmp_path / "local.yaml"
    assert plan_tool.main(["--profile-local", "--output", str(out)]) == 0
    view = load_cluster(out).view(2)
    assert view.device.peak_tflops["fp32"] > 0 and view.intra.bandwidth_gbs > 0 and view.intra.latency_us > 0
    with pytest.raises(ConfigError, match="already exists"):
        plan_tool.main(["--profile-local", "--output", str(out)])


@pytest.mark.slow  # two gloo processes
def test_link_measurement_reports_a_dead_worker_instead_of_waiting():
    from llmtrain.planner.calibration.profile import measure_gloo

    # The workers fail allocating a negative-sized buffer; the error names the exit codes it reacted to
    # (the old blind wait was 300 s; a hang now fails at the suite's timeout).
    with pytest.raises(RuntimeError, match=r"ended without a result \(.*exit [1-9]"):
        measure_gloo(mbytes=-1)


def test_memory_prints_the_per_rank_breakdown_of_the_configs_layout(capsys):
    config = str(ROOT / "configs" / "llama3-70b.yaml")
    # pp=4: at tp=4 pp=1 the gradients FSDP2 keeps unsharded over the micro-batches (65.7 GiB) do not fit.
    zero3 = "parallel.tp=4 parallel.pp=4 parallel.zero_stage=3 model.recompute=full"
    assert plan_tool.main(["--config", config, "--cluster", "h100-80gb", "--gpus", "64", "--memory",
                           "--evaluate", zero3]) == 0  # fmt: skip
    whole = capsys.readouterr().out
    for row in ("parameters", "gradients", "optimizer state", "activations", "gathered buffers",
                "communication buffers", "steady state", "startup peak", "of 80 GiB"):  # fmt: skip
        assert row in whole
    assert "fits" in whole
    old = ["--software", "llmtrain-whole-model", "--evaluate", zero3]
    cluster = ["--config", config, "--cluster", "h100-80gb", "--gpus", "64", "--memory"]
    assert plan_tool.main([*cluster, *old]) == 0
    assert "DOES NOT FIT" in (out := capsys.readouterr().out) and "needs sharded construction" in out
    # Offload runs through the DeepSpeed engine: data parallelism only.
    offload = "parallel.tp=1 parallel.sequence_parallel=false parallel.zero_stage=3 model.recompute=full "
    offload += "parallel.offload=optimizer+params"
    sharded = ["--evaluate", offload, "--json"]
    assert (
        plan_tool.main(["--config", config, "--cluster", "h100-80gb", "--gpus", "64", "--memory", *sharded])
        == 0
    )
    record = json.loads(capsys.readouterr().out)
    assert record["offload"] == "optimizer+params"
    assert record["memory_breakdown_gb"]["optimizer"] == 0 and record["memory_breakdown_gb"]["host"] > 16
    # ...but DeepSpeed is handed the model built whole in fp32 on every rank: 70.6e9 x 4 bytes do not start.
    assert not record["fits"] and record["memory_breakdown_gb"]["startup"] > 263
    with pytest.raises(ConfigError, match="needs zero_stage 2 or 3"):
        plan_tool.main(
            ["--config", config, "--gpus", "64", "--memory", "--evaluate", "parallel.offload=optimizer"]
        )


def test_the_choice_is_explained_and_per_layer_plans_are_written_for_the_trainer(tmp_path, capsys):
    # 8 layers at 8k tokens on a device of 15 GB: whole-model recomputation is needed, on some layers only.
    model = tmp_path / "model.yaml"
    model.write_text(
        yaml.safe_dump(
            {
                "model": {"arch": "llama", "num_layers": 8, "hidden_size": 2048, "num_attention_heads": 16,
                          "num_kv_heads": 4, "vocab_size": 32000, "seq_length": 8192},
                "train": {"global_batch_size": 2, "micro_batch_size": 1, "precision": "bf16"},
            }
        )
    )  # fmt: skip
    small = tmp_path / "small.yaml"
    small.write_text((PRESETS / "h100-80gb.yaml").read_text().replace("memory_gb: 80", "memory_gb: 15"))
    base = ["--config", str(model), "--cluster", str(small), "--gpus", "1", "--top", "3"]
    assert plan_tool.main(base) == 0
    text = capsys.readouterr().out
    assert "why tp=1 pp=1 dp=1" in text and "memory per rank (the fullest)" in text
    assert "runners-up (best of each other" in text and "does not fit: " in text
    assert plan_tool.main([*base, "--no-explain"]) == 0
    assert "why " not in capsys.readouterr().out
    written = tmp_path / "per-layer.yaml"
    assert plan_tool.main([*base, "--per-layer", "--write", str(written)]) == 0
    text = capsys.readouterr().out
    assert "per-layer search" in text and "recompute per layer: 0-" in text
    job = load(written)
    assert validate_world(job, 1) == 1
    assert set(job.model.recompute_layers) == {"full", "none"} and job.parallel.stage_layers == [8]
    assert plan_tool.main([*base, "--per-layer", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["per_layer"]["recompute_layers"] == job.model.recompute_layers and out["per_layer"]["gain"] > 0
