"""Run several command lines (``python -m MODULE ARGS...``) one after another in one Python process:
``python tests/batch_cli.py jobs.json results.json``.

Each job's ``MODULE.main(ARGS)`` runs as ``python -m`` would run it (``sys.argv``, its return value or
``SystemExit`` as the exit code, an uncaught exception printed as a traceback with exit code 1), with
file descriptors 1 and 2 redirected to files of its own, so everything that reaches them (Python,
logging handlers made earlier, C libraries) lands in the job's ``stdout`` / ``stderr``.  What it saves
is the interpreter start and the imports of torch and Megatron per command (seconds each); the
bad-input battery (tests/test_bad_inputs.py) runs its cases this way.

jobs.json: ``[{"name": ..., "module": ..., "args": [...]}, ...]``; results.json:
``{name: {"code": int, "stdout": str, "stderr": str}}``.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import tempfile
import traceback


def _run(module: str, args) -> int:
    saved_argv = sys.argv
    sys.argv = [module, *args]
    try:
        code = importlib.import_module(module).main(list(args))
    except SystemExit as e:
        code = e.code
    except BaseException:  # noqa: BLE001 - what `python -m` would print: a traceback, exit 1
        traceback.print_exc()
        code = 1
    finally:
        sys.argv = saved_argv
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)  # sys.exit("message"): printed, exit 1
    return 1


def main(jobs_path: str, results_path: str) -> int:
    with open(jobs_path, encoding="utf-8") as f:
        jobs = json.load(f)
    results = {}
    for job in jobs:
        with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
            sys.stdout.flush()
            sys.stderr.flush()
            keep = os.dup(1), os.dup(2)
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            try:
                code = _run(job["module"], job["args"])
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(keep[0], 1)
                os.dup2(keep[1], 2)
                os.close(keep[0])
                os.close(keep[1])
            out.seek(0)
            err.seek(0)
            results[job["name"]] = {"code": code, "stdout": out.read(), "stderr": err.read()}
    with open(results_path, "w", encoding="utf-8") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
