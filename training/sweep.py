"""Scaling-law sweeps: a grid of ordinary pre-training runs ("arms"), run, collected and fitted.

A sweep file (``configs/sweeps/*.yaml``)::

    name: tiny-cpu
    base: configs/pretrain/default-tiny.yaml   # the pre-training config every arm starts from
    out_dir: runs/sweeps/tiny-cpu               # arms go to <out_dir>/arms/<arm>, tables to <out_dir>/summary
    overrides: {run.eval_interval: 0}           # dotted keys for every arm
    grid:                                       # axes: variants, sizes, steps, seeds
      variants:                                 # name -> preset (+ n, k, m, hc, overrides)
        vanilla: {preset: tiny-moe:vanilla}
        mhc-n2: {preset: tiny-moe:mhc, n: 2}
      sizes: {base: {}}                         # name -> backbone overrides (hidden_size, num_layers, ...)
      steps: [40, 80, 160]                      # token budgets, in optimizer steps
      seeds: [1234]
    executor: {parallel: 1, nproc: 1, threads: 1, slurm: {nodes: 1, sbatch_args: []}}
    fit: {loss: valid, E: shared, baselines: [vanilla, mhc-n4], bootstrap: 200}

Every arm is one ``python -m training.pretrain`` run in its own ``run.dir`` (under ``torchrun`` when
``executor.nproc`` > 1), so checkpoints, ``checkpoint.load: auto`` resume, ``metrics.jsonl`` and
``status.json`` hold per arm.  :func:`load_sweep` resolves and validates every arm before anything
starts; :func:`run_local` skips finished arms and resumes the others; :func:`collect` reads the
arm directories into one table; :func:`fit_sweep` fits the laws of :mod:`xhc.scaling_fit`.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from configs import resolve_config
from training.config import ConfigError, load_config, pad_vocab_size

__all__ = ["SweepError", "Arm", "Sweep", "load_sweep", "run_local", "slurm_commands", "collect", "fit_sweep",
           "write_table", "ARM_STATE", "TOP_KEYS", "GRID_AXES"]

TOP_KEYS = ("name", "description", "base", "out_dir", "overrides", "grid", "executor", "fit")
GRID_AXES = ("variants", "sizes", "steps", "seeds")
VARIANT_KEYS = ("preset", "n", "k", "m", "hc", "overrides")
EXECUTOR_KEYS = ("parallel", "nproc", "threads", "slurm")
FIT_KEYS = ("loss", "E", "baselines", "bootstrap", "compute", "target_loss", "level", "seed", "tail_fraction")
ARM_STATE = "sweep_arm.json"
"""Per-arm record of the sweep runner (state, exit code, log, wall time) in the arm's run dir."""


class SweepError(ValueError):
    """A bad sweep file or sweep state; the message is one line naming the file and key."""


@dataclass
class Arm:
    """One pre-training run of the grid."""

    name: str
    variant: str
    size: str
    steps: int
    seed: int
    overrides: List[str]
    run_dir: str
    family: str = "vanilla"      # HC variant ("vanilla" for none)
    n: int = 1
    k: Optional[int] = None
    m: Optional[int] = None
    params_total: int = 0
    params_activated: int = 0
    params_hc: int = 0
    flops_per_token: float = 0.0
    tokens: int = 0
    nproc: int = 1

    @property
    def compute(self) -> float:
        return self.flops_per_token * self.tokens

    def command(self, base: Optional[str], python: str = sys.executable, port: Optional[int] = None) -> List[str]:
        """The launch command of this arm (``torchrun`` when it asks for more than one rank)."""
        args = (["--config", base] if base else []) + self.overrides
        if self.nproc > 1:
            return [python, "-m", "torch.distributed.run", "--nproc_per_node", str(self.nproc),
                    "--master_port", str(port or _free_port()), "-m", "training.pretrain"] + args
        return [python, "-m", "training.pretrain"] + args


@dataclass
class Sweep:
    name: str
    path: str
    base: Optional[str]
    out_dir: str
    arms: List[Arm]
    executor: Dict[str, Any] = field(default_factory=dict)
    fit: Dict[str, Any] = field(default_factory=dict)
    flops_convention: str = "megatron"

    @property
    def summary_dir(self) -> str:
        return os.path.join(self.out_dir, "summary")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _flatten(prefix: str, value: Any, out: List[str]) -> None:
    """``{a: {b: 1}}`` -> ``a.b=1`` (values as one-line YAML)."""
    import yaml

    if isinstance(value, dict) and not value and not prefix:
        return
    if isinstance(value, dict) and value:
        for k, v in value.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
        return
    text = yaml.safe_dump(value, default_flow_style=True, width=10 ** 6).strip()
    if text.endswith("\n..."):
        text = text[: -len("\n...")]
    text = text.removesuffix("...").strip()
    out.append(f"{prefix}={text}")


def _resolve_path(path: str, sweep_file: str) -> str:
    """The base pre-training config of a sweep file: as given if it exists, else a packaged one."""
    if os.path.isabs(path) or os.path.exists(path):
        return path
    return resolve_config(path, "pretrain")


