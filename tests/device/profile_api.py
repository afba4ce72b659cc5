"""Run serve.py under cProfile and write the API process's profile to $PROF_OUT on exit.

    env PROF_OUT=api.prof python tests/device/profile_api.py [serve.py flags]

Only the API process is profiled (the engine core is a process of its own). cProfile measures
wall time, so a thread that waits (the pipe reader) shows its waits too. `measure.sh api-profile`
runs it under a closed loop of 256 streams and prints the top of the profile.
"""
import cProfile
import os
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.argv = [str(ROOT / "serve.py")] + sys.argv[1:]
profile = cProfile.Profile()
profile.enable()
try:
    runpy.run_path(str(ROOT / "serve.py"), run_name="__main__")
except SystemExit:
    pass
finally:
    profile.disable()
    profile.dump_stats(os.environ.get("PROF_OUT", "api.prof"))
