"""Runs `tests/multidevice/` in a fresh process with 8 host CPU devices.

XLA's device count is fixed when JAX starts, so the multi-device tests cannot share this
process with the rest of the suite.
"""

import os
import pathlib
import subprocess
import sys


def test_multidevice_suite():
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
    env["NVFP4X_MULTIDEVICE"] = "1"
    here = pathlib.Path(__file__).parent
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-n",
            "0",
            str(here / "multidevice"),
        ],
        cwd=here.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1]