def load_sweep(path: str, out_dir: Optional[str] = None, extra_overrides: Sequence[str] = ()) -> Sweep:
    """Read a sweep file and resolve + validate every arm (raises :class:`SweepError`, one line)."""
    import yaml

    from models.zoo import ZooError, load_preset
    from training.metrics import model_flops_per_token
    from xhc.accounting import backbone_params, hc_params_total
    from tools.zoo import backbone_shape

    path = resolve_config(path, "sweeps")
    if not os.path.isfile(path):
        raise SweepError(f"sweep file {path}: not found (shipped sweeps live in configs/sweeps/)")
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f) or {}
    except yaml.YAMLError as e:
        raise SweepError(f"sweep file {path}: not valid YAML: {str(e).splitlines()[0]}") from None
    where = f"sweep file {path}"
    if not isinstance(raw, dict):
        raise SweepError(f"{where}: must hold a mapping with keys {', '.join(TOP_KEYS)}")
    for k in raw:
        if k not in TOP_KEYS:
            raise SweepError(f"{where}: unknown key {k!r}; known: {', '.join(TOP_KEYS)}")
    grid = raw.get("grid")
    if not isinstance(grid, dict) or not grid:
        raise SweepError(f"{where}: grid is missing or empty; give grid.variants and grid.steps")
    for k in grid:
        if k not in GRID_AXES:
            raise SweepError(f"{where}: unknown grid axis {k!r}; axes: {', '.join(GRID_AXES)}")
    variants = grid.get("variants")
    if not isinstance(variants, dict) or not variants:
        raise SweepError(f"{where}: grid.variants is empty; name at least one variant with its preset")
    sizes = grid.get("sizes") or {"base": {}}
    if not isinstance(sizes, dict):
        raise SweepError(f"{where}: grid.sizes must map a size name to backbone overrides, e.g. {{c96: {{hidden_size: 96}}}}")
    steps = grid.get("steps")
    if not isinstance(steps, list) or not steps or not all(isinstance(s, int) and s > 0 for s in steps):
        raise SweepError(f"{where}: grid.steps must be a non-empty list of positive step counts, got {steps!r}")
    seeds = grid.get("seeds") or [None]
    if not isinstance(seeds, list) or not all(s is None or isinstance(s, int) for s in seeds):
        raise SweepError(f"{where}: grid.seeds must be a list of integers, got {seeds!r}")
    executor = dict(raw.get("executor") or {})
    for k in executor:
        if k not in EXECUTOR_KEYS:
            raise SweepError(f"{where}: unknown executor key {k!r}; known: {', '.join(EXECUTOR_KEYS)}")
    fit = dict(raw.get("fit") or {})
    for k in fit:
        if k not in FIT_KEYS:
            raise SweepError(f"{where}: unknown fit key {k!r}; known: {', '.join(FIT_KEYS)}")
    nproc = int(executor.get("nproc", 1))
    base = raw.get("base")
    if base:
        base = os.path.abspath(_resolve_path(str(base), path))
        if not os.path.isfile(base):
            raise SweepError(f"{where}: base {raw['base']!r} not found (a configs/pretrain/*.yaml file, or null)")
    common: List[str] = []
    _flatten("", raw.get("overrides") or {}, common)
    common += list(extra_overrides)
    if executor.get("threads"):
        common.append(f"run.num_threads={int(executor['threads'])}")
    name = str(raw.get("name") or os.path.splitext(os.path.basename(path))[0])
    out = os.path.abspath(out_dir or raw.get("out_dir") or os.path.join("runs", "sweeps", name))

    arms: List[Arm] = []
    convention = None
    for vname, v in variants.items():
        if not isinstance(v, dict) or "preset" not in v:
            raise SweepError(f"{where}: grid.variants.{vname} needs a preset, e.g. {{preset: tiny-moe:xhc, n: 8}}")
        for k in v:
            if k not in VARIANT_KEYS:
                raise SweepError(f"{where}: grid.variants.{vname}: unknown key {k!r}; known: {', '.join(VARIANT_KEYS)}")
        hc = dict(v.get("hc") or {})
        for k in ("n", "k", "m"):
            if k in v:
                hc[k] = v[k]
        for sname, sv in sizes.items():
            if not isinstance(sv, dict):
                raise SweepError(f"{where}: grid.sizes.{sname} must map backbone keys to values")
            for st in steps:
                for seed in seeds:
                    arm_name = vname + (f"-{sname}" if len(sizes) > 1 else "") + f"-{st}st" + \
                        (f"-seed{seed}" if len(seeds) > 1 else "")
                    ov = [f"model.preset={v['preset']}"]
                    _flatten("model.hc", hc, ov) if hc else None
                    _flatten("model.backbone", sv, ov) if sv else None
                    ov += [*common, f"run.train_steps={st}"]
                    _flatten("", v.get("overrides") or {}, ov)
                    if seed is not None:
                        ov.append(f"run.seed={seed}")
                    run_dir = os.path.join(out, "arms", arm_name)
                    ov += [f"run.dir={run_dir}", f"run.name={arm_name}", "checkpoint.load=auto"]
                    label = f"{where}: arm {arm_name}"
                    try:
                        cfg = load_config(base, ov)
                        preset = load_preset(cfg.model.preset, backbone_overrides=cfg.model.backbone or None,
                                             hc_overrides=cfg.model.hc or None)
                    except (ConfigError, ZooError) as e:
                        raise SweepError(f"{label}: {e}") from None
                    if cfg.checkpoint.dir:
                        raise SweepError(f"{label}: checkpoint.dir must be unset in a sweep (each arm keeps its "
                                         "checkpoints in its run dir)")
                    t = cfg.tokenizer
                    vocab = t.padded_vocab_size or pad_vocab_size(t.vocab_size, t.make_vocab_size_divisible_by,
                                                                  cfg.parallel.tp)
                    seq = cfg.batch.seq_length or preset.seq_length
                    flops = model_flops_per_token(preset, seq, vocab, cfg.logging.flops_convention, preset.hc)
                    shape = dataclasses.replace(backbone_shape(preset), seq_len=int(seq), vocab=int(vocab))
                    bp = backbone_params(shape)
                    hcp = hc_params_total(preset.hc, preset.hidden_size, preset.num_layers).total \
                        if preset.hc.enabled else 0
                    h = preset.hc
                    arms.append(Arm(
                        name=arm_name, variant=vname, size=sname, steps=st, seed=cfg.run.seed, overrides=ov,
                        run_dir=run_dir, family="vanilla" if not h.enabled else h.variant,
                        n=h.n if h.enabled else 1, k=getattr(h, "k", None) if h.is_xhc else None,
                        m=getattr(h, "m", None) if h.is_xhc else None,
                        params_total=bp.total + hcp, params_activated=bp.activated + hcp, params_hc=hcp,
                        flops_per_token=flops["total"], tokens=st * cfg.batch.global_batch_size * seq, nproc=nproc))
                    convention = cfg.logging.flops_convention
    names = [a.name for a in arms]
    if len(set(names)) != len(names):
        raise SweepError(f"{where}: two arms have the same name; make variant and size names distinct")
    baselines = fit.get("baselines", ["vanilla"] if "vanilla" in variants else [])
    for b in baselines:
        if b not in variants:
            raise SweepError(f"{where}: fit.baselines names {b!r}, which is not a variant ({', '.join(variants)})")
    return Sweep(name=name, path=path, base=base, out_dir=out, arms=arms, executor=executor, fit=fit,
                 flops_convention=convention or "megatron")


