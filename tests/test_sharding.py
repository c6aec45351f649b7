"""Runs `tests/multidevice/` in a fresh process with 8 host CPU devices.

XLA's device count is fixed when JAX starts, so the multi-device tests cannot share this
process with the rest of the suite.
"""

import os
import pathlib

from helpers import run_script


def test_multidevice_suite():
    env = dict(os.environ)
    env["XLA_FLAGS"] = (
        env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()
    env["NVFP4X_MULTIDEVICE"] = "1"
    here = pathlib.Path(__file__).parent
    args = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0", str(here / "multidevice")]
    proc = run_script(args, cwd=here.parent, env=env, timeout=1500)
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1]
