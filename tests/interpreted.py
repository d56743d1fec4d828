"""Run a test file as a script under TRITON_INTERPRET=1 and read back the results it prints.

Triton reads TRITON_INTERPRET when it is first imported, and the rest of the suite may already have
imported it without the variable, so kernel checks run in one fresh subprocess per test file."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_interpreted(script: str) -> dict:
    """`python <script>` with TRITON_INTERPRET=1; the JSON object on its last stdout line."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