# ================================================================================================
# Arm state
# ================================================================================================
def _read_json(path: str) -> Optional[dict]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _write_json(path: str, obj: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)


def _pid_alive(pid: Optional[int]) -> bool:
    if not pid:
        return False
    try:
        os.kill(int(pid), 0)
    except (OSError, ValueError):
        return False
    return True


def arm_finished(arm: Arm) -> bool:
    st = _read_json(os.path.join(arm.run_dir, "status.json"))
    return bool(st and st.get("finished"))


def _tail_step(path: str) -> int:
    """The step of the last record of a metrics.jsonl (0 if none), reading only its end."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 4096))
            lines = f.read().decode("utf-8", "replace").strip().splitlines()
        for line in reversed(lines):
            try:
                return int(json.loads(line).get("step", 0))
            except ValueError:
                continue
    except OSError:
        pass
    return 0


def _last_error_line(log: str) -> str:
    try:
        with open(log, encoding="utf-8", errors="replace") as f:
            lines = [ln.strip() for ln in f.readlines()[-200:] if ln.strip()]
    except OSError:
        return ""
    for ln in reversed(lines):
        if ln.startswith("error:") or "Error" in ln.split(":")[0]:
            return ln[:200]
    return lines[-1][:200] if lines else ""


# ================================================================================================
# Local executor
# ================================================================================================
def _deathsig():
    """Child setup: receive SIGTERM when the sweep runner dies (so a killed runner's arms save and
    stop instead of training on unattended)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _prepare_data(sweep: Sweep, log) -> None:
    """Build the embedded default corpus/tokenizer once before parallel arms would race for it."""
    cfg = load_config(sweep.base, sweep.arms[0].overrides)
    if not cfg.uses_default_data:
        return
    from training.data import prepare_default_data

    kw = {} if cfg.data.default_target_mb is None else {"target_mb": cfg.data.default_target_mb}
    prepare_default_data(cfg.data.default_dir, vocab_size=cfg.tokenizer.vocab_size, seed=cfg.run.seed,
                         progress=False, log=None, **kw)


