"""Every sweep definition composes, and its sweep parameters name real options."""
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
SWEEPS = sorted(p.stem for p in (ROOT / "sweeps").glob("*.yaml"))


@pytest.mark.parametrize("name", SWEEPS)
def test_sweep_composes_and_its_options_exist(name):
    out = subprocess.run([sys.executable, "run.py", f"sweep={name}", "--cfg", "hydra"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    params = yaml.safe_load(out.stdout)["hydra"]["sweeper"]["params"]
    assert params, name
    for key, values in params.items():
        if "." not in key and key != "seed":  # a config group: every option must be a file in conf/<group>
            for option in str(values).split(","):
                assert (ROOT / "conf" / key / f"{option}.yaml").exists(), (name, key, option)
