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


def opcheck_pair(forward_op, forward_args: tuple, backward_op, backward_args: tuple) -> dict:
    """torch.library.opcheck of a custom op (give it requires_grad inputs, so its autograd registration is
    checked) and of the custom op its backward calls: test name -> result, the backward's prefixed."""
    import torch

    forward = torch.library.opcheck(forward_op, forward_args)
    backward = torch.library.opcheck(backward_op, backward_args)
    return {**forward, **{f"backward_{k}": r for k, r in backward.items()}}


def compile_against_eager(fn, run, op_name: str, names: list[str]) -> dict:
    """run(fn) -> tensors (outputs, then gradients) eager and under torch.compile(backend="aot_eager",
    fullgraph=True): {"frames": frames compiled, "ops_in_graph": op_name in every graph's code, "mismatches":
    the names of the tensors that differ beyond torch.allclose}."""
    import torch
    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    eager = run(fn)
    compiled = run(torch.compile(fn, backend=counter, fullgraph=True))
    return {"frames": counter.frame_count, "ops_in_graph": all(op_name in g.code for g in counter.graphs),
            "mismatches": [n for n, a, b in zip(names, compiled, eager) if not torch.allclose(a, b)]}