def run_local(sweep: Sweep, parallel: int = 1, log=print, poll_s: float = 0.5) -> Dict[str, str]:
    """Run every unfinished arm (``parallel`` at a time); returns arm name -> final state.

    Finished arms (``status.json``: finished) are skipped; unfinished ones resume from their
    checkpoints (``checkpoint.load=auto``).  A failed arm does not stop the sweep.  SIGTERM/SIGINT
    to the runner forwards SIGTERM to the running arms (they checkpoint and exit) and stops.
    """
    import resource

    from tqdm import tqdm

    t_start = time.time()
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu0 = ru.ru_utime + ru.ru_stime
    os.makedirs(sweep.out_dir, exist_ok=True)
    states: Dict[str, str] = {}
    todo: List[Arm] = []
    for a in sweep.arms:
        if arm_finished(a):
            states[a.name] = "finished"
        else:
            todo.append(a)
    total_c = sum(a.compute for a in sweep.arms) or 1.0
    done_c = sum(a.compute for a in sweep.arms if states.get(a.name) == "finished")
    log(f"[sweep] {sweep.name}: {len(sweep.arms)} arms, {len(states)} already finished, {len(todo)} to run "
        f"({parallel} at a time) -> {sweep.out_dir}")
    if todo:
        _prepare_data(sweep, log)
    running: Dict[str, tuple] = {}
    failed: List[str] = []
    stop = {"sig": None}

    def on_signal(signum, _frame):
        stop["sig"] = signum

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    bar = tqdm(total=100.0, initial=100.0 * done_c / total_c, unit="%", desc=f"sweep {sweep.name}",
               bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f}% [{elapsed}<{remaining}{postfix}]",
               file=sys.stderr, dynamic_ncols=True, mininterval=1.0)

    def finish(arm: Arm, proc, logf, t0, record):
        rc = proc.returncode
        logf.close()
        record["wall_s"] = record.get("wall_s", 0.0) + (time.time() - t0)
        record["pid"] = None
        record["returncode"] = rc
        if rc == 0 and arm_finished(arm):
            state = "finished"
        elif rc == 0 or stop["sig"] is not None:
            state = "stopped"
        else:
            state = "failed"
        record["state"] = state
        _write_json(os.path.join(arm.run_dir, ARM_STATE), record)
        states[arm.name] = state
        if state == "failed":
            failed.append(arm.name)
            bar.write(f"[sweep] arm {arm.name} failed (exit {rc}): see {record['log']}  "
                      f"[{_last_error_line(record['log'])}]")
        elif state == "finished":
            bar.write(f"[sweep] arm {arm.name} finished in {time.time() - t0:.0f}s")

    last_shown = [None, 0.0]
    try:
        while (todo or running) and stop["sig"] is None:
            while todo and len(running) < max(1, parallel) and stop["sig"] is None:
                arm = todo.pop(0)
                os.makedirs(arm.run_dir, exist_ok=True)
                rec_path = os.path.join(arm.run_dir, ARM_STATE)
                record = _read_json(rec_path) or {}
                if record.get("overrides") and record["overrides"] != arm.overrides:
                    raise SweepError(f"arm {arm.name}: {arm.run_dir} was started with other settings; use a new "
                                     "--out-dir or delete that arm's directory")
                while _pid_alive(record.get("pid")):  # a previous runner's arm still saving: let it finish
                    time.sleep(poll_s)
                logp = os.path.join(arm.run_dir, "train.log")
                logf = open(logp, "a", encoding="utf-8")
                cmd = arm.command(sweep.base)
                logf.write(f"\n[sweep] {time.strftime('%Y-%m-%d %H:%M:%S')} {shlex.join(cmd)}\n")
                logf.flush()
                env = dict(os.environ)
                if sweep.executor.get("threads"):
                    env.setdefault("OMP_NUM_THREADS", str(int(sweep.executor["threads"])))
                proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                        preexec_fn=_deathsig if sys.platform.startswith("linux") else None)
                record.update({"name": arm.name, "overrides": arm.overrides, "state": "running", "pid": proc.pid,
                               "log": logp, "command": shlex.join(cmd), "attempts": record.get("attempts", 0) + 1})
                _write_json(rec_path, record)
                states[arm.name] = "running"
                running[arm.name] = (arm, proc, logf, time.time(), record)
            for name in list(running):
                arm, proc, logf, t0, record = running[name]
                ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
                if proc.poll() is not None:
                    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)  # this arm's CPU (reaped just now)
                    record["cpu_s"] = record.get("cpu_s", 0.0) + (ru1.ru_utime + ru1.ru_stime) - \
                        (ru0.ru_utime + ru0.ru_stime)
                    finish(arm, proc, logf, t0, record)
                    del running[name]
                    if states[name] == "finished":
                        done_c += arm.compute
            partial = sum(a.compute * min(1.0, _tail_step(os.path.join(a.run_dir, "metrics.jsonl")) / a.steps)
                          for a, *_ in running.values())
            n_done = sum(1 for s in states.values() if s == "finished")
            shown = (int(100.0 * (done_c + partial) / total_c), n_done, len(running), len(failed))
            if shown != last_shown[0] or time.time() - last_shown[1] > 30:
                bar.n = 100.0 * (done_c + partial) / total_c
                bar.set_postfix_str(f"arms done {n_done}/{len(sweep.arms)} running {len(running)} "
                                    f"failed {len(failed)}", refresh=False)
                bar.refresh()
                last_shown[:] = [shown, time.time()]
            if running:
                time.sleep(poll_s)
    finally:
        if running:
            for arm, proc, *_ in running.values():
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)  # the trainer saves a checkpoint at the next step and exits
            for arm, proc, logf, t0, record in list(running.values()):
                try:
                    proc.wait(timeout=300)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                finish(arm, proc, logf, t0, record)
        bar.close()
        for s, h in old.items():
            signal.signal(s, h)
    if stop["sig"] is not None:
        log(f"[sweep] interrupted ({signal.Signals(stop['sig']).name}): rerun the same command to resume")
        return states
    n_done = sum(1 for s in states.values() if s == "finished")
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    log(f"[sweep] wall {time.time() - t_start:.0f}s, CPU of the arms run now {ru.ru_utime + ru.ru_stime - cpu0:.0f}s "
        "(user+sys; on an otherwise idle machine the wall time is about CPU / cores when parallel >= cores)")
    log(f"[sweep] {n_done}/{len(sweep.arms)} arms finished, {len(failed)} failed"
        + (": " + ", ".join(failed) + " (rerun to retry them; logs in each arm's train.log)" if failed else ""))
    return states


# ================================================================================================
# SLURM executor
# ================================================================================================
def slurm_commands(sweep: Sweep) -> List[str]:
    """Write ``<out_dir>/slurm_arms.jsonl`` (line i = the overrides of arm i) and return the sbatch
    line of one array job over the unfinished arms (``tools/slurm_pretrain.sh`` reads line
    ``SLURM_ARRAY_TASK_ID`` of ``XHC_SWEEP_ARMS``)."""
    os.makedirs(sweep.out_dir, exist_ok=True)
    todo = [a for a in sweep.arms if not arm_finished(a)]
    if not todo:
        return []
    arms_file = os.path.join(sweep.out_dir, "slurm_arms.jsonl")
    with open(arms_file + ".tmp", "w", encoding="utf-8") as f:
        for a in todo:
            f.write(json.dumps({"name": a.name, "overrides": a.overrides}) + "\n")
    os.replace(arms_file + ".tmp", arms_file)
    sl = sweep.executor.get("slurm") or {}
    extra = [str(x) for x in sl.get("sbatch_args", [])]
    nodes = int(sl.get("nodes", 1))
    import tools

    script = os.path.join(os.path.dirname(os.path.abspath(tools.__file__)), "slurm_pretrain.sh")
    cmd = (f"XHC_SWEEP_ARMS={shlex.quote(arms_file)} sbatch --array 0-{len(todo) - 1} --nodes {nodes} "
           f"--job-name {shlex.quote('sweep-' + sweep.name)} " + "".join(shlex.quote(x) + " " for x in extra)
           + f"{shlex.quote(script)} {shlex.quote(sweep.base or 'configs/pretrain/default-tiny.yaml')}")
    return [cmd]


# ================================================================================================
# Collect
# ================================================================================================
COLUMNS = ("arm", "variant", "size", "N", "k", "seed", "state", "params_total", "params_activated", "params_hc",
           "flops_per_token", "tokens", "compute", "train_loss", "valid_loss", "wall_s", "tokens_per_s", "reason")


def read_metrics(path: str):
    """(train records by step, eval records by step) of a metrics.jsonl; a step replayed after a
    resume keeps its last occurrence."""
    train: Dict[int, dict] = {}
    evals: Dict[int, dict] = {}
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    r = json.loads(line)
                except ValueError:
                    continue  # a line cut by a crash
                kind = r.get("kind")
                if kind == "train":
                    train[int(r["step"])] = r
                elif kind == "eval":
                    evals[int(r["step"])] = r
                elif r.get("event") == "resume" or (kind == "event" and r.get("event") == "resume"):
                    s = int(r.get("step", 0))  # steps after this are replayed: drop the stale ones
                    for d in (train, evals):
                        for k in [k for k in d if k > s]:
                            del d[k]
    except OSError:
        pass
    return train, evals


def collect_arm(arm: Arm, tail_fraction: float = 0.1) -> dict:
    """One row of the sweep table (see :data:`COLUMNS`)."""
    row = {"arm": arm.name, "variant": arm.variant, "size": arm.size, "N": arm.n, "k": arm.k, "seed": arm.seed,
           "params_total": arm.params_total, "params_activated": arm.params_activated, "params_hc": arm.params_hc,
           "flops_per_token": arm.flops_per_token, "tokens": arm.tokens, "compute": arm.compute,
           "train_loss": None, "valid_loss": None, "wall_s": None, "tokens_per_s": None, "reason": ""}
    status = _read_json(os.path.join(arm.run_dir, "status.json"))
    record = _read_json(os.path.join(arm.run_dir, ARM_STATE)) or {}
    train, evals = read_metrics(os.path.join(arm.run_dir, "metrics.jsonl"))
    if train:
        first = math.floor(arm.steps * (1 - tail_fraction))
        tail = [train[s]["loss"] for s in sorted(train) if s > first and _finite(train[s].get("loss"))]
        if not tail:
            tail = [train[max(train)]["loss"]]
        row["train_loss"] = sum(tail) / len(tail)
        dt = sum(float(r.get("step_time_s", 0.0)) for r in train.values())
        toks = sum(1 for _ in train) * (arm.tokens / arm.steps)
        row["tokens_per_s"] = toks / dt if dt > 0 else None
        times = [r["time"] for r in list(train.values()) + list(evals.values()) if "time" in r]
        row["wall_s"] = record.get("wall_s") or ((max(times) - min(times)) if times else None)
    if evals:
        first = arm.steps * (1 - tail_fraction)
        tail = [evals[s]["loss"] for s in sorted(evals) if s >= first and _finite(evals[s].get("loss"))]
        if not tail and _finite(evals[max(evals)].get("loss")):
            tail = [evals[max(evals)]["loss"]]
        row["valid_loss"] = sum(tail) / len(tail) if tail else None
    last_step = max(train) if train else 0
    if status and status.get("finished"):
        row["state"] = "finished"
    elif record.get("state") == "failed":
        row["state"] = "failed"
        row["reason"] = (f"failed (exit {record.get('returncode')}) at step {last_step}/{arm.steps}: see "
                         f"{record.get('log')}" + (f" [{_last_error_line(record['log'])}]" if record.get("log") else ""))
    elif record.get("state") == "running" and _pid_alive(record.get("pid")):
        row["state"] = "running"
        row["reason"] = f"running: step {last_step}/{arm.steps}"
    elif status or train or record:
        row["state"] = "unfinished"
        row["reason"] = (f"unfinished: step {last_step}/{arm.steps}"
                         + (f" ({status['stopped_early']})" if status and status.get("stopped_early") else "")
                         + (" (runner gone without a status: crashed or killed)" if not status and record else "")
                         + "; rerun `tools.sweep run` to resume")
    else:
        row["state"] = "not started"
        row["reason"] = "not started"
    return row


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def collect(sweep: Sweep) -> List[dict]:
    tail = float(sweep.fit.get("tail_fraction", 0.1))
    return [collect_arm(a, tail) for a in sweep.arms]


def _fmt(v, col: str) -> str:
    if v is None:
        return "-"
    if col in ("params_total", "params_activated", "params_hc", "tokens"):
        return _si(v)
    if col in ("flops_per_token", "compute"):
        return f"{v:.3g}"
    if col in ("train_loss", "valid_loss"):
        return f"{v:.4f}"
    if col == "wall_s":
        return f"{v:.0f}"
    if col == "tokens_per_s":
        return f"{v:.0f}"
    return str(v)


def _si(x: float) -> str:
    for unit, div in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.3g}{unit}"
    return f"{x:g}"


def format_table(rows: List[dict], columns: Sequence[str], markdown: bool = False) -> str:
    cells = [[_fmt(r.get(c), c) for c in columns] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        return "\n".join(lines + ["| " + " | ".join(c) + " |" for c in cells])
    widths = [max(len(c), *(len(r[i]) for r in cells)) if cells else len(c) for i, c in enumerate(columns)]
    out = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    out += ["  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in cells]
    return "\n".join(out)


def write_table(sweep: Sweep, rows: List[dict]) -> Dict[str, str]:
    """``arms.csv`` and ``arms.json`` under ``<out_dir>/summary``."""
    os.makedirs(sweep.summary_dir, exist_ok=True)
    paths = {"csv": os.path.join(sweep.summary_dir, "arms.csv"), "json": os.path.join(sweep.summary_dir, "arms.json")}
    with open(paths["csv"] + ".tmp", "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(COLUMNS))
        w.writeheader()
        for r in rows:
            w.writerow({c: r.get(c) for c in COLUMNS})
    os.replace(paths["csv"] + ".tmp", paths["csv"])
    _write_json(paths["json"], {"sweep": sweep.name, "flops_convention": sweep.flops_convention, "arms": rows})
    return paths


# ================================================================================================
# Fit
# ================================================================================================
def fit_sweep(sweep: Sweep, rows: List[dict], log=print) -> dict:
    """Fit L(C) per variant, L(N) at a fixed compute, L(P, D) when sizes and budgets both vary, and the
    compute multipliers against the baselines; write ``fit.json``, ``fit.md`` and the plots."""
    from xhc.scaling_fit import (FitError, fit_chinchilla, fit_power_laws, loss_at_interval,
                                 multiplier_interval)

    f = sweep.fit
    which = f.get("loss", "valid")
    if which not in ("valid", "train"):
        raise SweepError(f"sweep file {sweep.path}: fit.loss must be valid or train, got {which!r}")
    col = f"{which}_loss"
    used = [r for r in rows if r["state"] == "finished" and _finite(r.get(col))]
    excluded = [r for r in rows if r not in used]
    for r in excluded:
        log(f"[fit] excluded {r['arm']}: {r['reason'] or f'no {col}'}")
    by_var: Dict[str, tuple] = {}
    for r in used:
        c, l = by_var.setdefault(r["variant"], ([], []))
        c.append(r["compute"])
        l.append(r[col])
    if not by_var:
        raise SweepError("no finished arms with a loss to fit: run the sweep first (`tools.sweep run`)")
    E = f.get("E", "free")
    boot = int(f.get("bootstrap", 200))
    level = float(f.get("level", 0.95))
    fits = fit_power_laws(by_var, E=E, bootstrap=boot, seed=int(f.get("seed", 0)), level=level)
    meta = {r["variant"]: r for r in used}
    result: Dict[str, Any] = {"sweep": sweep.name, "loss": col, "E_mode": fits[next(iter(fits))].E_mode,
                              "flops_convention": sweep.flops_convention, "level": level, "bootstrap": boot,
                              "excluded": {r["arm"]: r["reason"] or f"no {col}" for r in excluded},
                              "laws": {v: fits[v].as_dict() for v in fits}}
    baselines = [b for b in f.get("baselines", ["vanilla"]) if b in fits]
    c_ref = f.get("compute")
    target = f.get("target_loss")
    mults = []
    for b in baselines:
        cb = float(c_ref) if c_ref is not None else max(by_var[b][0])
        for v in fits:
            if v == b:
                continue
            kw = {"loss": float(target)} if target is not None else {"compute": cb}
            m, lo, hi = multiplier_interval(fits[b], fits[v], **kw)
            mults.append({"baseline": b, "variant": v, "at": kw, "multiplier": m, "interval": [lo, hi]})
    result["multipliers"] = mults
    # L(N) at a fixed compute
    c_n = float(c_ref) if c_ref is not None else (max(by_var[baselines[0]][0]) if baselines else
                                                   math.exp(sum(math.log(r["compute"]) for r in used) / len(used)))
    ln = []
    for v, fit in fits.items():
        L, lo, hi = loss_at_interval(fit, c_n)
        ln.append({"variant": v, "family": _family(sweep, v), "N": meta[v]["N"], "k": meta[v]["k"],
                   "loss": L, "interval": [lo, hi]})
    result["loss_vs_n"] = {"compute": c_n, "points": ln}
    # Chinchilla L(P, D) per variant where sizes and budgets both vary
    ch = {}
    for v in fits:
        rv = [r for r in used if r["variant"] == v]
        if len({r["size"] for r in rv}) > 1 and len({r["tokens"] for r in rv}) > 1:
            try:
                cf = fit_chinchilla([r["params_activated"] for r in rv], [r["tokens"] for r in rv],
                                    [r[col] for r in rv], bootstrap=boot, seed=int(f.get("seed", 0)), level=level)
                ch[v] = cf.as_dict()
            except FitError as e:
                ch[v] = {"error": str(e)}
    if ch:
        result["chinchilla"] = ch
    os.makedirs(sweep.summary_dir, exist_ok=True)
    _write_json(os.path.join(sweep.summary_dir, "fit.json"), result)
    md = fit_markdown(result)
    with open(os.path.join(sweep.summary_dir, "fit.md"), "w", encoding="utf-8") as fh:
        fh.write(md + "\n")
    result["plots"] = plot_sweep(sweep, used, fits, result)
    _write_json(os.path.join(sweep.summary_dir, "fit.json"), result)
    return result


def _family(sweep: Sweep, variant: str) -> str:
    for a in sweep.arms:
        if a.variant == variant:
            return a.family
    return variant


def _iv(x, lo, hi, fmt="{:.4g}") -> str:
    if not (_finite(lo) and _finite(hi)):
        return fmt.format(x)
    return f"{fmt.format(x)} [{fmt.format(lo)}, {fmt.format(hi)}]"


def fit_markdown(result: dict) -> str:
    lvl = int(round(100 * result["level"]))
    out = [f"L(C) = E + A·C^(−α) on {result['loss']}, E {result['E_mode']}, Huber δ=1e-3 on log residuals, "
           f"{result['bootstrap']} bootstrap replicates ({lvl}% intervals), FLOPs convention "
           f"`{result['flops_convention']}`", "",
           "| variant | E | A | α | runs |", "|---|---|---|---|---|"]
    for v, d in result["laws"].items():
        out.append(f"| {v} | {_iv(d['E'], *d['E_interval'])} | {_iv(d['A'], *d['A_interval'])} | "
                   f"{_iv(d['alpha'], *d['alpha_interval'])} | {d['n_points']} |")
    if result["multipliers"]:
        out += ["", "Compute multipliers (compute the baseline needs / compute the variant needs for the same loss):",
                "", "| baseline | variant | at | multiplier |", "|---|---|---|---|"]
        for m in result["multipliers"]:
            at = ", ".join(f"{k}={v:.3g}" for k, v in m["at"].items())
            out.append(f"| {m['baseline']} | {m['variant']} | {at} | {_iv(m['multiplier'], *m['interval'], '{:.3f}')} |")
    ln = result["loss_vs_n"]
    out += ["", f"L(N) at fixed compute C = {ln['compute']:.3g} (fitted):", "", "| variant | family | N | k | loss |",
            "|---|---|---|---|---|"]
    for p in ln["points"]:
        out.append(f"| {p['variant']} | {p['family']} | {p['N']} | {p['k'] if p['k'] is not None else '-'} | "
                   f"{_iv(p['loss'], *p['interval'], '{:.4f}')} |")
    if result.get("chinchilla"):
        out += ["", "L(P, D) = E + A/P^α + B/D^β (P activated parameters, D tokens):", "",
                "| variant | E | A | α | B | β |", "|---|---|---|---|---|---|"]
        for v, d in result["chinchilla"].items():
            if "error" in d:
                out.append(f"| {v} | {d['error']} | | | | |")
            else:
                out.append(f"| {v} | " + " | ".join(_iv(d[p], *d[f'{p}_interval']) for p in
                                                   ("E", "A", "alpha", "B", "beta")) + " |")
    if result["excluded"]:
        out += ["", "Excluded arms: " + "; ".join(f"{k}: {v}" for k, v in result["excluded"].items())]
    return "\n".join(out)


def plot_sweep(sweep: Sweep, used: List[dict], fits, result: dict) -> Dict[str, str]:
    """``frontier.png`` (loss vs compute, fitted frontiers with bootstrap bands), ``loss_vs_n.png``
    and ``multipliers.png`` under ``<out_dir>/summary``; {} without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[fit] matplotlib is not installed: no plots (pip install 'xhc[plot]')")
        return {}
    import numpy as np

    d = sweep.summary_dir
    paths = {}
    col = result["loss"]
    cs = [r["compute"] for r in used]
    grid = np.geomspace(min(cs) / 1.3, max(cs) * 1.3, 100)
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    for v, fit in fits.items():
        pts = [(r["compute"], r[col]) for r in used if r["variant"] == v]
        (line,) = ax.plot(grid, [fit.loss(c) for c in grid], "-", lw=1.2,
                          label=f"{v}: A={fit.A:.3g}, α={fit.alpha:.3f}, E={fit.E:.3f}")
        ax.plot(*zip(*pts), "o", color=line.get_color(), ms=4)
        if fit.replicates:
            curves = np.array([[r.loss(c) for c in grid] for r in fit.replicates])
            q = 100 * (1 - fit.level) / 2
            lo, hi = np.nanpercentile(curves, [q, 100 - q], axis=0)
            ax.fill_between(grid, lo, hi, color=line.get_color(), alpha=0.15, lw=0)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(f"training compute C (FLOPs, {sweep.flops_convention})")
    ax.set_ylabel(col.replace("_", " "))
    ax.set_title(f"{sweep.name}: L(C) = E + A·C^(−α), {int(100 * result['level'])}% bootstrap bands")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths["frontier"] = os.path.join(d, "frontier.png")
    fig.savefig(paths["frontier"])
    plt.close(fig)

    ln = result["loss_vs_n"]
    fig, ax = plt.subplots(figsize=(6, 4), dpi=110)
    fams: Dict[str, list] = {}
    for p in ln["points"]:
        fams.setdefault(p["family"], []).append(p)
    for fam, pts in fams.items():
        pts.sort(key=lambda p: p["N"])
        xs, ys = [p["N"] for p in pts], [p["loss"] for p in pts]
        err = np.array([[max(0.0, p["loss"] - p["interval"][0]) if _finite(p["interval"][0]) else 0.0 for p in pts],
                        [max(0.0, p["interval"][1] - p["loss"]) if _finite(p["interval"][1]) else 0.0 for p in pts]])
        if fam == "vanilla":
            ax.axhline(ys[0], ls="--", color="gray", lw=1, label="vanilla (N=1)")
            continue
        ax.errorbar(xs, ys, yerr=err, fmt="o-", capsize=3, label=fam)
        for x, y in zip(xs, ys):
            ax.annotate(f"N={x}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("streams N")
    ax.set_ylabel(f"fitted {col.replace('_', ' ')} at C = {ln['compute']:.3g}")
    ax.set_title("loss vs N at fixed compute")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    paths["loss_vs_n"] = os.path.join(d, "loss_vs_n.png")
    fig.savefig(paths["loss_vs_n"])
    plt.close(fig)

    if result["multipliers"]:
        ms = result["multipliers"]
        fig, ax = plt.subplots(figsize=(7, 0.35 * len(ms) + 1.5), dpi=110)
        labels = [f"{m['baseline']} / {m['variant']}" for m in ms]
        vals = [m["multiplier"] for m in ms]
        lo = [max(0.0, m["multiplier"] - m["interval"][0]) if _finite(m["interval"][0]) else 0.0 for m in ms]
        hi = [max(0.0, m["interval"][1] - m["multiplier"]) if _finite(m["interval"][1]) else 0.0 for m in ms]
        ax.barh(range(len(ms)), vals, xerr=[lo, hi], capsize=3, color="C0", alpha=0.7)
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set_yticks(range(len(ms)))
        ax.set_yticklabels(labels, fontsize=7)
        ax.set_xscale("log")
        ax.set_xlabel("compute multiplier (baseline compute / variant compute at equal loss)")
        ax.set_title("compute multipliers with bootstrap intervals")
        fig.tight_layout()
        paths["multipliers"] = os.path.join(d, "multipliers.png")
        fig.savefig(paths["multipliers"])
        plt.close(fig)
    return paths
